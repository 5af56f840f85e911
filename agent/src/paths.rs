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
use substrate::procfs::{format_mac, parse_proc_arp, parse_proc_net_dev};
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
    /// Heartbeats this agent sent on the path (each one's number).
    sent: u64,
    /// The longest the peer said it would wait before its next heartbeat on the path.
    every: Duration,
    /// When this agent sends its next heartbeat on the path.
    next: Option<Instant>,
    /// Heartbeats that announced the calm interval while still at the busy one.
    calm_told: u8,
    /// The longest wait after this agent's last heartbeat on the path: the one it announced,
    /// or the down interval on a path that does not work.
    told: Duration,
}

impl Peer {
    fn new(node: String, port: u16, every: Duration) -> Self {
        Peer {
            node,
            port,
            last_seen: None,
            dead: false,
            heard: (0, 0),
            mac: None,
            sent: 0,
            every,
            next: None,
            calm_told: 0,
            told: every,
        }
    }
}

/// How long the node's networks must carry nothing but heartbeats before heartbeats slow
/// down to [`CALM_INTERVAL`].
pub const CALM_AFTER: Duration = Duration::from_secs(3);
/// Heartbeat interval on a calm node (the configured one if that is longer). A path that
/// fails while calm is noticed within this plus the silence limit; traffic makes the node
/// busy again within [`CHECK_EVERY`].
pub const CALM_INTERVAL: Duration = Duration::from_secs(1);
/// How often a calm node looks at its interfaces' packet counters.
pub const CHECK_EVERY: Duration = Duration::from_millis(100);
/// Packets per look, beyond heartbeats, that a calm node still takes for idle (neighbour
/// discovery and the like).
const CALM_SLACK: u64 = 2;
/// Heartbeats announcing the calm interval sent at the busy one first (one may be lost).
const CALM_ANNOUNCE: u8 = 3;
/// Heartbeat interval on a path that does not work (dead, or never heard from), the
/// configured one if that is longer. A peer the kernel cannot resolve keeps every datagram
/// sent to it in the neighbour queue for the 3 s of a resolution, counted against the
/// heartbeat socket's send buffer; at the busy interval one such peer fills that buffer
/// (hundreds of heartbeats), and then the heartbeats of every working path wait or are lost
/// too, until the kernel gives up on the unreachable one. At this interval each such peer
/// holds about 30 of them.
pub const DOWN_INTERVAL: Duration = Duration::from_millis(100);
/// The send buffer asked for the heartbeat socket (the kernel may give less): room for the
/// heartbeats parked by many unreachable peers at once.
const SEND_BUFFER: libc::c_int = 4 << 20;

/// Whether the node's networks carry anything but heartbeats.
#[derive(Default)]
struct Activity {
    /// Packets counted on the node's interfaces at the last look, and heartbeats sent and
    /// received by then.
    last: Option<(u64, u64)>,
    checked: Option<Instant>,
    /// The last look that saw other traffic (or the agent's start).
    busy_at: Option<Instant>,
    /// Heartbeats sent and received so far.
    heartbeats: u64,
}

#[derive(Default)]
struct State {
    ifaces: Vec<Iface>,
    refreshed: Option<Instant>,
    admin_down: HashSet<String>,
    peers: HashMap<IpAddr, Peer>,
    /// Traffic on the node's networks (the heartbeat rate follows it).
    activity: Activity,
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
    /// Heartbeat interval while the node is calm.
    calm_interval: Duration,
    /// The longest wait announced while calm: the interval and one round.
    calm_told: Duration,
    /// Heartbeat interval on a path that does not work.
    down_interval: Duration,
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
    /// The longest this agent waits between heartbeats on the path now (milliseconds): the
    /// probe interval, the calm interval while the node's networks are idle, or the down
    /// interval (100 ms) while the path does not work.
    pub heartbeat_ms: u64,
    /// The same, as the peer announced it.
    pub peer_heartbeat_ms: u64,
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
            calm_interval: CALM_INTERVAL.max(interval),
            // A calm node's rounds come every CHECK_EVERY: a heartbeat due in between goes
            // at the next round.
            calm_told: CALM_INTERVAL.max(interval) + CHECK_EVERY.max(interval),
            down_interval: DOWN_INTERVAL.max(interval),
        }
    }

    /// Silence after which the path to `p` is dead: the limit, after the longest wait the
    /// peer announced for its next heartbeat.
    fn silence_limit(&self, p: &Peer) -> Duration {
        if p.every > self.interval {
            p.every + self.dead_after
        } else {
            self.dead_after
        }
    }

    /// True when `p` was heard within its silence limit.
    fn heard_lately(&self, p: &Peer, now: Instant) -> bool {
        p.last_seen.is_some_and(|t| now.duration_since(t) < self.silence_limit(p))
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
                Peer::new(String::new(), a.port(), self.interval)
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
                Some(x) if self.heard_lately(x, now) => heard.push((local, *p)),
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
                    && self.heard_lately(q, now)
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
            let works = !p.dead && self.heard_lately(p, now) && st.usable(*ip).is_some();
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
                    heartbeat_ms: p.told.as_millis() as u64,
                    peer_heartbeat_ms: p.every.as_millis() as u64,
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
        st.activity.heartbeats += 1;
        let Some(Msg::Probe { node, seq, boot, echo_boot, echo_seq, every_ms }) =
            self.key.open_probe(d, from.ip(), i.addr)
        else {
            drop(st);
            self.refusals.note(Refused::Forged, || {
                format!("a heartbeat from {from} that is not sealed with this cluster's key (a stranger, or a node with another key)")
            });
            return;
        };
        let p = st.peers.entry(from.ip()).or_insert_with(|| {
            info!("node {node} heard at {}", from.ip());
            Peer::new(node.clone(), from.port(), self.interval)
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
        // (Bounded: a peer cannot make its paths look alive through a long silence for more
        // than a minute.)
        p.every = Duration::from_millis(every_ms.clamp(1, 60_000).into());
        let mine = p.sent;
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

    /// True when the node's networks carried nothing but heartbeats for [`CALM_AFTER`] and
    /// every path is settled (a path not heard from yet, or dead for less than a minute,
    /// keeps the busy interval). Looks at the interfaces' counters at most every
    /// [`CHECK_EVERY`].
    fn calm(&self, st: &mut State, now: Instant) -> bool {
        let a = &mut st.activity;
        if a.checked.is_none_or(|t| now.saturating_duration_since(t) >= CHECK_EVERY) {
            a.checked = Some(now);
            let packets: u64 = std::fs::read("/proc/net/dev")
                .map(|t| parse_proc_net_dev(&t))
                .unwrap_or_default()
                .iter()
                .filter(|d| d.device != "lo")
                .map(|d| d.rx.wrapping_add(d.tx))
                .fold(0u64, u64::wrapping_add);
            if let Some((p0, h0)) = a.last {
                let other = packets.wrapping_sub(p0).saturating_sub(a.heartbeats.wrapping_sub(h0));
                if other > CALM_SLACK {
                    if a.busy_at.is_some_and(|t| now.saturating_duration_since(t) >= CALM_AFTER) {
                        debug!("{other} packets besides heartbeats in {CHECK_EVERY:?}: heartbeats at the busy interval again");
                    }
                    a.busy_at = Some(now);
                }
            } else {
                a.busy_at = Some(now);
            }
            a.last = Some((packets, a.heartbeats));
        }
        let quiet = a.busy_at.is_some_and(|t| now.saturating_duration_since(t) >= CALM_AFTER);
        quiet
            && st.peers.values().all(|p| {
                p.last_seen.is_some()
                    && !(p.dead
                        && p.last_seen
                            .is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(60)))
            })
    }

    /// One round: probes every path whose heartbeat is due and declares the silent ones
    /// dead. Returns how long to wait before the next round.
    fn tick(&self, sock: &UdpSocket, late: bool, events: &Events) -> Duration {
        // Heartbeats that arrived while the receiver thread waited for the CPU count too:
        // a busy machine must not look like a dead network.
        let mut buf = [0u8; crate::mesh::PROBE_MAX];
        while let Some((n, from)) = recv_now(sock, &mut buf) {
            self.received(from, &buf[..n], events);
        }
        let mut st = self.lock();
        let now = Instant::now();
        st.refresh(now);
        let calm = self.calm(&mut st, now);
        let mut died = Vec::new();
        let mut sent = 0u64;
        let targets: Vec<Target> =
            st.peers.iter().map(|(ip, p)| (*ip, p.port, p.heard, st.usable(*ip).cloned())).collect();
        for (ip, port, heard, iface) in targets {
            let Some(i) = iface else { continue };
            let p = st.peers.get_mut(&ip).expect("listed above");
            // A path that does not work is probed at the down interval (see DOWN_INTERVAL).
            let down = p.dead || p.last_seen.is_none();
            if !calm {
                p.calm_told = 0;
                if !down && p.next.is_some_and(|t| t > now + self.interval) {
                    // Busy again, or the path works again: the next heartbeat goes now.
                    p.next = None;
                }
            }
            let mut refused = None;
            if p.next.is_none_or(|t| t <= now) {
                // On a calm node each heartbeat says the next may take the calm interval, a
                // few times at the busy interval first (the peer must know before it waits).
                let (every, next) = if down {
                    // The announced wait stays the node's own: the peer, which may still take
                    // the path for alive, keeps its silence limit (heartbeats from a side
                    // that does not hear it do not count anyway).
                    if calm {
                        (self.calm_told, self.calm_interval)
                    } else {
                        (self.interval, self.down_interval)
                    }
                } else if !calm {
                    (self.interval, self.interval)
                } else if p.calm_told < CALM_ANNOUNCE {
                    p.calm_told += 1;
                    (self.calm_told, self.interval)
                } else {
                    (self.calm_told, self.calm_interval)
                };
                p.sent += 1;
                p.next = Some(now + next);
                p.told = every.max(next);
                let probe = self.key.seal_probe(
                    &Msg::Probe {
                        node: self.node.clone(),
                        seq: p.sent,
                        boot: self.boot,
                        echo_boot: heard.0,
                        echo_seq: heard.1,
                        every_ms: every.as_millis().min(u32::MAX as u128) as u32,
                    },
                    i.addr,
                    ip,
                );
                // A link that went down on this node fails the send itself: the path is dead
                // now, without waiting for the silence. A heartbeat the socket has no room
                // for is lost rather than waited for: this thread holds the paths' state, and
                // the other paths' heartbeats are due.
                refused = match send_now(sock, &probe, SocketAddr::new(ip, port)) {
                    Ok(()) => {
                        sent += 1;
                        None
                    }
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(
                                libc::ENETUNREACH | libc::ENETDOWN | libc::EHOSTUNREACH | libc::EADDRNOTAVAIL
                            )
                        ) =>
                    {
                        Some(e)
                    }
                    Err(_) => None,
                };
            }
            let limit = self.silence_limit(p);
            let p = st.peers.get_mut(&ip).expect("listed above");
            // After a round that came late (this thread waited for the CPU), silence is not
            // judged: the peer's heartbeats may be on their way.
            let quiet = p.last_seen.map(|t| now.duration_since(t));
            let silent = !late && quiet.is_some_and(|q| q >= limit);
            if refused.is_some() && !p.dead {
                p.dead = true;
                died.push((i, ip, p.node.clone(), refused, quiet, limit));
            } else if silent && !p.dead {
                p.dead = true;
                died.push((i, ip, p.node.clone(), None, quiet, limit));
            }
        }
        st.activity.heartbeats = st.activity.heartbeats.wrapping_add(sent);
        let wait = if !calm || self.interval >= CHECK_EVERY {
            self.interval
        } else {
            let due =
                st.peers.values().filter_map(|p| p.next).map(|t| t.saturating_duration_since(now)).min();
            due.unwrap_or(CHECK_EVERY).clamp(self.interval, CHECK_EVERY)
        };
        drop(st);
        self.refresh_macs(now);
        let port = self.port;
        for (i, ip, node, cannot_send, quiet, limit) in died {
            let refused = cannot_send.is_some();
            self.journal.record(
                "path",
                None,
                serde_json::json!({
                    "local": i.addr.to_string(),
                    "peer": ip.to_string(),
                    "network": i.name,
                    "state": "dead",
                    "reason": if refused { "this node cannot send on it".to_string() } else { format!("silent for {} ms", limit.as_millis()) },
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
                    quiet.unwrap_or(limit).as_millis(),
                    limit.as_millis()
                ),
            }
            events.broadcast(&Msg::Path {
                local: SocketAddr::new(i.addr, 0),
                peer: SocketAddr::new(ip, 0),
                up: false,
            });
        }
        wait
    }
}

/// A peer address to probe: its port, what it was last heard to say, the local network.
type Target = (IpAddr, u16, (u64, u64), Option<Iface>);

/// Sends datagram `d` to `to` on `sock` without waiting for room in its send buffer.
fn send_now(sock: &UdpSocket, d: &[u8], to: SocketAddr) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: zeroed sockaddr_storage is valid; it is large enough for either family.
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match to {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write(&mut st as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write(&mut st as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: a valid buffer of d.len() bytes and an address of `len` bytes.
    let n = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            d.as_ptr() as *const libc::c_void,
            d.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            &st as *const _ as *const libc::sockaddr,
            len as libc::socklen_t,
        )
    };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Asks for a send buffer of [`SEND_BUFFER`] bytes on `sock` (the kernel caps it at
/// `net.core.wmem_max`); failure leaves the default.
fn widen_send_buffer(sock: &UdpSocket) {
    use std::os::fd::AsRawFd;
    let v: libc::c_int = SEND_BUFFER;
    // SAFETY: an int option of the right size on a socket this process owns.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
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
    widen_send_buffer(&sock);
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
            let mut last = Instant::now();
            let mut wait = health.interval;
            loop {
                let now = Instant::now();
                let late = now.duration_since(last) > wait + health.dead_after / 2;
                last = now;
                wait = health.tick(&sock, late, &events);
                std::thread::sleep(wait);
            }
        })
        .expect("spawn the prober");
}
