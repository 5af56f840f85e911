//! Authentication of a connection's ends when a link is rebuilt: SHA-256 (FIPS 180-4),
//! HMAC-SHA256 (RFC 2104), and the proofs of the resume handshake.
//!
//! When a virtual connection is first made, its two layers learn a 128-bit secret from
//! their agents. Resuming it later over a new physical link is a challenge-response on that
//! secret, with a fresh nonce from each side, so someone who learns the GID (or records an
//! earlier handshake) cannot take the connection over:
//!
//! ```text
//!  dialer                                   holder (via its node's agent)
//!    Resume{gid, nonce_a}        ──────►
//!                                ◄──────    Challenge{nonce_b}
//!    Proof{delivered_a, mac_a}   ──────►    checks mac_a, then freezes the old link
//!                                ◄──────    Ready{delivered_b, mac_b}
//!  checks mac_b; both replay from what the other delivered
//! ```

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

/// An incremental SHA-256.
#[derive(Clone)]
pub struct Sha256 {
    h: [u32; 8],
    block: [u8; 64],
    fill: usize,
    total: u64,
}

impl Default for Sha256 {
    fn default() -> Self {
        Self::new()
    }
}

impl Sha256 {
    /// A fresh hash.
    pub fn new() -> Self {
        Sha256 {
            h: [
                0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
                0x5be0cd19,
            ],
            block: [0; 64],
            fill: 0,
            total: 0,
        }
    }

    fn compress(h: &mut [u32; 8], b: &[u8; 64]) {
        let mut w = [0u32; 64];
        for (i, c) in b.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
        }
        let [mut a, mut bb, mut c, mut d, mut e, mut f, mut g, mut hh] = *h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[i]).wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & bb) ^ (a & c) ^ (bb & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = bb;
            bb = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, bb, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }

    /// Adds bytes.
    pub fn update(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        while !data.is_empty() {
            let n = (64 - self.fill).min(data.len());
            self.block[self.fill..self.fill + n].copy_from_slice(&data[..n]);
            self.fill += n;
            data = &data[n..];
            if self.fill == 64 {
                Self::compress(&mut self.h, &self.block);
                self.fill = 0;
            }
        }
    }

    /// The digest.
    pub fn finish(mut self) -> [u8; 32] {
        let bits = self.total.wrapping_mul(8);
        self.update(&[0x80]);
        while self.fill != 56 {
            self.update(&[0]);
        }
        self.update(&bits.to_be_bytes());
        let mut out = [0u8; 32];
        for (o, v) in out.chunks_exact_mut(4).zip(self.h) {
            o.copy_from_slice(&v.to_be_bytes());
        }
        out
    }
}

/// SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(data);
    h.finish()
}

/// HMAC-SHA256 of the concatenation of `parts`, keyed with `key`.
pub fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&sha256(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(&k.map(|b| b ^ 0x36));
    for p in parts {
        inner.update(p);
    }
    let mut outer = Sha256::new();
    outer.update(&k.map(|b| b ^ 0x5c));
    outer.update(&inner.finish());
    outer.finish()
}

/// The proof that the stream one side of connection `gid` sends (`from_active`: the side that
/// connected) ended at offset `at`: HMAC-SHA256 keyed with the connection's secret, cut to
/// 128 bits. A layer hands it to its agent when its program ends its stream; the agent
/// answers a link rebuilt after the process is gone with it, and the dialing layer, which
/// alone besides holds the secret, checks it. (Nothing else can make it: an end of stream
/// from anyone else on the path would cut a stream short.)
pub fn ended_mac(secret: u128, gid: u128, at: u64, from_active: bool) -> u128 {
    let d = hmac_sha256(
        &secret.to_le_bytes(),
        &[b"vmi-ended", &gid.to_le_bytes(), &at.to_le_bytes(), &[from_active as u8]],
    );
    u128::from_le_bytes(d[..16].try_into().expect("16 bytes"))
}

/// Which side of the resume handshake a proof is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that dials the new link.
    Dialer,
    /// The side that holds the connection and answers.
    Holder,
}

/// The proof one side sends: HMAC-SHA256 keyed with the connection's secret over a label
/// for the side, the GID, both nonces, the byte count the side states and its whereabouts
/// (its node agent's addresses, encoded by the caller), cut to 128 bits.
pub fn resume_mac(
    secret: u128,
    role: Role,
    gid: u128,
    nonce_a: u128,
    nonce_b: u128,
    delivered: u64,
    whereabouts: &[u8],
) -> u128 {
    let label: &[u8] = match role {
        Role::Dialer => b"vmi-resume-a",
        Role::Holder => b"vmi-resume-b",
    };
    let d = hmac_sha256(
        &secret.to_le_bytes(),
        &[
            label,
            &gid.to_le_bytes(),
            &nonce_a.to_le_bytes(),
            &nonce_b.to_le_bytes(),
            &delivered.to_le_bytes(),
            whereabouts,
        ],
    );
    u128::from_le_bytes(d[..16].try_into().expect("16 bytes"))
}

/// Compares two proofs in time that does not depend on where they differ.
pub fn proofs_equal(a: u128, b: u128) -> bool {
    let x = a ^ b;
    let folded = (x as u64) | ((x >> 64) as u64);
    std::hint::black_box(folded) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn sha256_known_answers() {
        assert_eq!(hex(&sha256(b"")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(hex(&sha256(b"abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(
            hex(&sha256(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        let mut h = Sha256::new();
        for _ in 0..1000 {
            h.update(&[b'a'; 1000]);
        }
        assert_eq!(hex(&h.finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    }

    #[test]
    fn hmac_rfc4231_vectors() {
        // Test case 1.
        assert_eq!(
            hex(&hmac_sha256(&[0x0b; 20], &[b"Hi There"])),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        // Test case 2, the message in two parts.
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", &[b"what do ya want ", b"for nothing?"])),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block.
        assert_eq!(
            hex(&hmac_sha256(&[0xaa; 131], &[b"Test Using Larger Than Block-Size Key - Hash Key First"])),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn proofs_bind_every_input() {
        let base = resume_mac(1, Role::Dialer, 2, 3, 4, 5, b"");
        assert!(proofs_equal(base, resume_mac(1, Role::Dialer, 2, 3, 4, 5, b"")));
        for other in [
            resume_mac(9, Role::Dialer, 2, 3, 4, 5, b""),
            resume_mac(1, Role::Holder, 2, 3, 4, 5, b""),
            resume_mac(1, Role::Dialer, 9, 3, 4, 5, b""),
            resume_mac(1, Role::Dialer, 2, 9, 4, 5, b""),
            resume_mac(1, Role::Dialer, 2, 3, 9, 5, b""),
            resume_mac(1, Role::Dialer, 2, 3, 4, 9, b""),
            resume_mac(1, Role::Dialer, 2, 3, 4, 5, b"x"),
        ] {
            assert!(!proofs_equal(base, other));
        }
    }
}
