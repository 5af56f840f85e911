//! Authentication of a connection's ends when a link is rebuilt: SHA-256 and HMAC-SHA256
//! (ring's), and the proofs of the resume handshake.
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

/// SHA-256 of `data` (ring's, which uses the CPU's SHA extensions where it has them).
pub fn sha256(data: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, data);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// HMAC-SHA256 of the concatenation of `parts`, keyed with `key` (ring's).
pub fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let mut c = ring::hmac::Context::with_key(&k);
    for p in parts {
        c.update(p);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(c.sign().as_ref());
    out
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

/// The tag of an acknowledgement sent alone on a link whose acknowledged stream is sealed:
/// `ack` bytes of the stream the other side sends were delivered, said by the side that
/// connected (`from_active`) or the one that accepted. HMAC-SHA256 keyed with the
/// connection's secret (which only the two layers and their agents hold; it crosses the
/// network only inside the agents' encrypted channel), cut to 128 bits. The side is in the
/// tag so that one end's acknowledgement sent back to it does not pass for its peer's. An
/// acknowledgement recorded earlier and sent again says less than the receiver already
/// knows, which it refuses (acknowledgements only go up).
pub fn ack_mac(secret: &[u8; 16], from_active: bool, ack: u64) -> [u8; 16] {
    let d = hmac_sha256(secret, &[b"vmi-ack", &[from_active as u8], &ack.to_le_bytes()]);
    d[..16].try_into().expect("16 bytes")
}

/// True when `tag` is [`ack_mac`] of the same secret, side and value (compared in constant
/// time).
pub fn ack_mac_ok(secret: &[u8; 16], from_active: bool, ack: u64, tag: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    tag.len() == 16 && bool::from(ack_mac(secret, from_active, ack).ct_eq(tag))
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
        assert_eq!(
            hex(&sha256(&vec![b'a'; 1_000_000])),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        );
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
