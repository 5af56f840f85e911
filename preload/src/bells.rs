//! Bells of an epoll instance: a cheaper wake-up than a byte through TCP for connections on
//! shared memory that an instance scans (see `crate::ready`).
//!
//! A writer of shared memory rings the reader when the reader may sleep; the bell used to be
//! one byte through the connection's TCP sockets (the reader's descriptor, which its program
//! waits on, must become readable). For a connection an epoll instance scans, every wait on
//! that instance looks at the ring first anyway: the wake-up only has to end the wait. So the
//! instance gets a socket of the layer's own, a Unix datagram socket bound to an abstract
//! name, registered in the instance with [`BELL_DATA`]; the reader writes that name into its
//! ring (`shmring::Ring::direct_bells`), and the writer sends a one-byte datagram there (one
//! system call that wakes the waiter without the TCP stack on either side) where it sent a
//! byte through TCP. The wait takes the datagrams, drops its own event from what the program
//! sees, and reports the rings that hold bytes.
//!
//! The TCP bell stays right in every case (the connection's socket is registered in the
//! instance too): a writer whose datagram cannot go (the name is gone: the instance closed,
//! the process exec'd or died) rings through TCP, and so does one that finds the name changed
//! after it rang. Anybody on the node may send datagrams to such a name: all they can do is
//! wake the wait, which then looks at its rings and sleeps again.

use crate::sys;
use crate::sys::fd::RawAddr;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering::*};
use std::sync::Arc;

/// The epoll data of an instance's bell socket ("vmi bell"). A program registering one of
/// its own descriptors with this data in an instance that has a bell makes the layer take its
/// bell away (`ready::note_ctl`): its events are never taken for the layer's.
pub const BELL_DATA: u64 = 0x766d_6920_6265_6c6c;

/// The abstract name of bell `id`.
fn name(id: u64) -> Option<RawAddr> {
    let mut n = [0u8; 26];
    n[1..10].copy_from_slice(b"vmi-bell-");
    for (i, d) in n[10..].iter_mut().enumerate() {
        *d = b"0123456789abcdef"[((id >> (60 - 4 * i)) & 0xf) as usize];
    }
    RawAddr::unix(&n)
}

/// Names handed out by this process (with its process id, unique on the node's network
/// namespace while the process lives; a name taken by another namespace's process is
/// skipped).
static NEXT: AtomicU32 = AtomicU32::new(1);

/// A bell for epoll instance `epfd`: a datagram socket bound to a name of its own and
/// registered in the instance. Returns the slot holding its descriptor (protected from the
/// program) and its id, or None when the layer cannot have one here (a sandbox, no
/// descriptors left).
pub fn open(epfd: i32) -> Option<(Arc<AtomicI32>, u64)> {
    if crate::sandbox::active() {
        return None;
    }
    let fd = sys::fd::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0);
    if fd < 0 {
        return None;
    }
    let fd = crate::ownfd::move_high(fd);
    let pid = u64::from(sys::process::getpid() as u32);
    let mut id = 0;
    for _ in 0..4 {
        let n = u64::from(NEXT.fetch_add(1, Relaxed));
        let try_id = (pid << 32) | n;
        if name(try_id).is_some_and(|a| sys::fd::bind(fd, &a) == 0) {
            id = try_id;
            break;
        }
    }
    let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: BELL_DATA };
    if id == 0 || sys::fd::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, Some(&mut ev)) != 0 {
        sys::fd::close(fd);
        return None;
    }
    let slot = Arc::new(AtomicI32::new(fd));
    crate::ownfd::protect_slot(&slot);
    Some((slot, id))
}

/// Closes a bell (its registration goes with it).
pub fn close(slot: &Arc<AtomicI32>) {
    crate::ownfd::unprotect_slot(slot);
    let fd = slot.swap(-1, AcqRel);
    if fd >= 0 {
        sys::fd::close(fd);
    }
}

/// Takes the datagrams waiting at a bell.
pub fn take(slot: &AtomicI32) {
    let fd = slot.load(Acquire);
    if fd >= 0 {
        sys::fd::drain_datagrams(fd);
    }
}

/// The writers' socket (unbound; one per process, made when first needed).
static SENDER: AtomicI32 = AtomicI32::new(-1);

/// Rings bell `id`: true if the datagram went (false: ring through TCP instead).
pub fn ring(id: u64) -> bool {
    if crate::sandbox::active() {
        return false;
    }
    let Some(to) = name(id) else { return false };
    let mut s = SENDER.load(Acquire);
    if s < 0 {
        let fd = sys::fd::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return false;
        }
        let fd = crate::ownfd::move_high(fd);
        match SENDER.compare_exchange(-1, fd, AcqRel, Acquire) {
            Ok(_) => {
                crate::ownfd::protect(crate::ownfd::OWN_BELLS, fd);
                s = fd;
            }
            Err(other) => {
                sys::fd::close(fd);
                s = other;
            }
        }
    }
    sys::fd::send_to(s, b"b", &to, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_abstract_and_tell_ids_apart() {
        let a = name(0x1234_0000_0001).unwrap();
        let b = name(0x1234_0000_0002).unwrap();
        let s = sys::fd::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_NONBLOCK, 0);
        let t = sys::fd::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_NONBLOCK, 0);
        assert_eq!(sys::fd::bind(s, &a), 0);
        assert_eq!(sys::fd::bind(t, &b), 0);
        // Two datagrams to one, none to the other: one drain takes both.
        let u = sys::fd::socket(libc::AF_UNIX, libc::SOCK_DGRAM, 0);
        assert_eq!(sys::fd::send_to(u, b"b", &a, libc::MSG_DONTWAIT), 1);
        assert_eq!(sys::fd::send_to(u, b"b", &a, libc::MSG_DONTWAIT), 1);
        assert_eq!(sys::fd::drain_datagrams(t), 0);
        assert_eq!(sys::fd::drain_datagrams(s), 2);
        assert_eq!(sys::fd::drain_datagrams(s), 0);
        // A name nobody holds: the writer learns it at once (and rings through TCP).
        assert!(sys::fd::send_to(u, b"b", &name(7).unwrap(), libc::MSG_DONTWAIT) < 0);
        for f in [s, t, u] {
            sys::fd::close(f);
        }
    }
}
