//! `vmictl`: look at the node through its agent.
//!
//! ```text
//! vmictl [--socket NAME] status [--json]
//! vmictl [--socket NAME] net down|up NET
//! ```

use agent::wire::{read_msg, write_msg};
use agent::DEFAULT_SOCKET;
use serde_json::Value;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::time::Duration;
use substrate::wire::agent::Msg;

const USAGE: &str = "usage: vmictl [--socket NAME] [--node NODE] status [--json]
       vmictl [--socket NAME] [--node NODE] net down|up NET
       vmictl [--socket NAME] [--node NODE] move GID shm|tcp
       vmictl [--socket NAME] --cluster status [--json]
       vmictl [--socket NAME] where GID [--json]
       vmictl [--socket NAME] events [--follow] [--json]

  status         the node's processes under the layer, its networks, the health of every
                 path to other nodes, and every virtual connection
  --json         the same as one JSON object:
                 {node, processes[], listeners[], networks[], paths[], connections[], mesh}
                 each connection has gid, pid, local, peer (what the program sees),
                 substrate, direction, bytes_sent, bytes_received, msgs_sent, msgs_received,
                 unacked_bytes, window, age_ms, error, network, link_local, link_peer (the
                 physical link now), failovers, link (up, relinking or failed); mesh has
                 the cluster key's fingerprint (key) and counts of what was refused
                 (channel, clear, forged_heartbeats, replayed_heartbeats, local). A user
                 other than root (or the agent's user) sees only their own processes,
                 listeners and connections
  net down NET   take network NET (interface name or address) out of service: connections
                 move off it without loss, new ones avoid it
  net up NET     put it back in service (both need root or the agent's user)
  move GID tcp   move a connection off shared memory onto TCP, without loss, and keep it
                 there (through later link rebuilds too); root or the owner of its processes
  move GID shm   move it back onto shared memory (when both ends are on this node)
  --node NODE    run the command on another node of the cluster (its name in reports, or
                 one of its addresses), through this node's agent and the cluster's
                 encrypted channel; changes need root there
  --cluster status  every node this node's agent knows (nodes it has connections with and
                 its --peers): a line per node, the paths between them, unreachable nodes;
                 --json: {node, nodes: [status report of each node], unreachable: []}
  where GID      on which node(s) and in which process(es) connection GID lives now
  events         what happened on the node (the last 4096 events): connections made and
                 closed, paths dead and alive, networks out of and back in service, links
                 rebuilt (relink), moves between substrates, checkpoint phases, refusals;
                 --follow: then every new one as it happens; --json: one object a line
                 {seq, ms, kind, pid?, ...}. Users other than root see the node's events
                 and those of their own processes
  --socket NAME  the agent's abstract socket (default vmi-agent, or VMI_AGENT_SOCKET)";

fn fail(msg: &str) -> ! {
    eprintln!("vmictl: {msg}");
    std::process::exit(1)
}

fn human(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn print_table(v: &Value) {
    println!("node {}", v["node"].as_str().unwrap_or("?"));
    if let Some(m) = v.get("mesh") {
        let r = &m["refused"];
        let n = |k: &str| r[k].as_u64().unwrap_or(0);
        println!(
            "cluster key {} (refused: {} agent channels, {} messages in clear, {} forged and {} replayed heartbeats, {} local commands)",
            m["key"].as_str().unwrap_or("?"),
            n("channel"),
            n("clear"),
            n("forged_heartbeats"),
            n("replayed_heartbeats"),
            n("local")
        );
    }
    let procs = v["processes"].as_array().cloned().unwrap_or_default();
    println!("\nprocesses under the layer: {}", procs.len());
    for p in &procs {
        let sandbox = p["sandbox"].as_str().unwrap_or("");
        println!(
            "  {:>7}  {:<20} {} virtual connections{}",
            p["pid"],
            p["name"].as_str().unwrap_or(""),
            p["connections"],
            if sandbox.is_empty() { String::new() } else { format!("  [{sandbox}]") }
        );
    }
    let ls = v["listeners"].as_array().cloned().unwrap_or_default();
    println!("\nlisteners: {}", ls.len());
    for l in &ls {
        println!("  {}", l["addr"].as_str().unwrap_or(""));
    }
    let ns = v["networks"].as_array().cloned().unwrap_or_default();
    println!("\nnetworks: {}", ns.len());
    for n in &ns {
        println!(
            "  {:<10} {:<24} {}",
            n["name"].as_str().unwrap_or(""),
            n["addr"].as_str().unwrap_or(""),
            if n["admin"] == "down" { "OUT OF SERVICE" } else { "in service" }
        );
    }
    let ps = v["paths"].as_array().cloned().unwrap_or_default();
    println!("\npaths to other nodes: {}", ps.len());
    for p in &ps {
        let silent = p["silent_ms"].as_u64().map(|m| format!("heard {m} ms ago")).unwrap_or_default();
        println!(
            "  {:<16} {:<18} -> {:<18} {:<8} {:<7} {}",
            p["node"].as_str().unwrap_or(""),
            p["local"].as_str().unwrap_or(""),
            p["peer"].as_str().unwrap_or(""),
            p["network"].as_str().unwrap_or(""),
            p["state"].as_str().unwrap_or(""),
            silent
        );
    }
    let cs = v["connections"].as_array().cloned().unwrap_or_default();
    println!("\nvirtual connections: {}", cs.len());
    if !cs.is_empty() {
        let h = ["GID", "PID", "LOCAL", "", "PEER", "SUBST", "SENT", "RECEIVED", "UNACKED", "NET", "LINK"];
        println!(
            "  {:<32}  {:>7}  {:<22} {:<3} {:<22} {:<5} {:>10} {:>10} {:>10}  {:<6} {}",
            h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9], h[10]
        );
    }
    for c in &cs {
        let arrow = if c["direction"] == "out" { "->" } else { "<-" };
        let link = match (c["link"].as_str().unwrap_or(""), c["failovers"].as_u64().unwrap_or(0)) {
            (l, 0) => l.to_string(),
            (l, n) => format!("{l}, {n} failovers"),
        };
        println!(
            "  {:<32}  {:>7}  {:<22} {:<3} {:<22} {:<5} {:>10} {:>10} {:>10}  {:<6} {}{}",
            c["gid"].as_str().unwrap_or(""),
            c["pid"],
            c["local"].as_str().unwrap_or(""),
            arrow,
            c["peer"].as_str().unwrap_or(""),
            c["substrate"].as_str().unwrap_or(""),
            human(c["bytes_sent"].as_u64().unwrap_or(0)),
            human(c["bytes_received"].as_u64().unwrap_or(0)),
            human(c["unacked_bytes"].as_u64().unwrap_or(0)),
            c["network"].as_str().unwrap_or("?"),
            link,
            if c["error"].as_u64().unwrap_or(0) != 0 { "  BROKEN" } else { "" },
        );
    }
}

/// Every end of connection `gid` in a cluster report, with its node.
fn where_is(v: &Value, gid: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for n in v["nodes"].as_array().into_iter().flatten() {
        for c in n["connections"].as_array().into_iter().flatten() {
            if c["gid"].as_str() == Some(gid) {
                let mut c = c.clone();
                c["node"] = n["node"].clone();
                out.push(c);
            }
        }
    }
    out
}

fn print_cluster(v: &Value) {
    let nodes = v["nodes"].as_array().cloned().unwrap_or_default();
    let bad = v["unreachable"].as_array().cloned().unwrap_or_default();
    println!(
        "cluster seen from node {}: {} nodes answered, {} unreachable",
        v["node"].as_str().unwrap_or("?"),
        nodes.len(),
        bad.len()
    );
    println!(
        "\n  {:<16} {:<16} {:>9} {:>11} {:>9} {:>11} {:>9} {:>8}",
        "NODE", "KEY", "NETWORKS", "PATHS UP", "PROCS", "CONNS", "TCP/SHM", "FAILOVERS"
    );
    for n in &nodes {
        let arr = |k: &str| n[k].as_array().cloned().unwrap_or_default();
        let (nets, paths, conns) = (arr("networks"), arr("paths"), arr("connections"));
        let up_nets = nets.iter().filter(|x| x["admin"] == "up").count();
        let alive = paths.iter().filter(|p| p["state"] == "alive").count();
        let shm = conns.iter().filter(|c| c["substrate"] == "shm").count();
        let failovers: u64 = conns.iter().map(|c| c["failovers"].as_u64().unwrap_or(0)).sum();
        println!(
            "  {:<16} {:<16} {:>9} {:>11} {:>9} {:>11} {:>9} {:>8}",
            n["node"].as_str().unwrap_or("?"),
            n["mesh"]["key"].as_str().unwrap_or("?"),
            format!("{up_nets}/{}", nets.len()),
            format!("{alive}/{}", paths.len()),
            arr("processes").len(),
            conns.len(),
            format!("{}/{shm}", conns.len() - shm),
            failovers
        );
    }
    println!("\npaths between nodes:");
    for n in &nodes {
        for p in n["paths"].as_array().into_iter().flatten() {
            println!(
                "  {:<16} {:<16} -> {:<16} {:<8} {}",
                n["node"].as_str().unwrap_or("?"),
                p["local"].as_str().unwrap_or(""),
                p["peer"].as_str().unwrap_or(""),
                p["network"].as_str().unwrap_or(""),
                p["state"].as_str().unwrap_or("")
            );
        }
    }
    for b in &bad {
        println!(
            "\nunreachable: node {} ({}): {}",
            b["node"].as_str().unwrap_or("?"),
            b["addrs"],
            b["error"].as_str().unwrap_or("")
        );
    }
}

/// The node's agent on its abstract socket `socket`, or the end with why not.
fn connect(socket: &str) -> UnixStream {
    let addr = UnixAddr::from_abstract_name(socket.as_bytes()).unwrap_or_else(|e| fail(&e.to_string()));
    UnixStream::connect_addr(&addr)
        .unwrap_or_else(|e| fail(&format!("no agent on @{socket} in this network namespace: {e}")))
}

/// Prints the node's events (and with `follow`, every new one) until the agent stops.
fn watch(socket: &str, follow: bool, json: bool) {
    use std::io::Write;
    let mut s = connect(socket);
    write_msg(&mut s, &Msg::Watch { after: 0, follow }).unwrap_or_else(|e| fail(&e.to_string()));
    let out = std::io::stdout();
    loop {
        match read_msg(&mut s) {
            Ok(Msg::Happened { json: text }) => {
                let mut o = out.lock();
                if json {
                    let _ = writeln!(o, "{text}");
                } else if let Ok(v) = serde_json::from_str::<Value>(&text) {
                    let _ = writeln!(o, "{}", event_line(&v));
                }
                let _ = o.flush();
            }
            Ok(Msg::Ok) => return,
            Ok(Msg::Error { reason }) => fail(&reason),
            Ok(other) => fail(&format!("unexpected answer {}", other.name())),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => fail("the agent went away"),
            Err(e) => fail(&e.to_string()),
        }
    }
}

/// One event as a line: UTC time, kind, its fields.
fn event_line(v: &Value) -> String {
    let ms = v["ms"].as_u64().unwrap_or(0);
    let (s, m) = (ms / 1000, ms % 1000);
    let mut line = format!(
        "{:02}:{:02}:{:02}.{m:03}  {:<10}",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60,
        v["kind"].as_str().unwrap_or("?")
    );
    if let Some(o) = v.as_object() {
        for (k, x) in o {
            if matches!(k.as_str(), "ms" | "kind" | "seq") {
                continue;
            }
            match x {
                Value::String(t) => line.push_str(&format!(" {k}={t}")),
                other => line.push_str(&format!(" {k}={other}")),
            }
        }
    }
    line
}

fn main() {
    let mut socket = std::env::var("VMI_AGENT_SOCKET").unwrap_or_else(|_| DEFAULT_SOCKET.into());
    let mut json = false;
    let mut cmd: Option<Msg> = None;
    let mut node: Option<String> = None;
    let mut cluster = false;
    let mut whereis: Option<String> = None;
    let mut follow = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--socket" => socket = it.next().unwrap_or_else(|| fail("--socket needs a value")),
            "--json" => json = true,
            "--node" => node = Some(it.next().unwrap_or_else(|| fail("--node needs a value"))),
            "--cluster" => cluster = true,
            "--follow" => follow = true,
            "events" => cmd = Some(Msg::Watch { after: 0, follow: false }),
            "where" => {
                let gid = it.next().unwrap_or_else(|| fail(&format!("where needs a GID\n{USAGE}")));
                whereis = Some(gid.trim_start_matches("0x").to_ascii_lowercase());
                cmd = Some(Msg::ClusterStatus);
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            "status" => cmd = Some(Msg::Status),
            "net" => {
                let up = match it.next().as_deref() {
                    Some("down") => false,
                    Some("up") => true,
                    _ => fail(&format!("net needs down or up\n{USAGE}")),
                };
                let name = it.next().unwrap_or_else(|| fail(&format!("net needs a network name\n{USAGE}")));
                cmd = Some(Msg::Net { name, up });
            }
            "move" => {
                let gid = it.next().unwrap_or_else(|| fail(&format!("move needs a GID\n{USAGE}")));
                let gid = u128::from_str_radix(gid.trim_start_matches("0x"), 16)
                    .unwrap_or_else(|_| fail(&format!("{gid} is not a GID (32 hex digits)")));
                let shm = match it.next().as_deref() {
                    Some("shm") => true,
                    Some("tcp") => false,
                    _ => fail(&format!("move needs shm or tcp\n{USAGE}")),
                };
                cmd = Some(Msg::Move { gid, shm });
            }
            other => fail(&format!("unknown argument {other}\n{USAGE}")),
        }
    }
    let Some(mut cmd) = cmd else { fail(USAGE) };
    if cluster {
        if cmd != Msg::Status {
            fail(&format!("--cluster goes with status\n{USAGE}"));
        }
        cmd = Msg::ClusterStatus;
    }
    if let Msg::Watch { .. } = cmd {
        if node.is_some() || cluster {
            fail("events are read on the node itself");
        }
        watch(&socket, follow, json);
        return;
    }
    if let Some(to) = node {
        if cluster || whereis.is_some() {
            fail("--node does not go with --cluster or where");
        }
        cmd = Msg::Remote { to, cmd: cmd.encode() };
    }
    let inner = match &cmd {
        Msg::Remote { cmd, .. } => Msg::decode_framed(cmd).unwrap_or(Msg::Status),
        c => c.clone(),
    };
    let mut s = connect(&socket);
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let done = match &inner {
        Msg::Net { name, up } => {
            Some(format!("network {name} {}", if *up { "back in service" } else { "out of service" }))
        }
        Msg::Move { gid, shm } => {
            Some(format!("connection {gid:032x} moving to {}", if *shm { "shared memory" } else { "TCP" }))
        }
        _ => None,
    };
    if let Some(done) = done {
        write_msg(&mut s, &cmd).unwrap_or_else(|e| fail(&e.to_string()));
        match read_msg(&mut s) {
            Ok(Msg::Ok) => {
                println!("{done}");
                return;
            }
            Ok(Msg::Error { reason }) => fail(&reason),
            Ok(other) => fail(&format!("unexpected answer {other:?}")),
            Err(e) => fail(&e.to_string()),
        }
    }
    write_msg(&mut s, &cmd).unwrap_or_else(|e| fail(&e.to_string()));
    let json_text = match read_msg(&mut s) {
        Ok(Msg::StatusReply { json }) => json,
        Ok(other) => fail(&format!("unexpected answer {other:?}")),
        Err(e) => fail(&e.to_string()),
    };
    let v: Value = serde_json::from_str(&json_text).unwrap_or_else(|e| fail(&format!("bad report: {e}")));
    if let Some(gid) = whereis {
        let ends = where_is(&v, &gid);
        if json {
            println!("{}", Value::Array(ends));
        } else if ends.is_empty() {
            fail(&format!("no node of the cluster lists connection {gid}"));
        } else {
            for e in &ends {
                println!(
                    "node {:<16} pid {:>7}  {:<22} {} {:<22} {:<4} {}",
                    e["node"].as_str().unwrap_or(""),
                    e["pid"],
                    e["local"].as_str().unwrap_or(""),
                    if e["direction"] == "out" { "->" } else { "<-" },
                    e["peer"].as_str().unwrap_or(""),
                    e["substrate"].as_str().unwrap_or(""),
                    e["link"].as_str().unwrap_or("")
                );
            }
        }
    } else if json {
        println!("{json_text}");
    } else if cluster {
        print_cluster(&v);
    } else {
        print_table(&v);
    }
}
