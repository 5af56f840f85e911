//! The agent's Unix socket: the node's layers register listeners, announce and look up
//! connections, and hand over their statistics tables; `vmictl` asks for status.

use crate::directory::{Directory, Lookup};
use crate::events::Events;
use crate::journal::Journal;
use crate::mesh::{ClusterKey, Refusals, Refused};
use crate::paths::Health;
use crate::peer::PeerClient;
use crate::status::Procs;
use crate::wire::{read_msg_fd, write_msg};
use crate::{net, status};
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use substrate::wire::agent::{Msg, NO_ADDR};
use tracing::{debug, info, warn};

/// Longest an accept waits for the source port of a connection announced without one
/// (the connecting layer sends it right after `connect`: well under a millisecond on one
/// network). Only accepts at an address with such a connection in flight wait at all.
pub const BOUND_WAIT: Duration = Duration::from_millis(500);

/// A listener on another node, as this agent knows it.
#[derive(Clone, Debug)]
enum Known {
    /// Subscribed, on the channel of this generation: connections to it are announced one
    /// way and answered here at once with the listener's window and its node's agents.
    Sub { window: u64, addrs: Vec<SocketAddr>, gen: u64 },
    /// Its agent did not take the subscription: not asked again before this time.
    Refused(Instant),
}

/// Most listeners on other nodes remembered.
const MAX_KNOWN: usize = 4096;

/// How long a refused subscription is not asked again.
const REFUSED_FOR: Duration = Duration::from_secs(10);

/// How long the agent of a listener that goes away waits for each subscribed agent to
/// take the news (the listener's `close` waits meanwhile).
const UNSUBSCRIBE_WAIT: Duration = Duration::from_millis(300);

/// The agent's shared state.
pub struct Agent {
    /// Listeners and expected connections.
    pub dir: Mutex<Directory>,
    /// Signalled when source ports arrive for connections announced without one.
    pub bound: Condvar,
    /// Source ports for announcements passed on to other agents.
    pub ports: crate::ports::Ports,
    /// Processes under the layer and their statistics tables.
    pub procs: Mutex<Procs>,
    /// Connections to other agents.
    pub peers: PeerClient,
    /// TCP port of agents (ours and other nodes').
    pub port: u16,
    /// Ports `port` to `port + relink_ports - 1` take rebuilt links (on every node).
    pub relink_ports: u16,
    /// The node's name in reports.
    pub node: String,
    /// Event channels of the node's processes.
    pub events: Arc<Events>,
    /// The node's networks and path health.
    pub health: Arc<Health>,
    /// The cluster key (agent channels and heartbeats).
    pub key: ClusterKey,
    /// What was refused to strangers and to local users without the right.
    pub refusals: Arc<Refusals>,
    /// What happened on the node.
    pub journal: Arc<Journal>,
    /// Where the web view is served, once it is (`vmictl web` reads it from the status).
    pub web: std::sync::OnceLock<serde_json::Value>,
    /// The node's default chains (the `chain` setting's rules, as `Policy::to_text` writes
    /// them), told to each process in the answer to its `Hello`.
    pub chain: std::sync::OnceLock<String>,
    /// The block of source ports the node's layers bind connections to (first, count).
    pub setup_ports: std::sync::OnceLock<(u16, u16)>,
    /// Listeners on other nodes this agent subscribed to (see [`Msg::Subscribe`]), by the
    /// destination connections go to; and the ones whose agents refused.
    remote: Mutex<HashMap<SocketAddr, Known>>,
    /// The folder of device plug-ins (the `plugins` setting).
    pub plugins: std::sync::OnceLock<std::path::PathBuf>,
    /// The node's sink plug-ins and what their probes said.
    pub sinks: crate::sinks::Sinks,
    /// The processes' tables of announced connections (see `crate::accepts`).
    pub accepts: crate::accepts::Tables,
    /// Listener registrations (client, address) whose process proved it holds a TCP socket
    /// bound there: only those get connections written into their process's table.
    proven: Mutex<std::collections::HashSet<(u64, SocketAddr)>>,
    next_client: AtomicU64,
}

/// A connection its connecting side announced (the fields of a `Connect` message).
pub struct Announce {
    /// The connecting side's address.
    pub src: SocketAddr,
    /// The address it connects to (on this node).
    pub dst: SocketAddr,
    /// The connection's GID.
    pub gid: u128,
    /// The connection's secret.
    pub secret: u128,
    /// The connecting side's window.
    pub window: u64,
    /// The address the program asked for (differs from `dst` when a moved listener's node
    /// takes the connection).
    pub aim: SocketAddr,
    /// The connecting node's agent addresses.
    pub agents: Vec<SocketAddr>,
}

impl Agent {
    /// A new agent of the cluster whose key is `key`.
    pub fn new(
        port: u16,
        relink_ports: u16,
        node: String,
        probe_interval: Duration,
        dead_after: Duration,
        key: ClusterKey,
    ) -> Self {
        let journal = Arc::new(Journal::default());
        let refusals = Arc::new(Refusals::new(journal.clone()));
        Agent {
            dir: Mutex::new(Directory::default()),
            bound: Condvar::new(),
            ports: crate::ports::Ports::new(key.clone()),
            procs: Mutex::new(Procs::default()),
            peers: PeerClient::new(key.clone()),
            port,
            relink_ports,
            events: Arc::new(Events::new(journal.clone())),
            health: Arc::new(Health::new(
                node.clone(),
                port,
                probe_interval,
                dead_after,
                key.clone(),
                refusals.clone(),
                journal.clone(),
            )),
            node,
            key,
            refusals,
            journal,
            web: std::sync::OnceLock::new(),
            chain: std::sync::OnceLock::new(),
            setup_ports: std::sync::OnceLock::new(),
            remote: Mutex::default(),
            plugins: std::sync::OnceLock::new(),
            sinks: crate::sinks::Sinks::default(),
            accepts: crate::accepts::Tables::default(),
            proven: Mutex::default(),
            next_client: AtomicU64::new(1),
        }
    }

    /// Source ports of connections announced without one (port 0: the connect failed):
    /// the announcement waiting here is completed, or the port goes where the
    /// announcement went.
    pub fn bound(&self, ports: Vec<(u128, SocketAddr)>) {
        let mut elsewhere = Vec::new();
        {
            let mut d = self.dir.lock().unwrap_or_else(|e| e.into_inner());
            for (gid, src) in ports {
                let src = SocketAddr::new(normalize(src.ip()), src.port());
                if !d.bind(gid, src) {
                    elsewhere.push((gid, src));
                }
            }
        }
        self.bound.notify_all();
        for (gid, src) in elsewhere {
            if !self.ports.pass_on(gid, src) {
                debug!("source port {src} of connection {gid:032x}: no announcement for it here");
            }
        }
    }

    /// The connection a listener accepted from `peer` at `local`, if it was announced. When
    /// a connection to `local` was announced without its source port, the answer waits for
    /// the port, at most [`BOUND_WAIT`].
    pub fn accepted(&self, local: SocketAddr, peer: SocketAddr) -> Option<crate::directory::Expected> {
        let deadline = Instant::now() + BOUND_WAIT;
        let mut d = self.dir.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match d.accept(local, peer) {
                Lookup::Found(e) => return Some(e),
                Lookup::Plain => return None,
                Lookup::Wait => {
                    let now = Instant::now();
                    if now >= deadline {
                        debug!(
                            "{peer} -> {local}: no announcement came for it (a connection announced without its port is still waiting for it, or the connecting node announces one way from this source port); this one is plain TCP"
                        );
                        return None;
                    }
                    d = self.bound.wait_timeout(d, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
        }
    }

    /// The process behind request socket `client`, once it said hello.
    pub fn pid_of(&self, client: u64) -> Option<u32> {
        self.procs.lock().unwrap_or_else(|e| e.into_inner()).pid_of(client)
    }

    /// A connection to `a.dst` (on this node) is announced.
    pub fn expect_local(&self, a: Announce) -> Msg {
        let Announce { src, dst, gid, secret, window, aim, agents } = a;
        let mut d = self.dir.lock().unwrap_or_else(|e| e.into_inner());
        let e = crate::directory::Expected { gid, secret, window, at: Instant::now(), aim, agents };
        let table_entry = (src.port() != 0).then(|| substrate::accepts::Entry {
            src,
            dst,
            gid,
            secret,
            window,
            alias: (e.aim != dst).then_some(e.aim),
            agents: if e.agents.is_empty() { self.health.advertised() } else { e.agents.clone() },
            expires_ns: 0,
        });
        match d.expect(src, dst, e) {
            Some(w) => {
                debug!("expecting virtual connection {gid:032x}: {src} -> {dst}");
                // The listener's process finds it in its table, without asking.
                let owner = d
                    .listener_for(dst)
                    .map(|l| (l.owner, l.addr))
                    .filter(|k| self.proven.lock().unwrap_or_else(|e| e.into_inner()).contains(k))
                    .map(|(o, _)| o);
                if let (Some(mut te), Some(owner)) = (table_entry, owner) {
                    let now = crate::accepts::now_ns();
                    // (A little before the directory forgets it: never taken from the table
                    // once the directory would say "plain".)
                    te.expires_ns =
                        now + (crate::directory::PENDING_TTL - Duration::from_secs(1)).as_nanos() as u64;
                    self.accepts.put(owner, &te, now);
                }
                Msg::Virtual { gid, secret, window: w, addrs: self.health.advertised(), alias: NO_ADDR }
            }
            None => Msg::Plain,
        }
    }

    /// A connection to `dst` (an address of this node) is announced: expected here when a
    /// listener here takes it; passed on to the node a moved listener went to otherwise (the
    /// answer's `alias` then names the address to connect to instead).
    pub fn expect_here(&self, a: Announce) -> Msg {
        let fwd = self.dir.lock().unwrap_or_else(|e| e.into_inner()).forward_for(a.dst).cloned();
        let Some(f) = fwd.map(crate::registry::follow) else { return self.expect_local(a) };
        let Announce { src, dst, gid, secret, window, aim, agents } = a;
        // The agent address of the new node on the network `dst` is on, if it has one.
        let ifaces = net::interfaces();
        let home = ifaces.iter().find(|i| i.addr == dst.ip());
        let target = f.to.iter().find(|t| home.is_some_and(|h| h.contains(t.ip()))).or(f.to.first());
        let Some(target) = target.copied() else { return Msg::Plain };
        let via = SocketAddr::new(target.ip(), dst.port());
        let m = Msg::Connect { src, dst: via, gid, secret, window, aim, agents };
        match self.peers.ask_within(target.ip(), target.port(), &m, crate::peer::CONNECT_BUDGET) {
            Ok(Msg::Virtual { gid, secret, window, addrs, .. }) => {
                if src.port() == 0 {
                    self.ports.route(gid, target);
                }
                info!("connection {gid:032x}: listener {dst} moved, {src} -> {via} (the node the listener is on now)");
                Msg::Virtual { gid, secret, window, addrs, alias: via }
            }
            Ok(other) => {
                info!(
                    "connection {gid:032x}: {src} -> {dst}: the listener moved to the node at {target}, whose agent answered {}; plain TCP (is the program still listening there?)",
                    other.name()
                );
                Msg::Plain
            }
            Err(e) => {
                info!(
                    "connection {gid:032x}: {src} -> {dst}: the listener moved to the node at {target}, whose agent is unreachable ({e}); plain TCP (check the agent there)"
                );
                Msg::Plain
            }
        }
    }

    /// A local layer is about to connect from `src` (IP maybe unspecified) to `dst`. When the
    /// network toward `dst` is dead and the destination node has another address on a
    /// working one, the connection is made to that address instead (the answer's `alias`).
    fn connect(&self, src: SocketAddr, dst: SocketAddr, gid: u128, secret: u128, window: u64) -> Msg {
        // The GID says which cluster issued it (the layer takes the answer's).
        let gid = substrate::Gid(gid).issued_by(self.key.cluster_id).0;
        let dst = SocketAddr::new(normalize(dst.ip()), dst.port());
        if let Some(ip) = self.health.alternative(dst.ip()) {
            // The network toward `dst` is down; the same node may take the connection on
            // another network (a listener on a wildcard address does).
            let via = SocketAddr::new(ip, dst.port());
            if let Some(src_ip) = if src.ip().is_unspecified() { net::source_for(ip) } else { Some(src.ip()) }
            {
                let from = SocketAddr::new(normalize(src_ip), src.port());
                let m = Msg::Connect {
                    src: from,
                    dst: via,
                    gid,
                    secret,
                    window,
                    aim: dst,
                    agents: self.health.advertised(),
                };
                if let Ok(Msg::Virtual { gid, secret, window, addrs, .. }) =
                    self.peers.ask_within(ip, self.port, &m, crate::peer::CONNECT_BUDGET)
                {
                    if from.port() == 0 {
                        self.ports.route(gid, SocketAddr::new(ip, self.port));
                    }
                    info!(
                        "connection {gid:032x}: the network toward {dst} is down; {from} -> {via} (the same node, another network) instead"
                    );
                    self.health.learn(&addrs);
                    return Msg::Virtual { gid, secret, window, addrs, alias: via };
                }
            }
        }
        // A path the heartbeats call dead is asked over all the same, for less long: a
        // moment's silence (a busy node) must not make a new connection plain for good, and
        // over a path that is really dead the program's own connect could not get through
        // either.
        let budget = if self.health.is_dead(dst.ip()) {
            debug!("path toward {} looks dead and no other network reaches the listener: asking its agent all the same", dst.ip());
            crate::peer::CONNECT_BUDGET_DEAD
        } else {
            crate::peer::CONNECT_BUDGET
        };
        let src_ip = if src.ip().is_unspecified() { net::source_for(dst.ip()) } else { Some(src.ip()) };
        let Some(src_ip) = src_ip else { return Msg::Plain };
        let src = SocketAddr::new(normalize(src_ip), src.port());
        if self.events.tickets.lock().unwrap_or_else(|e| e.into_inner()).has(src.port()) {
            // A program that bound its socket to one of the ticket ports itself: announcing
            // it could stand for a ticket's connection still to come there.
            debug!("connection {gid:032x}: {src} -> {dst}: the program bound a port the agent gives as tickets; plain TCP");
            return Msg::Plain;
        }
        if net::is_local(dst.ip()) {
            let agents = self.health.advertised();
            return self.expect_here(Announce { src, dst, gid, secret, window, aim: dst, agents });
        }
        let in_block = self.in_block(src.port());
        if in_block && budget == crate::peer::CONNECT_BUDGET {
            if let Some(m) = self.announce_one_way(src, dst, gid, secret, window) {
                return m;
            }
        }
        let m = Msg::Connect { src, dst, gid, secret, window, aim: dst, agents: self.health.advertised() };
        match self.peers.ask_within(dst.ip(), self.port, &m, budget) {
            Ok(Msg::Virtual { gid, secret, window, addrs, alias }) => {
                // (`alias`: the listener moved to another node, connect there.)
                if src.port() == 0 {
                    self.ports.route(gid, SocketAddr::new(dst.ip(), self.port));
                }
                self.health.learn(&addrs);
                Msg::Virtual { gid, secret, window, addrs, alias }
            }
            Ok(Msg::Plain) => Msg::Plain,
            Ok(other) => {
                info!(
                    "connection {gid:032x}: {src} -> {dst}: the agent there answered {}; plain TCP (do both agents run the same version?)",
                    other.name()
                );
                Msg::Plain
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::NotConnected) => {
                debug!("no agent at {}: {e}; plain TCP", dst.ip());
                Msg::Plain
            }
            Err(e) => {
                // An agent that is there but slow or unreachable: worth an operator's look.
                info!(
                    "connection {gid:032x}: {src} -> {dst}: the agent at {} did not answer ({e}); plain TCP",
                    dst.ip()
                );
                Msg::Plain
            }
        }
    }
}

impl Agent {
    /// For the status report: see `status::Report::setup`.
    pub fn setup_json(&self) -> serde_json::Value {
        let ports = match self.setup_ports.get() {
            Some(&(first, n)) if n > 0 => format!("{first}-{}", u32::from(first) + u32::from(n) - 1),
            _ => "off".into(),
        };
        let mut to: Vec<String> = self
            .remote
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, k)| matches!(k, Known::Sub { .. }))
            .map(|(d, _)| d.to_string())
            .collect();
        to.sort();
        let from: Vec<serde_json::Value> = self
            .dir
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .subs()
            .iter()
            .map(|s| serde_json::json!({ "listener": s.dst.to_string(), "node": s.node.to_string() }))
            .collect();
        let tickets_out = self.events.tickets.lock().unwrap_or_else(|e| e.into_inner()).out();
        serde_json::json!({ "ports": ports, "one_way_to": to, "one_way_from": from, "tickets_out": tickets_out })
    }

    /// Process `pid` took connection `gid` (`peer` -> `local`) from its table of announced
    /// connections (it holds it: the caller noted that): the directory's entry goes, and the
    /// connection is counted and recorded.
    pub fn taken_from_table(&self, pid: u32, local: SocketAddr, peer: SocketAddr, gid: u128) {
        let local = SocketAddr::new(normalize(local.ip()), local.port());
        let peer = SocketAddr::new(normalize(peer.ip()), peer.port());
        let known = self.dir.lock().unwrap_or_else(|e| e.into_inner()).taken(local, peer, gid);
        if !known {
            debug!("connection {gid:032x}: {peer} -> {local} taken from a table, no longer in the directory");
        }
        self.accepts.count(true);
        crate::registry::hold(gid, false, pid);
        self.journal.record_connection(pid, gid, "in", Some(local), peer);
    }

    /// Tickets for process `pid`'s next connections to listener `dst` on another node (see
    /// `crate::tickets`), announced to its agent one way before they are given: a
    /// [`Msg::TicketBook`], or [`Msg::Plain`] when this agent does not announce connections
    /// there one way (no subscription, a network down or looking dead: the layer asks per
    /// connection, which handles those) or has no ticket port free.
    pub fn give_tickets(&self, pid: u32, dst: SocketAddr, want: u16, window: u64) -> Msg {
        let dst = SocketAddr::new(normalize(dst.ip()), dst.port());
        if net::is_local(dst.ip()) {
            return self.give_local_tickets(pid, dst, want, window);
        }
        if self.health.alternative(dst.ip()).is_some() || self.health.is_dead(dst.ip()) {
            return Msg::Plain;
        }
        let known = self.remote.lock().unwrap_or_else(|e| e.into_inner()).get(&dst).cloned();
        let Some(Known::Sub { window: w, addrs, gen }) = known else { return Msg::Plain };
        let Some(src_ip) = net::source_for(dst.ip()).map(normalize) else { return Msg::Plain };
        let Some(tickets) = self.draw_tickets(pid, dst, want) else { return Msg::Plain };
        let entries =
            tickets.iter().map(|&(port, gid, secret)| (SocketAddr::new(src_ip, port), gid, secret)).collect();
        let m = Msg::Expects { dst, window, agents: self.health.advertised(), entries };
        if let Err(e) = self.peers.tell(dst.ip(), &m, gen) {
            debug!("listener {dst}: {e}; no tickets, asking its agent again");
            self.remote.lock().unwrap_or_else(|e| e.into_inner()).remove(&dst);
            let mut pool = self.events.tickets.lock().unwrap_or_else(|e| e.into_inner());
            for (_, gid, _) in &tickets {
                pool.back(u64::from(pid), *gid);
            }
            return Msg::Plain;
        }
        debug!("process {pid}: {} tickets for {dst}", tickets.len());
        ticket_book(dst, src_ip, w, addrs, tickets)
    }

    /// Up to `want` tickets (port, GID, secret) for process `pid`'s connections to `dst`
    /// from the node's pool, GIDs issued by this cluster; `None` when none is free.
    fn draw_tickets(&self, pid: u32, dst: SocketAddr, want: u16) -> Option<Vec<(u16, u128, u128)>> {
        let cluster = self.key.cluster_id;
        let want = usize::from(want).min(crate::tickets::MAX_BATCH);
        let mut draws = random_u128s(2 * want)?;
        let mut gids = || substrate::Gid(draws.pop().unwrap_or_default()).issued_by(cluster).0;
        let given = self.events.tickets.lock().unwrap_or_else(|e| e.into_inner()).give(
            u64::from(pid),
            dst,
            want,
            Instant::now(),
            &mut gids,
        );
        (!given.is_empty())
            .then(|| given.iter().map(|&(port, gid)| (port, gid, draws.pop().unwrap_or_default())).collect())
    }

    /// Tickets for a listener of this node (process `pid`'s connections to another process
    /// here, or to itself): each one expected here at once, as a peer agent's tickets are
    /// ([`Agent::expect_batch`]), so that the connection is virtual from its `connect` on
    /// without a round trip to this agent. None for a listener that is not here (moved away:
    /// its connections ask, and are sent on).
    fn give_local_tickets(&self, pid: u32, dst: SocketAddr, want: u16, window: u64) -> Msg {
        if self.dir.lock().unwrap_or_else(|e| e.into_inner()).listener_for(dst).is_none() {
            return Msg::Plain;
        }
        let Some(src_ip) = net::source_for(dst.ip()).map(normalize) else { return Msg::Plain };
        let Some(tickets) = self.draw_tickets(pid, dst, want) else { return Msg::Plain };
        let agents = self.health.advertised();
        let mut listener_window = None;
        for &(port, gid, secret) in &tickets {
            let src = SocketAddr::new(src_ip, port);
            let a = Announce { src, dst, gid, secret, window, aim: dst, agents: agents.clone() };
            match self.expect_local(a) {
                Msg::Virtual { window: w, .. } => listener_window = Some(w),
                _ => {
                    listener_window = None;
                    break;
                }
            }
        }
        self.bound.notify_all();
        let Some(w) = listener_window else {
            // (The listener closed meanwhile. The ports stay out until an announcement made
            // for some of them has lapsed: the pool gives them again after `HOLD`.)
            return Msg::Plain;
        };
        debug!("process {pid}: {} tickets for {dst} (on this node)", tickets.len());
        ticket_book(dst, src_ip, w, agents, tickets)
    }

    /// Connections announced ahead by the agent at `from` (its tickets): expected here,
    /// as [`Agent::expect_told`] expects one.
    pub fn expect_batch(
        &self,
        dst: SocketAddr,
        window: u64,
        agents: Vec<SocketAddr>,
        entries: Vec<(SocketAddr, u128, u128)>,
        from: Option<IpAddr>,
    ) {
        let dst = SocketAddr::new(normalize(dst.ip()), dst.port());
        let n = entries.len();
        for (src, gid, secret) in entries {
            let src = SocketAddr::new(normalize(src.ip()), src.port());
            let a = Announce { src, dst, gid, secret, window, aim: dst, agents: agents.clone() };
            if !matches!(self.expect_local(a), Msg::Virtual { .. }) {
                warn!(
                    "{n} connections to {dst} were announced ahead by the agent at {from:?}, but no listener under the layer takes them here any more (it closed a moment ago?)"
                );
                if let Some(ip) = from {
                    let _ =
                        self.peers.ask_within(ip, self.port, &Msg::Unlisten { addr: dst }, UNSUBSCRIBE_WAIT);
                }
                break;
            }
        }
        self.bound.notify_all();
    }

    /// `port` is in the node's block of source ports for layered connections.
    fn in_block(&self, port: u16) -> bool {
        self.setup_ports.get().is_some_and(|&(first, n)| {
            (u32::from(first)..u32::from(first) + u32::from(n)).contains(&u32::from(port))
        })
    }

    /// A connection to a listener this agent subscribed to: announced to its agent one way,
    /// and answered at once. `None` when there is no subscription (or its channel is gone:
    /// the caller asks).
    fn announce_one_way(
        &self,
        src: SocketAddr,
        dst: SocketAddr,
        gid: u128,
        secret: u128,
        window: u64,
    ) -> Option<Msg> {
        let known = self.remote.lock().unwrap_or_else(|e| e.into_inner()).get(&dst).cloned()?;
        let Known::Sub { window: w, addrs, gen } = known else { return None };
        let m = Msg::Expect { src, dst, gid, secret, window, aim: dst, agents: self.health.advertised() };
        match self.peers.tell(dst.ip(), &m, gen) {
            Ok(()) => Some(Msg::Virtual { gid, secret, window: w, addrs, alias: NO_ADDR }),
            Err(e) => {
                debug!("listener {dst}: {e}; asking its agent again");
                self.remote.lock().unwrap_or_else(|e| e.into_inner()).remove(&dst);
                None
            }
        }
    }

    /// After a connection from source port `port` to `dst` was set up: if `dst` is a
    /// listener under the layer on another node and the port is of the block, asks that
    /// node's agent to take this node's later connections there one way (once; a refusal is
    /// not asked again for a while).
    fn subscribe(&self, port: u16, dst: SocketAddr, window: u64, addrs: &[SocketAddr]) {
        let dst = SocketAddr::new(normalize(dst.ip()), dst.port());
        if !self.in_block(port) || net::is_local(dst.ip()) {
            return;
        }
        let Some(&(first_port, ports)) = self.setup_ports.get() else { return };
        {
            let r = self.remote.lock().unwrap_or_else(|e| e.into_inner());
            match r.get(&dst) {
                Some(Known::Sub { .. }) => return,
                Some(Known::Refused(until)) if Instant::now() < *until => return,
                _ => {}
            }
        }
        let m = Msg::Subscribe { listener: dst, first_port, ports };
        let k = match self.peers.ask_within(dst.ip(), self.port, &m, crate::peer::CONNECT_BUDGET) {
            Ok(Msg::Ok) => {
                debug!("listener {dst}: connections there are announced one way from now on");
                Known::Sub { window, addrs: addrs.to_vec(), gen: self.peers.generation(dst.ip()) }
            }
            other => {
                debug!("listener {dst}: no subscription ({other:?}); its connections are asked about");
                Known::Refused(Instant::now() + REFUSED_FOR)
            }
        };
        let mut r = self.remote.lock().unwrap_or_else(|e| e.into_inner());
        if r.len() >= MAX_KNOWN {
            r.clear();
        }
        r.insert(dst, k);
    }

    /// The agent of the node at `from` says listener `dst` is gone: its connections are
    /// asked about again.
    pub fn unsubscribed(&self, dst: SocketAddr, from: Option<IpAddr>) {
        if self.remote.lock().unwrap_or_else(|e| e.into_inner()).remove(&dst).is_some() {
            debug!("listener {dst} is gone (said the agent at {from:?})");
            // The node's processes drop their tickets for it: their next connections there
            // ask, and are told where it went (or that it is plain now).
            self.events.broadcast(&Msg::Unlisten { addr: dst });
        }
    }

    /// Another node's agent subscribes to listener `dst` here (see [`Msg::Subscribe`]).
    pub fn subscribed(&self, dst: SocketAddr, from: Option<IpAddr>, block: (u16, u16)) -> Msg {
        let Some(node) = from.map(normalize) else { return Msg::Plain };
        let dst = SocketAddr::new(normalize(dst.ip()), dst.port());
        if self.dir.lock().unwrap_or_else(|e| e.into_inner()).subscribe(dst, node, block) {
            debug!("the agent at {node} announces its connections to {dst} one way");
            Msg::Ok
        } else {
            Msg::Plain
        }
    }

    /// A connection announced one way by the agent at `from` (it subscribed to the
    /// listener): expected here. If the listener is gone meanwhile, that agent is told.
    pub fn expect_told(&self, a: Announce, from: Option<IpAddr>) {
        let (gid, src, dst) = (a.gid, a.src, a.dst);
        let dst = SocketAddr::new(normalize(dst.ip()), dst.port());
        let a = Announce { src: SocketAddr::new(normalize(src.ip()), src.port()), dst, ..a };
        match self.expect_local(a) {
            Msg::Virtual { .. } => self.bound.notify_all(),
            _ => {
                warn!(
                    "connection {gid:032x}: {src} -> {dst} was announced by the agent at {from:?}, but no listener under the layer takes it here any more (it closed a moment ago?)"
                );
                if let Some(ip) = from {
                    let _ =
                        self.peers.ask_within(ip, self.port, &Msg::Unlisten { addr: dst }, UNSUBSCRIBE_WAIT);
                }
            }
        }
    }

    /// After listeners went away here: the agents subscribed to them are told, each within
    /// [`UNSUBSCRIBE_WAIT`].
    pub fn tell_gone(&self) {
        let gone = self.dir.lock().unwrap_or_else(|e| e.into_inner()).gone_subs();
        for s in gone {
            match self.peers.ask_within(s.node, self.port, &Msg::Unlisten { addr: s.dst }, UNSUBSCRIBE_WAIT) {
                Ok(_) => debug!("listener {}: the agent at {} was told it is gone", s.dst, s.node),
                Err(e) => info!(
                    "listener {}: cannot tell the agent at {} that it is gone ({e}); its programs' connections there may find it gone",
                    s.dst, s.node
                ),
            }
        }
    }
}

/// The paths a rebuilt link of connection `gid` tries, in order: on each path, first the
/// peer agent's port the GID picks among `n` relink ports, then its base port (a peer with
/// fewer relink ports refuses the first at once). All the links rebuilt between two nodes
/// share the dialing node's ephemeral ports toward each destination port, so spreading them
/// over `n` ports lets `n` times as many move. GID 0 (not given): the base port only.
pub fn relink_ports(
    paths: Vec<(SocketAddr, SocketAddr)>,
    gid: u128,
    n: u16,
) -> Vec<(SocketAddr, SocketAddr)> {
    let pick = if n > 1 && gid != 0 { (gid as u64 % u64::from(n)) as u16 } else { 0 };
    if pick == 0 {
        return paths;
    }
    let mut out = Vec::with_capacity(2 * paths.len());
    for (local, peer) in paths {
        if let Some(p) = peer.port().checked_add(pick) {
            out.push((local, SocketAddr::new(peer.ip(), p)));
        }
        out.push((local, peer));
    }
    out
}

/// `n` random 128-bit values (GIDs and secrets of tickets); `None` when the kernel gives no
/// randomness (no ticket then: a secret must not be guessable).
fn random_u128s(n: usize) -> Option<Vec<u128>> {
    let mut b = vec![0u8; 16 * n];
    getrandom::fill(&mut b).ok()?;
    Some(b.chunks_exact(16).map(|c| u128::from_le_bytes(c.try_into().unwrap_or_default())).collect())
}

fn normalize(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// Error reason for a `Freeze` of a process that never talked to this agent.
pub const NOT_HERE: &str = "not under the layer here";

/// How long a process may take to get ready for a checkpoint.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(5);

/// The user id of the client on `s` (`None` if the kernel does not say).
pub fn peer_uid(s: &UnixStream) -> Option<u32> {
    peer_cred(s).map(|c| c.uid)
}

/// The process id of the client on `s` (when it connected), for log lines.
fn peer_pid(s: &UnixStream) -> Option<i32> {
    peer_cred(s).map(|c| c.pid)
}

fn peer_cred(s: &UnixStream) -> Option<libc::ucred> {
    // SAFETY: zeroed ucred is valid; the kernel fills at most `len` bytes.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: valid pointers to locals.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut _,
            &mut len,
        )
    };
    (r == 0).then_some(cred)
}

/// True if user `uid` may change the whole node (take a network out of service): root, or
/// the user the agent runs as.
pub fn may_run_node(uid: Option<u32>) -> bool {
    // SAFETY: geteuid has no preconditions.
    uid.is_some_and(|u| u == 0 || u == unsafe { libc::geteuid() })
}

/// The owner of process `pid`.
pub fn owner_of(pid: u32) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}")).ok().map(|m| m.uid())
}

/// True if the client on `s` may manage process `pid` (checkpoint it, move its
/// connections): whoever may run the node, or the process's owner.
fn may_manage(s: &UnixStream, pid: u32) -> bool {
    Asker::local(s).may_manage(pid)
}

/// Who asks for a command: a user of this node (as the kernel says), or a user of another
/// node of the cluster (as that node's agent says, over the cluster's channel).
#[derive(Clone, Copy, Debug)]
pub struct Asker {
    /// The user, if known.
    pub uid: Option<u32>,
    /// Asked through another node's agent.
    pub remote: bool,
}

impl Asker {
    /// The user on the other end of a local socket.
    pub fn local(s: &UnixStream) -> Self {
        Asker { uid: peer_uid(s), remote: false }
    }

    /// May change the whole node: root (of any node of the cluster), or locally the
    /// agent's own user.
    pub fn may_run_node(&self) -> bool {
        match self.uid {
            Some(0) => true,
            Some(_) if !self.remote => may_run_node(self.uid),
            _ => false,
        }
    }

    /// May manage process `pid`: whoever may run the node, or the process's owner.
    pub fn may_manage(&self, pid: u32) -> bool {
        self.may_run_node() || (self.uid.is_some() && owner_of(pid) == self.uid)
    }

    /// "user N", or "user N of another node".
    pub fn describe(&self) -> String {
        let who = self.uid.map_or("an unknown user".to_string(), |u| format!("user {u}"));
        if self.remote {
            format!("{who} of another node")
        } else {
            who
        }
    }
}

/// How long after a connection is made its layer has told the agent of it, at most (the
/// layer's batching delay, 50 ms, and room for a busy machine).
const HOLD_TOLD_WITHIN: std::time::Duration = std::time::Duration::from_millis(250);

/// The processes of this node holding connection `gid`, when `asker` may manage all of
/// them (root or their owner); otherwise why not, to answer (`what`: the action, for it and
/// for the log of refusals).
fn managed_holders(agent: &Agent, asker: &Asker, gid: u128, what: &str) -> Result<Vec<u32>, String> {
    let mut pids = agent.events.holders(gid);
    // A layer tells its agent of a connection up to 50 ms after making it (it batches what
    // it tells: `relink::hold_later`), while `vmictl status` lists it at once: a command
    // right after the set-up waits for the hold rather than call the connection unknown.
    let until = std::time::Instant::now() + HOLD_TOLD_WITHIN;
    while pids.is_empty() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(5));
        pids = agent.events.holders(gid);
    }
    if pids.is_empty() {
        return Err(format!("no process on this node holds connection {gid:032x}"));
    }
    if !pids.iter().all(|p| asker.may_manage(*p)) {
        agent.refusals.note(Refused::Local, || {
            format!("{} asked to {what} connection {gid:032x} of another user's process", asker.describe())
        });
        return Err(format!("not allowed to {what} connection {gid:032x}"));
    }
    Ok(pids)
}

/// Runs a command that may also come from another node (`Status`, `Net`, `Move`) for
/// `asker`.
pub fn command(agent: &Agent, asker: Asker, m: Msg) -> Msg {
    match m {
        Msg::Status => {
            // Other users see the node, and only their own processes in detail.
            let only = if asker.may_run_node() { None } else { Some(asker.uid.unwrap_or(u32::MAX)) };
            Msg::StatusReply { json: status::report(agent, only) }
        }
        Msg::Net { name, up } if !asker.may_run_node() => {
            agent.refusals.note(Refused::Local, || {
                format!(
                    "{} asked to take network {name} {}; only root or the agent's user may",
                    asker.describe(),
                    if up { "back into service" } else { "out of service" }
                )
            });
            Msg::Error { reason: format!("not allowed to change network {name}: run as root") }
        }
        Msg::Net { name, up } => {
            if asker.remote {
                info!(
                    "{} of the cluster takes network {name} {}",
                    asker.describe(),
                    if up { "back into service" } else { "out of service" }
                );
            }
            match agent.health.set_admin(&name, up, &agent.events) {
                Ok(_) => Msg::Ok,
                Err(reason) => Msg::Error { reason },
            }
        }
        Msg::Move { gid, shm } => {
            let pids = match managed_holders(agent, &asker, gid, "move") {
                Ok(p) => p,
                Err(reason) => return Msg::Error { reason },
            };
            if shm && pids.len() < 2 {
                Msg::Error {
                    reason: format!(
                        "the other end of connection {gid:032x} is not on this node: it stays on TCP"
                    ),
                }
            } else if agent.events.move_conn(gid, shm) {
                info!("connection {gid:032x}: moving to {}", if shm { "shared memory" } else { "TCP" });
                agent.journal.record(
                    "move",
                    pids.first().copied(),
                    serde_json::json!({ "gid": format!("{gid:032x}"), "to": if shm { "shm" } else { "tcp" } }),
                );
                Msg::Ok
            } else {
                Msg::Error { reason: format!("the processes holding {gid:032x} do not take events") }
            }
        }
        Msg::Chain { gid, spec } => {
            let pids = match managed_holders(agent, &asker, gid, "change the filters of") {
                Ok(p) => p,
                Err(reason) => return Msg::Error { reason },
            };
            if let Some(bad) = substrate::connection::Chain::build(&spec).map_or(Some(spec.clone()), |c| {
                c.ids().is_none().then(|| {
                    format!("{spec} (more than {} filters)", substrate::connection::chain::MAX_FILTERS)
                })
            }) {
                Msg::Error {
                    reason: format!(
                        "no such chain: {bad}; the filters are: {}",
                        substrate::connection::chain::DEVICE_NAMES.join(", ")
                    ),
                }
            } else if agent.events.tell_holders(gid, &Msg::Chain { gid, spec: spec.clone() }) {
                info!("connection {gid:032x}: chain \"{spec}\" asked for what its ends here send");
                agent.journal.record(
                    "chain",
                    pids.first().copied(),
                    serde_json::json!({ "gid": format!("{gid:032x}"), "chain": spec }),
                );
                Msg::Ok
            } else {
                Msg::Error { reason: format!("the processes holding {gid:032x} do not take events") }
            }
        }
        Msg::Device { load, name, gid, pid } => device(agent, &asker, load, &name, gid, pid),
        Msg::Profile { gid } => profile(agent, &asker, gid),
        Msg::Migrate { pid, to } => crate::migrate::run(agent, asker, pid, &to),
        other => Msg::Error { reason: format!("{} cannot be run from another node", other.name()) },
    }
}

/// `vmictl device load|unload NAME`: the device goes on (or off) both directions of one
/// connection, of every connection of a process, or of every connection on the node the
/// asker may manage; the layers holding them agree on the switch in band.
fn device(agent: &Agent, asker: &Asker, load: bool, name: &str, gid: u128, pid: u32) -> Msg {
    use substrate::connection::chain::{Chain, DEVICE_NAMES};
    let verb = if load { "load" } else { "unload" };
    let one = Chain::build(name).filter(|c| !c.is_empty() && !c.spec.contains(','));
    let name = match one {
        // (`zstd` is `zstd:3`: the layers compare names as the chain spells them.)
        Some(one) => one.spec,
        None if substrate::connection::chain::TAPS.contains(&name) => name.to_string(),
        // A plug-in (the layers load it from their plug-in folder, or refuse it and keep
        // their chain, with a log line that says why).
        None if substrate::connection::chain::plugin_name_ok(name)
            && !substrate::connection::chain::FILTERS.contains(&name)
            && plugin_dir(agent).join(format!("libvmi_dev_{name}.so")).is_file() =>
        {
            name.to_string()
        }
        None => {
            return Msg::Error {
                reason: format!(
                    "no such device: {name}; the devices are: {}, and the plug-ins of {}: {}",
                    DEVICE_NAMES.join(", "),
                    plugin_dir(agent).display(),
                    plugins_here(agent)
                ),
            }
        }
    };
    let name = name.as_str();
    let targets: Vec<(u128, Vec<u32>)> = if gid != 0 {
        match managed_holders(agent, asker, gid, &format!("{verb} a device on")) {
            Ok(pids) => vec![(gid, pids)],
            Err(reason) => return Msg::Error { reason },
        }
    } else if pid != 0 {
        if !asker.may_manage(pid) {
            agent.refusals.note(Refused::Local, || {
                format!(
                    "{} asked to {verb} device {name} on the connections of process {pid}",
                    asker.describe()
                )
            });
            return Msg::Error { reason: format!("not allowed to change the connections of process {pid}") };
        }
        let held = agent.events.held_by(Some(pid));
        if held.is_empty() {
            return Msg::Error { reason: format!("process {pid} holds no connection on this node") };
        }
        held
    } else {
        // Every connection the asker may manage (root: all of them).
        agent
            .events
            .held_by(None)
            .into_iter()
            .filter(|(_, pids)| pids.iter().all(|p| asker.may_manage(*p)))
            .collect()
    };
    let mut told = 0;
    for (g, pids) in &targets {
        let m = Msg::Device { load, name: name.to_string(), gid: *g, pid: 0 };
        if agent.events.tell_holders(*g, &m) {
            told += 1;
            agent.journal.record(
                "device",
                pids.first().copied(),
                serde_json::json!({ "gid": format!("{g:032x}"), "device": name, "op": verb }),
            );
        }
    }
    info!("device {name}: {verb} asked on {told} of {} connections", targets.len());
    if told == 0 && gid != 0 {
        return Msg::Error { reason: format!("the processes holding {gid:032x} do not take events") };
    }
    Msg::DeviceReply { conns: told as u32 }
}

/// The folder of device plug-ins.
fn plugin_dir(agent: &Agent) -> std::path::PathBuf {
    agent.plugins.get().cloned().unwrap_or_else(|| crate::config::DEFAULT_PLUGINS.into())
}

/// The plug-in devices of the folder, for messages ("none" when there are none).
fn plugins_here(agent: &Agent) -> String {
    let names = substrate::connection::chain::plugin_names(&plugin_dir(agent));
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// `vmictl profile GID`: asks a process holding the connection for its `profile` device's
/// figures, through a pipe passed down its event channel; the JSON it writes, or an error.
fn profile(agent: &Agent, asker: &Asker, gid: u128) -> Msg {
    use std::io::Read;
    if let Err(reason) = managed_holders(agent, asker, gid, "profile") {
        return Msg::Error { reason };
    }
    let (mut r, w) = match std::io::pipe() {
        Ok(p) => p,
        Err(e) => return Msg::Error { reason: format!("no pipe for the profile: {e}") },
    };
    let told = agent.events.tell_one_with_fd(gid, &Msg::Profile { gid }, w.as_raw_fd());
    drop(w);
    let Some(pid) = told else {
        return Msg::Error { reason: format!("the processes holding {gid:032x} do not take events") };
    };
    // (Read on a thread of its own, so that a process that never answers costs a wait of
    // bounded length here.)
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let r = (&mut r).take(16 << 20).read_to_string(&mut s).map(|_| s);
        let _ = tx.send(r);
    });
    match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(Ok(json)) if json.is_empty() => Msg::Error { reason: format!("process {pid} gave no profile") },
        Ok(Ok(json)) => match serde_json::from_str::<serde_json::Value>(&json) {
            Ok(v) => match v.get("error").and_then(|e| e.as_str()) {
                Some(e) => Msg::Error { reason: e.to_string() },
                None => Msg::ProfileReply { json },
            },
            Err(e) => Msg::Error { reason: format!("process {pid} gave a profile that is not JSON: {e}") },
        },
        Ok(Err(e)) => Msg::Error { reason: format!("reading process {pid}'s profile: {e}") },
        Err(_) => Msg::Error { reason: format!("process {pid} gave no profile within 5 s") },
    }
}

/// `vmictl capture GID -w FILE`: passes the file `vmictl` opened (`file`) to a process
/// holding the connection, which writes the connection's traffic there.
fn capture(
    agent: &Agent,
    asker: &Asker,
    gid: u128,
    duration_ms: u32,
    file: Option<std::os::fd::OwnedFd>,
) -> Msg {
    let Some(file) = file else {
        return Msg::Error { reason: "capture: no file came with the request".into() };
    };
    if let Err(reason) = managed_holders(agent, asker, gid, "capture") {
        return Msg::Error { reason };
    }
    match agent.events.tell_one_with_fd(gid, &Msg::Capture { gid, duration_ms }, file.as_raw_fd()) {
        Some(pid) => {
            info!("connection {gid:032x}: process {pid} captures its traffic for {duration_ms} ms");
            agent.journal.record(
                "capture",
                Some(pid),
                serde_json::json!({ "gid": format!("{gid:032x}"), "ms": duration_ms }),
            );
            Msg::Ok
        }
        None => Msg::Error { reason: format!("the processes holding {gid:032x} do not take events") },
    }
}

/// Sends the node's events after number `after` to `vmictl` on `s` (those `asker` may see),
/// then `Ok`; with `follow`, every later one as it happens, until `vmictl` goes away.
fn watch(agent: &Agent, asker: Asker, mut s: UnixStream, mut after: u64, follow: bool) -> io::Result<()> {
    let only = if asker.may_run_node() { None } else { Some(asker.uid.unwrap_or(u32::MAX)) };
    loop {
        let wait = if follow { Duration::from_millis(500) } else { Duration::ZERO };
        let (events, last) = agent.journal.since(after, only, wait);
        for e in events {
            write_msg(&mut s, &Msg::Happened { json: e.json.to_string() })?;
        }
        after = last;
        if !follow {
            return write_msg(&mut s, &Msg::Ok);
        }
        // Gone? (It sends nothing more: end of stream or an error.)
        let mut b = [0u8; 1];
        // SAFETY: a one-byte peek into a local buffer.
        let r = unsafe {
            libc::recv(s.as_raw_fd(), b.as_mut_ptr() as *mut _, 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
        };
        if r == 0 || (r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock) {
            return Ok(());
        }
    }
}

/// Serves the node's layers and `vmictl` on `listener`.
pub fn serve(agent: Arc<Agent>, listener: UnixListener) {
    for s in listener.incoming() {
        match s {
            Ok(s) => {
                let agent = agent.clone();
                let id = agent.next_client.fetch_add(1, Relaxed);
                std::thread::spawn(move || {
                    if let Err(e) = handle(&agent, id, s) {
                        if e.kind() != io::ErrorKind::UnexpectedEof {
                            info!("local client {id} closed: {e}");
                        }
                    }
                    let mut d = agent.dir.lock().unwrap_or_else(|e| e.into_inner());
                    d.drop_owner(id);
                    crate::registry::listeners(d.listeners().iter().map(|l| l.addr));
                    drop(d);
                    agent.tell_gone();
                    agent.procs.lock().unwrap_or_else(|e| e.into_inner()).gone(id);
                    agent.events.client_gone(id);
                    agent.accepts.detach(id);
                    agent.proven.lock().unwrap_or_else(|e| e.into_inner()).retain(|k| k.0 != id);
                });
            }
            Err(e) => warn!("accepting a local client: {e} (too many open files? see LimitNOFILE)"),
        }
    }
}

/// Waits until `fd` has something to read (or an error or hang-up to report). A thread asleep
/// in a blocking `recv` on a Unix socket is woken whenever the peer frees memory this socket
/// sent (the socket's "room to write" wake-up): each time a layer read one of our answers, the
/// thread that had sent it woke, found nothing to read and slept again, a wake-up of another
/// CPU per request. `poll` for input alone is not woken by those.
fn wait_readable(fd: i32) {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd. (EINTR and other errors: the read that follows reports.)
    unsafe { libc::poll(&mut p, 1, -1) };
}

fn handle(agent: &Agent, id: u64, mut s: UnixStream) -> io::Result<()> {
    loop {
        wait_readable(s.as_raw_fd());
        let (m, passed) = match read_msg_fd(s.as_raw_fd()) {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                warn!(
                    "malformed message from local client {id} (pid {}): {e}; closing it (does the layer come from the same build as the agent?)",
                    peer_pid(&s).map_or_else(|| "?".into(), |p| p.to_string())
                );
                let _ = write_msg(&mut s, &Msg::Error { reason: e.to_string() });
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let answer = match m {
            Msg::Hello { pid, name } => {
                info!("process {pid} ({name}) under the layer");
                agent.procs.lock().unwrap_or_else(|e| e.into_inner()).hello(id, pid, name, passed);
                // (The layers bind in the lower part of the block; the upper is for tickets.)
                let (first_port, ports) =
                    crate::tickets::split_of(agent.setup_ports.get().copied().unwrap_or((0, 0))).0;
                Msg::Welcome { chain: agent.chain.get().cloned().unwrap_or_default(), first_port, ports }
            }
            Msg::Table => {
                // Not answered.
                if let Some(fd) = &passed {
                    agent.accepts.attach(id, agent.pid_of(id), fd);
                }
                continue;
            }
            Msg::Listen { addr, window } => {
                debug!("listener {addr} (client {id})");
                // The listening socket rides along: a process that holds a TCP socket bound
                // to the address may have that listener's connections written in its table.
                let key = SocketAddr::new(normalize(addr.ip()), addr.port());
                let proof = passed.and_then(crate::accepts::tcp_names).map(|(l, _)| l);
                if proof.is_some_and(|l| SocketAddr::new(normalize(l.ip()), l.port()) == key) {
                    agent.proven.lock().unwrap_or_else(|e| e.into_inner()).insert((id, addr));
                }
                let mut d = agent.dir.lock().unwrap_or_else(|e| e.into_inner());
                let hold = d.listen(addr, window, id);
                crate::registry::listeners(d.listeners().iter().map(|l| l.addr));
                drop(d);
                if !hold.is_zero() {
                    // (The layer registers before it listens: this holds its `listen`.)
                    debug!("listener {addr}: a connection found nothing there a moment ago; its listen waits {hold:?}");
                    std::thread::sleep(hold);
                }
                Msg::Ok
            }
            Msg::Bound { ports } => {
                // Not answered: the layer does not wait for it.
                agent.bound(ports);
                continue;
            }
            Msg::Unlisten { addr } => {
                agent.proven.lock().unwrap_or_else(|e| e.into_inner()).remove(&(id, addr));
                let mut d = agent.dir.lock().unwrap_or_else(|e| e.into_inner());
                d.unlisten(addr, id);
                crate::registry::listeners(d.listeners().iter().map(|l| l.addr));
                drop(d);
                // (Before the answer: the layer closes the listener after it, and no agent
                // may announce a connection to a plain program listening there next.)
                agent.tell_gone();
                Msg::Ok
            }
            Msg::Connect { src, dst, gid, secret, window, .. } => {
                let answer = agent.connect(src, dst, gid, secret, window);
                let mut made = None;
                if let (Msg::Virtual { alias, gid, .. }, Some(pid)) = (&answer, agent.pid_of(id)) {
                    let gid = *gid;
                    agent.events.hold(id, pid, gid, true);
                    crate::registry::hold(gid, true, pid);
                    made = Some((pid, gid, if *alias != NO_ADDR { *alias } else { dst }));
                }
                write_msg(&mut s, &answer)?;
                // (Recorded after the answer: the program's connect does not wait for it.)
                if let Some((pid, gid, peer)) = made {
                    agent.journal.record_connection(pid, gid, "out", None, peer);
                }
                // (After the answer: the program's connect does not wait for it.)
                if let Msg::Virtual { window, addrs, alias: NO_ADDR, .. } = &answer {
                    agent.subscribe(src.port(), dst, *window, addrs);
                }
                continue;
            }
            Msg::Tickets { dst, want, window, returned, busy } => match agent.pid_of(id) {
                Some(pid) => {
                    let mut pool = agent.events.tickets.lock().unwrap_or_else(|e| e.into_inner());
                    for gid in returned {
                        pool.back(u64::from(pid), gid);
                    }
                    let now = Instant::now();
                    for gid in busy {
                        pool.busy(u64::from(pid), gid, now);
                    }
                    drop(pool);
                    agent.give_tickets(pid, dst, want, window)
                }
                None => Msg::Plain,
            },
            Msg::Accept { local, peer } => {
                let local = SocketAddr::new(normalize(local.ip()), local.port());
                let peer = SocketAddr::new(normalize(peer.ip()), peer.port());
                // Only a process holding the accepted socket learns the connection's identity
                // and secret: the socket rides along, and must be that connection.
                let n = |a: SocketAddr| SocketAddr::new(normalize(a.ip()), a.port());
                let holds = passed
                    .and_then(crate::accepts::tcp_names)
                    .is_some_and(|(l, p)| n(l) == local && p.map(n) == Some(peer));
                if !holds {
                    agent.refusals.note(Refused::Local, || {
                        format!(
                            "local client {id} asked about the connection {peer} -> {local} without holding its socket; answered plain"
                        )
                    });
                    write_msg(&mut s, &Msg::Plain)?;
                    continue;
                }
                let found = agent.accepted(local, peer);
                if let Some(e) = &found {
                    agent.accepts.count(false);
                    // Given out here: no process may take it from a table as well.
                    let owner = agent
                        .dir
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .listener_for(local)
                        .map(|l| l.owner);
                    for o in owner.into_iter().chain([id]) {
                        agent.accepts.clear(o, peer, local, e.gid);
                    }
                }
                if let (Some(e), Some(pid)) = (&found, agent.pid_of(id)) {
                    agent.events.hold(id, pid, e.gid, false);
                    crate::registry::hold(e.gid, false, pid);
                    agent.journal.record_connection(pid, e.gid, "in", Some(local), peer);
                }
                match found {
                    Some(e) => Msg::Virtual {
                        gid: e.gid,
                        secret: e.secret,
                        window: e.window,
                        // Where the connecting side's node is (the link may have to be
                        // rebuilt from this side, after a migration).
                        addrs: if e.agents.is_empty() { agent.health.advertised() } else { e.agents },
                        alias: if e.aim != local { e.aim } else { NO_ADDR },
                    },
                    None => Msg::Plain,
                }
            }
            Msg::Accepted { local, peer, gid } => {
                // Not answered: the layer took the connection from its table. (A layer since
                // 2026-11-28 says it on its event channel, with others.)
                if let Some(pid) = agent.pid_of(id) {
                    agent.events.hold(id, pid, gid, false);
                    agent.taken_from_table(pid, local, peer, gid);
                }
                continue;
            }
            m @ (Msg::Status
            | Msg::Net { .. }
            | Msg::Move { .. }
            | Msg::Chain { .. }
            | Msg::Device { .. }
            | Msg::Profile { .. }
            | Msg::Migrate { .. }) => command(agent, Asker::local(&s), m),
            Msg::Capture { gid, duration_ms } => capture(agent, &Asker::local(&s), gid, duration_ms, passed),
            Msg::Remote { to, cmd } => crate::cluster::remote(agent, Asker::local(&s), &to, &cmd),
            Msg::ClusterStatus => crate::cluster::status(agent, Asker::local(&s)),
            // (Other users see only their own connections: they ask the nodes.)
            Msg::Locate { gid } if Asker::local(&s).may_run_node() => crate::registry::locate(gid),
            Msg::GridStatus => crate::hier::grid_status(agent, Asker::local(&s)),
            Msg::WatchCluster { to, follow } => {
                return crate::cluster::watch(agent, Asker::local(&s), s, &to, follow)
            }
            Msg::Watch { after, follow } => return watch(agent, Asker::local(&s), s, after, follow),
            Msg::Events { pid } => {
                // From now on this connection is the process's event channel.
                agent.events.serve(id, pid, s);
                return Ok(());
            }
            Msg::Paths { peers, gid } => {
                // (A process restored here may ask about nodes this agent never heard of.)
                agent.health.learn(&peers);
                Msg::PathList { pairs: relink_ports(agent.health.paths_to(&peers), gid, agent.relink_ports) }
            }
            Msg::WhereAmI => Msg::Here { addrs: agent.health.advertised() },
            Msg::Sink { name } => match agent.sinks.get(&name) {
                Some(i) => Msg::SinkReply { devices: i.devices, why: i.why },
                None => Msg::SinkReply {
                    devices: -1,
                    why: format!(
                        "no sink plug-in {name} on this node (libvmi_sink_{name}.so in {})",
                        plugin_dir(agent).display()
                    ),
                },
            },
            Msg::Freeze { pid } if !may_manage(&s, pid) => {
                agent.refusals.note(Refused::Local, || {
                    format!("user {:?} asked to checkpoint another user's process {pid}", peer_uid(&s))
                });
                Msg::Error { reason: format!("not allowed to checkpoint process {pid}") }
            }
            Msg::Freeze { pid } => {
                let owners = agent.procs.lock().unwrap_or_else(|e| e.into_inner()).clients_of(pid);
                let listeners = agent.dir.lock().unwrap_or_else(|e| e.into_inner()).listeners_of(&owners);
                match agent.events.freeze(pid, FREEZE_TIMEOUT) {
                    Ok(true) => Msg::Frozen { listeners },
                    // Known here but its event channel is not open yet (it starts with the
                    // process's first contact): the caller tries again.
                    Ok(false) if !owners.is_empty() => {
                        Msg::Error { reason: format!("process {pid} is not ready yet (no event channel)") }
                    }
                    // Never talked to this agent: it holds no agent socket, nothing to do.
                    Ok(false) => Msg::Error { reason: format!("{NOT_HERE}: process {pid}") },
                    Err(reason) => Msg::Error { reason },
                }
            }
            Msg::Unfreeze { pid } if may_manage(&s, pid) => {
                agent.events.relinks.migrated(false);
                agent.events.unfreeze(pid);
                agent.journal.record(
                    "migration",
                    Some(pid),
                    serde_json::json!({ "phase": "stays here (checkpoint failed)" }),
                );
                Msg::Ok
            }
            Msg::Moved { pid, listeners, to } if may_manage(&s, pid) => {
                agent.events.relinks.migrated(true);
                let mut d = agent.dir.lock().unwrap_or_else(|e| e.into_inner());
                agent.journal.record(
                    "migration",
                    Some(pid),
                    serde_json::json!({ "phase": "moved away", "to": to.iter().map(|a| a.to_string()).collect::<Vec<_>>() }),
                );
                crate::registry::moved(listeners.clone(), to.clone());
                for l in listeners {
                    info!("listener {l} of process {pid} moved to the node at {to:?}");
                    d.forward(l, to.clone());
                }
                drop(d);
                agent.tell_gone();
                Msg::Ok
            }
            other => Msg::Error { reason: format!("unexpected message: {}", other.name()) },
        };
        write_msg(&mut s, &answer)?;
    }
}

/// The answer that hands tickets for listener `dst` (window `window`, its node's agents
/// `addrs`) to a process, announced from `src_ip`.
fn ticket_book(
    dst: SocketAddr,
    src_ip: IpAddr,
    window: u64,
    addrs: Vec<SocketAddr>,
    tickets: Vec<(u16, u128, u128)>,
) -> Msg {
    Msg::TicketBook {
        dst,
        src: SocketAddr::new(src_ip, 0),
        window,
        addrs,
        use_ms: crate::tickets::USE_WITHIN.as_millis() as u32,
        tickets,
    }
}

#[cfg(test)]
mod tests {
    use super::relink_ports;
    use std::net::SocketAddr;

    #[test]
    fn relink_ports_spread_by_gid_with_the_base_port_after() {
        let l: SocketAddr = "10.0.0.1:0".parse().unwrap();
        let p0: SocketAddr = "10.0.0.2:7787".parse().unwrap();
        let p1: SocketAddr = "10.1.0.2:7787".parse().unwrap();
        let paths = vec![(l, p0), (l, p1)];
        // One port, or no GID: unchanged.
        assert_eq!(relink_ports(paths.clone(), 7, 1), paths);
        assert_eq!(relink_ports(paths.clone(), 0, 4), paths);
        // A GID that picks the base port: unchanged.
        assert_eq!(relink_ports(paths.clone(), 8, 4), paths);
        // GID 7 of 4 ports: port + 3, then the base port, on each path in order.
        let out = relink_ports(paths.clone(), 7, 4);
        let ports: Vec<(String, u16)> = out.iter().map(|(_, p)| (p.ip().to_string(), p.port())).collect();
        assert_eq!(
            ports,
            [
                ("10.0.0.2".into(), 7790),
                ("10.0.0.2".into(), 7787),
                ("10.1.0.2".into(), 7790),
                ("10.1.0.2".into(), 7787)
            ]
        );
        // Over many GIDs every port is used, about equally.
        let mut seen = [0u32; 4];
        for g in 1..=4000u128 {
            let g = g.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
            seen[(relink_ports(vec![(l, p0)], g, 4)[0].1.port() - 7787) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| (800..=1200).contains(&n)), "{seen:?}");
        // Near the top of the port range, a port past 65535 is left out.
        let top: SocketAddr = "10.0.0.2:65535".parse().unwrap();
        assert_eq!(relink_ports(vec![(l, top)], 7, 4), vec![(l, top)]);
    }
}
