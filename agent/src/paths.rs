//! Path health: the agent probes every network path to every node it has connections with
//! (one heartbeat per path, not per connection) and tells the node's processes when a path
//! dies or comes back.
//!
//! A *path* is a peer node's address together with the local network on the same subnet.
//! Every `interval` the agent sends a UDP [`Msg::Probe`] to each peer address from the
//! agent's port; a path is dead when nothing was heard from that address for `dead_after`
//! (50 ms by default). Peers are learnt from the agents' answers when connections are set
//! up (each lists every address of its node) and from the probes that arrive.
//!
//! A network an administrator took out of service (`vmictl net down`) sends no probes and
//! ignores the ones that arrive, so both ends see its paths die and connections move off it.

use crate::events::Events;
use crate::net::{self, Iface};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;
use tracing::{debug, info, warn};

/// How often each path is probed, by default.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(10);
/// Silence after which a path is dead, by default (five probes missed: a silent failure is
/// noticed 40-50 ms after it happens; a link that goes down on this node, at the next probe).
pub const DEFAULT_DEAD_AFTER: Duration = Duration::from_millis(50);

#[derive(Debug)]
struct Peer {
    node: String,
    port: u16,
    last_seen: Option<Instant>,
    /// What the processes were last told (true = dead).
    dead: bool,
}

#[derive(Default)]
struct State {
    ifaces: Vec<Iface>,
    refreshed: Option<Instant>,
    admin_down: HashSet<String>,
    peers: HashMap<IpAddr, Peer>,
}

impl State {
    fn refresh(&mut self, now: Instant) {
        if self.refreshed.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1)) {
            self.ifaces = net::interfaces();
            self.refreshed = Some(now);
        }
    }

    fn iface_for(&self, ip: IpAddr) -> Option<&Iface> {
        self.ifaces.iter().find(|i| i.contains(ip))
    }

    fn usable(&self, ip: IpAddr) -> Option<&Iface> {
        self.iface_for(ip).filter(|i| !self.admin_down.contains(&i.name))
    }
}

/// The node's networks and the health of every path to other nodes.
pub struct Health {
    state: Mutex<State>,
    /// Probe interval.
    pub interval: Duration,
    /// Silence that kills a path.
    pub dead_after: Duration,
    node: String,
    port: u16,
}

/// A network as `vmictl status` shows it.
#[derive(Serialize, Clone, Debug)]
pub struct NetJson {
    /// Interface name.
    pub name: String,
    /// Address.
    pub addr: String,
    /// "up" or "down" (taken out of service).
    pub admin: &'static str,
}

/// A path as `vmictl status` shows it.
#[derive(Serialize, Clone, Debug)]
pub struct PathJson {
    /// Peer node's name.
    pub node: String,
    /// Local address.
    pub local: String,
    /// Peer address.
    pub peer: String,
    /// Local network's interface.
    pub network: String,
    /// "alive", "dead" or "unknown" (not heard from yet).
    pub state: &'static str,
    /// Milliseconds since the peer was last heard on this path.
    pub silent_ms: Option<u64>,
}

impl Health {
    /// Path health for the agent of `node`, whose agents use `port`.
    pub fn new(node: String, port: u16, interval: Duration, dead_after: Duration) -> Self {
        Health { state: Mutex::new(State::default()), interval, dead_after, node, port }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This node's agent addresses, one per network (what other nodes dial to reach it).
    pub fn advertised(&self) -> Vec<SocketAddr> {
        let mut st = self.lock();
        st.refresh(Instant::now());
        st.ifaces.iter().map(|i| SocketAddr::new(i.addr, self.port)).collect()
    }

    /// Starts probing the agent addresses `addrs` of another node.
    pub fn learn(&self, addrs: &[SocketAddr]) {
        let mut st = self.lock();
        st.refresh(Instant::now());
        for a in addrs {
            if net::is_local(a.ip()) {
                continue;
            }
            st.peers.entry(a.ip()).or_insert_with(|| {
                debug!("probing {a}");
                Peer { node: String::new(), port: a.port(), last_seen: None, dead: false }
            });
        }
    }

    /// The working paths toward the node reachable at `peers`, best first: paths heard from
    /// recently, then paths not probed yet; dead paths and networks out of service are left
    /// out.
    pub fn paths_to(&self, peers: &[SocketAddr]) -> Vec<(SocketAddr, SocketAddr)> {
        let mut st = self.lock();
        let now = Instant::now();
        st.refresh(now);
        let mut heard = Vec::new();
        let mut unknown = Vec::new();
        for p in peers {
            let Some(i) = st.usable(p.ip()) else { continue };
            let local = SocketAddr::new(i.addr, 0);
            match st.peers.get(&p.ip()) {
                Some(x) if x.dead => {}
                Some(Peer { last_seen: Some(t), .. }) if now.duration_since(*t) < self.dead_after => {
                    heard.push((local, *p))
                }
                Some(Peer { last_seen: Some(_), .. }) => {}
                _ => unknown.push((local, *p)),
            }
        }
        heard.extend(unknown);
        heard
    }

    /// True when the path toward `ip` is known dead (or its network is out of service).
    pub fn is_dead(&self, ip: IpAddr) -> bool {
        let mut st = self.lock();
        st.refresh(Instant::now());
        match st.peers.get(&ip) {
            Some(p) => p.dead || st.usable(ip).is_none(),
            None => false,
        }
    }

    /// Another address of the node at `ip`, on a working path, when the path to `ip` itself
    /// is dead (or its network is out of service); `None` when `ip`'s path works or is not
    /// known to be dead.
    pub fn alternative(&self, ip: IpAddr) -> Option<IpAddr> {
        let mut st = self.lock();
        let now = Instant::now();
        st.refresh(now);
        let p = st.peers.get(&ip)?;
        let down = p.dead || st.usable(ip).is_none();
        if !down || p.node.is_empty() {
            return None;
        }
        let node = p.node.clone();
        st.peers
            .iter()
            .filter(|(a, q)| {
                **a != ip
                    && q.node == node
                    && !q.dead
                    && q.last_seen.is_some_and(|t| now.duration_since(t) < self.dead_after)
                    && st.usable(**a).is_some()
            })
            .map(|(a, _)| *a)
            .next()
    }

    /// Takes network `name` (an interface name or one of its addresses) out of service, or
    /// puts it back. Returns the interface name.
    pub fn set_admin(&self, name: &str, up: bool, events: &Events) -> Result<String, String> {
        let mut st = self.lock();
        st.refreshed = None;
        st.refresh(Instant::now());
        let Some(i) = st.ifaces.iter().find(|i| i.name == name || i.addr.to_string() == name).cloned() else {
            let known: Vec<String> = st.ifaces.iter().map(|i| format!("{} ({})", i.name, i.addr)).collect();
            return Err(format!("no network {name} on this node; networks: {}", known.join(", ")));
        };
        if up {
            if st.admin_down.remove(&i.name) {
                info!("network {} ({}) back in service", i.name, i.addr);
            }
        } else if st.admin_down.insert(i.name.clone()) {
            info!("network {} ({}) taken out of service", i.name, i.addr);
            // Its paths are dead for this node's processes at once.
            let ips: Vec<IpAddr> = st.peers.keys().copied().filter(|p| i.contains(*p)).collect();
            for ip in ips {
                if let Some(p) = st.peers.get_mut(&ip) {
                    p.dead = true;
                }
                events.broadcast(&Msg::Path {
                    local: SocketAddr::new(i.addr, 0),
                    peer: SocketAddr::new(ip, 0),
                    up: false,
                });
            }
        }
        Ok(i.name)
    }

    /// The networks, for reports.
    pub fn networks(&self) -> Vec<NetJson> {
        let mut st = self.lock();
        st.refresh(Instant::now());
        st.ifaces
            .iter()
            .map(|i| NetJson {
                name: i.name.clone(),
                addr: i.addr.to_string(),
                admin: if st.admin_down.contains(&i.name) { "down" } else { "up" },
            })
            .collect()
    }

    /// The interface that carries traffic to or from `ip` (a local address or a peer's).
    pub fn network_of(&self, ip: IpAddr) -> Option<String> {
        let st = self.lock();
        st.ifaces.iter().find(|i| i.addr == ip || i.contains(ip)).map(|i| i.name.clone())
    }

    /// Every path, for reports.
    pub fn paths(&self) -> Vec<PathJson> {
        let st = self.lock();
        let now = Instant::now();
        let mut v: Vec<PathJson> = st
            .peers
            .iter()
            .filter_map(|(ip, p)| {
                let i = st.iface_for(*ip)?;
                let state = if p.dead || st.admin_down.contains(&i.name) {
                    "dead"
                } else if p.last_seen.is_some() {
                    "alive"
                } else {
                    "unknown"
                };
                Some(PathJson {
                    node: p.node.clone(),
                    local: i.addr.to_string(),
                    peer: ip.to_string(),
                    network: i.name.clone(),
                    state,
                    silent_ms: p.last_seen.map(|t| now.duration_since(t).as_millis() as u64),
                })
            })
            .collect();
        v.sort_by(|a, b| (&a.node, &a.peer).cmp(&(&b.node, &b.peer)));
        v
    }

    /// A probe from `from` arrived.
    fn heard(&self, from: SocketAddr, node: String, events: &Events) {
        let mut st = self.lock();
        let now = Instant::now();
        st.refresh(now);
        let Some(i) = st.usable(from.ip()).cloned() else { return };
        let p = st.peers.entry(from.ip()).or_insert_with(|| {
            info!("node {node} heard at {}", from.ip());
            Peer { node: node.clone(), port: from.port(), last_seen: None, dead: false }
        });
        p.node = node;
        p.port = from.port();
        p.last_seen = Some(now);
        if p.dead {
            p.dead = false;
            info!("path {} -> {} ({}) works again", i.addr, from.ip(), i.name);
            events.broadcast(&Msg::Path {
                local: SocketAddr::new(i.addr, 0),
                peer: SocketAddr::new(from.ip(), 0),
                up: true,
            });
        }
    }

    /// One round: probes every path and declares the silent ones dead.
    fn tick(&self, sock: &UdpSocket, seq: u64, late: bool, events: &Events) {
        // Heartbeats that arrived while the receiver thread waited for the CPU count too:
        // a busy machine must not look like a dead network.
        let mut buf = [0u8; 512];
        while let Some((n, from)) = recv_now(sock, &mut buf) {
            if let Ok(Msg::Probe { node, .. }) = Msg::decode_framed(&buf[..n]) {
                self.heard(from, node, events);
            }
        }
        let probe = Msg::Probe { node: self.node.clone(), seq }.encode();
        let mut st = self.lock();
        let now = Instant::now();
        st.refresh(now);
        let mut died = Vec::new();
        let targets: Vec<(IpAddr, u16, Option<Iface>)> =
            st.peers.iter().map(|(ip, p)| (*ip, p.port, st.usable(*ip).cloned())).collect();
        for (ip, port, iface) in targets {
            let Some(i) = iface else { continue };
            // A link that went down on this node fails the send itself: the path is dead now,
            // without waiting for the silence.
            let refused = match sock.send_to(&probe, SocketAddr::new(ip, port)) {
                Ok(_) => false,
                Err(e) => matches!(
                    e.raw_os_error(),
                    Some(libc::ENETUNREACH | libc::ENETDOWN | libc::EHOSTUNREACH | libc::EADDRNOTAVAIL)
                ),
            };
            let p = st.peers.get_mut(&ip).expect("listed above");
            // After a round that came late (this thread waited for the CPU), silence is not
            // judged: the peer's heartbeats may be on their way.
            let silent = !late && p.last_seen.is_some_and(|t| now.duration_since(t) >= self.dead_after);
            if refused && !p.dead {
                p.dead = true;
                died.push((i, ip, true));
            } else if silent && !p.dead {
                p.dead = true;
                died.push((i, ip, false));
            }
        }
        drop(st);
        for (i, ip, refused) in died {
            if refused {
                warn!("path {} -> {ip} ({}) is dead: this node cannot send on it", i.addr, i.name);
            } else {
                warn!(
                    "path {} -> {ip} ({}) is dead: silent for {} ms",
                    i.addr,
                    i.name,
                    self.dead_after.as_millis()
                );
            }
            events.broadcast(&Msg::Path {
                local: SocketAddr::new(i.addr, 0),
                peer: SocketAddr::new(ip, 0),
                up: false,
            });
        }
    }
}

/// One datagram waiting on `sock`, without blocking.
fn recv_now(sock: &UdpSocket, buf: &mut [u8]) -> Option<(usize, SocketAddr)> {
    use std::os::fd::AsRawFd;
    // SAFETY: zeroed sockaddr_storage is valid; the kernel writes at most `len` bytes.
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: valid buffer and address storage.
    let n = unsafe {
        libc::recvfrom(
            sock.as_raw_fd(),
            buf.as_mut_ptr() as *mut _,
            buf.len(),
            libc::MSG_DONTWAIT,
            &mut st as *mut _ as *mut libc::sockaddr,
            &mut len,
        )
    };
    if n < 0 {
        return None;
    }
    let from = match st.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says sockaddr_in.
            let a = unsafe { &*(&st as *const _ as *const libc::sockaddr_in) };
            SocketAddr::new(
                IpAddr::V4(std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))),
                u16::from_be(a.sin_port),
            )
        }
        libc::AF_INET6 => {
            // SAFETY: the family says sockaddr_in6.
            let a = unsafe { &*(&st as *const _ as *const libc::sockaddr_in6) };
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            SocketAddr::new(
                ip.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(ip)),
                u16::from_be(a.sin6_port),
            )
        }
        _ => return None,
    };
    Some((n as usize, from))
}

/// Raises the calling thread's priority (when allowed): a heartbeat delayed by a busy CPU
/// would look like a dead path.
fn urgent() {
    // SAFETY: gettid and setpriority on the calling thread; failure only leaves it as it was.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, -10);
    }
}

/// Runs the prober and the probe receiver on `sock` (the agent's UDP port).
pub fn run(health: Arc<Health>, events: Arc<Events>, sock: UdpSocket) {
    let (h2, e2) = (health.clone(), events.clone());
    let rsock = match sock.try_clone() {
        Ok(s) => s,
        Err(e) => {
            warn!("cannot clone the probe socket: {e}; path health is off");
            return;
        }
    };
    std::thread::Builder::new()
        .name("probe-rx".into())
        .spawn(move || {
            urgent();
            let mut buf = [0u8; 512];
            loop {
                match rsock.recv_from(&mut buf) {
                    Ok((n, from)) => match Msg::decode_framed(&buf[..n]) {
                        Ok(Msg::Probe { node, .. }) => h2.heard(from, node, &e2),
                        Ok(other) => debug!("unexpected datagram from {from}: {other:?}"),
                        Err(e) => debug!("malformed datagram from {from}: {e}"),
                    },
                    Err(e) => {
                        warn!("probe socket: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
        .expect("spawn the probe receiver");
    std::thread::Builder::new()
        .name("probe-tx".into())
        .spawn(move || {
            urgent();
            let mut seq = 0u64;
            let mut last = Instant::now();
            loop {
                let now = Instant::now();
                let late = now.duration_since(last) > health.interval + health.dead_after / 2;
                last = now;
                health.tick(&sock, seq, late, &events);
                seq += 1;
                std::thread::sleep(health.interval);
            }
        })
        .expect("spawn the prober");
}
