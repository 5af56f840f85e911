//! What the connections below and the wait calls above ([`crate::ready`]) share: what a
//! readable report of a virtual connection means, and which shared-memory connections an
//! epoll instance scans itself, with whether a thread may be asleep on them (a receive that
//! leaves a scanned ring need not ring the writer's bell unless one is).

use libc::c_int;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering::*};

/// What a readable report of a virtual connection means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Truth {
    /// Payload, the end of the stream or an error waits: report it.
    Readable,
    /// Only the layer's own bytes were there (now taken): readable is not true.
    Spurious,
    /// Cannot tell without waiting (another thread reads it): report what the kernel says.
    Unknown,
    /// The link is being rebuilt: what the kernel says is about a socket on its way out (shut
    /// down to wake threads blocked on it); nothing is reported until the new one is in
    /// place, whose registration brings its own events.
    Relinking,
}

pub(crate) const EPFD_BITS: usize = 1 << 16;

/// A bit per descriptor below `EPFD_BITS` (one word load to test).
pub(crate) struct FdBits([AtomicU64; EPFD_BITS / 64]);

impl FdBits {
    pub(crate) const fn new() -> FdBits {
        FdBits([const { AtomicU64::new(0) }; EPFD_BITS / 64])
    }

    fn at(&self, fd: c_int) -> Option<(&AtomicU64, u64)> {
        (fd >= 0 && (fd as usize) < EPFD_BITS)
            .then(|| (&self.0[fd as usize / 64], 1u64 << (fd as usize % 64)))
    }

    /// `None` beyond the bitmap.
    #[inline]
    pub(crate) fn get(&self, fd: c_int, order: std::sync::atomic::Ordering) -> Option<bool> {
        self.at(fd).map(|(w, b)| w.load(order) & b != 0)
    }

    pub(crate) fn has(&self, fd: c_int) -> bool {
        self.get(fd, SeqCst) == Some(true)
    }

    pub(crate) fn set(&self, fd: c_int) {
        if let Some((w, b)) = self.at(fd) {
            if w.load(Relaxed) & b == 0 {
                w.fetch_or(b, SeqCst);
            }
        }
    }

    /// Calls `f` with every descriptor whose bit is set, lowest first.
    pub(crate) fn each(&self, mut f: impl FnMut(c_int)) {
        for (i, w) in self.0.iter().enumerate() {
            let mut bits = w.load(SeqCst);
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                f((i * 64 + b) as c_int);
                bits &= bits - 1;
            }
        }
    }

    pub(crate) fn clear(&self, fd: c_int) {
        if let Some((w, b)) = self.at(fd) {
            if w.load(Relaxed) & b != 0 {
                w.fetch_and(!b, SeqCst);
            }
        }
    }
}

/// Descriptors (below this) that can be scanned, and epoll instances (below `SCAN_EPFDS`)
/// that can scan.
pub(crate) const SCAN_FDS: usize = EPFD_BITS;
pub(crate) const SCAN_EPFDS: usize = 4096;
/// Per descriptor: 1 + the epoll instance whose waits scan its ring, 0 when not scanned.
pub(crate) static SCAN_EPFD: [AtomicU16; SCAN_FDS] = [const { AtomicU16::new(0) }; SCAN_FDS];
/// Per epoll instance: threads inside a wait on it, which may sleep.
pub(crate) static SLEEPERS: [AtomicU32; SCAN_EPFDS] = [const { AtomicU32::new(0) }; SCAN_EPFDS];
/// Per epoll instance: how many connections it scans (its waits skip the scan at 0).
pub(crate) static SCANNED: [AtomicU32; SCAN_EPFDS] = [const { AtomicU32::new(0) }; SCAN_EPFDS];
/// Descriptors whose receive left without announcing its ring (`elided`): a wait that does
/// not scan must announce it first.
pub(crate) static UNANNOUNCED: FdBits = FdBits::new();
/// Connections on shared memory a zero-time-out `poll` looks at (`ready::poll_now`), held
/// by this process alone and in no epoll instance: their receives leave the rings awake.
pub(crate) static POLLED: FdBits = FdBits::new();

/// Descriptors whose ring's bells go to the bell of the epoll instance that scans them
/// (`crate::bells`): a `poll` or `select` on one must announce it first.
pub(crate) static DIRECTED: FdBits = FdBits::new();

/// Connection `fd`'s bells come through its socket again.
#[inline]
pub fn undirected(fd: c_int) {
    DIRECTED.clear(fd);
}

/// Threads inside a `poll` or `select` that includes a virtual connection: while there are
/// any, every receive announces (such a wait does not scan).
pub(crate) static POLL_SLEEPERS: AtomicU32 = AtomicU32::new(0);

/// Connection `fd`'s ring was announced (whatever it holds has a bell, and the writer rings).
#[inline]
pub fn announced(fd: c_int) {
    UNANNOUNCED.clear(fd);
}

/// Sets which instance scans `fd` (`now`: 1 + the instance, 0 for none), keeping the
/// instances' counts.
pub(crate) fn set_scan(fd: c_int, now: u16) {
    let was = SCAN_EPFD[fd as usize].swap(now, SeqCst);
    if was != now {
        if was != 0 {
            SCANNED[usize::from(was - 1)].fetch_sub(1, Relaxed);
        }
        if now != 0 {
            SCANNED[usize::from(now - 1)].fetch_add(1, Relaxed);
        }
    }
}

/// True when the receive that leaves connection `fd` need not tell the writer it may sleep:
/// the connection is scanned and no thread is inside a wait on its instance right now.
/// When it is, the descriptor is marked unannounced.
#[inline]
pub fn elided(fd: c_int) -> bool {
    if (fd as usize) >= SCAN_FDS {
        return false;
    }
    let e = SCAN_EPFD[fd as usize].load(Relaxed);
    if e == 0 {
        if !POLLED.has(fd) {
            return false;
        }
        // (A `poll` or `select` that may sleep announces it after it is counted.)
        UNANNOUNCED.set(fd);
        return POLL_SLEEPERS.load(SeqCst) == 0;
    }
    UNANNOUNCED.set(fd);
    SLEEPERS[usize::from(e - 1)].load(SeqCst) == 0 && POLL_SLEEPERS.load(SeqCst) == 0
}

/// Whether connection `fd` is scanned by an epoll instance's waits.
#[inline]
pub fn scanned(fd: c_int) -> bool {
    (fd as usize) < SCAN_FDS && SCAN_EPFD[fd as usize].load(Relaxed) != 0
}

// ---------------------------------------------------------------------------------------------
// Replacing the socket under descriptors that threads wait on in `poll` or `select`
//
// The kernel's `poll` and `select` put a waiting thread on the wait queues of the files its
// descriptors named at the call's first look only; when woken they look at the descriptors
// again, but do not queue on a file that has taken a descriptor's place since. A thread
// asleep on a connection whose socket is replaced (by a placeholder, then by the new link)
// would sleep on the old file until its own time-out. So a swap wakes the waiters on the
// file that goes while it still stands under the descriptors (it reports a hang-up from then
// on), waits until they are out of the kernel (their wait calls hold them out of it while the
// swap lasts and hide what they saw), and only then puts the new file in place, where their
// next call queues them.

/// Per descriptor (below `SCAN_FDS`): threads inside a real `poll` or `select` that includes
/// it (a virtual connection).
static IN_WAIT: [AtomicU16; SCAN_FDS] = [const { AtomicU16::new(0) }; SCAN_FDS];
/// Descriptors whose file is being replaced.
static SWAPPING: FdBits = FdBits::new();
/// Bumped when a replacement ends (waiters held out sleep on it).
static SWAPS: AtomicU32 = AtomicU32::new(0);
/// Longest wait for the waiters to leave the kernel (a thread whose wait cannot see the
/// hang-up, such as a `select` on writability alone, is not waited for longer).
const SWAP_WAIT_MS: u64 = 200;

fn tracked(fd: c_int) -> bool {
    fd >= 0 && (fd as usize) < SCAN_FDS
}

/// A wait call is about to enter the kernel on the virtual connections `fds`: holds it
/// while any of them is being replaced, then counts it in. Returns the replacement count
/// seen, for [`swapped_since`].
pub(crate) fn wait_enter(fds: &[c_int]) -> u32 {
    loop {
        let seen = SWAPS.load(SeqCst);
        if !fds.iter().any(|&fd| SWAPPING.has(fd)) {
            for &fd in fds.iter().filter(|&&fd| tracked(fd)) {
                IN_WAIT[fd as usize].fetch_add(1, SeqCst);
            }
            return seen;
        }
        crate::sys::futex_wait(&SWAPS, seen, 10);
    }
}

/// True while a thread is inside a real `poll` or `select` that includes `fd`.
pub(crate) fn in_wait(fd: c_int) -> bool {
    tracked(fd) && IN_WAIT[fd as usize].load(SeqCst) != 0
}

/// The wait call on `fds` is out of the kernel.
pub(crate) fn wait_leave(fds: &[c_int]) {
    for &fd in fds.iter().filter(|&&fd| tracked(fd)) {
        IN_WAIT[fd as usize].fetch_sub(1, SeqCst);
    }
}

/// True when a replacement began or ended since [`wait_enter`] returned `seen`, or `fd`'s
/// is under way: what the kernel said about `fd` may be about the file that went.
pub(crate) fn swapped_since(seen: u32, fd: c_int) -> bool {
    SWAPPING.has(fd) || SWAPS.load(SeqCst) != seen
}

/// Replaces the file under descriptors `fds`: `wake` makes the file there now report a
/// hang-up to the threads waiting on it, `replace` puts the new one in place once they left
/// the kernel.
pub(crate) fn replace_under(fds: &[c_int], wake: impl FnOnce(), replace: impl FnOnce()) {
    for &fd in fds {
        SWAPPING.set(fd);
    }
    SWAPS.fetch_add(1, SeqCst);
    wake();
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(SWAP_WAIT_MS);
    while fds.iter().any(|&fd| tracked(fd) && IN_WAIT[fd as usize].load(SeqCst) != 0)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    replace();
    for &fd in fds {
        SWAPPING.clear(fd);
    }
    SWAPS.fetch_add(1, SeqCst);
    crate::sys::futex_wake(&SWAPS, i32::MAX);
}
