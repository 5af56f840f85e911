//! # libvmi_preload.so
//!
//! The interposer of vmi. Loaded with `LD_PRELOAD` into an unmodified program, it turns the
//! program's TCP connections to other programs under the layer into virtual connections.
//!
//! * The descriptor the program holds **is** the connection's physical TCP socket, so
//!   `poll`/`select`/`epoll`, `fstat`, `fork` inheritance, `getsockname`/`getpeername` and
//!   socket options stay native (but `TCP_CORK` and `TCP_NODELAY` while the socket carries
//!   only shared-memory wake-ups: the program's values are kept aside then). The layer intercepts the calls that move data and frames
//!   the bytes ([`hooks`]).
//! * [`setup`] decides at `connect`/`accept` time, with the node agent, whether a connection
//!   is virtual; everything else stays plain TCP.
//! * [`vc`] holds a connection's chains; [`tcp_sink`] is the device at their bottom;
//!   [`shm`] keeps the reliability state in memory shared across `fork`.
//! * [`fdtable`] says which descriptors are managed; [`real`] reaches libc.
//!
//! No panic leaves the library: every hook catches unwinding and turns it into an errno.
//!
//! `unsafe` is denied everywhere but in [`sys`] (the system calls and the memory the layer
//! maps), the C entry points ([`hooks`], [`hooks_proc`] and the constructor below: the
//! program's raw pointers become views there) and [`shm`] (a connection's state in memory
//! shared across `fork`, lent out only to the thread holding its lock). One function
//! elsewhere keeps it, for a reason of its own: `exec::Handover::exec` (a `vfork` child
//! reaches its parent's connections through raw pointers, because it must not hold
//! reference counts in the parent's memory across a successful exec).

#![deny(unsafe_code)]

pub mod agent;
pub mod config;
pub mod error;
pub mod exec;
pub mod fdtable;
#[allow(unsafe_code)]
pub mod hooks;
#[allow(unsafe_code)]
pub mod hooks_proc;
pub mod lifetime;
pub mod linger;
pub mod log;
pub mod ready;
pub mod relink;
pub mod relisten;
pub mod sandbox;
pub mod setup;
#[allow(unsafe_code)]
pub mod shm;
pub mod shm_sink;
pub mod stats;
#[allow(unsafe_code)]
pub mod sys;
pub mod tcp_sink;
pub mod vc;

use std::sync::atomic::{AtomicI32, Ordering::Relaxed};

static PID: AtomicI32 = AtomicI32::new(0);

/// This process's id (cached; refreshed after fork).
pub fn pid() -> i32 {
    let p = PID.load(Relaxed);
    if p != 0 {
        return p;
    }
    if !sandbox::allows_nr(libc::SYS_getpid) {
        return 0;
    }
    let p = sys::process::getpid();
    PID.store(p, Relaxed);
    p
}

/// True in a child made by `vfork` (or `clone` with `CLONE_VM`) that has not exec'd yet: it
/// shares this process's memory, the layer's tables included, but has descriptors of its own
/// (Python's `subprocess` closes and moves descriptors there before its exec). Nothing it
/// does may change those tables: they are its parent's.
pub fn vforked() -> bool {
    let p = PID.load(Relaxed);
    // (A sandbox that forbids getpid: a vfork child there is not told apart.)
    // (glibc's getpid asks the kernel: no cache to share.)
    p != 0 && sandbox::allows_nr(libc::SYS_getpid) && p != sys::process::getpid()
}

extern "C" fn before_fork() {
    relink::before_fork();
    agent::before_fork();
    linger::before_fork();
    fdtable::before_fork();
}

extern "C" fn after_fork_parent() {
    fdtable::after_fork_parent();
    linger::after_fork_parent();
    agent::after_fork_parent();
    relink::after_fork();
}

extern "C" fn after_fork_child() {
    PID.store(0, Relaxed);
    lifetime::init_main_thread();
    fdtable::after_fork_child();
    linger::after_fork_child();
    agent::after_fork_child();
    relink::after_fork();
    relink::after_fork_child();
}

extern "C" fn fini() {
    let _ = std::panic::catch_unwind(linger::at_exit);
}

extern "C" fn init() {
    let _ = std::panic::catch_unwind(|| {
        config::init();
        lifetime::init_main_thread();
        sandbox::init();
        exec::adopt();
        sys::process::atfork(before_fork, after_fork_parent, after_fork_child);
    });
}

// The loader calls these (entry points from C, as the hooks are).
#[allow(unsafe_code)]
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

#[allow(unsafe_code)]
#[used]
#[link_section = ".fini_array"]
static FINI: extern "C" fn() = fini;
