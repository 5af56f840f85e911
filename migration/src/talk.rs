//! Requests to a node's agent and to a frozen process's thaw socket (abstract Unix sockets,
//! so they are reached inside the host's network namespace).

use crate::host::{in_host, Host};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;

fn connect_abstract(name: &str) -> std::io::Result<UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let s = UnixStream::connect_addr(&addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

fn send(s: &mut UnixStream, m: &Msg) -> std::io::Result<()> {
    s.write_all(&m.encode())
}

fn recv(s: &mut UnixStream) -> std::io::Result<Msg> {
    let mut pre = [0u8; 4];
    s.read_exact(&mut pre)?;
    let n = Msg::body_len(pre).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let mut body = vec![0u8; n];
    s.read_exact(&mut body)?;
    Msg::decode(&body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// One request to the agent of `host`.
pub fn ask_agent(host: &Host, socket: &str, m: &Msg, timeout: Duration) -> Result<Msg, String> {
    let mut s = in_host(host, || connect_abstract(socket))?
        .map_err(|e| format!("no agent on @{socket} in host {}: {e}", host.name()))?;
    let _ = s.set_read_timeout(Some(timeout));
    send(&mut s, m).and_then(|_| recv(&mut s)).map_err(|e| format!("agent of {}: {e}", host.name()))
}

/// Tells process `pid` (frozen, now in `host`) to go on; its report.
pub fn thaw(host: &Host, socket: &str, pid: i32, timeout: Duration) -> Result<Msg, String> {
    let name = format!("{socket}-thaw-{pid}");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut s = loop {
        match in_host(host, || connect_abstract(&name))? {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(format!("process {pid} does not wait for a thaw in {}: {e}", host.name()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let _ = s.set_read_timeout(Some(timeout));
    send(&mut s, &Msg::Thaw { pid: pid as u32 }).map_err(|e| format!("thaw {pid}: {e}"))?;
    recv(&mut s).map_err(|e| format!("process {pid} did not report after its thaw: {e}"))
}
