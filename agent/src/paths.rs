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
//!
//! Heartbeats are sealed with the cluster's key ([`crate::mesh`]) and bound to their path
//! (both addresses are authenticated with them). Each carries the last heartbeat number the
//! sender heard from the receiver on that path; a heartbeat counts only when that number is
//! one of the receiver's last [`FRESH_ROUNDS`] (so a path lives only while both directions
//! work), and a heartbeat number is taken once. A stranger cannot forge one, and one recorded
//! earlier cannot keep a dead path alive.
//!
//! Each path also carries the peer's MAC address on that network, as the kernel's neighbour
//! table (`/proc/net/arp`, resolved by the heartbeats themselves) says: read when a path comes
//! alive and once a second, never guessed (none while the entry is missing or incomplete).

use crate::events::Events;
use crate::journal::Journal;
use crate::mesh::{ClusterKey, Refusals, Refused};
use crate::net::{self, Iface};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use substrate::procfs::{format_mac, parse_proc_arp};
use substrate::wire::agent::Msg;
use tracing::{debug, info, warn};

/// How often each path is probed, by default.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(10);
/// Silence after which a path is dead, by default (five probes missed: a silent failure is
/// noticed 40-50 ms after it happens; a link that goes down on this node, at the next probe).
pub const DEFAULT_DEAD_AFTER: Duration = Duration::from_millis(50);
/// How many of its own latest heartbeat numbers a receiver takes as an echo: at least 16
/// rounds, and twice the silence that kills a path.
pub const FRESH_ROUNDS: u64 = 16;

#[derive(Debug)]
struct Peer {
    node: String,
    port: u16,
    last_seen: Option<Instant>,
    /// What the processes were last told (true = dead).
    dead: bool,
    /// The last heartbeat heard from it on this path (start-up number, heartbeat number):
    /// echoed in ours.
    heard: (u64, u64),
    /// Its MAC address on the path's network, from the neighbour table.
    mac: Option<[u8; 6]>,
}

impl Peer {
    fn new(node: String, port: u16) -> Self {
        Peer { node, port, last_seen: None, dead: false, heard: (0, 0), mac: None }
    }
}

#[derive(Default)]
struct State {
    ifaces: Vec<Iface>,
    refreshed: Option<Instant>,
    admin_down: HashSet<String>,
    peers: HashMap<IpAddr, Peer>,
    /// This agent's latest heartbeat number.
    seq: u64,
    /// When the neighbour table was last read.
    arp_read: Option<Instant>,
    /// A path came alive since: read the neighbour table soon.
    arp_due: bool,
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
    key: ClusterKey,
    refusals: Arc<Refusals>,
    journal: Arc<Journal>,
    /// This agent's start-up number (random, never 0).
    boot: u64,
    fresh: u64,
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
    /// The interface's MAC address (`aa:bb:cc:dd:ee:ff`), if it has one.
    pub mac: Option<String>,
    /// The interface's MTU.
    pub mtu: Option<u32>,
}

/// Another node as this agent knows it.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// Its name in reports (from its heartbeats), or its address before it was heard.
    pub name: String,
    /// Its addresses this agent probes.
    pub addrs: Vec<IpAddr>,
    /// One of them on a working path.
    pub reach: Option<IpAddr>,
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
    /// The peer's MAC address on this network, from the kernel's neighbour table; `None`
    /// while the entry is missing or incomplete.
    pub peer_mac: Option<String>,
}

/// How often the neighbour table is read for the peers' MAC addresses.
const ARP_EVERY: Duration = Duration::from_secs(1);
/// The soonest it is read again after a path came alive.
const ARP_SOON: Duration = Duration::from_millis(100);

impl Health {
    /// Path health for the agent of `node`, whose agents use `port` and share `key`.
    pub fn new(
        node: String,
        port: u16,
        interval: Duration,
        dead_after: Duration,
        key: ClusterKey,
        refusals: Arc<Refusals>,
        journal: Arc<Journal>,
    ) -> Self {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        let boot = u64::from_le_bytes(b).max(1);
        let fresh =
            FRESH_ROUNDS.max(2 * dead_after.as_nanos() as u64 / interval.as_nanos().max(1) as u64 + 2);
        Health {
            state: Mutex::new(State::default()),
            interval,
            dead_after,
            node,
            port,
            key,
            refusals,
            journal,
            boot,
            fresh,
        }
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
                Peer::new(String::new(), a.port())
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

    /// Where the node that has address `ip` is reached now: `ip`, or another address of the
    /// same node when the path to `ip` is dead.
    pub fn reach(&self, ip: IpAddr) -> Option<IpAddr> {
        self.alternative(ip).or(Some(ip))
    }

    /// Every other node this agent probes, by name (a node not heard yet is named by its
    /// address), with its addresses and one reached over a working path if any.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        let mut st = self.lock();
        let now = Instant::now();
        st.refresh(now);
        let mut out: Vec<NodeInfo> = Vec::new();
        let mut ips: Vec<&IpAddr> = st.peers.keys().collect();
        ips.sort();
        for ip in ips {
            let p = &st.peers[ip];
            let name = if p.node.is_empty() { ip.to_string() } else { p.node.clone() };
            let works = !p.dead
                && p.last_seen.is_some_and(|t| now.duration_since(t) < self.dead_after)
                && st.usable(*ip).is_some();
            let i = match out.iter().position(|n| n.name == name) {
                Some(i) => i,
                None => {
                    out.push(NodeInfo { name, addrs: Vec::new(), reach: None });
                    out.len() - 1
                }
            };
            out[i].addrs.push(*ip);
            if works && out[i].reach.is_none() {
                out[i].reach = Some(*ip);
            }
        }
        out
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
                self.journal.record(
                    "network",
                    None,
                    serde_json::json!({"network": i.name, "addr": i.addr.to_string(), "admin": "up"}),
                );
            }
        } else if st.admin_down.insert(i.name.clone()) {
            info!("network {} ({}) taken out of service", i.name, i.addr);
            self.journal.record(
                "network",
                None,
                serde_json::json!({"network": i.name, "addr": i.addr.to_string(), "admin": "down"}),
            );
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
                mac: i.mac.as_ref().map(format_mac),
                mtu: i.mtu,
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
                    peer_mac: p.mac.as_ref().map(format_mac),
                })
            })
            .collect();
        v.sort_by(|a, b| (&a.node, &a.peer).cmp(&(&b.node, &b.peer)));
        v
    }

    /// A datagram from `from` arrived on the heartbeat port.
    fn received(&self, from: SocketAddr, d: &[u8], events: &Events) {
        let mut st = self.lock();
        let now = Instant::now();
        st.refresh(now);
        // A network out of service ignores heartbeats (and never answers strangers).
        let Some(i) = st.usable(from.ip()).cloned() else { return };
        let Some(Msg::Probe { node, seq, boot, echo_boot, echo_seq }) =
            self.key.open_probe(d, from.ip(), i.addr)
        else {
            drop(st);
            self.refusals.note(Refused::Forged, || {
                format!("a heartbeat from {from} that is not sealed with this cluster's key (a stranger, or a node with another key)")
            });
            return;
        };
        let mine = st.seq;
        let p = st.peers.entry(from.ip()).or_insert_with(|| {
            info!("node {node} heard at {}", from.ip());
            Peer::new(node.clone(), from.port())
        });
        if boot == p.heard.0 && seq <= p.heard.1 {
            drop(st);
            self.refusals.note(Refused::Replayed, || {
                format!("heartbeat {seq} of node {node} from {from} came again (recorded and replayed?)")
            });
            return;
        }
        p.heard = (boot, seq);
        p.node = node;
        p.port = from.port();
        // Alive only if the sender heard one of our latest heartbeats: both ways work, and
        // the heartbeat is new.
        if echo_boot != self.boot || echo_seq > mine || mine - echo_seq > self.fresh {
            return;
        }
        let came_alive = p.last_seen.is_none() || p.dead;
        p.last_seen = Some(now);
        if p.dead {
            p.dead = false;
            info!("path {} -> {} on {} (node {}) works again", i.addr, from.ip(), i.name, p.node);
            self.journal.record(
                "path",
                None,
                serde_json::json!({"local": i.addr.to_string(), "peer": from.ip().to_string(), "node": p.node, "network": i.name, "state": "alive"}),
            );
            events.broadcast(&Msg::Path {
                local: SocketAddr::new(i.addr, 0),
                peer: SocketAddr::new(from.ip(), 0),
                up: true,
            });
        }
        if came_alive {
            st.arp_due = true;
        }
    }

    /// Reads the peers' MAC addresses from the kernel's neighbour table when it is due: once
    /// every [`ARP_EVERY`], or [`ARP_SOON`] after the last read when a path came alive.
    fn refresh_macs(&self, now: Instant) {
        {
            let mut st = self.lock();
            let since = st.arp_read.map(|t| now.saturating_duration_since(t));
            let due = since.is_none_or(|d| d >= ARP_EVERY || (st.arp_due && d >= ARP_SOON));
            if !due || st.peers.is_empty() {
                return;
            }
            // A path that comes alive while the table is read asks for the next read.
            st.arp_read = Some(now);
            st.arp_due = false;
        }
        let table = std::fs::read("/proc/net/arp").map(|t| parse_proc_arp(&t)).unwrap_or_default();
        let mut st = self.lock();
        let State { ifaces, peers, .. } = &mut *st;
        for (ip, p) in peers.iter_mut() {
            let dev = ifaces.iter().find(|i| i.contains(*ip)).map(|i| net::base_name(&i.name));
            p.mac = match (ip, dev) {
                (IpAddr::V4(v4), Some(dev)) => {
                    table.iter().find(|e| e.ip == *v4 && e.device == dev).map(|e| e.mac)
                }
                _ => None,
            };
        }
    }

    /// One round: probes every path and declares the silent ones dead.
    fn tick(&self, sock: &UdpSocket, seq: u64, late: bool, events: &Events) {
        // Heartbeats that arrived while the receiver thread waited for the CPU count too:
        // a busy machine must not look like a dead network.
        let mut buf = [0u8; crate::mesh::PROBE_MAX];
        while let Some((n, from)) = recv_now(sock, &mut buf) {
            self.received(from, &buf[..n], events);
        }
        let mut st = self.lock();
        let now = Instant::now();
        st.refresh(now);
        st.seq = seq;
        let mut died = Vec::new();
        let targets: Vec<Target> =
            st.peers.iter().map(|(ip, p)| (*ip, p.port, p.heard, st.usable(*ip).cloned())).collect();
        for (ip, port, heard, iface) in targets {
            let Some(i) = iface else { continue };
            let probe = self.key.seal_probe(
                &Msg::Probe {
                    node: self.node.clone(),
                    seq,
                    boot: self.boot,
                    echo_boot: heard.0,
                    echo_seq: heard.1,
                },
                i.addr,
                ip,
            );
            // A link that went down on this node fails the send itself: the path is dead now,
            // without waiting for the silence.
            let refused = match sock.send_to(&probe, SocketAddr::new(ip, port)) {
                Ok(_) => None,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENETUNREACH | libc::ENETDOWN | libc::EHOSTUNREACH | libc::EADDRNOTAVAIL)
                    ) =>
                {
                    Some(e)
                }
                Err(_) => None,
            };
            let p = st.peers.get_mut(&ip).expect("listed above");
            // After a round that came late (this thread waited for the CPU), silence is not
            // judged: the peer's heartbeats may be on their way.
            let quiet = p.last_seen.map(|t| now.duration_since(t));
            let silent = !late && quiet.is_some_and(|q| q >= self.dead_after);
            if refused.is_some() && !p.dead {
                p.dead = true;
                died.push((i, ip, p.node.clone(), refused, quiet));
            } else if silent && !p.dead {
                p.dead = true;
                died.push((i, ip, p.node.clone(), None, quiet));
            }
        }
        drop(st);
        self.refresh_macs(now);
        let port = self.port;
        for (i, ip, node, cannot_send, quiet) in died {
            let refused = cannot_send.is_some();
            self.journal.record(
                "path",
                None,
                serde_json::json!({
                    "local": i.addr.to_string(),
                    "peer": ip.to_string(),
                    "network": i.name,
                    "state": "dead",
                    "reason": if refused { "this node cannot send on it".to_string() } else { format!("silent for {} ms", self.dead_after.as_millis()) },
                }),
            );
            match cannot_send {
                Some(e) => warn!(
                    "path {} -> {ip} on {} (node {node}) is dead: this node cannot send on it ({e}); its connections move to another network (check the interface and routes: `ip addr show {}`, `ip route get {ip}`)",
                    i.addr, i.name, i.name
                ),
                None => warn!(
                    "path {} -> {ip} on {} (node {node}) is dead: no heartbeat for {} ms (limit {} ms); its connections move to another network (check the link, the agent on {ip}, and that UDP port {port} is open both ways)",
                    i.addr,
                    i.name,
                    quiet.unwrap_or(self.dead_after).as_millis(),
                    self.dead_after.as_millis()
                ),
            }
            events.broadcast(&Msg::Path {
                local: SocketAddr::new(i.addr, 0),
                peer: SocketAddr::new(ip, 0),
                up: false,
            });
        }
    }
}

/// A peer address to probe: its port, what it was last heard to say, the local network.
type Target = (IpAddr, u16, (u64, u64), Option<Iface>);

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
            let mut buf = [0u8; crate::mesh::PROBE_MAX];
            loop {
                match rsock.recv_from(&mut buf) {
                    Ok((n, from)) => h2.received(from, &buf[..n], &e2),
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
            let mut seq = 1u64;
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
