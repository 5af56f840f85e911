//! This process's statistics table: a memfd holding one slot per virtual connection
//! (layout in `substrate::stats`), handed to the node agent so `vmictl` can read it without
//! asking the program anything. Survives `fork` (shared mapping); slots are claimed with
//! compare-and-swap, so parent and child allocate safely.

use crate::sys;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::sync::OnceLock;
use substrate::devices::Counters;
use substrate::stats::{encode_addr, off, SLOT_SIZE, TABLE_BYTES, TABLE_HEADER, TABLE_MAGIC, TABLE_SLOTS};

/// The mapped table (its memfd stays open, close-on-exec, as the layer's own descriptor
/// `OWN_STATS`, protected from the program's closes).
pub struct Table {
    base: *mut u8,
    hint: AtomicU32,
}

// SAFETY: the table is shared memory accessed only with atomics or by the slot owner.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

static TABLE: OnceLock<Option<Table>> = OnceLock::new();

fn create() -> Option<Table> {
    // SAFETY: the name is NUL-terminated.
    let fd = unsafe { libc::memfd_create(c"vmi-stats".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    let fd = crate::fdtable::move_high(fd);
    // SAFETY: plain syscalls on our own memfd.
    let base = unsafe {
        if libc::ftruncate(fd, TABLE_BYTES as libc::off_t) != 0 {
            crate::sys::real::close(fd);
            return None;
        }
        libc::mmap(
            std::ptr::null_mut(),
            TABLE_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        crate::sys::fd::close(fd);
        return None;
    }
    let base = base as *mut u8;
    // SAFETY: the header lies inside the fresh mapping.
    unsafe {
        std::ptr::write(base as *mut u64, TABLE_MAGIC);
        std::ptr::write(base.add(8) as *mut u32, TABLE_SLOTS as u32);
        std::ptr::write(base.add(12) as *mut u32, crate::pid() as u32);
    }
    crate::fdtable::protect(crate::fdtable::OWN_STATS, fd);
    Some(Table { base, hint: AtomicU32::new(0) })
}

/// The table, created on first use.
pub fn table() -> Option<&'static Table> {
    TABLE.get_or_init(create).as_ref()
}

/// A connection's slot in the table.
#[derive(Clone, Copy)]
pub struct Slot(*mut u8);

// SAFETY: points into the shared table, which lives as long as the process.
unsafe impl Send for Slot {}
// SAFETY: as above.
unsafe impl Sync for Slot {}

/// What a slot describes.
pub struct SlotInfo {
    /// GID.
    pub gid: u128,
    /// Local address.
    pub local: SocketAddr,
    /// Peer address.
    pub peer: SocketAddr,
    /// True when this side connected.
    pub active: bool,
    /// Soft window.
    pub window: u64,
}

impl Table {
    fn slot_ptr(&self, i: usize) -> *mut u8 {
        // SAFETY: i < TABLE_SLOTS, inside the mapping.
        unsafe { self.base.add(TABLE_HEADER + i * SLOT_SIZE) }
    }

    /// Claims a free slot and fills it.
    pub fn alloc(&self, info: &SlotInfo) -> Option<Slot> {
        let start = self.hint.load(Relaxed) as usize;
        for k in 0..TABLE_SLOTS {
            let i = (start + k) % TABLE_SLOTS;
            let p = self.slot_ptr(i);
            // SAFETY: USED is a 4-aligned u32 inside the slot.
            let used = unsafe { AtomicU32::from_ptr(p.add(off::USED) as *mut u32) };
            if used.load(Relaxed) != 0 || used.compare_exchange(0, 2, Acquire, Relaxed).is_err() {
                continue;
            }
            self.hint.store(((i + 1) % TABLE_SLOTS) as u32, Relaxed);
            // SAFETY: we own the slot (state 2 = being filled); all fields lie inside it.
            unsafe {
                std::ptr::write_bytes(p.add(4), 0, SLOT_SIZE - 4);
                std::ptr::write(p.add(off::PID) as *mut u32, crate::pid() as u32);
                std::ptr::write(p.add(off::GID) as *mut u128, info.gid);
                std::ptr::copy_nonoverlapping(encode_addr(&info.local).as_ptr(), p.add(off::LOCAL), 20);
                std::ptr::copy_nonoverlapping(encode_addr(&info.peer).as_ptr(), p.add(off::PEER), 20);
                std::ptr::write(p.add(off::SUBSTRATE) as *mut u32, 1);
                std::ptr::write(p.add(off::ACTIVE) as *mut u32, info.active as u32);
                std::ptr::write(p.add(off::WINDOW) as *mut u64, info.window);
                std::ptr::write(p.add(off::CREATED_MS) as *mut u64, sys::unix_ms());
            }
            used.store(1, Release);
            return Some(Slot(p));
        }
        None
    }
}

impl Slot {
    /// The slot's counters (shared with the agent).
    pub fn counters(&self) -> &'static Counters {
        // SAFETY: COUNTERS is 8-aligned inside the slot; Counters is four AtomicU64, repr(C).
        unsafe { &*(self.0.add(off::COUNTERS) as *const Counters) }
    }

    /// Records the replay-buffer fill.
    pub fn set_unacked(&self, n: u64) {
        // SAFETY: UNACKED is an 8-aligned u64 inside the slot.
        unsafe { AtomicU64::from_ptr(self.0.add(off::UNACKED) as *mut u64) }.store(n, Relaxed);
    }

    /// Records the process using the connection (one relaxed load when unchanged).
    #[inline]
    pub fn set_pid(&self, pid: i32) {
        // SAFETY: PID is a 4-aligned u32 inside the slot.
        let a = unsafe { AtomicU32::from_ptr(self.0.add(off::PID) as *mut u32) };
        if a.load(Relaxed) != pid as u32 {
            a.store(pid as u32, Relaxed);
        }
    }

    /// Records the errno the connection failed with.
    pub fn set_error(&self, e: i32) {
        // SAFETY: ERROR is a 4-aligned u32 inside the slot.
        unsafe { AtomicU32::from_ptr(self.0.add(off::ERROR) as *mut u32) }.store(e as u32, Relaxed);
    }

    /// Records the physical link's addresses (at set-up and after each failover).
    pub fn set_link(&self, local: &SocketAddr, peer: &SocketAddr) {
        for (o, a) in [(off::LINK_LOCAL, local), (off::LINK_PEER, peer)] {
            let b = encode_addr(a);
            for (i, w) in b.chunks_exact(4).enumerate() {
                // SAFETY: the address fields are 4-aligned and 20 bytes long inside the slot.
                unsafe { AtomicU32::from_ptr(self.0.add(o + 4 * i) as *mut u32) }
                    .store(u32::from_ne_bytes(w.try_into().expect("4")), Relaxed);
            }
        }
    }

    /// Records the link state: rebuilding (`true`) or up; counts a rebuild when it ends.
    pub fn set_relinking(&self, on: bool, rebuilt: bool) {
        // SAFETY: LINK_STATE and FAILOVERS are 4-aligned u32s inside the slot.
        unsafe {
            AtomicU32::from_ptr(self.0.add(off::LINK_STATE) as *mut u32).store(on as u32, Relaxed);
            if rebuilt {
                AtomicU32::from_ptr(self.0.add(off::FAILOVERS) as *mut u32).fetch_add(1, Relaxed);
            }
        }
    }

    /// Records the substrate carrying the bytes (1 tcp, 2 shm).
    pub fn set_substrate(&self, code: u32) {
        // SAFETY: SUBSTRATE is a 4-aligned u32 inside the slot.
        unsafe { AtomicU32::from_ptr(self.0.add(off::SUBSTRATE) as *mut u32) }.store(code, Relaxed);
    }

    /// Takes back a slot this connection freed (an exec that failed): false if another
    /// connection claimed it meanwhile.
    pub fn reclaim(&self) -> bool {
        // SAFETY: USED is a 4-aligned u32 inside the slot.
        unsafe { AtomicU32::from_ptr(self.0.add(off::USED) as *mut u32) }
            .compare_exchange(0, 1, AcqRel, Relaxed)
            .is_ok()
    }

    /// Frees the slot.
    pub fn free(&self) {
        // SAFETY: USED is a 4-aligned u32 inside the slot.
        unsafe { AtomicU32::from_ptr(self.0.add(off::USED) as *mut u32) }.store(0, Release);
    }
}
