//! The layer reads `/proc/self/status` (text whose format is only a convention): parsing any
//! bytes never panics, and what it reports is in range.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::procfs::parse_status;

fuzz_target!(|data: &[u8]| {
    let s = parse_status(data);
    assert!(s.seccomp.is_none_or(|m| m <= 2));
});
