//! One link of a connection, as the core sees it: a reliable, ordered byte stream while it is
//! up (kernel TCP, shared memory, a Myrinet-style sink with its own retransmission), lost as a
//! whole when it fails. The core remembers which frames it put on each link, so that a failed
//! link's frames go again on another; and it parses what each link delivers into frames.

use crate::wire::frame::{FrameHeader, HEADER_LEN};
use std::collections::VecDeque;

/// Names one link of a connection (the driver's choice: a sink and an instance).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkId(pub u32);

/// A frame the core handed to a link, remembered until acknowledged or the link fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct InFlight {
    /// Stream offset of the first payload byte.
    pub seq: u64,
    /// Payload bytes (0 for the end-of-stream frame).
    pub len: u64,
    /// The end-of-stream frame.
    pub fin: bool,
}

/// What parsing a link's bytes produced.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Parsed {
    /// A whole frame: header and payload.
    Frame(FrameHeader, Vec<u8>),
}

/// A link's state in the core.
#[derive(Debug)]
pub(super) struct Link {
    pub id: LinkId,
    /// Frames on this link not acknowledged yet, oldest first.
    pub in_flight: VecDeque<InFlight>,
    /// Payload bytes in `in_flight`.
    pub in_flight_bytes: u64,
    /// Most payload bytes the driver lets be in flight on this link (its rate times its
    /// delay, as the driver measures them); `u64::MAX` when it does not say.
    pub budget: u64,
    /// Payload bytes handed to this link in all.
    pub carried: u64,
    /// The driver's estimate of the link: bytes per millisecond and round-trip time (ms);
    /// zero rate when it gave none.
    pub rate: u64,
    /// See `rate`.
    pub rtt_ms: u64,
    header: [u8; HEADER_LEN],
    header_got: usize,
    pending: Option<(FrameHeader, Vec<u8>)>,
}

impl Link {
    pub fn new(id: LinkId) -> Link {
        Link {
            id,
            in_flight: VecDeque::new(),
            in_flight_bytes: 0,
            budget: u64::MAX,
            carried: 0,
            rate: 0,
            rtt_ms: 0,
            header: [0; HEADER_LEN],
            header_got: 0,
            pending: None,
        }
    }

    /// Room for payload on this link now.
    pub fn room(&self) -> u64 {
        self.budget.saturating_sub(self.in_flight_bytes)
    }

    /// When `len` more bytes put on this link now would arrive (ms from now), by the
    /// driver's estimate: the queue beyond what the path itself holds drains at the link's
    /// rate, then half a round trip. `None` without an estimate.
    pub fn eta(&self, len: u64) -> Option<u64> {
        if self.rate == 0 {
            return None;
        }
        let path = self.rate * self.rtt_ms;
        let queue = (self.in_flight_bytes + len).saturating_sub(path);
        Some(queue / self.rate + self.rtt_ms / 2)
    }

    /// Records a frame put on the link.
    pub fn sent(&mut self, f: InFlight) {
        self.in_flight_bytes += f.len;
        self.carried += f.len;
        self.in_flight.push_back(f);
    }

    /// Forgets frames wholly below `acked` (the peer delivered them).
    pub fn on_ack(&mut self, acked: u64, fin_acked: bool) {
        while let Some(f) = self.in_flight.front() {
            let done = if f.fin { fin_acked } else { f.seq + f.len <= acked };
            if !done {
                break;
            }
            self.in_flight_bytes -= f.len;
            self.in_flight.pop_front();
        }
    }

    /// The link failed: its frames, for sending again elsewhere.
    pub fn fail(&mut self) -> Vec<InFlight> {
        self.in_flight_bytes = 0;
        self.header_got = 0;
        self.pending = None;
        self.in_flight.drain(..).collect()
    }

    /// Takes bytes the link delivered; appends whole frames to `out`. `max_payload` bounds a
    /// data frame's length (a header claiming more is refused by the header check itself).
    pub fn parse(
        &mut self,
        mut bytes: &[u8],
        out: &mut Vec<Parsed>,
    ) -> Result<(), crate::wire::frame::FrameError> {
        while !bytes.is_empty() {
            if let Some((h, mut p)) = self.pending.take() {
                let want = h.len as usize - p.len();
                let n = want.min(bytes.len());
                p.extend_from_slice(&bytes[..n]);
                bytes = &bytes[n..];
                if p.len() == h.len as usize {
                    out.push(Parsed::Frame(h, p));
                } else {
                    self.pending = Some((h, p));
                }
                continue;
            }
            let n = (HEADER_LEN - self.header_got).min(bytes.len());
            self.header[self.header_got..self.header_got + n].copy_from_slice(&bytes[..n]);
            self.header_got += n;
            bytes = &bytes[n..];
            if self.header_got < HEADER_LEN {
                break;
            }
            self.header_got = 0;
            let h = FrameHeader::decode(&self.header)?;
            if h.len == 0 {
                out.push(Parsed::Frame(h, Vec::new()));
            } else {
                self.pending = Some((h, Vec::with_capacity(h.len as usize)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::frame::FrameKind;

    #[test]
    fn frames_come_out_whatever_the_cut() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&FrameHeader::data(5, 0, 0).encode());
        wire.extend_from_slice(b"hello");
        wire.extend_from_slice(&FrameHeader::control(FrameKind::Ack, 5, 3).encode());
        for cut in 0..wire.len() {
            let mut l = Link::new(LinkId(0));
            let mut out = Vec::new();
            l.parse(&wire[..cut], &mut out).unwrap();
            l.parse(&wire[cut..], &mut out).unwrap();
            assert_eq!(out.len(), 2, "cut at {cut}");
            assert_eq!(out[0], Parsed::Frame(FrameHeader::data(5, 0, 0), b"hello".to_vec()));
        }
    }

    #[test]
    fn acks_free_whole_frames_and_failure_returns_the_rest() {
        let mut l = Link::new(LinkId(1));
        l.sent(InFlight { seq: 0, len: 10, fin: false });
        l.sent(InFlight { seq: 10, len: 10, fin: false });
        l.sent(InFlight { seq: 20, len: 0, fin: true });
        l.on_ack(15, false);
        assert_eq!(l.in_flight_bytes, 10);
        let back = l.fail();
        assert_eq!(back.len(), 2);
        assert_eq!(l.in_flight_bytes, 0);
    }
}
