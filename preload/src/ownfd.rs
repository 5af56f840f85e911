//! The layer's own descriptors (agent socket, statistics memfd, event channel, wake-up
//! eventfd, `/proc/self/status`, and per-connection ones of shared memory): kept at high
//! numbers, and protected from programs that close every descriptor or `dup2` onto one.

use std::sync::atomic::{AtomicI32, Ordering::*};
use std::sync::Arc;

static PROTECTED: [AtomicI32; 7] = [const { AtomicI32::new(-1) }; 7];

/// Moves one of the layer's own descriptors to a high number (close-on-exec).
pub fn move_high(fd: i32) -> i32 {
    move_to_high(fd, libc::F_DUPFD_CLOEXEC)
}

/// Moves one of the layer's own descriptors to a high number that stays open across exec
/// (something the layer hands to the new image).
pub fn move_high_inherited(fd: i32) -> i32 {
    move_to_high(fd, libc::F_DUPFD)
}

fn move_to_high(fd: i32, cmd: i32) -> i32 {
    let n = crate::sys::fd::fcntl(fd, cmd, 700);
    if n >= 0 {
        crate::sys::fd::close(fd);
        n
    } else {
        fd
    }
}

/// Role of the agent socket among the layer's own descriptors.
pub const OWN_AGENT: usize = 0;
/// Role of the statistics memfd.
pub const OWN_STATS: usize = 1;
/// Role of the event channel to the agent.
pub const OWN_EVENTS: usize = 2;
/// Role of the control thread's wake-up eventfd.
pub const OWN_WAKE: usize = 3;
/// Role of `/proc/self/status`, kept open for the control thread (see `lifetime`).
pub const OWN_STATUS: usize = 4;
/// Role of the memfd of connections announced to this process's listeners (`accepts`).
pub const OWN_ACCEPTS: usize = 5;
/// Role of the socket that rings epoll instances' bells (`bells`).
pub const OWN_BELLS: usize = 6;

/// Marks `fd` as the layer's own descriptor for `role`.
pub fn protect(role: usize, fd: i32) {
    PROTECTED[role].store(fd, Release);
}

/// The layer's own descriptor for `role` (-1 if none).
pub fn own_fd(role: usize) -> i32 {
    PROTECTED[role].load(Acquire)
}

/// Forgets the layer's own descriptor for `role`; returns it.
pub fn unprotect(role: usize) -> i32 {
    PROTECTED[role].swap(-1, AcqRel)
}

/// Per-connection descriptors of the layer's own (shared memory: region file, the peer's
/// socket, the rendezvous socket), each with the place that names it, so that a program
/// closing everything or `dup2`-ing onto one of them does not take it.
static EXTRA: std::sync::Mutex<Vec<Arc<AtomicI32>>> = std::sync::Mutex::new(Vec::new());
static EXTRA_N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn extra() -> std::sync::MutexGuard<'static, Vec<Arc<AtomicI32>>> {
    EXTRA.lock().unwrap_or_else(|e| e.into_inner())
}

/// Protects the descriptor `slot` names (and whatever it names later) until
/// [`unprotect_slot`].
pub fn protect_slot(slot: &Arc<AtomicI32>) {
    let mut x = extra();
    x.push(slot.clone());
    EXTRA_N.store(x.len(), Release);
}

/// Stops protecting `slot`'s descriptor.
pub fn unprotect_slot(slot: &Arc<AtomicI32>) {
    let mut x = extra();
    x.retain(|p| !Arc::ptr_eq(p, slot));
    EXTRA_N.store(x.len(), Release);
}

fn extra_fds() -> Vec<(i32, Arc<AtomicI32>)> {
    extra().iter().map(|p| (p.load(Acquire), p.clone())).collect()
}

/// True if `fd` is one of the layer's own.
#[inline]
pub fn is_protected(fd: i32) -> bool {
    fd >= 0
        && (PROTECTED.iter().any(|p| p.load(Relaxed) == fd)
            || (EXTRA_N.load(Relaxed) > 0 && extra().iter().any(|p| p.load(Acquire) == fd))
            || is_splice_pipe(fd))
}

/// True if `fd` is one of the splicing pipes' (`sys::splice`, made only when asked for).
fn is_splice_pipe(fd: i32) -> bool {
    let mut hit = false;
    crate::sys::splice::each_fd(|p| hit |= p.load(Acquire) == fd);
    hit
}

/// The protected descriptors.
pub fn protected() -> Vec<i32> {
    let mut v: Vec<i32> = PROTECTED.iter().map(|p| p.load(Relaxed)).filter(|&f| f >= 0).collect();
    if EXTRA_N.load(Relaxed) > 0 {
        v.extend(extra_fds().into_iter().map(|(f, _)| f).filter(|&f| f >= 0));
    }
    crate::sys::splice::each_fd(|p| {
        let f = p.load(Acquire);
        if f >= 0 {
            v.push(f);
        }
    });
    v
}

/// The program wants descriptor number `fd` (dup2 onto it): move ours out of the way.
pub fn evict(fd: i32) -> Option<(i32, i32)> {
    if !is_protected(fd) {
        return None;
    }
    let n = move_high(fd);
    for p in &PROTECTED {
        let _ = p.compare_exchange(fd, n, AcqRel, Relaxed);
    }
    for (f, p) in extra_fds() {
        if f == fd {
            let _ = p.compare_exchange(fd, n, AcqRel, Relaxed);
        }
    }
    crate::sys::splice::each_fd(|p| {
        let _ = p.compare_exchange(fd, n, AcqRel, Relaxed);
    });
    Some((fd, n))
}
