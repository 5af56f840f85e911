//! The intercepted libc functions: thin shims. Descriptors the layer does not manage go
//! straight to libc after one bitmap check; virtual connections go to [`crate::vc`];
//! set-up calls go to [`crate::setup`]. Errors become errno in [`crate::error`].

#![allow(clippy::missing_safety_doc)]

use crate::error::{guarded, quietly};
use crate::fdtable::{self, Entry};
use crate::sys::prog::{self, ProgArray};
use crate::sys::real;
use crate::vc::Vc;
use crate::{agent, setup, sys};
use libc::{c_int, c_uint, c_ulong, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t};
use std::sync::Arc;
use substrate::irb::IrbError;

/// The program's buffer as a slice (empty when `n` is 0, whatever `p` is).
unsafe fn buf<'a>(p: *const c_void, n: size_t) -> &'a [u8] {
    if n == 0 || p.is_null() {
        &[]
    } else {
        // SAFETY: the program passed a buffer of `n` bytes.
        unsafe { std::slice::from_raw_parts(p as *const u8, n) }
    }
}

unsafe fn buf_mut<'a>(p: *mut c_void, n: size_t) -> &'a mut [u8] {
    if n == 0 || p.is_null() {
        &mut []
    } else {
        // SAFETY: the program passed a writable buffer of `n` bytes.
        unsafe { std::slice::from_raw_parts_mut(p as *mut u8, n) }
    }
}

unsafe fn iovecs<'a>(iov: *const iovec, n: c_int) -> &'a [iovec] {
    if iov.is_null() || n <= 0 {
        &[]
    } else {
        // SAFETY: the program passed `n` iovecs.
        unsafe { std::slice::from_raw_parts(iov, n as usize) }
    }
}

/// readv semantics over a virtual connection: fill buffers in order, stop at a short read.
fn vc_readv(vc: &Vc, fd: c_int, iov: &[iovec], flags: c_int) -> Result<usize, IrbError> {
    let mut total = 0;
    for v in iov.iter().filter(|v| v.iov_len > 0) {
        let f = if total > 0 { flags | libc::MSG_DONTWAIT } else { flags };
        // SAFETY: each iovec names a writable buffer of the program's.
        let b = unsafe { buf_mut(v.iov_base, v.iov_len) };
        match vc.recv(fd, b, f) {
            Ok(n) => {
                total += n;
                if n < b.len() {
                    break;
                }
            }
            Err(_) if total > 0 => break,
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

/// writev semantics over a virtual connection: small vectors are gathered into one send,
/// large ones go buffer by buffer and stop at a short send.
fn vc_writev(vc: &Vc, fd: c_int, iov: &[iovec], flags: c_int) -> Result<usize, IrbError> {
    let len: usize = iov.iter().map(|v| v.iov_len).sum();
    let live: Vec<&iovec> = iov.iter().filter(|v| v.iov_len > 0).collect();
    if live.len() <= 1 || len <= 256 << 10 {
        if live.len() == 1 {
            // SAFETY: the program's buffer.
            return vc.send(fd, unsafe { buf(live[0].iov_base, live[0].iov_len) }, flags);
        }
        let mut all = Vec::with_capacity(len);
        for v in &live {
            // SAFETY: the program's buffer.
            all.extend_from_slice(unsafe { buf(v.iov_base, v.iov_len) });
        }
        return vc.send(fd, &all, flags);
    }
    let mut total = 0;
    for v in live {
        // SAFETY: the program's buffer.
        let b = unsafe { buf(v.iov_base, v.iov_len) };
        match vc.send(fd, b, flags) {
            Ok(n) => {
                total += n;
                if n < b.len() {
                    break;
                }
            }
            Err(_) if total > 0 => break,
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: the program's address of `len` bytes.
    let pending = match unsafe { sys::from_raw(addr, len) } {
        Some(dst) => quietly(|| setup::before_connect(fd, dst)),
        None => None,
    };
    let r = match pending.as_ref().and_then(|p| p.via) {
        Some(via) => {
            // The program's destination is on a dead network: the same node at another address.
            let (st, n) = sys::to_raw(&via, sys::tcp_family(fd) == Some(libc::AF_INET6));
            // SAFETY: a well-formed address of our own making.
            unsafe { real::connect(fd, &st as *const _ as *const sockaddr, n) }
        }
        // SAFETY: forwarding the program's arguments.
        None => unsafe { real::connect(fd, addr, len) },
    };
    if let Some(p) = pending {
        let e = sys::errno();
        quietly(|| {
            // (A blocking connect interrupted by a signal goes on in the kernel, as a
            // non-blocking one does.)
            if r == 0 || e == libc::EINPROGRESS || e == libc::EINTR {
                setup::after_connect(fd, p);
            } else {
                setup::connect_failed(p);
            }
            Some(())
        });
        sys::set_errno(e);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::listen(fd, backlog) };
    if r == 0 && !fdtable::is_managed(fd) {
        let e = sys::errno();
        quietly(|| {
            setup::after_listen(fd);
            Some(())
        });
        sys::set_errno(e);
    }
    r
}

fn accepted(listen_fd: c_int, fd: c_int) -> c_int {
    if fd >= 0 && fdtable::is_managed(listen_fd) {
        let e = sys::errno();
        quietly(|| {
            setup::after_accept(listen_fd, fd);
            Some(())
        });
        sys::set_errno(e);
    }
    fd
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarding.
    accepted(fd, relisten_retry(fd, || unsafe { real::accept(fd, addr, len) }))
}

#[no_mangle]
pub unsafe extern "C" fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    // SAFETY: forwarding.
    accepted(fd, relisten_retry(fd, || unsafe { real::accept4(fd, addr, len, flags) }))
}

/// Runs an accept again when it failed because the layer put another listener under the
/// descriptor meanwhile (after a migration: see `relisten.rs`).
fn relisten_retry(fd: c_int, mut call: impl FnMut() -> c_int) -> c_int {
    loop {
        let gen = crate::relisten::GEN.load(std::sync::atomic::Ordering::SeqCst);
        let r = call();
        if r >= 0
            || sys::errno() != libc::EINVAL
            || gen == crate::relisten::GEN.load(std::sync::atomic::Ordering::SeqCst)
            || !matches!(fdtable::get(fd), Some(Entry::Listener(_)))
        {
            return r;
        }
    }
}

/// Forgets `fd`. Returns the virtual connection when `fd` was the last hold on it anywhere
/// (no other descriptor here, no other process).
fn forget(fd: c_int) -> Option<Arc<Vc>> {
    match fdtable::remove(fd) {
        Some(Entry::Listener(l)) => {
            // Other descriptors (dup) may still point at the listener.
            if Arc::strong_count(&l) == 1 {
                quietly(|| {
                    setup::closed_listener(&l);
                    Some(())
                });
            }
            None
        }
        Some(Entry::Vc(v)) => {
            let last = Arc::strong_count(&v) == 1
                && v.mem().conn().procs.load(std::sync::atomic::Ordering::Acquire) == 1;
            last.then_some(v)
        }
        None => None,
    }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if fdtable::is_protected(fd) {
        // One of the layer's own descriptors: the program (a daemon closing everything)
        // does not know it; keep it.
        return 0;
    }
    if crate::ready::tracking(fd) || fdtable::is_managed(fd) {
        crate::ready::note_close(fd);
    }
    crate::ready::note_closed_fd(fd);
    if fdtable::is_managed(fd) && !crate::vforked() {
        if let Some(vc) = forget(fd) {
            if let Some(l) = vc.shm_now() {
                // The peer reads what the ring holds, then the end; nothing lingers here.
                quietly(|| {
                    vc.shm_close(l, fd);
                    Some(())
                });
                // SAFETY: forwarding.
                return unsafe { real::close(fd) };
            }
            return crate::linger::close_last(fd, vc);
        }
    }
    // SAFETY: forwarding.
    unsafe { real::close(fd) }
}

/// `epoll_ctl`: forwarded; only when a change of a virtual connection's registration fails
/// with `ENOENT` (its link is being rebuilt and the layer keeps the registration aside until
/// the new socket is in place) is the change made to the kept registration. UCX treats a
/// failed `EPOLL_CTL_MOD` as fatal.
#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int {
    let r = match fdtable::vc(fd) {
        Some(vc) => vc.epoll_ctl(
            epfd,
            op,
            fd,
            // SAFETY: the program's epoll_event, if any (the kernel reads it for ADD and MOD).
            || (!ev.is_null()).then(|| unsafe { std::ptr::read_unaligned(ev) }),
            // SAFETY: forwarding the program's arguments.
            || unsafe { real::epoll_ctl(epfd, op, fd, ev) },
        ),
        // SAFETY: forwarding the program's arguments.
        None => unsafe { real::epoll_ctl(epfd, op, fd, ev) },
    };
    if r == 0 && op == libc::EPOLL_CTL_ADD && !fdtable::is_managed(fd) {
        crate::ready::note_contained(fd);
    }
    if r == 0 && (fdtable::is_managed(fd) || crate::ready::tracking(epfd)) {
        let (events, data) = if ev.is_null() || op == libc::EPOLL_CTL_DEL {
            (0, 0)
        } else {
            // SAFETY: the program's epoll_event (the kernel read it too).
            let e = unsafe { std::ptr::read_unaligned(ev) };
            (e.events, e.u64)
        };
        quietly(|| {
            crate::ready::note_ctl(epfd, op, fd, events, data);
            Some(())
        });
    }
    r
}

/// `epoll_wait`: readable reports of virtual connections are checked ([`crate::ready`]).
#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    if !crate::ready::tracking(epfd) {
        // SAFETY: forwarding.
        return unsafe { real::epoll_wait(epfd, ev, max, timeout) };
    }
    // SAFETY: the program's buffer of `max` events; the kernel writes those it reports.
    let mut events = unsafe { ProgArray::new(ev, max.max(0) as usize) };
    crate::ready::epoll_wait(epfd, &mut events, crate::ready::ms_to_us(timeout), |first, left| {
        // SAFETY: forwarding.
        unsafe { real::epoll_wait(epfd, ev, max, crate::ready::ms_for(first, timeout, left)) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if !crate::ready::tracking(epfd) {
        // SAFETY: forwarding.
        return unsafe { real::epoll_pwait(epfd, ev, max, timeout, sigmask) };
    }
    // SAFETY: as epoll_wait.
    let mut events = unsafe { ProgArray::new(ev, max.max(0) as usize) };
    crate::ready::epoll_wait(epfd, &mut events, crate::ready::ms_to_us(timeout), |first, left| {
        // SAFETY: forwarding.
        unsafe { real::epoll_pwait(epfd, ev, max, crate::ready::ms_for(first, timeout, left), sigmask) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    ts: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if !crate::ready::tracking(epfd) {
        // SAFETY: forwarding.
        return unsafe { real::epoll_pwait2(epfd, ev, max, ts, sigmask) };
    }
    // SAFETY: as epoll_wait; `ts` is the program's.
    let (mut events, us) = unsafe { (ProgArray::new(ev, max.max(0) as usize), prog::ts_us(ts)) };
    crate::ready::epoll_wait(epfd, &mut events, us, |first, left| {
        // SAFETY: forwarding (with a time-out of our own after the first call).
        unsafe {
            if first || left < 0 {
                real::epoll_pwait2(epfd, ev, max, ts, sigmask)
            } else {
                let t = crate::ready::us_ts(left);
                real::epoll_pwait2(epfd, ev, max, &t, sigmask)
            }
        }
    })
}

/// `poll`: readable reports of virtual connections are checked ([`crate::ready`]).
#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    // SAFETY: the program's array of `n` entries.
    let mut view = unsafe { ProgArray::new(fds, n as usize) };
    crate::ready::poll(&mut view, crate::ready::ms_to_us(timeout), |first, left| {
        // SAFETY: forwarding.
        unsafe { real::poll(fds, n, crate::ready::ms_for(first, timeout, left)) }
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
    crate::ready::poll(&mut view, us, |first, left| {
        // SAFETY: forwarding (with a time-out of our own after the first call).
        unsafe {
            if first || left < 0 {
                real::ppoll(fds, n, ts, sigmask)
            } else {
                let t = crate::ready::us_ts(left);
                real::ppoll(fds, n, &t, sigmask)
            }
        }
    })
}

/// `select`: readable reports of virtual connections are checked ([`crate::ready`]).
#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    let timeout_us = if tv.is_null() {
        -1
    } else {
        // SAFETY: the program's timeval.
        let t = unsafe { *tv };
        t.tv_sec.saturating_mul(1_000_000).saturating_add(t.tv_usec).max(0)
    };
    // SAFETY: the program's sets (each null or one fd_set).
    let mut sets = unsafe { [ProgArray::new(rd, 1), ProgArray::new(wr, 1), ProgArray::new(ex, 1)] };
    crate::ready::select(nfds, &mut sets, timeout_us, |first, left| {
        // SAFETY: forwarding; the program's timeval gets what is left, as select's would.
        unsafe {
            if first || left < 0 {
                real::select(nfds, rd, wr, ex, tv)
            } else {
                let mut t =
                    libc::timeval { tv_sec: (left / 1_000_000) as _, tv_usec: (left % 1_000_000) as _ };
                let r = real::select(nfds, rd, wr, ex, &mut t);
                *tv = t;
                r
            }
        }
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
    crate::ready::select(nfds, &mut sets, us, |first, left| {
        // SAFETY: forwarding (with a time-out of our own after the first call).
        unsafe {
            if first || left < 0 {
                real::pselect(nfds, rd, wr, ex, ts, sigmask)
            } else {
                let t = crate::ready::us_ts(left);
                real::pselect(nfds, rd, wr, ex, &t, sigmask)
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if let Some(vc) = fdtable::vc(fd) {
        if let (Some(l), true) = (vc.shm_now(), how == libc::SHUT_WR || how == libc::SHUT_RDWR) {
            quietly(|| {
                let nonblock = sys::nonblocking(fd);
                let _ = l.settle(fd, !nonblock, true);
                Some(())
            });
            if vc.shm_now().is_some() {
                quietly(|| {
                    vc.shm_shut_send(l, fd);
                    Some(())
                });
                if how == libc::SHUT_WR {
                    return 0;
                }
                // SAFETY: forwarding the receive half of SHUT_RDWR.
                return unsafe { real::shutdown(fd, libc::SHUT_RD) };
            }
        }
        if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
            // The end of stream travels as a Fin frame (the peer keeps acknowledging).
            let r = quietly(|| Some(crate::tcp_sink::send_fin(vc.mem(), fd))).unwrap_or(-1);
            if r != 0 || how == libc::SHUT_WR {
                return r;
            }
            // SAFETY: forwarding the receive half of SHUT_RDWR.
            return unsafe { real::shutdown(fd, libc::SHUT_RD) };
        }
    }
    // SAFETY: forwarding.
    unsafe { real::shutdown(fd, how) }
}

/// getsockname/getpeername after a failover: what the program saw before (the physical
/// link's addresses changed under it).
/// A listener's name is the address it was bound to (after a migration to a node without
/// that address the socket under it listens on every address: see `relisten.rs`).
unsafe fn name_of(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, peer: bool) -> Option<c_int> {
    let name = match fdtable::get(fd)? {
        Entry::Listener(l) if !peer => l.addr,
        Entry::Vc(vc) => {
            let c = vc.mem().conn();
            if !vc.renamed
                && c.link_gen.load(std::sync::atomic::Ordering::Acquire) == 0
                && c.link_down.load(std::sync::atomic::Ordering::Acquire) == 0
            {
                return None;
            }
            if peer {
                vc.peer
            } else {
                vc.local
            }
        }
        _ => return None,
    };
    if addr.is_null() || len.is_null() {
        sys::set_errno(libc::EFAULT);
        return Some(-1);
    }
    let v6 = sys::tcp_family(fd) == Some(libc::AF_INET6);
    let (st, n) = sys::to_raw(&name, v6);
    // SAFETY: the program passed a buffer of *len bytes; we write at most that.
    unsafe {
        let room = (*len as usize).min(n as usize);
        std::ptr::copy_nonoverlapping(&st as *const _ as *const u8, addr as *mut u8, room);
        *len = n;
    }
    Some(0)
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if fdtable::is_managed(fd) {
        // SAFETY: the program's arguments.
        if let Some(r) = quietly(|| unsafe { name_of(fd, addr, len, false) }) {
            return r;
        }
    }
    // SAFETY: forwarding.
    unsafe { real::getsockname(fd, addr, len) }
}

/// `TCP_CORK` or `TCP_NODELAY` with an int-sized value (the kernel refuses shorter ones
/// itself).
fn bell_sensitive(level: c_int, opt: c_int) -> bool {
    level == libc::IPPROTO_TCP && (opt == libc::TCP_CORK || opt == libc::TCP_NODELAY)
}

/// A virtual connection's TCP_CORK and TCP_NODELAY are the program's: while its socket
/// carries only shared-memory bells they are kept aside for the connection's later links
/// and not given to the kernel (see `Vc::program_sets_tcp`).
#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if bell_sensitive(level, opt) && !val.is_null() && len as usize >= std::mem::size_of::<c_int>() {
        if let Some(vc) = fdtable::vc(fd) {
            // SAFETY: the program's option value, at least an int long (checked above).
            let on = unsafe { std::ptr::read_unaligned(val as *const c_int) } != 0;
            if quietly(|| Some(vc.program_sets_tcp(opt, on))) == Some(true) {
                return 0;
            }
        }
    }
    // SAFETY: forwarding.
    unsafe { real::setsockopt(fd, level, opt, val, len) }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if bell_sensitive(level, opt) && !val.is_null() && !len.is_null() {
        if let Some(v) = fdtable::vc(fd).and_then(|vc| quietly(|| vc.program_tcp(opt))) {
            // As the kernel answers: at most an int, a negative length refused.
            // SAFETY: the program's length word.
            let want = unsafe { std::ptr::read_unaligned(len) } as i32;
            if want < 0 {
                sys::set_errno(libc::EINVAL);
                return -1;
            }
            let n = (want as usize).min(std::mem::size_of::<c_int>());
            // SAFETY: the program's buffer of `*len` bytes, of which n are written.
            unsafe {
                std::ptr::copy_nonoverlapping(v.to_ne_bytes().as_ptr(), val as *mut u8, n);
                std::ptr::write_unaligned(len, n as socklen_t);
            }
            return 0;
        }
    }
    // SAFETY: forwarding.
    unsafe { real::getsockopt(fd, level, opt, val, len) }
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if fdtable::is_managed(fd) {
        // SAFETY: the program's arguments.
        if let Some(r) = quietly(|| unsafe { name_of(fd, addr, len, true) }) {
            return r;
        }
    }
    // SAFETY: forwarding.
    unsafe { real::getpeername(fd, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int != 0 || (fdtable::any() && crate::vforked()) {
        // SAFETY: forwarding (a vfork child closes its own descriptors; the tables it shares
        // are its parent's).
        return unsafe { real::close_range(first, last, flags) };
    }
    let mut own: Vec<c_uint> =
        fdtable::protected().into_iter().map(|f| f as c_uint).filter(|&f| f >= first && f <= last).collect();
    own.sort_unstable();
    for (fd, _) in fdtable::snapshot() {
        if fd as c_uint >= first && fd as c_uint <= last {
            forget(fd);
        }
    }
    let mut lo = first;
    for f in own {
        if f > lo {
            // SAFETY: closes a sub-range the program asked to close.
            let r = unsafe { real::close_range(lo, f - 1, flags) };
            if r != 0 {
                return r;
            }
        }
        lo = f + 1;
    }
    if lo <= last && lo >= first {
        // SAFETY: as above.
        return unsafe { real::close_range(lo, last, flags) };
    }
    0
}

fn copy_entry(old: c_int, new: c_int) {
    if let Some(e) = fdtable::get(old) {
        fdtable::insert(new, e);
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::dup(fd) };
    if r >= 0 && fdtable::is_managed(fd) && !crate::vforked() {
        copy_entry(fd, r);
    }
    r
}

unsafe fn dup_onto(old: c_int, new: c_int, f: impl FnOnce() -> c_int) -> c_int {
    if (fdtable::is_managed(old) || fdtable::is_managed(new) || fdtable::is_protected(new))
        && crate::vforked()
    {
        // A vfork child arranging its descriptors before exec: they are its own; the tables
        // it shares are its parent's.
        return f();
    }
    if old != new {
        if fdtable::evict(new).is_some() && new == fdtable::own_fd(fdtable::OWN_AGENT) {
            agent::lost_socket();
        }
        if fdtable::is_managed(new) {
            forget(new);
        }
    }
    let r = f();
    if r >= 0 && old != new && fdtable::is_managed(old) {
        copy_entry(old, new);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: forwarding.
    unsafe { dup_onto(old, new, || real::dup2(old, new)) }
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: forwarding.
    unsafe { dup_onto(old, new, || real::dup3(old, new, flags)) }
}

fn after_fcntl(fd: c_int, cmd: c_int, arg: c_ulong, r: c_int) -> c_int {
    if r >= 0 && cmd == libc::F_SETFL {
        crate::sandbox::note_nonblock(fd, arg as c_int & libc::O_NONBLOCK != 0);
    }
    if r >= 0
        && (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC)
        && fdtable::is_managed(fd)
        && !crate::vforked()
    {
        copy_entry(fd, r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: forwarding (the variadic argument is passed as a machine word).
    after_fcntl(fd, cmd, arg, unsafe { real::fcntl(fd, cmd, arg) })
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: as above.
    after_fcntl(fd, cmd, arg, unsafe { real::fcntl64(fd, cmd, arg) })
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int {
    if req == libc::FIONREAD {
        if let Some(vc) = fdtable::vc(fd) {
            return match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| vc.readable_bytes(fd))) {
                Ok(Ok(n)) => {
                    // SAFETY: FIONREAD's argument points at an int.
                    unsafe { *(arg as *mut c_int) = n };
                    0
                }
                Ok(Err(e)) => {
                    sys::set_errno(e);
                    -1
                }
                Err(_) => {
                    sys::set_errno(libc::EIO);
                    -1
                }
            };
        }
    }
    // SAFETY: forwarding.
    let r = unsafe { real::ioctl(fd, req, arg) };
    if r == 0 && req == libc::FIONBIO && arg != 0 {
        // SAFETY: FIONBIO's argument points at an int.
        crate::sandbox::note_nonblock(fd, unsafe { *(arg as *const c_int) } != 0);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, b: *mut c_void, n: size_t) -> ssize_t {
    if let Some(vc) = fdtable::vc(fd) {
        let _implied = crate::sandbox::implied(crate::sandbox::READ_CALLS);
        // SAFETY: the program's buffer.
        return guarded(|| vc.recv(fd, unsafe { buf_mut(b, n) }, 0));
    }
    // SAFETY: forwarding.
    unsafe { real::read(fd, b, n) }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, b: *mut c_void, n: size_t, buflen: size_t) -> ssize_t {
    if n <= buflen {
        if let Some(vc) = fdtable::vc(fd) {
            let _implied = crate::sandbox::implied(crate::sandbox::READ_CALLS);
            // SAFETY: the program's buffer.
            return guarded(|| vc.recv(fd, unsafe { buf_mut(b, n) }, 0));
        }
    }
    // SAFETY: forwarding (libc reports the overflow).
    unsafe { real::__read_chk(fd, b, n, buflen) }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, b: *const c_void, n: size_t) -> ssize_t {
    if let Some(vc) = fdtable::vc(fd) {
        let _implied = crate::sandbox::implied(crate::sandbox::WRITE_CALLS);
        // SAFETY: the program's buffer.
        return guarded(|| vc.send(fd, unsafe { buf(b, n) }, 0));
    }
    // SAFETY: forwarding.
    unsafe { real::write(fd, b, n) }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    if let Some(vc) = fdtable::vc(fd) {
        let _implied = crate::sandbox::implied(crate::sandbox::READ_CALLS);
        // SAFETY: the program's iovecs.
        return guarded(|| vc_readv(&vc, fd, unsafe { iovecs(iov, n) }, 0));
    }
    // SAFETY: forwarding.
    unsafe { real::readv(fd, iov, n) }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    if let Some(vc) = fdtable::vc(fd) {
        let _implied = crate::sandbox::implied(crate::sandbox::WRITE_CALLS);
        // SAFETY: the program's iovecs.
        return guarded(|| vc_writev(&vc, fd, unsafe { iovecs(iov, n) }, 0));
    }
    // SAFETY: forwarding.
    unsafe { real::writev(fd, iov, n) }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, b: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    if let Some(vc) = fdtable::vc(fd) {
        let _implied = crate::sandbox::implied(crate::sandbox::RECV_CALLS);
        // SAFETY: the program's buffer.
        return guarded(|| vc.recv(fd, unsafe { buf_mut(b, n) }, flags));
    }
    // SAFETY: forwarding.
    unsafe { real::recv(fd, b, n, flags) }
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
        if let Some(vc) = fdtable::vc(fd) {
            let _implied = crate::sandbox::implied(crate::sandbox::RECV_CALLS);
            // SAFETY: the program's buffer.
            return guarded(|| vc.recv(fd, unsafe { buf_mut(b, n) }, flags));
        }
    }
    // SAFETY: forwarding.
    unsafe { real::__recv_chk(fd, b, n, buflen, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, b: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    if let Some(vc) = fdtable::vc(fd) {
        let _implied = crate::sandbox::implied(crate::sandbox::SEND_CALLS);
        // SAFETY: the program's buffer.
        return guarded(|| vc.send(fd, unsafe { buf(b, n) }, flags));
    }
    // SAFETY: forwarding.
    unsafe { real::send(fd, b, n, flags) }
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
    if let Some(vc) = fdtable::vc(fd) {
        let _implied = crate::sandbox::implied(crate::sandbox::RECV_CALLS);
        if !len.is_null() {
            // SAFETY: TCP reports no source address, as the kernel does.
            unsafe { *len = 0 };
        }
        // SAFETY: the program's buffer.
        return guarded(|| vc.recv(fd, unsafe { buf_mut(b, n) }, flags));
    }
    // SAFETY: forwarding.
    unsafe { real::recvfrom(fd, b, n, flags, addr, len) }
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
    if n <= buflen && fdtable::is_managed(fd) {
        // SAFETY: same arguments.
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
    if let Some(vc) = fdtable::vc(fd) {
        let _implied = crate::sandbox::implied(crate::sandbox::SEND_CALLS);
        // SAFETY: the program's buffer.
        return guarded(|| vc.send(fd, unsafe { buf(b, n) }, flags));
    }
    // SAFETY: forwarding.
    unsafe { real::sendto(fd, b, n, flags, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    if !msg.is_null() && flags & libc::MSG_ERRQUEUE == 0 {
        if let Some(vc) = fdtable::vc(fd) {
            let _implied = crate::sandbox::implied(crate::sandbox::RECV_CALLS);
            // SAFETY: the program's msghdr.
            let m = unsafe { &mut *msg };
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            // SAFETY: the program's iovecs.
            let iov = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) };
            return guarded(|| vc_readv(&vc, fd, iov, flags));
        }
    }
    // SAFETY: forwarding.
    unsafe { real::recvmsg(fd, msg, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    if !msg.is_null() {
        if let Some(vc) = fdtable::vc(fd) {
            let _implied = crate::sandbox::implied(crate::sandbox::SEND_CALLS);
            // SAFETY: the program's msghdr and iovecs.
            let iov = unsafe { iovecs((*msg).msg_iov, (*msg).msg_iovlen as c_int) };
            return guarded(|| vc_writev(&vc, fd, iov, flags));
        }
    }
    // SAFETY: forwarding.
    unsafe { real::sendmsg(fd, msg, flags) }
}

/// sendfile onto a virtual connection: read the file, send through the chain.
fn vc_sendfile(vc: &Vc, out: c_int, inp: c_int, off: *mut off_t, count: size_t) -> Result<usize, IrbError> {
    let mut pos: off_t = if off.is_null() {
        // SAFETY: lseek on the program's descriptor, without moving it.
        unsafe { libc::lseek(inp, 0, libc::SEEK_CUR) }
    } else {
        // SAFETY: the program's offset.
        unsafe { *off }
    };
    if pos < 0 {
        return Err(IrbError::Os(sys::errno()));
    }
    let mut chunk = vec![0u8; count.min(256 << 10)];
    let mut total = 0usize;
    while total < count {
        let want = (count - total).min(chunk.len());
        // SAFETY: reads into our own buffer.
        let r = unsafe { libc::pread(inp, chunk.as_mut_ptr() as *mut c_void, want, pos) };
        if r < 0 {
            if total > 0 {
                break;
            }
            return Err(IrbError::Os(sys::errno()));
        }
        if r == 0 {
            break;
        }
        let flags = if total > 0 { libc::MSG_DONTWAIT } else { 0 };
        let sent = match vc.send(out, &chunk[..r as usize], flags) {
            Ok(n) => n,
            Err(_) if total > 0 => 0,
            Err(e) => return Err(e),
        };
        total += sent;
        pos += sent as off_t;
        if sent < r as usize {
            break;
        }
    }
    if off.is_null() {
        // SAFETY: moves the program's file position past what was sent.
        unsafe { libc::lseek(inp, pos, libc::SEEK_SET) };
    } else {
        // SAFETY: the program's offset.
        unsafe { *off = pos };
    }
    Ok(total)
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, inp: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    if let Some(vc) = fdtable::vc(out) {
        return guarded(|| vc_sendfile(&vc, out, inp, off, count));
    }
    // SAFETY: forwarding.
    unsafe { real::sendfile(out, inp, off, count) }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    if let Some(vc) = fdtable::vc(out) {
        return guarded(|| vc_sendfile(&vc, out, inp, off, count));
    }
    // SAFETY: forwarding.
    unsafe { real::sendfile64(out, inp, off, count) }
}

#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    // The child will hold every virtual connection too: count it before it exists, so that
    // the parent closing its copy right after fork is not taken for the last close.
    let vcs = fdtable::distinct_vcs();
    for v in &vcs {
        v.hold();
    }
    if !vcs.is_empty() {
        // The child may wait on them in ways this process does not see.
        quietly(|| {
            crate::ready::unscan_all();
            Some(())
        });
    }
    // SAFETY: forwarding; the atfork handlers keep the layer's locks consistent.
    let r = unsafe { real::fork() };
    if r < 0 {
        let e = sys::errno();
        for v in &vcs {
            v.release();
        }
        sys::set_errno(e);
    } else if r == 0 && !vcs.is_empty() {
        let e = sys::errno();
        quietly(|| {
            crate::relink::forked_child();
            Some(())
        });
        sys::set_errno(e);
    }
    r
}

extern "C" {
    static environ: *const *const libc::c_char;
}

/// The entries of a C environment array, copied.
///
/// # Safety
/// `envp` is a NULL-terminated array of C strings, or null.
unsafe fn env_vec(envp: *const *const libc::c_char) -> Vec<std::ffi::CString> {
    let mut out = Vec::new();
    let mut p = envp;
    while !p.is_null() {
        // SAFETY: walking the caller's array until its NULL.
        let s = unsafe { *p };
        if s.is_null() {
            break;
        }
        // SAFETY: each entry is a C string.
        out.push(unsafe { std::ffi::CStr::from_ptr(s) }.to_owned());
        // SAFETY: the next entry (the array goes on to its NULL).
        p = unsafe { p.add(1) };
    }
    out
}

#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    let _quiet = crate::relink::quiet_for_exec();
    // SAFETY: the program's environment array.
    match quietly(|| crate::exec::env_for_exec(|| unsafe { env_vec(envp) })) {
        // SAFETY: forwarding with the extended environment.
        Some(h) => h.exec(|e| unsafe { real::execve(path, argv, e) }),
        // SAFETY: forwarding.
        None => unsafe { real::execve(path, argv, envp) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    let _quiet = crate::relink::quiet_for_exec();
    // SAFETY: as in execve.
    match quietly(|| crate::exec::env_for_exec(|| unsafe { env_vec(envp) })) {
        // SAFETY: forwarding with the extended environment.
        Some(h) => h.exec(|e| unsafe { real::execvpe(file, argv, e) }),
        // SAFETY: forwarding.
        None => unsafe { real::execvpe(file, argv, envp) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    let _quiet = crate::relink::quiet_for_exec();
    // SAFETY: `environ` is the process environment.
    match quietly(|| crate::exec::env_for_exec(|| unsafe { env_vec(environ) })) {
        // SAFETY: forwarding to execve with the extended environment.
        Some(h) => h.exec(|e| unsafe { real::execve(path, argv, e) }),
        // SAFETY: forwarding.
        None => unsafe { real::execv(path, argv) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    let _quiet = crate::relink::quiet_for_exec();
    // SAFETY: `environ` is the process environment.
    match quietly(|| crate::exec::env_for_exec(|| unsafe { env_vec(environ) })) {
        // SAFETY: forwarding to execvpe with the extended environment.
        Some(h) => h.exec(|e| unsafe { real::execvpe(file, argv, e) }),
        // SAFETY: forwarding.
        None => unsafe { real::execvp(file, argv) },
    }
}
