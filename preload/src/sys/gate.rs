//! Which system calls the program's seccomp filters let the calling thread make: the state
//! every system call of the layer's own consults before it is made (the filters are read
//! and kept by `crate::sandbox` as they go in; here they are only run).

use libc::{c_int, c_long};
use std::cell::Cell;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::*};
use std::sync::OnceLock;
use substrate::seccomp::{strict_allows, Filter, SeccompData, Verdict};

/// Some thread of the process is under a filter (or strict mode).
const ACTIVE: u32 = 1;
/// A filter came with the process (or could not be read): its contents are unknown.
const UNKNOWN: u32 = 2;
/// Strict mode was entered by some thread.
const STRICT: u32 = 4;
/// A filter was synchronised to every thread, the layer's own included.
const TSYNCED: u32 = 8;

static STATE: AtomicU32 = AtomicU32::new(0);

/// Filters the program installed, oldest first. Never freed (a process stacks a handful).
const MAX_FILTERS: usize = 64;
static FILTERS: [OnceLock<Filter>; MAX_FILTERS] = [const { OnceLock::new() }; MAX_FILTERS];
static N_FILTERS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread is one of the layer's, started while no filter existed.
    static LAYER_CLEAN: Cell<bool> = const { Cell::new(false) };
    /// System calls (numbers below 64) the hooked call in progress implies.
    static IMPLIED: Cell<u64> = const { Cell::new(0) };
}

/// True when some thread of this process runs under a seccomp filter or strict mode.
#[inline]
pub fn active() -> bool {
    STATE.load(Relaxed) & ACTIVE != 0
}

/// True when a filter the layer could not read covers the process.
pub fn unknown() -> bool {
    STATE.load(Relaxed) & UNKNOWN != 0
}

/// Called first in a thread of the layer's own: whether it is free of filters (it was
/// spawned while none existed: `clean_at_spawn`, read by the spawning thread).
pub fn layer_thread(clean_at_spawn: bool) {
    LAYER_CLEAN.with(|c| c.set(clean_at_spawn));
}

/// For a thread about to spawn one of the layer's: will the new thread be free of filters?
pub fn spawn_is_clean() -> bool {
    !active() || (LAYER_CLEAN.with(|c| c.get()) && STATE.load(Relaxed) & TSYNCED == 0)
}

/// True when the calling thread may make system call `nr` with `args` without being killed,
/// trapped or failed by a filter.
pub fn allows(nr: c_long, args: [u64; 6]) -> bool {
    let s = STATE.load(Relaxed);
    if s & ACTIVE == 0 {
        return true;
    }
    if LAYER_CLEAN.with(|c| c.get()) && s & TSYNCED == 0 {
        return true;
    }
    if s & STRICT != 0 && !strict_allows(nr) {
        return false;
    }
    if s & UNKNOWN != 0 {
        return (0..64).contains(&nr) && IMPLIED.with(|i| i.get()) & (1 << nr) != 0;
    }
    let d = SeccompData::native(nr, args);
    let n = N_FILTERS.load(Acquire).min(MAX_FILTERS);
    FILTERS[..n].iter().all(|f| f.get().is_none_or(|f| Verdict::of(f.run(&d)) == Verdict::Allow))
}

/// `allows` for a call whose arguments do not matter to the layer's choice (numbers only).
pub fn allows_nr(nr: c_long) -> bool {
    allows(nr, [0; 6])
}

/// True when every call of `nrs` is allowed (arguments not looked at).
pub fn allows_all(nrs: &[c_long]) -> bool {
    !active() || nrs.iter().all(|&n| allows_nr(n))
}

/// The calls one of the layer's own threads needs (control thread: event channel, dialing,
/// handshakes, swapping sockets, epoll registrations, sleeping; linger thread).
pub const THREAD_CALLS: &[c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_close,
    libc::SYS_poll,
    libc::SYS_socket,
    libc::SYS_connect,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_fcntl,
    libc::SYS_dup3,
    libc::SYS_openat,
    libc::SYS_epoll_ctl,
    libc::SYS_futex,
    libc::SYS_clock_nanosleep,
    libc::SYS_getpid,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_getfd,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_madvise,
    libc::SYS_exit,
];

/// The calls starting a thread needs (glibc's `pthread_create` and the thread's start).
pub const SPAWN_CALLS: &[c_long] = &[
    libc::SYS_mmap,
    libc::SYS_mprotect,
    libc::SYS_munmap,
    libc::SYS_clone3,
    libc::SYS_clone,
    libc::SYS_rt_sigprocmask,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_sched_getaffinity,
    libc::SYS_prctl,
    libc::SYS_futex,
    libc::SYS_madvise,
];

/// The calls setting up a virtual connection needs (the agent conversation, the statistics
/// table, shared memory).
pub const SETUP_CALLS: &[c_long] = &[
    libc::SYS_socket,
    libc::SYS_connect,
    libc::SYS_bind,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_poll,
    libc::SYS_close,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_fcntl,
    libc::SYS_openat,
    libc::SYS_unlink,
    libc::SYS_ftruncate,
    libc::SYS_memfd_create,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_getrandom,
    libc::SYS_getpid,
    libc::SYS_eventfd2,
    libc::SYS_futex,
];

/// May a program thread start one of the layer's threads now (and would that thread be
/// able to work)?
pub fn may_spawn() -> bool {
    if !active() {
        return true;
    }
    if !allows_all(SPAWN_CALLS) {
        return false;
    }
    // The new thread inherits this thread's filters.
    spawn_is_clean() || (!unknown() && allows_all(THREAD_CALLS))
}

/// May a program thread set up a virtual connection now?
pub fn may_set_up() -> bool {
    !active() || (!unknown() && allows_all(SETUP_CALLS))
}

// ---------------------------------------------------------------------------------------------
// The call in progress

/// While alive: the hooked call in progress implies system calls `mask` (bit n: call n).
/// Only consulted under filters the layer could not read.
pub struct Implied(u64);

impl Drop for Implied {
    fn drop(&mut self) {
        if self.0 != u64::MAX {
            IMPLIED.with(|i| i.set(self.0));
        }
    }
}

/// Notes the system calls the hooked call implies (see [`Implied`]).
#[inline]
pub fn implied(nrs: &[c_long]) -> Implied {
    if !unknown() {
        return Implied(u64::MAX);
    }
    let mask = nrs.iter().filter(|&&n| (0..64).contains(&n)).fold(0u64, |m, &n| m | 1 << n);
    Implied(IMPLIED.with(|i| i.replace(mask)))
}

/// Calls a program's `write`/`writev`/`send`-family call implies.
pub const WRITE_CALLS: &[c_long] = &[libc::SYS_write, libc::SYS_writev];
/// Calls a program's `read`/`readv` implies.
pub const READ_CALLS: &[c_long] = &[libc::SYS_read, libc::SYS_readv];
/// Calls a program's `send`/`sendto`/`sendmsg` implies.
pub const SEND_CALLS: &[c_long] = &[libc::SYS_sendto, libc::SYS_sendmsg];
/// Calls a program's `recv`/`recvfrom`/`recvmsg` implies.
pub const RECV_CALLS: &[c_long] = &[libc::SYS_recvfrom, libc::SYS_recvmsg];

/// True when the filters already in (none unreadable) let every thread, the layer's own
/// included, make each call of `nrs` (arguments not looked at).
pub fn every_thread_allows(nrs: &[c_long]) -> bool {
    let s = STATE.load(Relaxed);
    if s & ACTIVE == 0 {
        return true;
    }
    if s & UNKNOWN != 0 {
        return false;
    }
    let saved = LAYER_CLEAN.with(|c| c.replace(false));
    let ok = nrs.iter().all(|&nr| allows_nr(nr));
    LAYER_CLEAN.with(|c| c.set(saved));
    ok
}

/// A filter (or strict mode, `filter` None and `strict`) went in; `tsync`: for every
/// thread, the layer's own included.
pub fn record(filter: Option<Filter>, strict: bool, tsync: bool) {
    let mut add = ACTIVE;
    if strict {
        add |= STRICT;
    }
    if tsync {
        add |= TSYNCED;
    }
    match filter {
        Some(f) => {
            let i = N_FILTERS.fetch_add(1, AcqRel);
            if i < MAX_FILTERS {
                let _ = FILTERS[i].set(f);
            } else {
                add |= UNKNOWN;
            }
        }
        None if !strict => add |= UNKNOWN,
        None => {}
    }
    STATE.fetch_or(add, AcqRel);
}

/// The process started in strict mode (`strict`), or under filters it cannot read.
pub fn record_at_start(strict: bool) {
    STATE.fetch_or(ACTIVE | if strict { STRICT } else { UNKNOWN }, AcqRel);
}

/// Waits up to `ms` for `events` on `fd` with `poll` or `ppoll`, whichever the sandbox
/// allows; `None` when neither is. The revents otherwise (0 on time-out or error).
pub fn poll_one(fd: c_int, events: i16, ms: c_int) -> Option<i16> {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    let r = if allows(libc::SYS_poll, [0, 1, ms as u64, 0, 0, 0]) {
        super::fd::poll(std::slice::from_mut(&mut p), ms)
    } else if allows_nr(libc::SYS_ppoll) {
        super::fd::ppoll_us(std::slice::from_mut(&mut p), if ms >= 0 { ms as i64 * 1000 } else { -1 })
    } else {
        return None;
    };
    Some(if r > 0 { p.revents } else { 0 })
}

/// Sleeps about `us` microseconds with a call the sandbox allows (spins, yielding, when none
/// is).
pub fn pause_us(us: u64) {
    if allows_nr(libc::SYS_clock_nanosleep) || allows_nr(libc::SYS_nanosleep) {
        std::thread::sleep(std::time::Duration::from_micros(us));
        return;
    }
    let until = super::now_us() + us;
    let may_yield = allows_nr(libc::SYS_sched_yield);
    while super::now_us() < until {
        if may_yield {
            // SAFETY: no arguments.
            unsafe { libc::sched_yield() };
        } else {
            std::hint::spin_loop();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Blocking mode, remembered for sandboxes that forbid fcntl

const MAX_FD_CACHE: usize = 4096;
/// Bit per descriptor: O_NONBLOCK as last seen.
static NONBLOCK: [AtomicU32; MAX_FD_CACHE / 32] = [const { AtomicU32::new(0) }; MAX_FD_CACHE / 32];

fn remember_nonblock(fd: c_int, on: bool) {
    if (0..MAX_FD_CACHE as c_int).contains(&fd) {
        let (w, b) = (fd as usize / 32, 1u32 << (fd % 32));
        if on {
            NONBLOCK[w].fetch_or(b, Relaxed);
        } else {
            NONBLOCK[w].fetch_and(!b, Relaxed);
        }
    }
}

/// The program set a descriptor's file status flags (`fcntl(F_SETFL)`) or its blocking mode
/// (`ioctl(FIONBIO)`).
pub fn note_nonblock(fd: c_int, on: bool) {
    remember_nonblock(fd, on);
}

/// True if `fd` is in non-blocking mode: asked of the kernel, or, where the sandbox forbids
/// `fcntl`, as last seen (before the filter went in, or set by the program since).
pub fn nonblocking(fd: c_int) -> bool {
    if allows(libc::SYS_fcntl, [fd as u64, libc::F_GETFL as u64, 0, 0, 0, 0]) {
        let fl = super::fd::fcntl(fd, libc::F_GETFL, 0);
        let on = fl >= 0 && fl & libc::O_NONBLOCK != 0;
        remember_nonblock(fd, on);
        return on;
    }
    (0..MAX_FD_CACHE as c_int).contains(&fd)
        && NONBLOCK[fd as usize / 32].load(Relaxed) & (1 << (fd % 32)) != 0
}
