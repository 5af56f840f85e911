//! Receive half: parses frames out of what the link delivered, straight into the
//! application's buffer.
//!
//! Payload bytes are never staged inside the layer: a read asks the link for at most the
//! rest of the current frame's payload (plus the next header), or, at a frame boundary, for a
//! header and then payload in place, compacting payload over any headers found inside the
//! buffer. Because the layer holds no payload of its own, the kernel socket's readiness is
//! exactly the application's readiness (the only difference: a socket holding nothing but an
//! ack frame looks readable, which non-blocking readers see as `EAGAIN`).

use super::ProtoError;
use crate::connection::chain::{Chain, CODED_MAX};
use crate::wire::frame::{
    FrameError, FrameHeader, FrameKind, CTL_TAG, HEADER_LEN, MAGIC, MAX_CHAIN_SPEC, PLAIN,
};

/// How the next read from the link must be laid out (the segments of one `readv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadPlan {
    /// At a frame boundary: `header` bytes into [`RxState::header_slot`], then the
    /// application buffer (`app_max` bytes at most).
    HeaderFirst {
        /// Bytes still missing from the header (the slot's length).
        header: usize,
        /// Most application-buffer bytes to read.
        app_max: usize,
    },
    /// Inside a frame: `payload` bytes (never past the current frame) into the start of the
    /// application buffer; then, if that reaches the frame's end, the next header into the
    /// header slot (`header` = 24, else 0) and `rest` more bytes into the application buffer
    /// right after the first part (the next frame's payload lands where it belongs).
    PayloadFirst {
        /// Payload bytes of the current frame to read first.
        payload: usize,
        /// Header-slot bytes after them (0 or a whole header).
        header: usize,
        /// Application-buffer bytes after the header.
        rest: usize,
    },
}

impl ReadPlan {
    /// Most bytes one read may take.
    pub fn total(&self) -> usize {
        match *self {
            ReadPlan::HeaderFirst { header, app_max } => header + app_max,
            ReadPlan::PayloadFirst { payload, header, rest } => payload + header + rest,
        }
    }
}

/// What one read gave.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ingested {
    /// Payload bytes now at the start of the application buffer.
    pub payload: usize,
    /// Headers fully parsed (data or control).
    pub headers: usize,
}

/// Receive-side state. Plain data (`repr(C)`), so it can live in memory shared across `fork`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RxState {
    // (The fields every receive touches come first, in two cache lines with the cell's
    // flag: `SharedConn` puts the cell on a line of its own.)
    /// Payload bytes delivered to the application: the peer's stream offset we expect next.
    pub delivered: u64,
    /// Payload bytes of the current data frame not read yet.
    pub frame_rem: u64,
    /// Highest acknowledgement the peer sent (applies to our send half).
    pub peer_ack: u64,
    /// Bytes of `header` gathered so far.
    pub header_len: u32,
    /// 1 once the peer's end of stream (a Fin frame) arrived: no data may follow.
    pub fin: u32,
    /// The frame header being gathered (`header_len` bytes of it so far).
    header: [u8; HEADER_LEN],
    /// 1 when a resync frame is allowed (first frame on a rebuilt link).
    pub expect_resync: u32,
    /// 1 when `resync` holds a value.
    pub has_resync: u32,
    /// Bytes of a chain offer's description still to come (they go into `spec`, never to
    /// the application).
    pub ctl_rem: u32,
    /// 1 once the peer may send coded frames: reads take one frame at a time, and a coded
    /// frame's payload stays in the socket until the program has all of it.
    pub careful: u32,
    /// 1 when the peer's latest chain is empty: the first plain data frame ends `careful`
    /// (no coded frame can follow it, replays included).
    leave_careful: u32,
    /// The answer owed to the peer's last offer ([`ANSWER`] | taken << 8 | number, and
    /// [`MIRROR`] when the peer asked for its chain on our stream too), 0: none.
    pub answer_owed: u32,
    /// The peer's answer to our offer ([`ANSWER`] | taken << 8 | number), 0: none.
    pub answer_in: u32,
    /// Encoded payload bytes of the coded frame being read (0: none); its header is taken,
    /// its payload waits whole in the socket until the program has all of it.
    pub coded_len: u32,
    /// The peer's chain number that coded the last data frame of its stream, when that
    /// chain is keyed (0: the stream is not sealed). A sealed stream takes an end of stream
    /// only with a tag under that chain's key, and a data frame in clear only of a chain
    /// taken after the sealing one. An offer of a chain that would not seal the stream
    /// must carry a tag while the stream is sealed, or while the chain taken last is keyed
    /// (under the first's key, else the second's): so every chain taken after a keyed one
    /// was offered by the peer, not by someone on the path.
    sealed_no: u32,
    /// 1 once the peer took a keyed chain for our stream (its answer carried a key share),
    /// until it takes one with no keyed filter: our stream is sealed, and the peer's
    /// acknowledgements of it count only from frames that carry a tag under the
    /// connection's secret (`auth::ack_mac`: acks sent alone). The acknowledgement in every
    /// other frame's header is ignored: someone on the path who forged one could make our
    /// sender drop bytes a failover would need.
    ack_demand: u32,
    /// The peer's resync value, when one arrived and was not taken yet.
    pub resync: u64,
    /// Bytes of `spec` gathered so far.
    spec_len: u32,
    /// The chain number being offered.
    offer_no: u32,
    /// 1 when that offer asks for the chain both ways.
    offer_both: u32,
    spec: [u8; MAX_CHAIN_SPEC as usize],
    /// The peer's chains for its stream, by number: [`TAKEN`] and the compact form
    /// (`chain::Chain::ids`); 0 for a number never taken.
    pub chains: [u32; 16],
    /// The chain number of the coded frame being read (`coded_len`).
    pub coded_chain: u32,
    /// Decoded bytes of that frame the program already has.
    pub coded_taken: u32,
    /// Stream offset of that frame's first decoded byte.
    pub coded_seq: u64,
    /// 1 when this side cannot read coded frames (the sink cannot give its socket a
    /// receive buffer big enough): offers of chains with filters are refused. Set by the
    /// sink, not carried across `exec`.
    pub refuse_coding: u32,
    /// While the control payload being read is an answer's key share: the answer (as
    /// `answer_in` takes it once the share is here); 0 for an offer's description.
    ctl_answer: u32,
    /// The key of each of the peer's keyed chains, by number (zero for the others).
    keys: [[u8; KEY]; 16],
    /// This side's random seed for its halves of the key exchanges (zero until the first
    /// keyed offer).
    kx_seed: [u8; KEY],
    /// This side's key share for the answer owed (a keyed chain taken).
    pub answer_share: [u8; KEY],
    /// The peer's key share that came with its answer to our offer (zero: none).
    pub share_in: [u8; KEY],
    /// The connection's secret: the key of the tags of the peer's key shares.
    auth: [u8; 16],
    /// Offers taken so far, when each number was taken last (that count then), when the
    /// empty chain (whose frames carry number 0) was, and the number taken last.
    takes: u32,
    taken_at: [u32; 16],
    empty_at: u32,
    latest_no: u32,
    /// What the control payload being read is: [`CTL_IS_FIN`] a Fin's tag, [`CTL_IS_ACK`]
    /// an acknowledgement's tag (its value is in `header`, the frame's), 0 neither.
    ctl_fin: u32,
    /// 1 on the side that connected: the side the peer's acknowledgement tags name.
    active: u32,
}

/// `RxState::ctl_fin`: the control payload being read is a Fin's tag.
const CTL_IS_FIN: u32 = 1;
/// `RxState::ctl_fin`: the control payload being read is an acknowledgement's tag.
const CTL_IS_ACK: u32 = 2;

/// Bytes of a key share and of a key.
const KEY: usize = crate::connection::aead::KEY_LEN;

/// `RxState::chains`: the number was taken (its compact form may be 0, the empty chain).
pub const TAKEN: u32 = 1 << 31;
/// `RxState::answer_owed` / `answer_in`: an answer is there.
pub const ANSWER: u32 = 1 << 16;
/// `RxState::answer_owed`: the offer taken asked for the same chain on our stream.
pub const MIRROR: u32 = 1 << 17;

impl Default for RxState {
    fn default() -> Self {
        Self::new()
    }
}

// (The fields every receive touches fit in 120 bytes: two cache lines with the flag of the
// cell that holds the state.)
const _: () = assert!(std::mem::offset_of!(RxState, ack_demand) + 4 <= 120);

impl RxState {
    /// The state as bytes (little endian, field by field) for a record that crosses
    /// `exec` (see [`crate::handover`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::BYTES);
        for v in [self.delivered, self.frame_rem, self.peer_ack, self.resync] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [self.has_resync, self.expect_resync, self.header_len] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.header);
        b.extend_from_slice(&self.fin.to_le_bytes());
        for v in [self.ctl_rem, self.spec_len, self.offer_no] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.spec);
        for v in self.chains {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [
            self.careful,
            self.leave_careful,
            self.answer_owed,
            self.answer_in,
            self.coded_len,
            self.coded_chain,
            self.coded_taken,
            self.offer_both,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.coded_seq.to_le_bytes());
        b.extend_from_slice(&self.ctl_answer.to_le_bytes());
        for k in self.keys.iter().chain([&self.kx_seed, &self.answer_share, &self.share_in]) {
            b.extend_from_slice(k);
        }
        b.extend_from_slice(&self.auth);
        for v in [self.sealed_no, self.takes, self.empty_at, self.latest_no, self.ctl_fin]
            .iter()
            .chain(&self.taken_at)
            .chain(&[self.ack_demand, self.active])
        {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Length of [`to_bytes`](Self::to_bytes).
    pub const BYTES: usize = 4 * 8
        + 3 * 4
        + HEADER_LEN
        + 4
        + 3 * 4
        + MAX_CHAIN_SPEC as usize
        + 16 * 4
        + 8 * 4
        + 8
        + 4
        + 19 * KEY
        + 16
        + 5 * 4
        + 16 * 4
        + 2 * 4;

    /// The state [`to_bytes`](Self::to_bytes) wrote; `None` for bytes of another length or
    /// values that cannot be (flags other than 0 and 1, a header longer than a header,
    /// a frame larger than the largest payload).
    pub fn from_bytes(b: &[u8]) -> Option<RxState> {
        if b.len() != Self::BYTES {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let mut r = RxState {
            delivered: u64_at(0),
            frame_rem: u64_at(8),
            peer_ack: u64_at(16),
            resync: u64_at(24),
            has_resync: u32_at(32),
            expect_resync: u32_at(36),
            header_len: u32_at(40),
            header: b[44..44 + HEADER_LEN].try_into().expect("header"),
            fin: u32_at(44 + HEADER_LEN),
            ctl_rem: u32_at(48 + HEADER_LEN),
            spec_len: u32_at(52 + HEADER_LEN),
            offer_no: u32_at(56 + HEADER_LEN),
            spec: b[60 + HEADER_LEN..60 + HEADER_LEN + MAX_CHAIN_SPEC as usize].try_into().expect("spec"),
            // (The rest is read below.)
            ..RxState::new()
        };
        let c = 60 + HEADER_LEN + MAX_CHAIN_SPEC as usize;
        for (i, v) in r.chains.iter_mut().enumerate() {
            *v = u32_at(c + 4 * i);
        }
        let m = c + 64;
        r.careful = u32_at(m);
        r.leave_careful = u32_at(m + 4);
        r.answer_owed = u32_at(m + 8);
        r.answer_in = u32_at(m + 12);
        r.coded_len = u32_at(m + 16);
        r.coded_chain = u32_at(m + 20);
        r.coded_taken = u32_at(m + 24);
        r.offer_both = u32_at(m + 28);
        r.coded_seq = u64_at(m + 32);
        r.ctl_answer = u32_at(m + 40);
        let mut at = m + 44;
        for k in r.keys.iter_mut().chain([&mut r.kx_seed, &mut r.answer_share, &mut r.share_in]) {
            k.copy_from_slice(&b[at..at + KEY]);
            at += KEY;
        }
        r.auth.copy_from_slice(&b[at..at + 16]);
        at += 16;
        r.sealed_no = u32_at(at);
        r.takes = u32_at(at + 4);
        r.empty_at = u32_at(at + 8);
        r.latest_no = u32_at(at + 12);
        r.ctl_fin = u32_at(at + 16);
        for (i, v) in r.taken_at.iter_mut().enumerate() {
            *v = u32_at(at + 20 + 4 * i);
        }
        r.ack_demand = u32_at(at + 84);
        r.active = u32_at(at + 88);
        let answer_ok = |a: u32| a == 0 || (a & ANSWER != 0 && a & !(ANSWER | MIRROR | 0x1ff) == 0);
        // (Summed wide: the record comes from the environment, and any value may be there.)
        let spec_total = u64::from(r.spec_len) + u64::from(r.ctl_rem);
        let sane = r.has_resync <= 1
            && r.expect_resync <= 1
            && r.header_len as usize <= HEADER_LEN
            && r.frame_rem <= crate::wire::frame::MAX_PAYLOAD as u64
            && r.fin <= 1
            && spec_total <= u64::from(MAX_CHAIN_SPEC)
            && answer_ok(r.ctl_answer)
            && (r.ctl_rem == 0 || r.header_len == 0)
            && r.offer_no <= 15
            && r.offer_both <= 1
            && r.chains.iter().all(|&v| v == 0 || (v & TAKEN != 0 && Chain::from_ids(v & !TAKEN).is_some()))
            && r.careful <= 1
            && r.leave_careful <= 1
            && answer_ok(r.answer_owed)
            && answer_ok(r.answer_in)
            && r.coded_len <= crate::wire::frame::MAX_PAYLOAD
            && r.coded_chain <= 15
            && (r.coded_len == 0 || (r.frame_rem == 0 && r.careful == 1))
            && r.sealed_no <= 15
            && r.latest_no <= 15
            && r.empty_at <= r.takes
            && r.taken_at.iter().all(|&t| t <= r.takes)
            && r.ctl_fin <= CTL_IS_ACK
            && (r.ctl_fin == 0 || (r.ctl_answer == 0 && spec_total == u64::from(CTL_TAG)))
            && r.ack_demand <= 1
            && r.active <= 1;
        sane.then_some(r)
    }
    /// A fresh receive half.
    pub fn new() -> Self {
        RxState {
            delivered: 0,
            frame_rem: 0,
            peer_ack: 0,
            resync: 0,
            has_resync: 0,
            expect_resync: 0,
            header_len: 0,
            header: [0; HEADER_LEN],
            fin: 0,
            ctl_rem: 0,
            spec_len: 0,
            offer_no: 0,
            offer_both: 0,
            spec: [0; MAX_CHAIN_SPEC as usize],
            chains: [0; 16],
            careful: 0,
            leave_careful: 0,
            answer_owed: 0,
            answer_in: 0,
            coded_len: 0,
            coded_chain: 0,
            coded_taken: 0,
            coded_seq: 0,
            refuse_coding: 0,
            ctl_answer: 0,
            keys: [[0; KEY]; 16],
            kx_seed: [0; KEY],
            answer_share: [0; KEY],
            share_in: [0; KEY],
            auth: [0; 16],
            sealed_no: 0,
            takes: 0,
            taken_at: [0; 16],
            empty_at: 0,
            latest_no: 0,
            ctl_fin: 0,
            ack_demand: 0,
            active: 0,
        }
    }

    /// Bytes the next read may put into [`header_slot`](Self::header_slot).
    fn slot_len(&self) -> usize {
        if self.ctl_rem > 0 {
            self.ctl_rem as usize
        } else {
            HEADER_LEN - self.header_len as usize
        }
    }

    /// Sets the key of the peer's key shares' tags and acknowledgements' tags, the
    /// connection's secret, and which side this is (`active`: the side that connected).
    pub fn set_auth(&mut self, secret: u128, active: bool) {
        self.auth = secret.to_le_bytes();
        self.active = active as u32;
    }

    /// True when the chain the peer's stream took last is keyed: this side then tags the
    /// acknowledgements it sends alone (`auth::ack_mac`), as the peer counts no other once
    /// it has our answer (see `ack_demand`). From the moment the offer is taken, before
    /// the answer goes, so every acknowledgement after the answer carries a tag.
    pub fn tags_acks(&self) -> bool {
        self.latest_key().is_some()
    }

    /// True while the peer's acknowledgements of our stream count only with a tag.
    pub fn acks_need_tags(&self) -> bool {
        self.ack_demand != 0
    }

    /// The key of the peer's chain number `no` (zero for a chain with no keyed filter).
    pub fn chain_key(&self, no: u32) -> &[u8; KEY] {
        &self.keys[no as usize & 15]
    }

    /// The key of the chain that sealed the peer's last data frame, if the stream is sealed.
    fn seal_key(&self) -> Option<&[u8; KEY]> {
        let k = &self.keys[self.sealed_no as usize & 15];
        (self.sealed_no != 0 && *k != [0; KEY]).then_some(k)
    }

    /// A fresh receive half whose peer's stream is already sealed by its chain number `no`
    /// (compact form `ids`, key `key`), as after an exchange and a first sealed frame: for
    /// tests and fuzzing of what a sealed stream refuses.
    pub fn sealed_by(no: u8, ids: u32, key: [u8; KEY]) -> Option<RxState> {
        let no = no as usize;
        if !(1..16).contains(&no) || !Chain::ids_keyed(ids) {
            return None;
        }
        let mut r = RxState::new();
        r.chains[no] = TAKEN | ids;
        r.keys[no] = key;
        r.careful = 1;
        r.takes = 1;
        r.taken_at[no] = 1;
        r.latest_no = no as u32;
        r.sealed_no = no as u32;
        Some(r)
    }

    /// This state with our stream sealed too: the peer's acknowledgements count only with a
    /// tag under `secret` (as after its answer taking a keyed chain of ours). For fuzzing
    /// what such a receive half refuses.
    pub fn with_tagged_acks(mut self, secret: u128, active: bool) -> RxState {
        self.set_auth(secret, active);
        self.ack_demand = 1;
        self
    }

    /// The key of the chain taken last, if it is keyed.
    fn latest_key(&self) -> Option<&[u8; KEY]> {
        let k = &self.keys[self.latest_no as usize & 15];
        (self.latest_no != 0 && *k != [0; KEY]).then_some(k)
    }

    /// The compact form of the peer's chain number `no`, if taken.
    pub fn chain_ids(&self, no: u32) -> Option<u32> {
        let v = *self.chains.get(no as usize)?;
        (v & TAKEN != 0).then_some(v & !TAKEN)
    }

    /// The coded frame whose header was taken holds its bytes as they were behind a tag byte
    /// of `0` (see `Chain::ids_store_plain`), and that byte is taken: the rest is read as a
    /// plain frame's payload, straight into the program's buffer.
    pub fn take_stored(&mut self) -> Result<(), ProtoError> {
        if self.coded_len < 2 || self.coded_taken != 0 || self.frame_rem != 0 {
            return Err(ProtoError::Undecodable);
        }
        self.frame_rem = self.coded_len as u64 - 1;
        self.coded_done();
        Ok(())
    }

    /// The decoded bytes of the coded frame being read were all given to the program (its
    /// payload was taken off the socket), or the link that carried it is gone.
    pub fn coded_done(&mut self) {
        self.coded_len = 0;
        self.coded_taken = 0;
    }

    /// `n` more decoded bytes of the coded frame being read went to the program.
    pub fn coded_delivered(&mut self, n: usize) {
        self.coded_taken += n as u32;
        self.delivered += n as u64;
    }

    /// Takes the answer owed to the peer's offer (number, taken).
    pub fn take_answer_owed(&mut self) -> Option<(u8, bool, bool)> {
        let a = std::mem::take(&mut self.answer_owed);
        (a != 0).then_some((a as u8, a & 0x100 != 0, a & MIRROR != 0))
    }

    /// Decides the layout of the next read for an application buffer of `app_len` bytes.
    pub fn plan_read(&self, app_len: usize) -> ReadPlan {
        if self.careful != 0 {
            // One frame at a time: a coded frame's header must be read before its payload.
            return if self.frame_rem > 0 {
                let payload = (app_len as u64).min(self.frame_rem) as usize;
                ReadPlan::PayloadFirst { payload, header: 0, rest: 0 }
            } else {
                self.header_only_plan()
            };
        }
        if self.frame_rem > 0 {
            let payload = (app_len as u64).min(self.frame_rem) as usize;
            if payload as u64 == self.frame_rem {
                ReadPlan::PayloadFirst { payload, header: HEADER_LEN, rest: app_len - payload }
            } else {
                ReadPlan::PayloadFirst { payload, header: 0, rest: 0 }
            }
        } else {
            ReadPlan::HeaderFirst { header: self.slot_len(), app_max: app_len }
        }
    }

    /// True when `peeked`, the first bytes waiting on the link (looked at, not taken), begin
    /// with a plain data frame at this side's stream position and at least one byte of its
    /// payload: the program's next read gets bytes, so the link is readable for it without
    /// taking anything off it first. False whenever anything else could be the case (a
    /// control frame first, a coded frame, a header in pieces, a rebuilt link's first frame,
    /// a frame this side would refuse): then the frames are taken one by one.
    pub fn data_ahead(&self, peeked: &[u8]) -> bool {
        let Some(head) = peeked.get(..HEADER_LEN) else { return false };
        if peeked.len() == HEADER_LEN
            || self.header_len != 0
            || self.ctl_rem != 0
            || self.frame_rem != 0
            || self.coded_len != 0
            || self.fin != 0
            || self.expect_resync != 0
            || self.has_resync != 0
            || self.sealed_no != 0
        {
            return false;
        }
        let Ok(h) = FrameHeader::decode(head.try_into().expect("a header's length")) else { return false };
        h.kind == FrameKind::Data && h.chain == 0 && h.len > 0 && h.seq == self.delivered
    }

    /// A read of header bytes only (used to take ack frames without touching payload).
    pub fn header_only_plan(&self) -> ReadPlan {
        ReadPlan::HeaderFirst { header: self.slot_len(), app_max: 0 }
    }

    /// Does what a `readv` laid out as `plan` does with the bytes `src` (for simulations,
    /// tests and fuzzing), then [`ingest`](Self::ingest)s them. Returns the bytes taken and
    /// what they gave.
    pub fn read_from(
        &mut self,
        plan: ReadPlan,
        src: &[u8],
        app: &mut [u8],
    ) -> (usize, Result<Ingested, ProtoError>) {
        let got = src.len().min(plan.total());
        let src = &src[..got];
        match plan {
            ReadPlan::HeaderFirst { header, .. } => {
                let h = got.min(header);
                self.header_slot()[..h].copy_from_slice(&src[..h]);
                app[..got - h].copy_from_slice(&src[h..]);
            }
            ReadPlan::PayloadFirst { payload, header, .. } => {
                let p = got.min(payload);
                app[..p].copy_from_slice(&src[..p]);
                let h = (got - p).min(header);
                self.header_slot()[..h].copy_from_slice(&src[p..p + h]);
                app[p..p + got - p - h].copy_from_slice(&src[p + h..]);
            }
        }
        (got, self.ingest(plan, got, app))
    }

    /// The buffer the next header bytes go into (or, while a chain offer's description is
    /// being read, the rest of it).
    pub fn header_slot(&mut self) -> &mut [u8] {
        if self.ctl_rem > 0 {
            let at = self.spec_len as usize;
            return &mut self.spec[at..at + self.ctl_rem as usize];
        }
        &mut self.header[self.header_len as usize..]
    }

    /// `h` bytes went into the header slot.
    #[inline]
    fn slot_filled(&mut self, h: usize, out: &mut Ingested) -> Result<(), ProtoError> {
        if h == 0 {
            return Ok(());
        }
        if self.ctl_rem > 0 {
            self.ctl_rem -= h as u32;
            self.spec_len += h as u32;
            if self.ctl_rem == 0 {
                self.finish_ctl()?;
            }
            return Ok(());
        }
        self.header_len += h as u32;
        self.check_partial()?;
        if self.header_len as usize == HEADER_LEN {
            self.finish_header(out)?;
        }
        Ok(())
    }

    /// Takes the result of a read made as `plan` said: `got` bytes in all, laid out in the
    /// header slot and `app` (the application buffer) in the plan's order. Payload ends up
    /// compacted at the start of `app`.
    pub fn ingest(&mut self, plan: ReadPlan, got: usize, app: &mut [u8]) -> Result<Ingested, ProtoError> {
        let mut out = Ingested::default();
        match plan {
            ReadPlan::PayloadFirst { payload, header, .. } => {
                let p = got.min(payload);
                self.frame_rem -= p as u64;
                self.delivered += p as u64;
                out.payload = p;
                let h = (got - p).min(header);
                if h > 0 {
                    debug_assert!(self.frame_rem == 0 && self.header_len == 0 && self.ctl_rem == 0);
                    self.slot_filled(h, &mut out)?;
                }
                let u = got - p - h;
                if u > 0 {
                    // The next frame's payload (and maybe more frames) right after ours.
                    let mut more = Ingested::default();
                    self.parse_in_place(&mut app[p..], u, &mut more)?;
                    out.payload += more.payload;
                    out.headers += more.headers;
                }
            }
            ReadPlan::HeaderFirst { header, .. } => {
                let h = got.min(header);
                self.slot_filled(h, &mut out)?;
                self.parse_in_place(app, got - h, &mut out)?;
            }
        }
        Ok(out)
    }

    /// The usual receive of a small message, decided in a few loads: `buf` (bytes straight
    /// off the link) is exactly one whole plain data frame at this side's stream position,
    /// and nothing is in progress (no header or frame begun, no control payload, no coded
    /// frame, no resync expected, no end, no sealed stream). Then the frame is taken, as
    /// [`parse_buffer`](Self::parse_buffer) would take it, and its payload is
    /// `buf[HEADER_LEN..]` (not moved). `None`: nothing was taken or changed, and
    /// `parse_buffer` takes the bytes (whatever they are, errors included).
    #[inline]
    pub fn take_plain_frame(&mut self, buf: &[u8]) -> Option<usize> {
        if (self.frame_rem | u64::from(self.header_len | self.ctl_rem | self.coded_len))
            | u64::from(self.expect_resync | self.fin | self.sealed_no | self.leave_careful)
            != 0
        {
            return None;
        }
        let h = FrameHeader::decode(buf.get(..HEADER_LEN)?.try_into().ok()?).ok()?;
        if h.kind != FrameKind::Data
            || h.chain != 0
            || h.seq != self.delivered
            || (h.ack < self.peer_ack && self.ack_demand == 0)
            || buf.len() - HEADER_LEN != h.len as usize
        {
            return None;
        }
        if self.ack_demand == 0 {
            self.peer_ack = h.ack;
        }
        self.delivered += u64::from(h.len);
        Some(h.len as usize)
    }

    /// Parses bytes straight off the link (continuing any frame or header in progress),
    /// compacting payload at the start of `buf`.
    pub fn parse_buffer(&mut self, buf: &mut [u8]) -> Result<Ingested, ProtoError> {
        let mut out = Ingested::default();
        let n = buf.len();
        self.parse_in_place(buf, n, &mut out)?;
        Ok(out)
    }

    /// Walks `app[..len]` (bytes straight off the link), moving payload down to `out.payload`.
    fn parse_in_place(&mut self, app: &mut [u8], len: usize, out: &mut Ingested) -> Result<(), ProtoError> {
        let mut cur = 0;
        while cur < len {
            if self.frame_rem > 0 {
                let take = ((len - cur) as u64).min(self.frame_rem) as usize;
                if out.payload != cur {
                    app.copy_within(cur..cur + take, out.payload);
                }
                out.payload += take;
                cur += take;
                self.frame_rem -= take as u64;
                self.delivered += take as u64;
            } else if self.ctl_rem > 0 {
                let take = (len - cur).min(self.ctl_rem as usize);
                let at = self.spec_len as usize;
                self.spec[at..at + take].copy_from_slice(&app[cur..cur + take]);
                cur += take;
                self.slot_filled(take, out)?;
            } else if self.coded_len > 0 {
                // A coded frame's payload is read whole by the sink, never in place.
                return Err(ProtoError::CodedInPlace);
            } else if self.header_len == 0 && len - cur >= HEADER_LEN {
                // A whole header here (the common case): decoded where it lies, which checks
                // everything `check_partial` would.
                self.header.copy_from_slice(&app[cur..cur + HEADER_LEN]);
                cur += HEADER_LEN;
                self.finish_header(out)?;
            } else {
                let at = self.header_len as usize;
                let take = (len - cur).min(HEADER_LEN - at);
                self.header[at..at + take].copy_from_slice(&app[cur..cur + take]);
                self.header_len += take as u32;
                cur += take;
                self.check_partial()?;
                if self.header_len as usize == HEADER_LEN {
                    self.finish_header(out)?;
                }
            }
        }
        Ok(())
    }

    /// Refuses a header as soon as its first bytes are wrong (a peer that sends a few bytes of
    /// garbage and waits must not leave the connection hanging).
    fn check_partial(&self) -> Result<(), ProtoError> {
        let n = self.header_len as usize;
        let h = &self.header;
        if n >= 1 && h[0] != MAGIC {
            return Err(FrameError::BadMagic(h[0]).into());
        }
        if n >= 2 && !(1..=7).contains(&h[1]) {
            return Err(FrameError::UnknownKind(h[1]).into());
        }
        let allowed = match h[1] {
            1 => 0x1f,
            6 | 7 => 0x01,
            _ => 0,
        };
        if n >= 4 && (h[2] & !allowed != 0 || h[3] != 0) {
            return Err(FrameError::BadFlags(u16::from_le_bytes([h[2], h[3]])).into());
        }
        Ok(())
    }

    fn finish_header(&mut self, out: &mut Ingested) -> Result<(), ProtoError> {
        self.header_len = 0;
        let h = FrameHeader::decode(&self.header)?;
        out.headers += 1;
        let first = self.expect_resync != 0;
        self.expect_resync = 0;
        match h.kind {
            FrameKind::Resync if first => {
                self.resync = h.ack;
                self.has_resync = 1;
                return Ok(());
            }
            FrameKind::Resync => return Err(ProtoError::UnexpectedResync),
            _ if first => return Err(ProtoError::MissingResync),
            FrameKind::Abort => return Err(ProtoError::PeerAborted),
            FrameKind::ChainOffer | FrameKind::ChainAnswer => {
                // `seq` numbers the chain; the acknowledgement counts as on any frame.
                if !(1..=15).contains(&h.seq) {
                    return Err(ProtoError::BadChain(h.seq.min(255) as u8));
                }
                self.take_ack(h.ack)?;
                if h.kind == FrameKind::ChainAnswer {
                    let a = ANSWER | (h.chain as u32) << 8 | h.seq as u32;
                    self.share_in = [0; KEY];
                    if h.len > 0 {
                        // Its key share follows: the answer counts once it is here.
                        self.spec_len = 0;
                        self.ctl_rem = h.len;
                        self.ctl_answer = a;
                    } else {
                        if h.chain & 1 != 0 {
                            // A chain with no keyed filter taken: our stream is not sealed
                            // from its first frame on, and plain acknowledgements count.
                            self.ack_demand = 0;
                        }
                        self.answer_in = a;
                    }
                } else {
                    self.offer_no = h.seq as u32;
                    self.offer_both = h.chain as u32;
                    self.spec_len = 0;
                    self.ctl_rem = h.len;
                    self.ctl_answer = 0;
                }
                return Ok(());
            }
            FrameKind::Data | FrameKind::Ack | FrameKind::Fin => {}
        }
        if h.seq != self.delivered {
            return Err(ProtoError::OutOfOrder { got: h.seq, expected: self.delivered });
        }
        if h.kind == FrameKind::Data && self.fin != 0 {
            return Err(ProtoError::DataAfterFin);
        }
        if h.kind == FrameKind::Ack && h.len == CTL_TAG {
            // Its tag follows: the acknowledgement counts once it is checked.
            self.spec_len = 0;
            self.ctl_rem = CTL_TAG;
            self.ctl_answer = 0;
            self.ctl_fin = CTL_IS_ACK;
            return Ok(());
        }
        self.take_ack(h.ack)?;
        if h.kind == FrameKind::Fin {
            match (self.seal_key().is_some(), h.len) {
                (false, 0) => self.fin = 1,
                (true, CTL_TAG) => {
                    // Its tag follows: the end of stream counts once it is checked.
                    self.spec_len = 0;
                    self.ctl_rem = CTL_TAG;
                    self.ctl_answer = 0;
                    self.ctl_fin = CTL_IS_FIN;
                }
                (true, _) => return Err(ProtoError::ControlForged("an end of stream with no tag")),
                (false, _) => return Err(ProtoError::ControlForged("a tagged end of stream")),
            }
            return Ok(());
        }
        if h.kind == FrameKind::Data && h.chain & PLAIN != 0 {
            // A frame of chain `no` that no filter of it would change: plain bytes, read as
            // any plain frame (a frame of a chain taken before an empty one may still be one).
            let no = h.chain & !PLAIN;
            let ids = self.chain_ids(no as u32).ok_or(ProtoError::BadChain(no))?;
            if Chain::ids_keyed(ids) {
                return Err(ProtoError::ControlForged("a data frame in clear"));
            }
            if self.sealed_no != 0 {
                if self.taken_at[no as usize] <= self.taken_at[self.sealed_no as usize] {
                    return Err(ProtoError::ControlForged("a data frame in clear"));
                }
                self.sealed_no = 0;
            }
            self.frame_rem = h.len as u64;
            return Ok(());
        }
        if h.kind == FrameKind::Data {
            let ids = match h.chain {
                0 => 0,
                k => self.chain_ids(k as u32).ok_or(ProtoError::BadChain(k))?,
            };
            if Chain::ids_keyed(ids) {
                // (Its record is opened with that chain's key, which authenticates it.)
                self.sealed_no = h.chain as u32;
            } else if self.sealed_no != 0 {
                // In clear after sealed frames: only from a chain taken since the sealing
                // one (frames of chains taken before it may not follow its frames).
                let at = if h.chain == 0 { self.empty_at } else { self.taken_at[h.chain as usize] };
                if at <= self.taken_at[self.sealed_no as usize] {
                    return Err(ProtoError::ControlForged("a data frame in clear"));
                }
                self.sealed_no = 0;
            }
            if ids == 0 {
                if self.leave_careful != 0 {
                    // Every frame from here on is plain (replays included): fast reads again.
                    self.leave_careful = 0;
                    self.careful = 0;
                }
                self.frame_rem = h.len as u64;
            } else {
                if self.careful == 0 {
                    return Err(ProtoError::BadChain(h.chain));
                }
                if h.len as usize > CODED_MAX {
                    // It could never be read whole: refused rather than waited for.
                    return Err(FrameError::BadLength(h.len).into());
                }
                self.coded_len = h.len;
                self.coded_chain = h.chain as u32;
                self.coded_taken = 0;
                self.coded_seq = h.seq;
            }
        }
        Ok(())
    }

    /// The acknowledgement in a frame's header, which has no tag: it counts unless our
    /// stream is sealed (`ack_demand`).
    fn take_ack(&mut self, ack: u64) -> Result<(), ProtoError> {
        if self.ack_demand != 0 {
            return Ok(());
        }
        self.take_checked_ack(ack)
    }

    fn take_checked_ack(&mut self, ack: u64) -> Result<(), ProtoError> {
        if ack < self.peer_ack {
            return Err(ProtoError::AckWentBack { ack, before: self.peer_ack });
        }
        self.peer_ack = ack;
        Ok(())
    }

    /// A control frame's payload is read whole: an offer's description, or an answer's
    /// key share.
    fn finish_ctl(&mut self) -> Result<(), ProtoError> {
        if self.ctl_fin == CTL_IS_ACK {
            self.ctl_fin = 0;
            self.spec_len = 0;
            // (The frame's header is still where it was gathered.)
            let ack = u64::from_le_bytes(self.header[16..24].try_into().expect("8 bytes"));
            let from_active = self.active == 0;
            let tag = &self.spec[..CTL_TAG as usize];
            if !crate::auth::ack_mac_ok(&self.auth, from_active, ack, tag) {
                return Err(ProtoError::ControlForged("an acknowledgement"));
            }
            return self.take_checked_ack(ack);
        }
        if self.ctl_fin != 0 {
            self.ctl_fin = 0;
            self.spec_len = 0;
            let key = self.seal_key().copied().unwrap_or_default();
            let tag = &self.spec[..CTL_TAG as usize];
            let at = self.delivered;
            if !crate::connection::aead::control_tag_ok(&key, FrameKind::Fin as u8, at, &[], tag) {
                return Err(ProtoError::ControlForged("an end of stream"));
            }
            self.fin = 1;
            return Ok(());
        }
        if self.ctl_answer == 0 {
            return self.finish_offer();
        }
        let no = self.ctl_answer as u8;
        let share =
            crate::connection::aead::open_share(&self.auth, false, no, &self.spec[..self.spec_len as usize]);
        self.spec_len = 0;
        self.share_in = share.ok_or(ProtoError::ShareForged)?;
        // A keyed chain taken for our stream: from here on the peer tags its
        // acknowledgements (it has since it took the offer).
        self.ack_demand = 1;
        self.answer_in = std::mem::take(&mut self.ctl_answer);
        Ok(())
    }

    /// The peer's offer is read whole: take the chain if this build knows every filter of
    /// it (and, for a keyed chain, a key comes from the offer's share), and owe the answer.
    /// From a taken chain with filters on, reads go one frame at a time (`careful`); the
    /// rest of the read that brought the offer is plain, as the peer codes nothing before
    /// our answer.
    fn finish_offer(&mut self) -> Result<(), ProtoError> {
        let payload = &self.spec[..self.spec_len as usize];
        let (text, mut share) = match payload.iter().position(|&b| b == 0) {
            Some(at) => (&payload[..at], Some(&payload[at + 1..])),
            None => (payload, None),
        };
        // On a sealed stream, an offer of a chain that would not seal it must carry a tag
        // under the sealing key in place of a share.
        let tagged = share.is_some_and(|s| s.len() == crate::connection::aead::CTL_TAG);
        if let Some(key) = self.seal_key().or_else(|| self.latest_key()) {
            let keyed = Chain::build(std::str::from_utf8(text).unwrap_or("?"))
                .and_then(|c| c.ids())
                .is_some_and(Chain::ids_keyed);
            if !keyed {
                let no = self.offer_no as u64;
                let ok = tagged
                    && crate::connection::aead::control_tag_ok(
                        key,
                        FrameKind::ChainOffer as u8,
                        no,
                        text,
                        share.unwrap_or_default(),
                    );
                if !ok {
                    return Err(ProtoError::ControlForged("a change of chain"));
                }
                share = None;
            }
        } else if tagged {
            // A tag where none is owed: the stream is not sealed, so an offer counts without
            // one, and the tag is dropped. (An offer our answer did not reach before its
            // link failed comes again on the new link as it was, tagged under the key of the
            // sealing chain before it, while the chain taken last here is the offered one.)
            share = None;
        }
        let spec = std::str::from_utf8(text).unwrap_or("?");
        let spec = if spec == "-" { "" } else { spec };
        let no = self.offer_no;
        self.answer_share = [0; KEY];
        let mut ids =
            Chain::build(spec).and_then(|c| c.ids()).filter(|&ids| ids == 0 || self.refuse_coding == 0);
        let mut key = [0; KEY];
        if let Some(i) = ids {
            let keyed = Chain::ids_keyed(i);
            let taken = match share {
                // A share with a chain that needs none, or none with one that does: refused.
                None => !keyed,
                Some(_) if !keyed => false,
                Some(s) => {
                    let offer = crate::connection::aead::open_share(&self.auth, true, no as u8, s)
                        .ok_or(ProtoError::ShareForged)?;
                    if self.kx_seed == [0; KEY] {
                        self.kx_seed = crate::connection::aead::random_secret().unwrap_or_default();
                    }
                    let spec = crate::connection::chain::spec_of_ids(i).unwrap_or_default();
                    match (self.kx_seed != [0; KEY])
                        .then(|| crate::connection::aead::answer(&self.kx_seed, &spec, no as u8, &offer))
                        .flatten()
                    {
                        Some((ours, k)) => {
                            self.answer_share = ours;
                            key = k;
                            true
                        }
                        None => false,
                    }
                }
            };
            if !taken {
                ids = None;
            }
        }
        self.spec_len = 0;
        self.answer_owed = ANSWER | no | (ids.is_some() as u32) << 8;
        let Some(ids) = ids else { return Ok(()) };
        self.takes += 1;
        self.taken_at[no as usize] = self.takes;
        if ids == 0 {
            self.empty_at = self.takes;
        }
        self.latest_no = no;
        self.keys[no as usize] = key;
        if self.offer_both != 0 {
            self.answer_owed |= MIRROR;
        }
        self.chains[no as usize] = TAKEN | ids;
        if ids != 0 {
            self.careful = 1;
            self.leave_careful = 0;
        } else if self.careful != 0 {
            self.leave_careful = 1;
        }
        Ok(())
    }

    /// Takes the peer's resync value, if one arrived.
    pub fn take_resync(&mut self) -> Option<u64> {
        if self.has_resync != 0 {
            self.has_resync = 0;
            Some(self.resync)
        } else {
            None
        }
    }

    /// A new link replaced the old one after a handshake that already told the peer what was
    /// delivered (and told us what the peer delivered, `peer_delivered`, which acknowledges
    /// our stream up to there): partial frames are gone; the next frame starts a clean one.
    pub fn relink(&mut self, peer_delivered: u64) {
        self.frame_rem = 0;
        self.header_len = 0;
        self.ctl_rem = 0;
        self.ctl_answer = 0;
        self.ctl_fin = 0;
        self.spec_len = 0;
        self.coded_done();
        self.expect_resync = 0;
        self.has_resync = 0;
        self.peer_ack = self.peer_ack.max(peer_delivered);
    }

    /// A new link replaced the old one: partial frames are gone; its first frame must be the
    /// peer's resync.
    pub fn link_reset(&mut self) {
        self.frame_rem = 0;
        self.header_len = 0;
        self.ctl_rem = 0;
        self.ctl_answer = 0;
        self.ctl_fin = 0;
        self.spec_len = 0;
        self.coded_done();
        self.expect_resync = 1;
        self.has_resync = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(frames: &[(FrameHeader, &[u8])]) -> Vec<u8> {
        let mut v = Vec::new();
        for (h, p) in frames {
            v.extend_from_slice(&h.encode());
            v.extend_from_slice(p);
        }
        v
    }

    /// Reads `link` through an `RxState` with reads of `n` bytes; returns delivered payload.
    fn read_all(link: &[u8], n: usize) -> Result<Vec<u8>, ProtoError> {
        let mut rx = RxState::new();
        let mut pos = 0;
        let mut got_all = Vec::new();
        while pos < link.len() {
            let mut app = vec![0u8; n];
            let plan = rx.plan_read(n);
            let (got, r) = rx.read_from(plan, &link[pos..], &mut app);
            pos += got;
            got_all.extend_from_slice(&app[..r?.payload]);
        }
        Ok(got_all)
    }

    #[test]
    fn a_state_whose_lengths_would_overflow_is_refused() {
        // The record crosses exec in the environment, which anything may set: a chain
        // description and a control frame whose lengths add up past 32 bits once passed the
        // check by wrapping (found by the exec_state fuzz target).
        let mut b = RxState::new().to_bytes();
        let at = 52 + HEADER_LEN;
        b[at..at + 4].copy_from_slice(&(u32::MAX - 15).to_le_bytes());
        b[at - 4..at].copy_from_slice(&32u32.to_le_bytes());
        assert!(RxState::from_bytes(&b).is_none());
        assert!(RxState::from_bytes(&RxState::new().to_bytes()).is_some());
    }

    #[test]
    fn only_a_plain_data_frame_at_the_stream_position_with_payload_is_data_ahead() {
        let rx = RxState::new();
        let data = wire(&[(FrameHeader::data(3, 0, 0), b"abc")]);
        assert!(rx.data_ahead(&data[..HEADER_LEN + 1]));
        assert!(rx.data_ahead(&data));
        // Its header alone, or a part of it: no byte for the program yet.
        assert!(!rx.data_ahead(&data[..HEADER_LEN]));
        assert!(!rx.data_ahead(&data[..HEADER_LEN - 1]));
        assert!(!rx.data_ahead(&[]));
        // A control frame first (even with data behind it).
        let ack =
            wire(&[(FrameHeader::control(FrameKind::Ack, 0, 0), b""), (FrameHeader::data(3, 0, 0), b"abc")]);
        assert!(!rx.data_ahead(&ack));
        // Another stream position, a coded frame, garbage.
        assert!(!rx.data_ahead(&wire(&[(FrameHeader::data(3, 7, 0), b"abc")])));
        let mut coded = FrameHeader::data(3, 0, 0);
        coded.chain = 1;
        assert!(!rx.data_ahead(&wire(&[(coded, b"abc")])));
        let mut bad = data.clone();
        bad[0] ^= 1;
        assert!(!rx.data_ahead(&bad));
        // A side in the middle of something: a header in pieces, a rebuilt link.
        let mut mid = RxState::new();
        let _ = mid.read_from(mid.plan_read(10), &data[..5], &mut [0u8; 10]);
        assert!(!mid.data_ahead(&data[5..]));
        let mut relinked = RxState::new();
        relinked.expect_resync = 1;
        assert!(!relinked.data_ahead(&data));
        // After the stream's end.
        let mut ended = RxState::new();
        let fin = wire(&[(FrameHeader::control(FrameKind::Fin, 0, 0), b"")]);
        let _ = ended.read_from(ended.plan_read(10), &fin, &mut [0u8; 10]);
        assert!(ended.fin != 0 && !ended.data_ahead(&data));
    }

    #[test]
    fn frames_of_every_size_through_buffers_of_every_size() {
        let link = wire(&[
            (FrameHeader::data(3, 0, 0), b"abc"),
            (FrameHeader::control(FrameKind::Ack, 3, 0), b""),
            (FrameHeader::data(1, 3, 0), b"d"),
            (FrameHeader::data(40, 4, 0), &[b'x'; 40]),
            (FrameHeader::data(2, 44, 0), b"yz"),
        ]);
        let mut want = b"abcd".to_vec();
        want.extend_from_slice(&[b'x'; 40]);
        want.extend_from_slice(b"yz");
        for n in 1..100 {
            assert_eq!(read_all(&link, n).unwrap(), want, "buffer of {n}");
        }
    }

    /// The receive path may read fewer link bytes than a plan allows, into a buffer of its
    /// own, and parse them there (`parse_buffer`): however many it takes (at most
    /// `plan.total()`), the payload never exceeds the application's buffer (so the layer
    /// never holds payload of its own), and the stream comes out whole.
    #[test]
    fn any_read_within_the_plan_fits_the_application_buffer() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..200 {
            let mut frames = Vec::new();
            let mut sent = Vec::new();
            let mut seq = 0u64;
            for _ in 0..40 {
                if next(4) == 0 {
                    frames.push((FrameHeader::control(FrameKind::Ack, seq, 0), Vec::new()));
                    continue;
                }
                let len = next(6000) as usize + 1;
                let p: Vec<u8> = (0..len).map(|i| (seq as usize + i) as u8).collect();
                frames.push((FrameHeader::data(len as u32, seq, 0), p.clone()));
                sent.extend_from_slice(&p);
                seq += len as u64;
            }
            let link = wire(&frames.iter().map(|(h, p)| (*h, &p[..])).collect::<Vec<_>>());
            let mut rx = RxState::new();
            let mut pos = 0;
            let mut got = Vec::new();
            while pos < link.len() {
                let app_len = next(5000) as usize + 1;
                let plan = rx.plan_read(app_len);
                let take = (next(plan.total() as u64) as usize + 1).min(link.len() - pos);
                let mut stage = link[pos..pos + take].to_vec();
                pos += take;
                let i = rx.parse_buffer(&mut stage).expect("a well-formed stream");
                assert!(i.payload <= app_len, "{} payload bytes for a buffer of {app_len}", i.payload);
                got.extend_from_slice(&stage[..i.payload]);
            }
            assert_eq!(got, sent);
            assert_eq!(rx.delivered, sent.len() as u64);
        }
    }

    #[test]
    fn out_of_order_and_garbage_are_errors() {
        let link = wire(&[(FrameHeader::data(3, 5, 0), b"abc")]);
        assert!(matches!(read_all(&link, 64), Err(ProtoError::OutOfOrder { .. })));
        assert!(matches!(
            read_all(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n", 64),
            Err(ProtoError::Frame(_))
        ));
        let link = wire(&[(FrameHeader::control(FrameKind::Resync, 0, 0), b"")]);
        assert_eq!(read_all(&link, 64), Err(ProtoError::UnexpectedResync));
    }

    fn offer(no: u64, spec: &str) -> (FrameHeader, Vec<u8>) {
        let mut h = FrameHeader::control(FrameKind::ChainOffer, no, 0);
        h.len = spec.len() as u32;
        (h, spec.as_bytes().to_vec())
    }

    #[test]
    fn offers_asked_both_ways_say_so_in_the_answer_owed() {
        for (spec, both, want) in [
            ("lz4", true, Some((4, true, true))),
            ("lz4", false, Some((4, true, false))),
            ("brotli", true, Some((4, false, false))),
        ] {
            let (mut h, p) = offer(4, spec);
            h.chain = u8::from(both);
            let mut rx = RxState::new();
            let link = wire(&[(h, &p), (FrameHeader::data(1, 0, 0), b"x")]);
            let mut app = [0u8; 64];
            let plan = rx.plan_read(64);
            let (_, r) = rx.read_from(plan, &link, &mut app);
            assert_eq!(r.unwrap().payload, 1);
            assert_eq!(rx.take_answer_owed(), want, "{spec} both={both}");
            let back = RxState::from_bytes(&rx.to_bytes()).expect("a state it wrote");
            assert_eq!(back.offer_both, u32::from(both));
        }
        // Any other flag of an offer is an error.
        let (mut h, _) = offer(4, "lz4");
        h.chain = 2;
        assert!(FrameHeader::decode(&h.encode()).is_err());
    }

    #[test]
    fn offers_are_taken_or_refused_and_never_reach_the_application() {
        for n in [1, 3, 7, 100] {
            let (h1, p1) = offer(2, "double");
            let (h2, p2) = offer(3, "brotli");
            let link = wire(&[
                (FrameHeader::data(3, 0, 0), b"abc"),
                (h1, &p1),
                (FrameHeader::data(2, 3, 0), b"de"),
                (h2, &p2),
            ]);
            let mut rx = RxState::new();
            let (mut pos, mut out) = (0, Vec::new());
            let mut answers = Vec::new();
            while pos < link.len() {
                let mut app = vec![0u8; n];
                let plan = rx.plan_read(n);
                let (got, r) = rx.read_from(plan, &link[pos..], &mut app);
                pos += got;
                out.extend_from_slice(&app[..r.unwrap().payload]);
                answers.extend(rx.take_answer_owed());
            }
            assert_eq!(out, b"abcde", "reads of {n}");
            // (An honest peer makes one offer at a time and waits for its answer; two in
            // one read leave only the last answer owed.)
            assert_eq!(answers.last(), Some(&(3, false, false)), "reads of {n}");
            assert!(
                n >= 100 || answers == [(2, true, false), (3, false, false)],
                "reads of {n}: {answers:?}"
            );
            assert_eq!(rx.chain_ids(2), Some(1));
            assert_eq!(rx.chain_ids(3), None, "a refused chain is not taken");
            assert_eq!(rx.careful, 1, "a taken chain with a filter: one frame at a time");
            let back = RxState::from_bytes(&rx.to_bytes()).expect("a state it wrote");
            assert_eq!((back.chains, back.careful), (rx.chains, rx.careful));
        }
    }

    #[test]
    fn acknowledgements_of_a_sealed_stream_count_only_with_their_tag() {
        let secret = 0x5eed_u128 << 64 | 77;
        let auth = secret.to_le_bytes();
        // This side connected; the peer accepted and tags as the side that did not.
        let tagged = |seq: u64, ack: u64, from_active: bool| {
            let mut h = FrameHeader::control(FrameKind::Ack, seq, ack);
            h.len = CTL_TAG;
            let mut v = h.encode().to_vec();
            v.extend_from_slice(&crate::auth::ack_mac(&auth, from_active, ack));
            v
        };
        let mut answer = FrameHeader::control(FrameKind::ChainAnswer, 2, 10);
        answer.chain = 1;
        answer.len = crate::wire::frame::ANSWER_SHARE;
        let share = crate::connection::aead::seal_share(&auth, false, 2, &[9; KEY]);
        // Whatever the reads' sizes.
        for n in [1, 5, 24, 40, 1000] {
            let mut rx = RxState::new();
            rx.set_auth(secret, true);
            let feed = |rx: &mut RxState, bytes: &[u8]| -> Result<(), ProtoError> {
                for chunk in bytes.chunks(n) {
                    rx.parse_buffer(&mut chunk.to_vec())?;
                }
                Ok(())
            };
            // Before our stream is sealed, every frame's acknowledgement counts.
            feed(&mut rx, &wire(&[(FrameHeader::data(2, 0, 10), b"ab")])).unwrap();
            assert_eq!(rx.peer_ack, 10);
            // The peer takes a keyed chain for our stream: from its answer on, only tags.
            feed(&mut rx, &wire(&[(answer, &share[..])])).unwrap();
            assert!(rx.acks_need_tags());
            feed(&mut rx, &wire(&[(FrameHeader::data(2, 2, 5000), b"cd")])).unwrap();
            feed(&mut rx, &wire(&[(FrameHeader::control(FrameKind::Ack, 4, 6000), b"")])).unwrap();
            assert_eq!(rx.peer_ack, 10, "acknowledgements with no tag are not counted");
            let mut quick = rx;
            let d = wire(&[(FrameHeader::data(1, 4, 7000), b"e")]);
            assert_eq!(quick.take_plain_frame(&d), Some(1));
            assert_eq!(quick.peer_ack, 10, "nor on the quick path");
            feed(&mut rx, &tagged(4, 300, false)).unwrap();
            assert_eq!(rx.peer_ack, 300);
            // Our own acknowledgement sent back to us, a wrong tag, a changed value: refused.
            for bad in [tagged(4, 400, true), tagged(4, 0, false)] {
                let mut r = rx;
                let e = feed(&mut r, &bad).unwrap_err();
                assert!(matches!(e, ProtoError::ControlForged(_) | ProtoError::AckWentBack { .. }), "{e:?}");
            }
            let mut altered = tagged(4, 400, false);
            altered[16] ^= 1;
            let mut r = rx;
            assert!(matches!(feed(&mut r, &altered), Err(ProtoError::ControlForged("an acknowledgement"))));
            // A tagged acknowledgement recorded earlier and sent again says less: refused.
            let mut r = rx;
            feed(&mut r, &tagged(4, 350, false)).unwrap();
            assert!(matches!(feed(&mut r, &tagged(4, 300, false)), Err(ProtoError::AckWentBack { .. })));
            // The state crosses exec with it.
            let back = RxState::from_bytes(&rx.to_bytes()).expect("a state it wrote");
            assert!(back.acks_need_tags());
            // The peer takes a chain with no keyed filter: plain acknowledgements count again.
            let mut plain = FrameHeader::control(FrameKind::ChainAnswer, 3, 0);
            plain.chain = 1;
            feed(&mut rx, &wire(&[(plain, b"")])).unwrap();
            assert!(!rx.acks_need_tags());
            feed(&mut rx, &wire(&[(FrameHeader::control(FrameKind::Ack, 4, 8000), b"")])).unwrap();
            assert_eq!(rx.peer_ack, 8000);
        }
    }

    /// A peer's offer of the keyed chain `aead` as chain `no`, its share tagged under `secret`.
    fn keyed_offer(secret: u128, no: u64) -> Vec<u8> {
        let share = crate::connection::aead::share_of(&[5; KEY]);
        let mut p = b"aead".to_vec();
        p.push(0);
        p.extend_from_slice(&crate::connection::aead::seal_share(
            &secret.to_le_bytes(),
            true,
            no as u8,
            &share,
        ));
        let mut h = FrameHeader::control(FrameKind::ChainOffer, no, 0);
        h.len = p.len() as u32;
        wire(&[(h, &p)])
    }

    /// A peer's offer of `lz4` as chain `no`, turning the sealing off: tagged under `key`.
    fn unsealing_offer(key: &[u8; KEY], no: u64) -> Vec<u8> {
        let mut p = b"lz4".to_vec();
        p.push(0);
        p.extend_from_slice(&crate::connection::aead::control_tag(
            key,
            FrameKind::ChainOffer as u8,
            no,
            b"lz4",
        ));
        let mut h = FrameHeader::control(FrameKind::ChainOffer, no, 0);
        h.len = p.len() as u32;
        wire(&[(h, &p)])
    }

    #[test]
    fn a_side_that_took_a_keyed_chain_tags_its_acknowledgements() {
        let mut rx = RxState::new();
        rx.set_auth(41, false);
        assert!(!rx.tags_acks());
        rx.parse_buffer(&mut keyed_offer(41, 5)).unwrap();
        assert_eq!(rx.take_answer_owed(), Some((5, true, false)));
        assert!(rx.tags_acks(), "the chain taken last is keyed");
        // Turning the sealing off takes a tag under the sealing key; once taken, no more tags.
        let key = *rx.chain_key(5);
        rx.parse_buffer(&mut unsealing_offer(&key, 6)).unwrap();
        assert_eq!(rx.take_answer_owed(), Some((6, true, false)));
        assert!(!rx.tags_acks());
    }

    #[test]
    fn an_offer_sent_again_after_a_relink_is_taken_again() {
        // A keyed chain taken, and no sealed frame yet; then an offer that turns the sealing
        // off, tagged under its key, taken. Its answer is lost with the link, and the offer
        // comes again as it was: it is taken again, not refused for its tag (the chain taken
        // last here is now the one offered, which owes no tag).
        let mut rx = RxState::new();
        rx.set_auth(43, false);
        rx.parse_buffer(&mut keyed_offer(43, 2)).unwrap();
        assert_eq!(rx.take_answer_owed(), Some((2, true, false)));
        let key = *rx.chain_key(2);
        let offer = unsealing_offer(&key, 3);
        rx.parse_buffer(&mut offer.clone()).unwrap();
        assert_eq!(rx.take_answer_owed(), Some((3, true, false)));
        rx.relink(0);
        rx.parse_buffer(&mut offer.clone()).unwrap();
        assert_eq!(rx.take_answer_owed(), Some((3, true, false)));
        assert_eq!(rx.chain_ids(3), crate::connection::Chain::build("lz4").and_then(|c| c.ids()));
    }

    #[test]
    fn a_stored_frame_is_read_as_a_plain_one_after_its_tag() {
        let (h, p) = offer(3, "lz4");
        let mut rx = RxState::new();
        rx.parse_buffer(&mut wire(&[(h, &p)])).unwrap();
        assert!(crate::connection::Chain::ids_store_plain(rx.chain_ids(3).unwrap()));
        let mut d = FrameHeader::data(6, 0, 0);
        d.chain = 3;
        let (_, r) = rx.read_from(rx.plan_read(100), &d.encode(), &mut [0u8; 100]);
        assert_eq!(r.unwrap().payload, 0);
        assert_eq!(rx.coded_len, 6);
        // (The sink took the tag byte `0` off the socket.)
        rx.take_stored().unwrap();
        assert_eq!((rx.coded_len, rx.frame_rem), (0, 5));
        let mut app = [0u8; 100];
        let (got, r) = rx.read_from(rx.plan_read(100), b"hello", &mut app);
        assert_eq!((got, r.unwrap().payload), (5, 5));
        assert_eq!((&app[..5], rx.delivered, rx.frame_rem), (&b"hello"[..], 5, 0));
        // A frame of its tag alone, or one partly given to the program, is not such a frame.
        let mut rx2 = RxState::new();
        rx2.parse_buffer(&mut wire(&[(h, &p)])).unwrap();
        let mut one = FrameHeader::data(1, 0, 0);
        one.chain = 3;
        let _ = rx2.read_from(rx2.plan_read(100), &one.encode(), &mut [0u8; 100]);
        assert_eq!(rx2.take_stored(), Err(ProtoError::Undecodable));
        assert!(!crate::connection::Chain::ids_store_plain(0x0201), "two filters");
        assert!(!crate::connection::Chain::ids_store_plain(1), "double has no tag");
    }

    #[test]
    fn coded_frames_need_a_taken_chain() {
        let mut h = FrameHeader::data(4, 0, 0);
        h.chain = 5;
        let mut rx = RxState::new();
        assert_eq!(rx.parse_buffer(&mut h.encode()).unwrap_err(), ProtoError::BadChain(5));
        // An offer numbered outside 1..=15.
        let (h, p) = offer(16, "double");
        let mut rx = RxState::new();
        assert_eq!(rx.parse_buffer(&mut wire(&[(h, &p)])).unwrap_err(), ProtoError::BadChain(16));
        // A coded frame is never parsed in place with what follows it.
        let (h, p) = offer(1, "double");
        let mut d = FrameHeader::data(4, 0, 0);
        d.chain = 1;
        let mut rx = RxState::new();
        let mut link = wire(&[(h, &p), (d, b"aabb")]);
        assert_eq!(rx.parse_buffer(&mut link).unwrap_err(), ProtoError::CodedInPlace);
        // Read one frame at a time, its header leaves the payload to the sink.
        let mut rx = RxState::new();
        rx.parse_buffer(&mut wire(&[(h, &p)])).unwrap();
        let plan = rx.plan_read(100);
        assert_eq!(plan, ReadPlan::HeaderFirst { header: HEADER_LEN, app_max: 0 });
        let (got, r) = rx.read_from(plan, &wire(&[(d, b"aabb")]), &mut [0u8; 100]);
        assert_eq!((got, r.unwrap().payload), (HEADER_LEN, 0));
        assert_eq!((rx.coded_len, rx.coded_chain, rx.coded_seq), (4, 1, 0));
        // A coded frame larger than one can wait whole in the socket is refused.
        let mut rx = RxState::new();
        rx.parse_buffer(&mut wire(&[(h, &p)])).unwrap();
        let mut big = FrameHeader::data(CODED_MAX as u32 + 2, 0, 0);
        big.chain = 1;
        assert!(matches!(
            rx.parse_buffer(&mut big.encode()),
            Err(ProtoError::Frame(FrameError::BadLength(_)))
        ));
    }

    #[test]
    fn an_empty_chain_ends_careful_reads_at_the_next_plain_frame() {
        let (h1, p1) = offer(1, "double");
        let (h2, p2) = offer(2, "-");
        let mut rx = RxState::new();
        rx.parse_buffer(&mut wire(&[(h1, &p1), (h2, &p2)])).unwrap();
        assert_eq!(rx.careful, 1, "coded frames of chain 1 may still come");
        rx.parse_buffer(&mut FrameHeader::data(2, 0, 0).encode()).unwrap();
        assert_eq!(rx.careful, 0);
    }

    #[test]
    fn a_plain_frame_taken_at_once_leaves_the_state_the_general_parse_leaves() {
        // Every frame the quick path takes, the general parse takes the same way (state and
        // payload); every buffer it declines changes nothing.
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut quick = RxState::new();
        let mut general = RxState::new();
        let mut at = 0u64;
        let mut ack = 0u64;
        for round in 0..2000 {
            let len = 1 + (next() % 300) as usize;
            let payload: Vec<u8> = (0..len).map(|i| (i as u64 + at) as u8).collect();
            ack += next() % 3;
            let mut h = FrameHeader::data(len as u32, at, ack);
            let mut frame = Vec::new();
            match round % 7 {
                // Not quick: a wrong offset, a chain, a cut frame, two frames, a Fin.
                1 => h.seq += 1,
                2 => h.chain = 1,
                _ => {}
            }
            frame.extend_from_slice(&h.encode());
            frame.extend_from_slice(&payload);
            if round % 7 == 3 {
                frame.truncate(HEADER_LEN + len / 2);
            }
            let before = quick;
            match quick.take_plain_frame(&frame) {
                Some(n) => {
                    assert_eq!(n, len);
                    assert_eq!(&frame[HEADER_LEN..], &payload[..]);
                    let mut copy = frame.clone();
                    let i = general.parse_buffer(&mut copy).expect("a well-formed frame");
                    assert_eq!(&copy[..i.payload], &payload[..]);
                    // (`header` is scratch while `header_len` is 0: the general parse leaves
                    // the last header in it, the quick path never copies it.)
                    let mut g = general;
                    g.header = quick.header;
                    assert_eq!(format!("{quick:?}"), format!("{g:?}"));
                    at += len as u64;
                }
                None => {
                    assert_eq!(format!("{quick:?}"), format!("{before:?}"), "declined, yet changed");
                    assert!(matches!(round % 7, 1..=3), "round {round}: a plain frame declined");
                    // (The general parse gets the same bytes on a copy of the state and its
                    // answer is not the quick path's business; the next frame starts afresh.)
                    let mut copy = frame.clone();
                    let _ = general.clone().parse_buffer(&mut copy);
                }
            }
        }
    }
}
