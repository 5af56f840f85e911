//! Taps on a connection: devices that watch what the program sends and receives without
//! changing a byte, on this end only (nothing is agreed with the peer's layer).
//!
//! * `profile` (`vmictl device load profile`): per direction, a histogram of the sizes of
//!   the program's calls (powers of two), one of the time between them, and bytes per second
//!   over the last ten minutes; read with `vmictl profile GID`, which asks the agent, which
//!   asks this layer through its event channel ([`profile_json`]).
//! * capture (`vmictl capture GID -w FILE`): the traffic as the program sees it, written to
//!   the file `vmictl` opened and passed down (the program never opens a path) as pcapng,
//!   with Ethernet, IP and TCP headers made up for the program's own addresses and its
//!   stream's offsets, so that tshark or Wireshark read it as an ordinary TCP conversation
//!   (a handshake first).
//!
//! A connection without taps pays one relaxed load per call.

use crate::sys;
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};

/// The program's sends.
pub const SEND: usize = 0;
/// The program's receives.
pub const RECV: usize = 1;
/// Buckets of the histograms: bucket k counts values in [2^k, 2^(k+1)) (bucket 0 also 0).
const BUCKETS: usize = 40;
/// Seconds of bytes per second kept.
const SECONDS: usize = 600;

/// The taps of one connection.
#[derive(Default)]
pub struct Taps {
    /// The profile, while the device is loaded.
    pub profile: Option<Box<Profile>>,
    /// The capture in progress.
    pub capture: Option<Capture>,
}

impl Taps {
    /// True when nothing is on.
    pub fn is_empty(&self) -> bool {
        self.profile.is_none() && self.capture.is_none()
    }

    /// The program moved `data` in direction `dir` ([`SEND`] or [`RECV`]).
    pub fn record(&mut self, dir: usize, data: &[u8]) {
        if let Some(p) = &mut self.profile {
            p.record(dir, data.len(), sys::now_us());
        }
        if let Some(c) = &mut self.capture {
            if !c.record(dir, data) {
                self.capture = None;
            }
        }
    }
}

/// One direction's figures.
struct Dir {
    calls: u64,
    bytes: u64,
    sizes: [u64; BUCKETS],
    gaps_us: [u64; BUCKETS],
    last_us: u64,
    /// (second since the profile began, bytes), oldest first.
    per_second: VecDeque<(u64, u64)>,
}

impl Default for Dir {
    fn default() -> Self {
        Dir {
            calls: 0,
            bytes: 0,
            sizes: [0; BUCKETS],
            gaps_us: [0; BUCKETS],
            last_us: 0,
            per_second: VecDeque::new(),
        }
    }
}

fn bucket(v: u64) -> usize {
    ((64 - v.leading_zeros()) as usize).saturating_sub(1).min(BUCKETS - 1)
}

/// The `profile` device's figures.
pub struct Profile {
    since_unix_ms: u64,
    since_us: u64,
    dirs: [Dir; 2],
}

impl Default for Profile {
    fn default() -> Self {
        Profile { since_unix_ms: sys::unix_ms(), since_us: sys::now_us(), dirs: Default::default() }
    }
}

impl Profile {
    /// One call of `n` bytes at `now_us` (monotonic).
    pub fn record(&mut self, dir: usize, n: usize, now_us: u64) {
        let d = &mut self.dirs[dir & 1];
        d.calls += 1;
        d.bytes += n as u64;
        d.sizes[bucket(n as u64)] += 1;
        if d.last_us != 0 {
            d.gaps_us[bucket(now_us.saturating_sub(d.last_us))] += 1;
        }
        d.last_us = now_us;
        let sec = now_us.saturating_sub(self.since_us) / 1_000_000;
        match d.per_second.back_mut() {
            Some((s, b)) if *s == sec => *b += n as u64,
            _ => {
                d.per_second.push_back((sec, n as u64));
                while d.per_second.len() > SECONDS {
                    d.per_second.pop_front();
                }
            }
        }
    }

    /// The profile as JSON: `{since_unix_ms, seconds, send: DIR, recv: DIR}`, each DIR
    /// `{calls, bytes, sizes: [[low, count]...], gaps_us: [[low, count]...], per_second:
    /// [[second, bytes]...]}` (histogram buckets hold values from `low` to twice it; empty
    /// buckets left out).
    pub fn json(&self, gid: u128) -> String {
        let hist = |h: &[u64; BUCKETS]| {
            let v: Vec<String> = h
                .iter()
                .enumerate()
                .filter(|(_, &c)| c > 0)
                .map(|(k, c)| format!("[{}, {c}]", if k == 0 { 0 } else { 1u64 << k }))
                .collect();
            format!("[{}]", v.join(", "))
        };
        let dir = |d: &Dir| {
            let ps: Vec<String> = d.per_second.iter().map(|(s, b)| format!("[{s}, {b}]")).collect();
            format!(
                "{{\"calls\": {}, \"bytes\": {}, \"sizes\": {}, \"gaps_us\": {}, \"per_second\": [{}]}}",
                d.calls,
                d.bytes,
                hist(&d.sizes),
                hist(&d.gaps_us),
                ps.join(", ")
            )
        };
        format!(
            "{{\"gid\": \"{gid:032x}\", \"pid\": {}, \"since_unix_ms\": {}, \"seconds\": {:.3}, \"send\": {}, \"recv\": {}}}",
            crate::sys::process::pid(),
            self.since_unix_ms,
            sys::now_us().saturating_sub(self.since_us) as f64 / 1e6,
            dir(&self.dirs[SEND]),
            dir(&self.dirs[RECV])
        )
    }
}

/// Most payload bytes in one made-up packet (an IPv4 packet's total length is 16 bits).
const SEGMENT: usize = 65_000;

/// A capture in progress.
pub struct Capture {
    fd: i32,
    until_ms: u64,
    local: SocketAddr,
    peer: SocketAddr,
    /// Next sequence number of each direction.
    next: [u32; 2],
    ip_id: u16,
    /// Packets written, and packets the file did not take (a full pipe).
    pub packets: u64,
    /// Packets lost.
    pub lost: u64,
}

impl Drop for Capture {
    fn drop(&mut self) {
        sys::fd::close(self.fd);
    }
}

/// The address as the program sees it, with IPv4-mapped IPv6 addresses as IPv4.
fn plain(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        _ => a,
    }
}

/// Ones'-complement sum of `b` (as 16-bit big-endian words) added to `acc`.
fn sum16(mut acc: u32, b: &[u8]) -> u32 {
    let mut it = b.chunks_exact(2);
    for w in &mut it {
        acc += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = it.remainder() {
        acc += u32::from(*last) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

impl Capture {
    /// Starts a capture into `fd` (taken over) for `duration_ms`, of the connection the
    /// program sees from `local` to `peer` (initial sequence numbers from `gid`). Writes the
    /// file's header and a made-up handshake; `None` (and `fd` closed) if the file takes
    /// nothing.
    pub fn start(
        fd: i32,
        duration_ms: u64,
        local: SocketAddr,
        peer: SocketAddr,
        gid: u128,
    ) -> Option<Capture> {
        // (A pipe that fills must not stop the program: what it does not take is lost.)
        let fl = sys::fd::fcntl(fd, libc::F_GETFL, 0);
        if fl >= 0 {
            sys::fd::fcntl(fd, libc::F_SETFL, (fl | libc::O_NONBLOCK) as libc::c_ulong);
        }
        let (local, peer) = (plain(local), plain(peer));
        let isn = [(gid as u32) | 1, ((gid >> 32) as u32) | 1];
        let mut c = Capture {
            fd,
            until_ms: sys::now_ms().saturating_add(duration_ms),
            local,
            peer,
            next: isn,
            ip_id: 1,
            packets: 0,
            lost: 0,
        };
        let mut head = Vec::with_capacity(64);
        // Section header block: byte-order magic, version 1.0, section length unknown.
        head.extend_from_slice(&0x0A0D_0D0Au32.to_le_bytes());
        head.extend_from_slice(&28u32.to_le_bytes());
        head.extend_from_slice(&0x1A2B_3C4Du32.to_le_bytes());
        head.extend_from_slice(&1u16.to_le_bytes());
        head.extend_from_slice(&0u16.to_le_bytes());
        head.extend_from_slice(&(-1i64).to_le_bytes());
        head.extend_from_slice(&28u32.to_le_bytes());
        // Interface description block: Ethernet, no snapshot limit.
        head.extend_from_slice(&1u32.to_le_bytes());
        head.extend_from_slice(&20u32.to_le_bytes());
        head.extend_from_slice(&1u16.to_le_bytes());
        head.extend_from_slice(&0u16.to_le_bytes());
        head.extend_from_slice(&0u32.to_le_bytes());
        head.extend_from_slice(&20u32.to_le_bytes());
        if sys::fd::write(fd, &head) != head.len() as isize {
            return None;
        }
        // (From here on, dropping `c` closes `fd`.)
        // The handshake: SYN, SYN-ACK, ACK (each SYN takes one sequence number).
        c.packet(SEND, 0x02, &[]);
        c.next[SEND] = c.next[SEND].wrapping_add(1);
        c.packet(RECV, 0x12, &[]);
        c.next[RECV] = c.next[RECV].wrapping_add(1);
        c.packet(SEND, 0x10, &[]);
        Some(c)
    }

    /// Records `data` moving in direction `dir`; false once the capture is over. Each
    /// segment and the receiving side's acknowledgement go to the file in one `writev`
    /// around the program's own bytes (never copied).
    pub fn record(&mut self, dir: usize, data: &[u8]) -> bool {
        if sys::now_ms() >= self.until_ms {
            return false;
        }
        for seg in data.chunks(SEGMENT) {
            let (head, mut tail) = self.block(dir, 0x18, seg);
            self.next[dir] = self.next[dir].wrapping_add(seg.len() as u32);
            // The receiving side's acknowledgement, as a kernel would send it (the layer
            // delivered the bytes): readers see an ordinary conversation, no window filled.
            let (ack_head, ack_tail) = self.block(1 - dir, 0x10, &[]);
            tail.extend_from_slice(&ack_head);
            tail.extend_from_slice(&ack_tail);
            self.write(&[&head, seg, &tail], 2);
        }
        true
    }

    /// True once the capture's time is over (the control thread ends it when the program
    /// is quiet).
    pub fn over(&self) -> bool {
        sys::now_ms() >= self.until_ms
    }

    /// Writes one packet (TCP flags `flags`, payload `data`) as an enhanced packet block.
    fn packet(&mut self, dir: usize, flags: u8, data: &[u8]) {
        let (head, tail) = self.block(dir, flags, data);
        self.write(&[&head, data, &tail], 1);
    }

    /// Writes `parts` (`n` packets), counting them written or lost.
    fn write(&mut self, parts: &[&[u8]], n: u64) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if sys::fd::write_parts(self.fd, parts) == len as isize {
            self.packets += n;
        } else {
            self.lost += n;
        }
    }

    /// The enhanced packet block of one packet (TCP flags `flags`, payload `data`), as what
    /// goes before the payload (block header and the made-up Ethernet, IP and TCP headers)
    /// and what goes after it (padding and the block's closing length).
    fn block(&mut self, dir: usize, flags: u8, data: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let (src, dst) = if dir == SEND { (self.local, self.peer) } else { (self.peer, self.local) };
        let (seq, ack) = (self.next[dir], self.next[1 - dir]);
        let mut tcp = [0u8; 20];
        tcp[0..2].copy_from_slice(&src.port().to_be_bytes());
        tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
        tcp[4..8].copy_from_slice(&seq.to_be_bytes());
        tcp[8..12].copy_from_slice(&(if flags == 0x02 { 0 } else { ack }).to_be_bytes());
        tcp[12] = 5 << 4;
        tcp[13] = flags;
        tcp[14..16].copy_from_slice(&0xffffu16.to_be_bytes());
        let mac = |d: usize| [0x02, 0, 0, 0, 0, 1 + d as u8];
        let mut pkt = Vec::with_capacity(14 + 40 + 20);
        pkt.extend_from_slice(&mac(1 - dir));
        pkt.extend_from_slice(&mac(dir));
        let tcp_len = (20 + data.len()) as u32;
        // (The header's 20 bytes are an even count: the sum goes on into the payload.)
        let tcp_sum = |pseudo: u32, tcp: &[u8; 20]| fold(sum16(sum16(pseudo, tcp), data));
        match (src.ip(), dst.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                pkt.extend_from_slice(&0x0800u16.to_be_bytes());
                let mut ip = [0u8; 20];
                ip[0] = 0x45;
                ip[2..4].copy_from_slice(&((20 + tcp_len) as u16).to_be_bytes());
                ip[4..6].copy_from_slice(&self.ip_id.to_be_bytes());
                ip[6] = 0x40;
                ip[8] = 64;
                ip[9] = 6;
                ip[12..16].copy_from_slice(&s.octets());
                ip[16..20].copy_from_slice(&d.octets());
                let c = fold(sum16(0, &ip));
                ip[10..12].copy_from_slice(&c.to_be_bytes());
                let pseudo = sum16(sum16(sum16(0, &s.octets()), &d.octets()), &[0, 6]) + tcp_len;
                let c = tcp_sum(pseudo, &tcp);
                tcp[16..18].copy_from_slice(&c.to_be_bytes());
                pkt.extend_from_slice(&ip);
            }
            _ => {
                let v6 = |a: IpAddr| match a {
                    IpAddr::V6(v) => v,
                    IpAddr::V4(v) => v.to_ipv6_mapped(),
                };
                let (s, d) = (v6(src.ip()), v6(dst.ip()));
                pkt.extend_from_slice(&0x86DDu16.to_be_bytes());
                let mut ip = [0u8; 40];
                ip[0] = 0x60;
                ip[4..6].copy_from_slice(&(tcp_len as u16).to_be_bytes());
                ip[6] = 6;
                ip[7] = 64;
                ip[8..24].copy_from_slice(&s.octets());
                ip[24..40].copy_from_slice(&d.octets());
                let pseudo = sum16(sum16(sum16(0, &s.octets()), &d.octets()), &[0, 6]) + tcp_len;
                let c = tcp_sum(pseudo, &tcp);
                tcp[16..18].copy_from_slice(&c.to_be_bytes());
                pkt.extend_from_slice(&ip);
            }
        }
        self.ip_id = self.ip_id.wrapping_add(1);
        pkt.extend_from_slice(&tcp);
        let captured = pkt.len() + data.len();
        let pad = (4 - captured % 4) % 4;
        let total = 32 + captured + pad;
        let ts = sys::unix_us();
        let mut head = Vec::with_capacity(28 + pkt.len());
        head.extend_from_slice(&6u32.to_le_bytes());
        head.extend_from_slice(&(total as u32).to_le_bytes());
        head.extend_from_slice(&0u32.to_le_bytes());
        head.extend_from_slice(&((ts >> 32) as u32).to_le_bytes());
        head.extend_from_slice(&(ts as u32).to_le_bytes());
        head.extend_from_slice(&(captured as u32).to_le_bytes());
        head.extend_from_slice(&(captured as u32).to_le_bytes());
        head.extend_from_slice(&pkt);
        let mut tail = Vec::with_capacity(pad + 4 + 128);
        tail.extend(std::iter::repeat_n(0u8, pad));
        tail.extend_from_slice(&(total as u32).to_le_bytes());
        (head, tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!((bucket(0), bucket(1), bucket(2), bucket(3), bucket(4)), (0, 0, 1, 1, 2));
        assert_eq!(bucket(65536), 16);
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn checksums_are_ones_complement() {
        // The example of RFC 1071: words 0x0001 0xf203 0xf4f5 0xf6f7 sum to 0xddf2.
        assert_eq!(fold(sum16(0, &[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7])), !0xddf2);
    }

    #[test]
    fn profiles_count_calls_sizes_gaps_and_seconds() {
        let mut p = Profile { since_unix_ms: 0, since_us: 1_000_000, dirs: Default::default() };
        p.record(SEND, 100, 1_000_000);
        p.record(SEND, 100, 1_000_500);
        p.record(SEND, 5000, 2_500_000);
        p.record(RECV, 1, 1_200_000);
        let d = &p.dirs[SEND];
        assert_eq!((d.calls, d.bytes), (3, 5200));
        assert_eq!((d.sizes[6], d.sizes[12]), (2, 1));
        assert_eq!((d.gaps_us[8], d.gaps_us[20]), (1, 1));
        assert_eq!(d.per_second.iter().copied().collect::<Vec<_>>(), vec![(0, 200), (1, 5000)]);
        let j = p.json(5);
        assert!(j.contains("\"sizes\": [[64, 2], [4096, 1]]"), "{j}");
        assert!(j.contains("\"recv\": {\"calls\": 1, \"bytes\": 1, \"sizes\": [[0, 1]]"), "{j}");
    }
}
