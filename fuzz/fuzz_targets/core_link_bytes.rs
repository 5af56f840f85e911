//! A hostile peer's bytes on a link of the connection core: never a panic; a violation
//! closes the connection.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::connection::{Config, Connection, LinkId};

fuzz_target!(|data: &[u8]| {
    let cfg =
        Config { window: 1 << 16, peer_window: 1 << 16, max_frame: 4096, grace_ms: 1000, ack_delay_ms: 5 };
    let mut c = Connection::new(cfg, 0);
    let _ = c.handle_link_up(0, LinkId(0), None);
    let _ = c.send(&[1u8; 5000]);
    while c.poll_transmit(0, LinkId(0), 1 << 16).is_some() {}
    for chunk in data.chunks(97) {
        if c.handle_link_bytes(1, LinkId(0), chunk).is_err() {
            break;
        }
        let mut buf = [0u8; 512];
        let _ = c.recv(&mut buf);
    }
    let _ = c.state();
});
