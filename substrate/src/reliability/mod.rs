//! The per-connection reliability protocol, with no I/O inside.
//!
//! Each virtual connection has a send half ([`TxState`]) and a receive half ([`RxState`]).
//! Bytes carry stream offsets; acknowledgements are cumulative counts of bytes the peer's
//! *layer* delivered to its application, piggy-backed on data frames and sent alone only
//! when a quarter of the window is waiting for one ([`ack_due`]). The send half keeps every
//! unacknowledged byte in a replay ring bounded by the window; when the window is full the
//! application is pushed back (blocking send blocks, non-blocking send gets `EAGAIN`).
//!
//! When a physical link dies, both halves are reset ([`TxState::link_reset`],
//! [`RxState::link_reset`]); on the new link each side first sends a resync frame that states
//! how much it delivered, and each side replays the rest from its ring. `tests/sim.rs` drives
//! two endpoints over a lossy simulated link with a virtual clock to prove that the delivered
//! stream always equals the sent one.

pub mod rx;
pub mod tx;

pub use rx::{Ingested, ReadPlan, RxState, ANSWER, MIRROR, TAKEN};
pub use tx::{
    offer_spec, ring_slices, ring_write, ring_write_with, AppBytes, Blocked, Gather, OfferError, Plan,
    Source, TxState, GATHER_PARTS,
};

use crate::wire::frame::FrameError;

/// A protocol violation by the peer: the connection cannot go on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtoError {
    /// A header did not parse.
    Frame(FrameError),
    /// A data frame did not start where the stream stands.
    OutOfOrder {
        /// Offset the frame claimed.
        got: u64,
        /// Offset the stream is at.
        expected: u64,
    },
    /// The peer acknowledged bytes that were never sent.
    AckBeyondSent {
        /// Acknowledged offset.
        ack: u64,
        /// Bytes sent so far.
        sent: u64,
    },
    /// An acknowledgement smaller than an earlier one.
    AckWentBack {
        /// The new value.
        ack: u64,
        /// The earlier one.
        before: u64,
    },
    /// A resync frame in the middle of a link.
    UnexpectedResync,
    /// A rebuilt link whose first frame was not a resync.
    MissingResync,
    /// The peer's program reset the connection (not a malformed stream: the end of it).
    PeerAborted,
    /// Data after the peer's end of stream.
    DataAfterFin,
    /// A chain number out of range, or a data frame coded with a chain never taken.
    BadChain(u8),
    /// A coded frame's payload where only plain bytes may be (a read not made one frame at
    /// a time).
    CodedInPlace,
    /// A coded frame whose payload the chain could not decode.
    Undecodable,
    /// A sealed record refused: forged, altered, sealed under another key, or replayed.
    Record(crate::connection::filter::DecodeError),
    /// A key share of a chain offer or answer whose tag is wrong.
    ShareForged,
    /// A stream sealed by a keyed chain got a control frame that ends it or changes its
    /// chain, or a data frame in clear, without a valid tag: what it was.
    ControlForged(&'static str),
    /// An answer to an offer this side did not make.
    UnexpectedAnswer(u8),
    /// The peer's resync names an offset outside what can be replayed.
    ResyncOutOfRange {
        /// What the peer says it received.
        received: u64,
        /// Bytes already freed.
        acked: u64,
        /// Bytes sent so far.
        sent: u64,
    },
}

impl From<FrameError> for ProtoError {
    fn from(e: FrameError) -> Self {
        ProtoError::Frame(e)
    }
}

impl std::fmt::Display for ProtoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProtoError::Frame(e) => write!(f, "malformed frame: {e}"),
            ProtoError::OutOfOrder { got, expected } => {
                write!(f, "frame at offset {got}, stream is at {expected}")
            }
            ProtoError::AckBeyondSent { ack, sent } => {
                write!(f, "peer acknowledged {ack} bytes, only {sent} were sent")
            }
            ProtoError::AckWentBack { ack, before } => {
                write!(f, "acknowledgement went back from {before} to {ack}")
            }
            ProtoError::UnexpectedResync => write!(f, "resync frame in the middle of a link"),
            ProtoError::MissingResync => write!(f, "rebuilt link did not start with a resync"),
            ProtoError::PeerAborted => write!(f, "the peer reset the connection"),
            ProtoError::DataAfterFin => write!(f, "data after the end of stream"),
            ProtoError::BadChain(n) => write!(f, "frame names filter chain {n}, never agreed"),
            ProtoError::CodedInPlace => write!(f, "coded frame where only plain bytes may be"),
            ProtoError::Undecodable => write!(f, "a coded frame did not decode"),
            ProtoError::Record(e) => write!(f, "{e}"),
            ProtoError::ShareForged => write!(
                f,
                "a key share of a chain offer or answer failed authentication (altered on the way, or \
                 sent by someone without the connection's secret)"
            ),
            ProtoError::ControlForged(what) => {
                write!(f, "{what} on a sealed stream failed authentication (forged, or altered on the way)")
            }
            ProtoError::UnexpectedAnswer(n) => write!(f, "answer for chain {n}, never offered"),
            ProtoError::ResyncOutOfRange { received, acked, sent } => {
                write!(f, "peer resynced at {received}, replayable range is {acked}..={sent}")
            }
        }
    }
}

impl std::error::Error for ProtoError {}

/// True when the receive half should send an acknowledgement on its own: a quarter of the
/// peer's window is delivered but not acknowledged yet.
pub fn ack_due(delivered: u64, ack_sent: u64, peer_window: u64) -> bool {
    delivered - ack_sent.min(delivered) >= peer_window / 4
}

/// [`ack_due`] for the kernel-TCP data path: five eighths of the peer's window delivered but
/// not acknowledged. Later than a quarter, so that a request/response program whose messages
/// are up to half the window (an MPI rank's 1 MiB messages with the 2 MiB default) sends no
/// acknowledgement alone at all: its answer carries it. A bulk sender still hears back with
/// three eighths of its window left, and a sender whose window is full always does (the
/// receiver gets to five eighths of it before it runs dry).
pub fn lone_ack_due(delivered: u64, ack_sent: u64, peer_window: u64) -> bool {
    delivered - ack_sent.min(delivered) >= peer_window / 8 * 5
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acknowledgement_goes_alone_late_but_always_before_a_full_window() {
        let w = 2 << 20;
        // A message of half the window, its header and its frame's: not yet.
        assert!(!lone_ack_due((1 << 20) + 32, 0, w));
        assert!(!lone_ack_due(5 << 20, (4 << 20) - 64, w));
        assert!(lone_ack_due(w / 8 * 5, 0, w));
        // Whatever was acknowledged last, a receiver that read a full window owes one.
        for sent in [0u64, 1, 4096, 1 << 20, 7 << 30] {
            for win in [4096u64, 65536, 2 << 20, 16 << 20] {
                assert!(lone_ack_due(sent + win, sent, win), "{sent} {win}");
            }
        }
        // (An acknowledgement beyond what was delivered, after a resync: nothing owed.)
        assert!(!lone_ack_due(10, 20, w));
    }
}
