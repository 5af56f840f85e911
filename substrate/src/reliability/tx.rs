//! Send half of a virtual connection: sequence numbers, the replay buffer, the window, and the
//! frame that is partly on the wire.
//!
//! The application's bytes are accepted only when the physical link took them (so nothing is
//! ever accepted that nobody will flush later); the accepted bytes are also copied into the
//! replay ring, where they stay until the peer's *layer* acknowledges them. After a link is
//! rebuilt, [`TxState::resync`] rewinds the wire position to what the peer says it delivered,
//! and [`TxState::plan_replay`] hands out the rest again from the ring.

use super::ProtoError;
use crate::wire::frame::{FrameHeader, FrameKind, HEADER_LEN, MAX_PAYLOAD};

/// Where the payload of a planned write comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The application's buffer, from its start.
    App,
    /// The replay ring, starting at this stream offset.
    Ring(u64),
}

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
}

impl Plan {
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
}

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
        b
    }

    /// Length of [`to_bytes`](Self::to_bytes).
    pub const BYTES: usize = 6 * 8 + HEADER_LEN + 2 * 4 + 8 + 4;

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
        };
        let sane = t.acked <= t.next_seq
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
        }
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
        let len = (app_len as u64).min(MAX_PAYLOAD as u64).min(self.space(hard));
        if len == 0 {
            return Err(Blocked::Window);
        }
        self.start_frame(FrameHeader::data(len as u32, self.next_seq, delivered), false);
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
            return Some(self.owed(self.owed_payload as usize, Source::Ring(at)));
        }
        if !self.replaying() || self.awaiting_resync() {
            return None;
        }
        let len = (self.next_seq - self.wire_seq).min(MAX_PAYLOAD as u64);
        self.start_frame(FrameHeader::data(len as u32, self.wire_seq, delivered), true);
        Some(self.owed(len as usize, Source::Ring(self.wire_seq)))
    }

    /// Plans a control frame (ack or resync) when no frame is in progress.
    pub fn plan_control(&mut self, kind: FrameKind, delivered: u64) -> Option<Plan> {
        if self.in_frame() {
            return None;
        }
        self.start_frame(FrameHeader::control(kind, self.wire_seq, delivered), false);
        Some(self.owed(0, Source::App))
    }

    fn start_frame(&mut self, h: FrameHeader, replay: bool) {
        self.owed_header = h.encode();
        self.owed_header_off = 0;
        self.owed_payload = h.len as u64;
        self.owed_is_replay = replay as u32;
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
        debug_assert_eq!(ring.len() as u64, self.window);
        if written == 0 && self.owed_header_off == 0 {
            // Nothing of a new frame reached the wire: forget it, so the next plan may differ.
            self.owed_header_off = HEADER_LEN as u32;
            self.owed_payload = 0;
            return 0;
        }
        let hw = written.min(plan.header_len);
        self.owed_header_off += hw as u32;
        if self.owed_header_off as usize == HEADER_LEN && hw > 0 {
            let ack = u64::from_le_bytes(self.owed_header[16..24].try_into().expect("8 bytes"));
            self.ack_sent = self.ack_sent.max(ack);
        }
        let pw = (written - hw).min(plan.payload);
        self.owed_payload -= pw as u64;
        match plan.source {
            Source::App => {
                // Part of the frame is on the wire: its whole payload is accepted now (into
                // the ring), and what the link did not take yet goes out from the ring. A
                // frame is never left waiting for the application's next call (which may
                // never come), so the peer never sits in the middle of a frame.
                ring_write_with(ring, self.next_seq, &app[..plan.payload], copy);
                self.next_seq += plan.payload as u64;
                self.wire_seq += pw as u64;
                if self.in_frame() {
                    self.owed_is_replay = 1;
                }
                plan.payload
            }
            Source::Ring(_) => {
                self.wire_seq += pw as u64;
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
        self.awaiting_resync = 0;
        self.acked = received;
        self.wire_seq = received;
        self.ack_sent = self.ack_sent.max(delivered);
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
        Ok(())
    }
}

/// Copies `data` into the ring at stream offset `seq` (wrapping).
pub fn ring_write(ring: &mut [u8], seq: u64, data: &[u8]) {
    ring_write_with(ring, seq, data, |d, s| d.copy_from_slice(s))
}

/// [`ring_write`] with the caller's copy routine.
pub fn ring_write_with(ring: &mut [u8], seq: u64, data: &[u8], copy: impl Fn(&mut [u8], &[u8])) {
    if data.is_empty() {
        return;
    }
    let cap = ring.len();
    let at = (seq % cap as u64) as usize;
    let first = data.len().min(cap - at);
    copy(&mut ring[at..at + first], &data[..first]);
    if first < data.len() {
        copy(&mut ring[..data.len() - first], &data[first..]);
    }
}

/// The ring's bytes for stream offsets `[seq, seq + len)`, as at most two slices.
pub fn ring_slices(ring: &[u8], seq: u64, len: usize) -> (&[u8], &[u8]) {
    let cap = ring.len();
    let at = (seq % cap as u64) as usize;
    let first = len.min(cap - at);
    (&ring[at..at + first], &ring[..len - first])
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let (a, b) = ring_slices(&ring, 100, 155);
        assert_eq!([a, b].concat(), app[100..]);
        tx.commit(&p, HEADER_LEN + 155, &[], &mut ring);
        assert!(tx.plan_replay(0).is_none());
        assert!(tx.plan_send(1, 0, false).is_ok());
    }

    #[test]
    fn ring_wraps() {
        let mut ring = vec![0u8; 8];
        ring_write(&mut ring, 6, &[1, 2, 3, 4]);
        let (a, b) = ring_slices(&ring, 6, 4);
        assert_eq!((a, b), (&[1u8, 2][..], &[3u8, 4][..]));
    }
}
