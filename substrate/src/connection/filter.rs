//! What every filter on a connection's stream is: the [`Filter`] trait, and why a frame's
//! payload could not be decoded ([`DecodeError`]). Below both the chain that composes
//! filters and the filters themselves, so that neither depends on the other for these.

/// Why a frame's payload could not be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The peer broke the filter's format.
    Malformed,
    /// A sealed record failed its authentication: forged, altered, or sealed under another
    /// key (another connection's).
    Forged,
    /// A sealed record whose nonce names another stream offset than the one it came at.
    Replayed {
        /// The offset it was sealed for.
        sealed_at: u64,
        /// The offset it came at.
        at: u64,
    },
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Malformed => write!(f, "a coded frame did not decode"),
            DecodeError::Forged => write!(
                f,
                "a sealed record failed authentication (forged, altered on the way, or sealed under another \
                 connection's key)"
            ),
            DecodeError::Replayed { sealed_at, at } => {
                write!(f, "a replayed record (sealed for stream offset {sealed_at}, found at {at})")
            }
        }
    }
}

/// A filter: encodes a frame's payload on the way out, decodes it on the way in.
pub trait Filter: std::fmt::Debug + Send {
    /// The name that describes it in a chain.
    fn name(&self) -> &'static str;
    /// Most bytes `n` payload bytes can encode to.
    fn max_out(&self, n: usize) -> usize;
    /// Encodes `input` into `out`: part of the frame at stream offset `seq` whose length
    /// before the chain's first filter is `raw_len`.
    fn encode(&mut self, seq: u64, raw_len: usize, input: &[u8], out: &mut Vec<u8>);
    /// Decodes `input` (stream offset `seq`) into `out`.
    fn decode(&mut self, seq: u64, input: &[u8], out: &mut Vec<u8>) -> Result<(), DecodeError>;
    /// True for a filter that needs a key from the chain's key exchange.
    fn keyed(&self) -> bool {
        false
    }
    /// Gives a keyed filter its key.
    fn set_key(&mut self, _key: &[u8; 32]) {}
    /// True when this filter would leave `input` as it is (a compressor that judges the
    /// frame not worth compressing): a frame every filter of its chain would leave may go
    /// plain, read by the peer's layer like any plain frame.
    fn passes(&mut self, _input: &[u8]) -> bool {
        false
    }
    /// Decodes `buf` where it lies, when the filter can (a sealed record opens in place):
    /// `None` when it cannot (then [`decode`](Self::decode) is used).
    fn decode_in_place(&mut self, _seq: u64, _buf: &mut Vec<u8>) -> Option<Result<(), DecodeError>> {
        None
    }
}
