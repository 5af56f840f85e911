//! The cluster as one: commands run on another node (`vmictl --node HOST ...`) and the status
//! of every node this agent knows (`vmictl --cluster status`), both through the cluster's
//! authenticated channels ([`crate::mesh`]).
//!
//! The asking agent reads who asks from the kernel and passes it on (`AsUser`); the answering
//! agent decides as it would for a local user, except that only root may change a node from
//! another node. The nodes an agent knows are those it probes: the nodes its processes have
//! connections with, and those given with `vmi-agent --peers`.

use crate::local::{command, Agent, Asker};
use crate::net;
use serde_json::{json, Value};
use std::net::IpAddr;
use std::time::Duration;
use substrate::wire::agent::Msg;
use tracing::debug;

/// Commands another node may ask for.
fn forwardable(m: &Msg) -> bool {
    matches!(m, Msg::Status | Msg::Net { .. } | Msg::Move { .. } | Msg::Migrate { .. })
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
        Ok(None) => command(agent, asker, m),
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

/// Serves another node's `AsUser` request.
pub fn as_user(agent: &Agent, uid: u32, cmd: &[u8]) -> Msg {
    match Msg::decode_framed(cmd) {
        Ok(m) if forwardable(&m) => command(agent, Asker { uid: Some(uid), remote: true }, m),
        Ok(m) => Msg::Error { reason: format!("{} cannot be run from another node", m.name()) },
        Err(e) => Msg::Error { reason: format!("malformed command: {e}") },
    }
}

/// The status of this node and of every node it knows, as one JSON document:
/// `{node, nodes: [status report...], unreachable: [{node, addrs, error}]}`.
pub fn status(agent: &Agent, asker: Asker) -> Msg {
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
                    // The working path first, then every other address of the node.
                    let order =
                        n.reach.into_iter().chain(n.addrs.iter().copied().filter(|a| Some(*a) != n.reach));
                    for ip in order {
                        match ask(agent, asker, ip, &Msg::Status) {
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
