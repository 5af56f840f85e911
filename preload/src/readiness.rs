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
        return false;
    }
    UNANNOUNCED.set(fd);
    SLEEPERS[usize::from(e - 1)].load(SeqCst) == 0 && POLL_SLEEPERS.load(SeqCst) == 0
}

/// Whether connection `fd` is scanned by an epoll instance's waits.
#[inline]
pub fn scanned(fd: c_int) -> bool {
    (fd as usize) < SCAN_FDS && SCAN_EPFD[fd as usize].load(Relaxed) != 0
}
