//! The layer reads `/proc/self/fdinfo/<epfd>` (text whose format is only a convention) to
//! move the program's epoll registrations to a rebuilt link: parsing any text never panics,
//! and every target it reports came from a `tfd:` line.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::procfs::parse_epoll_fdinfo;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let targets = parse_epoll_fdinfo(text);
    assert!(targets.len() <= text.lines().filter(|l| l.starts_with("tfd:")).count());
});
