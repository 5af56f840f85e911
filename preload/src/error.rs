//! The layer's answer to a program's call, and where its errors get their errno values.
//!
//! Every hook returns a [`Hooked`]: done with a result, not the layer's business (the real
//! libc function takes the call), or failed with an [`Errno`]. The C entry points
//! (`sys::entry`) are the one place that turns that into the C convention and sets the
//! program's errno.

pub use crate::sys::Errno;
use substrate::irb::IrbError;

/// What a hook did with a call.
#[derive(Debug, PartialEq, Eq)]
pub enum Hook<T> {
    /// The layer handled it: the program gets this result.
    Done(T),
    /// Not the layer's: the real libc function takes the call as the program made it.
    Real,
}

/// A hook's answer: [`Hook`], or the error the program sees.
pub type Hooked<T> = Result<Hook<T>, Errno>;

/// A real libc call's result, as a hook sees it: what it returned, or errno.
pub type Real = Result<libc::c_int, Errno>;

/// errno for an IRB error. `LinkDown` is the layer's own business and is not meant to
/// reach a program; if it ever does, the program sees a transient `EAGAIN`.
pub fn errno_of(e: IrbError) -> Errno {
    Errno(match e {
        IrbError::WouldBlock => libc::EAGAIN,
        IrbError::Os(e) => e,
        IrbError::Protocol => libc::ECONNRESET,
        IrbError::Unhandled => libc::EIO,
        IrbError::LinkDown => {
            crate::log::warn(format_args!("a link failure reached a program's call; it sees EAGAIN"));
            libc::EAGAIN
        }
    })
}

/// Runs a data call on a virtual connection, catching any panic: a panic never unwinds into
/// C; the call fails with `EIO` instead.
#[inline]
pub fn guarded(f: impl FnOnce() -> Result<usize, IrbError>) -> Hooked<usize> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(n)) => Ok(Hook::Done(n)),
        Ok(Err(e)) => Err(errno_of(e)),
        Err(_) => {
            crate::log::error(format_args!("internal error in a data call; returning EIO"));
            Err(Errno(libc::EIO))
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
