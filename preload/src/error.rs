//! The one place where the layer's errors become errno values.

use substrate::irb::IrbError;

/// errno for an IRB error.
pub fn errno_of(e: IrbError) -> i32 {
    match e {
        IrbError::WouldBlock => libc::EAGAIN,
        IrbError::Os(e) => e,
        IrbError::Protocol => libc::ECONNRESET,
        IrbError::Unhandled => libc::EIO,
    }
}

/// Turns a data-call result into the C convention (bytes, or -1 with errno set).
pub fn ret(r: Result<usize, IrbError>) -> isize {
    match r {
        Ok(n) => n as isize,
        Err(e) => {
            crate::sys::set_errno(errno_of(e));
            -1
        }
    }
}

/// Runs a data call on a virtual connection, catching any panic: a panic never unwinds into
/// C; the call fails with `EIO` instead.
pub fn guarded(f: impl FnOnce() -> Result<usize, IrbError>) -> isize {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => ret(r),
        Err(_) => {
            crate::log::error(format_args!("internal error in a data call; returning EIO"));
            crate::sys::set_errno(libc::EIO);
            -1
        }
    }
}

/// Runs set-up work (connect, accept, listen, close bookkeeping), catching any panic: on a
/// panic the work is skipped and the program goes on with plain TCP.
pub fn quietly<T>(f: impl FnOnce() -> Option<T>) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        crate::log::error(format_args!("internal error while setting up a connection; using plain TCP"));
        None
    })
}
