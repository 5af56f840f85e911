//! The connection core: everything a virtual connection must remember, with no I/O inside
//! (in the manner of quinn-proto's `Connection`).
//!
//! The core owns the stream: sequence numbers, the bytes the peer's layer has not
//! acknowledged (the replay buffer), the window, the end of stream and the abort, and what
//! arrived from the peer but was not read yet. Links (kernel TCP, shared memory, a
//! Myrinet-style sink, several at once) only move the frames it gives them. Time and bytes
//! come in as arguments; what the core wants done comes out of `poll_*` calls:
//!
//! ```text
//!   program ── send(data) / recv(buf) / shutdown() / abort() ──►┌────────────┐
//!                                                               │ Connection │── poll_event()
//!   link L ──── handle_link_bytes(now, L, bytes) ─────────────►│            │── poll_timeout()
//!   driver ──── handle_link_down(now, L) / handle_link_up(..) ─►│            │
//!   driver ◄─── poll_transmit(now, L, room): frame bytes for L ─┤            │
//!                                                               └────────────┘
//! ```
//!
//! * **Links pull.** A link asks for frames when it has room (`poll_transmit`), so a fast
//!   link carries more than a slow one and a connection striped over several links goes at
//!   their summed rate; the receiver puts frames back in order (bounded by the window). The
//!   driver may cap what one link holds in flight (`set_link_budget`: its rate times its
//!   delay) so that a slow link never holds the stream back.
//! * **A link that fails loses nothing.** Every frame a link carried stays remembered until
//!   acknowledged; when the link fails its frames go again on the others (or on the next link
//!   to come up), duplicates are dropped by the receiver. A new link after a total failure
//!   starts with the resume handshake, which tells each side what the other delivered
//!   (`resume_ack`, `handle_link_up`): only the rest is sent again.
//! * **Acknowledgements** are cumulative counts of the peer's bytes the program read, plus one
//!   once it read the end of stream (the end takes one sequence number, as in TCP), carried
//!   on every frame and sent alone when a quarter of the peer's window waits for one.
//! * **One state** ([`State`]): up, link down since T, replaying, half-closed, closed with
//!   its reason.

pub mod aead;
pub mod chain;
pub mod filter;
mod link;

pub use chain::{Chain, DecodeError, Doubler, Filter};
pub use link::LinkId;
use link::{InFlight, Link, Parsed};

use crate::reliability::{ack_due, ProtoError};
use crate::wire::frame::{FrameHeader, FrameKind, HEADER_LEN, MAX_CHAIN_SPEC};
use std::collections::{BTreeMap, VecDeque};

/// What a connection is set up with.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Bytes this side may have sent and not had acknowledged.
    pub window: u64,
    /// The peer's window (an acknowledgement goes alone when a quarter of it waits).
    pub peer_window: u64,
    /// Largest payload of one data frame.
    pub max_frame: u32,
    /// Milliseconds the connection waits for a link before it fails.
    pub grace_ms: u64,
    /// Longest wait (ms) before bytes the program read are acknowledged alone, when no
    /// frame carries the acknowledgement and less than a quarter window waits (a sender
    /// whose links hold less than that would otherwise wait for ever).
    pub ack_delay_ms: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            window: 2 << 20,
            peer_window: 2 << 20,
            max_frame: 64 << 10,
            grace_ms: 60_000,
            ack_delay_ms: 5,
        }
    }
}

/// Why a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// Both ends finished their streams and everything was acknowledged.
    Done,
    /// This side's program reset the connection.
    Aborted,
    /// The peer's program reset it.
    PeerAborted,
    /// No link came back within the grace period.
    TimedOut,
    /// The peer broke the protocol.
    Protocol(ProtoError),
}

/// Where the connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Links up, nothing owed.
    Up,
    /// No link has been up since this time (ms).
    LinkDown {
        /// When the last link failed.
        since: u64,
    },
    /// A link is up and frames lost with a failed one are going again.
    Replaying,
    /// One side ended its stream (`ours`: this side), the other may still send.
    HalfClosed {
        /// This side's end of stream was sent.
        ours: bool,
        /// The peer's end of stream arrived.
        theirs: bool,
    },
    /// Over.
    Closed(CloseReason),
}

/// Something the driver or the program should know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Bytes (or the end of stream) can be read.
    Readable,
    /// The window opened: `send` takes bytes again.
    Writable,
    /// A link failed (its frames go again elsewhere).
    LinkDown(LinkId),
    /// No link is left: the driver must build one (the grace period runs).
    NeedLink,
    /// A link came up after a total failure.
    Resumed,
    /// The connection ended.
    Closed(CloseReason),
    /// A chain of filters this side offered was taken: its stream goes through it from
    /// this offset on.
    ChainChanged {
        /// The chain's number.
        id: u8,
        /// First stream offset it transforms.
        from: u64,
    },
    /// The peer refused a chain this side offered (it does not know a filter).
    ChainRefused {
        /// The chain's number.
        id: u8,
    },
}

/// Why a chain cannot be offered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainError {
    /// A filter is unknown here, or the description is too long.
    Unknown,
    /// Every chain number is still in use by bytes not acknowledged yet.
    Busy,
    /// The connection is over.
    Closed,
}

/// A chain in effect for this side's stream from an offset on.
#[derive(Debug)]
struct TxChain {
    id: u8,
    from: u64,
    chain: Chain,
}

/// Why `send` took nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendError {
    /// The window is full: wait for `Event::Writable`.
    Blocked,
    /// This side already ended its stream.
    Finished,
    /// The connection is over.
    Closed(CloseReason),
}

/// What `recv` gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recv {
    /// This many bytes.
    Data(usize),
    /// Nothing now: wait for `Event::Readable`.
    Blocked,
    /// The peer's end of stream (read it once; it stays).
    End,
    /// The connection is over.
    Closed(CloseReason),
}

/// Our end of stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OurEnd {
    Open,
    /// The program shut its side; the end goes after the last byte.
    Owed,
    /// The end frame is on a link.
    Sent,
    /// The peer read it.
    Acked,
}

/// Whether links are there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Links {
    Up,
    Down { since: u64 },
}

/// The connection core.
#[derive(Debug)]
pub struct Connection {
    cfg: Config,
    // Send half.
    /// Bytes `[acked, next_seq)`.
    tx: VecDeque<u8>,
    acked: u64,
    next_seq: u64,
    /// First byte not yet given to any link.
    sent_hi: u64,
    /// Frames to give to a link again (from failed links), in stream order.
    again: VecDeque<InFlight>,
    our_end: OurEnd,
    abort_owed: bool,
    // Receive half.
    /// Bytes the program read.
    delivered: u64,
    /// Bytes in order, not read yet (`[delivered, delivered + ready.len())`).
    ready: VecDeque<u8>,
    /// Frames ahead of the stream, by offset, and their bytes.
    ahead: BTreeMap<u64, Vec<u8>>,
    ahead_bytes: u64,
    peer_end: Option<u64>,
    end_read: bool,
    ack_sent: u64,
    ack_now: bool,
    /// Since when read bytes wait for an acknowledgement (ms).
    ack_waiting_since: Option<u64>,
    // Links and the rest.
    links: Vec<Link>,
    link_state: Links,
    closed: Option<CloseReason>,
    events: VecDeque<Event>,
    was_blocked: bool,
    // Filter chains.
    /// Chains for our stream, by starting offset (the first: none, from 0).
    tx_chains: Vec<TxChain>,
    /// Chains offered, not answered yet: (number, chain).
    offered: Vec<(u8, Chain)>,
    /// Offers to (re)send.
    offers_owed: VecDeque<u8>,
    /// The peer's chains this side took, by number (0: none).
    rx_chains: Vec<Option<Chain>>,
    /// Answers to send: (number, taken).
    answers_owed: VecDeque<(u8, bool)>,
}

impl Connection {
    /// A connection with no link yet (the driver adds the first with `handle_link_up`).
    pub fn new(cfg: Config, now: u64) -> Connection {
        Connection {
            cfg,
            tx: VecDeque::new(),
            acked: 0,
            next_seq: 0,
            sent_hi: 0,
            again: VecDeque::new(),
            our_end: OurEnd::Open,
            abort_owed: false,
            delivered: 0,
            ready: VecDeque::new(),
            ahead: BTreeMap::new(),
            ahead_bytes: 0,
            peer_end: None,
            end_read: false,
            ack_sent: 0,
            ack_now: false,
            ack_waiting_since: None,
            links: Vec::new(),
            link_state: Links::Down { since: now },
            closed: None,
            events: VecDeque::new(),
            was_blocked: false,
            tx_chains: vec![TxChain { id: 0, from: 0, chain: Chain::default() }],
            offered: Vec::new(),
            offers_owed: VecDeque::new(),
            rx_chains: std::iter::once(Some(Chain::default())).chain((1..16).map(|_| None)).collect(),
            answers_owed: VecDeque::new(),
        }
    }

    /// The description of the chain this side's new bytes go through.
    pub fn chain(&self) -> &str {
        &self.tx_chains.last().expect("never empty").chain.spec
    }

    /// Offers the peer a new chain of filters for this side's stream (`spec`: filter names
    /// separated by commas; `""` for none). It applies from the next new frame once the peer
    /// takes it (`Event::ChainChanged`), or not at all (`Event::ChainRefused`). Returns the
    /// chain's number.
    pub fn offer_chain(&mut self, spec: &str) -> Result<u8, ChainError> {
        if self.closed.is_some() {
            return Err(ChainError::Closed);
        }
        let chain = Chain::build(spec).ok_or(ChainError::Unknown)?;
        // (The key exchange of keyed filters is the production layer's, not the core's yet.)
        if chain.spec.len() > MAX_CHAIN_SPEC as usize || chain.keyed() {
            return Err(ChainError::Unknown);
        }
        // Chains whose bytes are all acknowledged are not needed any more.
        while self.tx_chains.len() > 1 && self.tx_chains[1].from <= self.acked {
            self.tx_chains.remove(0);
        }
        let used =
            |id: u8| self.tx_chains.iter().any(|c| c.id == id) || self.offered.iter().any(|(o, _)| *o == id);
        let id = (1..16u8).find(|&i| !used(i)).ok_or(ChainError::Busy)?;
        self.offered.push((id, chain));
        self.offers_owed.push_back(id);
        Ok(id)
    }

    /// Attaches filter `name` after the current chain (see [`Connection::offer_chain`]).
    pub fn attach_filter(&mut self, name: &str) -> Result<u8, ChainError> {
        let cur = self.chain().to_string();
        let spec = if cur.is_empty() { name.to_string() } else { format!("{cur},{name}") };
        self.offer_chain(&spec)
    }

    /// Detaches filter `name` from the current chain (see [`Connection::offer_chain`]).
    pub fn detach_filter(&mut self, name: &str) -> Result<u8, ChainError> {
        let spec: Vec<&str> = self.chain().split(',').filter(|n| !n.is_empty() && *n != name).collect();
        self.offer_chain(&spec.join(","))
    }

    /// Where the connection stands.
    pub fn state(&self) -> State {
        if let Some(r) = self.closed {
            return State::Closed(r);
        }
        if let Links::Down { since } = self.link_state {
            return State::LinkDown { since };
        }
        if !self.again.is_empty() {
            return State::Replaying;
        }
        let ours = self.our_end != OurEnd::Open;
        let theirs = self.peer_end.is_some();
        if ours || theirs {
            return State::HalfClosed { ours, theirs };
        }
        State::Up
    }

    /// The next thing to know, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When `handle_timeout` must be called next (ms), if ever.
    pub fn poll_timeout(&self) -> Option<u64> {
        let ack = self.ack_waiting_since.map(|t| t + self.cfg.ack_delay_ms);
        match (self.closed, self.link_state) {
            (None, Links::Down { since }) => Some(since + self.cfg.grace_ms),
            (None, Links::Up) => ack,
            _ => None,
        }
    }

    /// Time passed: a connection without a link for the grace period fails.
    pub fn handle_timeout(&mut self, now: u64) {
        if let (None, Links::Down { since }) = (self.closed, self.link_state) {
            if now >= since + self.cfg.grace_ms {
                self.close(CloseReason::TimedOut);
            }
        }
    }

    fn close(&mut self, r: CloseReason) {
        if self.closed.is_none() {
            self.closed = Some(r);
            self.events.push_back(Event::Closed(r));
        }
    }

    // -----------------------------------------------------------------------------------------
    // The program's side

    /// Takes bytes of the program's stream, as many as the window allows.
    pub fn send(&mut self, data: &[u8]) -> Result<usize, SendError> {
        if let Some(r) = self.closed {
            return Err(SendError::Closed(r));
        }
        if self.our_end != OurEnd::Open {
            return Err(SendError::Finished);
        }
        let room = self.cfg.window.saturating_sub(self.next_seq - self.acked) as usize;
        let n = room.min(data.len());
        if n == 0 && !data.is_empty() {
            self.was_blocked = true;
            return Err(SendError::Blocked);
        }
        self.tx.extend(&data[..n]);
        self.next_seq += n as u64;
        Ok(n)
    }

    /// Reads bytes of the peer's stream into `buf`.
    pub fn recv(&mut self, buf: &mut [u8]) -> Recv {
        if !self.ready.is_empty() && !buf.is_empty() {
            let n = buf.len().min(self.ready.len());
            for (d, s) in buf.iter_mut().zip(self.ready.drain(..n)) {
                *d = s;
            }
            self.delivered += n as u64;
            if ack_due(self.delivered, self.ack_sent, self.cfg.peer_window) {
                self.ack_now = true;
            }
            return Recv::Data(n);
        }
        if self.peer_end == Some(self.delivered) {
            if !self.end_read {
                self.end_read = true;
                // The end takes one sequence number: acknowledged at once.
                self.ack_now = true;
                self.maybe_done();
            }
            return Recv::End;
        }
        match self.closed {
            Some(r) => Recv::Closed(r),
            None => Recv::Blocked,
        }
    }

    /// The program ends its stream (shutdown for writing): the end goes after the last byte.
    pub fn shutdown(&mut self) {
        if self.our_end == OurEnd::Open && self.closed.is_none() {
            self.our_end = OurEnd::Owed;
        }
    }

    /// The program resets the connection: the peer is told on the next transmit.
    pub fn abort(&mut self) {
        if self.closed.is_none() {
            self.abort_owed = true;
            self.close(CloseReason::Aborted);
        }
    }

    /// Bytes of ours the peer's layer has not acknowledged (the replay buffer's fill).
    pub fn unacked(&self) -> u64 {
        self.next_seq - self.acked
    }

    /// Bytes the program can read now.
    pub fn readable(&self) -> usize {
        self.ready.len()
    }

    /// Payload bytes each link carried so far, and what it has in flight.
    pub fn link_stats(&self) -> Vec<(LinkId, u64, u64)> {
        self.links.iter().map(|l| (l.id, l.carried, l.in_flight_bytes)).collect()
    }

    // -----------------------------------------------------------------------------------------
    // Links

    /// Our acknowledgement now: what a resume handshake tells the peer.
    pub fn resume_ack(&self) -> u64 {
        self.delivered + u64::from(self.end_read)
    }

    fn ack_value(&self) -> u64 {
        self.resume_ack()
    }

    /// A link is up. After a total failure, `peer_ack` is what the peer's side of the resume
    /// handshake said it delivered (`None` for a link joining others that work).
    pub fn handle_link_up(&mut self, now: u64, id: LinkId, peer_ack: Option<u64>) -> Result<(), ProtoError> {
        let _ = now;
        if self.links.iter().any(|l| l.id == id) {
            return Ok(());
        }
        self.links.push(Link::new(id));
        if let Some(a) = peer_ack {
            self.on_ack(a)?;
        }
        if let Links::Down { .. } = self.link_state {
            self.link_state = Links::Up;
            // What the peer may have lost with the old link: our end of stream, an ack.
            self.ack_now = true;
            self.events.push_back(Event::Resumed);
        }
        Ok(())
    }

    /// The driver's cap on payload in flight on one link (its rate times its delay).
    pub fn set_link_budget(&mut self, id: LinkId, bytes: u64) {
        if let Some(l) = self.links.iter_mut().find(|l| l.id == id) {
            l.budget = bytes.max(1);
        }
    }

    /// The driver's measure of a link: its rate (bytes per millisecond) and round-trip time.
    /// With measures of several links, a frame goes on the link where it arrives first (a
    /// slow link asking for frames gets one only when no other would deliver it sooner), so a
    /// slow link never holds the stream back.
    pub fn set_link_estimate(&mut self, id: LinkId, rate_per_ms: u64, rtt_ms: u64) {
        if let Some(l) = self.links.iter_mut().find(|l| l.id == id) {
            l.rate = rate_per_ms;
            l.rtt_ms = rtt_ms;
        }
    }

    /// True when another link would deliver `len` more bytes sooner than link `li`.
    fn another_is_sooner(&self, li: usize, len: u64) -> bool {
        let Some(mine) = self.links[li].eta(len) else { return false };
        self.links.iter().enumerate().any(|(k, l)| k != li && l.eta(len).is_some_and(|t| t < mine))
    }

    /// A link failed: what it carried and the peer has not acknowledged goes again.
    pub fn handle_link_down(&mut self, now: u64, id: LinkId) {
        let Some(i) = self.links.iter().position(|l| l.id == id) else { return };
        let mut l = self.links.remove(i);
        let lost = l.fail();
        for f in lost {
            if f.fin {
                if self.our_end == OurEnd::Sent {
                    self.our_end = OurEnd::Owed;
                }
            } else if f.seq + f.len > self.acked {
                self.again.push_back(f);
            }
        }
        self.again.make_contiguous().sort_by_key(|f| f.seq);
        // Offers and answers in flight on it may be lost: they go again (both are idempotent).
        for (id, _) in &self.offered {
            if !self.offers_owed.contains(id) {
                self.offers_owed.push_back(*id);
            }
        }
        self.events.push_back(Event::LinkDown(id));
        if self.links.is_empty() && self.closed.is_none() {
            self.link_state = Links::Down { since: now };
            self.events.push_back(Event::NeedLink);
        }
    }

    /// Frame bytes for link `id`, at most `room` bytes (header included), or `None` when
    /// nothing is owed on it now.
    pub fn poll_transmit(&mut self, now: u64, id: LinkId, room: usize) -> Option<Vec<u8>> {
        let li = self.links.iter().position(|l| l.id == id)?;
        if room <= HEADER_LEN {
            return None;
        }
        let ack = self.ack_value();
        if ack > self.ack_sent && self.ack_waiting_since.is_none() {
            self.ack_waiting_since = Some(now);
        }
        if self.ack_waiting_since.is_some_and(|t| now >= t + self.cfg.ack_delay_ms) {
            self.ack_now = true;
        }
        if self.abort_owed {
            self.abort_owed = false;
            return Some(FrameHeader::control(FrameKind::Abort, self.next_seq, ack).encode().to_vec());
        }
        if let Some(r) = self.closed {
            // After both ends finished, our acknowledgement of the peer's end may still be owed.
            if r == CloseReason::Done && self.ack_now {
                self.ack_now = false;
                self.ack_sent = ack;
                self.ack_waiting_since = None;
                return Some(FrameHeader::control(FrameKind::Ack, self.next_seq, ack).encode().to_vec());
            }
            return None;
        }
        if let Some((id, taken)) = self.answers_owed.pop_front() {
            let mut h = FrameHeader::control(FrameKind::ChainAnswer, id as u64, ack);
            h.chain = u8::from(taken);
            return Some(h.encode().to_vec());
        }
        while let Some(id) = self.offers_owed.pop_front() {
            let Some((_, c)) = self.offered.iter().find(|(o, _)| *o == id) else { continue };
            let spec = if c.spec.is_empty() { "-".to_string() } else { c.spec.clone() };
            if room < HEADER_LEN + spec.len() {
                self.offers_owed.push_front(id);
                break;
            }
            let mut h = FrameHeader::control(FrameKind::ChainOffer, id as u64, ack);
            h.len = spec.len() as u32;
            let mut out = h.encode().to_vec();
            out.extend_from_slice(spec.as_bytes());
            return Some(out);
        }
        let wire_max = (room - HEADER_LEN).min(self.cfg.max_frame as usize);
        let max = wire_max as u64;
        let mut link_room = self.links[li].room();
        if link_room > 0 && self.another_is_sooner(li, link_room.min(max)) {
            // Data waits for the link that delivers it first; control frames still go.
            link_room = 0;
        }
        // Frames lost with a failed link first, then new bytes.
        let mut frame = None;
        while let Some(f) = self.again.front().copied() {
            if f.seq + f.len <= self.acked {
                self.again.pop_front();
                continue;
            }
            let seq = f.seq.max(self.acked);
            let len = (f.seq + f.len - seq).min(max).min(link_room);
            if len == 0 {
                break;
            }
            self.again.pop_front();
            if seq + len < f.seq + f.len {
                self.again.push_front(InFlight {
                    seq: seq + len,
                    len: f.seq + f.len - seq - len,
                    fin: false,
                });
            }
            frame = Some((seq, len));
            break;
        }
        if frame.is_none() && self.again.is_empty() && self.sent_hi < self.next_seq {
            let len = (self.next_seq - self.sent_hi).min(max).min(link_room);
            if len > 0 {
                frame = Some((self.sent_hi, len));
                self.sent_hi += len;
            }
        }
        if let Some((seq, mut len)) = frame {
            // The chain of these offsets: a frame never spans two chains, and fits the room
            // once encoded.
            let ci = self.tx_chains.iter().rposition(|c| c.from <= seq).expect("chain 0 starts at 0");
            if let Some(next) = self.tx_chains.get(ci + 1) {
                len = len.min(next.from - seq);
            }
            len = len.min(self.tx_chains[ci].chain.fit(wire_max) as u64).max(1);
            let give_back = |this: &mut Self, rest: u64| {
                if rest > 0 {
                    // Not in this frame after all: back where it came from.
                    if seq + len + rest == this.sent_hi && this.again.is_empty() {
                        this.sent_hi -= rest;
                    } else {
                        this.again.push_front(InFlight { seq: seq + len, len: rest, fin: false });
                    }
                }
            };
            let planned = match frame {
                Some((_, l)) => l,
                None => len,
            };
            give_back(self, planned - len);
            let start = (seq - self.acked) as usize;
            let end = start + len as usize;
            let mut plain = Vec::with_capacity(len as usize);
            let (a, b) = self.tx.as_slices();
            if end <= a.len() {
                plain.extend_from_slice(&a[start..end]);
            } else if start >= a.len() {
                plain.extend_from_slice(&b[start - a.len()..end - a.len()]);
            } else {
                plain.extend_from_slice(&a[start..]);
                plain.extend_from_slice(&b[..end - a.len()]);
            }
            let c = &mut self.tx_chains[ci];
            let payload = if c.chain.is_empty() { plain } else { c.chain.encode(seq, &plain) };
            let mut h = FrameHeader::data(payload.len() as u32, seq, ack);
            h.chain = c.id;
            let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
            out.extend_from_slice(&h.encode());
            out.extend_from_slice(&payload);
            self.links[li].sent(InFlight { seq, len, fin: false });
            self.ack_sent = ack;
            self.ack_waiting_since = None;
            self.ack_now = false;
            return Some(out);
        }
        if self.our_end == OurEnd::Owed && self.again.is_empty() && self.sent_hi == self.next_seq {
            self.our_end = OurEnd::Sent;
            self.links[li].sent(InFlight { seq: self.next_seq, len: 0, fin: true });
            self.ack_sent = ack;
            self.ack_waiting_since = None;
            self.ack_now = false;
            return Some(FrameHeader::control(FrameKind::Fin, self.next_seq, ack).encode().to_vec());
        }
        if self.ack_now || ack_due(self.delivered, self.ack_sent, self.cfg.peer_window) {
            self.ack_sent = ack;
            self.ack_waiting_since = None;
            self.ack_now = false;
            return Some(FrameHeader::control(FrameKind::Ack, self.next_seq, ack).encode().to_vec());
        }
        None
    }

    /// Bytes link `id` delivered. A protocol violation closes the connection (and is
    /// returned).
    pub fn handle_link_bytes(&mut self, now: u64, id: LinkId, bytes: &[u8]) -> Result<(), ProtoError> {
        let _ = now;
        if self.closed.is_some() {
            return Ok(());
        }
        let Some(li) = self.links.iter().position(|l| l.id == id) else { return Ok(()) };
        let mut frames = Vec::new();
        let parsed = self.links[li].parse(bytes, &mut frames);
        for Parsed::Frame(h, payload) in frames {
            if let Err(e) = self.on_frame(h, payload) {
                self.close(CloseReason::Protocol(e));
                return Err(e);
            }
            if self.closed.is_some() {
                return Ok(());
            }
        }
        if let Err(e) = parsed {
            let e = ProtoError::Frame(e);
            self.close(CloseReason::Protocol(e));
            return Err(e);
        }
        Ok(())
    }

    fn on_frame(&mut self, h: FrameHeader, payload: Vec<u8>) -> Result<(), ProtoError> {
        self.on_ack(h.ack)?;
        match h.kind {
            FrameKind::Data => {
                let have = self.delivered + self.ready.len() as u64;
                let Some(c) = self.rx_chains.get_mut(h.chain as usize).and_then(Option::as_mut) else {
                    return Err(ProtoError::Frame(crate::wire::frame::FrameError::BadFlags(h.chain as u16)));
                };
                let plain = if c.is_empty() {
                    payload
                } else {
                    match c.decode(h.seq, payload) {
                        Ok(p) => p,
                        // A late copy of bytes already here, from a chain since replaced.
                        Err(_) if h.seq < have => return Ok(()),
                        Err(_) => return Err(ProtoError::OutOfOrder { got: h.seq, expected: have }),
                    }
                };
                if plain.is_empty() {
                    return Err(ProtoError::OutOfOrder { got: h.seq, expected: have });
                }
                self.on_data(h.seq, plain)
            }
            FrameKind::ChainOffer => {
                let id = h.seq;
                if !(1..16).contains(&id) {
                    return Err(ProtoError::Frame(crate::wire::frame::FrameError::BadFlags(0)));
                }
                let spec = std::str::from_utf8(&payload).unwrap_or("?");
                let spec = if spec == "-" { "" } else { spec };
                let taken = Chain::build(spec).filter(|c| !c.keyed());
                let ok = taken.is_some();
                if let Some(c) = taken {
                    self.rx_chains[id as usize] = Some(c);
                }
                self.answers_owed.push_back((id as u8, ok));
                Ok(())
            }
            FrameKind::ChainAnswer => {
                let Some(i) = self.offered.iter().position(|(o, _)| *o as u64 == h.seq) else {
                    return Ok(());
                };
                let (id, chain) = self.offered.remove(i);
                if h.chain == 1 {
                    let from = self.sent_hi.max(self.tx_chains.last().expect("never empty").from);
                    self.tx_chains.push(TxChain { id, from, chain });
                    self.events.push_back(Event::ChainChanged { id, from });
                } else {
                    self.events.push_back(Event::ChainRefused { id });
                }
                Ok(())
            }
            FrameKind::Fin => {
                if !payload.is_empty() {
                    // (This core seals nothing: a tag is owed only after a keyed chain.)
                    return Err(ProtoError::ControlForged("a tagged end of stream"));
                }
                let end = h.seq;
                if self.peer_end.is_some_and(|e| e != end) || end < self.delivered + self.ready.len() as u64 {
                    return Err(ProtoError::DataAfterFin);
                }
                if self.ahead.last_key_value().is_some_and(|(s, v)| s + v.len() as u64 > end) {
                    return Err(ProtoError::DataAfterFin);
                }
                if self.peer_end.replace(end).is_none() {
                    self.events.push_back(Event::Readable);
                }
                Ok(())
            }
            FrameKind::Abort => {
                self.close(CloseReason::PeerAborted);
                Ok(())
            }
            FrameKind::Ack => Ok(()),
            FrameKind::Resync => Err(ProtoError::UnexpectedResync),
        }
    }

    fn on_ack(&mut self, ack: u64) -> Result<(), ProtoError> {
        // (An end of stream owed again after its link failed may have arrived all the same.)
        let fin_sent = self.our_end != OurEnd::Open;
        let top = self.next_seq + u64::from(fin_sent);
        if ack > top {
            return Err(ProtoError::AckBeyondSent { ack, sent: top });
        }
        let data_ack = ack.min(self.next_seq);
        if data_ack > self.acked {
            self.tx.drain(..(data_ack - self.acked) as usize);
            self.acked = data_ack;
            self.sent_hi = self.sent_hi.max(self.acked);
            if self.was_blocked {
                self.was_blocked = false;
                self.events.push_back(Event::Writable);
            }
        }
        let fin_acked = fin_sent && ack == self.next_seq + 1;
        if fin_acked {
            self.our_end = OurEnd::Acked;
        }
        for l in &mut self.links {
            l.on_ack(self.acked, fin_acked);
        }
        self.maybe_done();
        Ok(())
    }

    fn on_data(&mut self, seq: u64, mut payload: Vec<u8>) -> Result<(), ProtoError> {
        let have = self.delivered + self.ready.len() as u64;
        let too_far = ProtoError::OutOfOrder { got: seq, expected: have };
        let end = seq.checked_add(payload.len() as u64).ok_or(too_far)?;
        if self.peer_end.is_some_and(|e| end > e) {
            return Err(ProtoError::DataAfterFin);
        }
        if end > self.delivered + self.cfg.window.max(self.cfg.peer_window) {
            return Err(ProtoError::OutOfOrder { got: seq, expected: have });
        }
        if end <= have {
            // A frame sent again after a failure, already here.
            return Ok(());
        }
        if seq > have {
            // Frames ahead never hold more than a window (a peer sending overlapping pieces
            // to fill memory breaks the protocol).
            if !self.ahead.contains_key(&seq) {
                if self.ahead_bytes + payload.len() as u64 > self.cfg.window.max(self.cfg.peer_window) {
                    return Err(too_far);
                }
                self.ahead_bytes += payload.len() as u64;
                self.ahead.insert(seq, payload);
            }
            return Ok(());
        }
        payload.drain(..(have - seq) as usize);
        self.ready.extend(payload);
        // Frames that were ahead and now follow.
        while let Some((&s, _)) = self.ahead.first_key_value() {
            let have = self.delivered + self.ready.len() as u64;
            if s > have {
                break;
            }
            let (s, v) = self.ahead.pop_first().expect("just seen");
            self.ahead_bytes -= v.len() as u64;
            if s + v.len() as u64 > have {
                self.ready.extend(&v[(have - s) as usize..]);
            }
        }
        self.events.push_back(Event::Readable);
        Ok(())
    }

    fn maybe_done(&mut self) {
        if self.our_end == OurEnd::Acked && self.end_read && self.closed.is_none() {
            // The peer's end was read here; ours was read there. Our last ack (the end's)
            // still goes out if owed: `poll_transmit` sends it before the driver lets go.
            self.close(CloseReason::Done);
        }
    }

    /// True while an acknowledgement is owed to the peer: after `Closed(Done)` the driver
    /// keeps a link until `poll_transmit` gave it (the peer waits for it to finish too).
    pub fn ack_owed(&self) -> bool {
        self.ack_now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Connection, Connection) {
        let cfg = Config {
            window: 1 << 16,
            peer_window: 1 << 16,
            max_frame: 4096,
            grace_ms: 1000,
            ack_delay_ms: 5,
        };
        let (mut a, mut b) = (Connection::new(cfg, 0), Connection::new(cfg, 0));
        a.handle_link_up(0, LinkId(1), None).unwrap();
        b.handle_link_up(0, LinkId(1), None).unwrap();
        (a, b)
    }

    fn pump(from: &mut Connection, to: &mut Connection) {
        while let Some(f) = from.poll_transmit(0, LinkId(1), 1 << 20) {
            to.handle_link_bytes(0, LinkId(1), &f).unwrap();
        }
    }

    #[test]
    fn bytes_go_and_acks_free_them() {
        let (mut a, mut b) = pair();
        assert_eq!(a.send(&[7u8; 10_000]), Ok(10_000));
        pump(&mut a, &mut b);
        let mut buf = vec![0u8; 20_000];
        assert_eq!(b.recv(&mut buf), Recv::Data(10_000));
        assert_eq!(a.unacked(), 10_000);
        // A quarter of the window read: an ack goes alone.
        pump(&mut b, &mut a);
        assert_eq!(a.unacked(), 0);
    }

    #[test]
    fn window_blocks_then_opens() {
        let (mut a, mut b) = pair();
        assert_eq!(a.send(&vec![1u8; 1 << 17]), Ok(1 << 16));
        assert_eq!(a.send(&[1]), Err(SendError::Blocked));
        pump(&mut a, &mut b);
        let mut buf = vec![0u8; 1 << 16];
        assert_eq!(b.recv(&mut buf), Recv::Data(1 << 16));
        pump(&mut b, &mut a);
        assert!(std::iter::from_fn(|| a.poll_event()).any(|e| e == Event::Writable));
        assert_eq!(a.send(&[1]), Ok(1));
    }

    #[test]
    fn both_ends_finish_and_close() {
        let (mut a, mut b) = pair();
        a.send(b"hi").unwrap();
        a.shutdown();
        b.shutdown();
        for _ in 0..3 {
            pump(&mut a, &mut b);
            pump(&mut b, &mut a);
            let mut buf = [0u8; 8];
            while let Recv::Data(_) = b.recv(&mut buf) {}
            while let Recv::Data(_) = a.recv(&mut buf) {}
        }
        assert_eq!(b.recv(&mut [0u8; 4]), Recv::End);
        assert_eq!(a.state(), State::Closed(CloseReason::Done));
        assert_eq!(b.state(), State::Closed(CloseReason::Done));
    }

    #[test]
    fn a_link_that_fails_loses_nothing() {
        let (mut a, mut b) = pair();
        a.send(&[3u8; 9000]).unwrap();
        let lost = a.poll_transmit(0, LinkId(1), 1 << 20).unwrap();
        drop(lost);
        a.handle_link_down(5, LinkId(1));
        b.handle_link_down(5, LinkId(1));
        assert_eq!(a.state(), State::LinkDown { since: 5 });
        let (ra, rb) = (a.resume_ack(), b.resume_ack());
        a.handle_link_up(10, LinkId(2), Some(rb)).unwrap();
        b.handle_link_up(10, LinkId(2), Some(ra)).unwrap();
        assert_eq!(a.state(), State::Replaying);
        while let Some(f) = a.poll_transmit(0, LinkId(2), 1 << 20) {
            b.handle_link_bytes(0, LinkId(2), &f).unwrap();
        }
        let mut buf = vec![0u8; 10_000];
        assert_eq!(b.recv(&mut buf), Recv::Data(9000));
    }

    #[test]
    fn a_doubling_filter_attached_then_detached_at_frame_boundaries() {
        let (mut a, mut b) = pair();
        a.send(&[1u8; 3000]).unwrap();
        let id = a.attach_filter("double").unwrap();
        a.send(&[2u8; 3000]).unwrap();
        // Offer, answer, then frames: the bytes given before the answer stay plain.
        let mut wire = 0;
        for _ in 0..4 {
            while let Some(f) = a.poll_transmit(0, LinkId(1), 1 << 20) {
                wire += f.len();
                b.handle_link_bytes(0, LinkId(1), &f).unwrap();
            }
            pump(&mut b, &mut a);
        }
        assert!(std::iter::from_fn(|| a.poll_event())
            .any(|e| matches!(e, Event::ChainChanged { id: i, .. } if i == id)));
        assert_eq!(a.chain(), "double");
        a.send(&[3u8; 3000]).unwrap();
        let before = wire;
        while let Some(f) = a.poll_transmit(0, LinkId(1), 1 << 20) {
            wire += f.len();
            b.handle_link_bytes(0, LinkId(1), &f).unwrap();
        }
        assert!(wire - before >= 6000, "doubled bytes on the wire: {}", wire - before);
        a.detach_filter("double").unwrap();
        for _ in 0..3 {
            pump(&mut a, &mut b);
            pump(&mut b, &mut a);
        }
        assert_eq!(a.chain(), "");
        a.send(&[4u8; 100]).unwrap();
        pump(&mut a, &mut b);
        let mut buf = vec![0u8; 20_000];
        let mut got = Vec::new();
        while let Recv::Data(n) = b.recv(&mut buf) {
            got.extend_from_slice(&buf[..n]);
        }
        let want: Vec<u8> = [vec![1u8; 3000], vec![2; 3000], vec![3; 3000], vec![4; 100]].concat();
        assert_eq!(got, want);
    }

    #[test]
    fn an_unknown_filter_is_refused_here_and_there() {
        let (mut a, mut b) = pair();
        assert_eq!(a.offer_chain("brotli"), Err(ChainError::Unknown));
        // A peer that does not know a filter refuses the offer; the stream goes on plain.
        let mut h = FrameHeader::control(FrameKind::ChainOffer, 3, 0);
        h.len = 6;
        let mut f = h.encode().to_vec();
        f.extend_from_slice(b"brotli");
        b.handle_link_bytes(0, LinkId(1), &f).unwrap();
        let answer = b.poll_transmit(0, LinkId(1), 1 << 20).unwrap();
        let h = FrameHeader::decode(answer[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!((h.kind, h.seq, h.chain), (FrameKind::ChainAnswer, 3, 0));
        // Data under a chain the receiver never took closes the connection.
        let mut d = FrameHeader::data(2, 0, 0);
        d.chain = 5;
        let mut f = d.encode().to_vec();
        f.extend_from_slice(b"xx");
        assert!(b.handle_link_bytes(0, LinkId(1), &f).is_err());
    }

    #[test]
    fn grace_runs_out() {
        let (mut a, _) = pair();
        a.handle_link_down(100, LinkId(1));
        assert_eq!(a.poll_timeout(), Some(1100));
        a.handle_timeout(1099);
        assert!(matches!(a.state(), State::LinkDown { .. }));
        a.handle_timeout(1100);
        assert_eq!(a.state(), State::Closed(CloseReason::TimedOut));
    }

    #[test]
    fn hostile_frames_close_the_connection() {
        let (_, mut b) = pair();
        let ack_beyond = FrameHeader::control(FrameKind::Ack, 0, 5).encode();
        assert!(matches!(
            b.handle_link_bytes(0, LinkId(1), &ack_beyond),
            Err(ProtoError::AckBeyondSent { .. })
        ));
        assert!(matches!(b.state(), State::Closed(CloseReason::Protocol(_))));
        let (_, mut c) = pair();
        let far = FrameHeader::data(10, 1 << 40, 0).encode();
        let mut f = far.to_vec();
        f.extend_from_slice(&[0; 10]);
        assert!(c.handle_link_bytes(0, LinkId(1), &f).is_err());
    }
}
