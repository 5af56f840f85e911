//! Safe forms of the process and thread calls the layer makes for itself.

use libc::c_int;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering::*};

/// `getpid` (glibc asks the kernel each time: no cache a `vfork` child could share).
pub fn getpid() -> i32 {
    // SAFETY: no preconditions.
    unsafe { libc::getpid() }
}

static PID: AtomicI32 = AtomicI32::new(0);

/// This process's id (cached; refreshed after fork; 0 where a sandbox forbids `getpid`).
#[inline]
pub fn pid() -> i32 {
    let p = PID.load(Relaxed);
    if p != 0 {
        return p;
    }
    pid_slow()
}

/// (Out of line: the sandbox check reads thread-local state, whose address the compiler
/// would otherwise compute in every caller's hot path.)
#[cold]
#[inline(never)]
fn pid_slow() -> i32 {
    if !super::gate::allows_nr(libc::SYS_getpid) {
        return 0;
    }
    let p = getpid();
    PID.store(p, Relaxed);
    p
}

/// A fork child forgets its parent's id.
pub fn forget_pid() {
    PID.store(0, Relaxed);
}

/// True in a child made by `vfork` (or `clone` with `CLONE_VM`) that has not exec'd yet: it
/// shares this process's memory, the layer's tables included, but has descriptors of its own
/// (Python's `subprocess` closes and moves descriptors there before its exec). Nothing it
/// does may change those tables: they are its parent's.
pub fn vforked() -> bool {
    let p = PID.load(Relaxed);
    // (A sandbox that forbids getpid: a vfork child there is not told apart.)
    // (glibc's getpid asks the kernel: no cache to share.)
    p != 0 && super::gate::allows_nr(libc::SYS_getpid) && p != getpid()
}

/// `getppid`.
pub fn getppid() -> i32 {
    // SAFETY: no preconditions.
    unsafe { libc::getppid() }
}

/// True unless process `pid` is known not to exist (`kill(pid, 0)` says `ESRCH`).
pub fn may_exist(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    !(unsafe { libc::kill(pid, 0) } != 0 && super::errno() == libc::ESRCH)
}

/// `raise`.
pub fn raise(sig: c_int) {
    // SAFETY: no pointers.
    unsafe { libc::raise(sig) };
}

/// This thread's `pthread_t`, as a number.
#[inline]
pub fn pthread_self() -> usize {
    // SAFETY: no preconditions.
    unsafe { libc::pthread_self() as usize }
}

/// `sched_yield`.
pub fn sched_yield() {
    // SAFETY: no preconditions.
    unsafe { libc::sched_yield() };
}

/// Ends the calling thread only (`SYS_exit`), skipping every destructor and handler.
pub fn exit_thread(code: c_int) -> ! {
    loop {
        // SAFETY: ends this thread; it touches nothing of the others.
        unsafe { libc::syscall(libc::SYS_exit, code) };
    }
}

/// `getrlimit`.
pub fn getrlimit(res: libc::__rlimit_resource_t) -> Option<libc::rlimit> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid pointer to a local.
    (unsafe { libc::getrlimit(res, &mut lim) } == 0).then_some(lim)
}

/// The main thread's thread-id word (see [`remember_main_tid_word`]), 0 if none.
static MAIN_TID_WORD: AtomicUsize = AtomicUsize::new(0);

/// Called in the main thread: remembers the word the kernel clears when this thread ends
/// (`PR_GET_TID_ADDRESS`; glibc registers it in the thread's descriptor).
pub fn remember_main_tid_word() {
    let mut p: usize = 0;
    // SAFETY: the kernel writes one pointer-sized word.
    let r = unsafe { libc::prctl(libc::PR_GET_TID_ADDRESS, &mut p as *mut usize as libc::c_ulong, 0, 0, 0) };
    MAIN_TID_WORD.store(if r == 0 { p } else { 0 }, Release);
}

/// True once the main thread ended (only when its word is known).
pub fn main_tid_word_cleared() -> bool {
    let addr = MAIN_TID_WORD.load(Acquire);
    // SAFETY: the word is in the main thread's descriptor, which stays mapped for the life
    // of the process; the kernel writes it, so it is read as an atomic.
    addr != 0 && unsafe { (*(addr as *const AtomicI32)).load(Acquire) } == 0
}

/// The file this library was loaded from (`dladdr` of one of its functions).
pub fn library_path() -> Option<String> {
    let f = library_path as *const libc::c_void;
    // SAFETY: all-zero is a valid Dl_info, filled by dladdr.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a local.
    if unsafe { libc::dladdr(f, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr gave a NUL-terminated name.
    Some(unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned())
}

/// Registers the fork handlers.
pub fn atfork(prepare: extern "C" fn(), parent: extern "C" fn(), child: extern "C" fn()) {
    // SAFETY: registering plain extern "C" functions.
    unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
}

/// Removes `key` from the environment. Called only while the program has no other thread
/// that could read the environment at the same time (at load, before `main`).
pub fn env_remove(key: &str) {
    // (`remove_var` is safe in this edition; it races with other threads' reads, which is
    // why the layer calls it at load only.)
    std::env::remove_var(key);
}

/// Values an exec about to happen uses, without a reference count of this process's own
/// when it is a `vfork` child: there a successful exec never drops what it holds, and the
/// counts live in the parent's memory (the child shares it), so they would stay raised for
/// ever. The suspended parent's own references keep the values alive until the exec.
pub struct ExecHeld<T> {
    _arcs: Vec<std::sync::Arc<T>>,
    ptrs: Vec<*const T>,
}

impl<T> ExecHeld<T> {
    /// Takes `v` (a vfork child keeps only the addresses; see above).
    pub fn new(v: Vec<std::sync::Arc<T>>) -> Self {
        let ptrs = v.iter().map(std::sync::Arc::as_ptr).collect();
        let _arcs = if vforked() { Vec::new() } else { v };
        ExecHeld { _arcs, ptrs }
    }

    /// Runs `f` on each value.
    pub fn each(&self, f: impl Fn(&T)) {
        for &p in &self.ptrs {
            // SAFETY: kept alive by `_arcs` or, in a vfork child, by the suspended parent's
            // descriptor table (see the type's description).
            f(unsafe { &*p })
        }
    }
}
