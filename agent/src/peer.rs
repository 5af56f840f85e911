//! Agent-to-agent traffic over TCP: the server that answers other nodes' agents, and a
//! client with one cached connection per remote node.

use crate::wire::{read_msg, write_msg};
use crate::{
    local::{Agent, Announce},
    net,
};
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;
use tracing::{debug, info, warn};

/// Error reason for a connection whose process is being moved away (the layer knows it).
pub const MOVED: &str = "moved";

/// Time allowed for reaching another node's agent.
pub const PEER_TIMEOUT: Duration = Duration::from_millis(500);

/// Connections to other nodes' agents.
#[derive(Default)]
pub struct PeerClient {
    conns: Mutex<HashMap<IpAddr, Arc<Mutex<Option<TcpStream>>>>>,
    down: Mutex<HashMap<IpAddr, Instant>>,
}

impl PeerClient {
    /// Sends `m` to the agent of the node at `ip` and returns its answer.
    pub fn ask(&self, ip: IpAddr, port: u16, m: &Msg) -> io::Result<Msg> {
        if let Some(t) = self.down.lock().unwrap_or_else(|e| e.into_inner()).get(&ip) {
            if t.elapsed() < Duration::from_secs(1) {
                return Err(io::Error::new(io::ErrorKind::NotConnected, "agent recently unreachable"));
            }
        }
        let slot = self.conns.lock().unwrap_or_else(|e| e.into_inner()).entry(ip).or_default().clone();
        let mut conn = slot.lock().unwrap_or_else(|e| e.into_inner());
        for attempt in 0..2 {
            if conn.is_none() {
                match TcpStream::connect_timeout(&SocketAddr::new(ip, port), PEER_TIMEOUT) {
                    Ok(s) => {
                        s.set_read_timeout(Some(Duration::from_secs(2)))?;
                        s.set_write_timeout(Some(Duration::from_secs(2)))?;
                        s.set_nodelay(true)?;
                        *conn = Some(s);
                    }
                    Err(e) => {
                        self.down.lock().unwrap_or_else(|e| e.into_inner()).insert(ip, Instant::now());
                        return Err(e);
                    }
                }
            }
            let s = conn.as_mut().expect("connected above");
            match write_msg(s, m).and_then(|_| read_msg(s)) {
                Ok(a) => return Ok(a),
                Err(e) => {
                    *conn = None;
                    if attempt == 1 {
                        return Err(e);
                    }
                    debug!("agent at {ip}: {e}; reconnecting");
                }
            }
        }
        unreachable!()
    }
}

/// Serves other nodes' agents on `listener`.
pub fn serve(agent: Arc<Agent>, listener: TcpListener) {
    for s in listener.incoming() {
        match s {
            Ok(s) => {
                let agent = agent.clone();
                std::thread::spawn(move || {
                    let peer = s.peer_addr().ok();
                    if let Err(e) = handle(&agent, s) {
                        if e.kind() != io::ErrorKind::UnexpectedEof {
                            info!("agent connection from {peer:?} closed: {e}");
                        }
                    }
                });
            }
            Err(e) => warn!("accepting an agent connection: {e}"),
        }
    }
}

fn handle(agent: &Agent, mut s: TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    loop {
        let m = match read_msg(&mut s) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                warn!("malformed message from agent {:?}: {e}; closing", s.peer_addr().ok());
                let _ = write_msg(&mut s, &Msg::Error { reason: e.to_string() });
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let answer = match m {
            Msg::Connect { src, dst, gid, secret, window, aim, agents } if net::is_local(dst.ip()) => {
                agent.expect_here(Announce { src, dst, gid, secret, window, aim, agents })
            }
            Msg::Connect { dst, .. } => Msg::Error { reason: format!("{dst} is not on this node") },
            Msg::Resume { gid, nonce, from_active } => {
                // A new link for a connection of this node: the process holding it takes the
                // socket and authenticates the dialer itself. (Both ends may live on this
                // node: the one being moved away no longer takes links.)
                if agent.events.handover(gid, nonce, from_active, s.as_raw_fd()) {
                    return Ok(());
                }
                if agent.events.is_moving(gid) {
                    // Its process is being moved to another node; it dials from there.
                    debug!("resume of {gid:032x}: its process is moving; the dialer waits");
                    Msg::Error { reason: MOVED.into() }
                } else {
                    info!(
                        "resume of {gid:032x} from {:?} refused: no process here holds it",
                        s.peer_addr().ok()
                    );
                    Msg::Error { reason: "no such connection".into() }
                }
            }
            other => Msg::Error { reason: format!("unexpected message from an agent: {other:?}") },
        };
        write_msg(&mut s, &answer)?;
    }
}
