//! The cluster directory in etcd (`--directory etcd://HOST:PORT,..`): off unless asked for.
//!
//! One thread of its own runs the etcd client on a current-thread tokio runtime; the rest of
//! the agent talks to it through a channel and never waits on etcd: writes are queued and
//! done in the background, a lookup waits at most [`LOOKUP_BOUND`] and then falls back to
//! what the agent knows. The changes to connection ends wait in a table ([`Ends`]) that
//! keeps only the latest change of each end, and an end released before its record was
//! written costs nothing: whatever etcd's pace, what waits is bounded by the connections the
//! node has, not by how many came and went. They are written in batches, one request for up
//! to [`BATCH`] new ends (created where no record exists; one that exists is a connection
//! that moved here, taken by compare-and-swap) and one for up to [`BATCH`] released ones. The thread keeps a mirror of what this node put there (its
//! listeners, the ends of connections its processes hold, the listeners that moved away
//! from it), so that when etcd comes back after an outage, or the node's lease ended, it
//! registers again under a new lease and writes the mirror anew.
//!
//! An agent does not follow the whole cluster: it watches the node records of the nodes it
//! cares about (those its processes have connections with, asked of the agent every
//! [`SCOPE_EVERY`], and those a lookup led to), one etcd watch per node on one watch
//! stream, and drops a node's watch [`forget_after`] after it last cared. What it holds per
//! node is bounded by [`record::MAX_CACHED_NODES`], however large the cluster. A node
//! record it does not watch (where a moved listener went) is found on demand through the
//! `agent/ADDR` index, within the lookup's bound.
//!
//! ```text
//!  local.rs / events.rs ──Cmd──► [registry thread: tokio current-thread]
//!        (listen, hold,           ├─ lease: grant, keep alive every ttl/3
//!         release, moved)         ├─ puts and deletes, CAS on mod_revision for a moved GID
//!  cares() every 1 s ──────►      ├─ one watch per cared-for node/NODE → NodeCache → journal
//!  expect_here ──Lookup──►        │    (joined, left); dropped 6 leases after it stops caring
//!        ◄── answer within 300 ms └─ Status (for `vmictl status`)
//! ```
//! Without the option nothing here runs: every function below returns at once.

pub mod record;

use crate::journal::Journal;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use record::{NodeCache, NodeChange, NodeRec, PlaceRec};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// Longest a lookup waits for the directory before the agent goes on without it.
pub const LOOKUP_BOUND: Duration = Duration::from_millis(300);
/// Default lease time to live, seconds.
pub const DEFAULT_TTL_S: u64 = 10;
/// Longest one etcd request may take before the session counts as broken.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Wait between two attempts to reach etcd (doubling up to [`MAX_BACKOFF`]).
const MIN_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Operations per transaction when the mirror is written anew, and changes of ends per
/// request.
const BATCH: usize = 64;
/// How long a new connection's end waits before it is written: a connection that ends
/// sooner never reaches etcd (a process tells the agent of its closed connections within
/// half a second), and bursts are written in batches. An end that came to this node (a
/// process restored here) is written at once.
pub const WRITE_DELAY: Duration = Duration::from_secs(1);
/// How often the agent is asked which nodes it cares about.
pub const SCOPE_EVERY: Duration = Duration::from_secs(1);
/// How long a node's watch stays after the agent last cared about it: six lease times
/// (60 s with the default lease), at least 20 s, at most 10 minutes.
pub fn forget_after(ttl_s: u64) -> Duration {
    Duration::from_secs(ttl_s.saturating_mul(6).clamp(20, 600))
}
/// Most watched nodes `vmictl status` names.
const SHOWN: usize = 32;
/// The watch id of this node's own record (the one the watch stream opens with).
const OWN_WATCH: i64 = 1;

/// What the directory thread needs to start.
pub struct Config {
    /// etcd endpoints (`http://HOST:PORT`, or `https://` with `tls`).
    pub endpoints: Vec<String>,
    /// TLS to etcd: the CA its servers' certificates are checked against, and the agent's
    /// client certificate if any (see [`Tls::load`]).
    pub tls: Option<Tls>,
    /// Lease time to live, seconds.
    pub ttl_s: u64,
    /// The cluster id (prefix of every key).
    pub cluster_id: u16,
    /// This node's name.
    pub node: String,
    /// This node's record as it is now (asked at every registration).
    pub describe: Box<dyn Fn() -> NodeRec + Send>,
    /// The other nodes this agent cares about now (those its processes have connections
    /// with), asked every [`SCOPE_EVERY`].
    pub cares: Box<dyn Fn() -> Vec<String> + Send>,
    /// The node's journal.
    pub journal: Arc<Journal>,
}

/// What the agent talks TLS to etcd with, read at start.
#[derive(Clone)]
pub struct Tls {
    ca: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl Tls {
    /// Reads the CA certificates (PEM) and, if given, the client certificate and its key
    /// (PEM; the key file must be readable by its owner only, like the cluster key).
    pub fn load(ca: &Path, client: Option<(&Path, &Path)>) -> Result<Tls, String> {
        let pem = |path: &Path, what: &str| -> Result<Vec<u8>, String> {
            let b = std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
            if !b.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(format!("{what} {}: not PEM (no -----BEGIN line)", path.display()));
            }
            Ok(b)
        };
        let ca = pem(ca, "directory-ca")?;
        let identity = match client {
            Some((cert, key)) => {
                let c = pem(cert, "directory-cert")?;
                let k = crate::mesh::read_private(key, "directory-key", "")?;
                if !k.windows(11).any(|w| w == b"-----BEGIN ") {
                    return Err(format!("directory-key {}: not PEM (no -----BEGIN line)", key.display()));
                }
                Some((c, k))
            }
            None => None,
        };
        Ok(Tls { ca, identity })
    }

    fn options(&self) -> etcd_client::TlsOptions {
        let mut t =
            etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(&self.ca));
        if let Some((c, k)) = &self.identity {
            t = t.identity(etcd_client::Identity::from_pem(c, k));
        }
        t
    }
}

enum Cmd {
    Listeners(BTreeSet<SocketAddr>),
    Moved { addrs: Vec<SocketAddr>, to: Vec<SocketAddr> },
    Lookup { key: String, prefix: bool, reply: std::sync::mpsc::SyncSender<Vec<(String, Vec<u8>)>> },
}

/// What `vmictl status` shows of the directory.
#[derive(Default)]
struct State {
    connected: bool,
    lease: Option<i64>,
    last_error: Option<String>,
    outages: u64,
    registrations: u64,
    registered_ms: Option<u64>,
    nodes: NodeCache,
    /// Node watches held now.
    watches: usize,
    /// The first [`SHOWN`] nodes watched, by name.
    watched: Vec<String>,
    /// Nodes a lookup led to since the worker last looked (it then watches them).
    looked_up: BTreeSet<String>,
}

/// One end of a connection: (GID, the connecting side).
type End = (u128, bool);

/// The latest change asked for one end's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EndChange {
    /// Held by this process here (set up, or restored here).
    Hold(u32),
    /// No longer held here; `delete`: its record goes.
    Release { delete: bool },
}

/// Changes to connection ends not yet taken by the directory thread: the latest of each end,
/// in the order the ends were first asked about, each taken [`WRITE_DELAY`] after that. A
/// release of an end the thread never took a hold of drops what waits for it and is not
/// written at all (a connection shorter than the delay costs etcd nothing), so what waits is
/// at most the ends the node holds plus those it released since the thread last took
/// changes.
#[derive(Default)]
struct Ends {
    /// The latest change of each end, and when the end was first asked about.
    latest: HashMap<End, (EndChange, Instant)>,
    /// Ends in the order they were first asked about (an entry whose time is not its end's
    /// in `latest` is stale and skipped), and those to be written at once.
    order: VecDeque<(End, Instant)>,
    soon: VecDeque<(End, Instant)>,
    /// Ends whose hold the thread has taken (it wrote their record, or will at the next
    /// registration), until it takes their release.
    taken: HashSet<End>,
    /// Most changes waiting at once so far.
    peak: usize,
    /// Changes asked for, and those that never reached etcd (released before written, or
    /// overtaken by a later change of the same end).
    asked: u64,
    spared: u64,
}

impl Ends {
    /// Notes a change; true when nothing waited before it (the thread must be woken: it
    /// sleeps until the oldest waiting change is due, or until woken).
    fn ask(&mut self, end: End, c: EndChange, now: Instant, at_once: bool) -> bool {
        let was_empty = self.latest.is_empty();
        self.asked += 1;
        if matches!(c, EndChange::Release { .. }) && !self.taken.contains(&end) {
            if self.latest.remove(&end).is_some() {
                self.spared += 1;
            }
            self.spared += 1;
            return false;
        }
        match self.latest.get_mut(&end) {
            Some(w) if !at_once => {
                w.0 = c;
                self.spared += 1;
            }
            Some(w) => {
                // Now urgent: its place in `order` goes stale.
                *w = (c, now);
                self.spared += 1;
                self.soon.push_back((end, now));
            }
            None => {
                self.latest.insert(end, (c, now));
                if at_once {
                    self.soon.push_back((end, now));
                } else {
                    self.order.push_back((end, now));
                }
            }
        }
        self.peak = self.peak.max(self.latest.len());
        // Ends dropped from `latest` leave their place in `order`: trim them now and then.
        if self.order.len() + self.soon.len() > 2 * self.latest.len() + 1024 {
            let latest = &self.latest;
            self.order.retain(|(e, t)| latest.get(e).is_some_and(|w| w.1 == *t));
            self.soon.retain(|(e, t)| latest.get(e).is_some_and(|w| w.1 == *t));
        }
        was_empty
    }

    /// Up to `n` changes asked about at least `delay` before `now`, oldest first (the
    /// thread answers for them from then on); and when the next one is due, if any waits.
    fn take(&mut self, n: usize, now: Instant, delay: Duration) -> (Vec<(End, EndChange)>, Option<Instant>) {
        let mut out = Vec::new();
        while out.len() < n {
            let Some((end, t)) = self.soon.pop_front() else { break };
            if self.latest.get(&end).is_some_and(|w| w.1 == t) {
                self.take_one(end, &mut out);
            }
        }
        if !self.soon.is_empty() {
            return (out, Some(now));
        }
        while let Some(&(end, t)) = self.order.front() {
            let current = self.latest.get(&end).is_some_and(|w| w.1 == t);
            if !current {
                self.order.pop_front();
                continue;
            }
            if out.len() >= n || now.saturating_duration_since(t) < delay {
                return (out, Some(t + delay));
            }
            self.order.pop_front();
            self.take_one(end, &mut out);
        }
        (out, None)
    }

    fn take_one(&mut self, end: End, out: &mut Vec<(End, EndChange)>) {
        let Some((c, _)) = self.latest.remove(&end) else { return };
        match c {
            EndChange::Hold(_) => self.taken.insert(end),
            EndChange::Release { .. } => self.taken.remove(&end),
        };
        out.push((end, c));
    }
}

struct Handle {
    tx: mpsc::UnboundedSender<Cmd>,
    /// Changes to connection ends, and the thread's wake-up for them.
    ends: Arc<Mutex<Ends>>,
    ends_ready: Arc<tokio::sync::Notify>,
    state: Arc<Mutex<State>>,
    endpoints: Vec<String>,
    ttl_s: u64,
    prefix: String,
    node: String,
}

static DIR: OnceLock<Handle> = OnceLock::new();

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn ends_of(h: &Handle) -> std::sync::MutexGuard<'_, Ends> {
    h.ends.lock().unwrap_or_else(|e| e.into_inner())
}

fn ask(end: End, c: EndChange, at_once: bool) {
    if let Some(h) = DIR.get() {
        if ends_of(h).ask(end, c, Instant::now(), at_once) || at_once {
            h.ends_ready.notify_one();
        }
    }
}

fn send(c: Cmd) {
    if let Some(h) = DIR.get() {
        let _ = h.tx.send(c);
    }
}

/// True if a directory is configured.
pub fn enabled() -> bool {
    DIR.get().is_some()
}

/// Starts the directory thread (once).
pub fn start(cfg: Config) -> Result<(), String> {
    let (tx, rx) = mpsc::unbounded_channel();
    let state = Arc::new(Mutex::new(State::default()));
    let prefix = record::prefix(cfg.cluster_id);
    let ends = Arc::new(Mutex::new(Ends::default()));
    let ends_ready = Arc::new(tokio::sync::Notify::new());
    let h = Handle {
        tx,
        ends: ends.clone(),
        ends_ready: ends_ready.clone(),
        state: state.clone(),
        endpoints: cfg.endpoints.clone(),
        ttl_s: cfg.ttl_s,
        prefix: prefix.clone(),
        node: cfg.node.clone(),
    };
    if DIR.set(h).is_err() {
        return Err("the directory is already started".into());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("directory: cannot make its runtime: {e}"))?;
    let w = Worker {
        cfg,
        prefix,
        rx,
        ends,
        ends_ready,
        ends_due: None,
        state,
        mirror: Mirror::default(),
        agents: Vec::new(),
        want: HashMap::new(),
        watching: HashMap::new(),
        next_watch: OWN_WATCH + 1,
        leases: [0; 3],
    };
    std::thread::Builder::new()
        .name("vmi-directory".into())
        .spawn(move || rt.block_on(w.run()))
        .map_err(|e| format!("directory: cannot start its thread: {e}"))?;
    Ok(())
}

/// The node's listeners are now `addrs` (the whole set: the thread puts and deletes the
/// difference).
pub fn listeners<I: IntoIterator<Item = SocketAddr>>(addrs: I) {
    if enabled() {
        send(Cmd::Listeners(addrs.into_iter().collect()));
    }
}

/// Process `pid` of this node holds end `active` of connection `gid`, set up here: written
/// after [`WRITE_DELAY`] if it still is.
pub fn hold(gid: u128, active: bool, pid: u32) {
    ask((gid, active), EndChange::Hold(pid), false);
}

/// Process `pid` holds end `active` of connection `gid` again, or holds it here after it
/// was restored on this node: written at once (the record then moves here by
/// compare-and-swap).
pub fn hold_again(gid: u128, active: bool, pid: u32) {
    ask((gid, active), EndChange::Hold(pid), true);
}

/// End `active` of connection `gid` is no longer held here; `delete`: its record goes
/// (false when its process was frozen for a checkpoint: the node it is restored on moves the
/// record by compare-and-swap, and until then it stays, under this node's lease).
pub fn release(gid: u128, active: bool, delete: bool) {
    ask((gid, active), EndChange::Release { delete }, false);
}

/// The listeners at `addrs` moved from this node to the node whose agents are at `to`.
pub fn moved(addrs: Vec<SocketAddr>, to: Vec<SocketAddr>) {
    send(Cmd::Moved { addrs, to });
}

/// Most nodes one lookup of a moved listener follows.
const MAX_HOPS: usize = 8;

/// A moved listener's forward, as the directory knows it now: from this node's record of
/// where it went, node to node through their records of where it went next (a process
/// migrated several times), all within [`LOOKUP_BOUND`] together. The forward this node
/// knows when the directory has no answer.
pub fn follow(f: crate::directory::Forward) -> crate::directory::Forward {
    let Some(h) = DIR.get() else { return f };
    let t = Instant::now();
    let deadline = t + LOOKUP_BOUND;
    let mut node = h.node.clone();
    let mut to: Option<PlaceRec> = None;
    let mut seen = vec![node.clone()];
    for _ in 0..MAX_HOPS {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(kvs) = lookup(record::moved_key(&h.prefix, &node, f.addr), false, left) else { break };
        let Some(p) =
            kvs.first().and_then(|(_, v)| record::parse_place(v).ok()).filter(|p| !p.agents.is_empty())
        else {
            break;
        };
        let cached =
            h.state.lock().unwrap_or_else(|e| e.into_inner()).nodes.node_at(&p.agents).map(str::to_string);
        let next = cached.or_else(|| node_of(&h.prefix, &p.agents, deadline));
        to = Some(p);
        match next {
            Some(n) if !seen.contains(&n) => {
                seen.push(n.clone());
                node = n;
            }
            _ => break,
        }
    }
    match to {
        Some(p) => {
            info!(
                "directory: listener {} moved on to node {} ({} node(s) followed in {} us)",
                f.addr,
                seen.last().map_or("?", |s| s.as_str()),
                seen.len() - 1,
                t.elapsed().as_micros()
            );
            crate::directory::Forward { addr: f.addr, to: p.agents }
        }
        None => f,
    }
}

/// The node whose agent is at one of `agents`, read from the directory's `agent/ADDR` index
/// (a node this agent does not watch), by `deadline`; the node is watched from then on for a
/// while.
fn node_of(prefix: &str, agents: &[SocketAddr], deadline: Instant) -> Option<String> {
    for a in agents.iter().take(4) {
        let left = deadline.saturating_duration_since(Instant::now());
        let kvs = lookup(record::agent_key(prefix, *a), false, left)?;
        if let Some(p) = kvs.first().and_then(|(_, v)| record::parse_place(v).ok()) {
            if let Some(h) = DIR.get() {
                let mut st = h.state.lock().unwrap_or_else(|e| e.into_inner());
                if st.looked_up.len() < record::MAX_CACHED_NODES {
                    st.looked_up.insert(p.node.clone());
                }
            }
            return Some(p.node);
        }
    }
    None
}

fn lookup(key: String, prefix: bool, wait: Duration) -> Option<Vec<(String, Vec<u8>)>> {
    let h = DIR.get()?;
    if wait.is_zero() || !h.state.lock().unwrap_or_else(|e| e.into_inner()).connected {
        return None;
    }
    let (reply, answer) = std::sync::mpsc::sync_channel(1);
    h.tx.send(Cmd::Lookup { key, prefix, reply }).ok()?;
    answer.recv_timeout(wait).ok()
}

/// Where the ends of connection `gid` live, by the directory: `[(side, place)]`, side
/// `out` (the connecting end) or `in`. `None`: no directory or no answer in time.
pub fn where_gid(gid: u128) -> Option<Vec<(String, PlaceRec)>> {
    let h = DIR.get()?;
    let kvs = lookup(record::gid_prefix(&h.prefix, gid), true, LOOKUP_BOUND)?;
    Some(
        kvs.iter()
            .filter_map(|(k, v)| {
                let side = k.rsplit('/').next()?.to_string();
                Some((side, record::parse_place(v).ok()?))
            })
            .collect(),
    )
}

/// The answer to `vmictl where GID` from the directory: `{"gid", "ends": [{"side",
/// "node", "agents", "pid"}], "lookup_us"}`, or an error when no directory is configured
/// or it did not answer within [`LOOKUP_BOUND`].
pub fn locate(gid: u128) -> substrate::wire::agent::Msg {
    use substrate::wire::agent::Msg;
    if !enabled() {
        return Msg::Error { reason: "no cluster directory is configured on this node (--directory)".into() };
    }
    let t = Instant::now();
    match where_gid(gid) {
        Some(ends) => {
            let ends: Vec<Value> = ends
                .into_iter()
                .map(|(side, p)| json!({ "side": side, "node": p.node, "agents": p.agents, "pid": p.pid }))
                .collect();
            let json = json!({ "gid": format!("{gid:032x}"), "ends": ends, "lookup_us": t.elapsed().as_micros() as u64 });
            Msg::StatusReply { json: json.to_string() }
        }
        None => Msg::Error {
            reason: format!("the cluster directory did not answer within {} ms", LOOKUP_BOUND.as_millis()),
        },
    }
}

/// The directory's part of the status report (`null` when none is configured).
pub fn status_json() -> Value {
    let Some(h) = DIR.get() else { return Value::Null };
    let (waiting, peak, asked, spared) = {
        let e = ends_of(h);
        (e.latest.len(), e.peak, e.asked, e.spared)
    };
    let s = h.state.lock().unwrap_or_else(|e| e.into_inner());
    json!({
        "endpoints": h.endpoints,
        "prefix": h.prefix,
        "connected": s.connected,
        "lease": s.lease.map(|l| format!("{l:x}")),
        "ttl_s": h.ttl_s,
        "last_error": s.last_error,
        "outages": s.outages,
        "registrations": s.registrations,
        "registered_ms": s.registered_ms,
        "nodes_known": s.nodes.len(),
        "node_watches": s.watches,
        "watched": s.watched,
        "nodes_not_watched": s.nodes.overflow,
        "ends_waiting": waiting,
        "ends_waiting_peak": peak,
        "end_changes": asked,
        "end_changes_spared": spared,
    })
}

/// What this node wrote, to write again under a new lease.
#[derive(Default)]
struct Mirror {
    listeners: BTreeSet<SocketAddr>,
    gids: BTreeMap<(u128, bool), u32>,
    /// Ends taken on here whose record was not yet moved by compare-and-swap (etcd was
    /// down, or the session broke mid-way): at registration they go through
    /// [`Worker::hold`], which tells where they came from, not through the plain rewrite.
    unsure: BTreeSet<(u128, bool)>,
    moved: BTreeMap<SocketAddr, Vec<SocketAddr>>,
}

struct Worker {
    cfg: Config,
    prefix: String,
    rx: mpsc::UnboundedReceiver<Cmd>,
    ends: Arc<Mutex<Ends>>,
    ends_ready: Arc<tokio::sync::Notify>,
    /// When the oldest change of an end waiting is due.
    ends_due: Option<Instant>,
    state: Arc<Mutex<State>>,
    mirror: Mirror,
    /// The agent addresses of the node's record, as last registered.
    agents: Vec<SocketAddr>,
    /// The nodes cared about, and when last (kept across sessions).
    want: HashMap<String, Instant>,
    /// The nodes watched on this session's watch stream: key → (node, watch id).
    watching: HashMap<String, (String, i64)>,
    /// The next watch id on the stream.
    next_watch: i64,
    /// The leases whose registrations wrote records last (0: none), newest first: a record under one of them is
    /// this node's own, which a registration may write over.
    leases: [i64; 3],
}

/// Wakes the directory thread for changes of ends: when one is asked for with nothing
/// waiting before it, or when the oldest waiting is due.
async fn ends_wake(ready: &tokio::sync::Notify, due: Option<Instant>) {
    match due {
        Some(t) => tokio::select! {
            _ = ready.notified() => {}
            _ = tokio::time::sleep_until(t.into()) => {}
        },
        None => ready.notified().await,
    }
}

/// Why a session with etcd ended.
type Broken = String;

fn err(what: &str, e: impl std::fmt::Display) -> Broken {
    format!("{what}: {e}")
}

async fn bounded<T, E: std::fmt::Display>(
    what: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, Broken> {
    match tokio::time::timeout(REQUEST_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(err(what, e)),
        Err(_) => Err(format!("{what}: no answer within {} ms", REQUEST_TIMEOUT.as_millis())),
    }
}

/// One registration: a client, a lease and the lease's id.
struct Session {
    client: Client,
    lease: i64,
}

impl Worker {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn run(mut self) {
        let mut backoff = MIN_BACKOFF;
        let mut down_since: Option<Instant> = None;
        loop {
            let started = Instant::now();
            let why = self.session(&mut down_since).await;
            let was_connected = {
                let mut s = self.state();
                let was = s.connected;
                s.connected = false;
                s.lease = None;
                s.last_error = Some(why.clone());
                was
            };
            if was_connected || down_since.is_none() {
                // One warning per outage; the attempts after it are quiet.
                let hint = match (&self.cfg.tls, why.contains("transport")) {
                    (_, false) => "",
                    (None, true) => " (if etcd serves TLS only, give the agent its CA: directory-ca)",
                    (Some(_), true) => " (over TLS: is etcd's certificate signed by directory-ca, for the address named here, and this agent's directory-cert by a CA etcd trusts, --trusted-ca-file?)",
                };
                warn!(
                    "directory: etcd at {} unreachable: {why}{hint}; connections go on with what this agent knows, retrying",
                    self.cfg.endpoints.join(",")
                );
                self.state().outages += 1;
                self.cfg.journal.record("directory", None, json!({ "state": "unreachable", "error": why }));
                down_since = Some(Instant::now());
            } else {
                debug!("directory: still unreachable: {why}");
            }
            if started.elapsed() > Duration::from_secs(5) {
                backoff = MIN_BACKOFF;
            }
            // Wait, still taking commands (into the mirror; lookups get no answer).
            let until = tokio::time::Instant::now() + backoff;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => break,
                    c = self.rx.recv() => match c {
                        Some(c) => self.offline(c),
                        None => return,
                    },
                    _ = ends_wake(&self.ends_ready, self.ends_due) => loop {
                        let batch = self.take_ends();
                        if batch.is_empty() {
                            break;
                        }
                        self.ends_offline(batch);
                    },
                }
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// A command while etcd is not reached.
    fn offline(&mut self, c: Cmd) {
        match c {
            Cmd::Listeners(l) => {
                self.mirror.moved.retain(|a, _| !l.contains(a));
                self.mirror.listeners = l;
            }
            Cmd::Moved { addrs, to } => {
                for a in addrs {
                    self.mirror.moved.insert(a, to.clone());
                }
            }
            Cmd::Lookup { reply, .. } => drop(reply),
        }
    }

    /// The changes of ends due now (at most a batch); notes when the next is due.
    fn take_ends(&mut self) -> Vec<(End, EndChange)> {
        let (batch, due) =
            self.ends.lock().unwrap_or_else(|e| e.into_inner()).take(BATCH, Instant::now(), WRITE_DELAY);
        self.ends_due = due;
        batch
    }

    /// Changes of ends while etcd is not reached: into the mirror, written at registration
    /// (a hold as "unsure": it may be a connection that moved here).
    fn ends_offline(&mut self, batch: Vec<(End, EndChange)>) {
        for (end, c) in batch {
            match c {
                EndChange::Hold(pid) => {
                    self.mirror.gids.insert(end, pid);
                    self.mirror.unsure.insert(end);
                }
                EndChange::Release { .. } => {
                    self.mirror.gids.remove(&end);
                    self.mirror.unsure.remove(&end);
                }
            }
        }
    }

    /// Changes of ends while registered: the releases in one request, each deleting its
    /// record only if it is still under this node's lease (a node the end moved to has its
    /// own); the holds in another, each creating its record where none exists. A hold whose
    /// record exists is a connection that came here (or a process that holds its end
    /// again): it goes by compare-and-swap ([`Worker::hold`]).
    async fn ends_online(&mut self, s: &mut Session, batch: Vec<(End, EndChange)>) -> Result<(), Broken> {
        let mut deletes = Vec::new();
        let mut holds = Vec::new();
        for (end, c) in batch {
            match c {
                EndChange::Hold(pid) => {
                    self.mirror.gids.insert(end, pid);
                    self.mirror.unsure.insert(end);
                    holds.push((end, pid));
                }
                EndChange::Release { delete } => {
                    self.mirror.gids.remove(&end);
                    self.mirror.unsure.remove(&end);
                    if delete {
                        let key = record::gid_key(&self.prefix, end.0, end.1);
                        deletes.push(TxnOp::txn(
                            Txn::new()
                                .when([Compare::lease(key.as_str(), CompareOp::Equal, s.lease)])
                                .and_then([TxnOp::delete(key.as_str(), None::<DeleteOptions>)]),
                        ));
                    }
                }
            }
        }
        if !deletes.is_empty() {
            bounded("release GIDs", s.client.txn(Txn::new().and_then(deletes))).await?;
        }
        self.write_holds(s, holds).await
    }

    /// Writes the records of ends held here: created in one request where none exists,
    /// the others one by one by compare-and-swap.
    async fn write_holds(&mut self, s: &mut Session, holds: Vec<(End, u32)>) -> Result<(), Broken> {
        if holds.is_empty() {
            return Ok(());
        }
        let ops: Vec<TxnOp> = holds
            .iter()
            .map(|((gid, active), pid)| {
                let key = record::gid_key(&self.prefix, *gid, *active);
                TxnOp::txn(
                    Txn::new().when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)]).and_then(
                        [TxnOp::put(
                            key.as_str(),
                            self.place(Some(*pid), self.agents.clone()),
                            Some(PutOptions::new().with_lease(s.lease)),
                        )],
                    ),
                )
            })
            .collect();
        let r = bounded("hold GIDs", s.client.txn(Txn::new().and_then(ops))).await?;
        let created: Vec<bool> = r
            .op_responses()
            .into_iter()
            .map(|o| matches!(o, etcd_client::TxnOpResponse::Txn(t) if t.succeeded()))
            .collect();
        for (i, ((gid, active), pid)) in holds.into_iter().enumerate() {
            if created.get(i).copied().unwrap_or(false) {
                self.mirror.unsure.remove(&(gid, active));
            } else {
                self.hold(s, gid, active, pid).await?;
            }
        }
        Ok(())
    }

    fn place(&self, pid: Option<u32>, agents: Vec<SocketAddr>) -> Vec<u8> {
        serde_json::to_vec(&PlaceRec { node: self.cfg.node.clone(), agents, pid }).unwrap_or_default()
    }

    fn listener_value(&self, addr: SocketAddr) -> Vec<u8> {
        serde_json::to_vec(&record::ListenRec { node: self.cfg.node.clone(), addr }).unwrap_or_default()
    }

    /// Connects, registers under a new lease, writes the mirror, then serves commands, keeps
    /// the lease alive and follows the node prefix until something breaks.
    async fn session(&mut self, down_since: &mut Option<Instant>) -> Broken {
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            .with_require_leader(true);
        if let Some(t) = &self.cfg.tls {
            opts = opts.with_tls(t.options());
        }
        let client = match bounded("connect", Client::connect(&self.cfg.endpoints, Some(opts))).await {
            Ok(c) => c,
            Err(e) => return e,
        };
        let mut s = match self.register(client).await {
            Ok(s) => s,
            Err(e) => return e,
        };
        let back = down_since.take();
        {
            let mut st = self.state();
            st.connected = true;
            st.lease = Some(s.lease);
            st.registrations += 1;
            st.registered_ms = Some(now_ms());
        }
        match back {
            Some(t) => info!(
                "directory: etcd back after {:.1} s; node {} registered again (lease {:x})",
                t.elapsed().as_secs_f64(),
                self.cfg.node,
                s.lease
            ),
            None => info!(
                "directory: node {} registered in etcd at {} (lease {:x}, {} s)",
                self.cfg.node,
                self.cfg.endpoints.join(","),
                s.lease,
                self.cfg.ttl_s
            ),
        }
        self.cfg.journal.record(
            "directory",
            None,
            json!({ "state": "registered", "lease": format!("{:x}", s.lease) }),
        );
        let node_prefix = format!("{}node/", self.prefix);
        let (mut keeper, mut alive) = match bounded("keep-alive", s.client.lease_keep_alive(s.lease)).await {
            Ok(k) => k,
            Err(e) => return e,
        };
        let mut watch = match self.follow_nodes(&mut s.client).await {
            Ok(w) => w,
            Err(e) => return e,
        };
        let mut tick = tokio::time::interval(
            Duration::from_millis(self.cfg.ttl_s * 1000 / 3).max(Duration::from_millis(300)),
        );
        let mut scope = tokio::time::interval(SCOPE_EVERY);
        loop {
            tokio::select! {
                c = self.rx.recv() => {
                    let Some(c) = c else { return "the agent is stopping".into() };
                    if let Err(e) = self.online(&mut s, c).await {
                        return e;
                    }
                }
                _ = ends_wake(&self.ends_ready, self.ends_due) => loop {
                    let batch = self.take_ends();
                    if batch.is_empty() {
                        break;
                    }
                    if let Err(e) = self.ends_online(&mut s, batch).await {
                        return e;
                    }
                },
                _ = tick.tick() => {
                    let r = tokio::time::timeout(REQUEST_TIMEOUT, async {
                        keeper.keep_alive().await?;
                        alive.message().await
                    }).await;
                    match r {
                        Ok(Ok(Some(m))) if m.ttl() > 0 => {}
                        Ok(Ok(Some(_))) => return format!("lease {:x} ended (etcd did not hear from this agent in time)", s.lease),
                        Ok(Ok(None)) => return "the lease's keep-alive stream ended".into(),
                        Ok(Err(e)) => return err("keep-alive", e),
                        Err(_) => return format!("keep-alive: no answer within {} ms", REQUEST_TIMEOUT.as_millis()),
                    }
                }
                _ = scope.tick() => {
                    if let Err(e) = self.scope(&mut s.client, &mut watch).await {
                        return e;
                    }
                }
                m = watch.message() => match m {
                    Ok(Some(r)) => {
                        if r.canceled() {
                            // A watch this agent dropped is answered so; any other ended on
                            // etcd's side (compaction): the session starts over.
                            if r.watch_id() == OWN_WATCH || self.watching.values().any(|(_, id)| *id == r.watch_id()) {
                                return format!("a node watch was canceled: {}", r.cancel_reason());
                            }
                            continue;
                        }
                        for ev in r.events() {
                            let Some(kv) = ev.kv() else { continue };
                            // Only nodes watched now (an event of a watch being dropped may
                            // still arrive).
                            if !self.watching.contains_key(kv.key_str().unwrap_or("")) {
                                continue;
                            }
                            let change = {
                                let mut st = self.state();
                                match ev.event_type() {
                                    EventType::Put => st.nodes.put(kv.value()).unwrap_or_else(|e| {
                                        debug!("directory: node record {:?}: {e}", kv.key_str().unwrap_or("?"));
                                        NodeChange::None
                                    }),
                                    EventType::Delete => st.nodes.delete(&node_prefix, kv.key_str().unwrap_or("")),
                                }
                            };
                            self.note(change);
                        }
                    }
                    Ok(None) => return "the watch of the nodes ended".into(),
                    Err(e) => return err("watch", e),
                },
            }
        }
    }

    fn note(&self, c: NodeChange) {
        let (what, name) = match c {
            NodeChange::Joined(n) => ("joined", n),
            NodeChange::Left(n) => ("left", n),
            NodeChange::Updated(_) | NodeChange::None => return,
        };
        if name == self.cfg.node {
            return;
        }
        info!("directory: node {name} {what} the cluster");
        self.cfg.journal.record("node", None, json!({ "node": name, "change": what }));
    }

    /// Opens this session's watch stream (on this node's own record) and watches again the
    /// nodes cared about before: what changed meanwhile (a node that left or came back while
    /// etcd was out of reach) is journalled.
    async fn follow_nodes(&mut self, client: &mut Client) -> Result<etcd_client::WatchStream, Broken> {
        let own = record::node_key(&self.prefix, &self.cfg.node);
        let mut watch =
            bounded("watch nodes", client.watch(own, Some(WatchOptions::new().with_watch_id(OWN_WATCH))))
                .await?;
        self.watching.clear();
        self.next_watch = OWN_WATCH + 1;
        let names: Vec<String> = self.want.keys().cloned().collect();
        for n in names {
            self.watch_node(client, &mut watch, n, true).await?;
        }
        self.show_watches();
        Ok(watch)
    }

    /// Starts watching node `name`: its record now (into the cache; `report`: a difference
    /// with what the cache had is journalled), then a watch on the stream from the revision
    /// after it.
    async fn watch_node(
        &mut self,
        client: &mut Client,
        watch: &mut etcd_client::WatchStream,
        name: String,
        report: bool,
    ) -> Result<(), Broken> {
        let key = record::node_key(&self.prefix, &name);
        if self.watching.contains_key(&key) {
            return Ok(());
        }
        if self.watching.len() >= record::MAX_CACHED_NODES {
            self.state().nodes.overflow += 1;
            return Ok(());
        }
        let r = bounded("read a node", client.get(key.as_str(), None)).await?;
        let rev = r.header().map_or(0, |h| h.revision());
        let change = {
            let mut st = self.state();
            let had = st.nodes.contains(&name);
            match r.kvs().first() {
                Some(kv) => match st.nodes.put(kv.value()) {
                    Ok(NodeChange::Joined(n)) if had || !report => NodeChange::Updated(n),
                    Ok(c) => c,
                    Err(e) => {
                        debug!("directory: node record {key:?}: {e}");
                        NodeChange::None
                    }
                },
                None if had => {
                    st.nodes.forget(&name);
                    NodeChange::Left(name.clone())
                }
                None => NodeChange::None,
            }
        };
        if report {
            self.note(change);
        }
        let id = self.next_watch;
        self.next_watch += 1;
        let opts = WatchOptions::new().with_start_revision(rev + 1).with_watch_id(id);
        bounded("watch a node", watch.watch(key.as_str(), Some(opts))).await?;
        debug!("directory: watching node {name} (watch {id})");
        self.watching.insert(key, (name, id));
        Ok(())
    }

    fn show_watches(&self) {
        let mut names: Vec<String> = self.watching.values().map(|(n, _)| n.clone()).collect();
        names.sort();
        names.truncate(SHOWN);
        let mut st = self.state();
        st.watches = self.watching.len();
        st.watched = names;
    }

    /// Asks the agent which nodes it cares about now; watches those not watched yet and
    /// drops the watches of those it has not cared about for [`forget_after`].
    async fn scope(
        &mut self,
        client: &mut Client,
        watch: &mut etcd_client::WatchStream,
    ) -> Result<(), Broken> {
        let now = Instant::now();
        let looked = std::mem::take(&mut self.state().looked_up);
        let mut beyond = 0;
        for n in (self.cfg.cares)().into_iter().chain(looked) {
            if n == self.cfg.node || n.is_empty() {
                continue;
            }
            if self.want.len() < record::MAX_CACHED_NODES || self.want.contains_key(&n) {
                self.want.insert(n, now);
            } else {
                beyond += 1;
            }
        }
        let stale: Vec<String> = self
            .want
            .iter()
            .filter(|(_, t)| now.duration_since(**t) >= forget_after(self.cfg.ttl_s))
            .map(|(n, _)| n.clone())
            .collect();
        for n in stale {
            self.want.remove(&n);
            if let Some((_, id)) = self.watching.remove(&record::node_key(&self.prefix, &n)) {
                debug!("directory: no longer watching node {n} (watch {id})");
                bounded("drop a node watch", watch.cancel(id)).await?;
            }
            self.state().nodes.forget(&n);
        }
        self.state().nodes.overflow = beyond;
        let new: Vec<String> = (self.want.keys())
            .filter(|n| !self.watching.contains_key(&record::node_key(&self.prefix, n)))
            .cloned()
            .collect();
        for n in new {
            self.watch_node(client, watch, n, false).await?;
        }
        self.show_watches();
        Ok(())
    }

    /// A new lease; the node's record and the whole mirror under it.
    async fn register(&mut self, mut client: Client) -> Result<Session, Broken> {
        let ttl = self.cfg.ttl_s as i64;
        let lease = bounded("lease", client.lease_grant(ttl, None)).await?.id();
        let node = (self.cfg.describe)();
        let value = serde_json::to_vec(&node).unwrap_or_default();
        let key = record::node_key(&self.prefix, &self.cfg.node);
        let with_lease = || Some(PutOptions::new().with_lease(lease));
        bounded("register the node", client.put(key, value, with_lease())).await?;
        let mut s = Session { client, lease };
        // The agent index and the mirror, in batches.
        let mut ops: Vec<TxnOp> = Vec::new();
        for a in &node.agents {
            ops.push(TxnOp::put(
                record::agent_key(&self.prefix, *a),
                self.place(None, vec![*a]),
                with_lease(),
            ));
        }
        for a in &self.mirror.listeners {
            ops.push(TxnOp::put(
                record::listener_key(&self.prefix, &self.cfg.node, *a),
                self.listener_value(*a),
                with_lease(),
            ));
        }
        let agents = node.agents.clone();
        self.agents = agents.clone();
        // An end this node held for sure is written again only where its record is still
        // under one of this node's leases, or is gone: a record another node wrote in between
        // is a connection that moved there (its process restored there while this agent could
        // not reach etcd, and this node's release of it still waiting), and stays.
        for ((gid, active), pid) in &self.mirror.gids {
            if self.mirror.unsure.contains(&(*gid, *active)) {
                continue;
            }
            let key = record::gid_key(&self.prefix, *gid, *active);
            let put = || TxnOp::put(key.as_str(), self.place(Some(*pid), agents.clone()), with_lease());
            let create = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([put()]);
            let mut t = create;
            for old in self.leases.iter().rev().filter(|l| **l != 0) {
                t = Txn::new()
                    .when([Compare::lease(key.as_str(), CompareOp::Equal, *old)])
                    .and_then([put()])
                    .or_else([TxnOp::txn(t)]);
            }
            ops.push(TxnOp::txn(t));
        }
        // From here records go under the new lease (a registration that breaks halfway leaves
        // some under each: the next one still knows both).
        self.leases = [lease, self.leases[0], self.leases[1]];
        for (a, to) in &self.mirror.moved {
            ops.push(TxnOp::put(
                record::moved_key(&self.prefix, &self.cfg.node, *a),
                self.place(None, to.clone()),
                with_lease(),
            ));
        }
        while !ops.is_empty() {
            let rest = ops.split_off(ops.len().min(BATCH));
            let batch = std::mem::replace(&mut ops, rest);
            bounded("write the node's entries", s.client.txn(Txn::new().and_then(batch))).await?;
        }
        let unsure: Vec<(End, u32)> = (self.mirror.unsure.iter())
            .filter_map(|k| self.mirror.gids.get(k).map(|pid| (*k, *pid)))
            .collect();
        for chunk in unsure.chunks(BATCH) {
            self.write_holds(&mut s, chunk.to_vec()).await?;
        }
        Ok(s)
    }

    /// Writes this node over a GID's record by compare-and-swap, or creates it if there was
    /// none; another writer in between makes it try again (a few times). A record that named
    /// another node is a connection that came here: journalled as `moved_from`.
    async fn hold(&mut self, s: &mut Session, gid: u128, active: bool, pid: u32) -> Result<(), Broken> {
        self.mirror.unsure.insert((gid, active));
        let key = record::gid_key(&self.prefix, gid, active);
        let value = self.place(Some(pid), self.agents.clone());
        let with_lease = Some(PutOptions::new().with_lease(s.lease));
        for _ in 0..4 {
            let cur = bounded("read a GID", s.client.get(key.as_str(), None)).await?;
            let (cmp, moved_from) = match cur.kvs().first() {
                Some(kv) => (
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, kv.mod_revision()),
                    record::parse_place(kv.value()).ok().map(|p| p.node),
                ),
                None => (Compare::create_revision(key.as_str(), CompareOp::Equal, 0), None),
            };
            let t = Txn::new().when([cmp]).and_then([TxnOp::put(
                key.as_str(),
                value.clone(),
                with_lease.clone(),
            )]);
            if bounded("move a GID", s.client.txn(t)).await?.succeeded() {
                self.mirror.unsure.remove(&(gid, active));
                if let Some(from) = moved_from.filter(|f| *f != self.cfg.node) {
                    info!("directory: connection {gid:032x} now lives here (was on node {from})");
                    self.cfg.journal.record(
                        "directory",
                        Some(pid),
                        json!({ "gid": format!("{gid:032x}"), "moved_from": from }),
                    );
                }
                return Ok(());
            }
        }
        // Four writers in a row in between: the record is left to the latest of them.
        self.mirror.unsure.remove(&(gid, active));
        warn!("directory: connection {gid:032x}: its record kept changing under this node's writes; left as it is");
        Ok(())
    }

    /// A command while registered.
    async fn online(&mut self, s: &mut Session, c: Cmd) -> Result<(), Broken> {
        let lease = s.lease;
        let with_lease = || Some(PutOptions::new().with_lease(lease));
        match c {
            Cmd::Listeners(now) => {
                let gone: Vec<SocketAddr> = self.mirror.listeners.difference(&now).copied().collect();
                let new: Vec<SocketAddr> = now.difference(&self.mirror.listeners).copied().collect();
                self.mirror.listeners = now;
                let mut ops = Vec::new();
                for a in gone {
                    ops.push(TxnOp::delete(record::listener_key(&self.prefix, &self.cfg.node, a), None));
                }
                for a in new {
                    // A listener back here: it no longer lives where it went.
                    if self.mirror.moved.remove(&a).is_some() {
                        ops.push(TxnOp::delete(record::moved_key(&self.prefix, &self.cfg.node, a), None));
                    }
                    ops.push(TxnOp::put(
                        record::listener_key(&self.prefix, &self.cfg.node, a),
                        self.listener_value(a),
                        with_lease(),
                    ));
                }
                for chunk in ops.chunks(BATCH) {
                    bounded("listeners", s.client.txn(Txn::new().and_then(chunk.to_vec()))).await?;
                }
            }
            Cmd::Moved { addrs, to } => {
                let mut ops = Vec::new();
                for a in addrs {
                    self.mirror.moved.insert(a, to.clone());
                    ops.push(TxnOp::put(
                        record::moved_key(&self.prefix, &self.cfg.node, a),
                        self.place(None, to.clone()),
                        with_lease(),
                    ));
                }
                for chunk in ops.chunks(BATCH) {
                    bounded("moved listeners", s.client.txn(Txn::new().and_then(chunk.to_vec()))).await?;
                }
            }
            Cmd::Lookup { key, prefix, reply } => {
                let opts = prefix.then(|| GetOptions::new().with_prefix().with_limit(16));
                let r = bounded("lookup", s.client.get(key, opts)).await?;
                let kvs = r
                    .kvs()
                    .iter()
                    .map(|kv| (kv.key_str().unwrap_or("").to_string(), kv.value().to_vec()))
                    .collect();
                let _ = reply.try_send(kvs);
            }
        }
        Ok(())
    }
}

/// This node's record, from what the agent knows of its networks.
pub fn describe(node: &str, agents: Vec<SocketAddr>) -> NodeRec {
    let networks = crate::net::interfaces()
        .into_iter()
        .filter(|i| !i.addr.is_loopback())
        .take(record::MAX_ADDRS)
        .map(|i| record::NetRec { name: i.name, addr: i.addr, mac: i.mac.map(record::mac_text), mtu: i.mtu })
        .collect();
    NodeRec {
        node: node.to_string(),
        agents: agents.into_iter().take(record::MAX_ADDRS).collect(),
        networks,
        version: env!("CARGO_PKG_VERSION").into(),
    }
}

#[cfg(test)]
mod tests {
    use super::{End, EndChange, EndChange::*, Ends};
    use std::time::{Duration, Instant};

    const D: Duration = Duration::from_millis(200);

    fn all(e: &mut Ends, at: Instant) -> Vec<(End, EndChange)> {
        e.take(64, at, D).0
    }

    #[test]
    fn ends_keep_the_latest_change_and_short_connections_cost_nothing() {
        let t0 = Instant::now();
        let later = t0 + D;
        let mut e = Ends::default();
        // A connection that comes and goes before the thread takes anything: nothing waits.
        assert!(e.ask((1, true), Hold(10), t0, false), "the first change wakes the thread");
        assert!(!e.ask((1, true), Release { delete: true }, t0, false));
        assert!(e.latest.is_empty());
        assert!(all(&mut e, later).is_empty());
        assert_eq!((e.asked, e.spared), (2, 2));
        // A hold is taken only once it is old enough; then its release is written.
        e.ask((2, true), Hold(10), t0, false);
        assert_eq!(e.take(64, t0 + D / 2, D), (vec![], Some(t0 + D)));
        assert_eq!(all(&mut e, later), vec![((2, true), Hold(10))]);
        e.ask((2, true), Release { delete: true }, later, false);
        assert_eq!(all(&mut e, later + D), vec![((2, true), Release { delete: true })]);
        // Released and held again before the thread looked: the latest change only.
        e.ask((3, false), Hold(10), t0, false);
        all(&mut e, later);
        e.ask((3, false), Release { delete: false }, later, false);
        e.ask((3, false), Hold(11), later, false);
        assert_eq!(all(&mut e, later + D), vec![((3, false), Hold(11))]);
        // Order of first asking, batches of at most n, and the next due time.
        for g in 10..20u128 {
            e.ask((g, true), Hold(1), t0 + Duration::from_millis(g as u64), false);
        }
        e.ask((10, true), Hold(2), later, false);
        let (first, next) = e.take(4, later + D, D);
        assert_eq!(first.iter().map(|(k, _)| k.0).collect::<Vec<_>>(), [10, 11, 12, 13]);
        assert_eq!(first[0].1, Hold(2));
        assert_eq!(next, Some(t0 + Duration::from_millis(14) + D));
        assert_eq!(e.take(64, later + D, D).0.len(), 6);
        assert_eq!(e.take(64, later + D, D), (vec![], None));
    }

    #[test]
    fn an_end_that_came_here_is_written_at_once() {
        let t0 = Instant::now();
        let mut e = Ends::default();
        e.ask((1, true), Hold(1), t0, false);
        assert!(!e.ask((2, true), Hold(2), t0, true), "something waited already");
        // The restored end goes first, without waiting; the new one waits its delay.
        assert_eq!(e.take(64, t0, D), (vec![((2, true), Hold(2))], Some(t0 + D)));
        // A new end that turns out to be held again after a restore: at once, once.
        e.ask((3, false), Hold(3), t0, false);
        e.ask((3, false), Hold(4), t0, true);
        assert_eq!(e.take(64, t0, D), (vec![((3, false), Hold(4))], Some(t0 + D)));
        assert_eq!(e.take(64, t0 + D, D), (vec![((1, true), Hold(1))], None));
    }

    #[test]
    fn a_stale_place_in_the_order_is_skipped() {
        let t0 = Instant::now();
        let mut e = Ends::default();
        e.ask((1, true), Hold(1), t0, false);
        e.ask((1, true), Release { delete: true }, t0, false);
        // Asked again later: due a delay after the second asking, not the first.
        e.ask((1, true), Hold(2), t0 + D, false);
        assert_eq!(e.take(64, t0 + D + D / 2, D), (vec![], Some(t0 + D + D)));
        assert_eq!(e.take(64, t0 + D + D, D).0, vec![((1, true), Hold(2))]);
    }

    #[test]
    fn what_waits_is_bounded_by_the_ends_held_however_many_come_and_go() {
        let t0 = Instant::now();
        let mut e = Ends::default();
        // 100,000 short connections while the thread takes nothing (etcd slow): nothing waits,
        // and the order list does not grow with them.
        for g in 0..100_000u128 {
            e.ask((g, true), Hold(1), t0, false);
            e.ask((g, true), Release { delete: true }, t0, false);
        }
        assert_eq!(e.latest.len(), 0);
        assert!(e.order.len() <= 1024 + 1, "{}", e.order.len());
        // 1,000 held and 100,000 coming and going: 1,000 wait.
        for g in 0..1000u128 {
            e.ask((1 << 64 | g, true), Hold(1), t0, false);
        }
        for g in 0..100_000u128 {
            e.ask((g, false), Hold(1), t0, false);
            e.ask((g, false), Release { delete: true }, t0, false);
        }
        assert_eq!(e.latest.len(), 1000);
        assert!(e.order.len() <= 2 * 1000 + 1024 + 1, "{}", e.order.len());
        assert!(e.peak <= 1001);
        let mut n = 0;
        loop {
            let b = all(&mut e, t0 + D);
            if b.is_empty() {
                break;
            }
            n += b.len();
        }
        assert_eq!(n, 1000);
    }
}
