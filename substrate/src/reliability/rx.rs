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
use crate::wire::frame::{FrameError, FrameHeader, FrameKind, HEADER_LEN, MAGIC};

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
    /// Payload bytes delivered to the application: the peer's stream offset we expect next.
    pub delivered: u64,
    /// Payload bytes of the current data frame not read yet.
    pub frame_rem: u64,
    /// Highest acknowledgement the peer sent (applies to our send half).
    pub peer_ack: u64,
    /// The peer's resync value, when one arrived and was not taken yet.
    pub resync: u64,
    /// 1 when `resync` holds a value.
    pub has_resync: u32,
    /// 1 when a resync frame is allowed (first frame on a rebuilt link).
    pub expect_resync: u32,
    /// Bytes of `header` gathered so far.
    pub header_len: u32,
    header: [u8; HEADER_LEN],
    /// 1 once the peer's end of stream (a Fin frame) arrived: no data may follow.
    pub fin: u32,
}

impl Default for RxState {
    fn default() -> Self {
        Self::new()
    }
}

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
        b
    }

    /// Length of [`to_bytes`](Self::to_bytes).
    pub const BYTES: usize = 4 * 8 + 3 * 4 + HEADER_LEN + 4;

    /// The state [`to_bytes`](Self::to_bytes) wrote; `None` for bytes of another length or
    /// values that cannot be (flags other than 0 and 1, a header longer than a header,
    /// a frame larger than the largest payload).
    pub fn from_bytes(b: &[u8]) -> Option<RxState> {
        if b.len() != Self::BYTES {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let r = RxState {
            delivered: u64_at(0),
            frame_rem: u64_at(8),
            peer_ack: u64_at(16),
            resync: u64_at(24),
            has_resync: u32_at(32),
            expect_resync: u32_at(36),
            header_len: u32_at(40),
            header: b[44..44 + HEADER_LEN].try_into().expect("header"),
            fin: u32_at(44 + HEADER_LEN),
        };
        let sane = r.has_resync <= 1
            && r.expect_resync <= 1
            && r.header_len as usize <= HEADER_LEN
            && r.frame_rem <= crate::wire::frame::MAX_PAYLOAD as u64
            && r.fin <= 1;
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
        }
    }

    /// Decides the layout of the next read for an application buffer of `app_len` bytes.
    pub fn plan_read(&self, app_len: usize) -> ReadPlan {
        if self.frame_rem > 0 {
            let payload = (app_len as u64).min(self.frame_rem) as usize;
            if payload as u64 == self.frame_rem {
                ReadPlan::PayloadFirst { payload, header: HEADER_LEN, rest: app_len - payload }
            } else {
                ReadPlan::PayloadFirst { payload, header: 0, rest: 0 }
            }
        } else {
            ReadPlan::HeaderFirst { header: HEADER_LEN - self.header_len as usize, app_max: app_len }
        }
    }

    /// A read of header bytes only (used to take ack frames without touching payload).
    pub fn header_only_plan(&self) -> ReadPlan {
        ReadPlan::HeaderFirst { header: HEADER_LEN - self.header_len as usize, app_max: 0 }
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

    /// The buffer the next header bytes go into.
    pub fn header_slot(&mut self) -> &mut [u8] {
        &mut self.header[self.header_len as usize..]
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
                    debug_assert!(self.frame_rem == 0 && self.header_len == 0);
                    self.header_len = h as u32;
                    self.check_partial()?;
                    if self.header_len as usize == HEADER_LEN {
                        self.finish_header(&mut out)?;
                    }
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
            ReadPlan::HeaderFirst { .. } => {
                let slot = HEADER_LEN - self.header_len as usize;
                let h = got.min(slot);
                self.header_len += h as u32;
                self.check_partial()?;
                if self.header_len as usize == HEADER_LEN {
                    self.finish_header(&mut out)?;
                }
                self.parse_in_place(app, got - h, &mut out)?;
            }
        }
        Ok(out)
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
        if n >= 2 && !(1..=5).contains(&h[1]) {
            return Err(FrameError::UnknownKind(h[1]).into());
        }
        if n >= 4 && (h[2] != 0 || h[3] != 0) {
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
            // Filter chains belong to the connection core; this data path has none.
            FrameKind::ChainOffer | FrameKind::ChainAnswer => {
                return Err(ProtoError::Frame(crate::wire::frame::FrameError::UnknownKind(h.kind as u8)))
            }
            FrameKind::Data if h.chain != 0 => {
                return Err(ProtoError::Frame(crate::wire::frame::FrameError::BadFlags(h.chain as u16)))
            }
            FrameKind::Data | FrameKind::Ack | FrameKind::Fin => {}
        }
        if h.seq != self.delivered {
            return Err(ProtoError::OutOfOrder { got: h.seq, expected: self.delivered });
        }
        if h.kind == FrameKind::Data && self.fin != 0 {
            return Err(ProtoError::DataAfterFin);
        }
        if h.kind == FrameKind::Fin {
            self.fin = 1;
        }
        if h.ack < self.peer_ack {
            return Err(ProtoError::AckWentBack { ack: h.ack, before: self.peer_ack });
        }
        self.peer_ack = h.ack;
        if h.kind == FrameKind::Data {
            self.frame_rem = h.len as u64;
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
        self.expect_resync = 0;
        self.has_resync = 0;
        self.peer_ack = self.peer_ack.max(peer_delivered);
    }

    /// A new link replaced the old one: partial frames are gone; its first frame must be the
    /// peer's resync.
    pub fn link_reset(&mut self) {
        self.frame_rem = 0;
        self.header_len = 0;
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
}
