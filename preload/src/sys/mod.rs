//! Small safe wrappers over the system calls the layer makes for itself.

pub mod cell;
pub mod copy;
pub mod entry;
pub mod fd;
pub mod gate;
pub mod packet;
pub mod plugin;
pub mod process;
pub mod prog;
pub mod real;
pub mod shared;
pub mod splice;

use libc::{c_int, sockaddr, sockaddr_in, sockaddr_in6, sockaddr_storage, socklen_t};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// An errno value: the one error type the C entry points turn into the program's errno
/// ([`entry`] is the only place that sets it for the program).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Errno(pub c_int);

impl Errno {
    /// The calling thread's errno now (right after a failed call).
    #[inline]
    pub fn last() -> Errno {
        Errno(errno())
    }
}

/// A libc-style result (negative: failed, errno says why) as a `Result`, with errno read
/// right after the call.
#[inline]
pub fn cvt<T: Copy + Default + PartialOrd>(r: T) -> Result<T, Errno> {
    if r < T::default() {
        Err(Errno::last())
    } else {
        Ok(r)
    }
}

/// The calling thread's errno.
pub fn errno() -> c_int {
    // SAFETY: __errno_location always returns the thread's errno slot.
    unsafe { *libc::__errno_location() }
}

/// Sets the calling thread's errno.
pub fn set_errno(e: c_int) {
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = e }
}

/// Reads a socket address given by the program.
///
/// # Safety
/// `addr` must be valid for `len` bytes (or null).
pub unsafe fn from_raw(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: at least the family field is readable.
    let family = unsafe { (*addr).sa_family } as c_int;
    match family {
        libc::AF_INET if len as usize >= std::mem::size_of::<sockaddr_in>() => {
            // SAFETY: length checked; sockaddr_in has no alignment above 4 and we copy it.
            let a = unsafe { std::ptr::read_unaligned(addr as *const sockaddr_in) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<sockaddr_in6>() => {
            // SAFETY: length checked; copied out unaligned.
            let a = unsafe { std::ptr::read_unaligned(addr as *const sockaddr_in6) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            let port = u16::from_be(a.sin6_port);
            // An IPv4-mapped address is the IPv4 peer it stands for.
            Some(match ip.to_ipv4_mapped() {
                Some(v4) => SocketAddr::V4(SocketAddrV4::new(v4, port)),
                None => SocketAddr::V6(SocketAddrV6::new(ip, port, a.sin6_flowinfo, a.sin6_scope_id)),
            })
        }
        _ => None,
    }
}

/// Builds a raw socket address of the given family.
pub fn to_raw(a: &SocketAddr, v6_socket: bool) -> (sockaddr_storage, socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut st: sockaddr_storage = unsafe { std::mem::zeroed() };
    let ip6 = match (a.ip(), v6_socket) {
        (IpAddr::V4(v4), false) => {
            let sin = sockaddr_in {
                sin_family: libc::AF_INET as _,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(v4).to_be() },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            unsafe { std::ptr::write(&mut st as *mut _ as *mut sockaddr_in, sin) };
            return (st, std::mem::size_of::<sockaddr_in>() as socklen_t);
        }
        (IpAddr::V4(v4), true) => v4.to_ipv6_mapped(),
        (IpAddr::V6(v6), _) => v6,
    };
    let sin6 = sockaddr_in6 {
        sin6_family: libc::AF_INET6 as _,
        sin6_port: a.port().to_be(),
        sin6_flowinfo: 0,
        sin6_addr: libc::in6_addr { s6_addr: ip6.octets() },
        sin6_scope_id: 0,
    };
    // SAFETY: as above, for sockaddr_in6.
    unsafe { std::ptr::write(&mut st as *mut _ as *mut sockaddr_in6, sin6) };
    (st, std::mem::size_of::<sockaddr_in6>() as socklen_t)
}

fn name_of(fd: c_int, peer: bool) -> Option<SocketAddr> {
    // SAFETY: zeroed storage is valid; the kernel fills at most `len` bytes.
    let mut st: sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<sockaddr_storage>() as socklen_t;
    let p = &mut st as *mut _ as *mut sockaddr;
    // SAFETY: valid pointers to owned storage.
    let r = unsafe {
        if peer {
            crate::sys::real::getpeername(fd, p, &mut len)
        } else {
            crate::sys::real::getsockname(fd, p, &mut len)
        }
    };
    if r != 0 {
        return None;
    }
    // SAFETY: the kernel wrote `len` bytes.
    unsafe { from_raw(p, len) }
}

/// The socket's local address.
pub fn local_addr(fd: c_int) -> Option<SocketAddr> {
    if !gate::allows_nr(libc::SYS_getsockname) {
        return None;
    }
    name_of(fd, false)
}

/// The socket's peer address.
pub fn peer_addr(fd: c_int) -> Option<SocketAddr> {
    if !gate::allows_nr(libc::SYS_getpeername) {
        return None;
    }
    name_of(fd, true)
}

/// An int socket option.
pub fn sockopt_int(fd: c_int, level: c_int, opt: c_int) -> Option<c_int> {
    if !gate::allows_nr(libc::SYS_getsockopt) {
        return None;
    }
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: valid pointers to a local int.
    let r = unsafe { real::getsockopt(fd, level, opt, &mut v as *mut _ as *mut _, &mut len) };
    (r == 0).then_some(v)
}

/// Sets an int socket option; true on success.
pub fn set_sockopt_int(fd: c_int, level: c_int, opt: c_int, v: c_int) -> bool {
    // SAFETY: a valid pointer to a local int of the option's size.
    unsafe {
        real::setsockopt(fd, level, opt, &v as *const c_int as *const _, std::mem::size_of::<c_int>() as _)
            == 0
    }
}

/// Sets SO_LINGER.
pub fn set_linger(fd: c_int, l: libc::linger) {
    // SAFETY: a valid pointer to a local linger.
    unsafe {
        real::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const _ as *const _,
            std::mem::size_of_val(&l) as _,
        )
    };
}

/// Sets both time-outs (SO_RCVTIMEO, SO_SNDTIMEO) of socket `fd` to `ms` milliseconds.
pub fn set_timeouts(fd: c_int, ms: i64) {
    let tv = libc::timeval { tv_sec: (ms / 1000) as _, tv_usec: ((ms % 1000) * 1000) as _ };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: valid pointer to a local timeval.
        unsafe {
            real::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                &tv as *const _ as *const _,
                std::mem::size_of_val(&tv) as _,
            )
        };
    }
}

/// Sleeps while `word` (in memory other processes may share: no FUTEX_PRIVATE_FLAG) holds
/// `val`, at most `ms` milliseconds (forever if negative). Returns the system call's result.
pub fn futex_wait(word: &std::sync::atomic::AtomicU32, val: u32, ms: i64) -> i64 {
    if !gate::allows_nr(libc::SYS_futex) {
        gate::pause_us(ms.clamp(0, 1) as u64 * 1000);
        return 0;
    }
    let ts = libc::timespec { tv_sec: ms / 1000, tv_nsec: (ms % 1000) * 1_000_000 };
    let tsp = if ms >= 0 { &ts as *const libc::timespec } else { std::ptr::null() };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, val, tsp, 0usize, 0u32) }
}

/// Wakes up to `n` waiters on `word`.
pub fn futex_wake(word: &std::sync::atomic::AtomicU32, n: i32) {
    if !gate::allows_nr(libc::SYS_futex) {
        // (Waiters look again within a millisecond: see futex_wait.)
        return;
    }
    // SAFETY: as above; FUTEX_WAKE takes no timeout.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, n, 0usize, 0usize, 0u32) };
}

/// Room for one passed descriptor in a message's control data.
pub type FdCmsg = [u64; 4];

/// Makes `msg` carry descriptor `fd` (SCM_RIGHTS) in `cbuf`, which must outlive the send.
pub fn attach_fd(msg: &mut libc::msghdr, cbuf: &mut FdCmsg, fd: c_int) {
    msg.msg_control = cbuf.as_mut_ptr() as *mut _;
    // SAFETY: CMSG_SPACE is a pure computation; the buffer holds one int's message.
    unsafe {
        msg.msg_controllen = libc::CMSG_SPACE(4) as _;
        let c = libc::CMSG_FIRSTHDR(msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut c_int, fd);
    }
}

/// Receives into `buf` (`recvmsg` with `flags` and close-on-exec for a passed descriptor):
/// the kernel's answer, and the descriptor that rode with the bytes, if any.
pub fn recv_with_fd(s: c_int, buf: &mut [u8], flags: c_int) -> (isize, Option<c_int>) {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut _, iov_len: buf.len() };
    let mut cbuf: FdCmsg = [0; 4];
    // SAFETY: zeroed msghdr is valid; its fields point at live locals.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut _;
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: msg is valid for the call.
    let r = unsafe { crate::sys::real::recvmsg(s, &mut msg, flags | libc::MSG_CMSG_CLOEXEC) };
    (r, if r >= 0 { passed_fd(&msg) } else { None })
}

/// The descriptor a received `msg` carried, if any.
pub fn passed_fd(msg: &libc::msghdr) -> Option<c_int> {
    // SAFETY: walking the control messages the kernel wrote into the buffer `msg` names.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                return Some(std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const c_int));
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    None
}

/// Family of a TCP socket (AF_INET or AF_INET6), or `None` if `fd` is anything else.
pub fn tcp_family(fd: c_int) -> Option<c_int> {
    // (A TCP socket is always of type SOCK_STREAM: the protocol says both.)
    if sockopt_int(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL)? != libc::IPPROTO_TCP {
        return None;
    }
    let fam = sockopt_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN)?;
    matches!(fam, libc::AF_INET | libc::AF_INET6).then_some(fam)
}

/// True if `fd` is a TCP socket (of either IP family: a TCP socket's family is asked of the
/// kernel with its address by callers that need it, one call less than [`tcp_family`]).
pub fn is_tcp(fd: c_int) -> bool {
    sockopt_int(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// True if the descriptor is in non-blocking mode.
pub fn nonblocking(fd: c_int) -> bool {
    gate::nonblocking(fd)
}

/// `N` random bytes from the kernel (one call as a rule).
pub fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let mut got = 0;
    while got < N {
        // SAFETY: writes into the rest of `b`.
        let r = unsafe { libc::getrandom(b[got..].as_mut_ptr() as *mut _, N - got, 0) };
        if r > 0 {
            got += r as usize;
        } else if errno() != libc::EINTR {
            // Fall back to time and address entropy; GIDs stay unique, if less secret.
            let t = now_ns() as u128 ^ ((&b as *const _ as usize as u128) << 64);
            for (i, c) in b.chunks_mut(16).enumerate() {
                let v = (t ^ ((i as u128) << 32)).to_le_bytes();
                c.copy_from_slice(&v[..c.len()]);
            }
            return b;
        }
    }
    b
}

/// 16 random bytes from the kernel.
pub fn random16() -> [u8; 16] {
    random()
}

/// Monotonic time in nanoseconds.
pub fn now_ns() -> u64 {
    // SAFETY: zeroed timespec filled by the kernel.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall-clock microseconds since the epoch.
pub fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Wall-clock milliseconds since the epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The kernel's TCP_INFO for a socket.
pub fn tcp_info(fd: c_int) -> Option<libc::tcp_info> {
    if !gate::allows_nr(libc::SYS_getsockopt) {
        return None;
    }
    // SAFETY: zeroed tcp_info is valid; the kernel fills at most `len` bytes.
    let mut ti: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: valid pointers to locals.
    let r = unsafe {
        real::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut ti as *mut _ as *mut _, &mut len)
    };
    (r == 0).then_some(ti)
}

/// Monotonic time in milliseconds.
pub fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

/// Monotonic microseconds.
pub fn now_us() -> u64 {
    now_ns() / 1_000
}

/// A random 128-bit number.
pub fn random_u128() -> u128 {
    u128::from_le_bytes(random16())
}

/// Waits up to `ms` for `events` on `fd`.
pub fn wait_fd(fd: c_int, events: i16, ms: c_int) -> i16 {
    if gate::active() {
        return gate::poll_one(fd, events, ms).unwrap_or_else(|| {
            gate::pause_us(ms.clamp(0, 1) as u64 * 1000);
            0
        });
    }
    let mut p = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: one valid pollfd.
    let r = unsafe { crate::sys::real::poll(&mut p, 1, ms) };
    if r > 0 {
        p.revents
    } else {
        0
    }
}
