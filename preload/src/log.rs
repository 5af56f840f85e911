//! Minimal logging to standard error, with the level from `VMI_LOG` (error, warn, info,
//! debug; default warn). Lines start with `vmi[PID]:`. Nothing is written if fd 2 is itself
//! a virtual connection (a program may have put a socket there).

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

static LEVEL: AtomicU8 = AtomicU8::new(2);

/// Sets the level from the value of `VMI_LOG`.
pub fn init(value: Option<&str>) {
    let l = match value.map(|v| v.to_ascii_lowercase()) {
        Some(v) if v == "off" => 0,
        Some(v) if v == "error" => 1,
        Some(v) if v == "warn" => 2,
        Some(v) if v == "info" => 3,
        Some(v) if v == "debug" || v == "trace" => 4,
        _ => 2,
    };
    LEVEL.store(l, Relaxed);
}

/// True if messages of `level` are printed.
pub fn enabled(level: u8) -> bool {
    LEVEL.load(Relaxed) >= level
}

fn emit(level: u8, tag: &str, args: fmt::Arguments<'_>) {
    if !enabled(level) || crate::fdtable::is_managed(2) {
        return;
    }
    if !crate::sandbox::allows(libc::SYS_write, [2, 0, 0, 0, 0, 0]) {
        return;
    }
    let mut s = String::with_capacity(128);
    let pid = crate::pid();
    let _ = writeln!(s, "vmi[{pid}]: {tag}: {args}");
    // SAFETY: writes a valid buffer to fd 2 through the real write.
    unsafe { crate::real::write(2, s.as_ptr() as *const _, s.len()) };
}

/// Logs an error.
pub fn error(args: fmt::Arguments<'_>) {
    emit(1, "error", args)
}
/// Logs a warning.
pub fn warn(args: fmt::Arguments<'_>) {
    emit(2, "warn", args)
}
/// Logs progress.
pub fn info(args: fmt::Arguments<'_>) {
    emit(3, "info", args)
}
/// Logs details.
pub fn debug(args: fmt::Arguments<'_>) {
    emit(4, "debug", args)
}
