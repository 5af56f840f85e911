//! Hooks on the calls that change what the process may do or how its threads end: seccomp
//! filters (`prctl(PR_SET_SECCOMP)`, and `seccomp(2)` through libc's `syscall`, as libseccomp
//! installs them) and `pthread_exit` of the main thread. See [`crate::sandbox`] and
//! [`crate::lifetime`]. The C entry points are in `sys::entry`.

use crate::error::Errno;
use crate::sys::prog::ProgBytes;
use crate::{fdtable, sandbox};
use libc::{c_int, c_long, c_ulong};

const SECCOMP_MODE_STRICT: c_ulong = 1;
const SECCOMP_MODE_FILTER: c_ulong = 2;
const SECCOMP_SET_MODE_STRICT: c_ulong = 0;
const SECCOMP_SET_MODE_FILTER: c_ulong = 1;
const SECCOMP_FILTER_FLAG_TSYNC: c_ulong = 1;

/// The program a seccomp install passes (its `sock_fprog` at the given address, read as
/// the instructions' bytes; `None` for a null pointer).
pub type Program<'a> = &'a dyn Fn(c_ulong) -> Option<ProgBytes>;

/// What a `prctl`/`seccomp` call is about to install, read before it goes in; what the
/// layer must do before it does is done here.
fn before(strict: bool, prog: c_ulong, tsync: bool, program: Program) -> Option<sandbox::Install> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // Blocking modes of the program's connections, while fcntl is still ours to use.
        for (fd, _) in fdtable::snapshot() {
            let _ = sandbox::nonblocking(fd);
        }
        let filter = (!strict).then(|| match program(prog) {
            Some(bytes) => sandbox::read_filter(bytes.get()),
            None => Err("no program".into()),
        });
        let (inst, then) = sandbox::before_install(filter, strict, tsync);
        // (The bells' own calls may not be allowed from now on.)
        crate::ready::drop_instance_bells();
        if then.listeners_go_plain {
            for (_, e) in fdtable::snapshot() {
                if let fdtable::Entry::Listener(l) = e {
                    crate::setup::closed_listener(&l);
                }
            }
        }
        if then.control_must_stop && crate::linkstate::control_running() {
            crate::log::info(format_args!(
                "a seccomp filter for every thread forbids what the control thread does: it stops \
                 (connections keep working, without failover)"
            ));
            crate::relink::retire_control();
        }
        inst
    }))
    .ok()
}

fn after(inst: Option<sandbox::Install>, ok: bool) {
    if let Some(i) = inst {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sandbox::installed(i, ok)));
    }
}

/// `prctl`: a seccomp install is read before it goes in and noted after.
pub fn prctl(
    option: c_int,
    a2: c_ulong,
    a3: c_ulong,
    program: Program,
    real: impl FnOnce() -> Result<c_int, Errno>,
) -> Result<c_int, Errno> {
    let inst = (option == libc::PR_SET_SECCOMP && (a2 == SECCOMP_MODE_STRICT || a2 == SECCOMP_MODE_FILTER))
        .then(|| before(a2 == SECCOMP_MODE_STRICT, a3, false, program))
        .flatten();
    let r = real();
    after(inst, r.is_ok());
    r
}

/// libc's `syscall`: the layer watches `seccomp` (and `prctl`) made through it, as
/// libseccomp's `seccomp_load` does, and forwards everything else unchanged.
pub fn syscall(
    n: c_long,
    a: [c_long; 6],
    program: Program,
    real: impl FnOnce() -> Result<c_long, Errno>,
) -> Result<c_long, Errno> {
    let inst = if n == libc::SYS_seccomp
        && (a[0] as c_ulong == SECCOMP_SET_MODE_FILTER || a[0] as c_ulong == SECCOMP_SET_MODE_STRICT)
    {
        before(
            a[0] as c_ulong == SECCOMP_SET_MODE_STRICT,
            a[2] as c_ulong,
            a[1] as c_ulong & SECCOMP_FILTER_FLAG_TSYNC != 0,
            program,
        )
    } else if n == libc::SYS_prctl
        && a[0] as c_int == libc::PR_SET_SECCOMP
        && (a[1] as c_ulong == SECCOMP_MODE_STRICT || a[1] as c_ulong == SECCOMP_MODE_FILTER)
    {
        before(a[1] as c_ulong == SECCOMP_MODE_STRICT, a[2] as c_ulong, false, program)
    } else {
        None
    };
    let r = real();
    if inst.is_some() {
        after(inst, r == Ok(0));
    }
    r
}

/// `_exit` and `_Exit`: no exit handler runs, so what the layer keeps back for the agent
/// (the ends of streams) goes now. Nothing in a vfork child (its memory is its parent's).
pub fn bare_exit() {
    if crate::vforked() {
        return;
    }
    let _ = std::panic::catch_unwind(crate::relink::flush_ended_at_exit);
}

/// `pthread_exit`: the main thread's end is noted (the control thread ends with the
/// program's last thread; see `lifetime`).
pub fn pthread_exit() {
    if crate::lifetime::is_main_thread() {
        crate::lifetime::main_pthread_exit();
        crate::linkstate::poke_work();
    }
}
