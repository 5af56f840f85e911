//! The agent reads the kernel's neighbour table (`/proc/net/arp`, text whose format is only a
//! convention): parsing any bytes never panics, and every entry it returns names a
//! well-formed IPv4 address and a 6-byte MAC address on a plausible device. The same for its
//! interface counters (`/proc/net/dev`), read to tell an idle node from a busy one.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::procfs::{format_mac, parse_mac, parse_proc_arp, parse_proc_net_dev};

fuzz_target!(|data: &[u8]| {
    for e in parse_proc_arp(data) {
        let ip = e.ip.to_string();
        assert_eq!(ip.parse::<std::net::Ipv4Addr>().ok(), Some(e.ip));
        assert_ne!(e.mac, [0u8; 6]);
        let mac = format_mac(&e.mac);
        assert_eq!(mac.len(), 17);
        assert_eq!(parse_mac(&mac), Some(e.mac));
        assert!(!e.device.is_empty() && e.device.len() <= 15 && !e.device.contains('/'));
        assert!(!e.device.chars().any(char::is_whitespace));
    }
    for d in parse_proc_net_dev(data) {
        assert!(!d.device.is_empty() && d.device.len() <= 15);
        assert!(!d.device.contains(['/', ' ', '|']));
    }
});
