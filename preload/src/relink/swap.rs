//! Swapping the socket under the program's descriptors: the old one parked under a
//! placeholder, the new one installed with the old one's flags, options and epoll
//! registrations.

use super::*;

/// Takes the old socket away from the program: its descriptors get a *placeholder* (a
/// listening socket on loopback, which never polls readable or writable, so `select` and
/// `poll` callers wait quietly instead of seeing the dead socket's error), its epoll
/// registrations are taken out, and the old socket is disconnected, which wakes any thread
/// blocked on it (that thread then waits for the new link, or says EAGAIN).
pub(super) fn kick(v: &Vc) {
    if v.parked() >= 0 {
        return;
    }
    let fds = crate::vc::fds_of(v);
    v.park_epoll(&fds);
    let Some(&fd0) = fds.first() else { return };
    // Our own handle on the old socket.
    let old = sys::fd::fcntl(fd0, libc::F_DUPFD_CLOEXEC, 700);
    let target = if old >= 0 { old } else { fd0 };
    // AF_UNSPEC: "disconnect" for TCP.
    let disconnect = || {
        sys::fd::connect(target, &sys::fd::RawAddr::unspec());
    };
    match placeholder(sys::tcp_family(fd0) == Some(libc::AF_INET6)) {
        Some(ph) => {
            // The program's settings wait on the placeholder (and change there if it sets
            // any). The old socket is disconnected while still under the descriptors, so
            // that threads in `poll` or `select` on it wake and wait again on the
            // placeholder (see `readiness::replace_under`).
            carry_state(fd0, ph);
            crate::readiness::replace_under(&fds, disconnect, || put_under(ph, &fds));
            v.set_parked(ph);
        }
        None => disconnect(),
    }
    if old >= 0 {
        crate::sys::fd::close(old);
    }
}

/// A socket that never polls readable or writable until it is shut down.
pub(super) fn placeholder(v6: bool) -> Option<i32> {
    let fam = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    let fd = sys::fd::socket(fam, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
    if fd < 0 {
        return None;
    }
    let lo: SocketAddr = if v6 { "[::1]:0".parse().ok()? } else { "127.0.0.1:0".parse().ok()? };
    let ok = sys::fd::bind(fd, &sys::fd::RawAddr::ip(&lo, v6)) == 0 && sys::fd::listen(fd, 0) == 0;
    if !ok {
        crate::sys::fd::close(fd);
        return None;
    }
    Some(crate::ownfd::move_high(fd))
}

/// Wakes whoever polls the placeholder (after the real socket took its place, or to show
/// the program a failed connection) and drops it.
pub(super) fn unpark(v: &Vc) {
    let ph = v.set_parked(-1);
    if ph >= 0 {
        // Our placeholder: shutting it down wakes its pollers, who look again at the
        // descriptor number (now the new socket).
        sys::fd::shutdown(ph, libc::SHUT_RDWR);
        sys::fd::close(ph);
    }
}

/// Socket options a program commonly sets, carried from the old socket to the new one.
pub(super) const CARRIED: &[(i32, i32)] = &[
    (libc::IPPROTO_TCP, libc::TCP_NODELAY),
    (libc::SOL_SOCKET, libc::SO_KEEPALIVE),
    (libc::SOL_SOCKET, libc::SO_RCVTIMEO),
    (libc::SOL_SOCKET, libc::SO_SNDTIMEO),
    (libc::SOL_SOCKET, libc::SO_LINGER),
    (libc::SOL_SOCKET, libc::SO_PRIORITY),
    (libc::SOL_SOCKET, libc::SO_RCVLOWAT),
    (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
    (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL),
    (libc::IPPROTO_TCP, libc::TCP_KEEPCNT),
    (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
];

/// Copies what the program set on socket `from` (non-blocking mode, common options) to `to`.
pub(super) fn carry_state(from: i32, to: i32) {
    for &(level, opt) in CARRIED {
        let mut buf = [0u8; 32];
        if let Some(len) = sys::fd::getsockopt_bytes(from, level, opt, &mut buf) {
            // The same bytes on the other socket.
            sys::fd::setsockopt_bytes(to, level, opt, &buf[..len]);
        }
    }
    let fl = sys::fd::fcntl(from, libc::F_GETFL, 0);
    if fl >= 0 {
        sys::fd::fcntl(to, libc::F_SETFL, (fl & libc::O_NONBLOCK) as libc::c_ulong);
    }
}

/// Puts the new socket `nfd` under every descriptor of `v` in this process. The caller
/// holds both halves' locks.
pub(super) fn install(v: &Vc, nfd: i32) {
    let c = v.mem().conn();
    let fds = crate::vc::fds_of(v);
    log::debug(format_args!(
        "virtual connection {:032x}: new link {:?} -> {:?} under fds {fds:?}",
        c.gid,
        sys::local_addr(nfd),
        sys::peer_addr(nfd)
    ));
    if let Some(&old) = fds.first() {
        // From the old socket, or the placeholder that took its options while it waited.
        carry_state(old, nfd);
    }
    if c.careful.load(Acquire) != 0 {
        // The peer codes its frames: a receive low-water mark on the old socket was the
        // layer's (a coded frame waited whole there), not the program's. The new link
        // starts at a frame boundary.
        // (What the new socket holds is not known: the old one's value was carried.)
        c.lowat.store(u32::MAX, Relaxed);
        crate::tcp_sink::set_lowat(v.mem(), nfd, 1);
    }
    // (The old socket's TCP options were the bells' if it was on shared memory.)
    v.link_tcp_options(nfd);
    // Threads in `poll` or `select` on the placeholder are woken by its shutdown while it
    // still stands under the descriptors, and wait again on the new socket (see
    // `readiness::replace_under`).
    let ph = v.set_parked(-1);
    crate::readiness::replace_under(
        &fds,
        || {
            if ph >= 0 {
                sys::fd::shutdown(ph, libc::SHUT_RDWR);
            }
        },
        || put_under(nfd, &fds),
    );
    crate::sys::fd::close(nfd);
    if ph >= 0 {
        crate::sys::fd::close(ph);
    }
    v.unpark_epoll();
    if let Some(&fd) = fds.first() {
        if let (Some(s), Some(l), Some(p)) = (v.slot(), sys::local_addr(fd), sys::peer_addr(fd)) {
            s.set_link(&l, &p);
        }
        c.link_pid.store(crate::pid(), Release);
        c.link_fd.store(fd, Release);
    }
    finish(v);
}

/// The new link is in place: wake the waiters; replay what the peer did not deliver and the
/// end of stream if the program shut its side down.
pub(super) fn finish(v: &Vc) {
    let c = v.mem().conn();
    c.link_down.store(0, Release);
    let gen = c.link_gen.fetch_add(1, AcqRel) + 1;
    v.seen_gen(gen);
    if let Some(s) = v.slot() {
        s.set_relinking(false, true);
    }
    sys::futex_wake(&c.link_gen, i32::MAX);
    if let Some(&fd) = crate::vc::fds_of(v).first() {
        // The caller holds the tx lock: push the replay now (the program may be waiting
        // for an answer to bytes only the replay carries).
        // After the peer's end of stream the new socket must read as ended too.
        if crate::tcp_sink::peer_fin(v.mem()) {
            crate::sys::fd::shutdown(fd, libc::SHUT_RD);
        }
        if c.tx_shut.load(Acquire) != 0 {
            // The program shut its side down: the new link says so too, after the replay.
            c.fin_owed.store(1, Release);
        }
        if !v.replay_now(fd) {
            REPLAYING.store(1, Relaxed);
            wake();
        }
    }
}
