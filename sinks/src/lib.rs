//! # vmi sinks
//!
//! Link devices: what carries a connection's frames between two layers. A link is, while it
//! is up, a reliable ordered byte stream ([`Link`]); the connection core
//! (`substrate::connection`) puts frames on it, remembers them until the peer acknowledges
//! them, and sends them again on another link when one fails.
//!
//! * [`plugin`]: sinks from shared libraries loaded at run time (`plugins/vmi_sink.h`), such
//!   as RDMA verbs: the layer never links the libraries they need.
//! * [`tcp`]: kernel TCP, the reference sink.
//! * [`mx`]: the Myrinet-style protocol on raw Ethernet (`substrate::mx`) through the
//!   kernel's packet rings.
//! * [`check`]: the conformance tests every sink passes (the core driven over a sink's links
//!   between two processes: streams both ways, ping-pong, links cut and rebuilt, the end of
//!   stream), run by the `sink-check` program.

pub mod check;
pub mod mx;
pub mod plugin;
pub mod tcp;

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

/// One link of a sink: a reliable ordered byte stream between two processes while it is up.
pub trait Link {
    /// Takes bytes for the peer: how many (0: no room now), or an error once the link failed.
    fn send(&mut self, buf: &[u8]) -> io::Result<usize>;
    /// Bytes from the peer: how many (0: none now), or an error once the link failed or the
    /// peer closed it.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Readies the link for a wait: a descriptor readable when `send` or `recv` may make
    /// progress, or `None` when they may now (call them again first).
    fn arm(&mut self) -> Option<RawFd>;
}

/// A passive endpoint: links the peer connects come out of it.
pub trait Listener {
    /// The next link, waiting at most `wait`.
    fn accept(&mut self, wait: Duration) -> io::Result<Box<dyn Link>>;
}

/// A sink: how a node reaches another over one kind of network.
pub trait Sink {
    /// Its name (`tcp`, `verbs`, ...).
    fn name(&self) -> &str;
    /// A passive endpoint at local address `ip`, and the address the peer connects to.
    fn listen(&self, ip: &str) -> io::Result<(Box<dyn Listener>, Vec<u8>)>;
    /// A link to the passive endpoint at `addr`, waiting at most `wait`.
    fn connect(&self, addr: &[u8], wait: Duration) -> io::Result<Box<dyn Link>>;
}

/// The sink called `name`: `tcp`, `mx`, or plug-in `libvmi_sink_NAME.so` of folder `dir`.
pub fn open(name: &str, dir: &std::path::Path) -> Result<Box<dyn Sink>, String> {
    match name {
        "tcp" => return Ok(Box::new(tcp::Tcp)),
        "mx" => return Ok(Box::new(mx::Mx::default())),
        _ => {}
    }
    plugin::SinkPlugin::open(dir, name).map(|p| Box::new(p) as Box<dyn Sink>)
}
