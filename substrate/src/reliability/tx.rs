//! Send half of a virtual connection: sequence numbers, the replay buffer, the window, and the
//! frame that is partly on the wire.
//!
//! The application's bytes are accepted only when the physical link took them (so nothing is
//! ever accepted that nobody will flush later); the accepted bytes are also copied into the
//! replay ring, where they stay until the peer's *layer* acknowledges them. After a link is
//! rebuilt, [`TxState::resync`] rewinds the wire position to what the peer says it delivered,
//! and [`TxState::plan_replay`] hands out the rest again from the ring.

use super::ProtoError;
use crate::wire::frame::{FrameHeader, FrameKind, CTL_TAG, HEADER_LEN, MAX_PAYLOAD};

/// Where the payload of a planned write comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The application's buffer, from its start.
    App,
    /// The replay ring, starting at this stream offset.
    Ring(u64),
    /// A coded frame: its `raw_len` raw bytes at stream offset `raw_seq` (in the
    /// application's buffer, from its start, when `app`; else in the ring) coded with our
    /// chain number `chain`; the write starts at coded byte `skip`.
    Coded {
        /// Stream offset of the frame's first raw byte.
        raw_seq: u64,
        /// Raw bytes in the frame.
        raw_len: u32,
        /// Our chain number.
        chain: u8,
        /// Coded bytes already on the wire.
        skip: u32,
        /// The raw bytes are the application's (a new frame).
        app: bool,
    },
    /// A chain offer's payload (the description of the one compact form `ids` names, and
    /// for a keyed chain the offer's key share; see [`TxState::offer_payload`]), from byte
    /// `skip`.
    Spec {
        /// The offered chain's compact form.
        ids: u32,
        /// Payload bytes already on the wire.
        skip: u32,
    },
    /// The key share of a chain answer (see [`TxState::answer_share`]), from byte `skip`.
    Share {
        /// Share bytes already on the wire.
        skip: u32,
    },
}

/// What a chain offer's description is on the wire (`-` for the empty chain).
pub fn offer_spec(ids: u32) -> String {
    let s = crate::connection::chain::spec_of_ids(ids).unwrap_or_default();
    if s.is_empty() {
        "-".into()
    } else {
        s
    }
}

/// Why a chain cannot be offered now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OfferError {
    /// An offer waits for its answer, or four chains of our stream still have bytes the
    /// peer has not acknowledged: try again later.
    Busy,
    /// A keyed chain offered with no secret for its key exchange.
    NoKey,
}

/// The frame in progress carries plain payload (application or ring bytes).
const OWED_PLAIN: u32 = 0;
/// The frame in progress is coded: its payload is made again from the ring's bytes.
const OWED_CODED: u32 = 1;
/// The frame in progress is a chain offer: its payload is the offer's description.
const OWED_SPEC: u32 = 2;
/// The frame in progress is a chain answer with a key share.
const OWED_SHARE: u32 = 3;
/// Bytes of a key share and of a key.
const KEY: usize = crate::connection::aead::KEY_LEN;
/// Bytes of a key share with its tag.
const SHARE_WIRE: usize = crate::connection::aead::SHARE_WIRE;
/// Most chain changes of our stream whose bytes are not all acknowledged.
const SWITCHES: usize = 4;

/// One write to put on the link: `header` bytes, then `payload` bytes from `source`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Header bytes to write (a new header, or the unwritten rest of one).
    pub header: [u8; HEADER_LEN],
    /// How many of `header`'s bytes to write, taken from its end.
    pub header_len: usize,
    /// Payload bytes to write after the header.
    pub payload: usize,
    /// Where those payload bytes come from.
    pub source: Source,
    /// The stream offset at the ring's first byte when the plan was made (see
    /// [`TxState::ring_pos`]).
    pub ring_base: u64,
}

impl Plan {
    /// Where stream offset `seq` is in the ring, as [`TxState::ring_pos`] says.
    #[inline]
    pub fn ring_pos(&self, seq: u64) -> u64 {
        seq.wrapping_sub(self.ring_base)
    }

    /// The header bytes still to write.
    pub fn header_bytes(&self) -> &[u8] {
        &self.header[HEADER_LEN - self.header_len..]
    }
}

/// Why no write could be planned now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocked {
    /// The window is full: wait for acknowledgements.
    Window,
    /// The link was rebuilt and the peer's resync has not arrived yet.
    AwaitingResync,
    /// Replayed bytes must go out before new application bytes: call `plan_replay`.
    Replaying,
}

/// Send-side state. Plain data (`repr(C)`), so it can live in memory shared across `fork`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TxState {
    // (The fields every send touches come first, in two cache lines with the cell's flag:
    // `SharedConn` puts the cell on a line of its own.)
    /// Stream offset of the next application byte to accept.
    pub next_seq: u64,
    /// Everything below this offset was delivered by the peer's layer and is freed.
    pub acked: u64,
    /// Stream offset of the next byte to put on the current link (below `next_seq` while
    /// replaying).
    pub wire_seq: u64,
    /// Replay-ring capacity: unacknowledged bytes never exceed it (the hard limit).
    pub window: u64,
    /// The window the peer is told about and the sender normally keeps to (the soft limit);
    /// it is exceeded only when acknowledgements are stuck behind data the application has
    /// not read yet, so that the layer never deadlocks a program native TCP would not.
    pub soft_window: u64,
    /// Highest acknowledgement value this side has put on the wire.
    pub ack_sent: u64,
    /// Header of the frame in progress.
    owed_header: [u8; HEADER_LEN],
    /// Bytes of `owed_header` already written (`HEADER_LEN` = header complete).
    owed_header_off: u32,
    /// True when the frame in progress carries ring bytes (a replay), not application bytes.
    owed_is_replay: u32,
    /// Payload bytes of the frame in progress still to write.
    owed_payload: u64,
    /// Set on a rebuilt link until the peer's resync arrives.
    awaiting_resync: u32,
    /// Our chain number new frames are coded with (0: plain).
    pub chain_cur: u32,
    /// The stream offset stored at the ring's first byte (see [`ring_pos`](Self::ring_pos)):
    /// moved up to `next_seq` whenever the ring is empty as a new frame begins, so that a
    /// connection whose bytes are acknowledged between messages (request and response)
    /// keeps writing the same first pages of its ring, warm in the cache, instead of
    /// walking through all of it (every page of which, in memory shared with other
    /// processes, costs a page fault the first time it is written: one per 4 KiB message
    /// until the ring has gone round once). Not carried across `exec`: the ring's bytes are,
    /// written again at the new image's own positions.
    ring_base: u64,
    /// Our offer waiting for its answer: its chain number (0: none; the rest of it below,
    /// `offer_ids`).
    pub offer_no: u32,
    /// The chain number the frame just planned must be coded with (0: plain).
    new_chain: u32,
    /// How the payload of the frame in progress is made (`OWED_*`; the rest of it below,
    /// `owed_raw_len`).
    owed_kind: u32,
    /// The chain number that coded the last byte of our stream (0: plain). When it is
    /// keyed, the stream is sealed: its Fin, and an offer that would turn the sealing off,
    /// carry a tag under its key.
    tail_chain: u32,
    /// Our chains by number: their compact form (0: empty or never taken).
    pub chain_ids: [u32; 16],
    /// Raw bytes per coded frame of each chain (so that it codes to at most the most a
    /// frame may carry).
    chain_fit: [u32; 16],
    /// Where chains began in our stream (offset, chain number; 0 plain), oldest first:
    /// frames sent again are coded with the chain of their offsets. Before the first, plain.
    switch_at: [u64; SWITCHES],
    switch_no: [u32; SWITCHES],
    n_switch: u32,
    /// Our offer waiting for its answer (its number is `offer_no`): compact form, raw bytes
    /// per frame, and whether it is on the current link.
    offer_ids: u32,
    offer_fit: u32,
    offer_sent: u32,
    /// The last chain number offered (numbers go round 1..=15).
    last_no: u32,
    /// For a coded frame in progress (`owed_kind`): its raw bytes (from `wire_seq`), chain
    /// number and coded length (a description's length for an offer).
    owed_raw_len: u32,
    owed_chain: u32,
    owed_enc_len: u32,
    /// 1 when our offer asks the peer to use the chain for its own stream as well.
    offer_both: u32,
    /// The key of each of our keyed chains, by number (zero for the others).
    chain_keys: [[u8; KEY]; 16],
    /// The secret of our waiting offer's key exchange (zero for an offer of a chain with
    /// no keyed filter).
    offer_secret: [u8; KEY],
    /// The key share of the answer in progress, with its tag.
    answer_share: [u8; SHARE_WIRE],
    /// The connection's secret: the key of the tags of our key shares.
    auth: [u8; 16],
    /// When our keyed chain now in use was keyed: stream offset and time (the caller's
    /// clock, milliseconds); 1 in `rekey` once a rebuilt link asks for a new key.
    keyed_seq: u64,
    keyed_ms: u64,
    rekey: u32,
    /// Highest acknowledgement this side has put on the wire with a tag
    /// ([`plan_ack`](Self::plan_ack)), or stated in a resume handshake (which the
    /// connection's secret authenticates). Once the peer's stream is sealed its layer
    /// counts no other, so our acknowledgements alone go by this one. Not carried across
    /// `exec` (the new image sends one tagged acknowledgement early).
    pub ack_tagged: u64,
}

// (The fields every send touches fit in 120 bytes: two cache lines with the flag of the
// cell that holds the state.)
const _: () = assert!(std::mem::offset_of!(TxState, tail_chain) + 4 <= 120);

impl TxState {
    /// The state as bytes (little endian, field by field) for a record that crosses
    /// `exec` (see [`crate::handover`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::BYTES);
        for v in [self.next_seq, self.acked, self.wire_seq, self.window, self.soft_window, self.ack_sent] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.owed_header);
        for v in [self.owed_header_off, self.owed_is_replay] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.owed_payload.to_le_bytes());
        b.extend_from_slice(&self.awaiting_resync.to_le_bytes());
        b.extend_from_slice(&self.chain_cur.to_le_bytes());
        for v in self.chain_ids.iter().chain(&self.chain_fit) {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in self.switch_at {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in self.switch_no.iter().chain(&[
            self.n_switch,
            self.offer_no,
            self.offer_ids,
            self.offer_fit,
            self.offer_sent,
            self.last_no,
            self.owed_kind,
            self.owed_raw_len,
            self.owed_chain,
            self.owed_enc_len,
            self.offer_both,
        ]) {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for k in self.chain_keys.iter().chain([&self.offer_secret]) {
            b.extend_from_slice(k);
        }
        b.extend_from_slice(&self.answer_share);
        b.extend_from_slice(&self.auth);
        for v in [self.keyed_seq, self.keyed_ms] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.rekey.to_le_bytes());
        b.extend_from_slice(&self.tail_chain.to_le_bytes());
        b
    }

    /// Length of [`to_bytes`](Self::to_bytes).
    pub const BYTES: usize = 6 * 8
        + HEADER_LEN
        + 2 * 4
        + 8
        + 4
        + 4
        + 32 * 4
        + SWITCHES * 8
        + SWITCHES * 4
        + 11 * 4
        + 17 * KEY
        + SHARE_WIRE
        + 16
        + 2 * 8
        + 4
        + 4;

    /// The state [`to_bytes`](Self::to_bytes) wrote; `None` for bytes of another length or
    /// positions that cannot be (acknowledged past sent, a window under 4 KiB, a frame in
    /// progress larger than a frame).
    pub fn from_bytes(b: &[u8]) -> Option<TxState> {
        if b.len() != Self::BYTES {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let h = 48;
        let t = TxState {
            next_seq: u64_at(0),
            acked: u64_at(8),
            wire_seq: u64_at(16),
            window: u64_at(24),
            soft_window: u64_at(32),
            ack_sent: u64_at(40),
            owed_header: b[h..h + HEADER_LEN].try_into().expect("header"),
            owed_header_off: u32_at(h + HEADER_LEN),
            owed_is_replay: u32_at(h + HEADER_LEN + 4),
            owed_payload: u64_at(h + HEADER_LEN + 8),
            awaiting_resync: u32_at(h + HEADER_LEN + 16),
            ..TxState::new(4096)
        };
        let mut t = t;
        let mut at = h + HEADER_LEN + 20;
        let mut next = || {
            let v = u32_at(at);
            at += 4;
            v
        };
        t.chain_cur = next();
        for v in t.chain_ids.iter_mut() {
            *v = next();
        }
        for v in t.chain_fit.iter_mut() {
            *v = next();
        }
        let sw = h + HEADER_LEN + 20 + 4 + 32 * 4;
        for (i, v) in t.switch_at.iter_mut().enumerate() {
            *v = u64_at(sw + 8 * i);
        }
        let mut at = sw + SWITCHES * 8;
        let mut next = || {
            let v = u32_at(at);
            at += 4;
            v
        };
        for v in t.switch_no.iter_mut() {
            *v = next();
        }
        t.n_switch = next();
        t.offer_no = next();
        t.offer_ids = next();
        t.offer_fit = next();
        t.offer_sent = next();
        t.last_no = next();
        t.owed_kind = next();
        t.owed_raw_len = next();
        t.owed_chain = next();
        t.owed_enc_len = next();
        t.offer_both = next();
        let mut at = Self::BYTES - 17 * KEY - SHARE_WIRE - 16 - 2 * 8 - 4 - 4;
        for k in t.chain_keys.iter_mut().chain([&mut t.offer_secret]) {
            k.copy_from_slice(&b[at..at + KEY]);
            at += KEY;
        }
        t.answer_share.copy_from_slice(&b[at..at + SHARE_WIRE]);
        at += SHARE_WIRE;
        t.auth.copy_from_slice(&b[at..at + 16]);
        at += 16;
        t.keyed_seq = u64_at(at);
        t.keyed_ms = u64_at(at + 8);
        t.rekey = u32_at(at + 16);
        t.tail_chain = u32_at(at + 20);
        let n = t.n_switch as usize;
        let chains_ok = t.chain_cur <= 15
            && (t.chain_cur == 0 || t.chain_ids[t.chain_cur as usize] != 0)
            && t.chain_ids.iter().all(|&i| crate::connection::chain::spec_of_ids(i).is_some())
            && n <= SWITCHES
            && t.switch_no[..n].iter().all(|&k| k <= 15)
            && t.switch_at[..n].windows(2).all(|w| w[0] <= w[1])
            && t.offer_no <= 15
            && crate::connection::chain::spec_of_ids(t.offer_ids).is_some()
            && t.offer_sent <= 1
            && t.offer_both <= 1
            && t.last_no <= 15
            && t.owed_kind <= OWED_SHARE
            && t.rekey <= 1
            && t.tail_chain <= 15
            && t.keyed_seq <= t.next_seq
            && t.owed_chain <= 15
            && t.owed_raw_len <= MAX_PAYLOAD
            && t.owed_enc_len <= MAX_PAYLOAD
            && t.owed_payload <= t.owed_enc_len.max(MAX_PAYLOAD) as u64;
        let sane = chains_ok
            && t.acked <= t.next_seq
            && t.wire_seq <= t.next_seq
            && t.window >= 4096
            && t.soft_window <= t.window
            && t.next_seq - t.acked <= t.window
            && t.owed_header_off as usize <= HEADER_LEN
            && t.owed_is_replay <= 1
            && t.owed_payload <= crate::wire::frame::MAX_PAYLOAD as u64
            && t.awaiting_resync <= 1;
        sane.then_some(t)
    }
    /// A fresh send half with a replay ring of `window` bytes.
    pub fn new(window: u64) -> Self {
        assert!(window >= 4096, "window too small");
        TxState {
            next_seq: 0,
            acked: 0,
            wire_seq: 0,
            window,
            soft_window: window,
            ack_sent: 0,
            owed_header: [0; HEADER_LEN],
            owed_header_off: HEADER_LEN as u32,
            owed_is_replay: 0,
            owed_payload: 0,
            awaiting_resync: 0,
            chain_cur: 0,
            chain_ids: [0; 16],
            chain_fit: [0; 16],
            switch_at: [0; SWITCHES],
            switch_no: [0; SWITCHES],
            n_switch: 0,
            offer_no: 0,
            offer_ids: 0,
            offer_fit: 0,
            offer_sent: 0,
            last_no: 0,
            owed_kind: OWED_PLAIN,
            owed_raw_len: 0,
            owed_chain: 0,
            owed_enc_len: 0,
            new_chain: 0,
            offer_both: 0,
            chain_keys: [[0; KEY]; 16],
            offer_secret: [0; KEY],
            answer_share: [0; SHARE_WIRE],
            auth: [0; 16],
            keyed_seq: 0,
            keyed_ms: 0,
            rekey: 0,
            tail_chain: 0,
            ring_base: 0,
            ack_tagged: 0,
        }
    }

    /// Where stream offset `seq` is in the ring (modulo its length): every read and write
    /// of ring bytes goes through this (or [`Plan::ring_pos`]).
    #[inline]
    pub fn ring_pos(&self, seq: u64) -> u64 {
        seq.wrapping_sub(self.ring_base)
    }

    /// Our chain number of stream offset `seq`, and where the next chain begins.
    fn chain_at(&self, seq: u64) -> (u32, u64) {
        let n = self.n_switch as usize;
        let mut no = 0;
        for i in 0..n {
            if self.switch_at[i] > seq {
                return (no, self.switch_at[i]);
            }
            no = self.switch_no[i];
        }
        (no, u64::MAX)
    }

    /// The chain number (and its compact form) the frame just planned must be coded with;
    /// `None` for a plain frame. The caller codes the frame's raw bytes and calls
    /// [`code_frame`](Self::code_frame).
    #[inline]
    pub fn frame_chain(&self) -> Option<(u8, u32)> {
        (self.new_chain != 0).then(|| (self.new_chain as u8, self.chain_ids[self.new_chain as usize]))
    }

    /// Sends the frame just planned plain although its chain named one (every filter of
    /// the chain would leave its bytes as they are): its header names the chain with the
    /// `PLAIN` flag. Returns the plan with that header.
    pub fn send_plain(&mut self, plan: Plan) -> Plan {
        debug_assert!(self.new_chain != 0 && self.owed_header_off == 0);
        let chain = std::mem::take(&mut self.new_chain);
        self.owed_header[2] = chain as u8 | crate::wire::frame::PLAIN;
        Plan { header: self.owed_header, ..plan }
    }

    /// Makes the frame just planned (`plan`, from `plan_send` or `plan_replay`, whose
    /// [`frame_chain`](Self::frame_chain) named a chain) a coded one of `enc_len` bytes.
    pub fn code_frame(&mut self, plan: Plan, enc_len: usize) -> Plan {
        debug_assert!(self.new_chain != 0 && self.owed_header_off == 0);
        debug_assert!((1..=MAX_PAYLOAD as usize).contains(&enc_len));
        let chain = std::mem::take(&mut self.new_chain);
        let mut h = FrameHeader::decode(&self.owed_header).expect("our own header");
        h.len = enc_len as u32;
        h.chain = chain as u8;
        self.owed_header = h.encode();
        self.owed_payload = enc_len as u64;
        self.owed_kind = OWED_CODED;
        self.owed_raw_len = plan.payload as u32;
        self.owed_chain = chain;
        self.owed_enc_len = enc_len as u32;
        let (raw_seq, app) = match plan.source {
            Source::Ring(at) => (at, false),
            _ => (self.next_seq, true),
        };
        Plan {
            header: self.owed_header,
            payload: enc_len,
            source: Source::Coded { raw_seq, raw_len: plan.payload as u32, chain: chain as u8, skip: 0, app },
            ..plan
        }
    }

    /// Offers the chain of compact form `ids` for our stream (`fit`: raw bytes per coded
    /// frame). With `both`, the peer is asked to put the same chain on its own stream (it
    /// offers it back). A keyed chain needs `secret`, this side's half of the key exchange
    /// (a fresh random one for every offer). Returns its number; the offer goes out with
    /// [`plan_offer`](Self::plan_offer).
    pub fn begin_offer(
        &mut self,
        ids: u32,
        fit: usize,
        both: bool,
        secret: Option<[u8; KEY]>,
    ) -> Result<u8, OfferError> {
        let keyed = crate::connection::Chain::ids_keyed(ids);
        if keyed && secret.is_none() {
            return Err(OfferError::NoKey);
        }
        self.trim_switches();
        if self.offer_no != 0 || self.n_switch as usize >= SWITCHES {
            return Err(OfferError::Busy);
        }
        let n = self.n_switch as usize;
        let mut no = self.last_no;
        for _ in 0..15 {
            no = no % 15 + 1;
            if !self.switch_no[..n].contains(&no) && no != self.chain_cur && no != self.tail_chain {
                break;
            }
        }
        self.last_no = no;
        self.offer_no = no;
        self.offer_ids = ids;
        self.offer_fit = fit.clamp(1, MAX_PAYLOAD as usize) as u32;
        self.offer_sent = 0;
        self.offer_both = u32::from(both);
        self.offer_secret = if keyed { secret.unwrap_or_default() } else { [0; KEY] };
        Ok(no as u8)
    }

    /// Takes back our offer while it has not gone on the current link (it waits for a data
    /// frame, or for a link that carries frames at all: a connection on shared memory), so
    /// that a later one can take its place. True when there was one. (If an earlier link
    /// carried it, the peer's answer to it is ignored when it comes: its number is no longer
    /// the one waiting, and the next offer takes another.)
    pub fn withdraw_unsent_offer(&mut self) -> bool {
        if self.offer_no == 0 || self.offer_sent != 0 || self.in_frame() {
            return false;
        }
        self.offer_no = 0;
        self.offer_secret = [0; KEY];
        true
    }

    /// Sets the key of our key shares' tags: the connection's secret, which the peer's
    /// layer holds too.
    pub fn set_auth(&mut self, secret: u128) {
        self.auth = secret.to_le_bytes();
    }

    /// The payload of our offer: the chain's description, and for a keyed chain a zero
    /// byte and the offer's key share with its tag.
    pub fn offer_payload(&self) -> Vec<u8> {
        let mut p = offer_spec(self.offer_ids).into_bytes();
        if let (true, Some(key)) = (self.offer_secret == [0; KEY], self.seal().or_else(|| self.cur_key())) {
            // Our stream is sealed (or our chain now is keyed) and this chain would not
            // seal it: the offer proves it comes from us.
            let tag = crate::connection::aead::control_tag(
                key,
                FrameKind::ChainOffer as u8,
                self.offer_no as u64,
                &p,
            );
            p.push(0);
            p.extend_from_slice(&tag);
        } else if self.offer_secret != [0; KEY] {
            p.push(0);
            let share = crate::connection::aead::share_of(&self.offer_secret);
            p.extend_from_slice(&crate::connection::aead::seal_share(
                &self.auth,
                true,
                self.offer_no as u8,
                &share,
            ));
        }
        p
    }

    /// The payload a control frame's `source` names (an offer's or an answer's).
    pub fn control_payload(&self, source: Source) -> Vec<u8> {
        match source {
            Source::Spec { .. } => self.offer_payload(),
            Source::Share { .. } => {
                self.answer_share[..(self.owed_enc_len as usize).min(SHARE_WIRE)].to_vec()
            }
            _ => Vec::new(),
        }
    }

    /// The key of the chain that sealed our stream's last byte, if that chain is keyed.
    pub fn seal(&self) -> Option<&[u8; KEY]> {
        let k = &self.chain_keys[self.tail_chain as usize & 15];
        (self.tail_chain != 0 && *k != [0; KEY]).then_some(k)
    }

    /// The key of our chain now, if it is keyed.
    fn cur_key(&self) -> Option<&[u8; KEY]> {
        let k = &self.chain_keys[self.chain_cur as usize & 15];
        (self.chain_cur != 0 && *k != [0; KEY]).then_some(k)
    }

    /// The compact form of our offer waiting for its answer, if one waits.
    pub fn offer_waiting(&self) -> Option<u32> {
        (self.offer_no != 0).then_some(self.offer_ids)
    }

    /// True when our waiting offer is of a keyed chain.
    pub fn offer_keyed(&self) -> bool {
        self.offer_no != 0 && self.offer_secret != [0; KEY]
    }

    /// The key of our chain number `no` (zero for a chain with no keyed filter).
    pub fn chain_key(&self, no: u8) -> &[u8; KEY] {
        &self.chain_keys[no as usize & 15]
    }

    /// True when our chain now is keyed and its key is due for renewal: a link was rebuilt
    /// since, or it sealed `max_bytes` bytes, or it is `max_ms` old (`now_ms` on the clock
    /// given to [`take_answer`](Self::take_answer)). Renewing is offering the same chain
    /// again.
    pub fn rekey_due(&self, now_ms: u64, max_bytes: u64, max_ms: u64) -> bool {
        self.chain_cur != 0
            && self.offer_no == 0
            && self.chain_keys[self.chain_cur as usize] != [0; KEY]
            && (self.rekey != 0
                || self.next_seq - self.keyed_seq >= max_bytes
                || now_ms.saturating_sub(self.keyed_ms) >= max_ms)
    }

    /// Plans our offer's frame, when one waits to go on this link and no frame is in
    /// progress.
    pub fn plan_offer(&mut self, delivered: u64) -> Option<Plan> {
        if self.offer_no == 0 || self.offer_sent != 0 || self.in_frame() {
            return None;
        }
        if self.replaying() {
            // Whether it carries a tag, and under which key, depends on the chain of our
            // stream's last byte, which the peer knows once it has every byte before the
            // offer: replayed bytes go first.
            return None;
        }
        let len = self.offer_payload().len();
        let mut h = FrameHeader::control(FrameKind::ChainOffer, self.offer_no as u64, delivered);
        h.len = len as u32;
        h.chain = self.offer_both as u8;
        self.start_frame(h, false);
        self.owed_kind = OWED_SPEC;
        self.owed_enc_len = len as u32;
        Some(self.owed(len, Source::Spec { ids: self.offer_ids, skip: 0 }))
    }

    /// Plans an answer to the peer's offer of its chain `no` (taken or not; with `share`,
    /// this side's key share for a keyed chain taken).
    pub fn plan_answer(
        &mut self,
        no: u8,
        taken: bool,
        delivered: u64,
        share: Option<[u8; KEY]>,
    ) -> Option<Plan> {
        if self.in_frame() {
            return None;
        }
        let mut h = FrameHeader::control(FrameKind::ChainAnswer, no as u64, delivered);
        h.chain = taken as u8;
        let share = share.filter(|_| taken);
        h.len = if share.is_some() { SHARE_WIRE as u32 } else { 0 };
        self.start_frame(h, false);
        match share {
            Some(s) => {
                self.answer_share = crate::connection::aead::seal_share(&self.auth, false, no, &s);
                self.owed_kind = OWED_SHARE;
                self.owed_enc_len = SHARE_WIRE as u32;
                Some(self.owed(SHARE_WIRE, Source::Share { skip: 0 }))
            }
            None => Some(self.owed(0, Source::App)),
        }
    }

    /// Takes the peer's answer (`rx::ANSWER | taken << 8 | number`, and the peer's key
    /// share `share` for a keyed chain) to our offer, at `now_ms`. Returns the number,
    /// whether it was taken and its compact form; `None` for an answer to an offer no
    /// longer waiting (one sent again on a rebuilt link is answered twice). A taken chain
    /// codes every new frame from the next byte of our stream. A keyed chain taken with no
    /// share, or one no key comes from, counts as refused (our frames stay as they were).
    pub fn take_answer(&mut self, a: u32, share: Option<[u8; KEY]>, now_ms: u64) -> Option<(u8, bool, u32)> {
        let (no, mut taken) = (a & 0xff, a & 0x100 != 0);
        if no == 0 || no != self.offer_no {
            return None;
        }
        let ids = self.offer_ids;
        self.offer_no = 0;
        self.offer_sent = 0;
        let mut key = [0; KEY];
        if taken && self.offer_secret != [0; KEY] {
            let spec = crate::connection::chain::spec_of_ids(ids).unwrap_or_default();
            match share
                .and_then(|s| crate::connection::aead::offer_key(&self.offer_secret, &spec, no as u8, &s))
            {
                Some(k) => key = k,
                None => taken = false,
            }
        }
        self.offer_secret = [0; KEY];
        if taken {
            self.chain_keys[no as usize] = key;
            self.keyed_seq = self.next_seq;
            self.keyed_ms = now_ms;
            self.rekey = 0;
            self.chain_ids[no as usize] = ids;
            self.chain_fit[no as usize] = self.offer_fit;
            self.chain_cur = if ids != 0 { no } else { 0 };
            self.trim_switches();
            let n = self.n_switch as usize;
            if n > 0 && self.switch_at[n - 1] == self.next_seq {
                self.switch_no[n - 1] = self.chain_cur;
            } else {
                debug_assert!(n < SWITCHES, "begin_offer keeps a place");
                let n = n.min(SWITCHES - 1);
                self.switch_at[n] = self.next_seq;
                self.switch_no[n] = self.chain_cur;
                self.n_switch = n as u32 + 1;
            }
        }
        Some((no as u8, taken, ids))
    }

    /// Forgets chain changes whose bytes are all acknowledged.
    fn trim_switches(&mut self) {
        let mut n = self.n_switch as usize;
        while n > 0
            && (n >= 2 && self.switch_at[1] <= self.acked
                || n == 1 && self.switch_no[0] == 0 && self.switch_at[0] <= self.acked)
        {
            self.switch_at.copy_within(1..n, 0);
            self.switch_no.copy_within(1..n, 0);
            n -= 1;
        }
        self.n_switch = n as u32;
    }

    /// Bytes sent but not yet acknowledged by the peer's layer (the replay-buffer fill).
    pub fn unacked(&self) -> u64 {
        self.next_seq - self.acked
    }

    /// Free window space for new application bytes, under the soft limit (or the hard one).
    pub fn space(&self, hard: bool) -> u64 {
        let limit = if hard { self.window } else { self.soft_window.min(self.window) };
        limit.saturating_sub(self.unacked())
    }

    /// A send half whose ring holds `ring` bytes and whose normal window is `soft`.
    pub fn with_soft_window(ring: u64, soft: u64) -> Self {
        let mut t = Self::new(ring);
        t.soft_window = soft.min(ring);
        t
    }

    /// True while a frame is partly on the wire (nothing else may be written before it ends).
    pub fn in_frame(&self) -> bool {
        (self.owed_header_off as usize) < HEADER_LEN || self.owed_payload > 0
    }

    /// True when this side never put a byte of its stream or a chain offer on any link: the
    /// peer's layer has nothing of ours to acknowledge or answer. (Acknowledgements of the
    /// peer's bytes may have gone; they are answered by nothing.)
    pub fn sent_nothing(&self) -> bool {
        self.next_seq == 0
            && self.wire_seq == 0
            && self.last_no == 0
            && self.offer_no == 0
            && !self.in_frame()
    }

    /// True while replayed bytes remain to be written.
    pub fn replaying(&self) -> bool {
        self.wire_seq < self.next_seq
    }

    /// True until the peer's resync arrives on a rebuilt link.
    pub fn awaiting_resync(&self) -> bool {
        self.awaiting_resync != 0
    }

    fn owed(&self, payload: usize, source: Source) -> Plan {
        Plan {
            header: self.owed_header,
            header_len: HEADER_LEN - self.owed_header_off as usize,
            payload,
            source,
            ring_base: self.ring_base,
        }
    }

    /// Plans a write of up to `app_len` application bytes, acknowledging `delivered`, within
    /// the soft window (or, with `hard`, within the whole ring).
    pub fn plan_send(&mut self, app_len: usize, delivered: u64, hard: bool) -> Result<Plan, Blocked> {
        if self.awaiting_resync() {
            return Err(Blocked::AwaitingResync);
        }
        if self.in_frame() {
            if self.owed_is_replay != 0 {
                return Err(Blocked::Replaying);
            }
            let payload = (app_len as u64).min(self.owed_payload) as usize;
            return Ok(self.owed(payload, Source::App));
        }
        if self.replaying() {
            return Err(Blocked::Replaying);
        }
        if self.acked == self.next_seq {
            // The ring holds nothing: the new frame's bytes go to its first byte.
            self.ring_base = self.next_seq;
        }
        let mut len = (app_len as u64).min(MAX_PAYLOAD as u64).min(self.space(hard));
        if self.chain_cur != 0 {
            len = len.min(self.chain_fit[self.chain_cur as usize] as u64);
        }
        if len == 0 {
            return Err(Blocked::Window);
        }
        self.start_frame(FrameHeader::data(len as u32, self.next_seq, delivered), false);
        self.new_chain = self.chain_cur;
        Ok(self.owed(len as usize, Source::App))
    }

    /// Plans the next write of replayed bytes (after a resync), acknowledging `delivered`.
    /// `None` when nothing remains to replay.
    pub fn plan_replay(&mut self, delivered: u64) -> Option<Plan> {
        if self.in_frame() {
            if self.owed_is_replay == 0 {
                return None;
            }
            let at = self.wire_seq;
            let done = (self.owed_enc_len as u64 - self.owed_payload.min(self.owed_enc_len as u64)) as u32;
            let source = match self.owed_kind {
                OWED_CODED => Source::Coded {
                    raw_seq: at,
                    raw_len: self.owed_raw_len,
                    chain: self.owed_chain as u8,
                    skip: done,
                    app: false,
                },
                OWED_SPEC => Source::Spec { ids: self.offer_ids, skip: done },
                OWED_SHARE => Source::Share { skip: done },
                _ => Source::Ring(at),
            };
            return Some(self.owed(self.owed_payload as usize, source));
        }
        if !self.replaying() || self.awaiting_resync() {
            return None;
        }
        let (no, next) = self.chain_at(self.wire_seq);
        let mut len = (self.next_seq - self.wire_seq).min(MAX_PAYLOAD as u64).min(next - self.wire_seq);
        let no = if self.chain_ids[no as usize] != 0 { no } else { 0 };
        if no != 0 {
            len = len.min(self.chain_fit[no as usize] as u64);
        }
        self.start_frame(FrameHeader::data(len as u32, self.wire_seq, delivered), true);
        self.new_chain = no;
        Some(self.owed(len as usize, Source::Ring(self.wire_seq)))
    }

    /// Plans an acknowledgement alone when no frame is in progress: with `tag` (this side
    /// connected: `Some(true)`; accepted: `Some(false)`) it carries the tag that makes it
    /// count on a sealed stream (`auth::ack_mac`, under the connection's secret, a payload
    /// of `CTL_TAG` bytes that [`control_payload`](Self::control_payload) gives).
    pub fn plan_ack(&mut self, delivered: u64, tag: Option<bool>) -> Option<Plan> {
        let Some(active) = tag else { return self.plan_control(FrameKind::Ack, delivered) };
        if self.in_frame() {
            return None;
        }
        let mut h = FrameHeader::control(FrameKind::Ack, self.wire_seq, delivered);
        h.len = CTL_TAG;
        self.start_frame(h, false);
        let mac = crate::auth::ack_mac(&self.auth, active, delivered);
        self.answer_share[..CTL_TAG as usize].copy_from_slice(&mac);
        self.owed_kind = OWED_SHARE;
        self.owed_enc_len = CTL_TAG;
        Some(self.owed(CTL_TAG as usize, Source::Share { skip: 0 }))
    }

    /// Plans a control frame (ack, resync, abort, fin) when no frame is in progress. The
    /// Fin of a sealed stream carries its tag (a payload of `CTL_TAG` bytes, made by
    /// [`control_payload`](Self::control_payload)).
    pub fn plan_control(&mut self, kind: FrameKind, delivered: u64) -> Option<Plan> {
        if self.in_frame() {
            return None;
        }
        let mut h = FrameHeader::control(kind, self.wire_seq, delivered);
        let tag = match (kind, self.seal()) {
            (FrameKind::Fin, Some(key)) => {
                Some(crate::connection::aead::control_tag(key, kind as u8, h.seq, &[]))
            }
            _ => None,
        };
        let Some(tag) = tag else {
            self.start_frame(h, false);
            return Some(self.owed(0, Source::App));
        };
        h.len = CTL_TAG;
        self.start_frame(h, false);
        self.answer_share[..CTL_TAG as usize].copy_from_slice(&tag);
        self.owed_kind = OWED_SHARE;
        self.owed_enc_len = CTL_TAG;
        Some(self.owed(CTL_TAG as usize, Source::Share { skip: 0 }))
    }

    fn start_frame(&mut self, h: FrameHeader, replay: bool) {
        self.owed_header = h.encode();
        self.owed_header_off = 0;
        self.owed_payload = h.len as u64;
        self.owed_is_replay = replay as u32;
        self.owed_kind = OWED_PLAIN;
        self.new_chain = 0;
    }

    /// Records that `written` bytes of `plan` reached the link. Payload bytes from the
    /// application (`app`, the same buffer the plan was made for) are copied into `ring`.
    /// Returns how many application bytes were accepted.
    pub fn commit(&mut self, plan: &Plan, written: usize, app: &[u8], ring: &mut [u8]) -> usize {
        self.commit_with(plan, written, app, ring, |d, s| d.copy_from_slice(s))
    }

    /// [`commit`](Self::commit) with the caller's copy routine for the ring (the replay ring
    /// is written once and read only after a failure, so a copy that bypasses the cache pays).
    pub fn commit_with(
        &mut self,
        plan: &Plan,
        written: usize,
        app: &[u8],
        ring: &mut [u8],
        copy: impl Fn(&mut [u8], &[u8]),
    ) -> usize {
        self.commit_gather(plan, written, app, ring, copy)
    }

    /// [`commit_with`](Self::commit_with) for the application's bytes in one buffer or
    /// gathered from several (a `writev`'s, see [`Gather`]), in order.
    pub fn commit_gather<'a>(
        &mut self,
        plan: &Plan,
        written: usize,
        app: impl AppBytes<'a>,
        ring: &mut [u8],
        copy: impl Fn(&mut [u8], &[u8]),
    ) -> usize {
        debug_assert_eq!(ring.len() as u64, self.window);
        if written == 0 && self.owed_header_off == 0 {
            // Nothing of a new frame reached the wire: forget it, so the next plan may differ.
            self.owed_header_off = HEADER_LEN as u32;
            self.owed_payload = 0;
            self.owed_kind = OWED_PLAIN;
            self.new_chain = 0;
            return 0;
        }
        let hw = written.min(plan.header_len);
        self.owed_header_off += hw as u32;
        if self.owed_header_off as usize == HEADER_LEN && hw > 0 {
            let ack = u64::from_le_bytes(self.owed_header[16..24].try_into().expect("8 bytes"));
            self.ack_sent = self.ack_sent.max(ack);
            if self.owed_header[1] == FrameKind::Ack as u8 && self.owed_kind == OWED_SHARE {
                // (Counted once the header is out: its tag goes with it or right after.)
                self.ack_tagged = self.ack_tagged.max(ack);
            }
        }
        let pw = (written - hw).min(plan.payload);
        self.owed_payload -= pw as u64;
        match plan.source {
            Source::App => {
                // Part of the frame is on the wire: its whole payload is accepted now (into
                // the ring), and what the link did not take yet goes out from the ring. A
                // frame is never left waiting for the application's next call (which may
                // never come), so the peer never sits in the middle of a frame.
                to_ring(app.take(plan.payload), ring, self.ring_pos(self.next_seq), &copy);
                self.next_seq += plan.payload as u64;
                self.wire_seq += pw as u64;
                if plan.payload > 0 {
                    self.tail_chain = 0;
                }
                if self.in_frame() {
                    self.owed_is_replay = 1;
                }
                plan.payload
            }
            Source::Ring(_) => {
                self.wire_seq += pw as u64;
                0
            }
            Source::Coded { raw_len, app: from_app, chain, .. } => {
                let raw_len = raw_len as usize;
                let accepted = if from_app {
                    self.tail_chain = chain as u32;
                    // As for a plain frame: the raw bytes are accepted whole, and what the
                    // link did not take yet is coded again from the ring.
                    to_ring(app.take(raw_len), ring, self.ring_pos(self.next_seq), &copy);
                    self.next_seq += raw_len as u64;
                    raw_len
                } else {
                    0
                };
                if self.in_frame() {
                    self.owed_is_replay = 1;
                } else {
                    // The wire position moves by whole coded frames.
                    self.wire_seq += raw_len as u64;
                    self.owed_kind = OWED_PLAIN;
                }
                accepted
            }
            Source::Share { .. } => {
                if self.in_frame() {
                    self.owed_is_replay = 1;
                } else {
                    self.owed_kind = OWED_PLAIN;
                }
                0
            }
            Source::Spec { .. } => {
                self.offer_sent = 1;
                if self.in_frame() {
                    self.owed_is_replay = 1;
                } else {
                    self.owed_kind = OWED_PLAIN;
                }
                0
            }
        }
    }

    /// Applies a cumulative acknowledgement from the peer's layer.
    pub fn on_ack(&mut self, ack: u64) -> Result<(), ProtoError> {
        if ack > self.next_seq {
            return Err(ProtoError::AckBeyondSent { ack, sent: self.next_seq });
        }
        self.acked = self.acked.max(ack);
        Ok(())
    }

    /// Our chain now: number (0: plain) and compact form.
    pub fn chain_now(&self) -> (u32, u32) {
        (self.chain_cur, self.chain_ids[self.chain_cur as usize])
    }

    /// The peer closed its sending side: its layer can acknowledge nothing more. Everything
    /// sent counts as acknowledged (it can no longer be replayed), so the window never stalls
    /// on acks that cannot come.
    pub fn peer_finished(&mut self) {
        self.acked = self.next_seq;
    }

    /// A new link replaced the old one: the frame in progress is gone with it; wait for the
    /// peer's resync before writing data.
    pub fn link_reset(&mut self) {
        self.owed_header_off = HEADER_LEN as u32;
        self.owed_payload = 0;
        self.owed_is_replay = 0;
        self.owed_kind = OWED_PLAIN;
        self.offer_sent = 0;
        self.awaiting_resync = 1;
    }

    /// A new link replaced the old one and the handshake said the peer delivered `received`
    /// bytes of our stream, and that we delivered `delivered` of the peer's: the frame in
    /// progress is gone; replay from `received`.
    pub fn relink(&mut self, received: u64, delivered: u64) -> Result<(), ProtoError> {
        if received < self.acked || received > self.next_seq {
            return Err(ProtoError::ResyncOutOfRange { received, acked: self.acked, sent: self.next_seq });
        }
        self.owed_header_off = HEADER_LEN as u32;
        self.owed_payload = 0;
        self.owed_is_replay = 0;
        self.owed_kind = OWED_PLAIN;
        // An offer waiting for its answer goes again on the new link.
        self.offer_sent = 0;
        self.awaiting_resync = 0;
        self.acked = received;
        self.wire_seq = received;
        self.ack_sent = self.ack_sent.max(delivered);
        self.ack_tagged = self.ack_tagged.max(delivered);
        self.rekey = 1;
        Ok(())
    }

    /// The peer says it delivered `received` bytes of our stream: replay from there.
    pub fn resync(&mut self, received: u64) -> Result<(), ProtoError> {
        if received < self.acked || received > self.next_seq {
            return Err(ProtoError::ResyncOutOfRange { received, acked: self.acked, sent: self.next_seq });
        }
        self.acked = received;
        self.wire_seq = received;
        self.awaiting_resync = 0;
        self.rekey = 1;
        Ok(())
    }
}

/// Copies `data` into the ring at position `pos` (wrapping): a stream offset through
/// [`TxState::ring_pos`] or [`Plan::ring_pos`].
pub fn ring_write(ring: &mut [u8], pos: u64, data: &[u8]) {
    ring_write_with(ring, pos, data, |d, s| d.copy_from_slice(s))
}

/// [`ring_write`] with the caller's copy routine.
pub fn ring_write_with(ring: &mut [u8], pos: u64, data: &[u8], copy: impl Fn(&mut [u8], &[u8])) {
    if data.is_empty() {
        return;
    }
    let cap = ring.len();
    let at = (pos % cap as u64) as usize;
    let first = data.len().min(cap - at);
    copy(&mut ring[at..at + first], &data[..first]);
    if first < data.len() {
        copy(&mut ring[..data.len() - first], &data[first..]);
    }
}

/// Most buffers one [`Gather`] holds.
pub const GATHER_PARTS: usize = 6;

/// The application's bytes for one send, gathered from up to [`GATHER_PARTS`] buffers in
/// order (the buffers of a `writev`), so that one frame carries them without a copy
/// into one buffer first. Empty buffers are left out.
#[derive(Clone, Copy, Debug)]
pub struct Gather<'a> {
    parts: [&'a [u8]; GATHER_PARTS],
    n: usize,
    len: usize,
}

impl<'a> Gather<'a> {
    /// One buffer.
    /// The buffers that are not empty, in order; `None` when there are more than
    /// [`GATHER_PARTS`] of them.
    pub fn new<I: IntoIterator<Item = &'a [u8]>>(bufs: I) -> Option<Self> {
        let mut g = Gather { parts: [&[][..]; GATHER_PARTS], n: 0, len: 0 };
        for b in bufs.into_iter().filter(|b| !b.is_empty()) {
            if g.n == GATHER_PARTS {
                return None;
            }
            g.parts[g.n] = b;
            g.n += 1;
            g.len += b.len();
        }
        Some(g)
    }

    /// Bytes in all.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffers, in order (none empty).
    #[inline]
    pub fn parts(&self) -> &[&'a [u8]] {
        &self.parts[..self.n]
    }

    /// The bytes from `k` on (all of them gone when `k >= len`).
    #[inline]
    pub fn skip(&self, mut k: usize) -> Self {
        if k == 0 {
            return *self;
        }
        let mut g = Gather { parts: [&[][..]; GATHER_PARTS], n: 0, len: 0 };
        for p in self.parts() {
            if k >= p.len() {
                k -= p.len();
                continue;
            }
            g.parts[g.n] = &p[k..];
            g.len += p.len() - k;
            g.n += 1;
            k = 0;
        }
        g
    }

    /// The first `k` bytes (all of them when `k >= len`).
    #[inline]
    pub fn take(&self, mut k: usize) -> Self {
        if k >= self.len {
            return *self;
        }
        let mut g = Gather { parts: [&[][..]; GATHER_PARTS], n: 0, len: 0 };
        for p in self.parts() {
            if k == 0 {
                break;
            }
            let t = k.min(p.len());
            g.parts[g.n] = &p[..t];
            g.n += 1;
            g.len += t;
            k -= t;
        }
        g
    }
}

/// The application's bytes for one send: one buffer (`&[u8]`), or a [`Gather`] of several.
/// The send path is written once over this, and the one-buffer case costs what a slice does.
pub trait AppBytes<'a>: Copy {
    /// Bytes in all.
    fn len(&self) -> usize;
    /// True when there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The bytes from `k` on.
    fn skip(&self, k: usize) -> Self;
    /// The first `k` bytes.
    fn take(&self, k: usize) -> Self;
    /// The buffers in order (a single one may be empty).
    fn parts(&self) -> &[&'a [u8]];
}

impl<'a> AppBytes<'a> for &'a [u8] {
    #[inline]
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    #[inline]
    fn skip(&self, k: usize) -> Self {
        &self[k.min(<[u8]>::len(self))..]
    }
    #[inline]
    fn take(&self, k: usize) -> Self {
        &self[..k.min(<[u8]>::len(self))]
    }
    #[inline]
    fn parts(&self) -> &[&'a [u8]] {
        std::slice::from_ref(self)
    }
}

impl<'a> AppBytes<'a> for Gather<'a> {
    #[inline]
    fn len(&self) -> usize {
        self.len
    }
    #[inline]
    fn skip(&self, k: usize) -> Self {
        Gather::skip(self, k)
    }
    #[inline]
    fn take(&self, k: usize) -> Self {
        Gather::take(self, k)
    }
    #[inline]
    fn parts(&self) -> &[&'a [u8]] {
        Gather::parts(self)
    }
}

/// Writes `app`'s bytes into `ring` at ring position `pos` (see [`TxState::ring_pos`]) with
/// `copy`.
#[inline]
fn to_ring<'a>(app: impl AppBytes<'a>, ring: &mut [u8], mut pos: u64, copy: &impl Fn(&mut [u8], &[u8])) {
    for p in app.parts() {
        ring_write_with(ring, pos, p, copy);
        pos += p.len() as u64;
    }
}

/// The ring's bytes at positions `[pos, pos + len)` (a stream offset through
/// [`TxState::ring_pos`] or [`Plan::ring_pos`]), as at most two slices.
pub fn ring_slices(ring: &[u8], pos: u64, len: usize) -> (&[u8], &[u8]) {
    let cap = ring.len();
    let at = (pos % cap as u64) as usize;
    let first = len.min(cap - at);
    (&ring[at..at + first], &ring[..len - first])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offer_not_sent_yet_can_be_withdrawn_and_replaced_but_one_sent_cannot() {
        let lz4 = crate::connection::Chain::build("lz4").unwrap();
        let mut t = TxState::new(1 << 16);
        assert!(!t.withdraw_unsent_offer(), "no offer");
        let a = t.begin_offer(lz4.ids().unwrap(), 4096, true, None).unwrap();
        assert_eq!(t.begin_offer(0, 4096, true, None), Err(OfferError::Busy));
        assert!(t.withdraw_unsent_offer());
        let b = t.begin_offer(0, 4096, true, None).unwrap();
        assert_ne!(a, b, "a new number: an answer to the first is not taken for the second");
        assert_eq!(t.take_answer(crate::reliability::rx::ANSWER | 0x100 | a as u32, None, 0), None);
        // Once planned onto the link, it stays until answered (or the link is rebuilt).
        assert!(t.plan_offer(0).is_some());
        let p = t.plan_offer(0);
        assert!(p.is_none());
        assert!(!t.withdraw_unsent_offer(), "its frame is under way");
    }

    #[test]
    fn a_gather_skips_takes_and_copies_across_its_buffers() {
        let (a, b, c) = (&[1u8, 2, 3][..], &[][..], &[4u8, 5, 6, 7][..]);
        let g = Gather::new([a, b, c]).expect("three buffers fit");
        assert_eq!((g.len(), g.parts().len()), (7, 2));
        let flat = |g: Gather<'_>| g.parts().concat();
        for k in 0..=8 {
            let all: Vec<u8> = (1..=7).collect();
            assert_eq!(flat(g.skip(k)), all[k.min(7)..], "skip {k}");
            assert_eq!(flat(g.take(k)), all[..k.min(7)], "take {k}");
            assert_eq!(flat(g.skip(k).take(2)), all[k.min(7)..(k + 2).min(7)], "skip {k} take 2");
            assert!(g.skip(k).parts().iter().all(|p| !p.is_empty()));
        }
        assert!(Gather::new(std::iter::repeat_n(a, GATHER_PARTS + 1)).is_none());
        assert!(Gather::new(std::iter::repeat_n(a, GATHER_PARTS)).is_some());
        let none = Gather::new([&[][..], &[][..]]).expect("empty buffers take no place");
        assert!(none.is_empty() && none.parts().is_empty());
    }

    #[test]
    fn a_gathered_frame_goes_into_the_ring_as_one_flat_buffer_would() {
        let big: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let bufs: [&[u8]; 3] = [&[9; 5], &big, &[3; 11]];
        let flat: Vec<u8> = bufs.concat();
        // A ring of 4096 bytes that the frame wraps around.
        let (mut t1, mut t2) = (TxState::new(4096), TxState::new(4096));
        let (mut r1, mut r2) = (vec![0u8; 4096], vec![0u8; 4096]);
        for t in [&mut t1, &mut t2] {
            t.next_seq = 3000;
            t.wire_seq = 3000;
            t.acked = 3000;
        }
        let p1 = t1.plan_send(flat.len(), 0, false).expect("window open");
        let p2 = t2.plan_send(flat.len(), 0, false).expect("window open");
        let n1 = t1.commit(&p1, p1.header_len + p1.payload, &flat, &mut r1);
        let g = Gather::new(bufs).expect("fits");
        let n2 = t2.commit_gather(&p2, p2.header_len + p2.payload, g, &mut r2, |d, s| d.copy_from_slice(s));
        assert_eq!((n1, r1, t1.next_seq), (n2, r2, t2.next_seq));
    }

    #[test]
    fn partial_writes_keep_the_frame_and_the_window() {
        let mut tx = TxState::new(4096);
        let mut ring = vec![0u8; 4096];
        let app = vec![7u8; 5000];
        let p = tx.plan_send(app.len(), 0, false).unwrap();
        assert_eq!(p.payload, 4096, "window bounds the frame");
        // Only 10 header bytes go out: the whole frame is accepted, the rest is owed from
        // the ring.
        assert_eq!(tx.commit(&p, 10, &app, &mut ring), 4096);
        assert!(tx.in_frame());
        assert_eq!(tx.next_seq, 4096);
        assert_eq!(tx.plan_send(1, 0, false), Err(Blocked::Replaying));
        let p = tx.plan_replay(0).unwrap();
        assert_eq!((p.header_len, p.payload, p.source), (14, 4096, Source::Ring(0)));
        assert_eq!(tx.commit(&p, 14 + 100, &[], &mut ring), 0);
        let p = tx.plan_replay(0).unwrap();
        assert_eq!((p.header_len, p.payload, p.source), (0, 3996, Source::Ring(100)));
        assert_eq!(tx.commit(&p, 3996, &[], &mut ring), 0);
        assert!(!tx.in_frame());
        assert!(tx.plan_replay(0).is_none());
        assert_eq!(tx.plan_send(1, 0, false), Err(Blocked::Window));
        tx.on_ack(4096).unwrap();
        assert!(tx.on_ack(4097).is_err());
        assert!(tx.plan_send(1, 0, false).is_ok());
    }

    #[test]
    fn nothing_written_forgets_the_frame() {
        let mut tx = TxState::new(4096);
        let mut ring = vec![0u8; 4096];
        let p = tx.plan_send(100, 0, false).unwrap();
        assert_eq!(tx.commit(&p, 0, &[0; 100], &mut ring), 0);
        assert!(!tx.in_frame());
        assert!(tx.plan_control(FrameKind::Ack, 3).is_some());
    }

    #[test]
    fn a_tagged_acknowledgement_carries_its_tag_and_alone_counts_as_tagged() {
        let mut tx = TxState::new(4096);
        tx.set_auth(99);
        let mut ring = vec![0u8; 4096];
        // A data frame's and a plain acknowledgement's values are sent, not tagged.
        let p = tx.plan_send(10, 70, false).unwrap();
        tx.commit(&p, p.header_len + 10, &[1; 10], &mut ring);
        let p = tx.plan_ack(80, None).unwrap();
        assert_eq!(p.payload, 0);
        tx.commit(&p, HEADER_LEN, &[], &mut ring);
        assert_eq!((tx.ack_sent, tx.ack_tagged), (80, 0));
        // A tagged one, written in two pieces: counted once its header is out.
        let p = tx.plan_ack(90, Some(false)).unwrap();
        assert_eq!((p.header_len, p.payload), (HEADER_LEN, CTL_TAG as usize));
        let h = FrameHeader::decode(p.header_bytes().try_into().unwrap()).unwrap();
        assert_eq!((h.kind, h.len, h.seq, h.ack), (FrameKind::Ack, CTL_TAG, 10, 90));
        let tag = tx.control_payload(p.source);
        assert!(crate::auth::ack_mac_ok(&99u128.to_le_bytes(), false, 90, &tag));
        assert!(!crate::auth::ack_mac_ok(&99u128.to_le_bytes(), true, 90, &tag));
        tx.commit(&p, HEADER_LEN + 3, &[], &mut ring);
        assert_eq!((tx.ack_sent, tx.ack_tagged), (90, 90));
        assert!(tx.in_frame());
        let rest = tx.plan_replay(90).unwrap();
        assert_eq!(&tx.control_payload(rest.source)[3..], &tag[3..]);
        tx.commit(&rest, CTL_TAG as usize - 3, &[], &mut ring);
        assert!(!tx.in_frame());
        // A resume handshake's count is authenticated: it counts as tagged.
        tx.relink(10, 120).unwrap();
        assert_eq!(tx.ack_tagged, 120);
    }

    #[test]
    fn resync_rewinds_and_checks_range() {
        let mut tx = TxState::new(4096);
        let mut ring = vec![0u8; 4096];
        let app: Vec<u8> = (0..255).collect();
        let p = tx.plan_send(app.len(), 0, false).unwrap();
        tx.commit(&p, HEADER_LEN + 255, &app, &mut ring);
        tx.on_ack(50).unwrap();
        tx.link_reset();
        assert_eq!(tx.plan_send(1, 0, false), Err(Blocked::AwaitingResync));
        assert!(tx.resync(10).is_err());
        assert!(tx.resync(300).is_err());
        tx.resync(100).unwrap();
        assert_eq!(tx.plan_send(1, 0, false), Err(Blocked::Replaying));
        let p = tx.plan_replay(0).unwrap();
        assert_eq!((p.payload, p.source), (155, Source::Ring(100)));
        let (a, b) = ring_slices(&ring, p.ring_pos(100), 155);
        assert_eq!([a, b].concat(), app[100..]);
        tx.commit(&p, HEADER_LEN + 155, &[], &mut ring);
        assert!(tx.plan_replay(0).is_none());
        assert!(tx.plan_send(1, 0, false).is_ok());
    }

    #[test]
    fn an_empty_ring_is_written_from_its_start_again() {
        let mut tx = TxState::new(4096);
        let mut ring = vec![0u8; 4096];
        for round in 0..3u8 {
            let app = [round; 1000];
            let p = tx.plan_send(app.len(), 0, false).unwrap();
            assert_eq!(tx.ring_pos(tx.next_seq), 0, "round {round}: the ring was empty");
            tx.commit(&p, HEADER_LEN + 1000, &app, &mut ring);
            assert_eq!(ring[..1000], app);
            tx.on_ack(tx.next_seq).unwrap();
        }
        // Bytes still unacknowledged: the next frame follows them, and a replay finds them
        // where they were written.
        let p = tx.plan_send(500, 0, false).unwrap();
        tx.commit(&p, HEADER_LEN + 500, &[7; 500], &mut ring);
        let p = tx.plan_send(300, 0, false).unwrap();
        assert_eq!(tx.ring_pos(tx.next_seq), 500);
        tx.commit(&p, HEADER_LEN + 300, &[8; 300], &mut ring);
        tx.link_reset();
        tx.resync(3000).unwrap();
        let p = tx.plan_replay(0).unwrap();
        assert_eq!((p.payload, p.source), (800, Source::Ring(3000)));
        let (a, b) = ring_slices(&ring, p.ring_pos(3000), 800);
        assert_eq!([a, b].concat(), [[7u8; 500].as_slice(), &[8u8; 300]].concat());
    }

    #[test]
    fn ring_wraps() {
        let mut ring = vec![0u8; 8];
        ring_write(&mut ring, 6, &[1, 2, 3, 4]);
        let (a, b) = ring_slices(&ring, 6, 4);
        assert_eq!((a, b), (&[1u8, 2][..], &[3u8, 4][..]));
    }
}
