//! Which descriptors the layer manages: a bitmap for the common check (one atomic load, so
//! files, pipes and plain sockets pay nothing measurable) and a table of entries behind a
//! read-write lock, with each thread's last few connections kept near it ([`vc`]). (The
//! layer's own descriptors are in [`crate::ownfd`].)

use crate::vc::Vc;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::{Arc, RwLock, Weak};

const BITMAP_FDS: usize = 1 << 16;

static MANAGED: [AtomicU64; BITMAP_FDS / 64] = [const { AtomicU64::new(0) }; BITMAP_FDS / 64];
static TABLE: RwLock<Table> =
    RwLock::new(Table { slots: Vec::new(), by_vc: BTreeMap::new(), by_gid: BTreeMap::new() });

/// The entries by descriptor, and each virtual connection's descriptors (lowest first), so
/// that finding a connection's descriptors does not walk the table: the control thread does
/// it for every connection in its sweeps and failovers. Each connection is also found by
/// its GID (the agent's events name connections by GID: a failover of N connections hands
/// over N links, and a walk per hand-over made it quadratic).
struct Table {
    slots: Vec<Option<Entry>>,
    by_vc: BTreeMap<usize, Vec<i32>>,
    by_gid: BTreeMap<u128, Arc<Vc>>,
}

impl Table {
    fn note(&mut self, fd: i32, e: &Option<Entry>, on: bool) {
        let Some(Entry::Vc(v)) = e else { return };
        let key = Arc::as_ptr(v) as usize;
        let gid = v.mem().conn().gid;
        if on {
            let fds = self.by_vc.entry(key).or_default();
            if let Err(at) = fds.binary_search(&fd) {
                fds.insert(at, fd);
            }
            self.by_gid.insert(gid, v.clone());
        } else if let Some(fds) = self.by_vc.get_mut(&key) {
            fds.retain(|&f| f != fd);
            if fds.is_empty() {
                self.by_vc.remove(&key);
                // (Another connection with the same GID may have taken its place.)
                if self.by_gid.get(&gid).is_some_and(|g| Arc::as_ptr(g) as usize == key) {
                    self.by_gid.remove(&gid);
                }
            }
        }
    }
}
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
    if fd == 2 {
        crate::log::stderr_is_connection(on);
    }
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
    t.slots.get(fd as usize).cloned().flatten()
}

/// One more at every change of the table, made under its write lock.
static CHANGES: AtomicU64 = AtomicU64::new(0);

/// How many connections each thread keeps near it.
const NEAR: usize = 16;

/// A connection a thread found, with the count of the table's changes when it looked.
struct Near {
    fd: i32,
    changes: u64,
    vc: Weak<Vc>,
}

thread_local! {
    /// The thread's last connections, by descriptor modulo [`NEAR`]. Weak: a connection
    /// closed goes when the table and its calls let go of it, as before.
    static NEAR_VCS: RefCell<[Option<Near>; NEAR]> = const { RefCell::new([const { None }; NEAR]) };
}

/// The virtual connection on `fd`, if it is one. Each hooked call starts here, so the usual
/// answer takes no lock: while the table has not changed since this thread last found the
/// connection at `fd`, its own note of it is the answer (one load of the table's count of
/// changes, and the count of the connection's holders raised). The table's read lock and the
/// count of the entry it hands out cost about 40 ns a call here, as much as the rest of the
/// layer's work on an `epoll_ctl`.
#[inline(always)]
pub fn vc(fd: i32) -> Option<Arc<Vc>> {
    if (fd as usize) < BITMAP_FDS && !is_managed(fd) {
        return None;
    }
    let changes = CHANGES.load(Acquire);
    if let Some(v) = near(fd, changes) {
        return Some(v);
    }
    // (The count is read before the table: a change after it makes this note stale for
    // good, and one before it is in what the table says.)
    match get(fd) {
        Some(Entry::Vc(v)) => {
            keep_near(fd, changes, &v);
            Some(v)
        }
        _ => None,
    }
}

/// This thread's note of the connection at `fd`, if the table has not changed since.
/// (None during the thread's end, when its notes are gone, or inside a signal handler that
/// interrupted [`keep_near`].)
#[inline]
fn near(fd: i32, changes: u64) -> Option<Arc<Vc>> {
    NEAR_VCS
        .try_with(|n| {
            let n = n.try_borrow().ok()?;
            let e = n[fd as usize % NEAR].as_ref()?;
            (e.fd == fd && e.changes == changes).then(|| e.vc.upgrade()).flatten()
        })
        .ok()
        .flatten()
}

fn keep_near(fd: i32, changes: u64, v: &Arc<Vc>) {
    let _ = NEAR_VCS.try_with(|n| {
        if let Ok(mut n) = n.try_borrow_mut() {
            n[fd as usize % NEAR] = Some(Near { fd, changes, vc: Arc::downgrade(v) });
        }
    });
}

/// `f` on the connection at `fd`, if any, under the table's read lock (no count taken on
/// the connection: for a look at its ring in a busy loop). `f` must not touch the table.
#[inline]
pub fn with_vc<R>(fd: i32, f: impl FnOnce(&Vc) -> R) -> Option<R> {
    if fd < 0 || ((fd as usize) < BITMAP_FDS && !is_managed(fd)) {
        return None;
    }
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    match t.slots.get(fd as usize) {
        Some(Some(Entry::Vc(v))) => Some(f(v)),
        _ => None,
    }
}

/// Records `e` for `fd` (replacing what was there); returns the old entry.
pub fn insert(fd: i32, e: Entry) -> Option<Entry> {
    if fd < 0 {
        return None;
    }
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    if t.slots.len() <= fd as usize {
        t.slots.resize(fd as usize + 1, None);
    }
    let new = Some(e);
    t.note(fd, &new, true);
    CHANGES.fetch_add(1, Release);
    let old = std::mem::replace(&mut t.slots[fd as usize], new);
    t.note(fd, &old, false);
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
    CHANGES.fetch_add(1, Release);
    let old = t.slots.get_mut(fd as usize).and_then(|s| s.take());
    t.note(fd, &old, false);
    if old.is_some() {
        ENTRIES.fetch_sub(1, Relaxed);
    }
    old
}

/// All entries (for fork and exec handling).
pub fn snapshot() -> Vec<(i32, Entry)> {
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    t.slots.iter().enumerate().filter_map(|(i, e)| e.clone().map(|e| (i as i32, e))).collect()
}

/// Every listener in the table: descriptor and address.
pub fn listeners() -> Vec<(i32, SocketAddr)> {
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    t.slots
        .iter()
        .enumerate()
        .filter_map(|(fd, e)| match e {
            Some(Entry::Listener(l)) => Some((fd as i32, l.addr)),
            _ => None,
        })
        .collect()
}

/// Tells the connection layer how to ask this table (at start).
pub fn install() {
    crate::vc::descriptors_from(crate::vc::Descriptors {
        connections: distinct_vcs,
        fds_of,
        listeners,
        by_gid,
    });
}

thread_local! {
    static FORK_GUARD: std::cell::RefCell<Option<std::sync::RwLockWriteGuard<'static, Table>>> =
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
    t.by_vc.get(&(vc as *const Vc as usize)).cloned().unwrap_or_default()
}

/// The virtual connection with GID `gid`, if this process has a descriptor of it.
pub fn by_gid(gid: u128) -> Option<Arc<Vc>> {
    TABLE.read().unwrap_or_else(|e| e.into_inner()).by_gid.get(&gid).cloned()
}

/// Each distinct virtual connection in the table, once.
pub fn distinct_vcs() -> Vec<Arc<Vc>> {
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    t.by_vc
        .values()
        .filter_map(|fds| match fds.first().and_then(|&fd| t.slots.get(fd as usize)) {
            Some(Some(Entry::Vc(v))) => Some(v.clone()),
            _ => None,
        })
        .collect()
}
