//! Fault injection for the tests of the `aead` filters (`VMI_TAMPER`): the layer of one
//! process alters one sealed frame it sends, as an attacker on the path would, so that the
//! tests can check that the peer refuses it, logs it and resets the connection.
//!
//! `flip:N` flips one bit of the Nth sealed frame's ciphertext; `replay:N` sends the record
//! of the frame before it in its place (a record sealed for another stream offset);
//! `foreign:N` seals it under a key of its own (a record from another connection). Frames
//! are counted from 1 per process, across its connections. `share:N` flips a bit of the key
//! share in the Nth chain offer with one (an attacker swapping the share for its own).
//! `fin:N`, `offer:N` and `clear:N` slip a frame in before the Nth sealed frame, as someone
//! on the path would: an end of stream, an offer of a chain that does not seal (`double`),
//! or five bytes in clear, none of them with the tag a sealed stream owes. `ack:N` and
//! `acktag:N` slip an acknowledgement in before the Nth acknowledgement this process sends
//! alone: one with no tag that claims more than was delivered (half the bytes waiting in the
//! socket besides, less an eighth), as someone on the path would to make the peer drop bytes a failover
//! needs; or one with a tag not made with the connection's secret. Off (one relaxed load per
//! sealed frame or acknowledgement alone) unless the variable is set.

use crate::shm::ConnMem;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Mutex;

const OFF: u8 = 0;
const FLIP: u8 = 1;
const REPLAY: u8 = 2;
const FOREIGN: u8 = 3;
const SHARE: u8 = 4;
const FIN: u8 = 5;
const OFFER: u8 = 6;
const CLEAR: u8 = 7;
const ACK: u8 = 8;
const ACK_TAG: u8 = 9;

static MODE: AtomicU8 = AtomicU8::new(OFF);
static AT: AtomicU64 = AtomicU64::new(0);
static SEEN: AtomicU64 = AtomicU64::new(0);
/// The last sealed frame's record (for `replay`).
static LAST: Mutex<Vec<u8>> = Mutex::new(Vec::new());
/// A frame to slip in before the next frame goes (`fin`, `offer`, `clear`).
static SLIP: Mutex<Vec<u8>> = Mutex::new(Vec::new());
static SLIPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// True when a frame waits to be slipped in (one relaxed load).
#[inline]
pub fn slipping() -> bool {
    SLIPPING.load(Relaxed)
}

/// Reads `VMI_TAMPER`'s value.
pub fn init(v: Option<&str>) {
    let Some(v) = v else { return };
    let parsed = v.split_once(':').and_then(|(m, n)| {
        let mode = match m {
            "flip" => FLIP,
            "replay" => REPLAY,
            "foreign" => FOREIGN,
            "share" => SHARE,
            "fin" => FIN,
            "offer" => OFFER,
            "clear" => CLEAR,
            "ack" => ACK,
            "acktag" => ACK_TAG,
            _ => return None,
        };
        // (Slipped in before a sealed frame that follows another: the stream is sealed.)
        let n: u64 =
            n.parse().ok().filter(|&n| n > u64::from(matches!(mode, REPLAY | FIN | OFFER | CLEAR)))?;
        Some((mode, n))
    });
    match parsed {
        Some((mode, n)) => {
            AT.store(n, Relaxed);
            MODE.store(mode, Relaxed);
            let what = match mode {
                SHARE => "the key share of chain offer",
                ACK | ACK_TAG => "what goes before acknowledgement",
                FIN | OFFER | CLEAR => "what goes before sealed frame",
                _ => "sealed frame",
            };
            crate::log::warn(format_args!("VMI_TAMPER={v}: this process will alter {what} {n} it sends"));
        }
        None => crate::log::warn(format_args!(
            "VMI_TAMPER={v} is not flip:N, foreign:N, share:N, ack:N, acktag:N, or replay:N, fin:N, offer:N, clear:N (N at least 2); nothing is altered"
        )),
    }
}

/// True when a frame may be altered.
#[inline]
pub fn active() -> bool {
    MODE.load(Relaxed) != OFF
}

/// Sees the payload of a chain offer about to go (`payload`) and alters the key share in it
/// if it is the one.
#[cold]
pub fn offer(payload: &mut [u8]) {
    if MODE.load(Relaxed) != SHARE {
        return;
    }
    let Some(zero) = payload.iter().position(|&b| b == 0) else { return };
    if payload.len() <= zero + 1 {
        return;
    }
    let n = SEEN.fetch_add(1, Relaxed) + 1;
    if n == AT.load(Relaxed) {
        payload[zero + 1] ^= 0x01;
        crate::log::warn(format_args!("VMI_TAMPER: the key share of chain offer {n} altered"));
        MODE.store(OFF, Relaxed);
    }
}

/// Sees an acknowledgement alone about to go on `fd` (at our stream offset `seq`, saying
/// `delivered`) and slips a forged one in before it if it is the one (`ack:N`, `acktag:N`).
#[cold]
pub fn ack(mem: ConnMem, fd: i32, seq: u64, delivered: u64) {
    use substrate::wire::frame::{FrameHeader, FrameKind, CTL_TAG};
    let mode = MODE.load(Relaxed);
    if mode != ACK && mode != ACK_TAG {
        return;
    }
    let n = SEEN.fetch_add(1, Relaxed) + 1;
    if n != AT.load(Relaxed) {
        return;
    }
    let (claim, forged) = if mode == ACK {
        // Bytes the peer sent and our program has not read, frames' headers included: seven
        // eighths of them is below what the peer sent unless its frames are tiny.
        let queued = crate::sys::fd::fionread(fd).unwrap_or(0).max(0) as u64;
        let claim = delivered + queued / 8 * 7;
        (claim, FrameHeader::control(FrameKind::Ack, seq, claim).encode().to_vec())
    } else {
        let mut h = FrameHeader::control(FrameKind::Ack, seq, delivered);
        h.len = CTL_TAG;
        (delivered, [&h.encode()[..], &[0x5a; CTL_TAG as usize]].concat())
    };
    *SLIP.lock().unwrap_or_else(|p| p.into_inner()) = forged;
    slip(fd);
    crate::log::warn(format_args!(
        "VMI_TAMPER: virtual connection {:032x}: an acknowledgement {} claiming {claim} (delivered {delivered}) slipped in before acknowledgement {n}",
        mem.conn().gid,
        if mode == ACK { "with no tag" } else { "with a forged tag" },
    ));
    MODE.store(OFF, Relaxed);
}

/// Writes the frame to slip in, if one waits, on `fd` (whole, before the frame about to go).
#[cold]
pub fn slip(fd: i32) {
    SLIPPING.store(false, Relaxed);
    let bytes = std::mem::take(&mut *SLIP.lock().unwrap_or_else(|p| p.into_inner()));
    let mut at = 0;
    while at < bytes.len() {
        let r = crate::sys::fd::send(fd, &bytes[at..], libc::MSG_NOSIGNAL);
        if r <= 0 && crate::sys::errno() != libc::EAGAIN && crate::sys::errno() != libc::EINTR {
            return;
        }
        if r > 0 {
            at += r as usize;
        } else {
            crate::sys::wait_fd(fd, libc::POLLOUT, 100);
        }
    }
}

/// Sees the frame `coded` just sealed (chain `ids`, key `key`, stream offset `seq`, its
/// header acknowledging `ack`) and alters it if it is the one.
#[cold]
pub fn frame(mem: ConnMem, ids: u32, key: &[u8; 32], seq: u64, ack: u64, coded: &mut Vec<u8>) {
    if !substrate::connection::Chain::ids_keyed(ids)
        || coded.is_empty()
        || matches!(MODE.load(Relaxed), SHARE | ACK | ACK_TAG)
    {
        return;
    }
    let n = SEEN.fetch_add(1, Relaxed) + 1;
    let mode = MODE.load(Relaxed);
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if n == AT.load(Relaxed) {
        match mode {
            FLIP => {
                let at = coded.len() / 2;
                coded[at] ^= 0x04;
            }
            REPLAY if !last.is_empty() => *coded = last.clone(),
            FOREIGN => {
                let mut c = substrate::connection::Chain::from_ids(ids).unwrap_or_default();
                let mut other = *key;
                other[0] ^= 0x80;
                c.set_key(&other);
                // (The frame's raw bytes are gone by now; any plaintext under the wrong key
                // makes the point.)
                *coded = c.encode(seq, &vec![0x5a; coded.len().saturating_sub(40).max(1)]);
            }
            FIN | OFFER | CLEAR => {
                use substrate::wire::frame::{FrameHeader, FrameKind};
                let slip = match mode {
                    FIN => FrameHeader::control(FrameKind::Fin, seq, ack).encode().to_vec(),
                    OFFER => {
                        let mut h = FrameHeader::control(FrameKind::ChainOffer, 15, ack);
                        h.len = 6;
                        [&h.encode()[..], b"double"].concat()
                    }
                    _ => [&FrameHeader::data(5, seq, ack).encode()[..], b"hello"].concat(),
                };
                *SLIP.lock().unwrap_or_else(|p| p.into_inner()) = slip;
                SLIPPING.store(true, Relaxed);
            }
            _ => {}
        }
        crate::log::warn(format_args!(
            "VMI_TAMPER: virtual connection {:032x}: sealed frame {n} at offset {seq} altered{}",
            mem.conn().gid,
            if matches!(mode, FIN | OFFER | CLEAR) { " (a frame slipped in before it)" } else { "" }
        ));
        MODE.store(OFF, Relaxed);
    }
    if mode == REPLAY {
        last.clone_from(coded);
    }
}
