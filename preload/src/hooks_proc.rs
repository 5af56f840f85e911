//! Hooks on the calls that change what the process may do or how its threads end: seccomp
//! filters (`prctl(PR_SET_SECCOMP)`, and `seccomp(2)` through libc's `syscall`, as libseccomp
//! installs them) and `pthread_exit` of the main thread. See [`crate::sandbox`] and
//! [`crate::lifetime`].

#![allow(clippy::missing_safety_doc)]

use crate::sandbox;
use crate::sys::real;
use libc::{c_int, c_long, c_ulong, c_void};

const SECCOMP_MODE_STRICT: c_ulong = 1;
const SECCOMP_MODE_FILTER: c_ulong = 2;
const SECCOMP_SET_MODE_STRICT: c_ulong = 0;
const SECCOMP_SET_MODE_FILTER: c_ulong = 1;
const SECCOMP_FILTER_FLAG_TSYNC: c_ulong = 1;

/// The instructions of the program's `sock_fprog` (`None` for a null one).
///
/// # Safety
/// `prog` is null or a valid `sock_fprog` whose `filter` points at `len` instructions (the
/// kernel reads the same memory right after).
unsafe fn program_bytes<'a>(prog: *const libc::sock_fprog) -> Option<&'a [u8]> {
    if prog.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    let (len, insns) = unsafe { ((*prog).len as usize, (*prog).filter) };
    if insns.is_null() || len == 0 {
        return Some(&[]);
    }
    // SAFETY: `len` instructions of 8 bytes each, as the caller says.
    Some(unsafe { std::slice::from_raw_parts(insns as *const u8, len * 8) })
}

/// What a `prctl`/`seccomp` call is about to install, read before it goes in.
fn before(strict: bool, prog: c_ulong, tsync: bool) -> sandbox::Install {
    let filter = if strict {
        None
    } else {
        // SAFETY: the program passes its `sock_fprog` (or garbage the kernel will refuse with
        // EFAULT: a null pointer is checked; other bad pointers fault the program's own call
        // just the same), whose `filter` holds `len` instructions of 8 bytes.
        Some(match unsafe { program_bytes(prog as *const libc::sock_fprog) } {
            Some(bytes) => sandbox::read_filter(bytes),
            None => Err("no program".into()),
        })
    };
    sandbox::before_install(filter, strict, tsync)
}

fn guarded_before(strict: bool, prog: c_ulong, tsync: bool) -> Option<sandbox::Install> {
    std::panic::catch_unwind(|| before(strict, prog, tsync)).ok()
}

fn after(inst: Option<sandbox::Install>, r: c_long) {
    if let Some(i) = inst {
        let e = crate::sys::errno();
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sandbox::installed(i, r == 0)));
        crate::sys::set_errno(e);
    }
}

#[no_mangle]
pub unsafe extern "C" fn prctl(option: c_int, a2: c_ulong, a3: c_ulong, a4: c_ulong, a5: c_ulong) -> c_int {
    let inst = (option == libc::PR_SET_SECCOMP && (a2 == SECCOMP_MODE_STRICT || a2 == SECCOMP_MODE_FILTER))
        .then(|| guarded_before(a2 == SECCOMP_MODE_STRICT, a3, false))
        .flatten();
    // SAFETY: forwarding the program's arguments (prctl reads at most four after the option).
    let r = unsafe { real::prctl(option, a2, a3, a4, a5) };
    after(inst, r as c_long);
    r
}

/// The kernel's `syscall` instruction with six arguments; returns its raw answer (negative
/// errno on failure).
#[cfg(target_arch = "x86_64")]
unsafe fn raw_syscall(n: c_long, a: [c_long; 6]) -> c_long {
    let r: c_long;
    // SAFETY: the caller's arguments go to the kernel unchanged; rcx and r11 are clobbered
    // by the instruction, as declared.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") n => r,
            in("rdi") a[0], in("rsi") a[1], in("rdx") a[2],
            in("r10") a[3], in("r8") a[4], in("r9") a[5],
            lateout("rcx") _, lateout("r11") _,
            options(nostack),
        );
    }
    r
}

/// libc's `syscall`: the layer watches `seccomp` (and `prctl`) made through it, as
/// libseccomp's `seccomp_load` does, and forwards everything else unchanged.
#[cfg(target_arch = "x86_64")]
#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    let inst = if n == libc::SYS_seccomp
        && (a1 as c_ulong == SECCOMP_SET_MODE_FILTER || a1 as c_ulong == SECCOMP_SET_MODE_STRICT)
    {
        guarded_before(
            a1 as c_ulong == SECCOMP_SET_MODE_STRICT,
            a3 as c_ulong,
            a2 as c_ulong & SECCOMP_FILTER_FLAG_TSYNC != 0,
        )
    } else if n == libc::SYS_prctl
        && a1 as c_int == libc::PR_SET_SECCOMP
        && (a2 as c_ulong == SECCOMP_MODE_STRICT || a2 as c_ulong == SECCOMP_MODE_FILTER)
    {
        guarded_before(a2 as c_ulong == SECCOMP_MODE_STRICT, a3 as c_ulong, false)
    } else {
        None
    };
    // SAFETY: forwarding the program's system call as libc's `syscall` would.
    let raw = unsafe { raw_syscall(n, [a1, a2, a3, a4, a5, a6]) };
    let r = if (-4095..0).contains(&raw) {
        crate::sys::set_errno(-raw as c_int);
        -1
    } else {
        raw
    };
    if inst.is_some() {
        after(inst, if r == 0 { 0 } else { -1 });
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn pthread_exit(ret: *mut c_void) -> ! {
    if crate::lifetime::is_main_thread() {
        // The control thread ends with the program's last thread (see `lifetime`).
        crate::lifetime::main_pthread_exit();
        crate::relink::poke_work();
    }
    // SAFETY: forwarding.
    unsafe { real::pthread_exit(ret) }
}
