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
//! `unsafe` is denied everywhere but in [`sys`]: the system calls, the C entry points
//! (`sys::entry`, where the program's raw pointers become views of its memory and the
//! program's errno is set, from the one error type the hooks answer with), and the memory
//! the layer maps or shares (`sys::cell`, `sys::shared`).

#![deny(unsafe_code)]

pub mod accepts;
pub mod agent;
pub mod bells;
pub mod config;
pub mod error;
pub mod exec;
pub mod fdtable;
pub mod hooks;
pub mod hooks_proc;
pub mod lifetime;
pub mod linger;
pub mod linkstate;
pub mod log;
pub mod ownfd;
pub mod readiness;
pub mod ready;
pub mod relink;
pub mod sandbox;
pub mod setup;
pub mod shm;
pub mod shm_sink;
pub mod sockswap;
pub mod stats;
#[allow(unsafe_code)]
pub mod sys;
pub mod tamper;
pub mod tap;
pub mod tcp_sink;
pub mod tickets;
pub mod vc;

pub use sys::process::{pid, vforked};

extern "C" fn before_fork() {
    relink::before_fork();
    agent::before_fork();
    tickets::before_fork();
    linger::before_fork();
    fdtable::before_fork();
}

extern "C" fn after_fork_parent() {
    fdtable::after_fork_parent();
    linger::after_fork_parent();
    tickets::after_fork_parent();
    agent::after_fork_parent();
    relink::after_fork();
}

extern "C" fn after_fork_child() {
    sys::process::forget_pid();
    sys::splice::after_fork_child();
    sys::shared::after_fork_child();
    lifetime::init_main_thread();
    fdtable::after_fork_child();
    linger::after_fork_child();
    tickets::after_fork_child();
    agent::after_fork_child();
    relink::after_fork();
    relink::after_fork_child();
}

/// The loader's destructor call (see `sys::entry`).
extern "C" fn fini() {
    let _ = std::panic::catch_unwind(linger::at_exit);
    let _ = std::panic::catch_unwind(relink::flush_ended_at_exit);
}

/// The loader's constructor call (see `sys::entry`).
extern "C" fn init() {
    let _ = std::panic::catch_unwind(|| {
        config::init();
        fdtable::install();
        linkstate::init(linkstate::Control { start: relink::ensure_control, released: relink::released });
        agent::init(
            config::agent_socket(),
            agent::Above { listeners: vc::listeners_once, after_contact: relink::ensure_control },
        );
        lifetime::init_main_thread();
        sandbox::init();
        exec::adopt();
        sys::process::atfork(before_fork, after_fork_parent, after_fork_child);
    });
}
