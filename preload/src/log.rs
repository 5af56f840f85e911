//! Minimal logging to standard error, with the level from `VMI_LOG` (error, warn, info,
//! debug; default warn). Lines start with `vmi[PID]:`. Nothing is written if fd 2 is itself
//! a virtual connection (a program may have put a socket there).

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

static LEVEL: AtomicU8 = AtomicU8::new(2);

/// 1 while fd 2 is a virtual connection (the descriptor table says so).
static STDERR_VC: AtomicU8 = AtomicU8::new(0);

/// The descriptor table's news about fd 2.
pub fn stderr_is_connection(yes: bool) {
    STDERR_VC.store(yes as u8, Relaxed);
}

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

/// A line being formatted, on the stack (a sandbox may forbid the calls an allocation
/// makes); longer lines are cut.
struct Line {
    buf: [u8; 512],
    len: usize,
}

impl fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = self.buf.len() - 1 - self.len;
        let n = s.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

fn emit(level: u8, tag: &str, args: fmt::Arguments<'_>) {
    if !enabled(level) || STDERR_VC.load(Relaxed) != 0 {
        return;
    }
    if !crate::sys::gate::allows(libc::SYS_write, [2, 0, 0, 0, 0, 0]) {
        return;
    }
    let mut line = Line { buf: [0; 512], len: 0 };
    let pid = crate::pid();
    let _ = write!(line, "vmi[{pid}]: {tag}: {args}");
    line.buf[line.len] = b'\n';
    if !fits_file_limit(line.len + 1) {
        return;
    }
    crate::sys::fd::write(2, &line.buf[..line.len + 1]);
}

/// False when fd 2 is a regular file that `n` more bytes would take past the process's
/// file size limit: the kernel kills a writer that goes past it with SIGXFSZ (OpenSSH's
/// sandboxed child sets the limit to zero, with stderr on a log file). Also false where a
/// sandbox forbids asking.
fn fits_file_limit(n: usize) -> bool {
    if !crate::sys::gate::allows_all(&[libc::SYS_newfstatat, libc::SYS_fstat, libc::SYS_prlimit64]) {
        return false;
    }
    let Some(st) = crate::sys::fd::fstat(2) else { return true };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return true;
    }
    let Some(lim) = crate::sys::process::getrlimit(libc::RLIMIT_FSIZE) else { return false };
    lim.rlim_cur == libc::RLIM_INFINITY || (st.st_size as u64).saturating_add(n as u64) <= lim.rlim_cur
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
