//! Connections announced to a process's listeners, in memory the process shares with its
//! node agent: the accepting layer looks a new connection up here instead of asking the agent
//! and waiting for its answer (a round trip between two processes, which on a machine whose
//! processors sleep when idle costs a wake-up each way).
//!
//! The layer makes the table (a sealed memfd) and hands it to its agent with its first
//! listener; the agent writes an entry for each connection announced to a listener of that
//! process (the same entry it keeps in its directory) and clears it when the connection is
//! asked about the old way; the layer takes an entry with one compare-and-swap and then tells
//! its agent, one way, that it took it.
//!
//! ```text
//!  header   32 words: MAGIC, VERSION << 32 | SLOTS, reserved
//!  slot i   32 words at 32 * (i + 1):
//!    0      state: generation << 2 | EMPTY 0 / WRITING 1 / READY 2 / TAKEN 3
//!    1      expires (CLOCK_MONOTONIC, ns)
//!    2-3    GID (low, high)          4-5  secret (low, high)       6  the connecting side's window
//!    7-9    source address          10-12 destination address     13-15 the address the
//!                                                                        connecting program
//!                                                                        asked for (0: the same)
//!    16     number of agent addresses (at most 4)    17-28 the connecting node's agent addresses
//! ```
//!
//! An address is three words: family and port (bit 63 set: present), then the 16 bytes of
//! the IP (an IPv4 address in the low 32 bits of the first). Writers are the agent's threads
//! (a slot is theirs once they moved it to WRITING); a reader copies a READY slot, checks that
//! its state word did not change meanwhile (a sequence lock), and takes it by moving the state
//! from that very value to TAKEN. Everything here is atomics, so a process that scribbles on
//! its own table can only lose its own entries, and nothing read from it is trusted beyond
//! "this slot names these two addresses".

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{fence, AtomicU64, Ordering::*};

/// First word of a table.
pub const MAGIC: u64 = 0x564d_4941_4343_5054; // "VMIACCPT"
/// Layout version.
pub const VERSION: u64 = 1;
/// Entries a table holds.
pub const SLOTS: usize = 256;
/// Words per slot (and in the header).
pub const SLOT_WORDS: usize = 32;
/// Bytes of a table.
pub const TABLE_BYTES: usize = (SLOTS + 1) * SLOT_WORDS * 8;
/// Most agent addresses an entry carries.
pub const MAX_AGENTS: usize = 4;
/// Slots looked at for one entry, from its hash on.
const PROBE: usize = 8;

const EMPTY: u64 = 0;
const WRITING: u64 = 1;
const READY: u64 = 2;
const TAKEN: u64 = 3;

const W_EXPIRES: usize = 1;
const W_GID: usize = 2;
const W_SECRET: usize = 4;
const W_WINDOW: usize = 6;
const W_SRC: usize = 7;
const W_DST: usize = 10;
const W_ALIAS: usize = 13;
const W_NAGENTS: usize = 16;
const W_AGENTS: usize = 17;

/// Words of shared memory (a table's mapping).
pub trait Words {
    /// Word `i` (`i < len()`).
    fn word(&self, i: usize) -> &AtomicU64;
    /// How many words there are.
    fn len(&self) -> usize;
    /// True when there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Words for [AtomicU64] {
    fn word(&self, i: usize) -> &AtomicU64 {
        &self[i]
    }
    fn len(&self) -> usize {
        <[AtomicU64]>::len(self)
    }
}

/// A connection announced to a listener of the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The connecting side's address (as the accepting side sees it).
    pub src: SocketAddr,
    /// The address connected to (the accepted socket's local address).
    pub dst: SocketAddr,
    /// GID.
    pub gid: u128,
    /// Secret.
    pub secret: u128,
    /// The connecting side's window.
    pub window: u64,
    /// The address the connecting program asked for, when it is not `dst` (its network was
    /// down and it was sent to another address of this node).
    pub alias: Option<SocketAddr>,
    /// The connecting node's agent addresses (at most [`MAX_AGENTS`] are kept).
    pub agents: Vec<SocketAddr>,
    /// When it stops counting (CLOCK_MONOTONIC, ns).
    pub expires_ns: u64,
}

/// Writes an empty table's header and clears every slot (the layer, at creation; an agent
/// that attaches, so that nothing an earlier agent wrote survives it).
pub fn init<W: Words + ?Sized>(t: &W) -> bool {
    if t.len() * 8 < TABLE_BYTES {
        return false;
    }
    t.word(0).store(MAGIC, Relaxed);
    t.word(1).store(VERSION << 32 | SLOTS as u64, Relaxed);
    for i in 0..SLOTS {
        let s = state_at(i);
        let w = t.word(s).load(Relaxed);
        // A new generation, so that a reader halfway through an old entry fails its check.
        t.word(s).store(((w >> 2) + 1) << 2 | EMPTY, Release);
    }
    true
}

/// True when `t` holds a table of this layout.
pub fn valid<W: Words + ?Sized>(t: &W) -> bool {
    t.len() * 8 >= TABLE_BYTES
        && t.word(0).load(Relaxed) == MAGIC
        && t.word(1).load(Relaxed) == VERSION << 32 | SLOTS as u64
}

fn state_at(slot: usize) -> usize {
    (slot + 1) * SLOT_WORDS
}

fn put_addr<W: Words + ?Sized>(t: &W, at: usize, a: Option<SocketAddr>) {
    let w = encode_addr(a);
    for (k, v) in w.iter().enumerate() {
        t.word(at + k).store(*v, Relaxed);
    }
}

fn get_addr<W: Words + ?Sized>(t: &W, at: usize) -> Option<SocketAddr> {
    decode_addr([t.word(at).load(Relaxed), t.word(at + 1).load(Relaxed), t.word(at + 2).load(Relaxed)])
}

/// An address as three words (all zero: none).
pub fn encode_addr(a: Option<SocketAddr>) -> [u64; 3] {
    match a {
        None => [0; 3],
        Some(SocketAddr::V4(v)) => {
            [1 << 63 | 4 << 16 | u64::from(v.port()), u64::from(u32::from(*v.ip())), 0]
        }
        Some(SocketAddr::V6(v)) => {
            let b = v.ip().octets();
            let lo = u64::from_le_bytes(b[..8].try_into().unwrap_or_default());
            let hi = u64::from_le_bytes(b[8..].try_into().unwrap_or_default());
            [1 << 63 | 6 << 16 | u64::from(v.port()), lo, hi]
        }
    }
}

/// The address of three words; `None` for none or for words that name no address.
pub fn decode_addr(w: [u64; 3]) -> Option<SocketAddr> {
    if w[0] >> 63 == 0 {
        return None;
    }
    let port = (w[0] & 0xffff) as u16;
    match (w[0] >> 16) & 0xff {
        4 if w[1] >> 32 == 0 && w[2] == 0 => {
            Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(w[1] as u32)), port))
        }
        6 => {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&w[1].to_le_bytes());
            b[8..].copy_from_slice(&w[2].to_le_bytes());
            Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(b)), port))
        }
        _ => None,
    }
}

/// The first slot an entry for `src → dst` is looked for in.
fn home(src: SocketAddr, dst: SocketAddr) -> usize {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for w in encode_addr(Some(src)).into_iter().chain(encode_addr(Some(dst))) {
        h = (h ^ w).wrapping_mul(0x100_0000_01b3).rotate_left(29);
    }
    (h % SLOTS as u64) as usize
}

/// Two addresses are the same here when their IP and port are (an IPv6 scope or flow label
/// the kernel reports on one side is not part of a connection's name).
fn same(a: SocketAddr, b: SocketAddr) -> bool {
    encode_addr(Some(a)) == encode_addr(Some(b))
}

fn same_key<W: Words + ?Sized>(t: &W, s: usize, src: SocketAddr, dst: SocketAddr) -> bool {
    get_addr(t, s + W_SRC).is_some_and(|a| same(a, src))
        && get_addr(t, s + W_DST).is_some_and(|a| same(a, dst))
}

/// Writes `e` (the agent). An entry for the same two addresses is replaced; a slot is taken
/// when it is empty, taken by its process or expired. False when the slots near its home are
/// all busy (the process then asks, as without a table).
pub fn put<W: Words + ?Sized>(t: &W, e: &Entry, now_ns: u64) -> bool {
    if !valid(t) {
        return false;
    }
    let h = home(e.src, e.dst);
    // An entry for the same two addresses goes first (a program that connects again from
    // the same port before the first was accepted), else the first free slot.
    let mut pick = None;
    for k in 0..PROBE {
        let i = (h + k) % SLOTS;
        let s = state_at(i);
        let w = t.word(s).load(Acquire);
        let ready = w & 3 == READY;
        if ready && same_key(t, s, e.src, e.dst) {
            pick = Some((s, w));
            break;
        }
        let free = match w & 3 {
            EMPTY | TAKEN => true,
            READY => t.word(s + W_EXPIRES).load(Relaxed) <= now_ns,
            _ => false,
        };
        if free && pick.is_none() {
            pick = Some((s, w));
        }
    }
    let Some((s, w)) = pick else { return false };
    let gen = (w >> 2) + 1;
    if t.word(s).compare_exchange(w, gen << 2 | WRITING, Acquire, Relaxed).is_err() {
        // (Another writer, or the process took it this moment: asked the old way instead.)
        return false;
    }
    t.word(s + W_EXPIRES).store(e.expires_ns, Relaxed);
    t.word(s + W_GID).store(e.gid as u64, Relaxed);
    t.word(s + W_GID + 1).store((e.gid >> 64) as u64, Relaxed);
    t.word(s + W_SECRET).store(e.secret as u64, Relaxed);
    t.word(s + W_SECRET + 1).store((e.secret >> 64) as u64, Relaxed);
    t.word(s + W_WINDOW).store(e.window, Relaxed);
    put_addr(t, s + W_SRC, Some(e.src));
    put_addr(t, s + W_DST, Some(e.dst));
    put_addr(t, s + W_ALIAS, e.alias);
    let n = e.agents.len().min(MAX_AGENTS);
    t.word(s + W_NAGENTS).store(n as u64, Relaxed);
    for k in 0..MAX_AGENTS {
        put_addr(t, s + W_AGENTS + 3 * k, e.agents.get(k).copied());
    }
    t.word(s).store(gen << 2 | READY, Release);
    true
}

/// Clears the entry for `src → dst` with GID `gid`, if it is still there (the agent, when
/// the connection was asked about the old way: the table never offers what the directory
/// already gave out).
pub fn clear<W: Words + ?Sized>(t: &W, src: SocketAddr, dst: SocketAddr, gid: u128) {
    if !valid(t) {
        return;
    }
    let h = home(src, dst);
    for k in 0..PROBE {
        let s = state_at((h + k) % SLOTS);
        let w = t.word(s).load(Acquire);
        if w & 3 == READY && same_key(t, s, src, dst) && read_gid(t, s) == gid {
            let _ = t.word(s).compare_exchange(w, ((w >> 2) + 1) << 2 | EMPTY, AcqRel, Relaxed);
        }
    }
}

fn read_gid<W: Words + ?Sized>(t: &W, s: usize) -> u128 {
    u128::from(t.word(s + W_GID).load(Relaxed)) | u128::from(t.word(s + W_GID + 1).load(Relaxed)) << 64
}

/// Takes the entry for `src → dst` (the accepting layer): `None` when there is none, it
/// expired, or another process of the listener took it.
pub fn claim<W: Words + ?Sized>(t: &W, src: SocketAddr, dst: SocketAddr, now_ns: u64) -> Option<Entry> {
    if !valid(t) {
        return None;
    }
    let h = home(src, dst);
    for k in 0..PROBE {
        let s = state_at((h + k) % SLOTS);
        let w = t.word(s).load(Acquire);
        if w & 3 != READY {
            continue;
        }
        let (Some(esrc), Some(edst)) = (get_addr(t, s + W_SRC), get_addr(t, s + W_DST)) else { continue };
        let e = Entry {
            src: esrc,
            dst: edst,
            gid: read_gid(t, s),
            secret: u128::from(t.word(s + W_SECRET).load(Relaxed))
                | u128::from(t.word(s + W_SECRET + 1).load(Relaxed)) << 64,
            window: t.word(s + W_WINDOW).load(Relaxed),
            alias: get_addr(t, s + W_ALIAS),
            agents: (0..(t.word(s + W_NAGENTS).load(Relaxed) as usize).min(MAX_AGENTS))
                .filter_map(|k| get_addr(t, s + W_AGENTS + 3 * k))
                .collect(),
            expires_ns: t.word(s + W_EXPIRES).load(Relaxed),
        };
        fence(Acquire);
        if t.word(s).load(Relaxed) != w {
            // Rewritten while we read it: not ours to trust.
            continue;
        }
        if !same(e.src, src) || !same(e.dst, dst) || e.expires_ns <= now_ns {
            continue;
        }
        if t.word(s).compare_exchange(w, (w >> 2) << 2 | TAKEN, AcqRel, Relaxed).is_ok() {
            return Some(e);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn table() -> Vec<AtomicU64> {
        let t: Vec<AtomicU64> = (0..TABLE_BYTES / 8).map(|_| AtomicU64::new(0)).collect();
        assert!(init(&t[..]));
        t
    }

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn entry(src: &str, dst: &str, gid: u128, expires_ns: u64) -> Entry {
        Entry {
            src: a(src),
            dst: a(dst),
            gid,
            secret: gid.wrapping_mul(7) ^ (1 << 100),
            window: 1 << 21,
            alias: None,
            agents: vec![a("10.0.0.2:7787"), a("[fd00::2]:7787")],
            expires_ns,
        }
    }

    #[test]
    fn addresses_round_trip_and_junk_names_none() {
        for s in ["10.1.2.3:80", "0.0.0.0:0", "[::1]:443", "[fd00::1:2]:65535"] {
            assert_eq!(decode_addr(encode_addr(Some(a(s)))), Some(a(s)));
        }
        assert_eq!(decode_addr(encode_addr(None)), None);
        assert_eq!(decode_addr([1 << 63 | 5 << 16, 0, 0]), None);
        assert_eq!(decode_addr([1 << 63 | 4 << 16, 1 << 40, 0]), None);
    }

    #[test]
    fn an_entry_is_taken_once_with_every_field() {
        let t = table();
        let mut e = entry("10.0.0.2:59001", "10.0.0.1:80", 0x1234_5678_9abc_def0_1122_3344_5566_7788, 1000);
        e.alias = Some(a("10.0.1.1:80"));
        assert!(put(&t[..], &e, 0));
        assert_eq!(claim(&t[..], a("10.0.0.2:59002"), a("10.0.0.1:80"), 0), None);
        assert_eq!(claim(&t[..], e.src, e.dst, 0), Some(e.clone()));
        assert_eq!(claim(&t[..], e.src, e.dst, 0), None, "taken twice");
    }

    #[test]
    fn expired_and_cleared_entries_are_not_taken() {
        let t = table();
        let e = entry("10.0.0.2:59001", "10.0.0.1:80", 5, 1000);
        assert!(put(&t[..], &e, 0));
        assert_eq!(claim(&t[..], e.src, e.dst, 1000), None);
        let e2 = entry("10.0.0.2:59003", "10.0.0.1:80", 6, 1000);
        assert!(put(&t[..], &e2, 0));
        clear(&t[..], e2.src, e2.dst, 99);
        assert!(claim(&t[..], e2.src, e2.dst, 0).is_some(), "cleared with another GID");
        assert!(put(&t[..], &e2, 0));
        clear(&t[..], e2.src, e2.dst, 6);
        assert_eq!(claim(&t[..], e2.src, e2.dst, 0), None);
    }

    #[test]
    fn a_new_announcement_of_the_same_addresses_replaces_the_old() {
        let t = table();
        assert!(put(&t[..], &entry("10.0.0.2:59001", "10.0.0.1:80", 1, 1000), 0));
        assert!(put(&t[..], &entry("10.0.0.2:59001", "10.0.0.1:80", 2, 1000), 0));
        assert_eq!(claim(&t[..], a("10.0.0.2:59001"), a("10.0.0.1:80"), 0).map(|e| e.gid), Some(2));
        assert_eq!(claim(&t[..], a("10.0.0.2:59001"), a("10.0.0.1:80"), 0), None);
    }

    #[test]
    fn a_full_neighbourhood_refuses_then_reuses_taken_and_expired_slots() {
        let t = table();
        let mut n = 0;
        for p in 0..5000u16 {
            if put(&t[..], &entry(&format!("10.0.0.2:{}", 1000 + p), "10.0.0.1:80", u128::from(p), 1000), 0) {
                n += 1;
            }
        }
        assert!((SLOTS * 3 / 4..=SLOTS).contains(&n), "{n} entries kept");
        // Everything expired at 1000: the slots are free again.
        let again = (0..SLOTS as u16)
            .filter(|p| put(&t[..], &entry(&format!("10.0.9.2:{}", 1000 + p), "10.0.0.1:80", 1, 5000), 2000))
            .count();
        assert!(again >= SLOTS * 3 / 4, "{again} after expiry");
    }

    #[test]
    fn junk_in_the_table_is_never_taken_for_an_entry_and_never_panics() {
        let t = table();
        let mut x: u64 = 0x1234_5678;
        for w in &t[32..] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.store(x, Relaxed);
        }
        for p in 0..2000u16 {
            let src = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)), p);
            if let Some(e) = claim(&t[..], src, a("10.0.0.1:80"), 0) {
                assert_eq!((e.src, e.dst), (src, a("10.0.0.1:80")));
            }
        }
        // A header that is not ours: nothing is written or read.
        t[1].store(0, Relaxed);
        assert!(!put(&t[..], &entry("10.0.0.2:1", "10.0.0.1:80", 1, 10), 0));
        assert!(!valid(&t[..2]));
    }

    #[test]
    fn writers_and_takers_at_once_hand_out_each_entry_once_and_whole() {
        let t: Arc<Vec<AtomicU64>> = Arc::new(table());
        let per = 3000u16;
        let writer = {
            let t = t.clone();
            std::thread::spawn(move || {
                for p in 0..per {
                    let e = entry(
                        &format!("10.0.0.2:{}", 2000 + p % 64),
                        "10.0.0.1:80",
                        u128::from(p) << 70 | 7,
                        1 << 40,
                    );
                    while !put(&t[..], &e, 0) {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let takers: Vec<_> = (0..2)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    for round in 0..200_000u32 {
                        let p = 2000 + (round % 64) as u16;
                        if let Some(e) = claim(&t[..], a(&format!("10.0.0.2:{p}")), a("10.0.0.1:80"), 0) {
                            // Whole: every field belongs to the same entry.
                            assert_eq!(e.gid & 7, 7);
                            assert_eq!(e.secret, e.gid.wrapping_mul(7) ^ (1 << 100));
                            assert_eq!(e.agents.len(), 2);
                            got.push(e.gid);
                        }
                    }
                    got
                })
            })
            .collect();
        writer.join().unwrap();
        let mut all: Vec<u128> = takers.into_iter().flat_map(|h| h.join().unwrap()).collect();
        let n = all.len();
        assert!(n > 0, "nothing taken");
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "an entry was taken twice");
    }
}
