//! Parsers of the `/proc` text the layer reads about its own process, and the agent about the
//! node's neighbours (outside input: the kernel writes it, but its format is only a
//! convention, so nothing here trusts it).

/// What `/proc/<pid>/status` says about the process's sandbox and threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status {
    /// `Seccomp:` 0 (none), 1 (strict), 2 (filter).
    pub seccomp: Option<u8>,
    /// `Seccomp_filters:` how many filters are stacked on the thread that read the file.
    pub seccomp_filters: Option<u32>,
    /// `NoNewPrivs:` set.
    pub no_new_privs: Option<bool>,
    /// `Threads:` threads of the process (a main thread that ended while others run is still
    /// counted, as a zombie).
    pub threads: Option<u32>,
}

/// Reads the fields of [`Status`] out of the text of a status file. Unknown lines, lines
/// without a value and values that do not parse are skipped.
pub fn parse_status(text: &[u8]) -> Status {
    let mut s = Status::default();
    for line in text.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let (key, rest) = (&line[..colon], &line[colon + 1..]);
        let value = std::str::from_utf8(rest).ok().map(str::trim).unwrap_or("");
        match key {
            b"Seccomp" => s.seccomp = value.parse().ok().filter(|&v: &u8| v <= 2),
            b"Seccomp_filters" => s.seccomp_filters = value.parse().ok(),
            b"NoNewPrivs" => s.no_new_privs = value.parse::<u8>().ok().map(|v| v != 0),
            b"Threads" => s.threads = value.parse().ok(),
            _ => {}
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_dev_counters() {
        let t = b"Inter-|   Receive                                                |  Transmit\n face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    lo:     100       2    0    0    0     0          0         0      100       2    0    0    0     0       0          0\n  eth0: 98765     321    0    0    0     0          0         0    54321     123    0    0    0     0       0          0\nbroken: 1 2 3\n";
        let v = parse_proc_net_dev(t);
        assert_eq!(
            v,
            vec![
                IfPackets { device: "lo".into(), rx: 2, tx: 2 },
                IfPackets { device: "eth0".into(), rx: 321, tx: 123 }
            ]
        );
        assert!(parse_proc_net_dev(b"").is_empty());
        assert!(parse_proc_net_dev(b"x: a b c d e f g h i j k l m n o p\n").is_empty());
    }

    #[test]
    fn reads_the_fields_of_a_real_status_file() {
        let text = b"Name:\tsshd\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t3224\nThreads:\t2\n\
NoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t1\nSpeculation_Store_Bypass:\tthread vulnerable\n";
        let s = parse_status(text);
        assert_eq!(s.seccomp, Some(2));
        assert_eq!(s.seccomp_filters, Some(1));
        assert_eq!(s.no_new_privs, Some(true));
        assert_eq!(s.threads, Some(2));
    }

    #[test]
    fn skips_what_does_not_parse() {
        let s = parse_status(b"Seccomp:\t7\nThreads:\tmany\nNoNewPrivs\n\xff\xfe:\x00\nSeccomp_filters:");
        assert_eq!(s, Status::default());
        assert_eq!(parse_status(b"Seccomp: 0").seccomp, Some(0));
    }
}

/// One target of an epoll instance, as `/proc/<pid>/fdinfo/<epfd>` lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpollTarget {
    /// The registered descriptor (`tfd:`).
    pub fd: i32,
    /// Its events (`events:`, hexadecimal).
    pub events: u32,
    /// The program's data (`data:`, hexadecimal).
    pub data: u64,
    /// The inode of the file it was registered as (`ino:`, hexadecimal; missing in old
    /// kernels).
    pub ino: Option<u64>,
}

/// The targets listed in the fdinfo text of an epoll instance (lines such as
/// `tfd:        5 events:       19 data:                5  pos:0 ino:2f8a sdev:8`). Lines
/// that are not targets, or whose descriptor, events or data do not parse, are skipped.
pub fn parse_epoll_fdinfo(text: &str) -> Vec<EpollTarget> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("tfd:")) {
        let mut it = line.split_whitespace();
        let mut field = |name: &str| -> Option<String> {
            while let Some(k) = it.next() {
                if k == name {
                    return it.next().map(str::to_string);
                }
                if let Some(v) = k.strip_prefix(name) {
                    return Some(v.to_string());
                }
            }
            None
        };
        let fd = field("tfd:").and_then(|v| v.parse::<i32>().ok());
        let events = field("events:").and_then(|v| u32::from_str_radix(&v, 16).ok());
        let data = field("data:").and_then(|v| u64::from_str_radix(&v, 16).ok());
        let ino = field("ino:").and_then(|v| u64::from_str_radix(&v, 16).ok());
        if let (Some(fd), Some(events), Some(data)) = (fd, events, data) {
            out.push(EpollTarget { fd, events, data, ino });
        }
    }
    out
}

#[cfg(test)]
mod fdinfo_tests {
    use super::*;

    #[test]
    fn targets_of_an_epoll_instance() {
        let text = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\n\
                    tfd:        5 events:       19 data:                5  pos:0 ino:2f8a sdev:8\n\
                    tfd:       12 events: 80000019 data: ffffffffffffffff  pos:0 ino:2f9b sdev:8\n";
        let t = parse_epoll_fdinfo(text);
        assert_eq!(
            t,
            vec![
                EpollTarget { fd: 5, events: 0x19, data: 5, ino: Some(0x2f8a) },
                EpollTarget { fd: 12, events: 0x8000_0019, data: u64::MAX, ino: Some(0x2f9b) },
            ]
        );
    }

    #[test]
    fn old_kernels_and_garbage() {
        assert_eq!(
            parse_epoll_fdinfo("tfd: 7 events: 1 data: 0\n"),
            vec![EpollTarget { fd: 7, events: 1, data: 0, ino: None }]
        );
        assert!(parse_epoll_fdinfo("tfd: x events: 1 data: 0\ntfd: 3 events: zz data: 0\ntfd:\n").is_empty());
    }
}

/// A complete entry of the kernel's IPv4 neighbour table, as `/proc/net/arp` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArpEntry {
    /// The neighbour's address.
    pub ip: std::net::Ipv4Addr,
    /// Its hardware (MAC) address.
    pub mac: [u8; 6],
    /// The interface it was resolved on.
    pub device: String,
}

/// `ATF_COM`: the entry is resolved.
const ATF_COM: u32 = 0x2;

/// The complete entries of `/proc/net/arp` text (a header line, then lines such as
/// `10.81.0.2  0x1  0x2  aa:bb:cc:dd:ee:ff  *  eth0`). Lines whose address, flags, hardware
/// address (six two-digit hexadecimal octets, not all zero) or device do not parse, and
/// entries not resolved (flags without 0x2), are skipped.
pub fn parse_proc_arp(text: &[u8]) -> Vec<ArpEntry> {
    let mut out = Vec::new();
    for line in text.split(|&b| b == b'\n') {
        let Ok(line) = std::str::from_utf8(line) else { continue };
        let f: Vec<&str> = line.split_whitespace().collect();
        let [ip, _hw_type, flags, mac, _mask, device] = f[..] else { continue };
        let Ok(ip) = ip.parse::<std::net::Ipv4Addr>() else { continue };
        let Some(flags) = flags.strip_prefix("0x").and_then(|v| u32::from_str_radix(v, 16).ok()) else {
            continue;
        };
        if flags & ATF_COM == 0 {
            continue;
        }
        let Some(mac) = parse_mac(mac) else { continue };
        if device.is_empty() || device.len() > 15 || device.contains('/') {
            continue;
        }
        out.push(ArpEntry { ip, mac, device: device.to_string() });
    }
    out
}

/// Packets an interface received and sent, from `/proc/net/dev`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfPackets {
    /// Interface name.
    pub device: String,
    /// Packets received.
    pub rx: u64,
    /// Packets sent.
    pub tx: u64,
}

/// The interfaces of `/proc/net/dev` text (two header lines, then lines such as
/// `  eth0: 1234 5 0 0 0 0 0 0 4321 6 0 0 0 0 0 0`: the name, then 8 receive and 8
/// transmit counters). Lines that do not parse are skipped.
pub fn parse_proc_net_dev(text: &[u8]) -> Vec<IfPackets> {
    let mut out = Vec::new();
    for line in text.split(|&b| b == b'\n') {
        let Ok(line) = std::str::from_utf8(line) else { continue };
        let Some((name, rest)) = line.split_once(':') else { continue };
        let device = name.trim();
        if device.is_empty() || device.len() > 15 || device.contains(['/', ' ', '|']) {
            continue;
        }
        let f: Vec<u64> = rest.split_whitespace().map_while(|v| v.parse().ok()).collect();
        if f.len() < 16 {
            continue;
        }
        out.push(IfPackets { device: device.to_string(), rx: f[1], tx: f[9] });
    }
    out
}

/// Six colon-separated two-digit hexadecimal octets, not all zero.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in mac.iter_mut() {
        let p = parts.next()?;
        if p.len() != 2 || !p.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    if parts.next().is_some() || mac == [0; 6] {
        return None;
    }
    Some(mac)
}

/// A MAC address as `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    let [a, b, c, d, e, f] = mac;
    format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{f:02x}")
}

#[cfg(test)]
mod arp_tests {
    use super::*;

    const REAL: &str = "IP address       HW type     Flags       HW address            Mask     Device\n\
10.81.0.2        0x1         0x2         6a:0e:3f:12:9b:c4     *        vmimac1a\n\
10.81.1.2        0x1         0x0         00:00:00:00:00:00     *        vmimac1b\n\
192.168.1.1      0x1         0x6         AA:BB:CC:DD:EE:01     *        eth0\n";

    #[test]
    fn complete_entries_of_a_real_table() {
        let t = parse_proc_arp(REAL.as_bytes());
        assert_eq!(
            t,
            vec![
                ArpEntry {
                    ip: "10.81.0.2".parse().unwrap(),
                    mac: [0x6a, 0x0e, 0x3f, 0x12, 0x9b, 0xc4],
                    device: "vmimac1a".into()
                },
                ArpEntry {
                    ip: "192.168.1.1".parse().unwrap(),
                    mac: [0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0x01],
                    device: "eth0".into()
                },
            ]
        );
        assert_eq!(format_mac(&t[0].mac), "6a:0e:3f:12:9b:c4");
    }

    #[test]
    fn malformed_lines_are_skipped() {
        let bad = "10.81.0.2 0x1 0x2 6a:0e:3f:12:9b * eth0\n\
                   10.81.0.2 0x1 0x2 6a:0e:3f:12:9b:c4:01 * eth0\n\
                   10.81.0.2 0x1 0x2 6a:0e:3f:12:9b:g4 * eth0\n\
                   10.81.0.2 0x1 0x2 6a:0e:3f:12:9b:+4 * eth0\n\
                   10.81.0.2 0x1 0x2 6a:e:3f:12:9b:c44 * eth0\n\
                   10.81.0.256 0x1 0x2 6a:0e:3f:12:9b:c4 * eth0\n\
                   ::1 0x1 0x2 6a:0e:3f:12:9b:c4 * eth0\n\
                   10.81.0.2 0x1 2 6a:0e:3f:12:9b:c4 * eth0\n\
                   10.81.0.2 0x1 0xzz 6a:0e:3f:12:9b:c4 * eth0\n\
                   10.81.0.2 0x1 0x2 6a:0e:3f:12:9b:c4 *\n\
                   10.81.0.2 0x1 0x2 6a:0e:3f:12:9b:c4 * eth0 extra\n\
                   10.81.0.2 0x1 0x2 6a:0e:3f:12:9b:c4 * a/b\n\
                   10.81.0.2 0x1 0x2 6a:0e:3f:12:9b:c4 * averyveryverylongname\n\
                   \n\u{0}\u{7f}";
        assert!(parse_proc_arp(bad.as_bytes()).is_empty());
        assert!(parse_proc_arp(b"\xff\xfe 0x1 0x2 6a:0e:3f:12:9b:c4 * eth0").is_empty());
        assert!(parse_proc_arp(b"").is_empty());
        // A good line among bad ones, with tabs and a missing final newline.
        let t = parse_proc_arp(b"garbage\n\xff\n10.0.0.1\t0x1\t0x2\t02:00:00:00:00:01\t*\teth1");
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].mac, [2, 0, 0, 0, 0, 1]);
        assert_eq!(t[0].device, "eth1");
    }
}
