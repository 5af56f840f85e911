//! The frame header that the layer puts in front of every chunk of application bytes on a
//! physical link, and the control frames that share the link.
//!
//! ```text
//!  0        1        2                4                                8
//! +--------+--------+----------------+--------------------------------+
//! | magic  |  kind  |  flags         |  len (payload bytes, LE u32)   |
//! +--------+--------+----------------+--------------------------------+
//! |  seq: stream offset of the first payload byte (LE u64)            |
//! +-------------------------------------------------------------------+
//! |  ack: bytes of the peer's stream this side has delivered (LE u64) |
//! +-------------------------------------------------------------------+
//! ```
//!
//! * `Data` carries `len` payload bytes (1..=[`MAX_PAYLOAD`]) that follow the header.
//! * `Ack` carries no payload; only `ack` matters (`seq` is the sender's next offset). Once
//!   the stream it acknowledges is sealed, it carries a 16-byte tag of the acknowledgement
//!   under the connection's secret ([`CTL_TAG`], `auth::ack_mac`), and the receiver counts
//!   no acknowledgement without one (not the `ack` field of any other frame).
//! * `Resync` is the first frame on a rebuilt link: `ack` says how many bytes of the peer's
//!   stream this side has delivered, so the peer replays from there.
//! * `ChainOffer` (connection core) proposes a chain of filters for this side's stream:
//!   `seq` numbers the chain (1..=15), the payload (at most [`MAX_CHAIN_SPEC`] bytes) names
//!   its filters; flags 1 asks the peer to put the same chain on its own stream too.
//!   `ChainAnswer` takes it (flags 1) or refuses it (flags 0); `seq` names it. For a chain
//!   with a keyed filter (`aead`), the offer's payload is the description, a zero byte and
//!   the offering side's 32-byte X25519 share with a 16-byte tag under the connection's
//!   secret, and an answer that takes it carries the answering side's share and tag as its
//!   payload (`len` 48; otherwise 0).
//! * `Fin` carries no payload, or, on a stream whose last data frame was sealed by a keyed
//!   chain, a 16-byte tag under that chain's key ([`CTL_TAG`]); an offer of a chain with no
//!   keyed filter on such a stream ends with a zero byte and such a tag instead of a share.
//!   (`connection::aead::control_tag`.)
//! * `flags` of a `Data` frame: the low 4 bits name the chain that transformed its payload
//!   (0: none); with [`PLAIN`] (0x10) the frame belongs to that chain but its payload is as
//!   it was (every filter of the chain would leave it so: incompressible bytes under a
//!   compressor; never a chain with a keyed filter), and it is read as a plain frame. Every
//!   other bit, `PLAIN` without a chain, and any flag of other kinds but those two, is an
//!   error.
//!
//! All integers are little endian. Anything else (bad magic, unknown kind, reserved flags,
//! a length out of bounds) is a [`FrameError`]: the connection is closed, never guessed at.

/// Length of every frame header in bytes.
pub const HEADER_LEN: usize = 24;
/// First byte of every frame.
pub const MAGIC: u8 = 0xA7;
/// Largest payload one data frame may carry.
pub const MAX_PAYLOAD: u32 = 1 << 20;
/// Largest chain description in a `ChainOffer`.
pub const MAX_CHAIN_SPEC: u32 = 256;
/// Payload of a `ChainAnswer` that takes a keyed chain: the answering side's key share and
/// its tag (`connection::aead::SHARE_WIRE`).
pub const ANSWER_SHARE: u32 = 48;
/// Flag of a `Data` frame of a chain whose payload is plain (see the module's notes).
pub const PLAIN: u8 = 0x10;
/// Payload of a `Fin` on a sealed stream: its tag (`connection::aead::CTL_TAG`); also of an
/// `Ack` of a sealed stream (`auth::ack_mac`).
pub const CTL_TAG: u32 = 16;

/// What a frame is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Application bytes follow the header.
    Data = 1,
    /// A cumulative acknowledgement with no payload.
    Ack = 2,
    /// First frame on a rebuilt link: how much of the peer's stream was delivered.
    Resync = 3,
    /// The peer's program reset the connection (closed it with unread data): final.
    Abort = 4,
    /// The peer's program shut its sending side down: end of stream (acks still flow).
    Fin = 5,
    /// A chain of filters proposed for the sender's stream (connection core).
    ChainOffer = 6,
    /// The answer to a `ChainOffer` (connection core).
    ChainAnswer = 7,
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame is.
    pub kind: FrameKind,
    /// Payload length (zero unless `kind` is `Data`).
    pub len: u32,
    /// Stream offset of the first payload byte (next offset for control frames).
    pub seq: u64,
    /// Cumulative count of the peer's bytes this side has delivered.
    pub ack: u64,
    /// `Data`: the chain that transformed the payload (0: none); `ChainAnswer`: 1 when
    /// taken; `ChainOffer`: 1 when the peer is asked to use the chain both ways. Zero
    /// otherwise.
    pub chain: u8,
}

/// Why a header was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// The first byte is not [`MAGIC`]: the peer does not speak this protocol.
    BadMagic(u8),
    /// The kind byte names no known frame.
    UnknownKind(u8),
    /// Reserved flag bits were set.
    BadFlags(u16),
    /// A data frame with no payload or more than [`MAX_PAYLOAD`], or a control frame with one.
    BadLength(u32),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::BadMagic(m) => write!(f, "bad frame magic 0x{m:02x}"),
            FrameError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            FrameError::BadFlags(x) => write!(f, "reserved frame flags set: 0x{x:04x}"),
            FrameError::BadLength(l) => write!(f, "frame length {l} out of bounds"),
        }
    }
}

impl std::error::Error for FrameError {}

impl FrameHeader {
    /// A data header.
    pub fn data(len: u32, seq: u64, ack: u64) -> Self {
        FrameHeader { kind: FrameKind::Data, len, seq, ack, chain: 0 }
    }

    /// A control header (no payload).
    pub fn control(kind: FrameKind, seq: u64, ack: u64) -> Self {
        FrameHeader { kind, len: 0, seq, ack, chain: 0 }
    }

    /// Writes the header into its 24-byte wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = MAGIC;
        b[1] = self.kind as u8;
        b[2] = self.chain;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.ack.to_le_bytes());
        b
    }

    /// Parses and validates a header.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, FrameError> {
        if b[0] != MAGIC {
            return Err(FrameError::BadMagic(b[0]));
        }
        let kind = match b[1] {
            1 => FrameKind::Data,
            2 => FrameKind::Ack,
            3 => FrameKind::Resync,
            4 => FrameKind::Abort,
            5 => FrameKind::Fin,
            6 => FrameKind::ChainOffer,
            7 => FrameKind::ChainAnswer,
            k => return Err(FrameError::UnknownKind(k)),
        };
        let flags = u16::from_le_bytes([b[2], b[3]]);
        let allowed = match kind {
            FrameKind::Data => 0x001f,
            FrameKind::ChainAnswer | FrameKind::ChainOffer => 0x0001,
            _ => 0,
        };
        if flags & !allowed != 0 || (kind == FrameKind::Data && flags & 0x1f == PLAIN as u16) {
            return Err(FrameError::BadFlags(flags));
        }
        let len = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        let ok = match kind {
            FrameKind::Data => (1..=MAX_PAYLOAD).contains(&len),
            FrameKind::ChainOffer => (1..=MAX_CHAIN_SPEC).contains(&len),
            FrameKind::ChainAnswer => len == 0 || len == ANSWER_SHARE,
            FrameKind::Fin | FrameKind::Ack => len == 0 || len == CTL_TAG,
            _ => len == 0,
        };
        if !ok {
            return Err(FrameError::BadLength(len));
        }
        Ok(FrameHeader {
            kind,
            len,
            seq: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            ack: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
            chain: flags as u8,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for h in [
            FrameHeader::data(1, 0, 0),
            FrameHeader::data(MAX_PAYLOAD, u64::MAX - 5, 77),
            FrameHeader::control(FrameKind::Ack, 9, 12),
            FrameHeader::control(FrameKind::Resync, 0, u64::MAX),
        ] {
            assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn refuses_garbage() {
        let mut b = FrameHeader::data(10, 0, 0).encode();
        b[0] = b'G';
        assert_eq!(FrameHeader::decode(&b), Err(FrameError::BadMagic(b'G')));
        let mut b = FrameHeader::data(10, 0, 0).encode();
        b[1] = 99;
        assert_eq!(FrameHeader::decode(&b), Err(FrameError::UnknownKind(99)));
        let mut b = FrameHeader::data(10, 0, 0).encode();
        b[3] = 1;
        assert!(matches!(FrameHeader::decode(&b), Err(FrameError::BadFlags(_))));
        let b = FrameHeader::data(0, 0, 0).encode();
        assert_eq!(FrameHeader::decode(&b), Err(FrameError::BadLength(0)));
        let b = FrameHeader::data(MAX_PAYLOAD + 1, 0, 0).encode();
        assert!(FrameHeader::decode(&b).is_err());
        let mut b = FrameHeader::control(FrameKind::Ack, 0, 0).encode();
        b[4] = 3;
        assert_eq!(FrameHeader::decode(&b), Err(FrameError::BadLength(3)));
    }
}
