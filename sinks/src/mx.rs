//! The Myrinet-style protocol on raw Ethernet (`substrate::mx`) as a sink: each link is one
//! [`MxLink`] session between two hosts' interfaces, its packets moved through the kernel's
//! packet rings (the layer's own driver, `preload/src/sys/packet.rs`).
//!
//! * **Ports.** One packet socket per interface and process ([`Port`]): it sorts what arrives
//!   by (source MAC, session) into the queues of the links that own them; a session it does
//!   not know is a new link for a passive endpoint on that interface, and dropped otherwise.
//! * **Set-up.** A passive endpoint's address is its IPv4 address, its MAC and the
//!   interface's MTU (12 bytes). The dialling side picks its interface on the same network
//!   (the one whose subnet holds that address), a random session, and sends a hello message
//!   on it; the link is up once the hello is acknowledged. The passive side takes a new
//!   session whose first message is that hello.
//! * **Failure.** Like the protocol itself, a link does not judge the network: a link the
//!   other side gave up is replaced by the next one it dials (the conformance driver takes a
//!   new link as the end of the old one, as the layer's agents would tell it).

#[allow(dead_code, unsafe_code, clippy::all)]
#[path = "../../preload/src/sys/packet.rs"]
mod packet;

use crate::{Link, Listener, Sink};
use packet::PacketRing;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::time::{Duration, Instant};
use substrate::mx::{MxConfig, MxLink, ETHERTYPE, ETH_HEADER};

/// Bytes of each packet ring.
const RING_BYTES: usize = 8 << 20;
/// The first message of every link.
const HELLO: &[u8] = b"vmi mx link v1";
/// Largest message a link sends (one connection frame or part of one).
const MSG: usize = 64 << 10;
/// Packets queued for one link at most (more are dropped: the peer sends them again).
const QUEUE_MAX: usize = 8192;

type Key = ([u8; 6], u32);

/// One interface's packet socket and what arrived on it, by link.
struct Port {
    ring: PacketRing,
    mac: [u8; 6],
    mtu: usize,
    queues: HashMap<Key, VecDeque<Vec<u8>>>,
    /// Sessions seen for the first time, for a passive endpoint.
    fresh: VecDeque<Key>,
    /// Sessions refused (not a hello first), not looked at again.
    refused: HashSet<Key>,
    listening: bool,
}

impl Port {
    fn open(iface: &str) -> io::Result<Port> {
        let ring = PacketRing::open(iface, ETHERTYPE, RING_BYTES)
            .map_err(|e| io::Error::other(format!("a packet socket on {iface}: {e}")))?;
        let (mac, mtu) = (ring.mac(), ring.mtu());
        Ok(Port {
            ring,
            mac,
            mtu,
            queues: HashMap::new(),
            fresh: VecDeque::new(),
            refused: HashSet::new(),
            listening: false,
        })
    }

    /// Sorts every packet waiting in the ring into its link's queue.
    fn pump(&mut self) {
        let (queues, fresh, refused, listening) =
            (&mut self.queues, &mut self.fresh, &self.refused, self.listening);
        self.ring.recv_each(usize::MAX, |fr| {
            if fr.len() < ETH_HEADER + 8 || fr[12..14] != ETHERTYPE.to_be_bytes() {
                return;
            }
            let mut src = [0u8; 6];
            src.copy_from_slice(&fr[6..12]);
            let p = &fr[ETH_HEADER..];
            let session = u32::from_le_bytes(p[4..8].try_into().expect("4 bytes"));
            let key = (src, session);
            match queues.get_mut(&key) {
                Some(q) if q.len() < QUEUE_MAX => q.push_back(p.to_vec()),
                Some(_) => {}
                None if listening && !refused.contains(&key) && fresh.len() < 64 => {
                    queues.insert(key, VecDeque::from([p.to_vec()]));
                    fresh.push_back(key);
                }
                None => {}
            }
        });
    }

    fn send(&mut self, to: [u8; 6], p: &[u8]) {
        let mut h = [0u8; ETH_HEADER];
        h[..6].copy_from_slice(&to);
        h[6..12].copy_from_slice(&self.mac);
        h[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
        let len = ETH_HEADER + p.len();
        for _ in 0..1000 {
            if self.ring.push(len, |f| {
                f[..ETH_HEADER].copy_from_slice(&h);
                f[ETH_HEADER..].copy_from_slice(p);
            }) {
                return;
            }
            // Full: hand the kernel what is there and let it send some.
            let _ = self.ring.flush();
            std::thread::yield_now();
        }
        // (Still full: the packet is lost, and sent again after the time-out.)
    }

    fn flush(&mut self) {
        if self.ring.unflushed() > 0 {
            let _ = self.ring.flush();
        }
    }
}

/// The `mx` sink.
#[derive(Default)]
pub struct Mx {
    ports: RefCell<HashMap<String, Rc<RefCell<Port>>>>,
}

impl Mx {
    fn port(&self, iface: &str) -> io::Result<Rc<RefCell<Port>>> {
        if let Some(p) = self.ports.borrow().get(iface) {
            return Ok(p.clone());
        }
        let p = Rc::new(RefCell::new(Port::open(iface)?));
        self.ports.borrow_mut().insert(iface.to_string(), p.clone());
        Ok(p)
    }
}

/// The interfaces' IPv4 addresses: (name, address, prefix length).
fn interfaces() -> Vec<(String, Ipv4Addr, u32)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut at = head;
    while !at.is_null() {
        // SAFETY: a node of the list getifaddrs made.
        let i = unsafe { &*at };
        at = i.ifa_next;
        if i.ifa_addr.is_null() || i.ifa_netmask.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points at a sockaddr of the family it names.
        if unsafe { (*i.ifa_addr).sa_family } as i32 != libc::AF_INET {
            continue;
        }
        // SAFETY: AF_INET: both are sockaddr_in.
        let (a, m) = unsafe {
            (&*(i.ifa_addr as *const libc::sockaddr_in), &*(i.ifa_netmask as *const libc::sockaddr_in))
        };
        // SAFETY: a NUL-terminated name.
        let name = unsafe { std::ffi::CStr::from_ptr(i.ifa_name) }.to_string_lossy().into_owned();
        let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
        let prefix = u32::from_be(m.sin_addr.s_addr).count_ones();
        out.push((name, ip, prefix));
    }
    // SAFETY: the list getifaddrs made, freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

fn same_net(a: Ipv4Addr, b: Ipv4Addr, prefix: u32) -> bool {
    let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix.min(32)) };
    u32::from(a) & mask == u32::from(b) & mask
}

fn session() -> u32 {
    let mut b = [0u8; 4];
    use std::io::Read;
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        b = (t.subsec_nanos() ^ std::process::id()).to_le_bytes();
    }
    u32::from_le_bytes(b) | 1
}

/// One link: a session with one peer, through its interface's port.
struct MxIo {
    port: Rc<RefCell<Port>>,
    key: Key,
    link: MxLink,
    t0: Instant,
    /// Delivered bytes not read yet.
    inbuf: VecDeque<u8>,
}

impl MxIo {
    fn new(port: Rc<RefCell<Port>>, key: Key) -> MxIo {
        let mtu = port.borrow().mtu;
        port.borrow_mut().queues.entry(key).or_default();
        MxIo {
            port,
            key,
            link: MxLink::new(MxConfig::new(mtu, key.1)),
            t0: Instant::now(),
            inbuf: VecDeque::new(),
        }
    }

    fn now(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    /// Packets in, time-outs, packets out.
    fn io(&mut self) {
        let now = self.now();
        let mut port = self.port.borrow_mut();
        port.pump();
        if let Some(q) = port.queues.get_mut(&self.key) {
            while let Some(p) = q.pop_front() {
                let _ = self.link.handle_packet(now, &p);
            }
        }
        self.link.handle_timeout(now);
        while let Some(p) = self.link.poll_packet(now) {
            port.send(self.key.0, &p);
        }
        port.flush();
        drop(port);
        while let Some(m) = self.link.poll_message() {
            self.inbuf.extend(m);
        }
    }
}

impl Drop for MxIo {
    fn drop(&mut self) {
        self.port.borrow_mut().queues.remove(&self.key);
    }
}

impl Link for MxIo {
    fn send(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut took = 0;
        let now = self.now();
        while took < buf.len() && self.link.can_send() {
            let k = (buf.len() - took).min(MSG);
            if self.link.send(now, buf[took..took + k].to_vec()).is_err() {
                break;
            }
            took += k;
        }
        self.io();
        Ok(took)
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.io();
        let n = buf.len().min(self.inbuf.len());
        for (d, s) in buf.iter_mut().zip(self.inbuf.drain(..n)) {
            *d = s;
        }
        Ok(n)
    }

    fn arm(&mut self) -> Option<RawFd> {
        self.io();
        let waiting = self.port.borrow().queues.get(&self.key).is_some_and(|q| !q.is_empty());
        if !self.inbuf.is_empty() || waiting {
            return None;
        }
        Some(self.port.borrow().ring.fd())
    }
}

struct MxPassive {
    port: Rc<RefCell<Port>>,
    /// New sessions whose hello is not whole yet, and since when.
    pending: Vec<(MxIo, Instant)>,
}

impl Listener for MxPassive {
    fn accept(&mut self, wait: Duration) -> io::Result<Box<dyn Link>> {
        let end = Instant::now() + wait;
        loop {
            self.port.borrow_mut().pump();
            let fresh = self.port.borrow_mut().fresh.pop_front();
            if let Some(key) = fresh {
                self.pending.push((MxIo::new(self.port.clone(), key), Instant::now()));
            }
            // A new session is a link once its first message, the hello, is here.
            let mut i = 0;
            while i < self.pending.len() {
                let (io, since) = &mut self.pending[i];
                io.io();
                let whole = io.inbuf.len() >= HELLO.len();
                let stale = since.elapsed() > Duration::from_secs(5);
                if !whole && !stale {
                    i += 1;
                    continue;
                }
                let (mut io, _) = self.pending.swap_remove(i);
                if whole && io.inbuf.iter().take(HELLO.len()).copied().eq(HELLO.iter().copied()) {
                    io.inbuf.drain(..HELLO.len());
                    return Ok(Box::new(io));
                }
                // (Not a link of this sink: its session is ignored from now on.)
                self.port.borrow_mut().refused.insert(io.key);
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no mx link came"));
            }
            let fd = self.port.borrow().ring.fd();
            crate::check::wait_readable(&[fd], left.min(Duration::from_millis(5)));
        }
    }
}

impl Sink for Mx {
    fn name(&self) -> &str {
        "mx"
    }

    fn listen(&self, ip: &str) -> io::Result<(Box<dyn Listener>, Vec<u8>)> {
        let ip: Ipv4Addr = ip
            .parse()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("not an IPv4 address: {ip}")))?;
        let (iface, _, _) = interfaces()
            .into_iter()
            .find(|(_, a, _)| *a == ip)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no interface has {ip}")))?;
        let port = self.port(&iface)?;
        let mut addr = ip.octets().to_vec();
        {
            let mut p = port.borrow_mut();
            p.listening = true;
            addr.extend_from_slice(&p.mac);
            addr.extend_from_slice(&(p.mtu as u16).to_le_bytes());
        }
        Ok((Box::new(MxPassive { port, pending: Vec::new() }), addr))
    }

    fn connect(&self, addr: &[u8], wait: Duration) -> io::Result<Box<dyn Link>> {
        if addr.len() != 12 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not an mx endpoint address"));
        }
        let ip = Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3]);
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&addr[4..10]);
        let mtu = u16::from_le_bytes([addr[10], addr[11]]) as usize;
        let (iface, _, _) =
            interfaces().into_iter().find(|(_, a, p)| *p > 0 && same_net(*a, ip, *p)).ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, format!("no interface on the network of {ip}"))
            })?;
        let port = self.port(&iface)?;
        if port.borrow().mtu != mtu {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("MTU {} on {iface}, {mtu} at the peer: mx needs the same on both", port.borrow().mtu),
            ));
        }
        let mut io = MxIo::new(port, (mac, session()));
        if io.link.send(0, HELLO.to_vec()).is_err() {
            return Err(io::Error::other("the hello does not fit"));
        }
        let end = Instant::now() + wait;
        loop {
            io.io();
            if io.link.in_flight() == 0 {
                return Ok(Box::new(io));
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no mx endpoint answered at {ip}"),
                ));
            }
            let fd = io.port.borrow().ring.fd();
            crate::check::wait_readable(&[fd], left.min(Duration::from_millis(5)));
        }
    }
}
