//! `vmictl`: look at the node through its agent (`vmictl --help`, `vmictl help COMMAND`,
//! vmictl(8)).

use agent::wire::{read_msg, write_msg};
use agent::DEFAULT_SOCKET;
use serde_json::Value;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::time::Duration;
use substrate::wire::agent::Msg;

const USAGE: &str = "usage: vmictl [--socket NAME] [--node NODE] status [--json]
       vmictl [--socket NAME] --cluster status [--json]
       vmictl [--socket NAME] --grid status [--json]
       vmictl [--socket NAME] [--node NODE | --cluster] net down|up NET [--json]
       vmictl [--socket NAME] [--node NODE] move GID shm|tcp [--json]
       vmictl [--socket NAME] [--node NODE] chain GID FILTERS|none [--json]
       vmictl [--socket NAME] [--node NODE] device load|unload NAME --gid GID|--pid PID|--all [--json]
       vmictl [--socket NAME] [--node NODE] device list [--json]
       vmictl [--socket NAME] [--node NODE] profile GID [--plot FILE.svg] [--json]
       vmictl [--socket NAME] capture GID -w FILE [--duration S] [--json]
       vmictl [--socket NAME] [--node NODE] migrate PID --to HOST [--json]
       vmictl [--socket NAME] where GID [--json]
       vmictl [--socket NAME] [--node NODE | --cluster] events [--follow] [--json]
       vmictl [--socket NAME] [--node NODE] web [--json]
       vmictl help [COMMAND] | --help | --version

Looks at the node through its vmi agent, and changes what an operator may change.

commands:
  status         the node's processes under the layer, networks, paths, connections
  net down|up    take a network out of service, or put it back
  move           move a connection between shared memory and TCP
  chain          put filters on what a live connection's ends on the node send
  device         load a device (a filter: compression, encryption; or the profile tap)
                 onto live connections, both directions, or unload it; list the devices and
                 each connection's chain
  profile        what the profile device saw on a connection: sizes of the program's calls,
                 time between them, bytes per second (a table, and a plot with --plot)
  capture        write a connection's traffic, as its program sees it, to a pcapng file
  migrate        move a process and its connections to another host (CRIU)
  where          on which node(s) and in which process(es) a connection lives
  events         what happened on the node (or on NODE, or on every node with --cluster),
                 and what happens next (--follow)
  web            where the agent serves the cluster to a browser (vmi-agent --web)
  help COMMAND   the usage of COMMAND (as `vmictl COMMAND --help`)

options (anywhere on the line):
  --socket NAME  the agent's abstract socket (default vmi-agent, or $VMI_AGENT_SOCKET)
  --node NODE    run status, net, move, chain, device, migrate, events or web on another
                 node of the cluster (its name in reports, or one of its addresses), through this
                 node's agent and the cluster's encrypted channel; changes need root there
  --cluster      status or events of every node of the cluster (through its head, if the
                 agents have one, else from every node); net on every node
  --grid         status of every cluster of the agent's grid view (vmi-agent --grid)
  --json         print JSON instead of a table or a line (every command)

Exit status: 0 done; 1 the command failed (no agent, not allowed, no such network or
connection); 2 the command line is wrong. See vmictl(8).";

const USAGE_STATUS: &str = "usage: vmictl [--socket NAME] [--node NODE] status [--json]
       vmictl [--socket NAME] --cluster status [--json]
       vmictl [--socket NAME] --grid status [--json]

  status         the node's processes under the layer, its networks, the health of every
                 path to other nodes, and every virtual connection
  --json         the same as one JSON object:
                 {node, processes[], listeners[], networks[], paths[], connections[], mesh,
                 sinks[]}; each sink plug-in has name, devices and why (its probe's words)
                 each network has name, addr, admin, mac and mtu (the interface's); each
                 path has node, local, peer, network, state, silent_ms and peer_mac (the
                 peer's MAC address on that network from the kernel's neighbour table;
                 null while its entry is missing or incomplete)
                 each connection has gid, pid, local, peer (what the program sees),
                 substrate, chain ({send, recv}: the filters on each direction, \"\" for
                 none; send_offered: a chain offered for what this end sends and not
                 answered yet, on shared memory until the next TCP link; null: none),
                 direction, bytes_sent, bytes_received, msgs_sent, msgs_received,
                 unacked_bytes, window, age_ms, error, network, link_local, link_peer (the
                 physical link now), failovers, link (up, relinking or failed); mesh has
                 the cluster key's fingerprint (key) and counts of what was refused
                 (channel, clear, forged_heartbeats, replayed_heartbeats, local, web);
                 web is where the agent serves its web view (null: it does not). A user
                 other than root (or the agent's user) sees only their own processes,
                 listeners and connections
  --node NODE    the status of another node of the cluster
  --cluster      every node of the cluster: a line per node, the paths between them,
                 unreachable nodes; answered by the first cluster head that answers
                 (vmi-agent --head), else by asking every node this node's agent knows
                 (nodes it has connections with and its peers);
                 --json: {node, nodes: [status report of each node], unreachable:
                 [{node, addrs, error, stale?}], via (head or fan-out), head (the head's
                 address, via a head), fallback (why no head answered, when there are
                 heads)}. A head lists a node whose summary is older than 6 s, or whose
                 heartbeats stopped, as unreachable (stale)
  --grid         every cluster of this agent's grid view (vmi-agent --grid), each asked
                 of its head with that cluster's key: its nodes with their health and
                 figures, and unreachable nodes; --json: {node, clusters: [{cluster,
                 head, head_node, key, nodes: [{node, health, networks, networks_up,
                 paths, paths_alive, processes, connections, tcp, shm, links_not_up,
                 failovers, age_ms}], unreachable, error?}]}";

const USAGE_NET: &str = "usage: vmictl [--socket NAME] [--node NODE | --cluster] net down|up NET [--json]

  net down NET   take network NET (interface name or address) out of service: connections
                 move off it without loss, new ones avoid it
  net up NET     put it back in service
  Both need root or the agent's user (on NODE with --node). `vmictl status` lists the
  networks and whether each is in service.
  --cluster      on every node of the cluster view, a line per node (--json: an object
                 per node, {node, network, ok, detail}); exit status 1 if any node did not
  --json         {network, admin, node, ok, error?} (node: NODE of --node, or null)";

const USAGE_MOVE: &str = "usage: vmictl [--socket NAME] [--node NODE] move GID shm|tcp [--json]

  move GID tcp   move a connection off shared memory onto TCP, without loss, and keep it
                 there (through later link rebuilds too)
  move GID shm   move it back onto shared memory (when both ends are on this node)
  GID is 32 hexadecimal digits, as `vmictl status` shows it. Needs root or the owner of
  the connection's processes.
  --json         {gid, to, node, ok, error?} (node: NODE of --node, or null)";

const USAGE_CHAIN: &str = "usage: vmictl [--socket NAME] [--node NODE] chain GID FILTERS|none [--json]

  chain GID FILTERS  put the chain of filters FILTERS (names separated by commas; the
                 filters this build has: double, which sends every byte twice, for tests;
                 lz4; zstd:LEVEL, 1-19, zstd for zstd:3; see `vmictl device list`)
                 on what each end of connection GID on this node sends, from a frame
                 boundary both layers agree on: no byte lost, repeated or reordered. The
                 peer's layer takes the chain or refuses it (the stream then goes on as
                 it was); `vmictl status` shows each direction's chain once taken.
  chain GID none take the filters off again
  GID is 32 hexadecimal digits, as `vmictl status` shows it. Needs root or the owner of
  the connection's processes. Connections on shared memory take no filters (move them to
  TCP first).
  --json         {gid, chain, node, ok, error?} (node: NODE of --node, or null)";

const USAGE_PROFILE: &str =
    "usage: vmictl [--socket NAME] [--node NODE] profile GID [--plot FILE.svg] [--json]

  profile GID    what the profile device (vmictl device load profile --gid GID) saw at the
                 end of connection GID on the node since it was loaded: for the program's
                 sends and receives, the number of calls and bytes, a histogram of call sizes
                 (powers of two), one of the time between calls, and bytes per second over
                 the last ten minutes. Needs root or the owner of the connection's processes.
  --plot FILE    also write bytes per second over time, both directions, as an SVG plot
  --json         the figures as the layer gives them: {gid, pid, since_unix_ms, seconds,
                 send: DIR, recv: DIR}, DIR {calls, bytes, sizes, gaps_us, per_second}
                 (histograms as [low, count]: values from low to twice it)";

const USAGE_CAPTURE: &str = "usage: vmictl [--socket NAME] capture GID -w FILE [--duration S] [--json]

  capture GID    write the traffic of connection GID, as its program on this node sees it,
                 to FILE as pcapng, for S seconds (default 10): each call's bytes as TCP
                 segments between the program's own addresses (Ethernet, IP and TCP headers
                 made up; a handshake first), so that tshark or Wireshark read it as an
                 ordinary TCP conversation. vmictl opens FILE (as the user who runs it) and
                 hands it to the process through the agent; the program opens no path.
                 Returns once the time is over. Needs root or the owner of the connection's
                 processes. (Not through --node: the file is written where the connection is.)
  --json         {gid, file, bytes, ok, error?}";

const USAGE_DEVICE: &str =
    "usage: vmictl [--socket NAME] [--node NODE] device load|unload NAME --gid GID|--pid PID|--all [--json]
       vmictl [--socket NAME] [--node NODE] device list [--json]

  device load NAME  put device NAME at the end of the chain of filters of connection GID,
                 of every connection of process PID, or of every connection on the node
                 (--all: those the asker may manage), in both directions: each end on the
                 node offers the new chain to its peer's layer, which takes it for what it
                 receives and offers the same for what it sends. Both layers switch at a
                 frame boundary they agree on: no byte lost, repeated or reordered. The
                 switch happens with the next bytes the end sends.
  device unload NAME  take device NAME out of those chains again
  device list    the devices this build has, and each connection's chain both ways
  The devices: double (every byte twice; for tests), lz4 (LZ4 compression of each frame;
  data that does not compress goes as it is), zstd:LEVEL (Zstandard at LEVEL 1-19, the
  same way; zstd is zstd:3). Needs root or the owner of the processes.
  Connections on shared memory take no devices (move them to TCP first).
  --json         load/unload: {device, op, conns, node, ok, error?}; list: {devices,
                 connections: [{gid, pid, send, recv}]}";

const USAGE_WHERE: &str = "usage: vmictl [--socket NAME] where GID [--json]

  where GID      on which node(s) and in which process(es) connection GID lives now:
                 from the cluster directory when the agent keeps one (vmi-agent
                 --directory), the user is root and it lists the connection, else asked
                 of every node this node's agent knows
  --json         a JSON array of the connection's ends, each with its node";

const USAGE_EVENTS: &str =
    "usage: vmictl [--socket NAME] [--node NODE | --cluster] events [--follow] [--json]

  events         what happened on the node (the last 4096 events): connections made and
                 closed, paths dead and alive, networks out of and back in service, links
                 rebuilt (relink; failover: the stall the process saw and the bytes it
                 sent again), moves between substrates, checkpoint phases, refusals.
                 Users other than root see the node's events and those of their own
                 processes
  --node NODE    the events of another node of the cluster, each naming its node
  --cluster      the events of every node of the cluster (through its head, if the
                 agents have one: the newest it holds), each naming its node; a node
                 that does not answer in time is reported (kind unreachable) and does
                 not hold up the others; kind fan-out or head says how they are read
                 when a head stops answering or answers again
  --follow       then every new one as it happens, until the agent stops or vmictl is
                 interrupted (other nodes' events within a second)
  --json         one object a line: {seq, ms, kind, node?, pid?, ...}";

const USAGE_WEB: &str = "usage: vmictl [--socket NAME] [--node NODE] web [--json]

  web            the address of the agent's live web view of the cluster (nodes, networks
                 and path health as a picture, connections with their rates, recent
                 events), for a browser on the node; or, when the agent does not serve one,
                 how to turn it on (vmi-agent --web 127.0.0.1:PORT, or web = in its
                 configuration file). When the view needs a token, open the address once
                 with ?token=TOKEN (the agent's web-token file)
  --json         {addr, url, token} as the agent reports it (token: true if one is needed)";

const USAGE_MIGRATE: &str = "usage: vmictl [--socket NAME] [--node NODE] migrate PID --to HOST [--json]

  migrate PID --to HOST
                 move process PID of the node (under the layer), with its connections, to
                 HOST with CRIU: the node's agent runs vmi-migrate (beside vmi-agent, or
                 $VMI_MIGRATE there) and answers with its report; HOST is a namespace host
                 of that machine or ssh:[USER@]MACHINE (see vmi-migrate --help). Needs root
                 or the process's owner; root on another node with --node
  --json         vmi-migrate's report as one JSON object";

/// The commands and their usage.
const COMMANDS: [(&str, &str); 11] = [
    ("status", USAGE_STATUS),
    ("net", USAGE_NET),
    ("move", USAGE_MOVE),
    ("chain", USAGE_CHAIN),
    ("device", USAGE_DEVICE),
    ("profile", USAGE_PROFILE),
    ("capture", USAGE_CAPTURE),
    ("migrate", USAGE_MIGRATE),
    ("where", USAGE_WHERE),
    ("events", USAGE_EVENTS),
    ("web", USAGE_WEB),
];

fn usage_of(cmd: Option<&str>) -> &'static str {
    COMMANDS.iter().find(|(c, _)| Some(*c) == cmd).map_or(USAGE, |(_, u)| u)
}

/// `device list`: the devices this build has, and the chains of the node's connections.
fn print_devices(v: &Value, json: bool) {
    const ABOUT: &[(&str, &str)] = &[
        ("double", "every byte twice (a test device that changes lengths)"),
        ("lz4", "LZ4 compression of each frame; data that does not compress goes as it is"),
        ("zstd", "Zstandard compression of each frame at level 3 (as zstd:3)"),
        ("zstd:LEVEL (1-19)", "Zstandard at LEVEL: 1 fastest, 19 smallest"),
    ];
    let devices = substrate::connection::chain::DEVICE_NAMES;
    let conns: Vec<Value> = v["connections"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|c| {
            serde_json::json!({
                "gid": c["gid"], "pid": c["pid"],
                "send": c["chain"]["send"].as_str().unwrap_or(""),
                "recv": c["chain"]["recv"].as_str().unwrap_or(""),
                "send_offered": c["chain"]["send_offered"],
            })
        })
        .collect();
    if json {
        println!("{}", serde_json::json!({ "devices": devices, "connections": conns }));
        return;
    }
    println!("devices:");
    for d in devices {
        let about = ABOUT.iter().find(|(n, _)| n == d).map_or("", |(_, a)| a);
        println!("  {d:<18} {about}");
    }
    println!("connections ({}):", conns.len());
    let shown = |s: &str| if s.is_empty() { "-".to_string() } else { s.to_string() };
    for c in &conns {
        let offered = match c["send_offered"].as_str() {
            Some(o) => format!(" (offered to send through {}, not answered yet)", shown(o)),
            None => String::new(),
        };
        println!(
            "  {} pid {:>7}  sends through {:<16} receives through {}{offered}",
            c["gid"].as_str().unwrap_or("?"),
            c["pid"],
            shown(c["send"].as_str().unwrap_or("")),
            shown(c["recv"].as_str().unwrap_or(""))
        );
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("vmictl: {msg}");
    std::process::exit(1)
}

/// A wrong command line: says what is wrong and the synopsis of `cmd` (or of vmictl), and
/// exits 2.
fn usage_error(cmd: Option<&str>, msg: &str) -> ! {
    let u = usage_of(cmd);
    let synopsis = u.split("\n\n").next().unwrap_or(u);
    let more = match cmd {
        Some(c) => format!("`vmictl help {c}` says more"),
        None => "`vmictl --help` says more".into(),
    };
    eprintln!("vmictl: {msg}\n{synopsis}\n({more})");
    std::process::exit(2)
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

/// `vmictl web`: where the agent serves its web view, or how to turn it on (exit 1).
fn print_web(v: &Value, json: bool) {
    let node = v["node"].as_str().unwrap_or("?");
    let w = &v["web"];
    let Some(url) = w["url"].as_str() else {
        fail(&format!(
            "the agent of node {node} serves no web view; start it with `--web 127.0.0.1:PORT` (or `web = \"127.0.0.1:PORT\"` in its configuration file, /etc/vmi/agent.toml), then open http://127.0.0.1:PORT/ on the node (ssh -L PORT:127.0.0.1:PORT from elsewhere)"
        ))
    };
    if json {
        println!("{w}");
        return;
    }
    println!("{url}");
    if w["token"].as_bool() == Some(true) {
        eprintln!(
            "(the view needs the token of the agent's web-token file: open {url}?token=TOKEN once; the page keeps it for the tab)"
        );
    }
}

fn print_table(v: &Value) {
    println!("node {}", v["node"].as_str().unwrap_or("?"));
    if let Some(m) = v.get("mesh") {
        let r = &m["refused"];
        let n = |k: &str| r[k].as_u64().unwrap_or(0);
        println!(
            "cluster key {} (refused: {} agent channels, {} messages in clear, {} forged and {} replayed heartbeats, {} local commands, {} web requests)",
            m["key"].as_str().unwrap_or("?"),
            n("channel"),
            n("clear"),
            n("forged_heartbeats"),
            n("replayed_heartbeats"),
            n("local"),
            n("web")
        );
    }
    // Substrates: kernel TCP and shared memory always; sink plug-ins as their probes said.
    let sinks = v["sinks"].as_array().cloned().unwrap_or_default();
    let mut subs = vec!["tcp".to_string(), "shm".to_string()];
    for sk in &sinks {
        let d = sk["devices"].as_i64().unwrap_or(-1);
        let state = match d {
            n if n > 0 => format!("{n} devices"),
            0 => "no device".into(),
            _ => "refused".into(),
        };
        subs.push(format!(
            "{} ({state}: {})",
            sk["name"].as_str().unwrap_or("?"),
            sk["why"].as_str().unwrap_or("")
        ));
    }
    println!("substrates: {}", subs.join(", "));
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
            "  {:<10} {:<24} {:<17} mtu {:<5} {}",
            n["name"].as_str().unwrap_or(""),
            n["addr"].as_str().unwrap_or(""),
            n["mac"].as_str().unwrap_or("-"),
            n["mtu"].as_u64().map(|m| m.to_string()).unwrap_or_else(|| "-".into()),
            if n["admin"] == "down" { "OUT OF SERVICE" } else { "in service" }
        );
    }
    let ps = v["paths"].as_array().cloned().unwrap_or_default();
    println!("\npaths to other nodes: {}", ps.len());
    for p in &ps {
        let silent = p["silent_ms"].as_u64().map(|m| format!("heard {m} ms ago")).unwrap_or_default();
        println!(
            "  {:<16} {:<18} -> {:<18} {:<17} {:<8} {:<7} {}",
            p["node"].as_str().unwrap_or(""),
            p["local"].as_str().unwrap_or(""),
            p["peer"].as_str().unwrap_or(""),
            p["peer_mac"].as_str().unwrap_or("-"),
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
        let mut link = match (c["link"].as_str().unwrap_or(""), c["failovers"].as_u64().unwrap_or(0)) {
            (l, 0) => l.to_string(),
            (l, n) => format!("{l}, {n} failovers"),
        };
        let (tx_chain, rx_chain) =
            (c["chain"]["send"].as_str().unwrap_or(""), c["chain"]["recv"].as_str().unwrap_or(""));
        let offered = c["chain"]["send_offered"].as_str();
        if !tx_chain.is_empty() || !rx_chain.is_empty() || offered.is_some() {
            let or_none = |s: &str| if s.is_empty() { "-".to_string() } else { s.to_string() };
            link += &format!(", chain out {} in {}", or_none(tx_chain), or_none(rx_chain));
        }
        if let Some(o) = offered {
            // (On shared memory a chain stands aside: it is offered on the next TCP link.)
            let when = if c["substrate"] == "shm" { ", for the next TCP link" } else { "" };
            link += &format!(" (out {} offered{when})", if o.is_empty() { "-" } else { o });
        }
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

/// `vmictl where GID` answered by the cluster directory, when the agent has one and it
/// lists the connection (the program ends here); otherwise nothing is printed and the
/// caller asks the nodes.
fn where_from_directory(socket: &str, gid: &str, json: bool) {
    let Ok(g) = u128::from_str_radix(gid, 16) else { return };
    let mut s = connect(socket);
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if write_msg(&mut s, &Msg::Locate { gid: g }).is_err() {
        return;
    }
    let Ok(Msg::StatusReply { json: text }) = read_msg(&mut s) else { return };
    let Ok(v) = serde_json::from_str::<Value>(&text) else { return };
    let ends = v["ends"].as_array().cloned().unwrap_or_default();
    if ends.is_empty() {
        return;
    }
    if json {
        let out: Vec<Value> = ends
            .iter()
            .map(|e| {
                serde_json::json!({
                    "node": e["node"], "pid": e["pid"], "direction": e["side"],
                    "agents": e["agents"], "source": "directory", "lookup_us": v["lookup_us"],
                })
            })
            .collect();
        println!("{}", Value::Array(out));
    } else {
        for e in &ends {
            println!(
                "node {:<16} pid {:>7}  {:<3} (cluster directory, {} us)",
                e["node"].as_str().unwrap_or(""),
                e["pid"],
                e["side"].as_str().unwrap_or(""),
                v["lookup_us"]
            );
        }
    }
    std::process::exit(0);
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
    let via = match (v["via"].as_str(), v["head"].as_str()) {
        (Some("head"), Some(h)) => {
            format!("answered by cluster head {h} ({})", v["head_node"].as_str().unwrap_or("?"))
        }
        _ => match v["fallback"].as_str() {
            Some(f) => format!("every node asked from here: {f}"),
            None => "every node asked from here".to_string(),
        },
    };
    println!(
        "cluster seen from node {}: {} nodes answered, {} unreachable; {via}",
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
                "  {:<16} {:<16} -> {:<16} {:<17} {:<8} {}",
                n["node"].as_str().unwrap_or("?"),
                p["local"].as_str().unwrap_or(""),
                p["peer"].as_str().unwrap_or(""),
                p["peer_mac"].as_str().unwrap_or("-"),
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

fn print_grid(v: &Value) {
    let clusters = v["clusters"].as_array().cloned().unwrap_or_default();
    println!("grid seen from node {}: {} clusters", v["node"].as_str().unwrap_or("?"), clusters.len());
    for c in &clusters {
        let name = c["cluster"].as_str().unwrap_or("?");
        if let Some(e) = c["error"].as_str() {
            println!("\ncluster {name} (key {}): {e}", c["key"].as_str().unwrap_or("?"));
            continue;
        }
        let nodes = c["nodes"].as_array().cloned().unwrap_or_default();
        let bad = c["unreachable"].as_array().cloned().unwrap_or_default();
        println!(
            "\ncluster {name} (key {}, head {} at {}): {} nodes, {} unreachable",
            c["key"].as_str().unwrap_or("?"),
            c["head_node"].as_str().unwrap_or("?"),
            c["head"].as_str().unwrap_or("?"),
            nodes.len(),
            bad.len()
        );
        println!(
            "  {:<16} {:<9} {:>9} {:>9} {:>7} {:>7} {:>9} {:>9}",
            "NODE", "HEALTH", "NETWORKS", "PATHS UP", "PROCS", "CONNS", "TCP/SHM", "FAILOVERS"
        );
        for n in &nodes {
            let u = |k: &str| n[k].as_u64().unwrap_or(0);
            println!(
                "  {:<16} {:<9} {:>9} {:>9} {:>7} {:>7} {:>9} {:>9}",
                n["node"].as_str().unwrap_or("?"),
                n["health"].as_str().unwrap_or("?"),
                format!("{}/{}", u("networks_up"), u("networks")),
                format!("{}/{}", u("paths_alive"), u("paths")),
                u("processes"),
                u("connections"),
                format!("{}/{}", u("tcp"), u("shm")),
                u("failovers")
            );
        }
        for b in &bad {
            println!(
                "  unreachable: node {} ({})",
                b["node"].as_str().unwrap_or("?"),
                b["error"].as_str().unwrap_or("")
            );
        }
    }
}

/// The node's agent on its abstract socket `socket`, or the end with why not.
/// `--cluster net down|up NET`: the change on every node of the cluster view, one line (or
/// JSON object) per node; exit status 1 if any node did not make it.
fn cluster_net(socket: &str, net: &str, up: bool, json: bool) -> ! {
    let ask = |m: &Msg| -> Result<Msg, String> {
        let mut s = connect(socket);
        let _ = s.set_read_timeout(Some(Duration::from_secs(15)));
        write_msg(&mut s, m).map_err(|e| e.to_string())?;
        read_msg(&mut s).map_err(|e| e.to_string())
    };
    let view: Value = match ask(&Msg::ClusterStatus) {
        Ok(Msg::StatusReply { json }) => serde_json::from_str(&json).unwrap_or(Value::Null),
        Ok(Msg::Error { reason }) => fail(&reason),
        Ok(other) => fail(&format!("unexpected answer {other:?}")),
        Err(e) => fail(&e),
    };
    let mut nodes: Vec<String> = view["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["node"].as_str().map(String::from))
        .collect();
    nodes.extend(
        view["unreachable"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n["node"].as_str().map(String::from)),
    );
    let mut failed = false;
    for n in nodes {
        let cmd = Msg::Remote { to: n.clone(), cmd: Msg::Net { name: net.to_string(), up }.encode() };
        let (ok, what) = match ask(&cmd) {
            Ok(Msg::Ok) => (true, if up { "back in service" } else { "out of service" }.to_string()),
            Ok(Msg::Error { reason }) => (false, reason),
            Ok(other) => (false, format!("unexpected answer {}", other.name())),
            Err(e) => (false, e),
        };
        failed |= !ok;
        if json {
            println!("{}", serde_json::json!({ "node": n, "network": net, "ok": ok, "detail": what }));
        } else if ok {
            println!("node {n}: network {net} {what}");
        } else {
            println!("node {n}: {what}");
        }
    }
    std::process::exit(i32::from(failed))
}

/// A GID on the command line of `cmd`.
fn parse_gid(cmd: Option<&str>, g: &str) -> u128 {
    u128::from_str_radix(g.trim_start_matches("0x"), 16)
        .ok()
        .filter(|&g| g != 0)
        .unwrap_or_else(|| usage_error(cmd, &format!("{g} is not a GID (32 hex digits)")))
}

/// `vmictl capture`: opens `file` as the user who runs vmictl, hands it to the process
/// holding `gid` through the agent, waits for the capture to end, and says what it wrote.
fn capture(socket: &str, gid: u128, duration_ms: u32, file: &str, json: bool) -> ! {
    use std::os::fd::AsRawFd;
    std::fs::File::create(file).unwrap_or_else(|e| fail(&format!("{file}: {e}")));
    // (Appending: each packet goes whole, even when a forked child of the program writes too.)
    let f =
        std::fs::OpenOptions::new().append(true).open(file).unwrap_or_else(|e| fail(&format!("{file}: {e}")));
    let mut s = connect(socket);
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let m = Msg::Capture { gid, duration_ms };
    agent::wire::send_with_fd(&s, &m.encode(), Some(f.as_raw_fd())).unwrap_or_else(|e| fail(&e.to_string()));
    drop(f);
    let outcome = match read_msg(&mut s) {
        Ok(Msg::Ok) => Ok(()),
        Ok(Msg::Error { reason }) => Err(reason),
        Ok(other) => Err(format!("unexpected answer {}", other.name())),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = outcome {
        if json {
            println!(
                "{}",
                serde_json::json!({ "gid": format!("{gid:032x}"), "file": file, "ok": false, "error": e })
            );
            std::process::exit(1);
        }
        fail(&e);
    }
    if !json {
        eprintln!("capturing connection {gid:032x} into {file} for {:.1} s", duration_ms as f64 / 1000.0);
    }
    std::thread::sleep(Duration::from_millis(duration_ms as u64));
    let bytes = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    if json {
        println!(
            "{}",
            serde_json::json!({ "gid": format!("{gid:032x}"), "file": file, "bytes": bytes, "ok": true })
        );
    } else {
        println!("connection {gid:032x}: {bytes} bytes of pcapng in {file}");
    }
    std::process::exit(0)
}

fn connect(socket: &str) -> UnixStream {
    let addr = UnixAddr::from_abstract_name(socket.as_bytes()).unwrap_or_else(|e| fail(&e.to_string()));
    UnixStream::connect_addr(&addr)
        .unwrap_or_else(|e| fail(&format!("no agent on @{socket} in this network namespace: {e}")))
}

/// Prints the events `m` asks for (and with its `follow`, every new one) until the agent
/// stops.
fn watch(socket: &str, m: Msg, json: bool) {
    use std::io::Write;
    let mut s = connect(socket);
    write_msg(&mut s, &m).unwrap_or_else(|e| fail(&e.to_string()));
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

/// One event as a line: UTC time, its node (events of other nodes), kind, its fields.
fn event_line(v: &Value) -> String {
    let ms = v["ms"].as_u64().unwrap_or(0);
    let (s, m) = (ms / 1000, ms % 1000);
    let node = v["node"].as_str().map(|n| format!("{n:<16} ")).unwrap_or_default();
    let mut line = format!(
        "{:02}:{:02}:{:02}.{m:03}  {node}{:<10}",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60,
        v["kind"].as_str().unwrap_or("?")
    );
    if let Some(o) = v.as_object() {
        for (k, x) in o {
            if matches!(k.as_str(), "ms" | "kind" | "seq" | "node") {
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

/// The next word of command `cmd`, which needs `what`; `--help` there prints the command's
/// usage.
fn operand(it: &mut impl Iterator<Item = String>, cmd: &str, what: &str) -> String {
    match it.next() {
        Some(h) if h == "-h" || h == "--help" => {
            println!("{}", usage_of(Some(cmd)));
            std::process::exit(0)
        }
        Some(v) => v,
        None => usage_error(Some(cmd), &format!("{cmd} needs {what}")),
    }
}

fn main() {
    // Output into a pipe closed early (`vmictl status | head`) ends the program quietly, as
    // it does any command-line tool, instead of a panic on the failed print.
    // SAFETY: sets one signal's action back to the default, before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let mut socket = std::env::var("VMI_AGENT_SOCKET").unwrap_or_else(|_| DEFAULT_SOCKET.into());
    let mut json = false;
    let mut cmd: Option<Msg> = None;
    let mut name: Option<&'static str> = None;
    let mut node: Option<String> = None;
    let mut cluster = false;
    let mut whereis: Option<String> = None;
    let mut follow = false;
    let mut web = false;
    let mut grid = false;
    let mut device_list = false;
    let mut plot: Option<String> = None;
    let mut capture_file: Option<String> = None;
    // `--flag=value` is `--flag value`.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .flat_map(|a| match a.split_once('=') {
            Some((f, v)) if ["--socket", "--node", "--gid", "--pid"].contains(&f) => {
                vec![f.to_string(), v.to_string()]
            }
            _ => vec![a],
        })
        .collect();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let word: Option<&'static str> = COMMANDS.iter().map(|(c, _)| *c).find(|c| *c == a);
        if let (Some(w), Some(before)) = (word, name) {
            usage_error(Some(before), &format!("one command at a time ({before}, then {w})"));
        }
        match a.as_str() {
            "--socket" => socket = it.next().unwrap_or_else(|| usage_error(name, "--socket needs a value")),
            "--json" => json = true,
            "--node" => node = Some(it.next().unwrap_or_else(|| usage_error(name, "--node needs a value"))),
            "--cluster" => cluster = true,
            "--grid" => grid = true,
            "--follow" => follow = true,
            "-h" | "--help" => {
                println!("{}", usage_of(name));
                return;
            }
            "-V" | "--version" => {
                println!("vmictl {}", env!("CARGO_PKG_VERSION"));
                return;
            }
            "help" => {
                match it.next() {
                    None => println!("{USAGE}"),
                    Some(c) if COMMANDS.iter().any(|(n, _)| *n == c) => println!("{}", usage_of(Some(&c))),
                    Some(c) => usage_error(
                        None,
                        &format!(
                            "no command {c:?} (commands: status, net, move, chain, device, profile, capture, migrate, where, events, web)"
                        ),
                    ),
                }
                return;
            }
            "events" => {
                name = word;
                cmd = Some(Msg::Watch { after: 0, follow: false })
            }
            "where" => {
                name = word;
                let gid = operand(&mut it, "where", "a GID");
                whereis = Some(gid.trim_start_matches("0x").to_ascii_lowercase());
                cmd = Some(Msg::ClusterStatus);
            }
            "status" => {
                name = word;
                cmd = Some(Msg::Status)
            }
            "web" => {
                name = word;
                web = true;
                cmd = Some(Msg::Status)
            }
            "net" => {
                name = word;
                let up = match operand(&mut it, "net", "down or up").as_str() {
                    "down" => false,
                    "up" => true,
                    other => usage_error(name, &format!("net needs down or up, not {other:?}")),
                };
                let net = operand(&mut it, "net", "a network name (or address)");
                cmd = Some(Msg::Net { name: net, up });
            }
            "migrate" => {
                name = word;
                let pid = operand(&mut it, "migrate", "a process id");
                let pid = pid
                    .parse::<u32>()
                    .unwrap_or_else(|_| usage_error(name, &format!("{pid} is not a process id")));
                if operand(&mut it, "migrate", "--to HOST") != "--to" {
                    usage_error(name, "migrate PID needs --to HOST");
                }
                let to = operand(&mut it, "migrate", "a host after --to");
                cmd = Some(Msg::Migrate { pid, to });
            }
            "move" => {
                name = word;
                let gid = operand(&mut it, "move", "a GID");
                let gid = u128::from_str_radix(gid.trim_start_matches("0x"), 16)
                    .unwrap_or_else(|_| usage_error(name, &format!("{gid} is not a GID (32 hex digits)")));
                let shm = match operand(&mut it, "move", "shm or tcp").as_str() {
                    "shm" => true,
                    "tcp" => false,
                    other => usage_error(name, &format!("move needs shm or tcp, not {other:?}")),
                };
                cmd = Some(Msg::Move { gid, shm });
            }
            "chain" => {
                name = word;
                let gid = operand(&mut it, "chain", "a GID");
                let gid = u128::from_str_radix(gid.trim_start_matches("0x"), 16)
                    .unwrap_or_else(|_| usage_error(name, &format!("{gid} is not a GID (32 hex digits)")));
                let spec = operand(&mut it, "chain", "filter names separated by commas, or none");
                let spec = if spec == "none" { String::new() } else { spec };
                cmd = Some(Msg::Chain { gid, spec });
            }
            "device" => {
                name = word;
                match operand(&mut it, "device", "load, unload or list").as_str() {
                    "list" => {
                        device_list = true;
                        cmd = Some(Msg::Status);
                    }
                    op @ ("load" | "unload") => {
                        let dev = operand(&mut it, "device", "a device name");
                        let (mut gid, mut pid) = (0u128, 0u32);
                        match operand(&mut it, "device", "--gid GID, --pid PID or --all").as_str() {
                            "--gid" => {
                                let g = operand(&mut it, "device", "a GID after --gid");
                                gid = u128::from_str_radix(g.trim_start_matches("0x"), 16)
                                    .ok()
                                    .filter(|&g| g != 0)
                                    .unwrap_or_else(|| {
                                        usage_error(name, &format!("{g} is not a GID (32 hex digits)"))
                                    });
                            }
                            "--pid" => {
                                let p = operand(&mut it, "device", "a PID after --pid");
                                pid = p.parse().ok().filter(|&p| p != 0).unwrap_or_else(|| {
                                    usage_error(name, &format!("{p} is not a process id"))
                                });
                            }
                            "--all" => {}
                            other => usage_error(
                                name,
                                &format!("device {op} needs --gid GID, --pid PID or --all, not {other:?}"),
                            ),
                        }
                        cmd = Some(Msg::Device { load: op == "load", name: dev, gid, pid });
                    }
                    other => usage_error(name, &format!("device needs load, unload or list, not {other:?}")),
                }
            }
            "profile" => {
                name = word;
                let g = operand(&mut it, "profile", "a GID");
                let gid = parse_gid(name, &g);
                cmd = Some(Msg::Profile { gid });
            }
            "--plot" if name == Some("profile") => {
                plot = Some(operand(&mut it, "profile", "a file after --plot"));
            }
            "capture" => {
                name = word;
                let g = operand(&mut it, "capture", "a GID");
                let gid = parse_gid(name, &g);
                cmd = Some(Msg::Capture { gid, duration_ms: 10_000 });
            }
            "-w" if name == Some("capture") => {
                capture_file = Some(operand(&mut it, "capture", "a file after -w"));
            }
            "--duration" if name == Some("capture") => {
                let d = operand(&mut it, "capture", "seconds after --duration");
                let secs: f64 =
                    d.parse().ok().filter(|s: &f64| *s > 0.0 && *s <= 86_400.0).unwrap_or_else(|| {
                        usage_error(name, &format!("{d} is not a number of seconds (up to a day)"))
                    });
                if let Some(Msg::Capture { duration_ms, .. }) = &mut cmd {
                    *duration_ms = (secs * 1000.0) as u32;
                }
            }
            other => usage_error(name, &format!("unknown argument {other:?}")),
        }
    }
    let Some(mut cmd) = cmd else { usage_error(None, "which command?") };
    if let Msg::Capture { gid, duration_ms } = cmd {
        if node.is_some() || cluster || grid {
            usage_error(name, "capture writes the file on the connection's node: run it there (no --node)");
        }
        let file = capture_file.unwrap_or_else(|| usage_error(name, "capture GID needs -w FILE"));
        capture(&socket, gid, duration_ms, &file, json);
    }
    if plot.is_some() && name != Some("profile") {
        usage_error(name, "--plot goes with profile");
    }
    if follow && name != Some("events") {
        usage_error(name, "--follow goes with events");
    }
    if let Msg::Watch { .. } = cmd {
        if grid || (cluster && node.is_some()) {
            usage_error(name, "events go with --node NODE or --cluster (not both), not with --grid");
        }
        let m = match (&node, cluster) {
            (Some(to), _) => Msg::WatchCluster { to: to.clone(), follow },
            (None, true) => Msg::WatchCluster { to: String::new(), follow },
            (None, false) => Msg::Watch { after: 0, follow },
        };
        watch(&socket, m, json);
        return;
    }
    if grid {
        if cmd != Msg::Status || web || cluster || node.is_some() {
            usage_error(name, "--grid goes with status (not with --cluster or --node)");
        }
        cmd = Msg::GridStatus;
    }
    if cluster {
        if let (Msg::Net { name: net, up }, None) = (&cmd, &node) {
            cluster_net(&socket, net, *up, json);
        }
        if cmd != Msg::Status || web {
            usage_error(name, "--cluster goes with status, events and net");
        }
        cmd = Msg::ClusterStatus;
    }
    if let (Some(gid), None) = (&whereis, &node) {
        where_from_directory(&socket, gid, json);
    }
    let target = node.clone();
    if let Some(to) = node {
        if cluster || whereis.is_some() {
            usage_error(name, "--node does not go with --cluster or where");
        }
        cmd = Msg::Remote { to, cmd: cmd.encode() };
    }
    let inner = match &cmd {
        Msg::Remote { cmd, .. } => Msg::decode_framed(cmd).unwrap_or(Msg::Status),
        c => c.clone(),
    };
    let mut s = connect(&socket);
    // A migration takes as long as CRIU does (the agent gives up after 300 s).
    let wait = if matches!(inner, Msg::Migrate { .. }) { 320 } else { 10 };
    let _ = s.set_read_timeout(Some(Duration::from_secs(wait)));
    if let Msg::Profile { .. } = &inner {
        write_msg(&mut s, &cmd).unwrap_or_else(|e| fail(&e.to_string()));
        let text = match read_msg(&mut s) {
            Ok(Msg::ProfileReply { json }) => json,
            Ok(Msg::Error { reason }) => fail(&reason),
            Ok(other) => fail(&format!("unexpected answer {}", other.name())),
            Err(e) => fail(&e.to_string()),
        };
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| fail(&format!("bad profile: {e}")));
        if let Some(p) = &plot {
            std::fs::write(p, agent::profile_view::svg(&v)).unwrap_or_else(|e| fail(&format!("{p}: {e}")));
        }
        if json {
            println!("{text}");
        } else {
            print!("{}", agent::profile_view::table(&v));
            if let Some(p) = &plot {
                println!("\nbytes per second over time: {p}");
            }
        }
        return;
    }
    if let Msg::Device { load, name: dev, gid, pid } = &inner {
        write_msg(&mut s, &cmd).unwrap_or_else(|e| fail(&e.to_string()));
        let op = if *load { "load" } else { "unload" };
        let outcome = match read_msg(&mut s) {
            Ok(Msg::DeviceReply { conns }) => Ok(conns),
            Ok(Msg::Error { reason }) => Err(reason),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        };
        if json {
            let mut v = serde_json::json!({
                "device": dev, "op": op, "ok": outcome.is_ok(),
                "node": target.clone().map_or(Value::Null, Value::String),
            });
            match &outcome {
                Ok(n) => v["conns"] = Value::from(*n),
                Err(e) => v["error"] = Value::String(e.clone()),
            }
            println!("{v}");
        } else {
            match &outcome {
                Ok(n) => {
                    let which = if *gid != 0 {
                        format!("connection {gid:032x}")
                    } else if *pid != 0 {
                        format!("the connections of process {pid}")
                    } else {
                        "every connection".to_string()
                    };
                    println!("device {dev}: {op} asked on {which} ({n} connection(s)); each switches at its next bytes sent");
                }
                Err(e) => eprintln!("vmictl: {e}"),
            }
        }
        std::process::exit(i32::from(outcome.is_err()));
    }
    let done = match &inner {
        Msg::Net { name, up } => Some((
            format!("network {name} {}", if *up { "back in service" } else { "out of service" }),
            serde_json::json!({ "network": name, "admin": if *up { "up" } else { "down" } }),
        )),
        Msg::Move { gid, shm } => Some((
            format!("connection {gid:032x} moving to {}", if *shm { "shared memory" } else { "TCP" }),
            serde_json::json!({ "gid": format!("{gid:032x}"), "to": if *shm { "shm" } else { "tcp" } }),
        )),
        Msg::Chain { gid, spec } => Some((
            format!(
                "connection {gid:032x}: chain {} offered to the peer for what its ends here send",
                if spec.is_empty() { "none".to_string() } else { format!("\"{spec}\"") }
            ),
            serde_json::json!({ "gid": format!("{gid:032x}"), "chain": spec }),
        )),
        _ => None,
    };
    if let Some((done, mut as_json)) = done {
        as_json["node"] = target.clone().map_or(Value::Null, Value::String);
        write_msg(&mut s, &cmd).unwrap_or_else(|e| fail(&e.to_string()));
        let outcome = match read_msg(&mut s) {
            Ok(Msg::Ok) => Ok(()),
            Ok(Msg::Error { reason }) => Err(reason),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        };
        if json {
            as_json["ok"] = Value::Bool(outcome.is_ok());
            if let Err(e) = &outcome {
                as_json["error"] = Value::String(e.clone());
            }
            println!("{as_json}");
            std::process::exit(i32::from(outcome.is_err()));
        }
        match outcome {
            Ok(()) => {
                println!("{done}");
                return;
            }
            Err(reason) => fail(&reason),
        }
    }
    write_msg(&mut s, &cmd).unwrap_or_else(|e| fail(&e.to_string()));
    let json_text = match read_msg(&mut s) {
        Ok(Msg::StatusReply { json }) => json,
        Ok(Msg::Error { reason }) => fail(&reason),
        Ok(other) => fail(&format!("unexpected answer {other:?}")),
        Err(e) => fail(&e.to_string()),
    };
    let v: Value = serde_json::from_str(&json_text).unwrap_or_else(|e| fail(&format!("bad report: {e}")));
    if let Msg::Migrate { pid, to } = &inner {
        let ok = v["ok"] == Value::Bool(true);
        if json {
            println!("{json_text}");
        } else if ok {
            let phases: Vec<String> = v
                .as_object()
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, x)| Some(format!("{} {} ms", k.strip_suffix("_ms")?, x)))
                        .collect()
                })
                .unwrap_or_default();
            println!(
                "process {pid}: {}; {} connection(s), {} rebuilt ({})",
                v["outcome"].as_str().unwrap_or("moved"),
                v["connections"],
                v["rebuilt"],
                phases.join(", ")
            );
        } else {
            eprintln!("vmictl: migration of process {pid} to {to} failed: {}", v["outcome"]);
        }
        std::process::exit(if ok { 0 } else { 1 });
    }
    if device_list {
        print_devices(&v, json);
    } else if web {
        print_web(&v, json);
    } else if let Some(gid) = whereis {
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
    } else if grid {
        print_grid(&v);
    } else if cluster {
        print_cluster(&v);
    } else {
        print_table(&v);
    }
}
