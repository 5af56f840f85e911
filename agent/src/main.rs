//! `vmi-agent`: the node agent. Runs in the foreground; logs to standard error with the
//! level from `VMI_LOG` (tracing filter syntax, default `info`).
//!
//! ```text
//! vmi-agent [--key FILE] [--peers A,B..] [--metrics ADDR:PORT] [--socket NAME] [--port PORT] [--bind ADDR] [--node NAME]
//!           [--probe-interval MS] [--dead-after MS]
//! vmi-agent --init [--key FILE]
//! ```

use agent::local::{self, Agent};
use agent::mesh::ClusterKey;
use agent::{net, paths, peer, DEFAULT_PORT, DEFAULT_SOCKET};
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
use std::sync::Arc;
use std::time::Duration;
use tracing::{error, info};

const USAGE: &str = "usage: vmi-agent [--key FILE] [--peers A,B..] [--metrics ADDR:PORT] [--socket NAME] [--port PORT] [--bind ADDR] [--node NAME]
                 [--probe-interval MS] [--dead-after MS] [--sweep-every MS]
       vmi-agent --init [--key FILE]

  --init         make a new cluster key at FILE and exit (an existing file is never
                 overwritten); copy it to every node of the cluster, mode 0600
  --key FILE     the cluster key (default $VMI_CLUSTER_KEY, else /etc/vmi/cluster.key).
                 Agents talk only to agents holding the same key: their channel is
                 authenticated and encrypted with it (Noise NNpsk0), heartbeats are sealed
                 with it; anything else is refused and logged. `vmictl status` shows its
                 fingerprint, equal on every node of one cluster

  --socket NAME  abstract Unix socket the node's layers use (default vmi-agent; the layer
                 reads VMI_AGENT_SOCKET). Abstract sockets belong to the network namespace,
                 so hosts made of namespaces need no per-host paths.
  --port PORT    TCP port for other nodes' agents (default 7787)
  --metrics ADDR:PORT  serve Prometheus metrics at http://ADDR:PORT/metrics (off by default;
                 nothing secret is in them, but keep ADDR local or firewalled)
  --peers A,B..  other nodes of the cluster (their addresses, one per node is enough): probed
                 from the start, so `vmictl --cluster status` and `vmictl --node` know them
                 before any connection does
  --bind ADDR    address to listen on for other agents (default 0.0.0.0)
  --node NAME    name shown in reports (default: first IPv4 address)
  --probe-interval MS  heartbeat on every network path to other nodes' agents, UDP on
                 PORT (default 10)
  --dead-after MS  silence after which a path is dead and connections leave it
                 (default 50)
  --sweep-every MS  how often /dev/shm is searched for shared-memory offers whose process
                 died before the peer took them; they are removed (default 30000)
Logging: VMI_LOG=error|warn|info|debug (default info).";

struct Args {
    init: bool,
    key: Option<std::path::PathBuf>,
    peers: Vec<IpAddr>,
    metrics: Option<SocketAddr>,
    socket: String,
    port: u16,
    bind: IpAddr,
    node: Option<String>,
    probe_interval: u64,
    dead_after: u64,
    sweep_every: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        init: false,
        key: None,
        peers: Vec::new(),
        metrics: None,
        socket: DEFAULT_SOCKET.into(),
        port: DEFAULT_PORT,
        bind: "0.0.0.0".parse().expect("ip"),
        node: None,
        probe_interval: paths::DEFAULT_INTERVAL.as_millis() as u64,
        dead_after: paths::DEFAULT_DEAD_AFTER.as_millis() as u64,
        sweep_every: 30_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match k.as_str() {
            "--init" => a.init = true,
            "--key" => a.key = Some(val("--key")?.into()),
            "--metrics" => {
                a.metrics =
                    Some(val("--metrics")?.parse().map_err(|e| format!("--metrics: {e} (ADDR:PORT)"))?)
            }
            "--peers" => {
                for p in val("--peers")?.split(',').filter(|p| !p.is_empty()) {
                    a.peers.push(p.trim().parse().map_err(|e| format!("--peers: {p}: {e}"))?);
                }
            }
            "--socket" => a.socket = val("--socket")?,
            "--port" => a.port = val("--port")?.parse().map_err(|e| format!("--port: {e}"))?,
            "--bind" => a.bind = val("--bind")?.parse().map_err(|e| format!("--bind: {e}"))?,
            "--node" => a.node = Some(val("--node")?),
            "--probe-interval" => {
                a.probe_interval =
                    val("--probe-interval")?.parse().map_err(|e| format!("--probe-interval: {e}"))?
            }
            "--dead-after" => {
                a.dead_after = val("--dead-after")?.parse().map_err(|e| format!("--dead-after: {e}"))?
            }
            "--sweep-every" => {
                a.sweep_every = val("--sweep-every")?.parse().map_err(|e| format!("--sweep-every: {e}"))?
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.sweep_every == 0 {
        return Err("--sweep-every must be > 0".into());
    }
    if a.probe_interval == 0 || a.dead_after <= a.probe_interval {
        return Err("--probe-interval must be > 0 and below --dead-after".into());
    }
    Ok(a)
}

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("VMI_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vmi-agent: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let key_path = ClusterKey::path(args.key.clone());
    if args.init {
        match ClusterKey::create(&key_path) {
            Ok(k) => {
                println!(
                    "cluster key written to {} (fingerprint {}); copy it to every node of the cluster (mode 0600)",
                    key_path.display(),
                    k.fingerprint
                );
                std::process::exit(0);
            }
            Err(e) => {
                eprintln!("vmi-agent: cannot make a cluster key: {e}");
                std::process::exit(1);
            }
        }
    }
    let key = match ClusterKey::load(&key_path) {
        Ok(k) => k,
        Err(e) => {
            error!("{e}");
            std::process::exit(1);
        }
    };
    let node = args.node.clone().unwrap_or_else(net::node_name);
    let unix = match UnixAddr::from_abstract_name(args.socket.as_bytes())
        .and_then(|a| UnixListener::bind_addr(&a))
    {
        Ok(l) => l,
        Err(e) => {
            error!("cannot listen on abstract socket @{}: {e} (is another agent running in this network namespace?)", args.socket);
            std::process::exit(1);
        }
    };
    let tcp = match TcpListener::bind(SocketAddr::new(args.bind, args.port)) {
        Ok(l) => l,
        Err(e) => {
            error!("cannot listen on {}:{} for other agents: {e}", args.bind, args.port);
            std::process::exit(1);
        }
    };
    let udp = match UdpSocket::bind(SocketAddr::new(args.bind, args.port)) {
        Ok(s) => s,
        Err(e) => {
            error!("cannot open UDP {}:{} for path probes: {e}", args.bind, args.port);
            std::process::exit(1);
        }
    };
    info!(
        "vmi-agent for node {node}: local socket @{}, agents on {}:{} (TCP, UDP probes every {} ms, dead after {} ms), cluster key {} ({})",
        args.socket, args.bind, args.port, args.probe_interval, args.dead_after, key.fingerprint, key_path.display()
    );
    let agent = Arc::new(Agent::new(
        args.port,
        node,
        Duration::from_millis(args.probe_interval),
        Duration::from_millis(args.dead_after),
        key,
    ));
    let peers: Vec<SocketAddr> = args.peers.iter().map(|ip| SocketAddr::new(*ip, args.port)).collect();
    agent.health.learn(&peers);
    if let Some(m) = args.metrics {
        if let Err(e) = agent::metrics::serve(agent.clone(), m) {
            error!("{e}");
            std::process::exit(1);
        }
    }
    paths::run(agent.health.clone(), agent.events.clone(), udp);
    agent::sweep::run("/dev/shm".into(), Duration::from_millis(args.sweep_every));
    let a2 = agent.clone();
    std::thread::spawn(move || peer::serve(a2, tcp));
    local::serve(agent, unix);
}
