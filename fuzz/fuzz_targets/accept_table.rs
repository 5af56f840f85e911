//! A process's table of announced connections (`substrate::accepts`), which the process
//! itself can scribble on: whatever its words hold, taking an entry never panics and hands
//! out only an entry that names the two addresses asked for; the agent's writes and
//! clears over such a table never panic either.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use substrate::accepts::{self, Entry, TABLE_BYTES};

fuzz_target!(|data: &[u8]| {
    if data.len() < 16 {
        return;
    }
    let t: Vec<AtomicU64> = (0..TABLE_BYTES / 8).map(|_| AtomicU64::new(0)).collect();
    assert!(accepts::init(&t[..]));
    // The input over the slots (the header stays valid, else nothing is read at all).
    for (i, c) in data[16..].chunks(8).enumerate() {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        if let Some(x) = t.get(32 + i) {
            x.store(u64::from_le_bytes(w), Relaxed);
        }
    }
    let port = u16::from_le_bytes([data[0], data[1]]);
    let src = SocketAddr::from(([10, data[2], data[3], 2], port));
    let dst: SocketAddr =
        if data[4] & 1 == 0 { "10.0.0.1:80".parse().unwrap() } else { "[fd00::1]:443".parse().unwrap() };
    let now = u64::from(data[5]) << 32;
    if let Some(e) = accepts::claim(&t[..], src, dst, now) {
        assert_eq!(
            (e.src.ip(), e.src.port(), e.dst.ip(), e.dst.port()),
            (src.ip(), src.port(), dst.ip(), dst.port())
        );
        assert!(e.expires_ns > now && e.agents.len() <= accepts::MAX_AGENTS);
    }
    let e =
        Entry { src, dst, gid: 7, secret: 8, window: 9, alias: None, agents: vec![dst], expires_ns: now + 1 };
    if accepts::put(&t[..], &e, now) {
        // (A scribbled table may hold the same two addresses twice: either may come first.)
        assert!(accepts::claim(&t[..], src, dst, now).is_some());
    }
    accepts::clear(&t[..], src, dst, 7);
});
