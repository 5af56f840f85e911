//! Global identities of virtual connections.

use std::fmt;

/// A virtual connection's global identity: 128 random bits, independent of where its ends run.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(transparent)]
pub struct Gid(pub u128);

impl Gid {
    /// Builds a GID from 16 random bytes (the caller supplies the randomness).
    pub fn from_random(bytes: [u8; 16]) -> Self {
        Gid(u128::from_le_bytes(bytes))
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

impl std::str::FromStr for Gid {
    type Err = std::num::ParseIntError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        u128::from_str_radix(s, 16).map(Gid)
    }
}
