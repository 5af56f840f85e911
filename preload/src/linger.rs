//! Closing a virtual connection without losing the peer's last bytes.
//!
//! The peer's layer sends acknowledgements that the program never reads. A kernel socket
//! closed with unread bytes, or one that receives bytes after it was closed, answers with a
//! reset, and a reset makes the *peer's* kernel drop whatever it had not delivered yet: the
//! tail of a download would vanish. So when a program closes the last descriptor of a
//! virtual connection, the layer keeps the socket a little longer: it sends the FIN at once
//! (the program's close means just that), then a background thread reads and discards what
//! still arrives until the peer closes too (or 30 s pass). At exit, the same happens inline
//! for every open virtual connection, for at most one second.

use crate::fdtable::{self, Entry};
use crate::{real, sys};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const LINGER: Duration = Duration::from_secs(30);
const EXIT_LINGER: Duration = Duration::from_secs(1);

struct Lingering {
    fds: Vec<(i32, Instant)>,
    thread: bool,
}

static LIST: Mutex<Lingering> = Mutex::new(Lingering { fds: Vec::new(), thread: false });

thread_local! {
    static FORK_GUARD: std::cell::RefCell<Option<MutexGuard<'static, Lingering>>> = const { std::cell::RefCell::new(None) };
}

fn lock() -> MutexGuard<'static, Lingering> {
    LIST.lock().unwrap_or_else(|e| e.into_inner())
}

/// Closes the program's descriptor `fd` of a virtual connection that no one else holds:
/// FIN now, drain until the peer's FIN in the background. Returns the result of the close.
pub fn close_last(fd: i32) -> i32 {
    // SAFETY: duplicates the program's descriptor for our own use.
    let keep = unsafe { real::fcntl(fd, libc::F_DUPFD_CLOEXEC, 700) };
    // SAFETY: the program's close.
    let r = unsafe { real::close(fd) };
    let e = sys::errno();
    if keep >= 0 {
        // SAFETY: our duplicate.
        unsafe { real::shutdown(keep, libc::SHUT_WR) };
        let mut l = lock();
        l.fds.push((keep, Instant::now() + LINGER));
        if !l.thread {
            l.thread = std::thread::Builder::new()
                .name("vmi-linger".into())
                .stack_size(64 << 10)
                .spawn(reaper)
                .is_ok();
            if !l.thread {
                // No thread: give up lingering rather than leak the socket.
                for (f, _) in l.fds.drain(..) {
                    // SAFETY: our duplicates.
                    unsafe { real::close(f) };
                }
            }
        }
    }
    sys::set_errno(e);
    r
}

/// Reads and discards; true when the peer closed (or the socket failed).
fn drain(fd: i32) -> bool {
    let mut buf = [0u8; 16384];
    loop {
        // SAFETY: reads into our own buffer.
        let r = unsafe { real::recv(fd, buf.as_mut_ptr() as *mut _, buf.len(), libc::MSG_DONTWAIT) };
        if r > 0 {
            continue;
        }
        return !(r < 0 && (sys::errno() == libc::EAGAIN || sys::errno() == libc::EINTR));
    }
}

fn reaper() {
    loop {
        let fds: Vec<i32> = lock().fds.iter().map(|f| f.0).collect();
        let mut p: Vec<libc::pollfd> =
            fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
        // SAFETY: valid pollfd array.
        unsafe { libc::poll(p.as_mut_ptr(), p.len() as _, 100) };
        let now = Instant::now();
        let mut l = lock();
        l.fds.retain(|&(fd, deadline)| {
            let done = p.iter().any(|q| q.fd == fd && q.revents != 0) && drain(fd) || now > deadline;
            if done {
                // SAFETY: our duplicate.
                unsafe { real::close(fd) };
            }
            !done
        });
    }
}

/// At exit: FIN on every virtual connection this process alone holds, then drain them and
/// the lingering ones until their peers close, for at most a second.
pub fn at_exit() {
    let mut fds: Vec<i32> = Vec::new();
    let mut done: Vec<*const crate::vc::Vc> = Vec::new();
    for (fd, e) in fdtable::snapshot() {
        if let Entry::Vc(v) = e {
            let p = std::sync::Arc::as_ptr(&v);
            if done.contains(&p) {
                continue;
            }
            done.push(p);
            // This process lets go; if it was the last, the connection ends here.
            if v.release() != 1 {
                v.hand_back_slot();
            } else {
                // SAFETY: the process is exiting; its sockets close anyway.
                unsafe { real::shutdown(fd, libc::SHUT_WR) };
                fds.push(fd);
            }
        }
    }
    if let Ok(l) = LIST.try_lock() {
        fds.extend(l.fds.iter().map(|f| f.0));
    }
    let deadline = Instant::now() + EXIT_LINGER;
    while !fds.is_empty() && Instant::now() < deadline {
        let mut p: Vec<libc::pollfd> =
            fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
        // SAFETY: valid pollfd array.
        unsafe { libc::poll(p.as_mut_ptr(), p.len() as _, 20) };
        fds.retain(|&fd| !(p.iter().any(|q| q.fd == fd && q.revents != 0) && drain(fd)));
    }
}

/// fork, prepare.
pub fn before_fork() {
    let g = lock();
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// fork, parent side.
pub fn after_fork_parent() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
}

/// fork, child side: the lingering sockets are the parent's business.
pub fn after_fork_child() {
    FORK_GUARD.with(|f| {
        if let Some(mut g) = f.borrow_mut().take() {
            for (fd, _) in g.fds.drain(..) {
                // SAFETY: the child's copies of the parent's lingering sockets.
                unsafe { real::close(fd) };
            }
            g.thread = false;
        }
    });
}
