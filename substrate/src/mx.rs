//! A Myrinet-style messaging protocol over raw Ethernet (EtherType 0x86DF), in the manner of
//! Open-MX's wire protocol, with no I/O inside: one [`MxLink`] carries one link of a
//! virtual connection between two hosts' Ethernet interfaces.
//!
//! It turns an unreliable network that may drop frames into the reliable, ordered sequence
//! of messages a connection link must be: each message is one frame of the connection core
//! (`poll_transmit`'s output), and a dropped Ethernet frame costs a resend, not the
//! connection.
//!
//! * **Message classes by size.** A message that fits one packet goes as one (*tiny* up to
//!   32 bytes, *small* up to the MTU); a *medium* one (up to [`MxConfig::medium_max`]) is cut
//!   into fragments of one packet each; a *large* one goes as a rendezvous: the sender
//!   announces it and keeps it, the receiver *pulls* it in blocks of packets, re-asking for
//!   what did not come, so a large transfer never floods a receiver that is not ready.
//! * **Order and acknowledgement.** Messages are numbered; the receiver delivers them in order
//!   and acknowledges cumulatively (on every packet it sends, and alone after a short delay).
//!   The sender resends what is not acknowledged after a retransmission time-out that doubles
//!   while nothing comes (a dead network is the agents' business: the link is failed from
//!   outside).
//! * **Trust nothing.** A packet of another session is dropped; lengths, offsets, fragment
//!   numbers and message numbers outside the window are refused with [`MxError`].
//!
//! Packet header (24 bytes, little endian), after the 14-byte Ethernet header the driver adds:
//!
//! ```text
//!  0 kind  1 flags(0)  2 frag (medium: index)     4 session
//!  8 seq (message number)                        12 ack (every message below it delivered)
//! 16 a (small/medium/rndv: message length; pull/pull-reply: offset)
//! 20 b (medium: fragments; pull/pull-reply: length)
//! 24 payload
//! ```

use std::collections::{BTreeMap, VecDeque};

/// The Ethernet type of this protocol (Myrinet Express over Ethernet, as Open-MX uses it).
pub const ETHERTYPE: u16 = 0x86DF;
/// Bytes of the Ethernet header the driver puts in front.
pub const ETH_HEADER: usize = 14;
/// Bytes of this protocol's header.
pub const HEADER: usize = 24;
/// Largest tiny message.
pub const TINY_MAX: usize = 32;

/// Packet kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A message of at most [`TINY_MAX`] bytes.
    Tiny = 1,
    /// A message that fits one packet.
    Small = 2,
    /// One fragment of a medium message.
    Medium = 3,
    /// A large message is waiting to be pulled.
    Rndv = 4,
    /// The receiver asks for part of a large message.
    Pull = 5,
    /// Part of a large message.
    PullReply = 6,
    /// An acknowledgement alone.
    Ack = 7,
}

/// Settings both ends agree on.
#[derive(Clone, Copy, Debug)]
pub struct MxConfig {
    /// The network's MTU (1500, or 9000 with jumbo frames): packet bytes after the Ethernet
    /// header.
    pub mtu: usize,
    /// Names the link (both ends use the same; agreed when the link is set up).
    pub session: u32,
    /// Largest medium message; larger ones are pulled.
    pub medium_max: usize,
    /// Largest message.
    pub message_max: usize,
    /// Messages in flight before `send` says the link is full.
    pub window: u32,
    /// First retransmission time-out (ms); doubles while nothing is acknowledged, up to
    /// 64 times.
    pub rto_ms: u64,
    /// Longest wait before a delivered message is acknowledged alone (ms).
    pub ack_delay_ms: u64,
    /// Packets a receiver has asked for and not received, at most, over all the large
    /// messages it pulls (the oldest message first): what its socket can take at once.
    pub pull_window: usize,
    /// Most bytes of incomplete messages a receiver holds (a medium or large message that
    /// would exceed it waits: its sender announces it again after the time-out).
    pub in_max: usize,
}

impl MxConfig {
    /// Settings for a network with this MTU and a session number.
    pub fn new(mtu: usize, session: u32) -> MxConfig {
        MxConfig {
            mtu,
            session,
            medium_max: 32 << 10,
            message_max: (1 << 20) + 64,
            window: 256,
            rto_ms: 20,
            ack_delay_ms: 1,
            pull_window: 64,
            in_max: 16 << 20,
        }
    }

    /// Payload bytes one packet carries.
    pub fn chunk(&self) -> usize {
        self.mtu - HEADER
    }
}

/// Why a packet was refused (a confused or hostile peer; the packet is dropped and counted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MxError {
    /// Shorter than a header, or an unknown kind.
    Malformed,
    /// Another session's packet.
    WrongSession,
    /// A length, offset or fragment number that cannot be.
    BadGeometry,
    /// A message number outside the window.
    OutOfWindow,
    /// An acknowledgement of messages never sent.
    BadAck,
}

impl std::fmt::Display for MxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            MxError::Malformed => "malformed packet",
            MxError::WrongSession => "packet of another session",
            MxError::BadGeometry => "impossible length, offset or fragment",
            MxError::OutOfWindow => "message number outside the window",
            MxError::BadAck => "acknowledgement of messages never sent",
        };
        f.write_str(s)
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Kind.
    pub kind: Kind,
    /// Medium fragment index.
    pub frag: u16,
    /// Session.
    pub session: u32,
    /// Message number.
    pub seq: u32,
    /// Cumulative acknowledgement.
    pub ack: u32,
    /// Kind-specific (see the module's table).
    pub a: u32,
    /// Kind-specific.
    pub b: u32,
}

impl Header {
    /// The header's wire form.
    pub fn encode(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[0] = self.kind as u8;
        h[2..4].copy_from_slice(&self.frag.to_le_bytes());
        h[4..8].copy_from_slice(&self.session.to_le_bytes());
        h[8..12].copy_from_slice(&self.seq.to_le_bytes());
        h[12..16].copy_from_slice(&self.ack.to_le_bytes());
        h[16..20].copy_from_slice(&self.a.to_le_bytes());
        h[20..24].copy_from_slice(&self.b.to_le_bytes());
        h
    }

    /// Reads a header from the front of a packet.
    pub fn decode(p: &[u8]) -> Result<Header, MxError> {
        if p.len() < HEADER || p[1] != 0 {
            return Err(MxError::Malformed);
        }
        let kind = match p[0] {
            1 => Kind::Tiny,
            2 => Kind::Small,
            3 => Kind::Medium,
            4 => Kind::Rndv,
            5 => Kind::Pull,
            6 => Kind::PullReply,
            7 => Kind::Ack,
            _ => return Err(MxError::Malformed),
        };
        let w = |i: usize| u32::from_le_bytes(p[i..i + 4].try_into().expect("4 bytes"));
        Ok(Header {
            kind,
            frag: u16::from_le_bytes([p[2], p[3]]),
            session: w(4),
            seq: w(8),
            ack: w(12),
            a: w(16),
            b: w(20),
        })
    }
}

/// A message sent and not acknowledged.
#[derive(Debug)]
struct Out {
    data: Vec<u8>,
    /// When its packets last went (ms).
    sent_at: u64,
}

/// A message coming in.
#[derive(Debug)]
struct In {
    buf: Vec<u8>,
    /// Pieces (fragments, or pulled chunks) that arrived.
    have: Vec<bool>,
    missing: usize,
    /// A large message: chunks asked for and when (ms), by chunk index.
    asked: BTreeMap<usize, u64>,
    large: bool,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MxStats {
    /// Packets made (resends included).
    pub packets_out: u64,
    /// Packets taken.
    pub packets_in: u64,
    /// Messages resent after a time-out.
    pub resent: u64,
    /// Chunks of large messages asked for again.
    pub pulled_again: u64,
    /// Packets refused.
    pub refused: u64,
}

/// One link's protocol state.
#[derive(Debug)]
pub struct MxLink {
    cfg: MxConfig,
    // Sending.
    next_seq: u32,
    acked: u32,
    out: BTreeMap<u32, Out>,
    rto: u64,
    /// Nothing (resend or pull again) is due before this time (ms): a lower bound of every
    /// time-out, so that most turns of a driver's loop cost no walk over the window. Raised
    /// by the walks in `handle_timeout`; lowered when a time-out may come sooner (a message
    /// sent, a chunk asked for, the time-out shortened).
    floor: u64,
    /// When the peer was last heard (ms).
    heard: u64,
    // Receiving.
    expected: u32,
    ins: BTreeMap<u32, In>,
    /// Bytes held for incomplete messages.
    in_bytes: usize,
    delivered: VecDeque<Vec<u8>>,
    ack_sent: u32,
    ack_since: Option<u64>,
    ack_now: bool,
    // Both.
    packets: VecDeque<Vec<u8>>,
    stats: MxStats,
}

impl MxLink {
    /// A link with nothing sent or received.
    pub fn new(cfg: MxConfig) -> MxLink {
        MxLink {
            cfg,
            next_seq: 0,
            acked: 0,
            out: BTreeMap::new(),
            rto: cfg.rto_ms,
            floor: u64::MAX,
            heard: 0,
            expected: 0,
            ins: BTreeMap::new(),
            in_bytes: 0,
            delivered: VecDeque::new(),
            ack_sent: 0,
            ack_since: None,
            ack_now: false,
            packets: VecDeque::new(),
            stats: MxStats::default(),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> MxStats {
        self.stats
    }

    /// Messages sent and not acknowledged.
    pub fn in_flight(&self) -> usize {
        self.out.len()
    }

    /// True when `send` would take a message.
    pub fn can_send(&self) -> bool {
        self.next_seq.wrapping_sub(self.acked) < self.cfg.window
    }

    fn header(&self, kind: Kind, seq: u32, frag: u16, a: u32, b: u32) -> Header {
        Header { kind, frag, session: self.cfg.session, seq, ack: self.expected, a, b }
    }

    fn packet(&mut self, h: Header, payload: &[u8]) {
        let mut p = Vec::with_capacity(HEADER + payload.len());
        p.extend_from_slice(&h.encode());
        p.extend_from_slice(payload);
        self.ack_sent = h.ack;
        self.ack_since = None;
        self.ack_now = false;
        self.stats.packets_out += 1;
        self.packets.push_back(p);
    }

    /// Queues the packets of message `seq` (again, after a time-out).
    fn emit(&mut self, seq: u32) {
        let Some(o) = self.out.get_mut(&seq) else { return };
        // (Taken out while its packets are made, put back after.)
        let data = std::mem::take(&mut o.data);
        let len = data.len();
        let chunk = self.cfg.chunk();
        if len <= chunk {
            let kind = if len <= TINY_MAX { Kind::Tiny } else { Kind::Small };
            let h = self.header(kind, seq, 0, len as u32, 0);
            self.packet(h, &data);
        } else if len <= self.cfg.medium_max {
            let frags = len.div_ceil(chunk);
            for (i, piece) in data.chunks(chunk).enumerate() {
                let h = self.header(Kind::Medium, seq, i as u16, len as u32, frags as u32);
                self.packet(h, piece);
            }
        } else {
            let h = self.header(Kind::Rndv, seq, 0, len as u32, 0);
            self.packet(h, &[]);
        }
        self.out.get_mut(&seq).expect("present").data = data;
    }

    /// Sends one message; `Err` gives it back when the window is full.
    pub fn send(&mut self, now: u64, msg: Vec<u8>) -> Result<(), Vec<u8>> {
        if !self.can_send() || msg.is_empty() || msg.len() > self.cfg.message_max {
            return Err(msg);
        }
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        self.out.insert(seq, Out { data: msg, sent_at: now });
        self.floor = self.floor.min(now + self.rto);
        self.emit(seq);
        Ok(())
    }

    /// The next packet to put on the wire (the driver adds the Ethernet header).
    pub fn poll_packet(&mut self, now: u64) -> Option<Vec<u8>> {
        if self.packets.is_empty()
            && (self.ack_now || self.ack_since.is_some_and(|t| now >= t + self.cfg.ack_delay_ms))
        {
            let h = self.header(Kind::Ack, self.next_seq, 0, 0, 0);
            self.packet(h, &[]);
        }
        self.packets.pop_front()
    }

    /// The next message delivered, in order.
    pub fn poll_message(&mut self) -> Option<Vec<u8>> {
        self.delivered.pop_front()
    }

    /// When `handle_timeout` is due (ms). It may be sooner than needed (a call then finds
    /// nothing to do), never later.
    pub fn poll_timeout(&self) -> Option<u64> {
        let ack = self.ack_since.map(|t| t + self.cfg.ack_delay_ms);
        let other = (self.floor != u64::MAX).then_some(self.floor);
        [other, ack].into_iter().flatten().min()
    }

    /// The earliest resend or pull-again time-out (`u64::MAX`: none), by a walk over what is
    /// in flight.
    fn earliest(&self) -> u64 {
        let resend = self.out.values().map(|o| o.sent_at + self.rto).min();
        let pull =
            self.ins.values().filter(|i| i.large).flat_map(|i| i.asked.values()).map(|&t| t + self.rto).min();
        [resend, pull].into_iter().flatten().min().unwrap_or(u64::MAX)
    }

    /// Time passed: resend what was not acknowledged within the time-out, ask again for
    /// pulled chunks that did not come.
    pub fn handle_timeout(&mut self, now: u64) {
        if now < self.floor {
            return;
        }
        // While the peer is heard (it works through what it has), only the oldest message
        // can be missing there; once it goes quiet, everything late goes again.
        let quiet = now >= self.heard + self.rto;
        let late: Vec<u32> = self
            .out
            .iter()
            .filter(|(_, o)| now >= o.sent_at + self.rto)
            .map(|(&s, _)| s)
            .take(if quiet { usize::MAX } else { 1 })
            .collect();
        if !late.is_empty() {
            for s in late {
                self.stats.resent += 1;
                if let Some(o) = self.out.get_mut(&s) {
                    o.sent_at = now;
                }
                self.emit(s);
            }
            self.rto = (self.rto * 2).min(self.cfg.rto_ms * 64);
        }
        let seqs: Vec<u32> = self.ins.iter().filter(|(_, i)| i.large).map(|(&s, _)| s).collect();
        for s in seqs {
            let rto = self.rto;
            let again: Vec<usize> =
                self.ins[&s].asked.iter().filter(|(_, &t)| now >= t + rto).map(|(&c, _)| c).collect();
            if !again.is_empty() {
                self.stats.pulled_again += again.len() as u64;
                self.pull(now, s, &again);
            }
        }
        self.floor = self.earliest();
    }

    /// Asks for chunks `which` of large message `seq` (consecutive runs go as one request).
    fn pull(&mut self, now: u64, seq: u32, which: &[usize]) {
        let chunk = self.cfg.chunk();
        let Some(msg) = self.ins.get_mut(&seq) else { return };
        let len = msg.buf.len();
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &c in which {
            msg.asked.insert(c, now);
            self.floor = self.floor.min(now + self.rto);
            match runs.last_mut() {
                Some((start, n)) if *start + *n == c => *n += 1,
                _ => runs.push((c, 1)),
            }
        }
        for (start, n) in runs {
            let off = start * chunk;
            let bytes = (n * chunk).min(len - off);
            let h = self.header(Kind::Pull, seq, 0, off as u32, bytes as u32);
            self.packet(h, &[]);
        }
    }

    /// Asks for the next chunks of large messages, oldest message first, keeping at most
    /// `pull_window` chunks outstanding in all. Asks in batches of at least half the window
    /// (one request per run of chunks): a request per chunk received would double the
    /// packets on the wire and the sender's work.
    fn pull_more(&mut self, now: u64) {
        let outstanding: usize = self.ins.values().map(|m| m.asked.len()).sum();
        let mut room = self.cfg.pull_window.saturating_sub(outstanding);
        if outstanding > 0 && room < self.cfg.pull_window.div_ceil(2) {
            return;
        }
        let seqs: Vec<u32> =
            self.ins.iter().filter(|(_, m)| m.large && m.missing > 0).map(|(&s, _)| s).collect();
        for seq in seqs {
            if room == 0 {
                break;
            }
            let msg = &self.ins[&seq];
            let next: Vec<usize> = (0..msg.have.len())
                .filter(|&c| !msg.have[c] && !msg.asked.contains_key(&c))
                .take(room)
                .collect();
            room -= next.len();
            if !next.is_empty() {
                self.pull(now, seq, &next);
            }
        }
    }

    /// A packet from the wire (Ethernet header removed). Refused packets change nothing.
    pub fn handle_packet(&mut self, now: u64, p: &[u8]) -> Result<(), MxError> {
        let r = self.take(now, p);
        if r.is_err() {
            self.stats.refused += 1;
        }
        r
    }

    fn take(&mut self, now: u64, p: &[u8]) -> Result<(), MxError> {
        let h = Header::decode(p)?;
        if h.session != self.cfg.session {
            return Err(MxError::WrongSession);
        }
        self.stats.packets_in += 1;
        self.heard = now;
        let payload = &p[HEADER..];
        // The peer's acknowledgement first (one older than what we know is stale, not wrong).
        let stale = self.acked.wrapping_sub(h.ack) <= self.cfg.window && h.ack != self.acked;
        if !stale && h.ack.wrapping_sub(self.acked) > self.next_seq.wrapping_sub(self.acked) {
            return Err(MxError::BadAck);
        }
        if !stale && h.ack != self.acked {
            while self.acked != h.ack {
                self.out.remove(&self.acked);
                self.acked = self.acked.wrapping_add(1);
            }
            self.rto = self.cfg.rto_ms;
            // (Shorter now: what was due later may be due sooner.)
            self.floor = 0;
        }
        match h.kind {
            Kind::Ack => Ok(()),
            Kind::Pull => {
                // The peer pulls part of a large message of ours.
                let Some(o) = self.out.get(&h.seq) else { return Ok(()) };
                let (off, len) = (h.a as usize, h.b as usize);
                if off.checked_add(len).is_none_or(|e| e > o.data.len())
                    || o.data.len() <= self.cfg.medium_max
                {
                    return Err(MxError::BadGeometry);
                }
                // (Taken out while its packets are made, put back after: no copy of the piece.)
                let data = std::mem::take(&mut self.out.get_mut(&h.seq).expect("present").data);
                let chunk = self.cfg.chunk();
                for (i, c) in data[off..off + len].chunks(chunk).enumerate() {
                    let at = off + i * chunk;
                    let hh = self.header(Kind::PullReply, h.seq, 0, at as u32, c.len() as u32);
                    self.packet(hh, c);
                }
                self.out.get_mut(&h.seq).expect("present").data = data;
                // Pulls prove the rendezvous arrived, and that the peer works through our
                // messages: it takes them in order, so the later ones wait behind this one and
                // need not go again while pulls come (past a wrap of the numbers, a few may).
                for (_, o) in self.out.range_mut(h.seq..) {
                    o.sent_at = o.sent_at.max(now);
                }
                Ok(())
            }
            Kind::Tiny | Kind::Small | Kind::Medium | Kind::Rndv | Kind::PullReply => {
                self.take_data(now, h, payload)
            }
        }
    }

    fn take_data(&mut self, now: u64, h: Header, payload: &[u8]) -> Result<(), MxError> {
        let ahead = h.seq.wrapping_sub(self.expected);
        if ahead >= self.cfg.window {
            if self.expected.wrapping_sub(h.seq) <= self.cfg.window {
                // Already delivered: our acknowledgement was lost; say it again.
                self.ack_now = true;
                return Ok(());
            }
            return Err(MxError::OutOfWindow);
        }
        let chunk = self.cfg.chunk();
        let len = h.a as usize;
        match h.kind {
            Kind::Tiny | Kind::Small => {
                if len != payload.len() || len > chunk || (h.kind == Kind::Tiny && len > TINY_MAX) || len == 0
                {
                    return Err(MxError::BadGeometry);
                }
                self.ins.entry(h.seq).or_insert_with(|| In {
                    buf: payload.to_vec(),
                    have: vec![true],
                    missing: 0,
                    asked: BTreeMap::new(),
                    large: false,
                });
            }
            Kind::Medium => {
                let frags = len.div_ceil(chunk);
                let i = h.frag as usize;
                let want = if i + 1 == frags { len - i * chunk } else { chunk };
                if len <= chunk
                    || len > self.cfg.medium_max
                    || h.b as usize != frags
                    || i >= frags
                    || payload.len() != want
                {
                    return Err(MxError::BadGeometry);
                }
                if !self.ins.contains_key(&h.seq) {
                    if self.in_bytes + len > self.cfg.in_max {
                        return Ok(());
                    }
                    self.in_bytes += len;
                }
                let m = self.ins.entry(h.seq).or_insert_with(|| In {
                    buf: vec![0; len],
                    have: vec![false; frags],
                    missing: frags,
                    asked: BTreeMap::new(),
                    large: false,
                });
                if m.buf.len() != len || m.large {
                    return Err(MxError::BadGeometry);
                }
                if !m.have[i] {
                    m.have[i] = true;
                    m.missing -= 1;
                    m.buf[i * chunk..i * chunk + payload.len()].copy_from_slice(payload);
                }
            }
            Kind::Rndv => {
                if len <= self.cfg.medium_max || len > self.cfg.message_max || !payload.is_empty() {
                    return Err(MxError::BadGeometry);
                }
                if !self.ins.contains_key(&h.seq) && self.in_bytes + len <= self.cfg.in_max {
                    self.in_bytes += len;
                    let n = len.div_ceil(chunk);
                    self.ins.insert(
                        h.seq,
                        In {
                            buf: vec![0; len],
                            have: vec![false; n],
                            missing: n,
                            asked: BTreeMap::new(),
                            large: true,
                        },
                    );
                    self.pull_more(now);
                }
            }
            Kind::PullReply => {
                let Some(m) = self.ins.get_mut(&h.seq) else { return Ok(()) };
                let off = h.a as usize;
                if !m.large || !off.is_multiple_of(chunk) || off >= m.buf.len() {
                    return Err(MxError::BadGeometry);
                }
                let c = off / chunk;
                let want = chunk.min(m.buf.len() - off);
                if payload.len() != want || h.b as usize != want {
                    return Err(MxError::BadGeometry);
                }
                if !m.have[c] {
                    m.have[c] = true;
                    m.missing -= 1;
                    m.buf[off..off + want].copy_from_slice(payload);
                }
                m.asked.remove(&c);
                self.pull_more(now);
            }
            Kind::Pull | Kind::Ack => unreachable!("handled by the caller"),
        }
        // Deliver what is complete, in order.
        while let Some(m) = self.ins.get(&self.expected) {
            if m.missing > 0 {
                break;
            }
            let m = self.ins.remove(&self.expected).expect("present");
            if m.have.len() > 1 || m.large {
                self.in_bytes -= m.buf.len();
            }
            self.delivered.push_back(m.buf);
            self.expected = self.expected.wrapping_add(1);
        }
        if self.expected != self.ack_sent && self.ack_since.is_none() {
            self.ack_since = Some(now);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(mtu: usize) -> (MxLink, MxLink) {
        (MxLink::new(MxConfig::new(mtu, 7)), MxLink::new(MxConfig::new(mtu, 7)))
    }

    /// The floor is a lower bound of every time-out: a time-out it hid would be a resend
    /// or a pull that never comes.
    fn check_floor(l: &MxLink) {
        assert!(l.floor <= l.earliest(), "floor {} above a time-out due at {}", l.floor, l.earliest());
    }

    /// Moves packets both ways for `ticks` ms, dropping those `drop` says.
    fn run(a: &mut MxLink, b: &mut MxLink, ticks: u64, mut drop: impl FnMut(u64) -> bool) {
        let mut n = 0u64;
        for now in 0..ticks {
            check_floor(a);
            check_floor(b);
            for dir in 0..2 {
                let (x, y) = if dir == 0 { (&mut *a, &mut *b) } else { (&mut *b, &mut *a) };
                while let Some(p) = x.poll_packet(now) {
                    n += 1;
                    if !drop(n) {
                        y.handle_packet(now, &p).unwrap();
                    }
                }
            }
            a.handle_timeout(now);
            b.handle_timeout(now);
        }
    }

    #[test]
    fn every_class_arrives_in_order() {
        let (mut a, mut b) = pair(1500);
        let sizes = [1, 32, 33, 1476, 1477, 20_000, 32 << 10, (32 << 10) + 1, 200_000, 1 << 20];
        for (i, &n) in sizes.iter().enumerate() {
            a.send(0, vec![i as u8; n]).unwrap();
        }
        run(&mut a, &mut b, 50, |_| false);
        for (i, &n) in sizes.iter().enumerate() {
            assert_eq!(b.poll_message(), Some(vec![i as u8; n]), "message {i}");
        }
        assert_eq!(a.in_flight(), 0);
    }

    /// Moves packets both ways for `ticks` ms, at most `rate` packets per ms each way (the
    /// rest queue, in order, as on a busy wire).
    fn run_paced(a: &mut MxLink, b: &mut MxLink, ticks: u64, rate: usize) {
        let mut wires = [VecDeque::new(), VecDeque::new()];
        for now in 0..ticks {
            check_floor(a);
            check_floor(b);
            for (dir, wire) in wires.iter_mut().enumerate() {
                let (x, y) = if dir == 0 { (&mut *a, &mut *b) } else { (&mut *b, &mut *a) };
                while let Some(p) = x.poll_packet(now) {
                    wire.push_back(p);
                }
                for p in wire.drain(..rate.min(wire.len())) {
                    y.handle_packet(now, &p).unwrap();
                }
            }
            a.handle_timeout(now);
            b.handle_timeout(now);
        }
    }

    #[test]
    fn messages_waiting_behind_a_pulled_one_are_not_sent_again() {
        // A window of large messages announced at once, pulled one after another over a
        // wire much slower than the time-out: each waits its turn far longer than the
        // time-out, and nothing is lost, so nothing must go twice.
        let (mut a, mut b) = pair(1500);
        let msgs: Vec<Vec<u8>> = (0..120u8).map(|i| vec![i; 64 << 10]).collect();
        for m in &msgs {
            a.send(0, m.clone()).unwrap();
        }
        run_paced(&mut a, &mut b, 2_000, 10);
        for (i, m) in msgs.iter().enumerate() {
            assert_eq!(b.poll_message().as_ref(), Some(m), "message {i}");
        }
        assert_eq!(a.in_flight(), 0);
        assert_eq!(a.stats().resent, 0, "{:?}", a.stats());
        assert_eq!(b.stats().pulled_again, 0, "{:?}", b.stats());
    }

    #[test]
    fn dropped_frames_cost_a_resend_not_the_link() {
        for seed in 1..20u64 {
            let (mut a, mut b) = pair(9000);
            let msgs: Vec<Vec<u8>> = (0..60u64)
                .map(|i| vec![(i * seed) as u8; ((i * 7919 * seed) % 300_000 + 1) as usize])
                .collect();
            for m in &msgs {
                a.send(0, m.clone()).unwrap();
            }
            let mut x = seed;
            run(&mut a, &mut b, 3_000, |_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % 100 < 5
            });
            for (i, m) in msgs.iter().enumerate() {
                assert_eq!(b.poll_message().as_ref(), Some(m), "seed {seed} message {i}");
            }
            assert_eq!(a.in_flight(), 0, "seed {seed}");
            assert!(a.stats().resent + b.stats().pulled_again > 0);
        }
    }

    #[test]
    fn hostile_packets_are_refused() {
        let (_, mut b) = pair(1500);
        let mut h = Header { kind: Kind::Medium, frag: 9, session: 7, seq: 0, ack: 0, a: 5000, b: 4 };
        let mut p = h.encode().to_vec();
        p.extend_from_slice(&[0; 100]);
        assert_eq!(b.handle_packet(0, &p), Err(MxError::BadGeometry));
        h.session = 8;
        assert_eq!(b.handle_packet(0, &h.encode()), Err(MxError::WrongSession));
        let far = Header { kind: Kind::Small, frag: 0, session: 7, seq: 1 << 20, ack: 0, a: 1, b: 0 };
        let mut p = far.encode().to_vec();
        p.push(1);
        assert_eq!(b.handle_packet(0, &p), Err(MxError::OutOfWindow));
        let ack = Header { kind: Kind::Ack, frag: 0, session: 7, seq: 0, ack: 3, a: 0, b: 0 };
        assert_eq!(b.handle_packet(0, &ack.encode()), Err(MxError::BadAck));
        assert_eq!(b.handle_packet(0, &[1, 2, 3]), Err(MxError::Malformed));
        assert_eq!(b.stats().refused, 5);
    }
}
