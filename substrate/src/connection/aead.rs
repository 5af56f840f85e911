//! The `aead` filters: each frame sealed as one record (AES-256-GCM or ChaCha20-Poly1305,
//! from ring), under a key each chain gets from an X25519 exchange inside its own offer and
//! answer.
//!
//! ```text
//! record:  seq (8, LE) | raw length (4, LE) | ciphertext | tag (16)
//! ```
//!
//! The first 12 bytes are the record's explicit nonce: the stream offset of the frame and its
//! length before any filter. The bytes of a stream at an offset never change, so a nonce
//! names one plaintext only: a frame sent again after a failure seals to the same record,
//! and no two different plaintexts ever share a nonce under one key (the raw length, not the
//! length after compression, is what makes that true behind a compressor). A record is
//! opened only at the offset its nonce names: one replayed at another offset is refused
//! before it is decrypted, and one sealed under another key (another connection, another
//! chain) or altered by a single bit fails its tag.
//!
//! Keys. The offering side draws a secret `a` and puts `A = X25519(a, 9)` after the chain's
//! description in its offer; the answering side derives its secret `b` from a random seed of
//! its own and the offer (so an offer sent again on a rebuilt link gets the same answer),
//! and puts `B` in its answer. Both take `HKDF-SHA256(X25519(a, B))` with the chain's
//! description, its number, `A` and `B` as context. Every offer is a new exchange: re-keying
//! is offering the same chain again, on a schedule and after every relink. A network
//! observer sees `A` and `B` only. Each share travels with a tag under the connection's
//! secret ([`seal_share`]), so an attacker on the path cannot put its own share in place of
//! one; the secret authenticates the exchange and takes no part in the key.

use super::filter::{DecodeError, Filter};
use curve25519_dalek::montgomery::MontgomeryPoint;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305, NONCE_LEN};

/// Bytes of a key share and of a key.
pub const KEY_LEN: usize = 32;
/// Bytes a record adds to a frame: the explicit nonce and the tag.
pub const OVERHEAD: usize = NONCE_LEN + 16;
/// What every record's tag also covers.
const AAD: &[u8] = b"vmi aead record v1";

/// The algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suite {
    /// AES-256 in Galois/counter mode.
    Aes256Gcm,
    /// ChaCha20 with Poly1305.
    ChaCha20Poly1305,
}

/// A sealing filter; without a key (before the exchange gave one) it seals and opens
/// nothing.
pub struct Aead {
    suite: Suite,
    key: Option<LessSafeKey>,
}

impl std::fmt::Debug for Aead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Aead({:?}, keyed: {})", self.suite, self.key.is_some())
    }
}

impl Aead {
    /// A filter of `suite` with no key yet.
    pub fn new(suite: Suite) -> Aead {
        Aead { suite, key: None }
    }
}

impl Aead {
    /// Opens the record `buf` (stream offset `seq`) where it lies: `buf` becomes its
    /// plaintext (emptied on an error).
    fn open(&mut self, seq: u64, buf: &mut Vec<u8>) -> Result<(), DecodeError> {
        let r = self.open_checked(seq, buf);
        if r.is_err() {
            buf.clear();
        }
        r
    }

    fn open_checked(&mut self, seq: u64, buf: &mut Vec<u8>) -> Result<(), DecodeError> {
        let key = self.key.as_ref().ok_or(DecodeError::Malformed)?;
        if buf.len() < OVERHEAD {
            return Err(DecodeError::Malformed);
        }
        let nonce: [u8; NONCE_LEN] = buf[..NONCE_LEN].try_into().expect("12 bytes");
        let sealed_at = u64::from_le_bytes(nonce[..8].try_into().expect("8 bytes"));
        if sealed_at != seq {
            return Err(DecodeError::Replayed { sealed_at, at: seq });
        }
        let n = key
            .open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(AAD), &mut buf[NONCE_LEN..])
            .map_err(|_| DecodeError::Forged)?
            .len();
        buf.copy_within(NONCE_LEN..NONCE_LEN + n, 0);
        buf.truncate(n);
        Ok(())
    }
}

impl Filter for Aead {
    fn name(&self) -> &'static str {
        match self.suite {
            Suite::Aes256Gcm => "aead:aes-256-gcm",
            Suite::ChaCha20Poly1305 => "aead:chacha20-poly1305",
        }
    }
    fn max_out(&self, n: usize) -> usize {
        n + OVERHEAD
    }
    fn keyed(&self) -> bool {
        true
    }
    fn set_key(&mut self, key: &[u8; KEY_LEN]) {
        let alg = match self.suite {
            Suite::Aes256Gcm => &AES_256_GCM,
            Suite::ChaCha20Poly1305 => &CHACHA20_POLY1305,
        };
        self.key = UnboundKey::new(alg, key).ok().map(LessSafeKey::new);
    }
    fn encode(&mut self, seq: u64, raw_len: usize, input: &[u8], out: &mut Vec<u8>) {
        let Some(key) = &self.key else { return };
        let mut nonce = [0u8; NONCE_LEN];
        nonce[..8].copy_from_slice(&seq.to_le_bytes());
        nonce[8..].copy_from_slice(&(raw_len as u32).to_le_bytes());
        let at = out.len();
        out.reserve(input.len() + OVERHEAD);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(input);
        match key.seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(AAD),
            &mut out[at + NONCE_LEN..],
        ) {
            Ok(tag) => out.extend_from_slice(tag.as_ref()),
            // (Only for more than 64 GiB in one record.)
            Err(_) => out.truncate(at),
        }
    }
    fn decode(&mut self, seq: u64, input: &[u8], out: &mut Vec<u8>) -> Result<(), DecodeError> {
        let mut buf = input.to_vec();
        self.open(seq, &mut buf)?;
        out.extend_from_slice(&buf);
        Ok(())
    }
    fn decode_in_place(&mut self, seq: u64, buf: &mut Vec<u8>) -> Option<Result<(), DecodeError>> {
        Some(self.open(seq, buf))
    }
}

/// Bytes of a key share on the wire: the share and its tag.
pub const SHARE_WIRE: usize = KEY_LEN + 16;

/// A key share as it goes on the wire: the share, then a tag under the connection's secret
/// `auth` (which only the two layers and their agents know: it travels inside the agents'
/// encrypted channel), bound to the side (`offer`: the offering side's share) and the chain
/// number. An attacker on the path who swaps a share for its own cannot make the tag: the
/// exchange is authenticated, while the key still comes from the exchange alone.
pub fn seal_share(auth: &[u8; 16], offer: bool, no: u8, share: &[u8; KEY_LEN]) -> [u8; SHARE_WIRE] {
    let mut out = [0u8; SHARE_WIRE];
    out[..KEY_LEN].copy_from_slice(share);
    out[KEY_LEN..].copy_from_slice(&share_tag(auth, offer, no, share).as_ref()[..16]);
    out
}

fn share_tag(auth: &[u8; 16], offer: bool, no: u8, share: &[u8; KEY_LEN]) -> ring::hmac::Tag {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, auth);
    let mut ctx = ring::hmac::Context::with_key(&k);
    ctx.update(b"vmi key share v1");
    ctx.update(&[u8::from(offer), no]);
    ctx.update(share);
    ctx.sign()
}

/// The share of a wire form [`seal_share`] made with the same `auth`, side and number;
/// `None` for any other bytes.
pub fn open_share(auth: &[u8; 16], offer: bool, no: u8, wire: &[u8]) -> Option<[u8; KEY_LEN]> {
    if wire.len() != SHARE_WIRE {
        return None;
    }
    let share: [u8; KEY_LEN] = wire[..KEY_LEN].try_into().ok()?;
    let want = share_tag(auth, offer, no, &share);
    // (A comparison in constant time.)
    use subtle::ConstantTimeEq;
    bool::from(want.as_ref()[..16].ct_eq(&wire[KEY_LEN..])).then_some(share)
}

/// Bytes of a control frame's tag (see [`control_tag`]).
pub const CTL_TAG: usize = 16;

/// The tag of a control frame of a sealed stream: a frame that ends the stream (`Fin`) or
/// changes its chain to one with no keyed filter (a `ChainOffer`), under `key`, the key of
/// the chain that sealed the stream's last data frame. `kind` is the frame's kind byte,
/// `seq` its number (the stream offset of a `Fin`, the chain number of an offer) and
/// `payload` what it carries before the tag. An attacker on the path, who does not have the
/// key, can then neither end a sealed stream early nor turn its sealing off.
pub fn control_tag(key: &[u8; KEY_LEN], kind: u8, seq: u64, payload: &[u8]) -> [u8; CTL_TAG] {
    // (A key of its own for these tags, derived from the chain's: the cipher's key is
    // never used by another primitive.)
    let root = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let derived = ring::hmac::sign(&root, b"vmi control frame tag key v1");
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, derived.as_ref());
    let mut ctx = ring::hmac::Context::with_key(&k);
    ctx.update(&[kind]);
    ctx.update(&seq.to_le_bytes());
    ctx.update(&(payload.len() as u32).to_le_bytes());
    ctx.update(payload);
    let mut out = [0u8; CTL_TAG];
    out.copy_from_slice(&ctx.sign().as_ref()[..CTL_TAG]);
    out
}

/// True when `tag` is [`control_tag`] of the same key, kind, number and payload (compared
/// in constant time).
pub fn control_tag_ok(key: &[u8; KEY_LEN], kind: u8, seq: u64, payload: &[u8], tag: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    tag.len() == CTL_TAG && bool::from(control_tag(key, kind, seq, payload).ct_eq(tag))
}

/// The public share of secret `secret`.
pub fn share_of(secret: &[u8; KEY_LEN]) -> [u8; KEY_LEN] {
    MontgomeryPoint::mul_base_clamped(*secret).to_bytes()
}

/// `KEY_LEN` random bytes from the system (`None` if it has none to give).
pub fn random_secret() -> Option<[u8; KEY_LEN]> {
    use ring::rand::SecureRandom;
    let mut s = [0u8; KEY_LEN];
    ring::rand::SystemRandom::new().fill(&mut s).ok()?;
    Some(s)
}

/// The key both sides derive: `None` when the peer's share is a point of small order (the
/// shared secret would be known to anyone).
fn derive(
    secret: &[u8; KEY_LEN],
    peer: &[u8; KEY_LEN],
    spec: &str,
    no: u8,
    offer: &[u8; KEY_LEN],
    answer: &[u8; KEY_LEN],
) -> Option<[u8; KEY_LEN]> {
    let shared = MontgomeryPoint(*peer).mul_clamped(*secret).to_bytes();
    if shared == [0; KEY_LEN] {
        return None;
    }
    struct Len;
    impl ring::hkdf::KeyType for Len {
        fn len(&self) -> usize {
            KEY_LEN
        }
    }
    let prk = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"vmi aead key v1").extract(&shared);
    let no = [no];
    let info: [&[u8]; 4] = [spec.as_bytes(), &no, offer, answer];
    let okm = prk.expand(&info, Len).ok()?;
    let mut key = [0u8; KEY_LEN];
    okm.fill(&mut key).ok()?;
    Some(key)
}

/// The answering side: its share and the key, for the peer's offer of chain `no` described
/// by `spec` with share `offer`, from this side's random `seed` (the same offer always gets
/// the same answer). `None` for a share no key can come from.
pub fn answer(
    seed: &[u8; KEY_LEN],
    spec: &str,
    no: u8,
    offer: &[u8; KEY_LEN],
) -> Option<([u8; KEY_LEN], [u8; KEY_LEN])> {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, seed);
    let mut ctx = ring::hmac::Context::with_key(&k);
    ctx.update(&[no]);
    ctx.update(offer);
    let b: [u8; KEY_LEN] = ctx.sign().as_ref().try_into().expect("32 bytes");
    let share = share_of(&b);
    let key = derive(&b, offer, spec, no, offer, &share)?;
    Some((share, key))
}

/// The offering side, once the answer came: the key, from its secret and the peer's share.
pub fn offer_key(
    secret: &[u8; KEY_LEN],
    spec: &str,
    no: u8,
    answer: &[u8; KEY_LEN],
) -> Option<[u8; KEY_LEN]> {
    derive(secret, answer, spec, no, &share_of(secret), answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyed(suite: Suite, key: &[u8; 32]) -> Aead {
        let mut a = Aead::new(suite);
        a.set_key(key);
        a
    }

    #[test]
    fn both_sides_derive_one_key_and_an_observer_cannot() {
        let a = random_secret().unwrap();
        let seed = random_secret().unwrap();
        let pa = share_of(&a);
        let (pb, kb) = answer(&seed, "aead:aes-256-gcm", 3, &pa).unwrap();
        assert_eq!(offer_key(&a, "aead:aes-256-gcm", 3, &pb), Some(kb));
        assert_eq!(
            answer(&seed, "aead:aes-256-gcm", 3, &pa).unwrap(),
            (pb, kb),
            "the same offer, the same answer"
        );
        // Another number, another description, another offer: other keys.
        assert_ne!(answer(&seed, "aead:aes-256-gcm", 4, &pa).unwrap().1, kb);
        assert_ne!(answer(&seed, "lz4,aead:aes-256-gcm", 3, &pa).unwrap().1, kb);
        assert_ne!(offer_key(&random_secret().unwrap(), "aead:aes-256-gcm", 3, &pb), Some(kb));
        // Shares of small order give no key.
        assert_eq!(answer(&seed, "aead", 1, &[0; 32]), None);
        let mut one = [0u8; 32];
        one[0] = 1;
        assert_eq!(offer_key(&a, "aead", 1, &one), None);
    }

    #[test]
    fn shares_are_bound_to_the_connection_side_and_number() {
        let auth = [3u8; 16];
        let share = share_of(&[9u8; 32]);
        let w = seal_share(&auth, true, 4, &share);
        assert_eq!(open_share(&auth, true, 4, &w), Some(share));
        assert_eq!(open_share(&[4u8; 16], true, 4, &w), None, "another connection's secret");
        assert_eq!(open_share(&auth, false, 4, &w), None, "reflected as an answer");
        assert_eq!(open_share(&auth, true, 5, &w), None, "another chain");
        let mut swapped = seal_share(&auth, true, 4, &share_of(&[1u8; 32]));
        swapped[KEY_LEN..].copy_from_slice(&w[KEY_LEN..]);
        assert_eq!(open_share(&auth, true, 4, &swapped), None, "a share swapped under its tag");
        assert_eq!(open_share(&auth, true, 4, &w[..40]), None);
    }

    #[test]
    fn records_open_only_where_and_as_they_were_sealed() {
        for suite in [Suite::Aes256Gcm, Suite::ChaCha20Poly1305] {
            let key = [7u8; 32];
            let mut f = keyed(suite, &key);
            let msg = b"attack at dawn".repeat(100);
            let mut rec = Vec::new();
            f.encode(4096, msg.len(), &msg, &mut rec);
            assert_eq!(rec.len(), msg.len() + OVERHEAD);
            assert!(!rec.windows(14).any(|w| w == b"attack at dawn"), "{suite:?}: no plaintext on the wire");
            let mut again = Vec::new();
            f.encode(4096, msg.len(), &msg, &mut again);
            assert_eq!(again, rec, "a frame sent again seals the same way");
            let mut out = Vec::new();
            f.decode(4096, &rec, &mut out).unwrap();
            assert_eq!(out, msg);
            let mut inplace = rec.clone();
            f.decode_in_place(4096, &mut inplace).unwrap().unwrap();
            assert_eq!(inplace, msg, "opened where it lies");
            let mut bad = rec.clone();
            bad[20] ^= 1;
            assert_eq!(f.decode_in_place(4096, &mut bad), Some(Err(DecodeError::Forged)));
            assert!(bad.is_empty());
            // A flipped bit anywhere: forged.
            for i in [0usize, 9, 12, rec.len() / 2, rec.len() - 1] {
                let mut bad = rec.clone();
                bad[i] ^= 0x10;
                let mut out = Vec::new();
                let e = f.decode(4096, &bad, &mut out).unwrap_err();
                assert!(out.is_empty());
                if i < 8 {
                    assert!(matches!(e, DecodeError::Replayed { .. }), "{i}: {e:?}");
                } else {
                    assert_eq!(e, DecodeError::Forged, "{i}");
                }
            }
            // The record at another offset: replayed.
            assert_eq!(
                f.decode(8192, &rec, &mut Vec::new()),
                Err(DecodeError::Replayed { sealed_at: 4096, at: 8192 })
            );
            // Another key (another connection): forged.
            let mut other = keyed(suite, &[8u8; 32]);
            assert_eq!(other.decode(4096, &rec, &mut Vec::new()), Err(DecodeError::Forged));
            // Short and unkeyed.
            assert_eq!(f.decode(0, &rec[..OVERHEAD - 1], &mut Vec::new()), Err(DecodeError::Malformed));
            let mut none = Aead::new(suite);
            let mut o = Vec::new();
            none.encode(0, 3, b"abc", &mut o);
            assert!(o.is_empty(), "no key, no record");
            assert_eq!(none.decode(4096, &rec, &mut Vec::new()), Err(DecodeError::Malformed));
        }
    }
}
