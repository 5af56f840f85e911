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
use crate::sys::gate;
pub use crate::sys::gate::{
    active, allows, allows_all, allows_nr, implied, layer_thread, may_set_up, may_spawn, nonblocking,
    note_nonblock, pause_us, poll_one, spawn_is_clean, unknown, Implied, READ_CALLS, RECV_CALLS, SEND_CALLS,
    SETUP_CALLS, SPAWN_CALLS, THREAD_CALLS, WRITE_CALLS,
};
use libc::c_int;
use std::sync::atomic::{AtomicBool, Ordering::*};
use substrate::seccomp::{Filter, SeccompData, Verdict};

// ---------------------------------------------------------------------------------------------
// Calls with a fallback

/// Longest write taken for a control frame alone.
const CONTROL_FRAME_MAX: usize = 64;
/// Pieces up to this many bytes in all are gathered on the stack for a one-buffer call.
const STACK_GATHER: usize = 4096 + 64;

/// Sends the concatenation of `parts` (at most `sys::fd::MAX_PARTS`) on socket `fd` with the first form the
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

/// What a filter about to go in means for the layer (see [`before_install`]).
pub struct Consequences {
    /// New connections to this process's listeners stay plain from now on (the layer will
    /// not be allowed what set-up needs): the agent must not tell clients otherwise.
    pub listeners_go_plain: bool,
    /// The filter covers every thread and forbids what the control thread does.
    pub control_must_stop: bool,
}

/// Before the kernel installs a filter (`filter`: None for one that could not be read) or
/// strict mode, with `SECCOMP_FILTER_FLAG_TSYNC` or not: remembers what the layer will need
/// to know once its calls are restricted, and says what the layer must do before it goes in
/// (the caller does it). Returns what [`installed`] needs.
pub fn before_install(
    filter: Option<Result<Filter, String>>,
    strict: bool,
    tsync: bool,
) -> (Install, Consequences) {
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
    let control_must_stop = tsync && !layer_threads_may_work_under(&inst);
    (inst, Consequences { listeners_go_plain: !setup_after, control_must_stop })
}

/// Would the layer's threads still work with `inst` added?
fn layer_threads_may_work_under(inst: &Install) -> bool {
    if inst.strict {
        return false;
    }
    let Some(f) = &inst.filter else { return false };
    THREAD_CALLS.iter().all(|&nr| Verdict::of(f.run(&SeccompData::native(nr, [0; 6]))) == Verdict::Allow)
        // ... and every filter already there (they cover the layer's threads after TSYNC).
        && gate::every_thread_allows(THREAD_CALLS)
}

/// After the kernel's answer (`ok`): the filter counts from now on.
pub fn installed(inst: Install, ok: bool) {
    if !ok {
        return;
    }
    gate::record(inst.filter, inst.strict, inst.tsync);
    WAKE_OK.store(
        allows(libc::SYS_write, [crate::ownfd::own_fd(crate::ownfd::OWN_WAKE) as u64, 0, 8, 0, 0, 0]),
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
        Some(1) => gate::record_at_start(true),
        Some(2) => {
            gate::record_at_start(false);
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
