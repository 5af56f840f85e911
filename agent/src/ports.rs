//! Source ports that come after the announcement. A layer announces a connection before
//! `connect` without its source port (the kernel picks the port at `connect`, per
//! destination) and sends the port right after (`Msg::Bound`). The port goes to the agent
//! that holds the announcement: this node's, or the agent this one asked at `Connect` (and
//! from there on, if that agent passed the announcement to the node a listener moved to).
//! Ports for the same agent go together, on a channel of their own, from one thread that
//! never holds up a layer.

use crate::mesh::ClusterKey;
use crate::peer::PeerClient;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Mutex;
use std::time::Instant;
use substrate::wire::agent::Msg;
use tracing::debug;

use crate::directory::UNBOUND_TTL;

/// Where each announcement this agent passed on went, and the thread that sends ports there.
pub struct Ports {
    routes: Mutex<Routes>,
    tx: Mutex<Sender<(SocketAddr, u128, SocketAddr)>>,
}

#[derive(Default)]
struct Routes {
    to: HashMap<u128, (SocketAddr, Instant)>,
    swept: Option<Instant>,
}

impl Ports {
    /// Starts the sending thread, with channels of its own to the agents of `key`.
    pub fn new(key: ClusterKey) -> Self {
        let (tx, rx) = mpsc::channel();
        let peers = PeerClient::new(key);
        let spawned =
            std::thread::Builder::new().name("vmi-ports".into()).spawn(move || send_loop(&peers, &rx));
        if let Err(e) = spawned {
            tracing::warn!("cannot start the thread that passes source ports on: {e}");
        }
        Ports { routes: Mutex::default(), tx: Mutex::new(tx) }
    }

    /// The announcement of `gid` went to the agent at `agent`.
    pub fn route(&self, gid: u128, agent: SocketAddr) {
        let now = Instant::now();
        let mut r = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        if r.swept.is_none_or(|t| now.saturating_duration_since(t) > UNBOUND_TTL) {
            r.to.retain(|_, (_, at)| now.saturating_duration_since(*at) < UNBOUND_TTL);
            r.swept = Some(now);
        }
        r.to.insert(gid, (agent, now));
    }

    /// `gid`'s source is `src` (port 0: the connect failed): passed to the agent its
    /// announcement went to. False if it went nowhere from here.
    pub fn pass_on(&self, gid: u128, src: SocketAddr) -> bool {
        let to = self.routes.lock().unwrap_or_else(|e| e.into_inner()).to.remove(&gid);
        match to {
            Some((agent, _)) => {
                let _ = self.tx.lock().unwrap_or_else(|e| e.into_inner()).send((agent, gid, src));
                true
            }
            None => false,
        }
    }
}

fn send_loop(peers: &PeerClient, rx: &Receiver<(SocketAddr, u128, SocketAddr)>) {
    while let Ok(first) = rx.recv() {
        let mut by_agent: HashMap<SocketAddr, Vec<(u128, SocketAddr)>> = HashMap::new();
        for (agent, gid, src) in std::iter::once(first).chain(rx.try_iter()) {
            by_agent.entry(agent).or_default().push((gid, src));
        }
        for (agent, ports) in by_agent {
            let n = ports.len();
            match peers.ask(agent.ip(), agent.port(), &Msg::Bound { ports }) {
                Ok(Msg::Ok) => {}
                Ok(other) => debug!("agent at {agent} answered {} to {n} source ports", other.name()),
                Err(e) => debug!("cannot pass {n} source ports to the agent at {agent}: {e}"),
            }
        }
    }
}
