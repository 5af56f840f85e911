//! Putting a new socket under the program's descriptor numbers (`dup3`), and the program's
//! epoll registrations of those descriptors: read from `/proc/self/fdinfo`, taken out while a
//! connection's link is rebuilt and made again on the new socket. Used by the control thread
//! (`relink`) and by a connection adopting a link another process rebuilt (`vc`).

use crate::{log, sys};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::*};

/// A registration of one of the program's descriptors with one of its epoll instances:
/// (epoll fd, fd, events, data).
pub type EpollReg = (i32, i32, u32, u64);

/// Epoll instances of this process: every one found by the first look through all its
/// descriptors, and every one the program registered a virtual connection with since
/// ([`note_epfd`], from its `epoll_ctl` calls). A rebuilt link then reads the `fdinfo` of
/// these only, not a link name per descriptor of the process: with N connections per
/// process a failover of them all would otherwise cost O(N²) system calls. Inherited with
/// the memory at `fork` (so are the instances); an exec starts with a look through all.
static EPFDS: crate::readiness::FdBits = crate::readiness::FdBits::new();
/// The first look was made.
static LOOKED: AtomicBool = AtomicBool::new(false);
/// An epoll instance beyond the bitmap was registered with: look through all every time.
static BEYOND: AtomicBool = AtomicBool::new(false);

/// The program registered a virtual connection with epoll instance `epfd`.
pub(crate) fn note_epfd(epfd: i32) {
    if epfd >= 0 && (epfd as usize) < crate::readiness::EPFD_BITS {
        EPFDS.set(epfd);
    } else {
        BEYOND.store(true, Relaxed);
    }
}

fn is_epoll(fd: i32) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok_and(|l| l.as_os_str() == "anon_inode:[eventpoll]")
}

/// The epoll instances to look at for a rebuilt link.
fn epoll_instances() -> Vec<i32> {
    let mut out = Vec::new();
    if LOOKED.load(Acquire) && !BEYOND.load(Relaxed) {
        EPFDS.each(|fd| out.push(fd));
        out.retain(|&fd| {
            let yes = is_epoll(fd);
            if !yes {
                EPFDS.clear(fd);
            }
            yes
        });
        return out;
    }
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return out };
    for e in dir.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if is_epoll(fd) {
            note_epfd(fd);
            out.push(fd);
        }
    }
    LOOKED.store(true, Release);
    out
}

/// What the fdinfo of each epoll instance listed, kept for a short while: reading it costs
/// time in proportion to everything registered with the instance (the kernel prints every
/// target, holding the instance's lock), so a failover of N connections registered with one
/// instance read it N times, O(N²). The layer keeps the copy in step with its own changes
/// (a socket taken out, the new one registered), and drops it when the program calls
/// `epoll_ctl` on a virtual connection ([`note_ctl`]) or after [`CACHE_MS`]. A one-shot
/// registration is always read afresh (the kernel disarms it when it fires, with no call).
///
/// Until a first copy is made ([`READ_ONCE`]), a program's `epoll_ctl` has no copy to make
/// stale and counts nothing: two atomic additions on one shared word per call, most of the
/// layer's cost of an event loop's registration changes, for a copy that most processes
/// never make.
struct Cache {
    gen: u64,
    at_ms: u64,
    by_epfd: HashMap<i32, Vec<substrate::procfs::EpollTarget>>,
}

static CACHE: std::sync::Mutex<Option<Cache>> = std::sync::Mutex::new(None);
static CTL_GEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Set (for good) before the first read of an instance's fdinfo for a copy: from then on
/// each `epoll_ctl` of a virtual connection counts in [`CTL_GEN`]. A change whose count it
/// skipped was made before this was set (its check comes after the kernel's change), so
/// before the read, and the copy holds it.
static READ_ONCE: AtomicBool = AtomicBool::new(false);
/// Longest use of a copy of an instance's fdinfo. (What the program changes without a call
/// the layer sees cannot make it wrong about the layer's sockets: a registration that
/// vanished with a closed descriptor names an inode no rebuilt link has.)
const CACHE_MS: u64 = 1000;

/// The program changed an epoll registration of a virtual connection (called after the
/// kernel's change).
#[inline]
pub(crate) fn note_ctl() {
    if READ_ONCE.load(SeqCst) {
        CTL_GEN.fetch_add(1, AcqRel);
    }
}

fn cache() -> std::sync::MutexGuard<'static, Option<Cache>> {
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The epoll registrations of the sockets under `fds`, read from `/proc/self/fdinfo` (the
/// kernel lists every epoll instance's targets with their events, data and inode), so the
/// program's `epoll_ctl` calls cost nothing extra.
pub(crate) fn epoll_regs(fds: &[i32]) -> Vec<EpollReg> {
    let mut inos = Vec::new();
    for &fd in fds {
        if let Some(st) = sys::fd::fstat(fd) {
            inos.push((fd, st.st_ino));
        }
    }
    let mut out = Vec::new();
    READ_ONCE.store(true, SeqCst);
    let (gen, now) = (CTL_GEN.load(SeqCst), sys::now_ms());
    let mut c = cache();
    let c = match &mut *c {
        Some(k) if k.gen == gen && now.saturating_sub(k.at_ms) < CACHE_MS => k,
        slot => slot.insert(Cache { gen, at_ms: now, by_epfd: HashMap::new() }),
    };
    let ours = |t: &substrate::procfs::EpollTarget| {
        inos.iter().any(|&(f, i)| f == t.fd && t.ino.is_none_or(|x| x == i))
    };
    for epfd in epoll_instances() {
        let fresh = match c.by_epfd.get(&epfd) {
            Some(ts) => ts.iter().any(|t| ours(t) && t.events & libc::EPOLLONESHOT as u32 != 0),
            None => true,
        };
        if fresh {
            let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{epfd}")) else {
                c.by_epfd.remove(&epfd);
                continue;
            };
            c.by_epfd.insert(epfd, substrate::procfs::parse_epoll_fdinfo(&info));
        }
        for t in c.by_epfd.get(&epfd).into_iter().flatten() {
            if ours(t) {
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
    if let Some(c) = cache().as_mut() {
        for r in &regs {
            if let Some(ts) = c.by_epfd.get_mut(&r.0) {
                ts.retain(|t| t.fd != r.1);
            }
        }
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
            continue;
        }
        let ino = sys::fd::fstat(fd).map(|st| st.st_ino);
        if let Some(ts) = cache().as_mut().and_then(|c| c.by_epfd.get_mut(&epfd)) {
            ts.retain(|t| t.fd != fd);
            ts.push(substrate::procfs::EpollTarget { fd, events, data, ino });
        }
    }
}

/// Puts the new socket `sock` under the program's descriptor `fd` (same number, its epoll
/// registrations made again) and closes our copy.
pub fn swap_socket(sock: i32, fd: i32) {
    let regs = epoll_detach(&[fd]);
    put_under(sock, &[fd]);
    sys::fd::close(sock);
    epoll_attach(&regs);
}

/// Puts socket `sock` under each of the program's descriptor numbers `fds`, keeping each
/// number's close-on-exec flag.
pub(crate) fn put_under(sock: i32, fds: &[i32]) {
    for &fd in fds {
        let cloexec = sys::fd::fcntl(fd, libc::F_GETFD, 0) & libc::FD_CLOEXEC != 0;
        // Replaces the program's descriptor with `sock` (same number).
        if sys::fd::dup3(sock, fd, if cloexec { libc::O_CLOEXEC } else { 0 }) < 0 {
            log::warn(format_args!("cannot put a socket under fd {fd}: errno {}", sys::errno()));
        }
    }
}
