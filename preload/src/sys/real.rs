//! The real libc functions, resolved once with `dlsym(RTLD_NEXT)` into one table (as
//! rdma-core's preload does). Every call the layer makes on the program's behalf goes through
//! here, never through the hooks.

use libc::{
    c_char, c_int, c_uint, c_ulong, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t,
};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

fn resolve(name: &'static str) -> usize {
    // SAFETY: `name` is NUL-terminated (built with concat!); dlsym is thread-safe.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char) };
    if p.is_null() {
        // (The log needs these very functions: one plain line, then the end.)
        let line = format!("vmi: error: cannot resolve {}; aborting\n", name.trim_end_matches('\0'));
        // SAFETY: a valid buffer of its length.
        unsafe { libc::write(2, line.as_ptr() as *const libc::c_void, line.len()) };
        std::process::abort();
    }
    p as usize
}

macro_rules! real {
    ($($name:ident: fn($($arg:ident: $t:ty),*) -> $r:ty;)*) => {
        $(
            /// Calls the real libc function of the same name.
            ///
            /// # Safety
            /// Same contract as the libc function.
            #[inline]
            #[allow(non_snake_case)]
            pub unsafe fn $name($($arg: $t),*) -> $r {
                static P: AtomicUsize = AtomicUsize::new(0);
                let mut p = P.load(Relaxed);
                if p == 0 {
                    p = resolve(concat!(stringify!($name), "\0"));
                    P.store(p, Relaxed);
                }
                // SAFETY: `p` is the address dlsym gave for this exact symbol, whose C
                // signature is the one written here.
                let f = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($t),*) -> $r>(p) };
                // SAFETY: the caller upholds the libc contract.
                unsafe { f($($arg),*) }
            }
        )*
    };
}

real! {
    connect: fn(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    listen: fn(fd: c_int, backlog: c_int) -> c_int;
    accept: fn(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    accept4: fn(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    close: fn(fd: c_int) -> c_int;
    close_range: fn(first: c_uint, last: c_uint, flags: c_int) -> c_int;
    read: fn(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    write: fn(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    readv: fn(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    writev: fn(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    recv: fn(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    send: fn(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    recvfrom: fn(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    sendto: fn(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t;
    recvmsg: fn(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    sendmsg: fn(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    sendfile: fn(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    sendfile64: fn(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    dup: fn(fd: c_int) -> c_int;
    dup2: fn(old: c_int, new: c_int) -> c_int;
    dup3: fn(old: c_int, new: c_int, flags: c_int) -> c_int;
    fcntl: fn(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int;
    fcntl64: fn(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int;
    ioctl: fn(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int;
    shutdown: fn(fd: c_int, how: c_int) -> c_int;
    getsockname: fn(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    setsockopt: fn(fd: c_int, level: c_int, opt: c_int, val: *const c_void, len: socklen_t) -> c_int;
    getsockopt: fn(fd: c_int, level: c_int, opt: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int;
    getpeername: fn(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    epoll_ctl: fn(epfd: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int;
    epoll_wait: fn(epfd: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int) -> c_int;
    epoll_pwait: fn(epfd: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int, sigmask: *const libc::sigset_t) -> c_int;
    epoll_pwait2: fn(epfd: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: *const libc::timespec, sigmask: *const libc::sigset_t) -> c_int;
    poll: fn(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int;
    __poll_chk: fn(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int, fdslen: size_t) -> c_int;
    ppoll: fn(fds: *mut libc::pollfd, n: libc::nfds_t, ts: *const libc::timespec, sigmask: *const libc::sigset_t) -> c_int;
    select: fn(nfds: c_int, rd: *mut libc::fd_set, wr: *mut libc::fd_set, ex: *mut libc::fd_set, tv: *mut libc::timeval) -> c_int;
    pselect: fn(nfds: c_int, rd: *mut libc::fd_set, wr: *mut libc::fd_set, ex: *mut libc::fd_set, ts: *const libc::timespec, sigmask: *const libc::sigset_t) -> c_int;
    fork: fn() -> libc::pid_t;
    prctl: fn(option: c_int, a2: c_ulong, a3: c_ulong, a4: c_ulong, a5: c_ulong) -> c_int;
    pthread_exit: fn(ret: *mut c_void) -> !;
    _exit: fn(status: c_int) -> !;
    _Exit: fn(status: c_int) -> !;
    execve: fn(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    execv: fn(path: *const c_char, argv: *const *const c_char) -> c_int;
    execvp: fn(file: *const c_char, argv: *const *const c_char) -> c_int;
    execvpe: fn(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    __read_chk: fn(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t;
    __recv_chk: fn(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int) -> ssize_t;
    __recvfrom_chk: fn(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
}
