//! Safe forms of the descriptor calls the layer makes for itself: buffers are slices,
//! addresses are [`RawAddr`]s, and each function is the libc call of the same name (through
//! [`super::real`] where the program's own symbol is hooked). Return values and errno are
//! the kernel's, untouched: the callers decide what an error means.

use super::real;
use libc::{c_int, c_ulong, c_void, iovec, pollfd, sockaddr, sockaddr_storage, socklen_t};
use std::ffi::CStr;
use std::net::SocketAddr;

/// Most buffer parts one gathered or scattered call takes (a chain offer, a frame header and
/// the payload gathered from up to six of the program's buffers; a header and the two pieces
/// of a payload that wraps around the ring; or two frames, each a header and its payload,
/// from the program's buffers). A call given more sends a prefix of them.
pub const MAX_PARTS: usize = 10;

/// A socket address owned by the layer, ready for `bind` or `connect`.
#[derive(Clone, Copy)]
pub struct RawAddr {
    st: sockaddr_storage,
    len: socklen_t,
}

impl RawAddr {
    /// An IP address, in the family of a socket that is (`v6_socket`) or is not IPv6.
    pub fn ip(a: &SocketAddr, v6_socket: bool) -> RawAddr {
        let (st, len) = super::to_raw(a, v6_socket);
        RawAddr { st, len }
    }

    /// A Unix-domain address. `path` is a file path, or an abstract name when it starts
    /// with a NUL byte; `None` when it does not fit.
    pub fn unix(path: &[u8]) -> Option<RawAddr> {
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut st: sockaddr_storage = unsafe { std::mem::zeroed() };
        // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_un.
        let sun = unsafe { &mut *(&mut st as *mut sockaddr_storage as *mut libc::sockaddr_un) };
        if path.len() >= sun.sun_path.len() {
            return None;
        }
        sun.sun_family = libc::AF_UNIX as _;
        for (d, s) in sun.sun_path.iter_mut().zip(path) {
            *d = *s as libc::c_char;
        }
        let off = std::mem::size_of::<libc::sa_family_t>();
        // A file path counts its terminating NUL; an abstract name is exactly its bytes.
        let len = off + path.len() + usize::from(path.first() != Some(&0));
        Some(RawAddr { st, len: len as socklen_t })
    }

    /// An address of family AF_UNSPEC (`connect` to it dissolves a socket's association).
    pub fn unspec() -> RawAddr {
        // SAFETY: all-zero is a valid sockaddr_storage, and AF_UNSPEC is 0.
        let st: sockaddr_storage = unsafe { std::mem::zeroed() };
        RawAddr { st, len: std::mem::size_of::<sockaddr>() as socklen_t }
    }

    fn ptr(&self) -> *const sockaddr {
        &self.st as *const sockaddr_storage as *const sockaddr
    }
}

/// `lseek`.
pub fn lseek(fd: c_int, off: libc::off_t, whence: c_int) -> Result<libc::off_t, super::Errno> {
    // SAFETY: no pointers.
    super::cvt(unsafe { libc::lseek(fd, off, whence) })
}

/// `close`.
#[inline]
pub fn close(fd: c_int) -> c_int {
    // SAFETY: closing a number is memory-safe; which descriptor it names is the caller's
    // business.
    unsafe { real::close(fd) }
}

/// `shutdown`.
#[inline]
pub fn shutdown(fd: c_int, how: c_int) -> c_int {
    // SAFETY: no pointers.
    unsafe { real::shutdown(fd, how) }
}

/// `fcntl` with an integer argument (`F_GETFD`, `F_SETFD`, `F_GETFL`, `F_SETFL`,
/// `F_DUPFD`, `F_DUPFD_CLOEXEC`, `F_ADD_SEALS`); other commands, which take pointers, are refused with -1
/// and `EINVAL`.
pub fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    match cmd {
        libc::F_GETFD
        | libc::F_SETFD
        | libc::F_GETFL
        | libc::F_SETFL
        | libc::F_DUPFD
        | libc::F_DUPFD_CLOEXEC
        | libc::F_ADD_SEALS => {
            // SAFETY: these commands take an integer, not a pointer.
            unsafe { real::fcntl(fd, cmd, arg) }
        }
        _ => {
            super::set_errno(libc::EINVAL);
            -1
        }
    }
}

/// `dup3`.
pub fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: no pointers.
    unsafe { real::dup3(old, new, flags) }
}

/// `socket`.
pub fn socket(family: c_int, ty: c_int, proto: c_int) -> c_int {
    // SAFETY: no pointers.
    unsafe { libc::socket(family, ty, proto) }
}

/// `bind`.
pub fn bind(fd: c_int, a: &RawAddr) -> c_int {
    // SAFETY: the address is owned and `len` bytes long.
    unsafe { libc::bind(fd, a.ptr(), a.len) }
}

/// `connect`.
pub fn connect(fd: c_int, a: &RawAddr) -> c_int {
    // SAFETY: as for bind.
    unsafe { real::connect(fd, a.ptr(), a.len) }
}

/// `listen`.
pub fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: no pointers.
    unsafe { real::listen(fd, backlog) }
}

/// `accept4` without the peer's address.
pub fn accept4(fd: c_int, flags: c_int) -> c_int {
    // SAFETY: null address and length are allowed.
    unsafe { libc::accept4(fd, std::ptr::null_mut(), std::ptr::null_mut(), flags) }
}

/// `send`.
#[inline]
pub fn send(fd: c_int, b: &[u8], flags: c_int) -> isize {
    // SAFETY: `b` is readable for its length.
    unsafe { real::send(fd, b.as_ptr() as *const c_void, b.len(), flags) }
}

/// `recv`.
#[inline]
pub fn recv(fd: c_int, b: &mut [u8], flags: c_int) -> isize {
    // SAFETY: `b` is writable for its length.
    unsafe { real::recv(fd, b.as_mut_ptr() as *mut c_void, b.len(), flags) }
}

/// `read` (through the real libc symbol, not the layer's hook).
#[inline]
pub fn read(fd: c_int, b: &mut [u8]) -> isize {
    // SAFETY: as for recv.
    unsafe { real::read(fd, b.as_mut_ptr() as *mut c_void, b.len()) }
}

/// `read` of the kernel's own (eventfd counters, pipes), through libc directly.
pub fn read_raw(fd: c_int, b: &mut [u8]) -> isize {
    // SAFETY: as for recv.
    unsafe { libc::read(fd, b.as_mut_ptr() as *mut c_void, b.len()) }
}

/// `write` (through the real libc symbol).
#[inline]
pub fn write(fd: c_int, b: &[u8]) -> isize {
    // SAFETY: as for send.
    unsafe { real::write(fd, b.as_ptr() as *const c_void, b.len()) }
}

/// `write` through libc directly (eventfd counters).
pub fn write_raw(fd: c_int, b: &[u8]) -> isize {
    // SAFETY: as for send.
    unsafe { libc::write(fd, b.as_ptr() as *const c_void, b.len()) }
}

/// `pread`.
pub fn pread(fd: c_int, b: &mut [u8], off: i64) -> isize {
    // SAFETY: as for recv.
    unsafe { libc::pread(fd, b.as_mut_ptr() as *mut c_void, b.len(), off) }
}

fn iovs(parts: &[&[u8]]) -> ([iovec; MAX_PARTS], usize) {
    debug_assert!(parts.len() <= MAX_PARTS, "more parts than one call takes");
    let mut v = [iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_PARTS];
    let n = parts.len().min(MAX_PARTS);
    for (d, s) in v.iter_mut().zip(parts) {
        *d = iovec { iov_base: s.as_ptr() as *mut c_void, iov_len: s.len() };
    }
    (v, n)
}

fn iovs_mut(parts: &mut [&mut [u8]]) -> ([iovec; MAX_PARTS], usize) {
    debug_assert!(parts.len() <= MAX_PARTS, "more parts than one call takes");
    let mut v = [iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_PARTS];
    let n = parts.len().min(MAX_PARTS);
    for (d, s) in v.iter_mut().zip(parts.iter_mut()) {
        *d = iovec { iov_base: s.as_mut_ptr() as *mut c_void, iov_len: s.len() };
    }
    (v, n)
}

/// `sendmsg` of the parts in order (at most [`MAX_PARTS`]), no address, no control data.
#[inline]
pub fn send_parts(fd: c_int, parts: &[&[u8]], flags: c_int) -> isize {
    let (mut v, n) = iovs(parts);
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = v.as_mut_ptr();
    msg.msg_iovlen = n as _;
    // SAFETY: the iovecs name the live slices of `parts` (the kernel only reads them).
    unsafe { real::sendmsg(fd, &msg, flags) }
}

/// `writev` of the parts in order (at most [`MAX_PARTS`]).
#[inline]
pub fn write_parts(fd: c_int, parts: &[&[u8]]) -> isize {
    let (v, n) = iovs(parts);
    // SAFETY: as for send_parts.
    unsafe { real::writev(fd, v.as_ptr(), n as c_int) }
}

/// `recvmsg` into the parts in order (at most [`MAX_PARTS`]), no address, no control data.
#[inline]
pub fn recv_parts(fd: c_int, parts: &mut [&mut [u8]], flags: c_int) -> isize {
    let (mut v, n) = iovs_mut(parts);
    // SAFETY: as for send_parts.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = v.as_mut_ptr();
    msg.msg_iovlen = n as _;
    // SAFETY: the iovecs name the live, writable slices of `parts`.
    unsafe { real::recvmsg(fd, &mut msg, flags) }
}

/// `readv` into the parts in order (at most [`MAX_PARTS`]).
#[inline]
pub fn read_parts(fd: c_int, parts: &mut [&mut [u8]]) -> isize {
    let (v, n) = iovs_mut(parts);
    // SAFETY: as for recv_parts.
    unsafe { real::readv(fd, v.as_ptr(), n as c_int) }
}

/// `sendmsg` of one buffer with descriptor `pass` attached (SCM_RIGHTS), to `to` if given
/// (a datagram socket's destination).
pub fn send_with_fd(fd: c_int, b: &[u8], pass: c_int, to: Option<&RawAddr>, flags: c_int) -> isize {
    let mut iov = iovec { iov_base: b.as_ptr() as *mut c_void, iov_len: b.len() };
    let mut cbuf: super::FdCmsg = [0; 4];
    // SAFETY: as for send_parts.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(a) = to {
        msg.msg_name = a.ptr() as *mut c_void;
        msg.msg_namelen = a.len;
    }
    super::attach_fd(&mut msg, &mut cbuf, pass);
    // SAFETY: the message names live locals.
    unsafe { real::sendmsg(fd, &msg, flags) }
}

/// `sendto` of one datagram to `to`.
pub fn send_to(fd: c_int, b: &[u8], to: &RawAddr, flags: c_int) -> isize {
    // SAFETY: the buffer and the address are live locals of the caller.
    unsafe { real::sendto(fd, b.as_ptr() as *const c_void, b.len(), flags, to.ptr(), to.len) }
}

/// Takes every datagram waiting on `fd` (a non-blocking socket whose datagrams say only
/// "look"), up to 32 with each call; returns how many were taken.
pub fn drain_datagrams(fd: c_int) -> usize {
    const N: usize = 32;
    let mut bytes = [[0u8; 1]; N];
    let mut taken = 0;
    loop {
        // SAFETY: all-zero is a valid mmsghdr and iovec.
        let mut iov: [iovec; N] = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut msgs: [libc::mmsghdr; N] = unsafe { std::mem::zeroed() };
        for ((m, v), b) in msgs.iter_mut().zip(iov.iter_mut()).zip(bytes.iter_mut()) {
            v.iov_base = b.as_mut_ptr() as *mut c_void;
            v.iov_len = 1;
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
        }
        // SAFETY: every message names one live byte; the call is not one the layer hooks.
        let r = unsafe {
            libc::recvmmsg(fd, msgs.as_mut_ptr(), N as libc::c_uint, libc::MSG_DONTWAIT, std::ptr::null_mut())
        };
        if r <= 0 {
            return taken;
        }
        taken += r as usize;
        if (r as usize) < N {
            return taken;
        }
    }
}

/// `poll` (through the real symbol).
#[inline]
pub fn poll(fds: &mut [pollfd], ms: c_int) -> c_int {
    // SAFETY: `fds` is a valid array of its length.
    unsafe { real::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) }
}

/// `ppoll` through libc directly, with a time-out in microseconds (none if negative) and no
/// signal mask.
pub fn ppoll_us(fds: &mut [pollfd], us: i64) -> c_int {
    let ts = libc::timespec { tv_sec: us.max(0) / 1_000_000, tv_nsec: (us.max(0) % 1_000_000) * 1000 };
    let tsp = if us >= 0 { &ts as *const libc::timespec } else { std::ptr::null() };
    // SAFETY: valid array and time-out (or null), no signal mask.
    unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, tsp, std::ptr::null()) }
}

/// The `select` system call itself (not glibc's, which may use `pselect6`) for
/// readability of `fds` (each below FD_SETSIZE) with a time-out in milliseconds (none if
/// negative): the call's result, and which of `fds` were readable.
pub fn select_readable(fds: &[c_int], ms: c_int) -> (c_int, Vec<bool>) {
    let mut set = FdSet::new();
    let mut hi = -1;
    for &f in fds {
        set.insert(f);
        hi = hi.max(f);
    }
    let mut tv = libc::timeval { tv_sec: (ms.max(0) / 1000) as _, tv_usec: ((ms.max(0) % 1000) * 1000) as _ };
    let tvp = if ms >= 0 { &mut tv as *mut libc::timeval } else { std::ptr::null_mut() };
    // SAFETY: a valid set and time-out (or null); the other sets are null.
    let r = unsafe {
        libc::syscall(libc::SYS_select, hi + 1, &mut set.0 as *mut libc::fd_set, 0usize, 0usize, tvp)
    } as c_int;
    let ready = fds.iter().map(|&f| r > 0 && set.contains(f)).collect();
    (r, ready)
}

/// An `fd_set` owned by the layer.
#[derive(Clone, Copy)]
pub struct FdSet(pub libc::fd_set);

impl FdSet {
    /// An empty set.
    pub fn new() -> FdSet {
        // SAFETY: all-zero is an empty fd_set.
        FdSet(unsafe { std::mem::zeroed() })
    }

    /// Adds `fd` (ignored outside 0..FD_SETSIZE).
    pub fn insert(&mut self, fd: c_int) {
        if (0..libc::FD_SETSIZE as c_int).contains(&fd) {
            // SAFETY: fd is within the set's size.
            unsafe { libc::FD_SET(fd, &mut self.0) }
        }
    }

    /// Removes `fd`.
    pub fn remove(&mut self, fd: c_int) {
        if (0..libc::FD_SETSIZE as c_int).contains(&fd) {
            // SAFETY: as above.
            unsafe { libc::FD_CLR(fd, &mut self.0) }
        }
    }

    /// True if `fd` is in the set.
    pub fn contains(&self, fd: c_int) -> bool {
        // SAFETY: as above.
        (0..libc::FD_SETSIZE as c_int).contains(&fd) && unsafe { libc::FD_ISSET(fd, &self.0) }
    }
}

impl Default for FdSet {
    fn default() -> Self {
        FdSet::new()
    }
}

/// `epoll_ctl`; `ev` may be `None` for `EPOLL_CTL_DEL`.
pub fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: Option<&mut libc::epoll_event>) -> c_int {
    let p = ev.map_or(std::ptr::null_mut(), |e| e as *mut libc::epoll_event);
    // SAFETY: a valid event or null.
    unsafe { real::epoll_ctl(epfd, op, fd, p) }
}

/// `ioctl(FIONREAD)`: bytes waiting on a socket, or `None`.
pub fn fionread(fd: c_int) -> Option<c_int> {
    let mut n: c_int = 0;
    // SAFETY: FIONREAD writes one int.
    let r = unsafe { real::ioctl(fd, libc::FIONREAD, &mut n as *mut c_int as c_ulong) };
    (r >= 0).then_some(n)
}

/// `SIOCOUTQNSD`: bytes of a TCP socket's send queue the kernel has not sent yet.
pub const SIOCOUTQNSD: c_ulong = 0x894b;

/// `ioctl(SIOCOUTQNSD)`: bytes queued on a TCP socket and not sent yet, or `None`.
pub fn unsent(fd: c_int) -> Option<c_int> {
    let mut n: c_int = 0;
    // SAFETY: SIOCOUTQNSD writes one int.
    let r = unsafe { real::ioctl(fd, SIOCOUTQNSD, &mut n as *mut c_int as c_ulong) };
    (r >= 0).then_some(n)
}

/// `getsockopt` into a byte buffer: the length the kernel wrote, or `None`.
pub fn getsockopt_bytes(fd: c_int, level: c_int, opt: c_int, buf: &mut [u8]) -> Option<usize> {
    let mut len = buf.len() as socklen_t;
    // SAFETY: a writable buffer and its length.
    let r = unsafe { real::getsockopt(fd, level, opt, buf.as_mut_ptr() as *mut c_void, &mut len) };
    (r == 0).then_some(len as usize)
}

/// `setsockopt` from a byte buffer.
pub fn setsockopt_bytes(fd: c_int, level: c_int, opt: c_int, buf: &[u8]) -> c_int {
    // SAFETY: a readable buffer and its length.
    unsafe { real::setsockopt(fd, level, opt, buf.as_ptr() as *const c_void, buf.len() as socklen_t) }
}

/// Some socket of this process was given a receive or send time-out (`SO_RCVTIMEO`,
/// `SO_SNDTIMEO`): the layer's own waits on a connection (an empty ring, a full one, a full
/// window) look for the program's time-out then, for such programs only.
static TIMEO_SET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Option `opt` of level `level` is a socket time-out.
pub fn is_timeo(level: c_int, opt: c_int) -> bool {
    // (64-bit time forms too: what glibc passes for a program built with 64-bit time_t on
    // a 32-bit machine.)
    level == libc::SOL_SOCKET && matches!(opt, libc::SO_RCVTIMEO | libc::SO_SNDTIMEO | 66 | 67)
}

/// The program set a socket time-out on some socket.
pub fn timeo_set() {
    TIMEO_SET.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// When a wait that begins now on socket `fd` ends for the program's time-out `opt`
/// (`SO_RCVTIMEO` or `SO_SNDTIMEO`), in `super::now_us` time; `None` when it has none.
pub fn timeo_deadline(fd: c_int, opt: c_int) -> Option<u64> {
    if !TIMEO_SET.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    let mut tv = libc::timeval { tv_sec: 0, tv_usec: 0 };
    let mut len = std::mem::size_of::<libc::timeval>() as socklen_t;
    // SAFETY: a local timeval and its size.
    let r = unsafe {
        real::getsockopt(fd, libc::SOL_SOCKET, opt, &mut tv as *mut libc::timeval as *mut c_void, &mut len)
    };
    if r != 0 || (tv.tv_sec <= 0 && tv.tv_usec <= 0) {
        return None;
    }
    let us = (tv.tv_sec.max(0) as u64).saturating_mul(1_000_000).saturating_add(tv.tv_usec.max(0) as u64);
    Some(super::now_us().saturating_add(us))
}

/// `SO_LINGER` of a socket.
pub fn linger_of(fd: c_int) -> Option<libc::linger> {
    let mut l = libc::linger { l_onoff: 0, l_linger: 0 };
    let mut len = std::mem::size_of::<libc::linger>() as socklen_t;
    // SAFETY: a local linger and its size.
    let r = unsafe {
        real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &mut l as *mut libc::linger as *mut c_void,
            &mut len,
        )
    };
    (r == 0).then_some(l)
}

/// `fstat`.
pub fn fstat(fd: c_int) -> Option<libc::stat> {
    // SAFETY: all-zero is a valid stat, filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to it.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st)
}

/// `open` of a path.
pub fn open(path: &CStr, flags: c_int) -> c_int {
    // SAFETY: a NUL-terminated path.
    unsafe { libc::open(path.as_ptr(), flags) }
}

/// `open` of a path with a mode (for `O_CREAT`).
pub fn open_mode(path: &CStr, flags: c_int, mode: libc::mode_t) -> c_int {
    // SAFETY: a NUL-terminated path.
    unsafe { libc::open(path.as_ptr(), flags, mode as libc::c_uint) }
}

/// `unlink`.
pub fn unlink(path: &CStr) -> c_int {
    // SAFETY: a NUL-terminated path.
    unsafe { libc::unlink(path.as_ptr()) }
}

/// `ftruncate`.
pub fn ftruncate(fd: c_int, len: i64) -> c_int {
    // SAFETY: no pointers.
    unsafe { libc::ftruncate(fd, len as libc::off_t) }
}

/// `memfd_create`.
pub fn memfd_create(name: &CStr, flags: libc::c_uint) -> c_int {
    // SAFETY: a NUL-terminated name.
    unsafe { libc::memfd_create(name.as_ptr(), flags) }
}

/// `eventfd`.
pub fn eventfd(init: libc::c_uint, flags: c_int) -> c_int {
    // SAFETY: no pointers.
    unsafe { libc::eventfd(init, flags) }
}

/// `pidfd_open` then `pidfd_getfd`: a copy of descriptor `src` of process `pid`, or -1.
pub fn fd_of_process(pid: i32, src: c_int) -> c_int {
    // SAFETY: plain integer arguments.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as c_int;
    if pidfd < 0 {
        return -1;
    }
    // SAFETY: as above.
    let n = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, src, 0) } as c_int;
    let e = super::errno();
    close(pidfd);
    super::set_errno(e);
    n
}

/// Takes ownership of a descriptor as a `File` (closed when the file drops). The caller
/// gives up the descriptor: nothing else may close it.
pub fn into_file(fd: c_int) -> std::fs::File {
    use std::os::fd::FromRawFd;
    // SAFETY: the caller hands the descriptor over.
    unsafe { std::fs::File::from_raw_fd(fd) }
}

/// Sends the parts as one flat buffer of at most `N` bytes, gathered on the stack (for
/// small frames the kernel's one-buffer path is cheaper than `sendmsg`). Longer input is
/// refused with -1 and `EMSGSIZE`.
#[inline]
pub fn send_flat<const N: usize>(fd: c_int, parts: &[&[u8]], flags: c_int) -> isize {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    if total > N {
        super::set_errno(libc::EMSGSIZE);
        return -1;
    }
    let mut buf = std::mem::MaybeUninit::<[u8; N]>::uninit();
    let p = buf.as_mut_ptr() as *mut u8;
    let mut n = 0;
    for part in parts {
        // SAFETY: the parts add up to at most N bytes (checked), the buffer's size.
        unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), p.add(n), part.len()) };
        n += part.len();
    }
    // SAFETY: the first `n` bytes of the buffer were written just above.
    unsafe { real::send(fd, p as *const c_void, n, flags) }
}

/// A receive buffer (on the caller's stack) that is not zeroed first: it knows how many of
/// its bytes were written, and hands out only those. (The buffer is the caller's, not a
/// field: built inside a struct next to the count, the compiler chose to zero all of it,
/// 4 KiB per receive.)
pub struct Stage<'a, const N: usize> {
    buf: &'a mut std::mem::MaybeUninit<[u8; N]>,
    init: usize,
}

impl<'a, const N: usize> Stage<'a, N> {
    /// An empty stage over `buf`.
    #[inline]
    pub fn new(buf: &'a mut std::mem::MaybeUninit<[u8; N]>) -> Self {
        Stage { buf, init: 0 }
    }

    /// Reads at most `want` (<= N) bytes with one call: `read` when `flags` is 0, else
    /// `recv`. The kernel's answer.
    #[inline]
    pub fn read(&mut self, fd: c_int, want: usize, flags: c_int) -> isize {
        let want = want.min(N);
        let p = self.buf.as_mut_ptr() as *mut c_void;
        // SAFETY: the stage is writable for N >= want bytes; the kernel writes at most
        // `want` of them and says how many.
        let r = unsafe {
            if flags == 0 {
                real::read(fd, p, want)
            } else {
                real::recv(fd, p, want, flags)
            }
        };
        if r > 0 {
            self.init = self.init.max(r as usize);
        }
        r
    }

    /// The first `want` (<= N) bytes, zeroed first where nothing was written yet (for a
    /// call that needs a plain slice).
    pub fn zeroed(&mut self, want: usize) -> &mut [u8] {
        let want = want.min(N);
        let p = self.buf.as_mut_ptr() as *mut u8;
        if want > self.init {
            // SAFETY: inside the buffer.
            unsafe { std::ptr::write_bytes(p.add(self.init), 0, want - self.init) };
            self.init = want;
        }
        // SAFETY: the first `init >= want` bytes are initialised.
        unsafe { std::slice::from_raw_parts_mut(p, want) }
    }

    /// The first `n` bytes, which a read wrote (panics if fewer were).
    #[inline]
    pub fn filled(&mut self, n: usize) -> &mut [u8] {
        assert!(n <= self.init, "stage read past what was written");
        // SAFETY: the first `init >= n` bytes are initialised.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr() as *mut u8, n) }
    }
}
