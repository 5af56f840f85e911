//! The layer's threads never outlive the program.
//!
//! A process ends when its last thread ends. The layer's control thread is a thread too, so
//! a program whose main thread ends on its own (`pthread_exit` in `main`, or a seccomp filter
//! killing only that thread) would otherwise live on as a zombie with one thread of ours,
//! keeping its network namespace and connections alive.
//!
//! * The main thread's end is seen without a system call: the kernel clears the word whose
//!   address the thread registered with `set_tid_address` (glibc's, read once with
//!   `prctl(PR_GET_TID_ADDRESS)`) when the thread exits, whatever the reason.
//! * The program's other threads are counted from `Threads:` in `/proc/self/status` (read
//!   through a descriptor opened while `/proc` was reachable: a chroot does not hide it),
//!   less the zombie main thread and the layer's own threads.
//! * When no thread of the program is left, the control thread ends too. If the main thread
//!   ended with `pthread_exit`, the control thread returns normally: glibc's last thread then
//!   calls `exit(0)` and the program's `atexit` handlers run, as they would have. If it was
//!   killed, the control thread leaves with the bare `exit` system call, so the process ends
//!   with the main thread's status (killed by `SIGSYS`, say), as it would have alone.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering::*};

/// The main thread called `pthread_exit`.
static MAIN_PTHREAD_EXIT: AtomicBool = AtomicBool::new(false);
/// The main thread's `pthread_t`.
static MAIN_THREAD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// `/proc/self/status`, opened while reachable (-1: none).
static STATUS_FD: AtomicI32 = AtomicI32::new(-1);
/// Threads of the layer's own that run now (control, linger).
static LAYER_THREADS: AtomicU32 = AtomicU32::new(0);

/// Called in the main thread at start-up and in a forked child (whose only thread is its
/// main thread now).
pub fn init_main_thread() {
    crate::sys::process::remember_main_tid_word();
    MAIN_THREAD.store(crate::sys::process::pthread_self(), Release);
    MAIN_PTHREAD_EXIT.store(false, Release);
    LAYER_THREADS.store(0, Release);
    STATUS_FD.store(-1, Release);
    let old = crate::ownfd::unprotect(crate::ownfd::OWN_STATUS);
    if old >= 0 {
        crate::sys::fd::close(old);
    }
}

/// Opens `/proc/self/status` for later reads (when the control thread starts: before any
/// chroot a forked child may do).
pub fn open_status() {
    if STATUS_FD.load(Acquire) >= 0 || !crate::sandbox::allows_nr(libc::SYS_openat) {
        return;
    }
    let fd = crate::sys::fd::open(c"/proc/self/status", libc::O_RDONLY | libc::O_CLOEXEC);
    if fd >= 0 {
        let fd = crate::ownfd::move_high(fd);
        crate::ownfd::protect(crate::ownfd::OWN_STATUS, fd);
        STATUS_FD.store(fd, Release);
    }
}

/// True when the calling thread is the program's main thread.
pub fn is_main_thread() -> bool {
    MAIN_THREAD.load(Acquire) == crate::sys::process::pthread_self()
}

/// The main thread is calling `pthread_exit`.
pub fn main_pthread_exit() {
    MAIN_PTHREAD_EXIT.store(true, Release);
}

/// True once the main thread ended (only for a process whose main thread registered a word).
pub fn main_gone() -> bool {
    // (The word is in the main thread's descriptor, which stays mapped for the life of the
    // process.)
    crate::sys::process::main_tid_word_cleared()
}

/// One of the layer's threads starts (or, with `false`, ends).
pub fn layer_thread(running: bool) {
    if running {
        LAYER_THREADS.fetch_add(1, AcqRel);
    } else {
        LAYER_THREADS.fetch_sub(1, AcqRel);
    }
}

/// Threads of the program still running (the main thread excluded), when the count can be
/// read.
fn program_threads_left() -> Option<u32> {
    let fd = STATUS_FD.load(Acquire);
    if fd < 0 {
        return None;
    }
    let mut buf = [0u8; 4096];
    let n = crate::sys::fd::pread(fd, &mut buf, 0);
    if n <= 0 {
        return None;
    }
    let threads = substrate::procfs::parse_status(&buf[..n as usize]).threads?;
    Some(threads.saturating_sub(1 + LAYER_THREADS.load(Acquire)))
}

/// What the control thread does about the program's threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The program runs: go on.
    Run,
    /// The main thread ended but other program threads run: go on, look again soon.
    Watch,
    /// No program thread left, and the main thread ended with `pthread_exit`: return.
    EndNormally,
    /// No program thread left, and the main thread was killed: leave without running
    /// anything of the program's.
    EndBare,
}

/// Looks at the program's threads.
pub fn verdict() -> Verdict {
    if !main_gone() {
        return Verdict::Run;
    }
    match program_threads_left() {
        Some(n) if n > 0 => Verdict::Watch,
        _ if MAIN_PTHREAD_EXIT.load(Acquire) => Verdict::EndNormally,
        _ => Verdict::EndBare,
    }
}

/// Ends the calling thread only (not the process), with no clean-up of the program's.
pub fn exit_thread_bare() -> ! {
    crate::sys::process::exit_thread(0)
}
