//! Which descriptors the layer manages: a bitmap for the common check (one atomic load, so
//! files, pipes and plain sockets pay nothing measurable) and a table of entries behind a
//! read-write lock. Also the layer's own descriptors (agent socket, statistics memfd), kept
//! at high numbers and protected from programs that close every descriptor.

use crate::vc::Vc;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::*};
use std::sync::{Arc, RwLock};

const BITMAP_FDS: usize = 1 << 16;

static MANAGED: [AtomicU64; BITMAP_FDS / 64] = [const { AtomicU64::new(0) }; BITMAP_FDS / 64];
static TABLE: RwLock<Vec<Option<Entry>>> = RwLock::new(Vec::new());
static PROTECTED: [AtomicI32; 5] = [const { AtomicI32::new(-1) }; 5];
static ENTRIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// True if the table holds anything (one load: the exec hook's fast path).
pub fn any() -> bool {
    ENTRIES.load(Relaxed) > 0
}

/// A listening socket under the layer.
#[derive(Debug)]
pub struct Listener {
    /// Where it listens.
    pub addr: SocketAddr,
}

/// What the layer knows about a descriptor.
#[derive(Clone)]
pub enum Entry {
    /// A virtual connection.
    Vc(Arc<Vc>),
    /// A listener registered with the agent.
    Listener(Arc<Listener>),
}

fn set_bit(fd: i32, on: bool) {
    if fd >= 0 && (fd as usize) < BITMAP_FDS {
        let (w, b) = (fd as usize / 64, fd as usize % 64);
        if on {
            MANAGED[w].fetch_or(1 << b, Release);
        } else {
            MANAGED[w].fetch_and(!(1 << b), Release);
        }
    }
}

/// True if the layer manages `fd`.
#[inline(always)]
pub fn is_managed(fd: i32) -> bool {
    if fd < 0 {
        return false;
    }
    if (fd as usize) < BITMAP_FDS {
        return MANAGED[fd as usize / 64].load(Acquire) & (1 << (fd as usize % 64)) != 0;
    }
    get(fd).is_some()
}

/// The entry for `fd`.
pub fn get(fd: i32) -> Option<Entry> {
    if fd < 0 {
        return None;
    }
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    t.get(fd as usize).cloned().flatten()
}

/// The virtual connection on `fd`, if it is one.
#[inline(always)]
pub fn vc(fd: i32) -> Option<Arc<Vc>> {
    if (fd as usize) < BITMAP_FDS && !is_managed(fd) {
        return None;
    }
    match get(fd) {
        Some(Entry::Vc(v)) => Some(v),
        _ => None,
    }
}

/// Records `e` for `fd` (replacing what was there); returns the old entry.
pub fn insert(fd: i32, e: Entry) -> Option<Entry> {
    if fd < 0 {
        return None;
    }
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    if t.len() <= fd as usize {
        t.resize(fd as usize + 1, None);
    }
    let old = t[fd as usize].replace(e);
    if old.is_none() {
        ENTRIES.fetch_add(1, Relaxed);
    }
    set_bit(fd, true);
    old
}

/// Forgets `fd`; returns what it was.
pub fn remove(fd: i32) -> Option<Entry> {
    if !is_managed(fd) {
        return None;
    }
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    set_bit(fd, false);
    let old = t.get_mut(fd as usize).and_then(|s| s.take());
    if old.is_some() {
        ENTRIES.fetch_sub(1, Relaxed);
    }
    old
}

/// All entries (for fork and exec handling).
pub fn snapshot() -> Vec<(i32, Entry)> {
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    t.iter().enumerate().filter_map(|(i, e)| e.clone().map(|e| (i as i32, e))).collect()
}

/// Addresses of every listener in the table.
pub fn listener_addrs() -> Vec<SocketAddr> {
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<SocketAddr> = t
        .iter()
        .flatten()
        .filter_map(|e| match e {
            Entry::Listener(l) => Some(l.addr),
            _ => None,
        })
        .collect();
    v.dedup();
    v
}

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
            || (EXTRA_N.load(Relaxed) > 0 && extra().iter().any(|p| p.load(Acquire) == fd)))
}

/// The protected descriptors.
pub fn protected() -> Vec<i32> {
    let mut v: Vec<i32> = PROTECTED.iter().map(|p| p.load(Relaxed)).filter(|&f| f >= 0).collect();
    if EXTRA_N.load(Relaxed) > 0 {
        v.extend(extra_fds().into_iter().map(|(f, _)| f).filter(|&f| f >= 0));
    }
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
    Some((fd, n))
}

thread_local! {
    static FORK_GUARD: std::cell::RefCell<Option<std::sync::RwLockWriteGuard<'static, Vec<Option<Entry>>>>> =
        const { std::cell::RefCell::new(None) };
}

/// fork, prepare: hold the table so no thread is inside it across the fork.
pub fn before_fork() {
    let g = TABLE.write().unwrap_or_else(|e| e.into_inner());
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// fork, parent side.
pub fn after_fork_parent() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
}

/// fork, child side.
pub fn after_fork_child() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
}

/// The descriptors of this process that name `vc`.
pub fn fds_of(vc: &Vc) -> Vec<i32> {
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    t.iter()
        .enumerate()
        .filter_map(|(i, e)| match e {
            Some(Entry::Vc(v)) if std::ptr::eq(Arc::as_ptr(v), vc) => Some(i as i32),
            _ => None,
        })
        .collect()
}

/// Each distinct virtual connection in the table, once.
pub fn distinct_vcs() -> Vec<Arc<Vc>> {
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    let mut out: Vec<Arc<Vc>> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for e in t.iter().flatten() {
        if let Entry::Vc(v) = e {
            if seen.insert(Arc::as_ptr(v) as usize) {
                out.push(v.clone());
            }
        }
    }
    out
}
