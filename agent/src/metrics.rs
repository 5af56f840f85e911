//! Prometheus metrics of the node (`vmi-agent --metrics ADDR:PORT`, served at `/metrics` in
//! the OpenMetrics text format, through the `prometheus-client` and `tiny_http` crates).
//!
//! Labels are bounded: substrates, link states, network names, path states, event and
//! refusal kinds; never a connection's GID or a process id.

use crate::local::Agent;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tracing::{info, warn};

type Labels = Vec<(String, String)>;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Gauges counted by label set.
fn tally(reg: &mut Registry, name: &str, help: &str, items: impl Iterator<Item = Labels>) {
    let mut n: BTreeMap<Labels, i64> = BTreeMap::new();
    for l in items {
        *n.entry(l).or_default() += 1;
    }
    let f = Family::<Labels, Gauge>::default();
    for (l, v) in n {
        f.get_or_create(&l).set(v);
    }
    reg.register(name, help, f);
}

/// The node's metrics now, in the OpenMetrics text format.
pub fn render(agent: &Agent) -> String {
    let st: Value = serde_json::from_str(&crate::status::report(agent, None)).unwrap_or(Value::Null);
    let arr = |k: &str| st[k].as_array().cloned().unwrap_or_default();
    let s = |v: &Value, k: &str| v[k].as_str().unwrap_or("").to_string();
    let mut reg = <Registry>::with_prefix("vmi");

    let info = Family::<Labels, Gauge>::default();
    info.get_or_create(&labels(&[("node", &agent.node), ("key", &agent.key.fingerprint)])).set(1);
    reg.register("node", "This node: its name and the fingerprint of its cluster key (value 1)", info);

    let procs = Gauge::<i64>::default();
    procs.set(arr("processes").len() as i64);
    reg.register("processes", "Processes under the layer on this node", procs);

    let conns = arr("connections");
    tally(
        &mut reg,
        "connections",
        "Virtual connections open on this node, by substrate and link state",
        conns.iter().map(|c| labels(&[("substrate", &s(c, "substrate")), ("link", &s(c, "link"))])),
    );
    let bytes = Family::<Labels, Gauge>::default();
    for c in &conns {
        for (dir, k) in [("sent", "bytes_sent"), ("received", "bytes_received")] {
            bytes
                .get_or_create(&labels(&[("substrate", &s(c, "substrate")), ("direction", dir)]))
                .inc_by(c[k].as_i64().unwrap_or(0));
        }
    }
    reg.register("open_connection_bytes", "Bytes moved by the connections open now, by substrate", bytes);
    tally(
        &mut reg,
        "networks",
        "Networks of this node, by name and whether they are in service",
        arr("networks").iter().map(|n| labels(&[("network", &s(n, "name")), ("admin", &s(n, "admin"))])),
    );
    tally(
        &mut reg,
        "paths",
        "Network paths to other nodes, by local network and state",
        arr("paths").iter().map(|p| labels(&[("network", &s(p, "network")), ("state", &s(p, "state"))])),
    );

    let events = Family::<Labels, Counter>::default();
    for (kind, n) in agent.journal.counts() {
        events.get_or_create(&labels(&[("kind", &kind)])).inc_by(n);
    }
    reg.register(
        "events",
        "Events since the agent started, by kind (connection, closed, path, network, relink, failover, move, migration, refused)",
        events,
    );
    let refused = Family::<Labels, Counter>::default();
    if let Value::Object(r) = agent.refusals.json() {
        for (kind, n) in r {
            refused.get_or_create(&labels(&[("kind", &kind)])).inc_by(n.as_u64().unwrap_or(0));
        }
    }
    reg.register("refused", "What the agent refused since it started, by kind", refused);
    agent.events.relinks.register(&mut reg);
    let accepts = Family::<Labels, Counter>::default();
    for (how, n) in [("table", &agent.accepts.taken), ("asked", &agent.accepts.asked)] {
        accepts.get_or_create(&labels(&[("how", how)])).inc_by(n.load(std::sync::atomic::Ordering::Relaxed));
    }
    reg.register(
        "accepts",
        "Virtual connections accepted since the agent started, by how the accepting process learnt it (table: from the table it shares with the agent, no question asked; asked: a question to the agent)",
        accepts,
    );

    let mut out = String::new();
    if let Err(e) = encode(&mut out, &reg) {
        warn!("encoding metrics: {e}");
    }
    out
}

/// Serves `/metrics` on `addr` from a thread of its own.
pub fn serve(agent: Arc<Agent>, addr: SocketAddr) -> Result<(), String> {
    let server = tiny_http::Server::http(addr).map_err(|e| format!("metrics on {addr}: {e}"))?;
    info!("metrics at http://{addr}/metrics");
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for req in server.incoming_requests() {
                let resp = if req.url() == "/metrics" {
                    let ct = tiny_http::Header::from_bytes(
                        &b"Content-Type"[..],
                        &b"application/openmetrics-text; version=1.0.0; charset=utf-8"[..],
                    )
                    .expect("a valid header");
                    tiny_http::Response::from_string(render(&agent)).with_header(ct)
                } else {
                    tiny_http::Response::from_string("only /metrics here\n").with_status_code(404)
                };
                let _ = req.respond(resp);
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}
