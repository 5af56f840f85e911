//! The cluster as one: commands run on another node (`vmictl --node HOST ...`), the status
//! of every node (`vmictl --cluster status`) and their events (`vmictl --cluster events`),
//! all through the cluster's authenticated channels ([`crate::mesh`]).
//!
//! The asking agent reads who asks from the kernel and passes it on (`AsUser`); the answering
//! agent decides as it would for a local user, except that only root may change a node from
//! another node. With cluster heads (`head = [...]`, [`crate::hier`]) a cluster query is
//! one exchange with the first head that answers; without one, or when none answers, the
//! asking agent asks every node it knows (fan-out) and says so (`via`, `fallback`). The
//! nodes an agent knows are those it probes: the nodes its processes have connections with,
//! and those given with `vmi-agent --peers`.

use crate::hier;
use crate::local::{command, Agent, Asker};
use crate::mesh::Channel;
use crate::net;
use crate::wire::{read_msg, write_msg};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;
use tracing::{debug, info, warn};

/// Commands another node may ask for.
fn forwardable(m: &Msg) -> bool {
    matches!(
        m,
        Msg::Status
            | Msg::Net { .. }
            | Msg::Move { .. }
            | Msg::Chain { .. }
            | Msg::Device { .. }
            | Msg::Profile { .. }
            | Msg::Migrate { .. }
            | Msg::Journal { .. }
    )
}

/// How often `--follow` asks for new events of other nodes.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

/// This node's events after number `after` that `asker` may see:
/// `{node, boot, last, events: [event with its node]}`.
pub fn journal(agent: &Agent, asker: Asker, after: u64) -> Msg {
    let (events, last) = agent.journal.since(after, hier::only(asker), Duration::ZERO);
    let events: Vec<Value> = events
        .into_iter()
        .map(|e| {
            let mut j = e.json;
            hier::with_node(&mut j, &agent.node);
            j
        })
        .collect();
    Msg::StatusReply {
        json: json!({ "node": agent.node, "boot": hier::boot(), "last": last, "events": events }).to_string(),
    }
}

/// Runs `command` for `asker` on this node, with the commands only agents exchange.
fn here(agent: &Agent, asker: Asker, m: Msg) -> Msg {
    match m {
        Msg::Journal { after } => journal(agent, asker, after),
        m => command(agent, asker, m),
    }
}

/// Where node `to` (a node name or one of its addresses) is reached: `None` for this node.
fn resolve(agent: &Agent, to: &str) -> Result<Option<IpAddr>, String> {
    if to == agent.node {
        return Ok(None);
    }
    if let Ok(ip) = to.parse::<IpAddr>() {
        return Ok(if net::is_local(ip) { None } else { Some(agent.health.reach(ip).unwrap_or(ip)) });
    }
    let nodes = agent.health.nodes();
    match nodes.iter().find(|n| n.name == to) {
        Some(n) => {
            n.reach.or(n.addrs.first().copied()).map(Some).ok_or_else(|| format!("node {to} has no address"))
        }
        None => {
            let known: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
            Err(format!("no node {to} known here; known nodes: {}", known.join(", ")))
        }
    }
}

/// Runs the encoded command `cmd` on node `to` for `asker`.
pub fn remote(agent: &Agent, asker: Asker, to: &str, cmd: &[u8]) -> Msg {
    let m = match Msg::decode_framed(cmd) {
        Ok(m) if forwardable(&m) => m,
        Ok(m) => return Msg::Error { reason: format!("{} cannot be run on another node", m.name()) },
        Err(e) => return Msg::Error { reason: format!("malformed command: {e}") },
    };
    match resolve(agent, to) {
        Err(reason) => Msg::Error { reason },
        Ok(None) => here(agent, asker, m),
        Ok(Some(ip)) => ask(agent, asker, ip, &m),
    }
}

fn ask(agent: &Agent, asker: Asker, ip: IpAddr, m: &Msg) -> Msg {
    let Some(uid) = asker.uid else {
        return Msg::Error { reason: "the kernel did not say who asks".into() };
    };
    let asked = Msg::AsUser { uid, cmd: m.encode() };
    let answer = if let Msg::Migrate { .. } = m {
        // Long, and never to be sent twice.
        agent.peers.ask_once(ip, agent.port, &asked, crate::migrate::TIMEOUT + Duration::from_secs(10))
    } else {
        agent.peers.ask(ip, agent.port, &asked)
    };
    match answer {
        Ok(a) => a,
        Err(e) => Msg::Error { reason: format!("the agent at {ip} did not answer: {e}") },
    }
}

/// Time a node has to answer a request for its events, or a head a query, before it is
/// reported as not answering (the others are not held up).
pub const ANSWER_WITHIN: Duration = Duration::from_millis(1500);

/// Asks the agent of the node at `ip` for `m` on `asker`'s behalf over a channel of its own
/// (not the shared one, which a slow agent holds), giving up after about `within`.
fn ask_within(agent: &Agent, asker: Asker, ip: IpAddr, m: &Msg, within: Duration) -> Msg {
    let Some(uid) = asker.uid else {
        return Msg::Error { reason: "the kernel did not say who asks".into() };
    };
    let start = Instant::now();
    let left = || within.saturating_sub(start.elapsed()).max(Duration::from_millis(10));
    let answer = (|| -> io::Result<Msg> {
        let s = TcpStream::connect_timeout(&SocketAddr::new(ip, agent.port), within)?;
        s.set_read_timeout(Some(left()))?;
        s.set_write_timeout(Some(left()))?;
        s.set_nodelay(true)?;
        let mut c = Channel::dial(s, &agent.key)?;
        c.stream().set_read_timeout(Some(left()))?;
        write_msg(&mut c, &Msg::AsUser { uid, cmd: m.encode() })?;
        read_msg(&mut c)
    })();
    match answer {
        Ok(a) => a,
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => Msg::Error {
            reason: format!("the agent at {ip} did not answer within {} ms", within.as_millis()),
        },
        Err(e) => Msg::Error { reason: format!("the agent at {ip} did not answer: {e}") },
    }
}

/// Serves another node's `AsUser` request (and the hierarchy's: summaries pushed to this
/// agent as a head, queries of what it holds).
pub fn as_user(agent: &Agent, uid: u32, cmd: &[u8]) -> Msg {
    let asker = Asker { uid: Some(uid), remote: true };
    match Msg::decode_framed(cmd) {
        Ok(Msg::Summary { json }) => hier::take_summary(&json),
        Ok(Msg::HeadStatus { brief }) => hier::head_status(agent, asker, brief),
        Ok(Msg::HeadEvents { after }) => hier::head_events(agent, asker, after),
        Ok(m) if forwardable(&m) => here(agent, asker, m),
        Ok(m) => Msg::Error { reason: format!("{} cannot be run from another node", m.name()) },
        Err(e) => Msg::Error { reason: format!("malformed command: {e}") },
    }
}

/// Logs at most once in ten seconds that no head answered.
fn note_fallback(why: &str) {
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
        *last = Some(Instant::now());
        warn!(
            "no cluster head answered ({why}); cluster queries ask every node this agent knows instead (check the agents at the addresses of `head`)"
        );
    }
}

/// Asks the cluster's heads for `m` in their order until one answers: (the head, its
/// answer), or why none did. A head that is this node answers at once.
fn ask_heads(agent: &Agent, asker: Asker, m: &Msg) -> Result<(String, Value), String> {
    let mut errors = Vec::new();
    for h in hier::heads() {
        let answer = if net::is_local(*h) {
            match m {
                Msg::HeadStatus { brief } => hier::head_status(agent, asker, *brief),
                Msg::HeadEvents { after } => hier::head_events(agent, asker, *after),
                _ => Msg::Error { reason: "not a head query".into() },
            }
        } else {
            ask_within(agent, asker, *h, m, ANSWER_WITHIN)
        };
        match answer {
            Msg::StatusReply { json } => match serde_json::from_str::<Value>(&json) {
                Ok(v) if v.is_object() => return Ok((h.to_string(), v)),
                Ok(_) => errors.push(format!("{h}: bad answer: not a JSON object")),
                Err(e) => errors.push(format!("{h}: bad answer: {e}")),
            },
            Msg::Error { reason } => errors.push(format!("{h}: {reason}")),
            other => errors.push(format!("{h}: answered {}", other.name())),
        }
    }
    Err(errors.join("; "))
}

/// The status of this node and of every node of the cluster, as one JSON document:
/// `{node, nodes: [status report...], unreachable: [{node, addrs, error}], via, head?,
/// fallback?}`: `via` is "head" (answered by the cluster head `head`) or "fan-out" (every
/// node asked by this one; `fallback` says why no head answered, when there are heads).
pub fn status(agent: &Agent, asker: Asker) -> Msg {
    let mut fallback = None;
    if !hier::heads().is_empty() {
        match ask_heads(agent, asker, &Msg::HeadStatus { brief: false }) {
            Ok((head, mut v)) => {
                // This node as it is now, not as it last pushed itself.
                if let Msg::StatusReply { json } = command(agent, asker, Msg::Status) {
                    if let (Ok(me), Some(nodes)) =
                        (serde_json::from_str::<Value>(&json), v["nodes"].as_array_mut())
                    {
                        nodes.retain(|n| n["node"].as_str() != Some(agent.node.as_str()));
                        nodes.insert(0, me);
                    }
                }
                if let Some(u) = v["unreachable"].as_array_mut() {
                    u.retain(|n| n["node"].as_str() != Some(agent.node.as_str()));
                }
                v["head_node"] = v["node"].take();
                v["node"] = Value::from(agent.node.clone());
                v["via"] = "head".into();
                v["head"] = head.into();
                return Msg::StatusReply { json: v.to_string() };
            }
            Err(why) => {
                note_fallback(&why);
                fallback = Some(format!("no cluster head answered: {why}"));
            }
        }
    }
    match fan_out(agent, asker) {
        Msg::StatusReply { json } => {
            let mut v: Value = serde_json::from_str(&json).unwrap_or(Value::Null);
            v["via"] = "fan-out".into();
            if let Some(f) = fallback {
                v["fallback"] = f.into();
            }
            Msg::StatusReply { json: v.to_string() }
        }
        other => other,
    }
}

/// The status of this node and of every node it knows, each asked by this agent:
/// `{node, nodes: [status report...], unreachable: [{node, addrs, error}]}`.
fn fan_out(agent: &Agent, asker: Asker) -> Msg {
    let me = match command(agent, asker, Msg::Status) {
        Msg::StatusReply { json } => serde_json::from_str::<Value>(&json).unwrap_or(Value::Null),
        other => return other,
    };
    let nodes = agent.health.nodes();
    let answers: Vec<(String, Vec<IpAddr>, Result<Value, String>)> = std::thread::scope(|sc| {
        let hs: Vec<_> = nodes
            .iter()
            .map(|n| {
                sc.spawn(move || {
                    let mut last = "no address".to_string();
                    // The working path first, then every other address of the node, all
                    // within ANSWER_WITHIN: a node that does not answer holds nobody up.
                    let order =
                        n.reach.into_iter().chain(n.addrs.iter().copied().filter(|a| Some(*a) != n.reach));
                    let start = Instant::now();
                    for ip in order {
                        let Some(left) = ANSWER_WITHIN.checked_sub(start.elapsed()) else { break };
                        match ask_within(agent, asker, ip, &Msg::Status, left) {
                            Msg::StatusReply { json } => {
                                return serde_json::from_str::<Value>(&json)
                                    .map_err(|e| format!("bad report: {e}"))
                            }
                            Msg::Error { reason } => last = reason,
                            other => last = format!("answered {}", other.name()),
                        }
                        debug!("cluster status: node {} at {ip}: {last}", n.name);
                    }
                    Err(last)
                })
            })
            .collect();
        nodes
            .iter()
            .zip(hs)
            .map(|(n, h)| {
                (n.name.clone(), n.addrs.clone(), h.join().unwrap_or_else(|_| Err("panicked".into())))
            })
            .collect()
    });
    let mut reports = vec![me];
    let mut unreachable = Vec::new();
    for (name, addrs, r) in answers {
        match r {
            Ok(v) => reports.push(v),
            Err(error) => unreachable.push(json!({
                "node": name,
                "addrs": addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
                "error": error,
            })),
        }
    }
    Msg::StatusReply {
        json: json!({ "node": agent.node, "nodes": reports, "unreachable": unreachable }).to_string(),
    }
}

/// Where the events of the cluster (or of one node) come from, and how far each node's were
/// read: one asker of events, for `vmictl events --follow` or a web view. Each event is
/// given once, with its node, whether it came through a head or from the node itself.
#[derive(Default)]
pub struct Merged {
    /// The head asked last, its run and the number read up to.
    head: Option<(String, u64, u64)>,
    /// Each node's run and the number of its events read up to.
    nodes: HashMap<String, (u64, u64)>,
    /// Nodes said to be unreachable (said again only after they answered).
    down: HashSet<String>,
    /// "head" or "fan-out": how the last events were read.
    pub via: &'static str,
}

/// Events of several nodes in the order they happened (by the nodes' clocks).
fn sort_events(v: &mut [Value]) {
    v.sort_by(|a, b| {
        let k = |e: &Value| (e["ms"].as_u64(), e["node"].as_str().map(String::from), e["seq"].as_u64());
        k(a).cmp(&k(b))
    });
}

fn pseudo(kind: &str, node: &str, detail: String) -> Value {
    json!({ "kind": kind, "node": node, "ms": hier::now_ms(), "detail": detail })
}

impl Merged {
    /// Takes a node's answer `{node, boot, last, events}` of events after what was read:
    /// the new ones.
    fn take(&mut self, key: &str, v: &Value) -> Vec<Value> {
        let boot = v["boot"].as_u64().unwrap_or(0);
        let c = self.nodes.entry(key.to_string()).or_insert((boot, 0));
        if c.0 != boot {
            *c = (boot, 0);
        }
        let mut out = Vec::new();
        for e in v["events"].as_array().into_iter().flatten() {
            let seq = e["seq"].as_u64().unwrap_or(0);
            if seq > c.1 {
                c.1 = seq;
                out.push(e.clone());
            }
        }
        c.1 = c.1.max(v["last"].as_u64().unwrap_or(0));
        out
    }

    fn up(&mut self, node: &str, out: &mut Vec<Value>, error: Option<String>) {
        match error {
            Some(e) => {
                if self.down.insert(node.to_string()) {
                    out.push(pseudo("unreachable", node, e));
                }
            }
            None => {
                self.down.remove(node);
            }
        }
    }

    /// New events of node `to` (its name or an address; `None`: every node of the
    /// cluster) that `asker` may see, oldest first, with notices of nodes that do not
    /// answer (kind "unreachable") and of the way events are read when a head stops
    /// answering or answers again (kinds "fan-out" and "head").
    pub fn pull(&mut self, agent: &Agent, asker: Asker, to: Option<&str>) -> Vec<Value> {
        let mut out = Vec::new();
        if let Some(to) = to {
            let after = self.nodes.get(to).map_or(0, |c| c.1);
            let journal_of = |after: u64| match resolve(agent, to) {
                Err(reason) => Msg::Error { reason },
                Ok(None) => journal(agent, asker, after),
                Ok(Some(ip)) => ask_within(agent, asker, ip, &Msg::Journal { after }, ANSWER_WITHIN),
            };
            let mut answer = journal_of(after);
            if let Msg::StatusReply { json } = &answer {
                let v: Value = serde_json::from_str(json).unwrap_or(Value::Null);
                if self.nodes.get(to).is_some_and(|c| Some(c.0) != v["boot"].as_u64()) && after > 0 {
                    // Its agent started again: read its events from the start.
                    answer = journal_of(0);
                }
            }
            match answer {
                Msg::StatusReply { json } => {
                    let v: Value = serde_json::from_str(&json).unwrap_or(Value::Null);
                    out = self.take(to, &v);
                    self.up(to, &mut out, None);
                }
                Msg::Error { reason } => self.up(to, &mut out, Some(reason)),
                other => self.up(to, &mut out, Some(format!("answered {}", other.name()))),
            }
            self.via = "node";
            return out;
        }
        if !hier::heads().is_empty() {
            // Asked from where the last head's answer ended; from 0 if another head (or the
            // same one started again) answers.
            let guess = self.head.as_ref().map_or(0, |(_, _, n)| *n);
            match ask_heads(agent, asker, &Msg::HeadEvents { after: guess }) {
                Ok((head, v)) => {
                    let boot = v["boot"].as_u64().unwrap_or(0);
                    let same = self.head.as_ref().is_some_and(|(h, b, _)| *h == head && *b == boot);
                    let v = if guess != 0 && !same {
                        ask_heads(agent, asker, &Msg::HeadEvents { after: 0 }).map_or(v, |(_, v)| v)
                    } else {
                        v
                    };
                    if self.via == "fan-out" {
                        out.push(pseudo(
                            "head",
                            &agent.node,
                            format!("events through cluster head {head} again"),
                        ));
                    }
                    self.via = "head";
                    let boots = v["boots"].as_object().cloned().unwrap_or_default();
                    for e in v["events"].as_array().into_iter().flatten() {
                        let node = e["node"].as_str().unwrap_or("").to_string();
                        let seq = e["seq"].as_u64().unwrap_or(0);
                        let b = boots.get(&node).and_then(Value::as_u64).unwrap_or(0);
                        let c = self.nodes.entry(node).or_insert((b, 0));
                        if c.0 != b {
                            *c = (b, 0);
                        }
                        if seq > c.1 {
                            c.1 = seq;
                            out.push(e.clone());
                        }
                    }
                    let silent: Vec<String> = v["unreachable"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|n| n.as_str().map(String::from))
                        .collect();
                    let known: Vec<String> = self.nodes.keys().cloned().collect();
                    for n in known.iter().chain(silent.iter()) {
                        let err = silent
                            .contains(n)
                            .then(|| format!("cluster head {head} lists it as unreachable"));
                        self.up(n, &mut out, err);
                    }
                    self.head = Some((head, boot, v["last"].as_u64().unwrap_or(0)));
                    sort_events(&mut out);
                    return out;
                }
                Err(why) => {
                    note_fallback(&why);
                    if self.via != "fan-out" {
                        out.push(pseudo(
                            "fan-out",
                            &agent.node,
                            format!("no cluster head answered ({why}); events read from every node"),
                        ));
                    }
                }
            }
        }
        self.via = "fan-out";
        // This node, then every node it knows, in parallel: a node that does not answer in
        // time is reported, the others are not held up.
        if let Msg::StatusReply { json } =
            journal(agent, asker, self.nodes.get(&agent.node).map_or(0, |c| c.1))
        {
            let v: Value = serde_json::from_str(&json).unwrap_or(Value::Null);
            out.extend(self.take(&agent.node.clone(), &v));
        }
        let nodes = agent.health.nodes();
        let cursors: Vec<(u64, u64)> =
            nodes.iter().map(|n| self.nodes.get(&n.name).copied().unwrap_or((0, 0))).collect();
        let answers: Vec<Result<Value, String>> = std::thread::scope(|sc| {
            let hs: Vec<_> = nodes
                .iter()
                .zip(cursors)
                .map(|(n, (boot, after))| {
                    sc.spawn(move || {
                        let mut last = "no address".to_string();
                        // One address, the working path's if any: the answer stays
                        // within ANSWER_WITHIN (twice, when the node's agent started again).
                        let order = n.reach.or(n.addrs.first().copied()).into_iter();
                        for ip in order {
                            let within = ANSWER_WITHIN;
                            let mut a = ask_within(agent, asker, ip, &Msg::Journal { after }, within);
                            if let Msg::StatusReply { json } = &a {
                                let v: Value = serde_json::from_str(json).unwrap_or(Value::Null);
                                if after > 0 && v["boot"].as_u64() != Some(boot) {
                                    a = ask_within(agent, asker, ip, &Msg::Journal { after: 0 }, within);
                                }
                            }
                            match a {
                                Msg::StatusReply { json } => {
                                    return serde_json::from_str::<Value>(&json)
                                        .map_err(|e| format!("bad answer: {e}"))
                                }
                                Msg::Error { reason } => last = reason,
                                other => last = format!("answered {}", other.name()),
                            }
                        }
                        Err(last)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
        });
        for (n, a) in nodes.iter().zip(answers) {
            match a {
                Ok(v) => {
                    let evs = self.take(&n.name, &v);
                    out.extend(evs);
                    self.up(&n.name, &mut out, None);
                }
                Err(e) => self.up(&n.name, &mut out, Some(e)),
            }
        }
        sort_events(&mut out);
        out
    }
}

/// `vmictl --cluster events` and `vmictl --node NODE events`: the events of every node (`to`
/// empty) or of one, each as a `Happened` naming its node, then `Ok`; with `follow`, every
/// later one, until `vmictl` goes away.
pub fn watch(agent: &Agent, asker: Asker, mut s: UnixStream, to: &str, follow: bool) -> io::Result<()> {
    let to = (!to.is_empty()).then_some(to);
    if let Some(t) = to {
        if let Err(reason) = resolve(agent, t) {
            return write_msg(&mut s, &Msg::Error { reason });
        }
    }
    let mut m = Merged::default();
    let mut first = true;
    loop {
        let events = m.pull(agent, asker, to);
        if first && to.is_none() {
            info!("cluster events for {}: {}", asker.uid.map_or("?".into(), |u| format!("user {u}")), m.via);
        }
        first = false;
        if to.is_some() && !follow {
            // One node asked once: its failure is the answer.
            if let Some(e) = events.iter().find(|e| e["kind"] == "unreachable") {
                let reason = e["detail"].as_str().unwrap_or("it did not answer").to_string();
                return write_msg(&mut s, &Msg::Error { reason });
            }
        }
        for e in events {
            write_msg(&mut s, &Msg::Happened { json: e.to_string() })?;
        }
        if !follow {
            return write_msg(&mut s, &Msg::Ok);
        }
        let until = Instant::now() + FOLLOW_EVERY;
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100));
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
}
