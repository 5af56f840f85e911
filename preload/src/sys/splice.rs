//! Sending from the replay ring without the kernel's copy.
//!
//! The bytes of a large frame are copied once, from the program into the replay ring, and the
//! kernel takes them from the ring by reference: the ring's pages go into a pipe (`vmsplice`)
//! and from the pipe into the socket (`splice`). The kernel never says when it lets go of such
//! pages, so the ring may reuse the space only once the peer's layer acknowledged the bytes (by
//! then the receiving side's copy has run), and where the sender must reuse it without that
//! acknowledgement it first takes the pages out of the ring ([`release_ring`]): the kernel
//! keeps the old pages, the ring gets new ones.
//!
//! The pipes are the process's own: a few, kept at high numbers and protected from a program
//! that closes every descriptor, each used by one call at a time and always empty between
//! calls (what the socket did not take is thrown away: the caller sends it again from the
//! ring). A fork child makes its own on first use.

use super::process;
use libc::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering::*};
use std::sync::OnceLock;

/// Pipes per process: calls that find every one in use send as before (with the copy).
const PIPES: usize = 4;
/// Pipe size asked for: room for a chunk of 64 KiB (16 pages, chunks end at 64 KiB
/// boundaries of memory) and some to spare.
const PIPE_BYTES: usize = 128 << 10;
/// Most payload bytes one `vmsplice` puts in the pipe.
const CHUNK: usize = 64 << 10;
const PAGE: usize = 4096;

struct Slot {
    busy: AtomicBool,
    /// The process that made the pipe (0: none yet).
    pid: AtomicI32,
    r: AtomicI32,
    w: AtomicI32,
    /// Payload bytes one chunk may have, from the pipe's size.
    chunk: AtomicUsize,
}

struct Pool {
    slots: [Slot; PIPES],
    null: AtomicI32,
    null_pid: AtomicI32,
}

static POOL: OnceLock<Pool> = OnceLock::new();
/// Set until `VMI_SPLICE=1` turns splicing on, and when the kernel or a sandbox refuses these
/// calls (never tried again then).
static OFF: AtomicBool = AtomicBool::new(true);

fn pool() -> &'static Pool {
    POOL.get_or_init(|| Pool {
        slots: std::array::from_fn(|_| Slot {
            busy: AtomicBool::new(false),
            pid: AtomicI32::new(0),
            r: AtomicI32::new(-1),
            w: AtomicI32::new(-1),
            chunk: AtomicUsize::new(0),
        }),
        null: AtomicI32::new(-1),
        null_pid: AtomicI32::new(0),
    })
}

/// Calls `f` on each place that names one of the pool's descriptors (the layer keeps them
/// from a program that closes every descriptor, and moves them out of the way of `dup2`).
pub fn each_fd(mut f: impl FnMut(&'static AtomicI32)) {
    if let Some(p) = POOL.get() {
        for s in &p.slots {
            f(&s.r);
            f(&s.w);
        }
        f(&p.null);
    }
}

/// `fd` moved to a high number, close-on-exec.
fn high(fd: c_int) -> c_int {
    let n = super::fd::fcntl(fd, libc::F_DUPFD_CLOEXEC, 700);
    if n < 0 {
        return fd;
    }
    super::fd::close(fd);
    n
}

/// Set by `VMI_SPLICE=auto`: only the send calls that begin with every byte acknowledged
/// splice ([`only_when_idle`]).
static WHEN_IDLE: AtomicBool = AtomicBool::new(false);

/// Splice in this process (`VMI_SPLICE=1`), or (`when_idle`, `VMI_SPLICE=auto`) only in send
/// calls that begin with nothing unacknowledged.
pub fn turn_on(when_idle: bool) {
    WHEN_IDLE.store(when_idle, Relaxed);
    OFF.store(false, Relaxed);
}

/// True when only the send calls that begin with every byte acknowledged splice: a program
/// whose large message waits for its answer (MPI's ping-pong, a request) gains the copy the
/// kernel would make on its critical path, while a sender streaming ahead of its receiver
/// (whose kernel pays more for pages by reference than the copy costs) keeps copying.
#[inline]
pub fn only_when_idle() -> bool {
    WHEN_IDLE.load(Relaxed)
}

/// True while splicing may be tried at all.
#[inline]
pub fn available() -> bool {
    !OFF.load(Relaxed) && !super::gate::active()
}

/// A pipe of the pool, held for one send.
pub struct Pipe {
    slot: &'static Slot,
    r: c_int,
    w: c_int,
    chunk: usize,
}

impl Drop for Pipe {
    fn drop(&mut self) {
        self.slot.busy.store(false, Release);
    }
}

/// A free pipe of the process's pool (made now if this process has none in that place);
/// `None` when all are in use or pipes cannot be made.
pub fn take() -> Option<Pipe> {
    if !available() {
        return None;
    }
    let pid = process::pid();
    if pid == 0 {
        return None;
    }
    let pool = pool();
    for slot in &pool.slots {
        if slot.busy.compare_exchange(false, true, Acquire, Relaxed).is_err() {
            continue;
        }
        if slot.pid.load(Relaxed) != pid && !remake(slot, pid) {
            slot.busy.store(false, Release);
            return None;
        }
        let (r, w) = (slot.r.load(Acquire), slot.w.load(Acquire));
        return Some(Pipe { slot, r, w, chunk: slot.chunk.load(Relaxed) });
    }
    None
}

/// Makes the slot's pipe for this process (a fork child closes its copy of the parent's).
fn remake(slot: &Slot, pid: i32) -> bool {
    for end in [&slot.r, &slot.w] {
        let fd = end.swap(-1, AcqRel);
        if fd >= 0 {
            super::fd::close(fd);
        }
    }
    let mut fds = [-1; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
        if matches!(super::errno(), libc::ENOSYS | libc::EPERM | libc::EACCES) {
            OFF.store(true, Relaxed);
        }
        return false;
    }
    // SAFETY: integer arguments only (straight to the kernel, not through the layer's hook).
    let _ = unsafe { libc::syscall(libc::SYS_fcntl, fds[1], libc::F_SETPIPE_SZ, PIPE_BYTES) };
    // SAFETY: as above.
    let size = unsafe { libc::syscall(libc::SYS_fcntl, fds[1], libc::F_GETPIPE_SZ, 0) };
    // Room for a chunk and three pages to spare (a pipe made smaller than asked for).
    let pages = (size.max(0) as usize / PAGE).saturating_sub(3);
    if pages == 0 {
        super::fd::close(fds[0]);
        super::fd::close(fds[1]);
        OFF.store(true, Relaxed);
        return false;
    }
    // (A power of two, so that chunks can end at multiples of it.)
    let chunk = (pages * PAGE).min(CHUNK);
    slot.chunk.store(1 << (usize::BITS - 1 - chunk.leading_zeros()), Relaxed);
    slot.r.store(high(fds[0]), Release);
    slot.w.store(high(fds[1]), Release);
    slot.pid.store(pid, Relaxed);
    true
}

/// `/dev/null`, where bytes the socket did not take leave the pipe (-1: none here).
fn null_fd() -> c_int {
    let pool = pool();
    let pid = process::pid();
    if pool.null_pid.load(Acquire) == pid {
        return pool.null.load(Acquire);
    }
    // (A fork child shares the parent's open description, which is as good.)
    let mut fd = pool.null.load(Acquire);
    if fd < 0 {
        let n = super::fd::open(c"/dev/null", libc::O_WRONLY | libc::O_CLOEXEC);
        if n >= 0 {
            fd = high(n);
            if pool.null.compare_exchange(-1, fd, AcqRel, Acquire).is_err() {
                super::fd::close(fd);
                fd = pool.null.load(Acquire);
            }
        }
    }
    pool.null_pid.store(pid, Release);
    fd
}

/// Empties the pipe; a pipe that cannot be emptied is closed (made again at its next use).
fn drain(p: &Pipe, mut left: usize) {
    let null = null_fd();
    while left > 0 && null >= 0 {
        // SAFETY: null offsets; descriptors only.
        let n = unsafe {
            libc::splice(p.r, std::ptr::null_mut(), null, std::ptr::null_mut(), left, libc::SPLICE_F_NONBLOCK)
        };
        if n <= 0 {
            break;
        }
        left -= (n as usize).min(left);
    }
    if left > 0 {
        p.slot.pid.store(0, Relaxed);
    }
}

fn sigpipe_set() -> libc::sigset_t {
    // SAFETY: a plain value, filled by the calls below.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
    }
    set
}

/// Blocks SIGPIPE in this thread; `None` when the program had it blocked already (then a
/// SIGPIPE of ours could not be told from one of its own: the caller does not splice).
fn block_sigpipe() -> Option<libc::sigset_t> {
    let set = sigpipe_set();
    // SAFETY: plain value, filled by the call.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: both sets are valid; the kernel's sigset size.
    let r = unsafe { libc::syscall(libc::SYS_rt_sigprocmask, libc::SIG_BLOCK, &set, &mut old, 8) };
    if r != 0 {
        return None;
    }
    // SAFETY: `old` is a valid sigset_t.
    if unsafe { libc::sigismember(&old, libc::SIGPIPE) } == 1 {
        return None;
    }
    Some(old)
}

/// Takes back a SIGPIPE our `splice` raised (a socket whose peer is gone), then restores
/// the thread's mask.
fn unblock_sigpipe(old: &libc::sigset_t, failed: bool) {
    if failed {
        let set = sigpipe_set();
        let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: valid set and time-out; no info wanted.
        let _ = unsafe {
            libc::syscall(libc::SYS_rt_sigtimedwait, &set, std::ptr::null_mut::<c_void>(), &zero, 8)
        };
    }
    // SAFETY: a valid set; no old set wanted.
    let _ = unsafe {
        libc::syscall(libc::SYS_rt_sigprocmask, libc::SIG_SETMASK, old, std::ptr::null_mut::<c_void>(), 8)
    };
}

/// Sends `head` (copied) and then the bytes of `parts` (by reference: they must stay
/// unchanged until the peer has them) on the stream socket `fd`, as one write would, a chunk
/// at a time. `more`: the caller's `MSG_MORE`. Returns what the socket took (header bytes
/// included), or -1 with errno; `None` when nothing was tried (the caller sends another
/// way).
pub fn send(p: &Pipe, fd: c_int, head: &[u8], parts: [&[u8]; 2], more: bool) -> Option<isize> {
    let old = block_sigpipe()?;
    let mut taken = 0usize;
    let mut err = 0;
    let total: usize = parts.iter().map(|x| x.len()).sum();
    let mut at = 0usize; // payload bytes put into the pipe so far
    if !head.is_empty() {
        // The header by copy, as the start of the socket's next packet: a small fragment of
        // a page of its own among the ring's pages makes the kernel cut the stream into
        // packets about half as large.
        let n = super::fd::send(fd, head, libc::MSG_MORE | libc::MSG_NOSIGNAL);
        if n < 0 {
            unblock_sigpipe(&old, false);
            return Some(-1);
        }
        taken = n as usize;
        if taken < head.len() {
            unblock_sigpipe(&old, false);
            return Some(n);
        }
    }
    while at < total {
        // The next chunk of the payload, in at most two pieces of the two parts.
        // Chunks end at multiples of the chunk size in memory: a chunk then spans whole
        // pages only (16 at most: one packet's worth of fragments), where an unaligned one
        // would span 17 and the kernel would cut a small packet off each.
        let next = piece_at(&parts, at).map_or(0, |p| p as usize);
        let want = (total - at).min(p.chunk - next % p.chunk);
        let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 2];
        let mut n_iov = 0;
        let (mut skip, mut need) = (at, want);
        for part in parts {
            if need == 0 {
                break;
            }
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            let piece = &part[skip..(skip + need).min(part.len())];
            skip = 0;
            need -= piece.len();
            iov[n_iov] = libc::iovec { iov_base: piece.as_ptr() as *mut c_void, iov_len: piece.len() };
            n_iov += 1;
        }
        // SAFETY: every iovec points into memory the caller lends for this call.
        let m = unsafe { libc::vmsplice(p.w, iov.as_ptr(), n_iov, libc::SPLICE_F_NONBLOCK) };
        if m <= 0 {
            // (The pipe is empty here: every chunk before went whole.)
            if taken == 0 {
                if m < 0 && matches!(super::errno(), libc::ENOSYS | libc::EPERM | libc::EINVAL) {
                    OFF.store(true, Relaxed);
                }
                unblock_sigpipe(&old, false);
                return None;
            }
            // (Later: what went stays sent; the caller sends the rest its way.)
            break;
        }
        let in_pipe = m as usize;
        at += in_pipe;
        let flags = if more || at < total { libc::SPLICE_F_MORE } else { 0 };
        // SAFETY: null offsets; descriptors only.
        let k = unsafe { libc::splice(p.r, std::ptr::null_mut(), fd, std::ptr::null_mut(), in_pipe, flags) };
        if k < 0 {
            err = super::errno();
            drain(p, in_pipe);
            break;
        }
        taken += k as usize;
        if (k as usize) < in_pipe {
            // The socket is full (or a signal came): the rest goes again from the ring.
            drain(p, in_pipe - k as usize);
            break;
        }
    }
    // (A socket that fails in the middle of a call answers with what it took, and the
    // SIGPIPE is raised all the same: any call cut short may have one.)
    unblock_sigpipe(&old, err != 0 || taken < head.len() + total);
    if taken == 0 && err != 0 {
        super::set_errno(err);
        return Some(-1);
    }
    Some(taken as isize)
}

/// The address of payload byte `at` of `parts`.
fn piece_at(parts: &[&[u8]; 2], mut at: usize) -> Option<*const u8> {
    for part in parts {
        if at < part.len() {
            return Some(part[at..].as_ptr());
        }
        at -= part.len();
    }
    None
}

/// Gives the ring new pages (the kernel keeps the old ones for what it still holds): for a
/// ring whose space is reused without the peer's acknowledgement of what was spliced from it.
/// False when the memory could not be replaced.
pub fn release_ring(ring: &mut [u8]) -> bool {
    let start = ring.as_mut_ptr() as usize;
    let len = (ring.len() + PAGE - 1) & !(PAGE - 1);
    if !start.is_multiple_of(PAGE) || len == 0 {
        return false;
    }
    // SAFETY: the ring's own pages (its mapping is page aligned and runs to a page's end);
    // afterwards they read as zero, which is all the caller expects of free ring space.
    if unsafe { libc::madvise(start as *mut c_void, len, libc::MADV_REMOVE) } == 0 {
        return true;
    }
    // A private mapping (`SharedMap::forget_contents`) cannot be punched; dropping its pages
    // does the same there (and only there: a shared mapping's pages would come back).
    // SAFETY: as above.
    super::errno() == libc::EINVAL
        && unsafe { libc::madvise(start as *mut c_void, len, libc::MADV_DONTNEED) } == 0
}

/// In a fork child: pipes that the parent's other threads held at the fork are free here
/// (no thread of the child holds them); each is made again at its first use.
pub fn after_fork_child() {
    if let Some(p) = POOL.get() {
        for s in &p.slots {
            s.busy.store(false, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;

    fn pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let c = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        (c, s)
    }

    #[test]
    fn what_a_full_socket_refuses_is_not_counted_and_the_stream_stays_whole() {
        turn_on(false);
        let (c, s) = pair();
        c.set_nonblocking(true).expect("nonblocking");
        for (fd, opt) in [(c.as_raw_fd(), libc::SO_SNDBUF), (s.as_raw_fd(), libc::SO_RCVBUF)] {
            let v: c_int = 32 << 10;
            // SAFETY: an int option, its size.
            unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, opt, &v as *const c_int as *const c_void, 4) };
        }
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 + i / 4093) as u8).collect();
        // A slow reader: the socket fills, and calls are cut short or refused.
        let reader = std::thread::spawn(move || {
            let mut s = s;
            let mut got = Vec::new();
            let mut buf = vec![0u8; 50_000];
            loop {
                std::thread::sleep(std::time::Duration::from_micros(200));
                let n = s.read(&mut buf).expect("read");
                if n == 0 {
                    return got;
                }
                got.extend_from_slice(&buf[..n]);
            }
        });
        let (mut sent, mut short) = (0, 0);
        while sent < data.len() {
            // A "frame" of up to 200,000 bytes: 10 copied, the rest lent in two pieces.
            let frame = &data[sent..(sent + 200_000).min(data.len())];
            let (head, body) = frame.split_at(10.min(frame.len()));
            let (x, y) = body.split_at(body.len() / 3);
            let p = take().expect("a pipe");
            let r = send(&p, c.as_raw_fd(), head, [x, y], false).expect("tried");
            drop(p);
            if r < 0 {
                assert_eq!(super::super::errno(), libc::EAGAIN);
                std::thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            short += usize::from((r as usize) < frame.len());
            sent += r as usize;
        }
        drop(c);
        let got = reader.join().expect("reader");
        assert!(short > 0, "the socket never cut a call short: the case was not reached");
        assert_eq!(got.len(), data.len());
        assert!(got == data, "the stream differs");
    }

    #[test]
    fn a_dead_peer_gives_epipe_and_no_sigpipe() {
        turn_on(false);
        // SIGPIPE at its default action: one that escaped the call would end this process.
        // SAFETY: setting a signal's disposition to its default.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let (c, s) = pair();
        drop(s);
        let buf = vec![7u8; 256 << 10];
        let mut last = 0;
        for _ in 0..200 {
            let p = take().expect("a pipe");
            let r = send(&p, c.as_raw_fd(), b"head", [&buf, &[]], false).expect("tried");
            if r < 0 {
                last = super::super::errno();
                if last == libc::EPIPE {
                    break;
                }
            }
        }
        assert_eq!(last, libc::EPIPE);
        // Nothing left pending either.
        // SAFETY: plain value filled by the call.
        let mut pend: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: a valid set.
        unsafe { libc::sigpending(&mut pend) };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::sigismember(&pend, libc::SIGPIPE) }, 0);
    }
}
