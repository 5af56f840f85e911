//! Memory the layer shares between threads and processes, reached only in ways that keep
//! Rust's rules: data lent to one borrower at a time ([`LendCell`]), values kept until their
//! owner goes ([`Kept`]), and a mapping's head and the ring after it ([`HeadRing`]).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicI32, AtomicPtr, Ordering::*};

/// Data lent to one borrower at a time, in every thread and every process that maps it.
/// The flag holds the borrowing process's id: taken with an atomic swap (acquire), given
/// back with a release store, so two borrows never overlap and each sees what the one
/// before wrote. A borrow that finds it taken panics (a nested borrow, or a caller without
/// the lock that is meant to keep others away), unless the process that took it is gone:
/// then the borrow it left behind is over, and the data is taken over as it is.
///
/// A lock (the connection's `FutexLock`) is what orders users; this flag is what
/// makes handing out `&mut` sound.
#[repr(C)]
pub struct LendCell<T> {
    lent: AtomicI32,
    cell: UnsafeCell<T>,
}

// SAFETY: the data is reached only through `lend`, one borrow at a time across threads
// (the flag, taken atomically), as a mutex-protected value is; `peek` copies `Plain` data.
unsafe impl<T: Send> Sync for LendCell<T> {}

impl<T> LendCell<T> {
    /// `v`, not lent.
    pub const fn new(v: T) -> LendCell<T> {
        LendCell { lent: AtomicI32::new(0), cell: UnsafeCell::new(v) }
    }

    /// Runs `f` on the data, lent for the length of `f`.
    #[inline]
    pub fn lend<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        // (-1 where a sandbox hides the process's id: never taken for a dead process.)
        let me = match super::process::pid() {
            0 => -1,
            p => p,
        };
        let was = self.lent.swap(me, Acquire);
        if was != 0 {
            self.taken(was, me);
        }
        struct Back<'a>(&'a AtomicI32);
        impl Drop for Back<'_> {
            #[inline]
            fn drop(&mut self) {
                self.0.store(0, Release);
            }
        }
        let _back = Back(&self.lent);
        // SAFETY: the flag was free (or its borrower's process is gone) and is ours until
        // `_back` drops: no other borrow of the data exists in any thread or process, and
        // the acquire/release pair orders this one after the previous.
        f(unsafe { &mut *self.cell.get() })
    }

    #[cold]
    fn taken(&self, was: i32, me: i32) {
        if was != me && was > 0 && !super::process::may_exist(was) {
            // (The lock it held is taken over too, and says so: see `shm::FutexLock`.)
            return;
        }
        self.lent.store(was, Release);
        panic!("connection state borrowed twice");
    }
}

/// Data whose every bit pattern is a valid value (plain integers), so a racy copy is at
/// worst stale or torn, never undefined.
///
/// # Safety
/// Only for types made of integers (and arrays and structs of them), with no padding that
/// matters and no pointers.
pub unsafe trait Plain: Copy {}

// SAFETY: plain integers only (they live in memory shared across processes).
unsafe impl Plain for substrate::reliability::TxState {}
// SAFETY: as above.
unsafe impl Plain for substrate::reliability::RxState {}
// SAFETY: plain integers.
unsafe impl Plain for u64 {}
// SAFETY: as above.
unsafe impl Plain for u32 {}

impl<T: Plain> LendCell<T> {
    /// A look without a borrow: a racy copy that may be a moment old (or torn), taken only
    /// to choose whether and how to wait or look again, never to change anything.
    pub fn peek<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        // SAFETY: a volatile copy of plain data: any bytes are a valid value.
        let copy = unsafe { std::ptr::read_volatile(self.cell.get()) };
        f(&copy)
    }

    /// As [`peek`](Self::peek), for one field: the field at byte offset `at`
    /// (`std::mem::offset_of!`), whose type `field` names (it is never called). One load,
    /// where a copy of the whole value is one per byte (a volatile copy of a struct is made
    /// byte by byte: about 700 instructions for the send half's state).
    #[inline]
    pub fn peek_field<R: Plain>(&self, at: usize, field: fn(&T) -> &R) -> R {
        let _ = field;
        assert!(at + std::mem::size_of::<R>() <= std::mem::size_of::<T>(), "a field outside its value");
        // (The value is aligned for each of its fields, so a field's offset is too.)
        let p = self.cell.get().cast::<u8>().wrapping_add(at).cast::<R>();
        assert!(p.is_aligned(), "a field off its alignment");
        // SAFETY: inside the value (checked above), aligned (checked), and any bytes are a
        // valid `R` (`Plain`); volatile, as `peek`: a racy look, at worst stale or torn.
        unsafe { std::ptr::read_volatile(p) }
    }
}

/// The current one of values that are kept until the slot goes (a reader racing a change
/// may still use the one it found): one load to read, a lock only to change.
pub struct Kept<T> {
    cur: AtomicPtr<T>,
    #[allow(clippy::vec_box)]
    keep: std::sync::Mutex<Vec<Box<T>>>,
}

impl<T> Default for Kept<T> {
    fn default() -> Self {
        Kept { cur: AtomicPtr::new(std::ptr::null_mut()), keep: Default::default() }
    }
}

impl<T> Kept<T> {
    /// The current value.
    pub fn get(&self) -> Option<&T> {
        let p = self.cur.load(Acquire);
        // SAFETY: every value stored is kept (boxed, never moved or dropped) until the slot
        // drops, which `&self` outlives.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    /// Makes `v` the current value; returns it (at its final address).
    pub fn set(&self, v: T) -> &T {
        let b = Box::new(v);
        let p = &*b as *const T as *mut T;
        self.keep.lock().unwrap_or_else(|e| e.into_inner()).push(b);
        self.cur.store(p, Release);
        // SAFETY: just stored, kept until the slot drops.
        unsafe { &*p }
    }
}

/// A head whose ring follows it in one mapping: the ring is lent together with one of the
/// head's cells, and only then.
pub trait RingHead: Sync + 'static {
    /// What is lent with the ring.
    type Half;
    /// The cell lent with the ring.
    fn ring_cell(&self) -> &LendCell<Self::Half>;
}

/// A view of a mapping that holds an `H` in its first `head` bytes and a ring after them.
/// Copyable; whoever owns the mapping keeps it mapped while views are used.
pub struct HeadRing<H> {
    base: *mut u8,
    len: usize,
    head: usize,
    _h: std::marker::PhantomData<*const H>,
}

impl<H> Clone for HeadRing<H> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<H> Copy for HeadRing<H> {}

// SAFETY: the mapping is plain memory; the head is `Sync` and the ring is reached only
// through the head's lending cell.
unsafe impl<H: RingHead> Send for HeadRing<H> {}
// SAFETY: as above.
unsafe impl<H: RingHead> Sync for HeadRing<H> {}

impl<H: RingHead> HeadRing<H> {
    /// Writes `h` at the start of `map` (fresh, page aligned) and makes the view; `None`
    /// when `H` does not fit in `head` bytes or no ring follows.
    pub fn init(map: &super::shared::SharedMap, head: usize, h: H) -> Option<HeadRing<H>> {
        if std::mem::size_of::<H>() > head || map.len() <= head || std::mem::align_of::<H>() > 4096 {
            return None;
        }
        let base = map.base();
        // SAFETY: the mapping is ours, page aligned, and at least `head` bytes long; nothing
        // else refers to it yet.
        unsafe { std::ptr::write(base as *mut H, h) };
        Some(HeadRing { base, len: map.len(), head, _h: std::marker::PhantomData })
    }

    /// The head. (The mapping outlives every use of the view: its owner keeps it.)
    #[inline]
    pub fn head(&self) -> &'static H {
        // SAFETY: written in `init`, mapped while the view is used.
        unsafe { &*(self.base as *const H) }
    }

    /// Runs `f` on the head's ring cell and the ring, lent together.
    #[inline]
    pub fn with_ring<R>(&self, f: impl FnOnce(&mut H::Half, &mut [u8]) -> R) -> R {
        self.head().ring_cell().lend(|half| {
            // SAFETY: the ring is mapped for `len - head` bytes after the head, and is
            // reached only here, inside the one borrow of the head's ring cell.
            let ring =
                unsafe { std::slice::from_raw_parts_mut(self.base.add(self.head), self.len - self.head) };
            f(half, ring)
        })
    }

    /// Ring length in bytes.
    pub fn ring_len(&self) -> usize {
        self.len - self.head
    }
}
