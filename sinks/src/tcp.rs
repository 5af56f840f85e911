//! Kernel TCP as a sink: the reference every other sink is checked against. A passive
//! endpoint is a listening socket; its address, the port and IP as text (`IP:PORT`).

use crate::{Link, Listener, Sink};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// The kernel TCP sink.
pub struct Tcp;

struct TcpLink(TcpStream);

struct TcpPassive(TcpListener);

fn link(s: TcpStream) -> io::Result<Box<dyn Link>> {
    s.set_nodelay(true)?;
    s.set_nonblocking(true)?;
    Ok(Box::new(TcpLink(s)))
}

impl Sink for Tcp {
    fn name(&self) -> &str {
        "tcp"
    }

    fn listen(&self, ip: &str) -> io::Result<(Box<dyn Listener>, Vec<u8>)> {
        let ip: std::net::IpAddr = ip
            .parse()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("not an IP address: {ip}")))?;
        let l = TcpListener::bind(SocketAddr::new(ip, 0))?;
        let addr = l.local_addr()?.to_string().into_bytes();
        l.set_nonblocking(true)?;
        Ok((Box::new(TcpPassive(l)), addr))
    }

    fn connect(&self, addr: &[u8], wait: Duration) -> io::Result<Box<dyn Link>> {
        let a: SocketAddr = std::str::from_utf8(addr)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a TCP endpoint address"))?;
        link(TcpStream::connect_timeout(&a, wait)?)
    }
}

impl Listener for TcpPassive {
    fn accept(&mut self, wait: Duration) -> io::Result<Box<dyn Link>> {
        let end = Instant::now() + wait;
        loop {
            match self.0.accept() {
                Ok((s, _)) => return link(s),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "no connection came"));
                    }
                    crate::check::wait_readable(&[self.0.as_raw_fd()], left.min(Duration::from_millis(50)));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Link for TcpLink {
    fn send(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self.0.write(buf) {
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.0.read(buf) {
            Ok(0) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the link")),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn arm(&mut self) -> Option<RawFd> {
        Some(self.0.as_raw_fd())
    }
}
