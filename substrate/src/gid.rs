//! Global identities of virtual connections.

use std::fmt;

/// A virtual connection's global identity: the id of the cluster that issued it (its top 16
/// bits) and 112 random bits, independent of where its ends run.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(transparent)]
pub struct Gid(pub u128);

/// Bits of a GID that are random (below the cluster id).
pub const RANDOM_BITS: u32 = 112;

impl Gid {
    /// Builds a GID from 16 random bytes (the caller supplies the randomness).
    pub fn from_random(bytes: [u8; 16]) -> Self {
        Gid(u128::from_le_bytes(bytes))
    }

    /// The same GID issued by cluster `cluster`: its random bits kept, its top 16 bits the
    /// cluster's id.
    pub fn issued_by(self, cluster: u16) -> Gid {
        Gid(self.0 & ((1u128 << RANDOM_BITS) - 1) | u128::from(cluster) << RANDOM_BITS)
    }

    /// The id of the cluster that issued it.
    pub fn cluster(self) -> u16 {
        (self.0 >> RANDOM_BITS) as u16
    }

    /// True when `other` is this GID, issued by some cluster (the random bits are equal).
    pub fn same_draw(self, other: Gid) -> bool {
        self.issued_by(0) == other.issued_by(0)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_in_the_top_bits() {
        let g = Gid::from_random([0xAB; 16]);
        let i = g.issued_by(0x3786);
        assert_eq!(i.cluster(), 0x3786);
        assert!(format!("{i}").starts_with("3786"));
        assert!(i.same_draw(g) && g.same_draw(i));
        assert_eq!(i.issued_by(0x3786), i);
        assert!(!i.same_draw(Gid(i.0 ^ 1)));
    }
}
