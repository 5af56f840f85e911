//! The program's memory, as the C entry points receive it: an array the program passed
//! (an epoll event buffer, a `pollfd` array, an `fd_set`), whose validity the entry point
//! promises once, when it makes the view (`unsafe fn new`). Everything past that promise
//! sees slices that live only for a callback.

use libc::c_int;

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

/// The program's bytes (a buffer it asks to send): valid for the call's length.
pub struct ProgBytes {
    ptr: *const u8,
    len: usize,
}

impl ProgBytes {
    /// A view of the program's `len` bytes at `ptr` (empty for a null pointer or 0).
    ///
    /// # Safety
    /// `ptr` is null, or valid for reads of `len` bytes while the view lives.
    #[inline]
    pub unsafe fn new(ptr: *const libc::c_void, len: usize) -> Self {
        ProgBytes { ptr: ptr as *const u8, len: if ptr.is_null() { 0 } else { len } }
    }

    /// The bytes.
    #[inline]
    pub fn get(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the promise made in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Their number.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The program's buffer for bytes it asks to receive.
pub struct ProgBytesMut {
    ptr: *mut u8,
    len: usize,
}

impl ProgBytesMut {
    /// A view of the program's writable `len` bytes at `ptr` (empty for null or 0).
    ///
    /// # Safety
    /// `ptr` is null, or valid for writes of `len` bytes while the view lives.
    #[inline]
    pub unsafe fn new(ptr: *mut libc::c_void, len: usize) -> Self {
        ProgBytesMut { ptr: ptr as *mut u8, len: if ptr.is_null() { 0 } else { len } }
    }

    /// The buffer (its bytes are whatever the program left there: they are only written).
    #[inline]
    pub fn get(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: the promise made in `new`; `&mut self` keeps views from overlapping.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// The program's array of `iovec`s: each names a buffer of its.
pub struct ProgIov {
    iov: *const libc::iovec,
    n: usize,
    writable: bool,
}

impl ProgIov {
    /// The iovecs of a call that sends (`writable` false) or receives.
    ///
    /// # Safety
    /// `iov` is null or valid for `n` iovecs, each naming memory valid for reads (and, when
    /// `writable`, writes) of its length, while the view lives.
    pub unsafe fn new(iov: *const libc::iovec, n: c_int, writable: bool) -> Self {
        ProgIov { iov, n: if iov.is_null() || n <= 0 { 0 } else { n as usize }, writable }
    }

    fn all(&self) -> &[libc::iovec] {
        if self.n == 0 {
            return &[];
        }
        // SAFETY: the promise made in `new`.
        unsafe { std::slice::from_raw_parts(self.iov, self.n) }
    }

    /// How many iovecs.
    pub fn len(&self) -> usize {
        self.n
    }

    /// True for none.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Length of buffer `i`.
    pub fn len_of(&self, i: usize) -> usize {
        self.all().get(i).map_or(0, |v| if v.iov_base.is_null() { 0 } else { v.iov_len })
    }

    /// Buffer `i`, to read.
    pub fn buf(&self, i: usize) -> &[u8] {
        let n = self.len_of(i);
        if n == 0 {
            return &[];
        }
        // SAFETY: the promise made in `new`.
        unsafe { std::slice::from_raw_parts(self.all()[i].iov_base as *const u8, n) }
    }

    /// Buffer `i`, to fill (a view made for a receiving call only).
    pub fn buf_mut(&mut self, i: usize) -> &mut [u8] {
        assert!(self.writable, "a sending call's buffers are the program's to read only");
        let n = self.len_of(i);
        if n == 0 {
            return &mut [];
        }
        // SAFETY: the promise made in `new` (writable); `&mut self` keeps views apart.
        unsafe { std::slice::from_raw_parts_mut(self.all()[i].iov_base as *mut u8, n) }
    }
}

/// The program's `msghdr` of a `recvmsg` or `sendmsg` on a virtual connection.
pub struct ProgMsg {
    msg: *mut libc::msghdr,
    writable: bool,
}

impl ProgMsg {
    /// A view of the program's message (`None` for a null pointer).
    ///
    /// # Safety
    /// `msg` is null or a valid `msghdr` whose iovecs are valid as [`ProgIov::new`] needs;
    /// when `writable`, the header and the buffers may be written.
    pub unsafe fn new(msg: *const libc::msghdr, writable: bool) -> Option<Self> {
        (!msg.is_null()).then_some(ProgMsg { msg: msg as *mut libc::msghdr, writable })
    }

    /// Its buffers.
    pub fn iov(&self) -> ProgIov {
        // SAFETY: the promise made in `new`.
        unsafe {
            let m = std::ptr::read_unaligned(self.msg);
            ProgIov::new(m.msg_iov, m.msg_iovlen as c_int, self.writable)
        }
    }

    /// A stream socket's answer carries no address, control data or flags.
    pub fn clear_extras(&mut self) {
        assert!(self.writable, "a sending call's message is the program's to read only");
        // SAFETY: the promise made in `new` (writable).
        unsafe {
            let mut m = std::ptr::read_unaligned(self.msg);
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            std::ptr::write_unaligned(self.msg, m);
        }
    }
}

/// Where the program wants a socket address written (`getsockname`, `recvfrom`).
pub struct ProgAddrOut {
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
}

impl ProgAddrOut {
    /// A view of the program's address buffer and its length word.
    ///
    /// # Safety
    /// `len` is null or valid; `addr` is null or valid for writes of `*len` bytes.
    pub unsafe fn new(addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> Self {
        ProgAddrOut { addr, len }
    }

    /// Writes `a` (in the family of a socket that is, or is not, IPv6), cut to the room the
    /// program gave, and its whole length into the length word. `EFAULT` without a buffer.
    pub fn put(&mut self, a: &std::net::SocketAddr, v6: bool) -> Result<(), super::Errno> {
        if self.addr.is_null() || self.len.is_null() {
            return Err(super::Errno(libc::EFAULT));
        }
        let (st, n) = super::to_raw(a, v6);
        // SAFETY: the promise made in `new`; at most `*len` bytes are written.
        unsafe {
            let room = (std::ptr::read_unaligned(self.len) as usize).min(n as usize);
            std::ptr::copy_nonoverlapping(&st as *const _ as *const u8, self.addr as *mut u8, room);
            std::ptr::write_unaligned(self.len, n);
        }
        Ok(())
    }

    /// No address: a zero length (what a TCP socket's `recvfrom` reports).
    pub fn put_none(&mut self) {
        if !self.len.is_null() {
            // SAFETY: the promise made in `new`.
            unsafe { std::ptr::write_unaligned(self.len, 0) };
        }
    }
}

/// Where the program wants an option value written (`getsockopt`).
pub struct ProgOptOut {
    val: *mut libc::c_void,
    len: *mut libc::socklen_t,
}

impl ProgOptOut {
    /// A view of the program's value buffer and its length word.
    ///
    /// # Safety
    /// `len` is null or valid; `val` is null or valid for writes of `*len` bytes.
    pub unsafe fn new(val: *mut libc::c_void, len: *mut libc::socklen_t) -> Self {
        ProgOptOut { val, len }
    }

    /// True when both pointers are there.
    pub fn present(&self) -> bool {
        !self.val.is_null() && !self.len.is_null()
    }

    /// Answers an int option as the kernel does: at most an int's bytes, a negative length
    /// refused with `EINVAL`.
    pub fn put_int(&mut self, v: c_int) -> Result<(), super::Errno> {
        if !self.present() {
            return Err(super::Errno(libc::EFAULT));
        }
        // SAFETY: the promise made in `new`.
        let want = unsafe { std::ptr::read_unaligned(self.len) } as i32;
        if want < 0 {
            return Err(super::Errno(libc::EINVAL));
        }
        let n = (want as usize).min(std::mem::size_of::<c_int>());
        // SAFETY: the promise made in `new`; n <= *len bytes are written.
        unsafe {
            std::ptr::copy_nonoverlapping(v.to_ne_bytes().as_ptr(), self.val as *mut u8, n);
            std::ptr::write_unaligned(self.len, n as libc::socklen_t);
        }
        Ok(())
    }
}

/// One value of the program's that a call passes by pointer (an epoll event, a file
/// offset, an ioctl's int).
pub struct ProgCell<T: Copy> {
    p: *mut T,
}

impl<T: Copy> ProgCell<T> {
    /// A view of the program's value (none for a null pointer).
    ///
    /// # Safety
    /// `p` is null, or valid for reads (and, if [`ProgCell::set`] is used, writes) whenever
    /// the view is used; a caller reads it only where the program's call promised a value.
    pub unsafe fn new(p: *mut T) -> Self {
        ProgCell { p }
    }

    /// True for a null pointer.
    pub fn is_null(&self) -> bool {
        self.p.is_null()
    }

    /// The value (`None` for a null pointer).
    pub fn get(&self) -> Option<T> {
        // SAFETY: the promise made in `new`.
        (!self.p.is_null()).then(|| unsafe { std::ptr::read_unaligned(self.p) })
    }

    /// Writes the value (nothing for a null pointer).
    pub fn set(&mut self, v: T) {
        if !self.p.is_null() {
            // SAFETY: the promise made in `new`.
            unsafe { std::ptr::write_unaligned(self.p, v) }
        }
    }
}

/// The instructions of a seccomp install's `sock_fprog` as bytes (`None` for a null one).
///
/// # Safety
/// `prog` is null or a valid `sock_fprog` whose `filter` points at `len` instructions (the
/// kernel reads the same memory right after), valid while the view lives.
pub unsafe fn fprog(prog: *const libc::sock_fprog) -> Option<ProgBytes> {
    if prog.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    let (len, insns) = unsafe { ((*prog).len as usize, (*prog).filter) };
    // SAFETY: `len` instructions of 8 bytes each, as the caller says (none for a null one).
    Some(unsafe { ProgBytes::new(insns as *const libc::c_void, if insns.is_null() { 0 } else { len * 8 }) })
}

extern "C" {
    static environ: *const *const libc::c_char;
}

/// The entries of a C environment array (`None`: the process's own), copied.
///
/// # Safety
/// `envp` is a NULL-terminated array of C strings, or null.
pub unsafe fn env_vec(envp: Option<*const *const libc::c_char>) -> Vec<std::ffi::CString> {
    let mut p = match envp {
        Some(p) => p,
        // SAFETY: `environ` is the process's environment array.
        None => unsafe { environ },
    };
    let mut out = Vec::new();
    while !p.is_null() {
        // SAFETY: walking the caller's array until its NULL.
        let s = unsafe { *p };
        if s.is_null() {
            break;
        }
        // SAFETY: each entry is a C string.
        out.push(unsafe { std::ffi::CStr::from_ptr(s) }.to_owned());
        // SAFETY: the next entry (the array goes on to its NULL).
        p = unsafe { p.add(1) };
    }
    out
}

/// Runs `f` with a NULL-terminated pointer array over `env` (for an exec).
pub fn with_envp<R>(env: &[std::ffi::CString], f: impl FnOnce(*const *const libc::c_char) -> R) -> R {
    let mut ptrs: Vec<*const libc::c_char> = env.iter().map(|c| c.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    f(ptrs.as_ptr())
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
