//! Sandboxes: what the program lets the layer do, and how the layer keeps to it.
//!
//! A program may forbid system calls to itself: a seccomp filter (OpenSSH's pre-authentication
//! child, systemd's `SystemCallFilter=`, container runtimes, browsers) kills a thread, or the
//! whole process, that makes a call outside its list. The layer makes calls on the program's
//! behalf, so it must never make one the program's filters forbid:
//!
//! * **Knowing the filters.** Filters the program installs through libc (`prctl(PR_SET_SECCOMP)`,
//!   `seccomp(2)` through `syscall`) are copied before they go in and kept
//!   ([`substrate::seccomp`] runs them as the kernel does); `/proc/self/status` says at start-up
//!   whether filters came with the process (installed before its `exec`: then the layer cannot
//!   read them and knows only that they exist).
//! * **Asking before each call.** [`allows`] runs the known filters over the call the layer is
//!   about to make, with its arguments. A program thread is taken to be under every filter the
//!   process installed (a filter covers the thread that installs it and the threads it creates
//!   later: which one is not tracked, so the layer assumes the worst). The layer's own threads
//!   started before the first filter are under none, unless a filter was synchronised to every
//!   thread (`SECCOMP_FILTER_FLAG_TSYNC`): they do what the program's threads may not.
//! * **Choosing another call.** The data path uses the call the program's own call implies
//!   when the usual one is forbidden: a frame goes out with `write`/`writev` instead of
//!   `send(MSG_NOSIGNAL)`, a read with `read` instead of `recv`, a non-blocking look at the
//!   socket with `poll` and `read`. What has no allowed form (an acknowledgement sent while
//!   the program reads, a wake-up of the control thread) is handed to the control thread.
//! * **Under filters it cannot read** the layer keeps to the calls each hooked call implies
//!   ([`Implied`]); it sets up no new virtual connection (the agent conversation needs calls
//!   nobody allowed) and starts no thread.
//!
//! Everything here is cheap when no filter exists: one relaxed load.

use crate::log;
use crate::sys;
use libc::{c_int, c_long};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::*};
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

// ---------------------------------------------------------------------------------------------
// Calls with a fallback

/// Longest write taken for a control frame alone.
const CONTROL_FRAME_MAX: usize = 64;
/// Pieces up to this many bytes in all are gathered on the stack for a one-buffer call.
const STACK_GATHER: usize = 4096 + 64;

/// Sends the concatenation of `parts` (at most 4) on socket `fd` with the first form the
/// sandbox allows: `sendmsg` or `sendto` (with `MSG_NOSIGNAL`, then the flags as given),
/// then, when the call may block as the socket's mode says (no `MSG_DONTWAIT` asked for, or
/// the socket is non-blocking anyway, or a control frame alone), `writev` and `write`.
/// `None` when no form is allowed. Nothing is allocated (a sandbox may forbid `brk` and
/// `mmap`): small pieces are gathered on the stack, large ones go one call each, stopping at
/// a short write.
///
/// Without `MSG_NOSIGNAL` a write on a broken link raises `SIGPIPE`, as the program's own
/// write would have.
pub fn send_parts(fd: c_int, parts: &[&[u8]], flags: c_int) -> Option<isize> {
    let mut live = [&[][..]; sys::fd::MAX_PARTS];
    let mut n = 0;
    for p in parts.iter().filter(|p| !p.is_empty()).take(sys::fd::MAX_PARTS) {
        live[n] = p;
        n += 1;
    }
    let iov = &live[..n.max(1)];
    let len: usize = iov.iter().map(|v| v.len()).sum();
    let fdu = fd as u64;
    for f in [flags | libc::MSG_NOSIGNAL, flags] {
        if allows(libc::SYS_sendmsg, [fdu, 0, f as u64, 0, 0, 0]) {
            return Some(sys::fd::send_parts(fd, iov, f));
        }
    }
    for f in [flags | libc::MSG_NOSIGNAL, flags] {
        if allows(libc::SYS_sendto, [fdu, 0, len as u64, f as u64, 0, 0]) {
            return Some(one_by_one(iov, |b| sys::fd::send(fd, b, f)));
        }
    }
    if flags & libc::MSG_DONTWAIT != 0 && !nonblocking(fd) && len > CONTROL_FRAME_MAX {
        // (A control frame alone, an acknowledgement of a quarter window, cannot fill a
        // socket's buffer: a plain write of one does not block.)
        return None;
    }
    if allows(libc::SYS_writev, [fdu, 0, iov.len() as u64, 0, 0, 0]) {
        return Some(sys::fd::write_parts(fd, iov));
    }
    if allows(libc::SYS_write, [fdu, 0, len as u64, 0, 0, 0]) {
        return Some(one_by_one(iov, |b| sys::fd::write(fd, b)));
    }
    None
}

/// Sends `iov` with a one-buffer call: gathered on the stack when small, else piece by piece
/// (stopping at a short or failed write; bytes already sent count).
fn one_by_one(iov: &[&[u8]], mut call: impl FnMut(&[u8]) -> isize) -> isize {
    let len: usize = iov.iter().map(|v| v.len()).sum();
    if iov.len() == 1 || len <= STACK_GATHER {
        if iov.len() == 1 {
            return call(iov[0]);
        }
        let mut buf = [0u8; STACK_GATHER];
        let mut at = 0;
        for v in iov {
            buf[at..at + v.len()].copy_from_slice(v);
            at += v.len();
        }
        return call(&buf[..at]);
    }
    let mut total = 0isize;
    for v in iov {
        let r = call(v);
        if r < 0 {
            return if total > 0 { total } else { r };
        }
        total += r;
        if (r as usize) < v.len() {
            break;
        }
    }
    total
}

/// Reads at most `buf.len()` bytes from socket `fd` with `flags` (`MSG_DONTWAIT`,
/// `MSG_PEEK`) in the first form the sandbox allows: `recv`, `recvmsg`, or (no flags but
/// `MSG_DONTWAIT`) `read`/`readv`, after a `poll` says there is something when the call must
/// not block. `None` when no form is allowed.
pub fn recv_into(fd: c_int, buf: &mut [u8], flags: c_int) -> Option<isize> {
    let (p, n, fdu) = (buf.as_ptr() as u64, buf.len(), fd as u64);
    if flags == 0 && allows(libc::SYS_read, [fdu, p, n as u64, 0, 0, 0]) {
        return Some(sys::fd::read(fd, buf));
    }
    if allows(libc::SYS_recvfrom, [fdu, p, n as u64, flags as u64, 0, 0]) {
        return Some(sys::fd::recv(fd, buf, flags));
    }
    if allows(libc::SYS_recvmsg, [fdu, 0, flags as u64, 0, 0, 0]) {
        return Some(sys::fd::recv_parts(fd, &mut [buf], flags));
    }
    if flags & !libc::MSG_DONTWAIT != 0 {
        return None;
    }
    let read_ok = allows(libc::SYS_read, [fdu, p, n as u64, 0, 0, 0]);
    let readv_ok = allows(libc::SYS_readv, [fdu, 0, 1, 0, 0, 0]);
    if !read_ok && !readv_ok {
        return None;
    }
    if flags & libc::MSG_DONTWAIT != 0 && !nonblocking(fd) {
        // Never block where the layer asked not to: look first.
        match poll_one(fd, libc::POLLIN, 0) {
            Some(0) => {
                crate::sys::set_errno(libc::EAGAIN);
                return Some(-1);
            }
            Some(_) => {}
            None => return None,
        }
    }
    if read_ok {
        return Some(sys::fd::read(fd, buf));
    }
    Some(sys::fd::read_parts(fd, &mut [buf]))
}

/// Waits up to `ms` for `events` on `fd` with `poll` or `ppoll`, whichever the sandbox
/// allows; `None` when neither is. The revents otherwise (0 on time-out or error).
pub fn poll_one(fd: c_int, events: i16, ms: c_int) -> Option<i16> {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    let r = if allows(libc::SYS_poll, [0, 1, ms as u64, 0, 0, 0]) {
        sys::fd::poll(std::slice::from_mut(&mut p), ms)
    } else if allows_nr(libc::SYS_ppoll) {
        sys::fd::ppoll_us(std::slice::from_mut(&mut p), if ms >= 0 { ms as i64 * 1000 } else { -1 })
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
    let until = crate::sys::now_us() + us;
    let may_yield = allows_nr(libc::SYS_sched_yield);
    while crate::sys::now_us() < until {
        if may_yield {
            sys::process::sched_yield();
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
        let fl = sys::fd::fcntl(fd, libc::F_GETFL, 0);
        let on = fl >= 0 && fl & libc::O_NONBLOCK != 0;
        remember_nonblock(fd, on);
        return on;
    }
    (0..MAX_FD_CACHE as c_int).contains(&fd)
        && NONBLOCK[fd as usize / 32].load(Relaxed) & (1 << (fd % 32)) != 0
}

// ---------------------------------------------------------------------------------------------
// Filters going in

/// How a filter goes in.
pub struct Install {
    filter: Option<Filter>,
    strict: bool,
    tsync: bool,
}

/// Reads the filter a program is installing (`insns`: its instructions, 8 bytes each, as
/// the C entry point copied them), before the call goes to the kernel.
pub fn read_filter(insns: &[u8]) -> Result<Filter, String> {
    if insns.is_empty() {
        return Err("an empty program".into());
    }
    Filter::parse(insns).map_err(|e| e.to_string())
}

/// Before the kernel installs a filter (`filter`: None for one that could not be read) or
/// strict mode, with `SECCOMP_FILTER_FLAG_TSYNC` or not: remembers what the layer will need
/// to know once its calls are restricted, and keeps the layer's threads out of a filter that
/// would forbid their work. Returns what [`installed`] needs.
pub fn before_install(filter: Option<Result<Filter, String>>, strict: bool, tsync: bool) -> Install {
    // Blocking modes of the program's connections, while fcntl is still ours to use.
    for (fd, _) in crate::fdtable::snapshot() {
        let _ = nonblocking(fd);
    }
    let filter = match filter {
        Some(Ok(f)) => Some(f),
        Some(Err(e)) => {
            log::warn(format_args!("a seccomp filter the layer cannot read ({e}): it keeps to the calls each program call implies"));
            None
        }
        None => None,
    };
    let inst = Install { filter, strict, tsync };
    // (Said now: once the filter is in, writing to stderr may be refused.)
    log::info(format_args!(
        "{} going in{}: the layer keeps to the calls it allows",
        if strict { "seccomp strict mode" } else { "a seccomp filter" },
        if tsync { " for every thread" } else { "" }
    ));
    let setup_after = may_set_up()
        && !strict
        && inst.filter.as_ref().is_some_and(|f| {
            SETUP_CALLS
                .iter()
                .all(|&nr| Verdict::of(f.run(&SeccompData::native(nr, [0; 6]))) == Verdict::Allow)
        });
    if !setup_after {
        // New connections to this process's listeners stay plain from now on: the agent must
        // not tell clients otherwise.
        for (_, e) in crate::fdtable::snapshot() {
            if let crate::fdtable::Entry::Listener(l) = e {
                crate::setup::closed_listener(&l);
            }
        }
    }
    if tsync && crate::relink::control_running() && !layer_threads_may_work_under(&inst) {
        log::info(format_args!(
            "a seccomp filter for every thread forbids what the control thread does: it stops \
             (connections keep working, without failover)"
        ));
        crate::relink::retire_control();
    }
    inst
}

/// Would the layer's threads still work with `inst` added?
fn layer_threads_may_work_under(inst: &Install) -> bool {
    if inst.strict {
        return false;
    }
    let Some(f) = &inst.filter else { return false };
    THREAD_CALLS.iter().all(|&nr| Verdict::of(f.run(&SeccompData::native(nr, [0; 6]))) == Verdict::Allow)
        && STATE.load(Relaxed) & UNKNOWN == 0
        && {
            // ... and every filter already there (they cover the layer's threads after TSYNC).
            let saved = LAYER_CLEAN.with(|c| c.replace(false));
            let ok = THREAD_CALLS.iter().all(|&nr| allows_nr(nr));
            LAYER_CLEAN.with(|c| c.set(saved));
            ok || STATE.load(Relaxed) & ACTIVE == 0
        }
}

/// After the kernel's answer (`ok`): the filter counts from now on.
pub fn installed(inst: Install, ok: bool) {
    if !ok {
        return;
    }
    let mut add = ACTIVE;
    if inst.strict {
        add |= STRICT;
    }
    if inst.tsync {
        add |= TSYNCED;
    }
    match inst.filter {
        Some(f) => {
            let i = N_FILTERS.fetch_add(1, AcqRel);
            if i < MAX_FILTERS {
                let _ = FILTERS[i].set(f);
            } else {
                add |= UNKNOWN;
            }
        }
        None if !inst.strict => add |= UNKNOWN,
        None => {}
    }
    STATE.fetch_or(add, AcqRel);
    WAKE_OK.store(
        allows(libc::SYS_write, [crate::fdtable::own_fd(crate::fdtable::OWN_WAKE) as u64, 0, 8, 0, 0, 0]),
        Release,
    );
}

/// Program threads may write to the control thread's wake descriptor.
static WAKE_OK: AtomicBool = AtomicBool::new(true);

/// True when a program thread's wake-up reaches the control thread at once (else the
/// control thread looks often, see [`control_poll_ms`]).
pub fn wake_reaches() -> bool {
    !active() || WAKE_OK.load(Acquire)
}

/// How long the control thread may sleep when nothing is under way: short when program
/// threads cannot wake it.
pub fn control_poll_ms(idle: i32) -> i32 {
    if wake_reaches() {
        idle
    } else {
        idle.min(20)
    }
}

// ---------------------------------------------------------------------------------------------
// Start-up

/// At start-up: filters that came with the process (installed before the exec) are there but
/// unreadable; the layer then keeps to what each call implies.
pub fn init() {
    let Some(text) = read_proc_status() else { return };
    let st = substrate::procfs::parse_status(&text);
    match st.seccomp {
        Some(1) => {
            STATE.fetch_or(ACTIVE | STRICT, AcqRel);
        }
        Some(2) => {
            STATE.fetch_or(ACTIVE | UNKNOWN, AcqRel);
            log::info(format_args!(
                "started under {} seccomp filter(s) the layer cannot read: no new virtual \
                 connections, and the layer keeps to the calls each program call implies",
                st.seccomp_filters.unwrap_or(1)
            ));
        }
        _ => {}
    }
}

/// The text of `/proc/self/status`, or `None`.
pub fn read_proc_status() -> Option<Vec<u8>> {
    std::fs::read("/proc/self/status").ok()
}
