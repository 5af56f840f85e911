//! Packets from a hostile or confused peer on a raw Ethernet link: the Myrinet-style protocol
//! never panics, refuses what cannot be, and never holds more than it may.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::mx::{MxConfig, MxLink};

fuzz_target!(|data: &[u8]| {
    let mut l = MxLink::new(MxConfig::new(1500, 7));
    let _ = l.send(0, vec![1u8; 100_000]);
    let _ = l.send(0, vec![2u8; 10]);
    let mut now = 0;
    // Packets of up to 1500 bytes, one after the other, each prefixed by its length byte.
    let mut rest = data;
    while let Some((&n, tail)) = rest.split_first() {
        let n = (n as usize * 6).min(tail.len());
        let _ = l.handle_packet(now, &tail[..n]);
        rest = &tail[n..];
        now += 3;
        l.handle_timeout(now);
        while l.poll_packet(now).is_some() {}
        while l.poll_message().is_some() {}
    }
});
