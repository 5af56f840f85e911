//! `vmi-agent`: the node agent. Runs in the foreground and logs to standard error. Its
//! settings come from the configuration file (`/etc/vmi/agent.toml`, or `--config FILE`),
//! the environment (`VMI_CLUSTER_KEY`, `VMI_LOG`) and the command line, each overriding the
//! one before (see [`agent::config`] and `vmi-agent --help`).

use agent::config::{self, Action, Metrics, Settings, Web};
use agent::local::{self, Agent};
use agent::mesh::ClusterKey;
use agent::{net, paths, peer};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
use std::sync::Arc;
use std::time::Duration;
use tracing::{error, info, warn};

const USAGE: &str = "usage: vmi-agent [--config FILE] [--key FILE] [--peers A,B..] [--head A,B..]
                 [--grid NAME=HEADADDR@KEYFILE].. [--metrics ADDR:PORT|off]
                 [--web ADDR:PORT|PORT|off] [--web-token FILE]
                 [--socket NAME] [--port PORT] [--relink-ports N] [--bind ADDR] [--node NAME]
                 [--setup-ports FIRST-LAST|off]
                 [--probe-interval MS] [--dead-after MS] [--sweep-every MS]
                 [--directory etcd://HOST:PORT,..] [--directory-ttl S]
                 [--directory-ca FILE [--directory-cert FILE --directory-key FILE]]
                 [--chain RULE].. [--plugins DIR] [--log FILTER]
       vmi-agent --init [--config FILE] [--key FILE]
       vmi-agent --check-config [--config FILE] [flags as above]
       vmi-agent --help | --version

The vmi node agent: one per node (per network namespace), in the foreground, logging to
standard error. Settings come from the configuration file, then the environment, then the
flags, each overriding the one before; every flag NAME is also a key NAME in the file.

  --config FILE  the configuration file (TOML; default /etc/vmi/agent.toml, used if it
                 exists). An unknown key or a bad value stops the agent with the file, line
                 and key; `--config /dev/null` ignores the default file
  --check-config  read the settings and the cluster key, print the settings the agent would
                 run with (as a configuration file) and exit: 0 if they are good
  --init         make a new cluster key at the key file and exit (an existing file is never
                 overwritten); copy it to every node of the cluster, mode 0600
  --key FILE     the cluster key (key = \"FILE\"; $VMI_CLUSTER_KEY overrides the file;
                 default /etc/vmi/cluster.key). Agents talk only to agents holding the same
                 key: their channel is authenticated and encrypted with it (Noise NNpsk0),
                 heartbeats are sealed with it; anything else is refused and logged.
                 `vmictl status` shows its fingerprint, equal on every node of one cluster

  --socket NAME  abstract Unix socket the node's layers and vmictl use (socket = \"NAME\";
                 default vmi-agent; the layer reads VMI_AGENT_SOCKET). Abstract sockets
                 belong to the network namespace, so hosts made of namespaces need no paths
  --port PORT    TCP port for other nodes' agents, and UDP port of the heartbeats
                 (port = PORT; default 7787; the same on every node)
  --relink-ports N  TCP ports PORT to PORT+N-1 take the rebuilt links of connections
                 (relink-ports = N; default 1, at most 64; the same on every node). A
                 node dials a connection's rebuilt link to one of them, chosen by the
                 connection's GID, and to PORT if that one does not answer: all the
                 links rebuilt between two nodes share the dialing node's ephemeral
                 ports (about 28,000 per destination port by default), so more ports let
                 more connections between two nodes move at once
  --setup-ports FIRST-LAST  source ports the node's layers bind their connections to
                 before connecting (setup-ports = \"FIRST-LAST\", or \"off\"; default
                 59000-60999): a connection is then announced with its source port and the
                 accepting side finds it at once. The agent reserves them
                 (net.ipv4.ip_local_reserved_ports, added to what is there and left after
                 it stops) so that the kernel gives them to no other connection; when all
                 are taken, connections are announced without their port, as with off
  --bind ADDR    address to listen on for other agents (bind = \"ADDR\"; default 0.0.0.0)
  --peers A,B..  other nodes of the cluster (peers = [\"A\", \"B\"]; one address per node is
                 enough): probed from the start, so `vmictl --cluster status` and
                 `vmictl --node` know them before any connection does. Repeatable; default none
  --head A,B..   the cluster's heads (head = [\"A\", \"B\"]; give every node the same list):
                 this node pushes a summary of itself (its status, the owners of its
                 processes, its newest events) to each every 2 s and when something happens;
                 `vmictl --cluster status`, `where` and `--cluster events` are answered by the
                 first head that answers, in one exchange; when none does, this agent asks
                 every node it knows and says so. Any agent can be a head. Repeatable;
                 default none (every query asks every node)
  --grid NAME=HEADADDR@KEYFILE  a cluster of this agent's grid view (grid = [\"...\", ...]):
                 `vmictl --grid status` asks its head (HEADADDR, or ADDR:PORT) through a
                 channel with that cluster's key (KEYFILE, mode 0600). Entries of one NAME
                 are alternative heads. Repeatable; default none
  --node NAME    name shown in reports (node = \"NAME\"; default: first IPv4 address)
  --metrics ADDR:PORT  serve Prometheus metrics at http://ADDR:PORT/metrics
                 (metrics = \"ADDR:PORT\"; default off). Nothing secret is in them, but keep
                 ADDR local or firewalled
  --web ADDR:PORT  serve a live view of the cluster to browsers at http://ADDR:PORT/: nodes,
                 networks and path health as a picture, connections with their rates,
                 recent events; read-only (web = \"ADDR:PORT\"; PORT alone is 127.0.0.1:PORT;
                 default off). On loopback no token is needed; any other address needs
                 --web-token, or the agent does not start
  --web-token FILE  the web view's token (web-token = \"FILE\"; 16 or more visible
                 characters, mode 0600; default none): every request must carry it, as
                 `Authorization: Bearer TOKEN` or once as http://ADDR:PORT/?token=TOKEN
  --probe-interval MS  heartbeat on every network path to other nodes' agents, UDP on PORT
                 (probe-interval = MS; default 10)
  --dead-after MS  silence after which a path is dead and connections leave it
                 (dead-after = MS; default 50; above probe-interval)
  --sweep-every MS  how often /dev/shm is searched for shared-memory offers whose process
                 died before the peer took them; they are removed (sweep-every = MS;
                 default 30000)
  --directory etcd://HOST:PORT[,HOST:PORT..]  keep the cluster's directory in etcd
                 (directory = \"etcd://...\"; default off): this node under a lease its agent
                 keeps alive, its networks and listeners, where each connection's ends live;
                 a moved listener is looked up there first (at most 300 ms). etcd down or
                 slow never stops connections: the agent goes on with what it knows and
                 registers again when etcd is back
  --directory-ttl S  the directory lease's time to live, seconds (directory-ttl = S;
                 default 10, 2 to 3600): a dead node's entries go within it
  --directory-ca FILE  talk TLS to etcd, its servers' certificates checked against these
                 CA certificates (PEM; directory-ca = \"FILE\"; default none: plain TCP). The
                 records hold no secret, but whoever reaches etcd unchecked can change them
  --directory-cert FILE --directory-key FILE  the agent's client certificate and its key
                 (PEM; the key file readable by its owner only) for etcd's
                 --client-cert-auth; with etcd's authentication on, the certificate's
                 common name is the etcd user, which needs read and write on the cluster's
                 prefix (/vmi/CLUSTER/)
  --plugins DIR  the folder of device plug-ins (libvmi_dev_NAME.so; default
                 /usr/lib/vmi/plugins): vmictl device load NAME takes a plug-in found there
                 (the programs' layers load it from their VMI_PLUGINS, the same folder by
                 default)
  --chain RULE   a default chain of devices for the node's connections (chain = [\"RULE\",
                 ..]): CHAIN for every connection, or NET/LEN=CHAIN for those whose peer is in
                 that network (the most specific rule wins; CHAIN may be none), e.g. --chain
                 lz4 --chain \"10.78.1.0/24=zstd:1\"; rules may also be separated by ';'. A
                 program's VMI_CHAIN overrides it. Repeatable; default none
  --log FILTER   log level or tracing filter: error, warn, info, debug (log = \"FILTER\";
                 $VMI_LOG overrides the file; default info)
  -h, --help     this text;  -V, --version  the version

Exit status: 0 done (--init, --check-config, --help); 1 the agent could not start (a socket
is taken or cannot be opened) or stopped on an error; 2 the command line, the configuration
file or the cluster key is unusable (nothing was started; fix it before trying again).
See vmi-agent(8).";

/// Exit status for an unusable command line, configuration or key: starting again will
/// not help (the systemd unit does not restart on it).
const EXIT_CONFIG: i32 = 2;

fn main() {
    let cli = match config::parse_args(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vmi-agent: {e}\n(`vmi-agent --help` lists the flags)");
            std::process::exit(EXIT_CONFIG);
        }
    };
    match cli.action {
        Action::Help => {
            println!("{USAGE}");
            return;
        }
        Action::Version => {
            println!("vmi-agent {}", env!("CARGO_PKG_VERSION"));
            return;
        }
        _ => {}
    }
    let settings = match config::load(cli.config.as_deref())
        .and_then(|f| config::resolve(&cli.layer, |k| std::env::var(k).ok(), &f))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vmi-agent: {e}; not started");
            std::process::exit(EXIT_CONFIG);
        }
    };
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&settings.log))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    match cli.action {
        Action::Init => match ClusterKey::create(&settings.key) {
            Ok(k) => {
                println!(
                    "cluster key written to {} (fingerprint {}); copy it to every node of the cluster (mode 0600)",
                    settings.key.display(),
                    k.fingerprint
                );
            }
            Err(e) => {
                eprintln!("vmi-agent: cannot make a cluster key: {e}");
                std::process::exit(1);
            }
        },
        Action::Check => {
            match ClusterKey::load(&settings.key).and_then(|k| web_token(&settings).map(|_| k)).and_then(
                |k| agent::hier::init(settings.head.clone(), &settings.grid, settings.port).map(|_| k),
            ) {
                Ok(k) => {
                    print!("{}", settings.to_toml());
                    println!(
                        "# cluster key fingerprint {}; node name {}",
                        k.fingerprint,
                        node_name(&settings)
                    );
                }
                Err(e) => {
                    eprintln!("vmi-agent: {e}");
                    std::process::exit(EXIT_CONFIG);
                }
            }
        }
        _ => run(settings),
    }
}

/// The web view's token, if one is configured (read even when the view is off, so that
/// `--check-config` finds a bad file before it is needed).
fn web_token(s: &Settings) -> Result<Option<agent::web::Token>, String> {
    s.web_token.as_deref().map(agent::web::Token::load).transpose()
}

fn node_name(s: &Settings) -> String {
    s.node.clone().unwrap_or_else(net::node_name)
}

/// Raises the soft limit on open descriptors to the hard one. Every rebuilt link passes
/// through the agent, and a descriptor sent to a process that has not read it yet counts
/// against the sender's limit (the kernel refuses the send with ETOOMANYREFS beyond it): a
/// failover of thousands of connections must not stop at the default 1,024.
fn raise_nofile() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one plain struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 || r.rlim_cur >= r.rlim_max {
        return;
    }
    let want = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
    // SAFETY: setrlimit reads one plain struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
        info!("open descriptors: soft limit raised from {} to {}", r.rlim_cur, r.rlim_max);
    } else {
        warn!(
            "open descriptors: cannot raise the soft limit {} to {}: {}",
            r.rlim_cur,
            r.rlim_max,
            std::io::Error::last_os_error()
        );
    }
}

fn run(args: Settings) {
    raise_nofile();
    let key = match ClusterKey::load(&args.key) {
        Ok(k) => k,
        Err(e) => {
            error!("{e}; not started");
            std::process::exit(EXIT_CONFIG);
        }
    };
    let token = match web_token(&args) {
        Ok(t) => t,
        Err(e) => {
            error!("{e}; not started");
            std::process::exit(EXIT_CONFIG);
        }
    };
    if let Err(e) = agent::hier::init(args.head.clone(), &args.grid, args.port) {
        error!("{e}; not started");
        std::process::exit(EXIT_CONFIG);
    }
    let node = node_name(&args);
    let unix = match UnixAddr::from_abstract_name(args.socket.as_bytes())
        .and_then(|a| UnixListener::bind_addr(&a))
    {
        Ok(l) => l,
        Err(e) => {
            error!(
                "cannot listen on abstract socket @{}: {e} (is another agent running in this network namespace? `ss -xlp | grep @{}` shows it; or choose another `socket`)",
                args.socket, args.socket
            );
            std::process::exit(1);
        }
    };
    let tcp = match TcpListener::bind(SocketAddr::new(args.bind, args.port)) {
        Ok(l) => l,
        Err(e) => {
            error!(
                "cannot listen on {}:{} (TCP) for other agents: {e} (`ss -tlpn sport = :{}` shows who holds the port; `port` and `bind` choose another)",
                args.bind, args.port, args.port
            );
            std::process::exit(1);
        }
    };
    let mut relink = Vec::new();
    for p in 1..args.relink_ports {
        let port = args.port + p;
        match TcpListener::bind(SocketAddr::new(args.bind, port)) {
            Ok(l) => relink.push(l),
            Err(e) => {
                error!(
                    "cannot listen on {}:{port} (TCP) for rebuilt links (relink-ports {}): {e} (`ss -tlpn sport = :{port}` shows who holds the port; `relink-ports` or `port` choose others)",
                    args.bind, args.relink_ports
                );
                std::process::exit(1);
            }
        }
    }
    let udp = match UdpSocket::bind(SocketAddr::new(args.bind, args.port)) {
        Ok(s) => s,
        Err(e) => {
            error!(
                "cannot open {}:{} (UDP) for path heartbeats: {e} (`ss -ulpn sport = :{}` shows who holds the port; `port` and `bind` choose another)",
                args.bind, args.port, args.port
            );
            std::process::exit(1);
        }
    };
    info!(
        "vmi-agent {} for node {node}: local socket @{}, agents on {}:{} (TCP, UDP probes every {} ms, dead after {} ms), cluster key {} ({})",
        env!("CARGO_PKG_VERSION"), args.socket, args.bind, args.port, args.probe_interval, args.dead_after, key.fingerprint, args.key.display()
    );
    let agent = Arc::new(Agent::new(
        args.port,
        args.relink_ports,
        node.clone(),
        Duration::from_millis(args.probe_interval),
        Duration::from_millis(args.dead_after),
        key,
    ));
    let peers: Vec<SocketAddr> = args.peers.iter().map(|ip| SocketAddr::new(*ip, args.port)).collect();
    agent.health.learn(&peers);
    if let agent::config::SetupPorts::Range(first, last) = args.setup_ports {
        agent::net::reserve_ports(first, last);
        let _ = agent.setup_ports.set(args.setup_ports.block());
        let (_, (first, n)) = agent::tickets::split(args.setup_ports.block().0, args.setup_ports.block().1);
        *agent.events.tickets.lock().unwrap_or_else(|e| e.into_inner()) = agent::tickets::Pool::new(first, n);
    }
    {
        // (Weak: the hook lives in the agent it points to.)
        let a = Arc::downgrade(&agent);
        let _ = agent.events.on_accepted.set(Box::new(move |pid, local, peer, gid| {
            if let Some(a) = a.upgrade() {
                a.taken_from_table(pid, local, peer, gid);
            }
        }));
    }
    let _ = agent.plugins.set(args.plugins.clone());
    agent.sinks.probe(&args.plugins);
    // (Names only: status shows the chains of plug-ins, which run in the programs alone.)
    substrate::connection::chain::set_plugins(Box::new(substrate::connection::chain::PluginNames(
        substrate::connection::chain::plugin_names_kept(&args.plugins),
    )));
    if !args.chain.is_empty() {
        // (Checked when the settings were read.)
        let p = substrate::connection::chain::Policy::parse(args.chain.iter().map(String::as_str))
            .unwrap_or_default();
        info!(
            "default chains of this node's connections: {} (a program's VMI_CHAIN overrides them)",
            p.to_text()
        );
        let _ = agent.chain.set(p.to_text());
    }
    if !args.head.is_empty() {
        info!(
            "cluster heads: {} (this node pushes its summary there; cluster queries go there first)",
            args.head.iter().map(|h| h.to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    if !args.grid.is_empty() {
        info!(
            "grid view of {} (`vmictl --grid status`)",
            args.grid.iter().map(|g| format!("{} at {}", g.name, g.head)).collect::<Vec<_>>().join(", ")
        );
    }
    agent::hier::push_forever(agent.clone());
    if args.directory != config::DirectorySpec::Off {
        let health = agent.health.clone();
        let name = node.clone();
        let tls = match &args.directory_ca {
            Some(ca) => {
                let client = args.directory_cert.as_deref().zip(args.directory_key.as_deref());
                match agent::registry::Tls::load(ca, client) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        error!("{e}; not started");
                        std::process::exit(EXIT_CONFIG);
                    }
                }
            }
            None => None,
        };
        let endpoints = args.directory.urls_with(if tls.is_some() { "https" } else { "http" });
        let cfg = agent::registry::Config {
            endpoints,
            tls,
            ttl_s: args.directory_ttl,
            cluster_id: agent.key.cluster_id,
            node: node.clone(),
            describe: Box::new(move || agent::registry::describe(&name, health.advertised())),
            cares: {
                let a = agent.clone();
                Box::new(move || agent::status::cared_nodes(&a))
            },
            journal: agent.journal.clone(),
        };
        info!(
            "cluster directory in etcd at {} (lease {} s, {})",
            args.directory,
            args.directory_ttl,
            match (&args.directory_ca, &args.directory_cert) {
                (None, _) => "plain TCP: the records hold no secret, but anyone who reaches etcd can change them; see directory-ca".to_string(),
                (Some(ca), None) => format!("TLS, servers checked against {}", ca.display()),
                (Some(ca), Some(c)) => format!("TLS, servers checked against {}, client certificate {}", ca.display(), c.display()),
            }
        );
        if let Err(e) = agent::registry::start(cfg) {
            error!("{e}");
            std::process::exit(1);
        }
    }
    if let Metrics::At(m) = args.metrics {
        if let Err(e) = agent::metrics::serve(agent.clone(), m) {
            error!("{e} (`metrics` chooses another address, or off)");
            std::process::exit(1);
        }
    }
    if let Web::At(w) = args.web {
        if let Err(e) = agent::web::serve(agent.clone(), w, token) {
            error!("{e} (`web` chooses another address, or off)");
            std::process::exit(1);
        }
    }
    paths::run(agent.health.clone(), agent.events.clone(), udp);
    agent::sweep::run("/dev/shm".into(), Duration::from_millis(args.sweep_every));
    let a2 = agent.clone();
    std::thread::spawn(move || peer::serve(a2, tcp));
    for l in relink {
        let a = agent.clone();
        std::thread::spawn(move || peer::serve(a, l));
    }
    let status =
        format!("READY=1\nSTATUS=node {node}, local socket @{}, agents on port {}", args.socket, args.port);
    if let Err(e) = agent::notify::notify(&status) {
        warn!("cannot tell the service manager the agent is ready: {e} (NOTIFY_SOCKET)");
    }
    local::serve(agent, unix);
}
