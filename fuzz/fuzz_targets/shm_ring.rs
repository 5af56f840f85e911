//! A ring of shared memory is written by another process, which may be confused or hostile:
//! whatever it writes into the header (positions, flags, where bells go) between our calls,
//! no call panics, reads and writes stay inside the ring, and a position that is impossible
//! is an error.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::shmring::{Ring, HEADER};

const CAP: usize = 256;

/// The ring's memory, 64-byte aligned.
#[repr(C, align(64))]
struct Mem([u8; HEADER + CAP]);

fuzz_target!(|data: &[u8]| {
    let mut mem = Box::new(Mem([0; HEADER + CAP]));
    let base = mem.0.as_mut_ptr();
    // SAFETY: `mem` is aligned, HEADER + CAP bytes, and outlives `ring` (dropped first).
    let ring = match unsafe { Ring::init(base, HEADER + CAP) } {
        Ok(r) => r,
        Err(_) => return,
    };
    let mut buf = [0u8; CAP + 16];
    let mut it = data.chunks(3);
    while let Some(op) = it.next() {
        let (kind, a, b) = (op[0], *op.get(1).unwrap_or(&0), *op.get(2).unwrap_or(&0));
        match kind % 13 {
            0 => {
                let n = (a as usize) % buf.len();
                if let Ok(got) = ring.read(&mut buf[..n], b & 1 == 1) {
                    assert!(got <= n);
                }
            }
            1 => {
                let n = (a as usize) % buf.len();
                if let Ok(put) = ring.write(&buf[..n]) {
                    assert!(put <= n);
                }
            }
            2 => {
                if let Ok(r) = ring.readable() {
                    assert!(r <= CAP);
                }
                if let Ok(w) = ring.writable() {
                    assert!(w <= CAP);
                }
            }
            3 => {
                let _ = ring.after_write();
                let _ = ring.after_read();
            }
            4 => {
                let _ = ring.before_sleep();
                let _ = ring.at_end();
            }
            5 => {
                let _ = ring.ensure_bell();
                ring.bell_taken();
                let _ = ring.bell_to();
            }
            6 => ring.direct_bells(u64::from(a) << 8 | u64::from(b)),
            7 if a & 1 == 1 => ring.reset(),
            7 => ring.close(),
            8 => {
                let _ = ring.take_reset();
            }
            _ => {
                // The other process writes a byte of the header (positions and flags
                // included), as it may at any moment.
                let at = (usize::from(a) << 8 | usize::from(b)) % HEADER;
                // SAFETY: inside the header of our own allocation; the ring reads it only
                // through atomics, and nothing else runs meanwhile.
                unsafe { base.add(at).write_volatile(kind) };
            }
        }
    }
    drop(ring);
    drop(mem);
});
