//! Readiness for a service manager: systemd's `sd_notify` protocol, one datagram to the
//! Unix socket named by `NOTIFY_SOCKET` (a path, or `@name` for an abstract socket). Without
//! `NOTIFY_SOCKET` nothing is sent.

use std::ffi::OsStr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` (newline-separated `KEY=VALUE` lines, e.g. `READY=1`) to the service
/// manager, if there is one. Errors are returned for logging; they are not fatal.
pub fn notify(state: &str) -> std::io::Result<bool> {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else { return Ok(false) };
    let target = target.as_encoded_bytes();
    let addr = match target.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(std::path::Path::new(OsStr::from_bytes(target)))?,
    };
    let s = UnixDatagram::unbound()?;
    s.send_to_addr(state.as_bytes(), &addr)?;
    Ok(true)
}
