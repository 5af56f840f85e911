//! The program's epoll registrations of a connection's socket: taken out while its link
//! is rebuilt and made again on the new socket.

use super::*;

/// A registration of one of the program's descriptors with one of its epoll instances:
/// (epoll fd, fd, events, data).
pub type EpollReg = (i32, i32, u32, u64);

/// The epoll registrations of the sockets under `fds`, read from `/proc/self/fdinfo` (the
/// kernel lists every epoll instance's targets with their events, data and inode), so the
/// program's `epoll_ctl` calls cost nothing extra.
pub(super) fn epoll_regs(fds: &[i32]) -> Vec<EpollReg> {
    let mut inos = Vec::new();
    for &fd in fds {
        if let Some(st) = sys::fd::fstat(fd) {
            inos.push((fd, st.st_ino));
        }
    }
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return out };
    for e in dir.flatten() {
        let Some(epfd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if !std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:[eventpoll]") {
            continue;
        }
        let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{epfd}")) else { continue };
        for t in substrate::procfs::parse_epoll_fdinfo(&info) {
            if inos.iter().any(|&(f, i)| f == t.fd && t.ino.is_none_or(|x| x == i)) {
                out.push((epfd, t.fd, t.events, t.data));
            }
        }
    }
    out
}

/// Takes the sockets under `fds` out of the program's epoll instances; returns what to
/// register again later.
pub(crate) fn epoll_detach(fds: &[i32]) -> Vec<EpollReg> {
    let regs = epoll_regs(fds);
    for r in &regs {
        // Removes the old socket from the program's epoll instance.
        sys::fd::epoll_ctl(r.0, libc::EPOLL_CTL_DEL, r.1, None);
    }
    regs
}

/// Registers the descriptors again, with the program's events and data.
pub(crate) fn epoll_attach(regs: &[EpollReg]) {
    for &(epfd, fd, events, data) in regs {
        let mut ev = libc::epoll_event { events, u64: data };
        // The socket now under `fd`, with the program's events and data.
        if sys::fd::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, Some(&mut ev)) != 0 {
            log::warn(format_args!(
                "cannot register fd {fd} again with epoll fd {epfd}: errno {}",
                sys::errno()
            ));
        }
    }
}
