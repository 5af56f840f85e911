//! The levels above the node: cluster heads and grid views.
//!
//! * **Cluster heads** (`head = ["ADDR", ...]`): every node pushes a summary of itself (its
//!   status report as root sees it, the owners of its processes and listeners, its newest
//!   events) to each of its heads every [`PUSH_EVERY`], and at once when something happens
//!   (a new event). Any agent takes summaries pushed to it and answers `HeadStatus` and
//!   `HeadEvents` from what it holds, so a cluster query costs one exchange with the head
//!   instead of one per node. A summary older than [`STALE_AFTER`] (or whose node's
//!   heartbeats the head no longer hears) is listed as unreachable; after [`FORGET_AFTER`]
//!   it is forgotten. The head filters what it answers as each node would: root sees all,
//!   another user only their own processes, listeners, connections and events (the owners
//!   travel with the summary).
//! * **Grid views** (`grid = ["NAME=HEADADDR@KEYFILE", ...]`): an agent that holds the key
//!   of several clusters asks each cluster's head for a line per node (`vmictl --grid
//!   status`), each through that cluster's own channel.
//!
//! The state of both is kept here, beside the [`Agent`], set up once by [`init`].

use crate::config::GridMember;
use crate::local::{Agent, Asker};
use crate::mesh::ClusterKey;
use crate::peer::PeerClient;
use crate::{net, status};
use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use substrate::wire::agent::Msg;
use tracing::{debug, info, warn};

/// How often a node pushes its summary to its heads when nothing happens.
pub const PUSH_EVERY: Duration = Duration::from_secs(2);
/// How often a node looks for something new to push at once.
const CHANGE_CHECK: Duration = Duration::from_millis(200);
/// A summary older than this is stale: its node is listed as unreachable.
pub const STALE_AFTER: Duration = Duration::from_secs(6);
/// A summary older than this is forgotten.
pub const FORGET_AFTER: Duration = Duration::from_secs(60);
/// Largest summary a node sends and a head takes (bytes of JSON); a node with more
/// connections than fit sends the first ones and says how many it left out.
pub const SUMMARY_MAX: usize = 512 << 10;
/// Most nodes one head holds.
pub const NODES_MAX: usize = 1024;
/// Most events sent with one summary (the newest).
pub const PUSH_EVENTS_MAX: usize = 256;
/// A head's own summary is taken again for a query only when it is older than this (or
/// something happened).
const OWN_FRESH: Duration = Duration::from_millis(250);
/// Events a head keeps, of all its nodes together.
pub const HEAD_EVENTS_MAX: usize = 8192;

/// One cluster of the grid view.
pub struct GridCluster {
    /// Its name.
    pub name: String,
    /// Its head (one of several, for one name).
    pub head: IpAddr,
    /// Its agents' port.
    pub port: u16,
    /// Its key's fingerprint.
    pub key: String,
    /// Channels to its agents, with its key.
    pub client: Arc<PeerClient>,
}

/// The agent's place in the hierarchy.
#[derive(Default)]
pub struct Config {
    /// The cluster's heads.
    pub heads: Vec<IpAddr>,
    /// The grid view's clusters.
    pub grid: Vec<GridCluster>,
}

static CONFIG: OnceLock<Config> = OnceLock::new();
static STORE: OnceLock<Mutex<Store>> = OnceLock::new();
static BOOT: OnceLock<u64> = OnceLock::new();

/// Sets the agent's heads and grid view up (once, at start); loads each grid cluster's key.
pub fn init(heads: Vec<IpAddr>, grid: &[GridMember], port: u16) -> Result<(), String> {
    let mut clients: HashMap<std::path::PathBuf, (String, Arc<PeerClient>)> = HashMap::new();
    let mut out = Vec::new();
    for m in grid {
        let (key, client) = match clients.get(&m.key) {
            Some(c) => c.clone(),
            None => {
                let k = ClusterKey::load(&m.key).map_err(|e| format!("grid cluster {}: {e}", m.name))?;
                let c = (k.fingerprint.clone(), Arc::new(PeerClient::new(k)));
                clients.insert(m.key.clone(), c.clone());
                c
            }
        };
        out.push(GridCluster {
            name: m.name.clone(),
            head: m.head,
            port: m.port.unwrap_or(port),
            key,
            client,
        });
    }
    CONFIG.set(Config { heads, grid: out }).map_err(|_| "the hierarchy is set up already".to_string())
}

fn config() -> &'static Config {
    CONFIG.get_or_init(Config::default)
}

/// The cluster's heads this agent was given.
pub fn heads() -> &'static [IpAddr] {
    &config().heads
}

/// A random number of this run of the agent: event numbers restart with it.
pub fn boot() -> u64 {
    *BOOT.get_or_init(|| {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        u64::from_le_bytes(b).max(1)
    })
}

fn store() -> std::sync::MutexGuard<'static, Store> {
    STORE.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Names event `e` as one of node `node`'s: its field `node` (a path's event names the node
/// at the path's other end there) becomes `peer_node`.
pub fn with_node(e: &mut Value, node: &str) {
    if let Some(o) = e.as_object_mut() {
        if let Some(peer) = o.remove("node") {
            if peer.as_str() != Some(node) {
                o.insert("peer_node".into(), peer);
            }
        }
        o.insert("node".into(), Value::from(node));
    }
}

/// Whose processes' details `asker` sees: `None` all (root), else that user's.
pub fn only(asker: Asker) -> Option<u32> {
    if asker.may_run_node() {
        None
    } else {
        Some(asker.uid.unwrap_or(u32::MAX))
    }
}

// ---------------------------------------------------------------------------------------------
// What a node pushes

/// The summary of this node for a head that holds its events up to number `after`
/// (`None`: unknown, the newest [`PUSH_EVENTS_MAX`] are sent).
pub fn summary(agent: &Agent, after: Option<u64>) -> String {
    let mut report: Value = serde_json::from_str(&status::report(agent, None)).unwrap_or(Value::Null);
    let mut owners = Map::new();
    for list in ["processes", "connections"] {
        for x in report[list].as_array().into_iter().flatten() {
            if let Some(pid) = x["pid"].as_u64() {
                let uid = crate::local::owner_of(pid as u32);
                owners.insert(pid.to_string(), uid.map_or(Value::Null, Value::from));
            }
        }
    }
    let listeners: Vec<(String, u64)> = agent
        .dir
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .listeners()
        .iter()
        .map(|l| (l.addr.to_string(), l.owner))
        .collect();
    let mut lowners = Map::new();
    {
        let procs = agent.procs.lock().unwrap_or_else(|e| e.into_inner());
        for (addr, client) in listeners {
            let uid = procs.pid_of(client).and_then(crate::local::owner_of);
            lowners.insert(addr, uid.map_or(Value::Null, Value::from));
        }
    }
    let (events, _) = agent.journal.since(after.unwrap_or(0), None, Duration::ZERO);
    let skip = events.len().saturating_sub(PUSH_EVENTS_MAX);
    let mut events: Vec<Value> = events
        .into_iter()
        .skip(skip)
        .map(|e| json!({ "uid": e.pid.and_then(crate::local::owner_of), "event": e.json }))
        .collect();
    let addrs: Vec<String> = agent.health.advertised().iter().map(|a| a.ip().to_string()).collect();
    let mut left_out = 0usize;
    loop {
        let s = json!({
            "node": agent.node,
            "boot": boot(),
            "addrs": addrs,
            "report": report,
            "owners": owners,
            "lowners": lowners,
            "events": events,
            "connections_left_out": left_out,
        })
        .to_string();
        if s.len() <= SUMMARY_MAX {
            return s;
        }
        // Too big: half the connections (then the events) go, and the summary says so.
        match report["connections"].as_array_mut() {
            Some(c) if !c.is_empty() => {
                let keep = c.len() / 2;
                left_out += c.len() - keep;
                c.truncate(keep);
            }
            _ if !events.is_empty() => {
                let keep = events.len() / 2;
                events.drain(..events.len() - keep);
            }
            _ => return json!({ "node": agent.node, "boot": boot(), "addrs": addrs, "report": { "node": agent.node }, "events": [] }).to_string(),
        }
    }
}

/// Pushes this node's summary to its heads from a thread of its own, every
/// [`PUSH_EVERY`] and as soon as a new event happens.
pub fn push_forever(agent: Arc<Agent>) {
    let heads: Vec<IpAddr> = heads().to_vec();
    if heads.is_empty() {
        return;
    }
    std::thread::Builder::new()
        .name("head-push".into())
        .spawn(move || {
            let mut have: HashMap<IpAddr, Option<u64>> = heads.iter().map(|h| (*h, None)).collect();
            let mut failing: HashMap<IpAddr, bool> = HashMap::new();
            let mut last_push: Option<Instant> = None;
            let mut last_event = u64::MAX;
            loop {
                let ev = agent.journal.last();
                if ev == last_event && last_push.is_some_and(|t| t.elapsed() < PUSH_EVERY) {
                    std::thread::sleep(CHANGE_CHECK);
                    continue;
                }
                last_event = ev;
                last_push = Some(Instant::now());
                for h in &heads {
                    let after = have.get(h).copied().flatten();
                    let text = summary(&agent, after);
                    let answer = if net::is_local(*h) {
                        store().ingest(&text, Instant::now()).map(|n| Msg::StatusReply { json: json!({ "have": n }).to_string() })
                    } else {
                        let m = Msg::AsUser { uid: 0, cmd: Msg::Summary { json: text }.encode() };
                        agent.peers.ask(*h, agent.port, &m).map_err(|e| e.to_string())
                    };
                    let was_failing = failing.get(h).copied().unwrap_or(false);
                    match answer {
                        Ok(Msg::StatusReply { json }) => {
                            let n = serde_json::from_str::<Value>(&json).ok().and_then(|v| v["have"].as_u64());
                            have.insert(*h, n);
                            if was_failing {
                                info!("cluster head {h} takes this node's summary again");
                            }
                            failing.insert(*h, false);
                        }
                        other => {
                            let why = match other {
                                Ok(Msg::Error { reason }) => reason,
                                Ok(m) => format!("it answered {}", m.name()),
                                Err(e) => e,
                            };
                            have.insert(*h, None);
                            if !was_failing {
                                warn!(
                                    "cluster head {h} does not take this node's summary: {why}; cluster queries go to another head or to every node until it does (check the agent there, and that it holds this cluster's key)"
                                );
                            } else {
                                debug!("cluster head {h}: {why}");
                            }
                            failing.insert(*h, true);
                        }
                    }
                }
            }
        })
        .expect("a thread");
}

// ---------------------------------------------------------------------------------------------
// What a head holds

struct NodeEntry {
    at: Instant,
    boot: u64,
    addrs: Vec<Value>,
    report: Value,
    owners: Map<String, Value>,
    lowners: Map<String, Value>,
    /// The number of the node's latest event held.
    have: u64,
    left_out: u64,
}

struct HeadEvent {
    hseq: u64,
    uid: Option<u32>,
    has_pid: bool,
    json: Value,
}

/// The summaries a head holds, and its nodes' events.
#[derive(Default)]
pub struct Store {
    nodes: HashMap<String, NodeEntry>,
    events: VecDeque<HeadEvent>,
    next: u64,
}

fn uid_of(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|u| u32::try_from(u).ok())
}

impl Store {
    /// How many nodes and events the head holds now.
    pub fn held(&self) -> (usize, usize) {
        (self.nodes.len(), self.events.len())
    }

    /// Takes a node's summary (its JSON text); the number of the node's latest event now
    /// held, or why it is refused.
    pub fn ingest(&mut self, text: &str, now: Instant) -> Result<u64, String> {
        if text.len() > SUMMARY_MAX {
            return Err(format!("a summary of {} bytes (at most {SUMMARY_MAX})", text.len()));
        }
        let mut v: Value =
            serde_json::from_str(text).map_err(|e| format!("a summary that is not JSON: {e}"))?;
        if !v.is_object() {
            return Err("a summary that is not a JSON object".into());
        }
        let node = match v["node"].as_str() {
            Some(n) if !n.is_empty() && n.len() <= 255 => n.to_string(),
            _ => return Err("a summary without a node name".into()),
        };
        let boot = v["boot"].as_u64().ok_or("a summary without boot")?;
        if !v["report"].is_object() || v["report"]["node"].as_str() != Some(node.as_str()) {
            return Err(format!("the summary of node {node} holds no report of that node"));
        }
        let events = v["events"].as_array().map_or(0, Vec::len);
        if events > PUSH_EVENTS_MAX {
            return Err(format!("a summary with {events} events (at most {PUSH_EVENTS_MAX})"));
        }
        self.nodes.retain(|_, e| now.duration_since(e.at) < FORGET_AFTER);
        if !self.nodes.contains_key(&node) && self.nodes.len() >= NODES_MAX {
            return Err(format!("this head holds {NODES_MAX} nodes already"));
        }
        let obj = |v: &mut Value, k: &str| match v[k].take() {
            Value::Object(m) => m,
            _ => Map::new(),
        };
        let owners = obj(&mut v, "owners");
        let lowners = obj(&mut v, "lowners");
        let entry = self.nodes.entry(node.clone()).or_insert_with(|| NodeEntry {
            at: now,
            boot,
            addrs: Vec::new(),
            report: Value::Null,
            owners: Map::new(),
            lowners: Map::new(),
            have: 0,
            left_out: 0,
        });
        if entry.boot != boot {
            // The node's agent started again: its event numbers too.
            entry.boot = boot;
            entry.have = 0;
        }
        entry.at = now;
        entry.report = v["report"].take();
        entry.addrs = v["addrs"].as_array().cloned().unwrap_or_default();
        entry.owners = owners;
        entry.lowners = lowners;
        entry.left_out = v["connections_left_out"].as_u64().unwrap_or(0);
        let mut have = entry.have;
        for e in v["events"].as_array_mut().map(std::mem::take).unwrap_or_default() {
            let Value::Object(mut e) = e else { continue };
            let mut ev = e.remove("event").unwrap_or(Value::Null);
            let Some(seq) = ev["seq"].as_u64() else { continue };
            if seq <= have || !ev.is_object() {
                continue;
            }
            have = seq;
            with_node(&mut ev, &node);
            self.next += 1;
            self.events.push_back(HeadEvent {
                hseq: self.next,
                uid: e.get("uid").and_then(uid_of),
                has_pid: ev.get("pid").is_some_and(|p| !p.is_null()),
                json: ev,
            });
        }
        while self.events.len() > HEAD_EVENTS_MAX {
            self.events.pop_front();
        }
        if let Some(e) = self.nodes.get_mut(&node) {
            e.have = have;
        }
        Ok(have)
    }

    /// `{nodes, unreachable}` as `only` may see them: every node heard from within
    /// [`STALE_AFTER`] and not in `silent` (nodes whose heartbeats stopped), the others as
    /// unreachable; `brief`: figures per node instead of the reports.
    pub fn status(
        &mut self,
        now: Instant,
        only: Option<u32>,
        silent: &[String],
        brief: bool,
    ) -> (Vec<Value>, Vec<Value>) {
        self.nodes.retain(|_, e| now.duration_since(e.at) < FORGET_AFTER);
        let mut names: Vec<&String> = self.nodes.keys().collect();
        names.sort();
        let (mut nodes, mut unreachable) = (Vec::new(), Vec::new());
        for name in names {
            let e = &self.nodes[name];
            let age = now.duration_since(e.at);
            if age >= STALE_AFTER || silent.contains(name) {
                let error = if age >= STALE_AFTER {
                    format!("stale: no summary from its agent for {} s", age.as_secs())
                } else {
                    "this head hears no heartbeat from it (its agent stopped, or every network between them is dead or out of service)".to_string()
                };
                unreachable.push(json!({
                    "node": name, "addrs": e.addrs, "error": error, "stale": true, "age_ms": age.as_millis() as u64,
                }));
                continue;
            }
            let mut r = filter_report(&e.report, &e.owners, &e.lowners, only);
            if e.left_out > 0 {
                r["connections_left_out"] = e.left_out.into();
            }
            nodes.push(if brief { brief_of(&r, age) } else { r });
        }
        (nodes, unreachable)
    }

    /// Events held after the head's number `after` that `only` may see, each naming its
    /// node; the number to ask from next time; each node's run (boot).
    pub fn events(&self, after: u64, only: Option<u32>) -> (Vec<Value>, u64, Map<String, Value>) {
        let evs = self
            .events
            .iter()
            .filter(|e| e.hseq > after)
            .filter(|e| match only {
                None => true,
                Some(u) => !e.has_pid || e.uid == Some(u),
            })
            .map(|e| e.json.clone())
            .collect();
        let boots = self.nodes.iter().map(|(n, e)| (n.clone(), Value::from(e.boot))).collect();
        (evs, self.next, boots)
    }
}

fn owned_by(owners: &Map<String, Value>, key: &str, uid: u32) -> bool {
    owners.get(key).and_then(uid_of) == Some(uid)
}

/// A node's report as user `only` may see it (`None`: whole).
pub fn filter_report(
    r: &Value,
    owners: &Map<String, Value>,
    lowners: &Map<String, Value>,
    only: Option<u32>,
) -> Value {
    let mut r = r.clone();
    let Some(u) = only else { return r };
    for list in ["processes", "connections"] {
        if let Some(a) = r[list].as_array_mut() {
            a.retain(|x| x["pid"].as_u64().is_some_and(|p| owned_by(owners, &p.to_string(), u)));
        }
    }
    if let Some(a) = r["listeners"].as_array_mut() {
        a.retain(|l| l["addr"].as_str().is_some_and(|k| owned_by(lowners, k, u)));
    }
    r
}

/// A line of figures for a node's report (what a grid view shows of each node).
pub fn brief_of(r: &Value, age: Duration) -> Value {
    let arr = |k: &str| r[k].as_array().cloned().unwrap_or_default();
    let (nets, paths, conns) = (arr("networks"), arr("paths"), arr("connections"));
    let nets_up = nets.iter().filter(|n| n["admin"] == "up").count();
    let alive = paths.iter().filter(|p| p["state"] == "alive").count();
    let shm = conns.iter().filter(|c| c["substrate"] == "shm").count();
    let failovers: u64 = conns.iter().map(|c| c["failovers"].as_u64().unwrap_or(0)).sum();
    let broken = conns.iter().filter(|c| c["link"] != "up").count();
    let ok = nets_up == nets.len() && alive == paths.len() && broken == 0;
    json!({
        "node": r["node"],
        "key": r["mesh"]["key"],
        "health": if ok { "ok" } else { "degraded" },
        "networks": nets.len(),
        "networks_up": nets_up,
        "paths": paths.len(),
        "paths_alive": alive,
        "processes": arr("processes").len(),
        "connections": conns.len(),
        "tcp": conns.len() - shm,
        "shm": shm,
        "links_not_up": broken,
        "failovers": failovers,
        "age_ms": age.as_millis() as u64,
    })
}

/// Names of the nodes this agent probes whose every path is dead (their agent stopped, or
/// they are cut off).
fn silent_nodes(agent: &Agent) -> Vec<String> {
    agent
        .health
        .nodes()
        .into_iter()
        .filter(|n| n.reach.is_none() && n.name.parse::<IpAddr>().is_err())
        .map(|n| n.name)
        .collect()
}

/// Takes this node's own summary into the store (a head answers for itself too).
fn ingest_own(agent: &Agent) {
    let last = agent.journal.last();
    let (have, fresh) = store()
        .nodes
        .get(&agent.node)
        .filter(|e| e.boot == boot())
        .map_or((None, false), |e| (Some(e.have), e.have == last && e.at.elapsed() < OWN_FRESH));
    if fresh {
        // Taken a moment ago and nothing happened since: many askers cost one report.
        return;
    }
    let text = summary(agent, have);
    if let Err(e) = store().ingest(&text, Instant::now()) {
        debug!("this node's own summary: {e}");
    }
}

/// A head's answer to `HeadStatus`: `{node, head, nodes, unreachable}`.
pub fn head_status(agent: &Agent, asker: Asker, brief: bool) -> Msg {
    ingest_own(agent);
    let silent = silent_nodes(agent);
    let (nodes, unreachable) = store().status(Instant::now(), only(asker), &silent, brief);
    Msg::StatusReply {
        json: json!({ "node": agent.node, "head": agent.node, "nodes": nodes, "unreachable": unreachable })
            .to_string(),
    }
}

/// A head's answer to `HeadEvents`: `{node, boot, last, events, boots, unreachable}`.
pub fn head_events(agent: &Agent, asker: Asker, after: u64) -> Msg {
    ingest_own(agent);
    let silent = silent_nodes(agent);
    let mut st = store();
    let (events, last, boots) = st.events(after, only(asker));
    let (_, unreachable) = st.status(Instant::now(), only(asker), &silent, true);
    drop(st);
    let unreachable: Vec<Value> = unreachable.into_iter().map(|u| u["node"].clone()).collect();
    Msg::StatusReply {
        json: json!({ "node": agent.node, "boot": boot(), "last": last, "events": events, "boots": boots, "unreachable": unreachable })
            .to_string(),
    }
}

/// A summary pushed by a node of the cluster.
pub fn take_summary(json: &str) -> Msg {
    match store().ingest(json, Instant::now()) {
        Ok(have) => Msg::StatusReply { json: json!({ "have": have }).to_string() },
        Err(reason) => {
            debug!("summary refused: {reason}");
            Msg::Error { reason }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The grid view

/// `vmictl --grid status`: each cluster of the grid view as its head sees it,
/// `{node, clusters: [{cluster, head, key, nodes: [figures], unreachable, error?}]}`.
pub fn grid_status(agent: &Agent, asker: Asker) -> Msg {
    let grid = &config().grid;
    if grid.is_empty() {
        return Msg::Error {
            reason: "this agent has no grid view: give it grid = [\"NAME=HEADADDR@KEYFILE\", ...] (vmi-agent --grid)"
                .into(),
        };
    }
    let Some(uid) = asker.uid else {
        return Msg::Error { reason: "the kernel did not say who asks".into() };
    };
    let mut names: Vec<&str> = Vec::new();
    for g in grid {
        if !names.contains(&g.name.as_str()) {
            names.push(&g.name);
        }
    }
    let clusters: Vec<Value> = std::thread::scope(|sc| {
        let hs: Vec<_> = names
            .iter()
            .map(|name| {
                sc.spawn(move || {
                    let mut errors = Vec::new();
                    let mut key = String::new();
                    for g in grid.iter().filter(|g| g.name == *name) {
                        key = g.key.clone();
                        let m = Msg::AsUser { uid, cmd: Msg::HeadStatus { brief: true }.encode() };
                        match g.client.ask(g.head, g.port, &m) {
                            Ok(Msg::StatusReply { json }) => match serde_json::from_str::<Value>(&json) {
                                Ok(v) => {
                                    return json!({
                                        "cluster": name, "head": g.head.to_string(), "head_node": v["node"], "key": g.key,
                                        "nodes": v["nodes"], "unreachable": v["unreachable"],
                                    })
                                }
                                Err(e) => errors.push(format!("{}: bad answer: {e}", g.head)),
                            },
                            Ok(Msg::Error { reason }) => errors.push(format!("{}: {reason}", g.head)),
                            Ok(other) => errors.push(format!("{}: answered {}", g.head, other.name())),
                            Err(e) => errors.push(format!("{}: {e}", g.head)),
                        }
                    }
                    json!({
                        "cluster": name, "key": key, "nodes": [], "unreachable": [],
                        "error": format!("no head answered: {}", errors.join("; ")),
                    })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| json!({ "error": "panicked" }))).collect()
    });
    Msg::StatusReply { json: json!({ "node": agent.node, "clusters": clusters }).to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary_text(node: &str, boot: u64, events: &[(u64, Option<u32>, Option<u32>)]) -> String {
        let evs: Vec<Value> = events
            .iter()
            .map(|(seq, pid, uid)| {
                let mut e = json!({ "kind": "connection", "seq": seq, "ms": 1 });
                if let Some(p) = pid {
                    e["pid"] = (*p).into();
                }
                json!({ "uid": uid, "event": e })
            })
            .collect();
        json!({
            "node": node, "boot": boot, "addrs": ["10.0.0.1"],
            "report": {
                "node": node,
                "processes": [{ "pid": 10 }, { "pid": 11 }],
                "connections": [{ "pid": 10, "gid": "a", "substrate": "tcp", "link": "up", "failovers": 1 }, { "pid": 11, "gid": "b", "substrate": "shm", "link": "up" }],
                "listeners": [{ "addr": "0.0.0.0:1" }, { "addr": "0.0.0.0:2" }],
                "networks": [{ "admin": "up" }], "paths": [{ "state": "alive" }], "mesh": { "key": "k" },
            },
            "owners": { "10": 1000, "11": 0 },
            "lowners": { "0.0.0.0:1": 1000 },
            "events": evs,
        })
        .to_string()
    }

    #[test]
    fn a_head_holds_summaries_filters_them_and_forgets_them() {
        let mut s = Store::default();
        let t0 = Instant::now();
        assert_eq!(
            s.ingest(&summary_text("n1", 5, &[(1, None, None), (2, Some(10), Some(1000))]), t0),
            Ok(2)
        );
        assert_eq!(s.ingest(&summary_text("n2", 6, &[(1, Some(11), Some(0))]), t0), Ok(1));
        // Sent again: nothing new.
        assert_eq!(s.ingest(&summary_text("n1", 5, &[(2, Some(10), Some(1000))]), t0), Ok(2));
        let (nodes, bad) = s.status(t0, None, &[], false);
        assert_eq!((nodes.len(), bad.len()), (2, 0));
        assert_eq!(nodes[0]["connections"].as_array().unwrap().len(), 2);
        let (nodes, _) = s.status(t0, Some(1000), &[], false);
        assert_eq!(nodes[0]["connections"].as_array().unwrap().len(), 1, "only user 1000's");
        assert_eq!(nodes[0]["processes"].as_array().unwrap().len(), 1);
        assert_eq!(nodes[0]["listeners"].as_array().unwrap().len(), 1);
        let (nodes, _) = s.status(t0, Some(1000), &[], true);
        assert_eq!((nodes[0]["connections"].as_u64(), nodes[0]["health"].as_str()), (Some(1), Some("ok")));
        let mut r = s.status(t0, None, &[], false).0[0].clone();
        assert_eq!(brief_of(&r, Duration::ZERO)["health"], "ok");
        r["paths"] = json!([{ "state": "alive" }, { "state": "dead" }]);
        assert_eq!(brief_of(&r, Duration::ZERO)["health"], "degraded");
        let (evs, last, boots) = s.events(0, None);
        assert_eq!((evs.len(), last), (3, 3));
        assert_eq!(boots["n1"], 5);
        assert!(evs.iter().all(|e| e["node"].is_string()));
        let mut path = json!({ "kind": "path", "node": "n9", "state": "alive" });
        with_node(&mut path, "n1");
        assert_eq!((path["node"].as_str(), path["peer_node"].as_str()), (Some("n1"), Some("n9")));
        let (evs, _, _) = s.events(0, Some(1000));
        assert_eq!(evs.len(), 2, "the node's own event and user 1000's: {evs:?}");
        assert_eq!(s.events(3, None).0.len(), 0);
        // A node whose agent started again: its numbers start again.
        assert_eq!(s.ingest(&summary_text("n1", 7, &[(1, None, None)]), t0), Ok(1));
        assert_eq!(s.events(3, None).0.len(), 1);
        // Silent, stale, forgotten.
        let (nodes, bad) = s.status(t0, None, &["n2".to_string()], false);
        assert_eq!((nodes.len(), bad[0]["node"].as_str()), (1, Some("n2")));
        let (nodes, bad) = s.status(t0 + STALE_AFTER, None, &[], false);
        assert_eq!((nodes.len(), bad.len()), (0, 2));
        assert!(bad[0]["error"].as_str().unwrap().starts_with("stale"));
        let (nodes, bad) = s.status(t0 + FORGET_AFTER, None, &[], false);
        assert_eq!((nodes.len(), bad.len()), (0, 0));
    }

    /// Summaries come from other agents: whatever their shape, a head neither panics nor
    /// grows beyond its bounds (a small deterministic fuzzer over a valid summary's text).
    #[test]
    fn any_summary_text_is_taken_or_refused() {
        let good = summary_text("n1", 5, &[(1, None, None), (2, Some(10), Some(1000))]);
        let pieces = ["[]", "{}", "null", "1", "\"x\"", "-1", "1e400", "[{}]", "{\"event\":1}", "true"];
        let mut s = Store::default();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let t0 = Instant::now();
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut t = good.clone().into_bytes();
            for _ in 0..(x % 4 + 1) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = (x as usize) % t.len();
                match x % 3 {
                    0 => t[at] = (x >> 8) as u8,
                    1 => {
                        let end = (at + (x >> 16) as usize % 12).min(t.len());
                        t.drain(at..end);
                    }
                    _ => {
                        let p = pieces[(x >> 24) as usize % pieces.len()];
                        t.splice(at..at, p.bytes());
                    }
                }
                if t.is_empty() {
                    t.push(b'{');
                }
            }
            let text = String::from_utf8_lossy(&t);
            let _ = s.ingest(&text, t0);
            let _ = s.status(t0, Some(1000), &[], true);
            let _ = s.events(0, Some(1000));
        }
        assert!(s.nodes.len() <= NODES_MAX && s.events.len() <= HEAD_EVENTS_MAX);
    }

    #[test]
    fn a_head_refuses_what_is_not_a_summary_and_stays_bounded() {
        let mut s = Store::default();
        let t0 = Instant::now();
        for bad in
            ["", "[]", "{}", r#"{"node":"a","boot":1}"#, r#"{"node":"a","boot":1,"report":{"node":"b"}}"#]
        {
            assert!(s.ingest(bad, t0).is_err(), "{bad}");
        }
        assert!(s.ingest(&"x".repeat(SUMMARY_MAX + 1), t0).is_err());
        let many: Vec<(u64, Option<u32>, Option<u32>)> =
            (1..=PUSH_EVENTS_MAX as u64 + 1).map(|i| (i, None, None)).collect();
        assert!(s.ingest(&summary_text("a", 1, &many), t0).is_err());
        for i in 0..NODES_MAX {
            s.ingest(&summary_text(&format!("n{i}"), 1, &[]), t0).unwrap();
        }
        assert!(s.ingest(&summary_text("one-more", 1, &[]), t0).is_err());
        assert!(
            s.ingest(&summary_text("one-more", 1, &[]), t0 + FORGET_AFTER).is_ok(),
            "the old ones are forgotten"
        );
        for r in 0..(HEAD_EVENTS_MAX / PUSH_EVENTS_MAX + 2) as u64 {
            let evs: Vec<_> = (1..=PUSH_EVENTS_MAX as u64).map(|i| (r * 1000 + i, None, None)).collect();
            s.ingest(&summary_text("busy", 1, &evs), t0 + FORGET_AFTER).unwrap();
        }
        assert_eq!(s.events.len(), HEAD_EVENTS_MAX);
    }
}
