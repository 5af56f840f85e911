//! `vmi-agent`: the node agent. Runs in the foreground; logs to standard error with the
//! level from `VMI_LOG` (tracing filter syntax, default `info`).
//!
//! ```text
//! vmi-agent [--socket NAME] [--port PORT] [--bind ADDR] [--node NAME]
//! ```

use agent::local::{self, Agent};
use agent::{net, peer, DEFAULT_PORT, DEFAULT_SOCKET};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
use std::sync::Arc;
use tracing::{error, info};

const USAGE: &str = "usage: vmi-agent [--socket NAME] [--port PORT] [--bind ADDR] [--node NAME]

  --socket NAME  abstract Unix socket the node's layers use (default vmi-agent; the layer
                 reads VMI_AGENT_SOCKET). Abstract sockets belong to the network namespace,
                 so hosts made of namespaces need no per-host paths.
  --port PORT    TCP port for other nodes' agents (default 7787)
  --bind ADDR    address to listen on for other agents (default 0.0.0.0)
  --node NAME    name shown in reports (default: first IPv4 address)
Logging: VMI_LOG=error|warn|info|debug (default info).";

struct Args {
    socket: String,
    port: u16,
    bind: IpAddr,
    node: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        socket: DEFAULT_SOCKET.into(),
        port: DEFAULT_PORT,
        bind: "0.0.0.0".parse().expect("ip"),
        node: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match k.as_str() {
            "--socket" => a.socket = val("--socket")?,
            "--port" => a.port = val("--port")?.parse().map_err(|e| format!("--port: {e}"))?,
            "--bind" => a.bind = val("--bind")?.parse().map_err(|e| format!("--bind: {e}"))?,
            "--node" => a.node = Some(val("--node")?),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
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
    info!("vmi-agent for node {node}: local socket @{}, agents on {}:{}", args.socket, args.bind, args.port);
    let agent = Arc::new(Agent::new(args.port, node));
    let a2 = agent.clone();
    std::thread::spawn(move || peer::serve(a2, tcp));
    local::serve(agent, unix);
}
