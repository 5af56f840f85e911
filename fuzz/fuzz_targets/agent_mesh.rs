//! Any bytes where agents take input from the network or a file: a heartbeat datagram, the
//! first message of an agent channel, a cluster key file. Nothing panics, and nothing opens
//! without the key (a fuzzer cannot forge a Poly1305 tag).
#![no_main]
use agent::mesh::ClusterKey;
use libfuzzer_sys::fuzz_target;
use std::net::{IpAddr, Ipv4Addr};

fuzz_target!(|data: &[u8]| {
    let key = ClusterKey::from_bytes(&[7; 32]);
    let (a, b) = (IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
    assert!(key.open_probe(data, a, b).is_none());
    assert!(key.hello(data).is_err());
    let _ = ClusterKey::parse(data);
});
