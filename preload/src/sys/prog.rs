//! The program's memory, as the C entry points receive it: an array the program passed
//! (an epoll event buffer, a `pollfd` array, an `fd_set`), whose validity the entry point
//! promises once, when it makes the view (`unsafe fn new`). Everything past that promise
//! sees slices that live only for a callback.

/// `len` elements of the program's at `ptr` (or none, for a null pointer).
pub struct ProgArray<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> ProgArray<T> {
    /// A view of the program's array.
    ///
    /// # Safety
    /// `ptr` is null, or valid for reads and writes of `len` elements for the view's life,
    /// and the elements a caller of [`ProgArray::with`] asks for are initialised then (by
    /// the program, or by the kernel before the call).
    pub unsafe fn new(ptr: *mut T, len: usize) -> Self {
        ProgArray { ptr, len: if ptr.is_null() { 0 } else { len } }
    }

    /// True for a null or empty array.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Runs `f` on the first `n` elements (at most the length).
    pub fn with<R>(&mut self, n: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
        let n = n.min(self.len);
        if n == 0 {
            return f(&mut []);
        }
        // SAFETY: the promise made in `new`; the slice lives only for `f`, and `&mut self`
        // keeps any other view from overlapping it.
        f(unsafe { std::slice::from_raw_parts_mut(self.ptr, n) })
    }
}

impl ProgArray<libc::fd_set> {
    /// True if `fd` is in the program's set (false for no set, or `fd` out of range).
    pub fn has(&mut self, fd: libc::c_int) -> bool {
        self.with(1, |s| s.first().is_some_and(|s| super::fd::FdSet(*s).contains(fd)))
    }

    /// Takes `fd` out of the program's set.
    pub fn clear(&mut self, fd: libc::c_int) {
        self.with(1, |s| {
            if let Some(s) = s.first_mut() {
                let mut f = super::fd::FdSet(*s);
                f.remove(fd);
                *s = f.0;
            }
        })
    }
}

/// A time-out the program passed as a `timespec` (null: none) in microseconds (negative:
/// none).
///
/// # Safety
/// `ts` is null or valid.
pub unsafe fn ts_us(ts: *const libc::timespec) -> i64 {
    if ts.is_null() {
        return -1;
    }
    // SAFETY: the caller's contract.
    let t = unsafe { *ts };
    t.tv_sec.saturating_mul(1_000_000).saturating_add((t.tv_nsec + 999) / 1000).max(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timespecs_and_views() {
        let t = libc::timespec { tv_sec: 1, tv_nsec: 500_000_000 };
        // SAFETY: a valid timespec, and null.
        assert_eq!(unsafe { ts_us(&t) }, 1_500_000);
        // SAFETY: null is allowed.
        assert_eq!(unsafe { ts_us(std::ptr::null()) }, -1);
        let mut a = [1u32, 2, 3];
        // SAFETY: a local array of 3.
        let mut v = unsafe { ProgArray::new(a.as_mut_ptr(), 3) };
        assert_eq!(v.with(10, |s| s.len()), 3);
        v.with(2, |s| s[1] = 7);
        assert_eq!(a, [1, 7, 3]);
        // SAFETY: null is allowed.
        let mut none = unsafe { ProgArray::<u32>::new(std::ptr::null_mut(), 5) };
        assert!(none.is_empty());
        assert_eq!(none.with(3, |s| s.len()), 0);
        let mut set = FdSetTest::one(5);
        // SAFETY: a local fd_set.
        let mut p = unsafe { ProgArray::new(&mut set.0 as *mut libc::fd_set, 1) };
        assert!(p.has(5) && !p.has(6));
        p.clear(5);
        assert!(!p.has(5));
    }

    struct FdSetTest(libc::fd_set);
    impl FdSetTest {
        fn one(fd: i32) -> Self {
            let mut f = super::super::fd::FdSet::new();
            f.insert(fd);
            FdSetTest(f.0)
        }
    }
}
