//! What the layer does with each intercepted libc call, in safe code. The C entry points
//! (`sys::entry`) make views of the program's memory and call these; each answers with a
//! [`Hooked`]: done, not the layer's business (the real function takes the call), or an
//! error. Descriptors the layer does not manage go straight to libc after one bitmap check;
//! virtual connections go to [`crate::vc`]; set-up calls go to [`crate::setup`].
//!
//! Hooks that must act around the real call (`connect`, `close`, `fork`, ...) get it as a
//! closure, `real`, that makes the program's call and says how it went.

pub use crate::error::Real;
use crate::error::{guarded, quietly, Errno, Hook, Hooked};
use crate::fdtable::{self, Entry};
use crate::sandbox::{self, implied};
use crate::sys::fd::RawAddr;
use crate::sys::prog::{
    ProgAddrOut, ProgArray, ProgBytes, ProgBytesMut, ProgCell, ProgIov, ProgMsg, ProgOptOut,
};
use crate::vc::Vc;
use crate::{agent, setup, sys};
use libc::{c_int, c_uint, c_ulong, off_t};
use std::net::SocketAddr;
use std::sync::Arc;
use substrate::irb::IrbError;
use substrate::reliability::Gather;

/// Bytes a vectored read takes first into a buffer of the layer's and spreads over the
/// program's buffers, when there are several and the first is smaller (a message header and
/// its body, as MPI's progress engines read): one call fills them all for a small message,
/// where reading buffer by buffer would cost a system call each (measured with Open MPI:
/// two receive calls per message under the layer against one natively).
const GATHER: usize = 4096;

/// readv semantics over a virtual connection: fill buffers in order, stop at a short read.
fn vc_readv(vc: &Vc, fd: c_int, iov: &mut ProgIov, flags: c_int) -> Result<usize, IrbError> {
    let all: usize = (0..iov.len()).map(|i| iov.len_of(i)).sum();
    let live = (0..iov.len()).filter(|&i| iov.len_of(i) > 0).count();
    // Where the next byte goes: buffer `at`, offset `off` in it.
    let (mut at, mut off, mut total) = (0, 0, 0);
    let first_small = (0..iov.len()).find(|&i| iov.len_of(i) > 0).is_some_and(|i| iov.len_of(i) < GATHER);
    if live > 1 && (first_small || flags & libc::MSG_PEEK != 0) {
        // (A peek reads from the same place each call: it is never spread over calls.)
        let want = if flags & libc::MSG_PEEK != 0 { all.min(256 << 10) } else { all.min(GATHER) };
        // (A stage zeroes only the bytes asked for, not all 4 KiB on every call.)
        let mut raw = std::mem::MaybeUninit::<[u8; GATHER]>::uninit();
        let mut stage = sys::fd::Stage::new(&mut raw);
        let mut big = Vec::new();
        let tmp: &mut [u8] = if want <= GATHER {
            stage.zeroed(want)
        } else {
            big.resize(want, 0);
            &mut big[..]
        };
        let n = vc.recv(fd, tmp, flags)?;
        let mut left = &tmp[..n];
        while !left.is_empty() && at < iov.len() {
            let b = iov.buf_mut(at);
            let k = (b.len() - off).min(left.len());
            b[off..off + k].copy_from_slice(&left[..k]);
            left = &left[k..];
            off += k;
            if off == b.len() {
                at += 1;
                off = 0;
            }
        }
        total = n;
        if n < want || total == all || flags & libc::MSG_PEEK != 0 {
            return Ok(total);
        }
    }
    // The rest buffer by buffer (bulk reads: each call fills a large buffer).
    while at < iov.len() {
        if iov.len_of(at) == off {
            at += 1;
            off = 0;
            continue;
        }
        // After the first bytes, only what is there already (as readv does), unless the
        // program waits for all (MSG_WAITALL).
        let f = if total > 0 && flags & libc::MSG_WAITALL == 0 { flags | libc::MSG_DONTWAIT } else { flags };
        let b = &mut iov.buf_mut(at)[off..];
        let want = b.len();
        match vc.recv(fd, b, f) {
            Ok(n) => {
                total += n;
                if n < want {
                    break;
                }
            }
            Err(_) if total > 0 => break,
            Err(e) => return Err(e),
        }
        at += 1;
        off = 0;
    }
    Ok(total)
}

/// writev semantics over a virtual connection: up to six buffers go as one send (one frame
/// on kernel TCP); more are gathered into one buffer when small, and go buffer by buffer,
/// stopping at a short send, when large.
fn vc_writev(vc: &Vc, fd: c_int, iov: &ProgIov, flags: c_int) -> Result<usize, IrbError> {
    // (The program's buffers that are not empty, walked without a list: no allocation.)
    let live = || (0..iov.len()).filter(|&i| iov.len_of(i) > 0);
    // A few buffers (a message's header and body): one frame, in one system call, and no
    // copy of the program's bytes but the replay ring's.
    if let Some(g) = Gather::new(live().map(|i| iov.buf(i))) {
        return match g.parts() {
            [one] => vc.send(fd, one, flags),
            _ => vc.send_gather(fd, g, flags),
        };
    }
    let len: usize = live().map(|i| iov.len_of(i)).sum();
    if len <= 256 << 10 {
        if len <= GATHER {
            // (No allocation for a small message, and only its bytes touched.)
            let mut raw = std::mem::MaybeUninit::<[u8; GATHER]>::uninit();
            let mut stage = sys::fd::Stage::new(&mut raw);
            let small = stage.zeroed(len);
            let mut k = 0;
            for i in live() {
                let b = iov.buf(i);
                small[k..k + b.len()].copy_from_slice(b);
                k += b.len();
            }
            return vc.send(fd, &small[..k], flags);
        }
        let mut all = Vec::with_capacity(len);
        for i in live() {
            all.extend_from_slice(iov.buf(i));
        }
        return vc.send(fd, &all, flags);
    }
    let mut total = 0;
    for i in live() {
        let b = iov.buf(i);
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

/// `connect`: `dst` is the program's destination (if it is one the layer reads); `real`
/// connects to the program's address, or to the one given (the same node at another
/// address when the program's is on a dead network).
pub fn connect(fd: c_int, dst: Option<SocketAddr>, real: impl FnOnce(Option<&RawAddr>) -> Real) -> Real {
    let before = dst.and_then(|dst| quietly(|| setup::before_connect(fd, dst)));
    let via = match &before {
        Some(setup::Before::Virtual(p)) => {
            p.via.map(|v| RawAddr::ip(&v, sys::tcp_family(fd) == Some(libc::AF_INET6)))
        }
        _ => None,
    };
    let r = real(via.as_ref());
    // (A blocking connect interrupted by a signal goes on in the kernel, as a non-blocking
    // one does.)
    let made = matches!(r, Ok(_) | Err(Errno(libc::EINPROGRESS | libc::EINTR)));
    match before {
        Some(setup::Before::Virtual(p)) => {
            quietly(|| {
                if made {
                    setup::after_connect(fd, p, r.is_err());
                } else {
                    setup::connect_failed(p);
                }
                Some(())
            });
        }
        Some(setup::Before::Plain(dst)) if made => setup::plain_connect(dst),
        _ => {}
    }
    r
}

/// `listen`.
pub fn listen(fd: c_int, real: impl FnOnce() -> Real) -> Real {
    if fdtable::is_managed(fd) {
        return real();
    }
    // A bound socket is registered before it listens: once the kernel takes connections on
    // it, a connecting layer's agent must find it (a client that connects as soon as the
    // port listens would otherwise go plain).
    let early = quietly(|| setup::before_listen(fd));
    match real() {
        Ok(r) => {
            quietly(|| {
                setup::after_listen(fd, early);
                Some(())
            });
            Ok(r)
        }
        Err(e) => {
            if let Some(addr) = early {
                quietly(|| {
                    setup::listen_failed(addr);
                    Some(())
                });
            }
            Err(e)
        }
    }
}

/// `accept` and `accept4`: `real` is the program's call, run again when it failed because
/// the layer put another listener under the descriptor meanwhile (after a migration: see
/// `relink/relisten.rs`).
pub fn accept(listen_fd: c_int, mut real: impl FnMut() -> Real) -> Real {
    let fd = loop {
        let gen = crate::relink::relisten::GEN.load(std::sync::atomic::Ordering::SeqCst);
        match real() {
            Err(Errno(libc::EINVAL))
                if gen != crate::relink::relisten::GEN.load(std::sync::atomic::Ordering::SeqCst)
                    && matches!(fdtable::get(listen_fd), Some(Entry::Listener(_))) => {}
            r => break r?,
        }
    };
    if fdtable::is_managed(listen_fd) {
        quietly(|| {
            setup::after_accept(listen_fd, fd);
            Some(())
        });
    }
    Ok(fd)
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

/// Descriptor `fd` is closed (by `close`, or by `dup2`/`dup3` over it): the epoll
/// registrations the layer keeps for it go, and so does an epoll instance at `fd` with its own.
fn registrations_closed(fd: c_int) {
    if crate::ready::tracking(fd) || fdtable::is_managed(fd) {
        crate::ready::note_close(fd);
    }
    crate::ready::note_closed_fd(fd);
}

/// `close`.
pub fn close(fd: c_int, real: impl FnOnce() -> Real) -> Real {
    if crate::ownfd::is_protected(fd) {
        // One of the layer's own descriptors: the program (a daemon closing everything)
        // does not know it; keep it.
        return Ok(0);
    }
    registrations_closed(fd);
    if fdtable::is_managed(fd) && !crate::vforked() {
        if let Some(vc) = forget(fd) {
            if let Some(l) = vc.shm_now() {
                // The peer reads what the ring holds, then the end; nothing lingers here. A
                // close with unread bytes, or with SO_LINGER 0, is a reset, as a socket's.
                quietly(|| {
                    let reset = l.readable() > 0 || crate::linger::abortive_close(fd);
                    vc.shm_close(l, fd, reset);
                    Some(())
                });
                return real();
            }
            return crate::linger::close_last(fd, vc);
        }
    }
    real()
}

/// `epoll_ctl`: forwarded; while a virtual connection's link is rebuilt, a change of its
/// registration is made to the registration the layer keeps aside until the new socket is
/// in place (see `Vc::epoll_ctl`). UCX treats a failed `EPOLL_CTL_MOD` as fatal. `ev` is
/// the program's event, read only where the kernel reads it too.
#[inline]
pub fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: &ProgCell<libc::epoll_event>,
    real: impl FnOnce() -> Real,
) -> Real {
    let vc = fdtable::vc(fd);
    let r = match &vc {
        Some(vc) => vc.epoll_ctl(epfd, op, fd, || ev.get(), real),
        None => real(),
    }?;
    let managed = vc.is_some() || fdtable::is_managed(fd);
    if !managed {
        // (Whether `fd` is an epoll instance nested in `epfd`.)
        const INPUT: u32 = (libc::EPOLLIN | libc::EPOLLRDNORM) as u32;
        let input = ev.get().is_some_and(|e| e.events & INPUT != 0);
        crate::ready::note_nesting(epfd, op, fd, input);
    }
    if managed || crate::ready::tracking(epfd) {
        let (events, data) = match (op, ev.get()) {
            (libc::EPOLL_CTL_DEL, _) | (_, None) => (0, 0),
            (_, Some(e)) => (e.events, e.u64),
        };
        quietly(|| {
            crate::ready::note_ctl(epfd, op, fd, vc.as_ref(), events, data);
            Some(())
        });
    }
    Ok(r)
}

/// `epoll_wait` and its variants: readable reports of virtual connections are checked
/// ([`crate::ready`]). `wait(first, us_left)` is the real call, writing into `events`.
pub fn epoll_wait(
    epfd: c_int,
    events: &mut ProgArray<libc::epoll_event>,
    timeout_us: i64,
    wait: impl FnMut(bool, i64) -> Real,
) -> Hooked<c_int> {
    if !crate::ready::tracking(epfd) {
        return Ok(Hook::Real);
    }
    crate::ready::epoll_wait(epfd, events, timeout_us, wait).map(Hook::Done)
}

/// `poll` and `ppoll`: readable reports of virtual connections are checked.
pub fn poll(fds: &mut ProgArray<libc::pollfd>, timeout_us: i64, wait: impl FnMut(bool, i64) -> Real) -> Real {
    crate::ready::poll(fds, timeout_us, wait)
}

/// `select` and `pselect`: readable reports of virtual connections are checked.
pub fn select(
    nfds: c_int,
    sets: &mut [ProgArray<libc::fd_set>; 3],
    timeout_us: i64,
    wait: impl FnMut(bool, i64) -> Real,
) -> Real {
    crate::ready::select(nfds, sets, timeout_us, wait)
}

/// `shutdown`: `real(how)` shuts the program's socket down.
pub fn shutdown(fd: c_int, how: c_int, real: impl FnOnce(c_int) -> Real) -> Real {
    let Some(vc) = fdtable::vc(fd) else { return real(how) };
    let send_side = how == libc::SHUT_WR || how == libc::SHUT_RDWR;
    if let (Some(l), true) = (vc.shm_now(), send_side) {
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
                return Ok(0);
            }
            // The receive half of SHUT_RDWR.
            return real(libc::SHUT_RD);
        }
    }
    if send_side {
        // The end of stream travels as a Fin frame (the peer keeps acknowledging).
        let told = vc.mem().conn().tx_shut.load(std::sync::atomic::Ordering::Acquire) != 0;
        quietly(|| Some(vc.end_stream(fd))).unwrap_or(Err(Errno(libc::EIO)))?;
        quietly(|| {
            if !told {
                crate::relink::ended(&vc);
            }
            if !sys::nonblocking(fd) {
                crate::linger::until_sent(fd);
            }
            Some(())
        });
        if how == libc::SHUT_WR {
            return Ok(0);
        }
        // The receive half of SHUT_RDWR.
        return real(libc::SHUT_RD);
    }
    real(how)
}

/// getsockname/getpeername after a failover: what the program saw before (the physical
/// link's addresses changed under it).
/// A listener's name is the address it was bound to (after a migration to a node without
/// that address the socket under it listens on every address: see `relink/relisten.rs`).
pub fn name_of(fd: c_int, out: &mut ProgAddrOut, peer: bool) -> Hooked<c_int> {
    if !fdtable::is_managed(fd) {
        return Ok(Hook::Real);
    }
    let name = quietly(|| match fdtable::get(fd)? {
        Entry::Listener(l) if !peer => Some(l.addr),
        Entry::Vc(vc) => {
            let c = vc.mem().conn();
            if !vc.renamed
                && c.link_gen.load(std::sync::atomic::Ordering::Acquire) == 0
                && c.link_down.load(std::sync::atomic::Ordering::Acquire) == 0
            {
                return None;
            }
            Some(if peer { vc.peer } else { vc.local })
        }
        _ => None,
    });
    let Some(name) = name else { return Ok(Hook::Real) };
    out.put(&name, sys::tcp_family(fd) == Some(libc::AF_INET6))?;
    Ok(Hook::Done(0))
}

/// `TCP_CORK` or `TCP_NODELAY`.
fn bell_sensitive(level: c_int, opt: c_int) -> bool {
    level == libc::IPPROTO_TCP && (opt == libc::TCP_CORK || opt == libc::TCP_NODELAY)
}

/// A virtual connection's TCP_CORK and TCP_NODELAY are the program's: while its socket
/// carries only shared-memory bells they are kept aside for the connection's later links
/// and not given to the kernel (see `Vc::program_sets_tcp`). A value shorter than an int
/// goes to the kernel, which refuses it.
pub fn setsockopt(fd: c_int, level: c_int, opt: c_int, val: &ProgBytes) -> Hooked<c_int> {
    if level == libc::SOL_SOCKET && opt == libc::SO_LINGER {
        // (The kernel's socket takes it, and keeps it across relinks: looked at on close.
        // Set before `connect` too, on a socket not yet virtual.)
        crate::linger::linger_set();
    }
    if crate::sys::fd::is_timeo(level, opt) {
        // (The same: the layer's own waits look for it.)
        crate::sys::fd::timeo_set();
    }
    if !bell_sensitive(level, opt) || val.len() < std::mem::size_of::<c_int>() {
        return Ok(Hook::Real);
    }
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let on = val.get()[..4] != [0u8; 4];
    if quietly(|| Some(vc.program_sets_tcp(opt, on))) == Some(true) {
        return Ok(Hook::Done(0));
    }
    Ok(Hook::Real)
}

/// `getsockopt`: the program's own TCP_CORK and TCP_NODELAY where they are kept aside.
pub fn getsockopt(fd: c_int, level: c_int, opt: c_int, out: &mut ProgOptOut) -> Hooked<c_int> {
    if !bell_sensitive(level, opt) || !out.present() {
        return Ok(Hook::Real);
    }
    let Some(v) = fdtable::vc(fd).and_then(|vc| quietly(|| vc.program_tcp(opt))) else {
        return Ok(Hook::Real);
    };
    out.put_int(v)?;
    Ok(Hook::Done(0))
}

/// `close_range`: the layer's own descriptors in the range stay open; `real(lo, hi)`
/// closes a sub-range.
pub fn close_range(
    first: c_uint,
    last: c_uint,
    flags: c_int,
    mut real: impl FnMut(c_uint, c_uint) -> Real,
) -> Real {
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int != 0 || (fdtable::any() && crate::vforked()) {
        // A vfork child closes its own descriptors; the tables it shares are its parent's.
        return real(first, last);
    }
    let mut own: Vec<c_uint> = crate::ownfd::protected()
        .into_iter()
        .map(|f| f as c_uint)
        .filter(|&f| f >= first && f <= last)
        .collect();
    own.sort_unstable();
    for (fd, _) in fdtable::snapshot() {
        if fd as c_uint >= first && fd as c_uint <= last {
            forget(fd);
        }
    }
    let mut lo = first;
    for f in own {
        if f > lo {
            real(lo, f - 1)?;
        }
        lo = f + 1;
    }
    if lo <= last && lo >= first {
        return real(lo, last);
    }
    Ok(0)
}

fn copy_entry(old: c_int, new: c_int) {
    if let Some(e) = fdtable::get(old) {
        fdtable::insert(new, e);
    }
}

/// `dup`.
pub fn dup(fd: c_int, real: impl FnOnce() -> Real) -> Real {
    let r = real()?;
    if fdtable::is_managed(fd) && !crate::vforked() {
        copy_entry(fd, r);
    }
    Ok(r)
}

/// `dup2` and `dup3`.
pub fn dup_onto(old: c_int, new: c_int, real: impl FnOnce() -> Real) -> Real {
    if (fdtable::is_managed(old) || fdtable::is_managed(new) || crate::ownfd::is_protected(new))
        && crate::vforked()
    {
        // A vfork child arranging its descriptors before exec: they are its own; the tables
        // it shares are its parent's.
        return real();
    }
    if old != new {
        if crate::ownfd::evict(new).is_some() && new == crate::ownfd::own_fd(crate::ownfd::OWN_AGENT) {
            agent::lost_socket();
        }
        // What `new` named is closed, as by `close`: its epoll registrations are forgotten
        // (else an event with their data would be checked against the connection that
        // takes the number now), and an epoll instance at `new` goes with its own. (Not in
        // a vfork child: its descriptors are its own, the tables its parent's.)
        if !crate::vforked() {
            registrations_closed(new);
        }
        if fdtable::is_managed(new) {
            forget(new);
        }
    }
    let r = real()?;
    if old != new && fdtable::is_managed(old) {
        copy_entry(old, new);
    }
    Ok(r)
}

/// `fcntl` (and `fcntl64`).
pub fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong, real: impl FnOnce() -> Real) -> Real {
    let r = real()?;
    if cmd == libc::F_SETFL {
        sandbox::note_nonblock(fd, arg as c_int & libc::O_NONBLOCK != 0);
    }
    if (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) && fdtable::is_managed(fd) && !crate::vforked()
    {
        copy_entry(fd, r);
    }
    Ok(r)
}

/// `ioctl`: `FIONREAD` on a virtual connection counts the stream's bytes, not the
/// socket's; `FIONBIO` is noted. `arg` is the int the two requests point at.
pub fn ioctl(fd: c_int, req: c_ulong, arg: &mut ProgCell<c_int>, real: impl FnOnce() -> Real) -> Real {
    if req == libc::FIONREAD {
        if let Some(vc) = fdtable::vc(fd) {
            return match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| vc.readable_bytes(fd))) {
                Ok(Ok(n)) => {
                    arg.set(n);
                    Ok(0)
                }
                Ok(Err(e)) => Err(Errno(e)),
                Err(_) => Err(Errno(libc::EIO)),
            };
        }
    }
    let r = real()?;
    if req == libc::FIONBIO && !arg.is_null() {
        sandbox::note_nonblock(fd, arg.get() != Some(0));
    }
    Ok(r)
}

/// `read` (and `__read_chk` within its buffer).
#[inline]
pub fn read(fd: c_int, b: &mut ProgBytesMut) -> Hooked<usize> {
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let _implied = implied(sandbox::READ_CALLS);
    guarded(|| vc.recv(fd, b.get(), 0))
}

/// `write`.
#[inline]
pub fn write(fd: c_int, b: &ProgBytes) -> Hooked<usize> {
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let _implied = implied(sandbox::WRITE_CALLS);
    guarded(|| vc.send(fd, b.get(), 0))
}

/// `readv`.
pub fn readv(fd: c_int, iov: &mut ProgIov) -> Hooked<usize> {
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let _implied = implied(sandbox::READ_CALLS);
    guarded(|| vc_readv(&vc, fd, iov, 0))
}

/// `writev`.
pub fn writev(fd: c_int, iov: &ProgIov) -> Hooked<usize> {
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let _implied = implied(sandbox::WRITE_CALLS);
    guarded(|| vc_writev(&vc, fd, iov, 0))
}

/// `recv` (and `__recv_chk` within its buffer).
#[inline]
pub fn recv(fd: c_int, b: &mut ProgBytesMut, flags: c_int) -> Hooked<usize> {
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let _implied = implied(sandbox::RECV_CALLS);
    guarded(|| vc.recv(fd, b.get(), flags))
}

/// `send`, and `sendto` (a connected stream socket ignores the address).
#[inline]
pub fn send(fd: c_int, b: &ProgBytes, flags: c_int) -> Hooked<usize> {
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let _implied = implied(sandbox::SEND_CALLS);
    guarded(|| vc.send(fd, b.get(), flags))
}

/// `recvfrom`: TCP reports no source address, as the kernel does.
pub fn recvfrom(fd: c_int, b: &mut ProgBytesMut, flags: c_int, from: &mut ProgAddrOut) -> Hooked<usize> {
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let _implied = implied(sandbox::RECV_CALLS);
    from.put_none();
    guarded(|| vc.recv(fd, b.get(), flags))
}

/// `recvmsg` (not the error queue, which is the socket's own).
pub fn recvmsg(fd: c_int, msg: Option<&mut ProgMsg>, flags: c_int) -> Hooked<usize> {
    let Some(msg) = msg.filter(|_| flags & libc::MSG_ERRQUEUE == 0) else { return Ok(Hook::Real) };
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let _implied = implied(sandbox::RECV_CALLS);
    msg.clear_extras();
    let mut iov = msg.iov();
    guarded(|| vc_readv(&vc, fd, &mut iov, flags))
}

/// `sendmsg`.
pub fn sendmsg(fd: c_int, msg: Option<&ProgMsg>, flags: c_int) -> Hooked<usize> {
    let Some(msg) = msg else { return Ok(Hook::Real) };
    let Some(vc) = fdtable::vc(fd) else { return Ok(Hook::Real) };
    let _implied = implied(sandbox::SEND_CALLS);
    let iov = msg.iov();
    guarded(|| vc_writev(&vc, fd, &iov, flags))
}

/// `sendfile` (and `sendfile64`) onto a virtual connection: the file is read and its bytes
/// go through the connection.
pub fn sendfile(out: c_int, inp: c_int, off: &mut ProgCell<off_t>, count: usize) -> Hooked<usize> {
    let Some(vc) = fdtable::vc(out) else { return Ok(Hook::Real) };
    guarded(|| vc_sendfile(&vc, out, inp, off, count))
}

fn vc_sendfile(
    vc: &Vc,
    out: c_int,
    inp: c_int,
    off: &mut ProgCell<off_t>,
    count: usize,
) -> Result<usize, IrbError> {
    let mut pos: off_t = match off.get() {
        Some(p) => p,
        // Where the program's file position is, without moving it.
        None => sys::fd::lseek(inp, 0, libc::SEEK_CUR).map_err(|e| IrbError::Os(e.0))?,
    };
    let mut chunk = vec![0u8; count.min(256 << 10)];
    let mut total = 0usize;
    while total < count {
        let want = (count - total).min(chunk.len());
        let r = sys::fd::pread(inp, &mut chunk[..want], pos);
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
        // The program's file position moves past what was sent.
        let _ = sys::fd::lseek(inp, pos, libc::SEEK_SET);
    } else {
        off.set(pos);
    }
    Ok(total)
}

/// `fork`.
pub fn fork(real: impl FnOnce() -> Real) -> Real {
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
    // (The atfork handlers keep the layer's locks consistent.)
    let r = real();
    match r {
        Err(_) => {
            for v in &vcs {
                v.release();
            }
        }
        Ok(0) if !vcs.is_empty() => {
            quietly(|| {
                crate::relink::forked_child();
                Some(())
            });
        }
        Ok(_) => {}
    }
    r
}

/// The exec calls: `env` is the environment the new image would get, `with_env` makes the
/// program's exec with another one, `real` makes it as it was. Connections the image
/// inherits are handed over in its environment (see [`crate::exec`]).
pub fn exec(
    env: impl FnOnce() -> Vec<std::ffi::CString>,
    with_env: impl FnOnce(&[std::ffi::CString]) -> Real,
    real: impl FnOnce() -> Real,
) -> Real {
    // (Held across the real call: the control thread keeps still while the image goes.)
    let _quiet = crate::relink::quiet_for_exec();
    match quietly(|| crate::exec::env_for_exec(env)) {
        Some(h) => h.exec(with_env),
        None => real(),
    }
}
