//! The C entry points: the libc symbols the layer interposes, and its constructor and
//! destructor. Each one makes views of the program's memory ([`super::prog`]), hands them
//! to the safe hook of the same name in [`crate::hooks`], and turns the hook's answer into
//! the C convention: the result; or the real libc function called with the program's own
//! arguments; or -1 with errno set. This is the one place that sets the program's errno.
//!
//! Hooks that act around the real call get it as a closure made here. Those outside the
//! data path (set-up, descriptors, waits, processes) leave the program's errno as it was
//! when they succeed, whatever the layer's own calls did meanwhile.

#![allow(clippy::missing_safety_doc)]

use super::prog::{
    self, ProgAddrOut, ProgArray, ProgBytes, ProgBytesMut, ProgCell, ProgIov, ProgMsg, ProgOptOut,
};
use super::{cvt, errno, real, set_errno, Errno};
use crate::error::{Hook, Hooked};
use crate::hooks;
use crate::hooks_proc;
use libc::{
    c_char, c_int, c_long, c_uint, c_ulong, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t,
    ssize_t,
};

/// A C return type and its failure value.
trait CRet: Copy {
    const FAIL: Self;
}

impl CRet for c_int {
    const FAIL: c_int = -1;
}

impl CRet for ssize_t {
    const FAIL: ssize_t = -1;
}

/// -1 with errno set.
#[cold]
fn fail<T: CRet>(e: Errno) -> T {
    set_errno(e.0);
    T::FAIL
}

/// Runs a hook; a panic in it never unwinds into C: the call fails with `EIO` (the data
/// hooks catch their own, closer to the connection: see `error::guarded`).
#[inline(always)]
fn caught<T>(f: impl FnOnce() -> Result<T, Errno>) -> Result<T, Errno> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        crate::log::error(format_args!("internal error in an intercepted call; returning EIO"));
        Err(Errno(libc::EIO))
    })
}

/// A data hook's answer in the C convention; `real` makes the program's call. A call the
/// layer made succeed leaves the program's errno as it was (as a system call does), whatever
/// the layer's own calls on the socket did meanwhile.
#[inline(always)]
fn data(h: impl FnOnce() -> Hooked<usize>, real: impl FnOnce() -> ssize_t) -> ssize_t {
    // (The thread's errno slot, looked up once for the read and the write back.)
    // SAFETY: __errno_location always returns the calling thread's errno slot.
    let slot = unsafe { libc::__errno_location() };
    // SAFETY: as above.
    let before = unsafe { *slot };
    match h() {
        Ok(Hook::Done(n)) => {
            // SAFETY: as above (the same thread).
            unsafe { *slot = before };
            n as ssize_t
        }
        Ok(Hook::Real) => {
            crate::ready::kernel_touched();
            real()
        }
        Err(e) => fail(e),
    }
}

/// An int hook's answer in the C convention; when the layer answered, the program's errno
/// is what it was before.
#[inline(always)]
fn answer(h: impl FnOnce() -> Hooked<c_int>, real: impl FnOnce() -> c_int) -> c_int {
    let before = errno();
    match caught(h) {
        Ok(Hook::Done(n)) => {
            set_errno(before);
            n
        }
        Ok(Hook::Real) => real(),
        Err(e) => fail(e),
    }
}

/// Runs a hook that acts around the real call; on success the program's errno is what it
/// was before.
#[inline]
fn kept<T: CRet>(f: impl FnOnce() -> Result<T, Errno>) -> T {
    let before = errno();
    match caught(f) {
        Ok(v) => {
            set_errno(before);
            v
        }
        Err(e) => fail(e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: the program's address of `len` bytes.
    let dst = unsafe { super::from_raw(addr, len) };
    kept(|| {
        hooks::connect(fd, dst, |via| match via {
            Some(a) => cvt(super::fd::connect(fd, a)),
            // SAFETY: forwarding the program's arguments.
            None => cvt(unsafe { real::connect(fd, addr, len) }),
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: forwarding.
    kept(|| hooks::listen(fd, || cvt(unsafe { real::listen(fd, backlog) })))
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarding.
    kept(|| hooks::accept(fd, || cvt(unsafe { real::accept(fd, addr, len) })))
}

#[no_mangle]
pub unsafe extern "C" fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    // SAFETY: forwarding.
    kept(|| hooks::accept(fd, || cvt(unsafe { real::accept4(fd, addr, len, flags) })))
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    crate::ready::kernel_touched();
    // SAFETY: forwarding.
    kept(|| hooks::close(fd, || cvt(unsafe { real::close(fd) })))
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int {
    // SAFETY: the program's event, read only for ADD and MOD (the kernel reads it then) or
    // after the kernel took it.
    let event = unsafe { ProgCell::new(ev) };
    // SAFETY: forwarding.
    kept(|| hooks::epoll_ctl(epfd, op, fd, &event, || cvt(unsafe { real::epoll_ctl(epfd, op, fd, ev) })))
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: the program's buffer of `max` events; the kernel writes those it reports.
    let mut events = unsafe { ProgArray::new(ev, max.max(0) as usize) };
    let us = crate::ready::ms_to_us(timeout);
    let h = || {
        hooks::epoll_wait(epfd, &mut events, us, |first, left| {
            // SAFETY: forwarding.
            cvt(unsafe { real::epoll_wait(epfd, ev, max, crate::ready::ms_for(first, timeout, left)) })
        })
    };
    // SAFETY: forwarding.
    answer(h, || unsafe { real::epoll_wait(epfd, ev, max, timeout) })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: as epoll_wait.
    let mut events = unsafe { ProgArray::new(ev, max.max(0) as usize) };
    let us = crate::ready::ms_to_us(timeout);
    let h = || {
        hooks::epoll_wait(epfd, &mut events, us, |first, left| {
            // SAFETY: forwarding.
            cvt(unsafe {
                real::epoll_pwait(epfd, ev, max, crate::ready::ms_for(first, timeout, left), sigmask)
            })
        })
    };
    // SAFETY: forwarding.
    answer(h, || unsafe { real::epoll_pwait(epfd, ev, max, timeout, sigmask) })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    ts: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: as epoll_wait; `ts` is the program's.
    let (mut events, us) = unsafe { (ProgArray::new(ev, max.max(0) as usize), prog::ts_us(ts)) };
    let h = || {
        hooks::epoll_wait(epfd, &mut events, us, |first, left| {
            // SAFETY: forwarding (with a time-out of our own after the first call).
            cvt(unsafe {
                if first || left < 0 {
                    real::epoll_pwait2(epfd, ev, max, ts, sigmask)
                } else {
                    let t = crate::ready::us_ts(left);
                    real::epoll_pwait2(epfd, ev, max, &t, sigmask)
                }
            })
        })
    };
    // SAFETY: forwarding.
    answer(h, || unsafe { real::epoll_pwait2(epfd, ev, max, ts, sigmask) })
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    // SAFETY: the program's array of `n` entries.
    let mut view = unsafe { ProgArray::new(fds, n as usize) };
    kept(|| {
        hooks::poll(&mut view, crate::ready::ms_to_us(timeout), |first, left| {
            // SAFETY: forwarding.
            cvt(unsafe { real::poll(fds, n, crate::ready::ms_for(first, timeout, left)) })
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<libc::pollfd>()) < n as usize {
        // SAFETY: forwarding (libc reports the overflow).
        return unsafe { real::__poll_chk(fds, n, timeout, fdslen) };
    }
    // SAFETY: as poll.
    unsafe { poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the program's array of `n` entries, and its time-out.
    let (mut view, us) = unsafe { (ProgArray::new(fds, n as usize), prog::ts_us(ts)) };
    kept(|| {
        hooks::poll(&mut view, us, |first, left| {
            // SAFETY: forwarding (with a time-out of our own after the first call).
            cvt(unsafe {
                if first || left < 0 {
                    real::ppoll(fds, n, ts, sigmask)
                } else {
                    let t = crate::ready::us_ts(left);
                    real::ppoll(fds, n, &t, sigmask)
                }
            })
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    // SAFETY: the program's timeval, if any.
    let mut time = unsafe { ProgCell::new(tv) };
    let timeout_us =
        time.get().map_or(-1, |t| t.tv_sec.saturating_mul(1_000_000).saturating_add(t.tv_usec).max(0));
    // SAFETY: the program's sets (each null or one fd_set).
    let mut sets = unsafe { [ProgArray::new(rd, 1), ProgArray::new(wr, 1), ProgArray::new(ex, 1)] };
    kept(|| {
        hooks::select(nfds, &mut sets, timeout_us, |first, left| {
            if first || left < 0 {
                // SAFETY: forwarding.
                return cvt(unsafe { real::select(nfds, rd, wr, ex, tv) });
            }
            // The program's timeval gets what is left, as select's would.
            let mut t = libc::timeval { tv_sec: (left / 1_000_000) as _, tv_usec: (left % 1_000_000) as _ };
            // SAFETY: forwarding, with our own time-out.
            let r = cvt(unsafe { real::select(nfds, rd, wr, ex, &mut t) });
            time.set(t);
            r
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    ts: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the program's sets (each null or one fd_set), and its time-out.
    let (mut sets, us) =
        unsafe { ([ProgArray::new(rd, 1), ProgArray::new(wr, 1), ProgArray::new(ex, 1)], prog::ts_us(ts)) };
    kept(|| {
        hooks::select(nfds, &mut sets, us, |first, left| {
            // SAFETY: forwarding (with a time-out of our own after the first call).
            cvt(unsafe {
                if first || left < 0 {
                    real::pselect(nfds, rd, wr, ex, ts, sigmask)
                } else {
                    let t = crate::ready::us_ts(left);
                    real::pselect(nfds, rd, wr, ex, &t, sigmask)
                }
            })
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    // SAFETY: forwarding (the layer may shut only the receive half).
    kept(|| hooks::shutdown(fd, how, |how| cvt(unsafe { real::shutdown(fd, how) })))
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: the program's buffer and length word.
    let mut out = unsafe { ProgAddrOut::new(addr, len) };
    // SAFETY: forwarding.
    answer(|| hooks::name_of(fd, &mut out, false), || unsafe { real::getsockname(fd, addr, len) })
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: the program's buffer and length word.
    let mut out = unsafe { ProgAddrOut::new(addr, len) };
    // SAFETY: forwarding.
    answer(|| hooks::name_of(fd, &mut out, true), || unsafe { real::getpeername(fd, addr, len) })
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    // SAFETY: the program's value of `len` bytes.
    let value = unsafe { ProgBytes::new(val, len as usize) };
    // SAFETY: forwarding.
    answer(
        || hooks::setsockopt(fd, level, opt, &value),
        || unsafe { real::setsockopt(fd, level, opt, val, len) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    // SAFETY: the program's buffer and length word.
    let mut out = unsafe { ProgOptOut::new(val, len) };
    // SAFETY: forwarding.
    answer(
        || hooks::getsockopt(fd, level, opt, &mut out),
        || unsafe { real::getsockopt(fd, level, opt, val, len) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    // SAFETY: closes a sub-range of what the program asked to close.
    kept(|| hooks::close_range(first, last, flags, |lo, hi| cvt(unsafe { real::close_range(lo, hi, flags) })))
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: forwarding.
    kept(|| hooks::dup(fd, || cvt(unsafe { real::dup(fd) })))
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    crate::ready::kernel_touched();
    // SAFETY: forwarding.
    kept(|| hooks::dup_onto(old, new, || cvt(unsafe { real::dup2(old, new) })))
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    crate::ready::kernel_touched();
    // SAFETY: forwarding.
    kept(|| hooks::dup_onto(old, new, || cvt(unsafe { real::dup3(old, new, flags) })))
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: forwarding (the variadic argument is passed as a machine word).
    kept(|| hooks::fcntl(fd, cmd, arg, || cvt(unsafe { real::fcntl(fd, cmd, arg) })))
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: as above.
    kept(|| hooks::fcntl(fd, cmd, arg, || cvt(unsafe { real::fcntl64(fd, cmd, arg) })))
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int {
    // SAFETY: FIONREAD's and FIONBIO's argument points at an int (the only requests whose
    // argument the hook reads or writes).
    let mut int = unsafe { ProgCell::new(arg as *mut c_int) };
    // SAFETY: forwarding.
    kept(|| hooks::ioctl(fd, req, &mut int, || cvt(unsafe { real::ioctl(fd, req, arg) })))
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, b: *mut c_void, n: size_t) -> ssize_t {
    // SAFETY: the program's buffer.
    let mut buf = unsafe { ProgBytesMut::new(b, n) };
    // SAFETY: forwarding.
    data(|| hooks::read(fd, &mut buf), || unsafe { real::read(fd, b, n) })
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, b: *mut c_void, n: size_t, buflen: size_t) -> ssize_t {
    if n <= buflen {
        // SAFETY: as read.
        return unsafe { read(fd, b, n) };
    }
    // SAFETY: forwarding (libc reports the overflow).
    unsafe { real::__read_chk(fd, b, n, buflen) }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, b: *const c_void, n: size_t) -> ssize_t {
    // SAFETY: the program's buffer.
    let buf = unsafe { ProgBytes::new(b, n) };
    // SAFETY: forwarding.
    data(|| hooks::write(fd, &buf), || unsafe { real::write(fd, b, n) })
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    // SAFETY: the program's iovecs, to fill.
    let mut v = unsafe { ProgIov::new(iov, n, true) };
    // SAFETY: forwarding.
    data(|| hooks::readv(fd, &mut v), || unsafe { real::readv(fd, iov, n) })
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    // SAFETY: the program's iovecs.
    let v = unsafe { ProgIov::new(iov, n, false) };
    // SAFETY: forwarding.
    data(|| hooks::writev(fd, &v), || unsafe { real::writev(fd, iov, n) })
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, b: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    // SAFETY: the program's buffer.
    let mut buf = unsafe { ProgBytesMut::new(b, n) };
    // SAFETY: forwarding.
    data(|| hooks::recv(fd, &mut buf, flags), || unsafe { real::recv(fd, b, n, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    b: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if n <= buflen {
        // SAFETY: as recv.
        return unsafe { recv(fd, b, n, flags) };
    }
    // SAFETY: forwarding.
    unsafe { real::__recv_chk(fd, b, n, buflen, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, b: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    // SAFETY: the program's buffer.
    let buf = unsafe { ProgBytes::new(b, n) };
    // SAFETY: forwarding.
    data(|| hooks::send(fd, &buf, flags), || unsafe { real::send(fd, b, n, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    b: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    // SAFETY: the program's buffer, and its address buffer and length word.
    let (mut buf, mut from) = unsafe { (ProgBytesMut::new(b, n), ProgAddrOut::new(addr, len)) };
    // SAFETY: forwarding.
    data(
        || hooks::recvfrom(fd, &mut buf, flags, &mut from),
        || unsafe { real::recvfrom(fd, b, n, flags, addr, len) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    b: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if n <= buflen {
        // SAFETY: as recvfrom.
        return unsafe { recvfrom(fd, b, n, flags, addr, len) };
    }
    // SAFETY: forwarding.
    unsafe { real::__recvfrom_chk(fd, b, n, buflen, flags, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    b: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    // SAFETY: the program's buffer.
    let buf = unsafe { ProgBytes::new(b, n) };
    // SAFETY: forwarding.
    data(|| hooks::send(fd, &buf, flags), || unsafe { real::sendto(fd, b, n, flags, addr, len) })
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the program's message, to fill.
    let mut m = unsafe { ProgMsg::new(msg, true) };
    // SAFETY: forwarding.
    data(|| hooks::recvmsg(fd, m.as_mut(), flags), || unsafe { real::recvmsg(fd, msg, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the program's message.
    let m = unsafe { ProgMsg::new(msg, false) };
    // SAFETY: forwarding.
    data(|| hooks::sendmsg(fd, m.as_ref(), flags), || unsafe { real::sendmsg(fd, msg, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, inp: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    // SAFETY: the program's offset, if any.
    let mut o = unsafe { ProgCell::new(off) };
    // SAFETY: forwarding.
    data(|| hooks::sendfile(out, inp, &mut o, count), || unsafe { real::sendfile(out, inp, off, count) })
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    // SAFETY: the program's offset, if any.
    let mut o = unsafe { ProgCell::new(off) };
    // SAFETY: forwarding.
    data(|| hooks::sendfile(out, inp, &mut o, count), || unsafe { real::sendfile64(out, inp, off, count) })
}

#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    // SAFETY: forwarding; the atfork handlers keep the layer's locks consistent.
    kept(|| hooks::fork(|| cvt(unsafe { real::fork() })))
}

/// The exec calls: `envp` is the program's environment array (`None`: the process's own),
/// `with` makes the program's exec with another one, `real` makes it as it was.
///
/// # Safety
/// `envp` is a NULL-terminated array of C strings when given.
unsafe fn exec_entry(
    envp: Option<*const *const c_char>,
    with: impl FnOnce(*const *const c_char) -> c_int,
    real: impl FnOnce() -> c_int,
) -> c_int {
    kept(|| {
        hooks::exec(
            // SAFETY: the caller's promise.
            || unsafe { prog::env_vec(envp) },
            |env| prog::with_envp(env, |e| cvt(with(e))),
            || cvt(real()),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the program's environment array; forwarding, with the extended environment
    // or as it was.
    unsafe { exec_entry(Some(envp), |e| real::execve(path, argv, e), || real::execve(path, argv, envp)) }
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: as execve.
    unsafe { exec_entry(Some(envp), |e| real::execvpe(file, argv, e), || real::execvpe(file, argv, envp)) }
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: the process's environment; forwarding to execve with the extended one, or to
    // execv.
    unsafe { exec_entry(None, |e| real::execve(path, argv, e), || real::execv(path, argv)) }
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: as execv, with execvpe and execvp.
    unsafe { exec_entry(None, |e| real::execvpe(file, argv, e), || real::execvp(file, argv)) }
}

/// The `sock_fprog` a seccomp install passes, as bytes.
fn program(prog: c_ulong) -> Option<ProgBytes> {
    // SAFETY: the program passes its `sock_fprog` (or garbage the kernel will refuse with
    // EFAULT: a null pointer is checked; other bad pointers fault the program's own call
    // just the same), whose `filter` holds `len` instructions of 8 bytes; read only while
    // its call lasts.
    unsafe { prog::fprog(prog as *const libc::sock_fprog) }
}

#[no_mangle]
pub unsafe extern "C" fn prctl(option: c_int, a2: c_ulong, a3: c_ulong, a4: c_ulong, a5: c_ulong) -> c_int {
    kept(|| {
        // SAFETY: forwarding the program's arguments (prctl reads at most four after the
        // option).
        hooks_proc::prctl(option, a2, a3, &program, || cvt(unsafe { real::prctl(option, a2, a3, a4, a5) }))
    })
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

/// libc's `syscall`: see [`hooks_proc::syscall`].
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
    let a = [a1, a2, a3, a4, a5, a6];
    let r = hooks_proc::syscall(n, a, &program, || {
        // SAFETY: forwarding the program's system call as libc's `syscall` would.
        let raw = unsafe { raw_syscall(n, a) };
        if (-4095..0).contains(&raw) {
            Err(Errno(-raw as c_int))
        } else {
            Ok(raw)
        }
    });
    // (No errno is kept here: `syscall` is the program's own system call.)
    r.unwrap_or_else(|e| {
        set_errno(e.0);
        -1
    })
}

#[no_mangle]
pub unsafe extern "C" fn pthread_exit(ret: *mut c_void) -> ! {
    hooks_proc::pthread_exit();
    // SAFETY: forwarding.
    unsafe { real::pthread_exit(ret) }
}

#[no_mangle]
pub unsafe extern "C" fn _exit(status: c_int) -> ! {
    hooks_proc::bare_exit();
    // SAFETY: forwarding.
    unsafe { real::_exit(status) }
}

#[no_mangle]
pub unsafe extern "C" fn _Exit(status: c_int) -> ! {
    hooks_proc::bare_exit();
    // SAFETY: forwarding.
    unsafe { real::_Exit(status) }
}

// The loader calls these (entry points from C, as the hooks are).
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = crate::init;

#[used]
#[link_section = ".fini_array"]
static FINI: extern "C" fn() = crate::fini;
