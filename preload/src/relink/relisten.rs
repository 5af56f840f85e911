//! Listeners bound to a specific address, across a migration.
//!
//! CRIU restores a listening socket by binding it to its old address again, which fails on a
//! node that does not have that address, and the whole restore with it (it restores
//! `IP_FREEBIND` only after the bind, for IPv4). So the freeze puts a *placeholder* under
//! such a listener's descriptor (a listener on a loopback port that nobody connects to,
//! with the program's file flags and epoll registrations), and the thaw puts a real
//! listener back under it: on its old address when this node has it (a thaw in place), else
//! on the same port of every address of the new node. The program still sees its old
//! address (`getsockname` answers from the layer's table), the old node's agent forwards new
//! connections for that address here (`Moved`), and a thread that was blocked in `accept`
//! on the placeholder is woken and accepts on the new listener (the hook retries).

use crate::{log, sys};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

/// Listeners that only exist on this node's addresses: neither wildcard nor loopback.
fn specific_listeners() -> Vec<(i32, SocketAddr)> {
    crate::vc::listeners()
        .into_iter()
        .filter(|(_, a)| !a.ip().is_unspecified() && !a.ip().is_loopback())
        .collect()
}

/// Bumped each time a listener is put back under a descriptor: an `accept` that failed with
/// `EINVAL` meanwhile (its placeholder was shut down) is retried.
pub static GEN: AtomicU32 = AtomicU32::new(0);

/// A listening socket of `addr`'s family on `at`, with the file status flags of `like`.
fn listener_on(at: SocketAddr, backlog: i32, like: i32) -> Result<i32, i32> {
    let v6 = at.is_ipv6();
    let fam = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    let s = sys::fd::socket(fam, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
    if s < 0 {
        return Err(sys::errno());
    }
    sys::set_sockopt_int(s, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1);
    if v6 {
        let only = sys::sockopt_int(like, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY).unwrap_or(0);
        sys::set_sockopt_int(s, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, only);
    }
    let addr = sys::fd::RawAddr::ip(&at, v6);
    // Binds and listens; copies the file status flags (O_NONBLOCK above all) of the
    // program's descriptor.
    let ok = sys::fd::bind(s, &addr) == 0
        && sys::fd::listen(s, backlog) == 0
        && sys::fd::fcntl(s, libc::F_SETFL, sys::fd::fcntl(like, libc::F_GETFL, 0) as libc::c_ulong) == 0;
    if !ok {
        let e = sys::errno();
        crate::sys::fd::close(s);
        return Err(e);
    }
    Ok(s)
}

/// Before a checkpoint: a placeholder under every listener bound to a specific address;
/// returns those listeners.
pub fn before_checkpoint() -> Vec<(i32, SocketAddr)> {
    let mut swapped = Vec::new();
    for (fd, addr) in specific_listeners() {
        let lo = if addr.is_ipv6() {
            SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST), 0)
        } else {
            SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0)
        };
        match listener_on(lo, 0, fd) {
            Ok(ph) => {
                crate::sockswap::swap_socket(ph, fd);
                swapped.push((fd, addr));
            }
            Err(e) => log::warn(format_args!(
                "listener {addr}: no placeholder (errno {e}); a restore on a node without that address will fail"
            )),
        }
    }
    swapped
}

/// True when this node has `ip` (a socket can be bound to it).
fn is_local(ip: IpAddr) -> bool {
    let fam = if ip.is_ipv6() { libc::AF_INET6 } else { libc::AF_INET };
    let s = sys::fd::socket(fam, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
    if s < 0 {
        return true;
    }
    let ok = sys::fd::bind(s, &sys::fd::RawAddr::ip(&SocketAddr::new(ip, 0), ip.is_ipv6())) == 0;
    sys::fd::close(s);
    ok
}

/// After the thaw: a real listener back under each placeholder, on the old address if this
/// node has it, else on the same port of every address. Returns the listeners of the second
/// kind, for the node's agent to learn (once the process talks to it again).
pub fn after_thaw(swapped: &[(i32, SocketAddr)]) -> Vec<SocketAddr> {
    let mut everywhere = Vec::new();
    for &(fd, addr) in swapped {
        let here = is_local(addr.ip());
        let at = if here {
            addr
        } else if addr.is_ipv6() {
            SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), addr.port())
        } else {
            SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), addr.port())
        };
        let s = match listener_on(at, libc::SOMAXCONN, fd) {
            Ok(s) => s,
            Err(e) => {
                log::warn(format_args!(
                    "listener {addr}: cannot listen on {at} here (errno {e}); it accepts nothing until \
                     the process moves again"
                ));
                continue;
            }
        };
        // A copy of the placeholder, to wake threads blocked on it once it is replaced.
        let ph = sys::fd::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0);
        crate::sockswap::swap_socket(s, fd);
        GEN.fetch_add(1, SeqCst);
        if ph >= 0 {
            // Our copy of the placeholder: shutting it down ends any accept on it.
            sys::fd::shutdown(ph, libc::SHUT_RDWR);
            sys::fd::close(ph);
        }
        if !here {
            everywhere.push(at);
            log::info(format_args!(
                "listener {addr}: this node lacks that address; listening on port {} of every address \
                 (the program still sees {addr})",
                addr.port()
            ));
        }
    }
    everywhere
}
