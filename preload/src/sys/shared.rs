//! Memory shared with other processes (a `fork`ed child, the node agent, a co-located peer),
//! mapped once and seen only through atomics at checked offsets: nothing outside this
//! module turns an address into a reference.

use libc::c_int;
use std::ffi::CStr;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize};
use std::sync::Arc;
use substrate::shmring::{Ring, RingError};

/// Types made only of atomics (`repr(C)`), which may be seen in shared memory at any
/// suitably aligned offset.
///
/// # Safety
/// Every bit pattern must be a valid value, and all access must go through atomics.
pub unsafe trait Atomics: Sync {}

// SAFETY: four AtomicU64, repr(C).
unsafe impl Atomics for substrate::devices::Counters {}
// SAFETY: repr(C) atomics, but for `magic`, a plain u64 written once (through `u64` here)
// before the region is shared and only read afterwards; any bits are a value.
unsafe impl Atomics for substrate::shmring::RegionHead {}

/// A shared mapping of `len` bytes.
pub struct SharedMap {
    base: *mut u8,
    len: usize,
    /// Unmapped when dropped (false: kept for the life of the process).
    owned: bool,
}

// SAFETY: the memory is only ever reached through atomics (see the accessors).
unsafe impl Send for SharedMap {}
// SAFETY: as above.
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// Maps `len` bytes of the file `fd` shared (`MAP_SHARED`), read and write.
    pub fn map_fd(fd: c_int, len: usize, owned: bool) -> Option<SharedMap> {
        // SAFETY: a new mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        (p != libc::MAP_FAILED).then_some(SharedMap { base: p as *mut u8, len, owned })
    }

    /// `len` bytes of anonymous memory shared with this process's `fork` children (pages are
    /// given only as they are touched).
    pub fn anonymous(len: usize) -> Option<SharedMap> {
        // SAFETY: a new mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        (p != libc::MAP_FAILED).then_some(SharedMap { base: p as *mut u8, len, owned: true })
    }

    /// Like [`SharedMap::anonymous`], but takes a mapping of the same length that
    /// [`SharedMap::spare`] kept, when there is one: a short connection then costs no
    /// `mmap`, no `munmap` (whose flush of the other threads' TLBs is the dear part) and no
    /// page faults. The memory holds what its last user left: the caller writes every byte
    /// it reads before reading it.
    pub fn anonymous_reused(len: usize) -> Option<SharedMap> {
        if SPARE_LEN.load(Relaxed) == len {
            for s in &SPARES {
                let p = s.swap(std::ptr::null_mut(), Acquire);
                if !p.is_null() {
                    return Some(SharedMap { base: p, len, owned: true });
                }
            }
        }
        SharedMap::anonymous(len)
    }

    /// Keeps this mapping (anonymous, owned, no longer seen by any process) for the next
    /// [`SharedMap::anonymous_reused`] of its length, or unmaps it when [`SPARE_COUNT`] are
    /// kept already or the kept ones have another length.
    pub fn spare(self) {
        let len = self.len;
        if !self.owned
            || (SPARE_LEN.load(Relaxed) != len
                && SPARE_LEN.compare_exchange(0, len, Relaxed, Relaxed).is_err())
        {
            return;
        }
        for s in &SPARES {
            if s.compare_exchange(std::ptr::null_mut(), self.base, Release, Relaxed).is_ok() {
                std::mem::forget(self);
                return;
            }
        }
    }

    /// The first byte's address (for a layout placed there by its owner).
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// A new memory file named `name` of `len` bytes, mapped: the map and the file's
    /// descriptor (the caller owns it).
    pub fn memfd(name: &CStr, len: usize, flags: libc::c_uint) -> Option<(SharedMap, c_int)> {
        let fd = super::fd::memfd_create(name, flags);
        if fd < 0 {
            return None;
        }
        if super::fd::ftruncate(fd, len as i64) != 0 {
            super::fd::close(fd);
            return None;
        }
        match SharedMap::map_fd(fd, len, false) {
            Some(m) => Some((m, fd)),
            None => {
                super::fd::close(fd);
                None
            }
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty map.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn at(&self, off: usize, size: usize, align: usize) -> *mut u8 {
        assert!(off.checked_add(size).is_some_and(|end| end <= self.len), "shared offset {off} out of range");
        assert!(off.is_multiple_of(align), "shared offset {off} misaligned");
        self.base.wrapping_add(off)
    }

    /// The 32-bit word at `off` (4-aligned, inside the map; checked).
    #[inline]
    pub fn u32(&self, off: usize) -> &AtomicU32 {
        let p = self.at(off, 4, 4);
        // SAFETY: inside the mapping (which lives as long as `self`), aligned, reached
        // only atomically.
        unsafe { AtomicU32::from_ptr(p as *mut u32) }
    }

    /// The 64-bit word at `off` (8-aligned, inside the map; checked).
    #[inline]
    pub fn u64(&self, off: usize) -> &AtomicU64 {
        let p = self.at(off, 8, 8);
        // SAFETY: as for `u32`.
        unsafe { AtomicU64::from_ptr(p as *mut u64) }
    }

    /// The byte at `off`.
    #[inline]
    pub fn u8(&self, off: usize) -> &AtomicU8 {
        let p = self.at(off, 1, 1);
        // SAFETY: as for `u32`.
        unsafe { AtomicU8::from_ptr(p) }
    }

    /// A `T` made of atomics at `off` (aligned for `T`, inside the map; checked).
    #[inline]
    pub fn atomics<T: Atomics>(&self, off: usize) -> &T {
        let p = self.at(off, std::mem::size_of::<T>(), std::mem::align_of::<T>());
        // SAFETY: inside the mapping, aligned; `T` is atomics only, valid for any bytes.
        unsafe { &*(p as *const T) }
    }

    /// Stores `b` at `off` byte by byte (relaxed): for filling a region this process owns
    /// for now (readers look only after a release store elsewhere).
    pub fn store_bytes(&self, off: usize, b: &[u8]) {
        let _ = self.at(off, b.len(), 1);
        for (i, &x) in b.iter().enumerate() {
            self.u8(off + i).store(x, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl SharedMap {
    /// Lets the shared memory go from this process: private zero pages take its place, at
    /// the same addresses (so whatever still looks at it sees zeros, never a hole).
    pub fn forget_contents(&self) {
        // SAFETY: replaces this mapping's own range with an anonymous one of the same size;
        // every address stays mapped and readable.
        unsafe {
            libc::mmap(
                self.base as *mut libc::c_void,
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
    }
}

/// How many mappings [`SharedMap::spare`] keeps.
pub const SPARE_COUNT: usize = 4;

/// The kept mappings (null: none), all of length [`SPARE_LEN`].
static SPARES: [AtomicPtr<u8>; SPARE_COUNT] = [const { AtomicPtr::new(std::ptr::null_mut()) }; SPARE_COUNT];

/// The length of every kept mapping (0: none kept yet); set by the first one kept.
static SPARE_LEN: AtomicUsize = AtomicUsize::new(0);

/// fork, child side: the kept mappings are shared with the parent, which may hand them to
/// a connection of its own at any time; the child lets go of them.
pub fn after_fork_child() {
    let len = SPARE_LEN.load(Relaxed);
    for s in &SPARES {
        let p = s.swap(std::ptr::null_mut(), Acquire);
        if !p.is_null() {
            drop(SharedMap { base: p, len, owned: true });
        }
    }
}

/// A ring in a shared map; it keeps the map (and so its memory) alive.
pub struct MappedRing {
    ring: Ring,
    _map: Arc<SharedMap>,
}

impl std::ops::Deref for MappedRing {
    type Target = Ring;
    fn deref(&self) -> &Ring {
        &self.ring
    }
}

/// Makes (`fresh`) or finds a ring of `len` bytes at `off` in `map` (64-aligned, inside it;
/// checked).
pub fn ring(map: &Arc<SharedMap>, off: usize, len: usize, fresh: bool) -> Result<MappedRing, RingError> {
    if !off.is_multiple_of(64) || off.checked_add(len).is_none_or(|end| end > map.len) {
        return Err(RingError::NotARing);
    }
    let p = map.base.wrapping_add(off);
    // SAFETY: `len` bytes inside the mapping, 64-aligned (checked); the ring keeps the map
    // alive (`MappedRing` holds it, and `Ring` is not Copy, so no copy outlives it). A fresh
    // ring is made only in memory nobody else uses yet (the caller's region before it is
    // offered).
    let ring = unsafe {
        if fresh {
            Ring::init(p, len)?
        } else {
            Ring::attach(p, len)?
        }
    };
    Ok(MappedRing { ring, _map: map.clone() })
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        if self.owned
            && super::gate::allows(libc::SYS_munmap, [self.base as u64, self.len as u64, 0, 0, 0, 0])
        {
            // SAFETY: unmaps exactly what was mapped; no reference into it outlives `self`.
            unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
        }
    }
}
