//! The layer reads the seccomp programs a program installs (any bytes it passes): checking
//! one never panics, a checked program always ends with an answer, and a program that
//! passes the checks reads back the same.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::seccomp::{Filter, SeccompData, Verdict};

fuzz_target!(|data: &[u8]| {
    if data.len() < 64 {
        return;
    }
    let (input, prog) = data.split_at(64);
    let word = |i: usize| u64::from_le_bytes(input[i * 8..i * 8 + 8].try_into().unwrap());
    let d = SeccompData {
        nr: word(0) as i32,
        arch: (word(0) >> 32) as u32,
        instruction_pointer: word(1),
        args: [word(2), word(3), word(4), word(5), word(6), word(7)],
    };
    if let Ok(f) = Filter::parse(prog) {
        let _ = Verdict::of(f.run(&d));
        assert_eq!(Filter::parse(&f.to_bytes()).as_ref(), Ok(&f));
    }
});
