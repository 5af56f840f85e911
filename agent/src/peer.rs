//! Agent-to-agent traffic over TCP: the server that answers other nodes' agents, and a
//! client with one cached channel per remote node. Agents speak only through channels
//! authenticated and encrypted with the cluster key ([`crate::mesh`]); the same port takes
//! the layers' own dials that rebuild a link (`Resume`, in clear, proven by the connection's
//! secret), and nothing else in clear.

use crate::mesh::{Channel, ClusterKey, Refused, HANDSHAKE_TIMEOUT, MESH_MAGIC};
use crate::wire::{read_msg, read_msg_limited, write_msg};
use crate::{
    events::Events,
    local::{Agent, Announce},
    net,
};
use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;
use tracing::{debug, info, warn};

/// Error reason for a connection whose process is being moved away (the layer knows it).
pub const MOVED: &str = "moved";

/// Largest message taken in clear (a `Resume` is about 40 bytes).
const CLEAR_MAX: usize = 1024;

/// Time allowed for reaching another node's agent.
pub const PEER_TIMEOUT: Duration = Duration::from_millis(500);

/// Time an answer from another node's agent may take, at most (a new channel included).
pub const ASK_BUDGET: Duration = Duration::from_secs(4);

/// Time the agent gives another node's agent to answer a program's `connect` (the program
/// waits meanwhile; the layer waits up to [`substrate::wire::agent::CONNECT_WAIT_MS`]).
pub const CONNECT_BUDGET: Duration = Duration::from_millis(2000);

/// The same over a path the heartbeats call dead (no other network reaching the node).
pub const CONNECT_BUDGET_DEAD: Duration = Duration::from_millis(700);

/// Channels to other nodes' agents.
pub struct PeerClient {
    key: ClusterKey,
    conns: Mutex<HashMap<IpAddr, Arc<Mutex<Option<Channel>>>>>,
    down: Mutex<HashMap<IpAddr, Instant>>,
    /// How many channels were opened to each node so far: what went over an earlier one
    /// (a subscription) is not known to the agent at the end of the current one, which may
    /// have restarted.
    gens: Mutex<HashMap<IpAddr, u64>>,
}

impl PeerClient {
    /// A client of the agents that share `key`.
    pub fn new(key: ClusterKey) -> Self {
        PeerClient { key, conns: Mutex::default(), down: Mutex::default(), gens: Mutex::default() }
    }

    /// Sends `m` to the agent of the node at `ip` and returns its answer.
    pub fn ask(&self, ip: IpAddr, port: u16, m: &Msg) -> io::Result<Msg> {
        self.ask_within(ip, port, m, ASK_BUDGET)
    }

    /// As [`PeerClient::ask`], giving up once `budget` has passed (a new channel's dial and
    /// handshake included): for a program's `connect`, which waits for the answer.
    pub fn ask_within(&self, ip: IpAddr, port: u16, m: &Msg, budget: Duration) -> io::Result<Msg> {
        let deadline = Instant::now() + budget;
        let left = || {
            let d = deadline.saturating_duration_since(Instant::now());
            if d.is_zero() {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no answer within {} ms", budget.as_millis()),
                ))
            } else {
                Ok(d)
            }
        };
        if let Some(t) = self.down.lock().unwrap_or_else(|e| e.into_inner()).get(&ip) {
            if t.elapsed() < Duration::from_secs(1) {
                return Err(io::Error::new(io::ErrorKind::NotConnected, "agent recently unreachable"));
            }
        }
        let slot = self.conns.lock().unwrap_or_else(|e| e.into_inner()).entry(ip).or_default().clone();
        let mut conn = slot.lock().unwrap_or_else(|e| e.into_inner());
        for attempt in 0..2 {
            if conn.is_none() {
                let opened = left()
                    .and_then(|d| TcpStream::connect_timeout(&SocketAddr::new(ip, port), d.min(PEER_TIMEOUT)))
                    .and_then(|s| {
                        let d = left()?;
                        s.set_read_timeout(Some(d))?;
                        s.set_write_timeout(Some(d))?;
                        s.set_nodelay(true)?;
                        Channel::dial(s, &self.key)
                    });
                match opened {
                    Ok(c) => {
                        *conn = Some(c);
                        *self.gens.lock().unwrap_or_else(|e| e.into_inner()).entry(ip).or_default() += 1;
                    }
                    Err(e) => {
                        if e.kind() == io::ErrorKind::PermissionDenied {
                            warn!(
                                "agent at {ip}:{port} is not of this cluster: {e}; programs here connect to its node over plain TCP (compare the cluster key's fingerprint in `vmictl status` on both nodes)"
                            );
                        }
                        self.down.lock().unwrap_or_else(|e| e.into_inner()).insert(ip, Instant::now());
                        return Err(e);
                    }
                }
            }
            let s = conn.as_mut().expect("connected above");
            let timed = left().and_then(|d| {
                s.stream().set_read_timeout(Some(d))?;
                s.stream().set_write_timeout(Some(d))
            });
            match timed.and_then(|_| write_msg(s, m)).and_then(|_| read_msg(s)) {
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

impl PeerClient {
    /// Which channel to the node at `ip` is the current one (see [`PeerClient::tell`]).
    pub fn generation(&self, ip: IpAddr) -> u64 {
        self.gens.lock().unwrap_or_else(|e| e.into_inner()).get(&ip).copied().unwrap_or(0)
    }

    /// Sends `m`, which is not answered, to the agent of the node at `ip` on the channel of
    /// generation `gen` (the one a subscription was made on). Fails, sending nothing, when
    /// that channel is gone or its other end closed it (that agent restarted, say): the
    /// caller asks instead.
    pub fn tell(&self, ip: IpAddr, m: &Msg, gen: u64) -> io::Result<()> {
        let gone = || io::Error::new(io::ErrorKind::NotConnected, "the channel of the subscription is gone");
        let slot = self.conns.lock().unwrap_or_else(|e| e.into_inner()).get(&ip).cloned().ok_or_else(gone)?;
        let mut conn = slot.lock().unwrap_or_else(|e| e.into_inner());
        if self.generation(ip) != gen {
            return Err(gone());
        }
        let c = conn.as_mut().ok_or_else(gone)?;
        // Nothing is ever sent unasked on this channel: readable means closed or reset.
        let mut p = libc::pollfd { fd: c.stream().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut p, 1, 0) } != 0 {
            *conn = None;
            return Err(gone());
        }
        write_msg(c, m).inspect_err(|_| *conn = None)
    }

    /// Sends `m` once on a channel of its own and waits up to `wait` for the answer: for a
    /// command that must not run twice (a migration) and may take long. Never retried.
    pub fn ask_once(&self, ip: IpAddr, port: u16, m: &Msg, wait: Duration) -> io::Result<Msg> {
        let s = TcpStream::connect_timeout(&SocketAddr::new(ip, port), PEER_TIMEOUT)?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.set_write_timeout(Some(Duration::from_secs(2)))?;
        s.set_nodelay(true)?;
        let mut c = Channel::dial(s, &self.key)?;
        write_msg(&mut c, m)?;
        c.stream().set_read_timeout(Some(wait))?;
        read_msg(&mut c)
    }
}

/// An address for log lines (`?` when the socket had none).
fn show(a: Option<SocketAddr>) -> String {
    a.map_or_else(|| "?".into(), |a| a.to_string())
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
                            info!("agent connection from {} closed: {e}", show(peer));
                        }
                    }
                });
            }
            Err(e) => warn!("accepting an agent connection: {e} (too many open files? see LimitNOFILE)"),
        }
    }
}

fn handle(agent: &Agent, mut s: TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    let from = s.peer_addr().ok();
    // Whoever does not speak within the time-out is dropped (a stranger holding
    // connections open must not hold threads for ever).
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut first = [0u8; 4];
    s.read_exact(&mut first)?;
    if first == MESH_MAGIC {
        let mut c = match Channel::answer(s, &agent.key) {
            Ok(c) => c,
            Err(e) => {
                agent.refusals.note(Refused::Channel, || {
                    format!("agent channel from {}: {e}; it does not hold this cluster's key", show(from))
                });
                return Ok(());
            }
        };
        c.stream().set_read_timeout(None)?;
        return serve_agent(agent, &mut c, from);
    }
    let first = read_msg_limited(first, &mut s, CLEAR_MAX);
    s.set_read_timeout(None)?;
    serve_link(agent, s, first, from)
}

/// Serves another agent of the cluster on its channel.
fn serve_agent(agent: &Agent, c: &mut Channel, from: Option<SocketAddr>) -> io::Result<()> {
    loop {
        let m = match read_msg(c) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                warn!(
                    "agent channel from {}: {e}; closing it (the agent there may run another version of vmi)",
                    show(from)
                );
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let answer = match m {
            Msg::Connect { src, dst, gid, secret, window, aim, agents } if net::is_local(dst.ip()) => {
                agent.expect_here(Announce { src, dst, gid, secret, window, aim, agents })
            }
            Msg::Connect { dst, .. } => Msg::Error { reason: format!("{dst} is not on this node") },
            Msg::Bound { ports } => {
                agent.bound(ports);
                Msg::Ok
            }
            Msg::Subscribe { listener, first_port, ports } if net::is_local(listener.ip()) => {
                agent.subscribed(listener, from.map(|f| f.ip()), (first_port, ports))
            }
            Msg::Expect { src, dst, gid, secret, window, aim, agents } => {
                // Not answered: the sender does not wait.
                agent.expect_told(
                    Announce { src, dst, gid, secret, window, aim, agents },
                    from.map(|f| f.ip()),
                );
                continue;
            }
            Msg::Expects { dst, window, agents, entries } => {
                // Not answered, as `Expect`.
                agent.expect_batch(dst, window, agents, entries, from.map(|f| f.ip()));
                continue;
            }
            Msg::Unlisten { addr } => {
                agent.unsubscribed(addr, from.map(|f| f.ip()));
                Msg::Ok
            }
            Msg::AsUser { uid, cmd } => crate::cluster::as_user(agent, uid, &cmd),
            other => Msg::Error { reason: format!("unexpected message from an agent: {}", other.name()) },
        };
        write_msg(c, &answer)?;
    }
}

/// Serves a dial in clear: only a layer's `Resume` (a new link of a connection) is taken.
fn serve_link(
    agent: &Agent,
    mut s: TcpStream,
    first: io::Result<Msg>,
    from: Option<SocketAddr>,
) -> io::Result<()> {
    let mut next = Some(first);
    loop {
        let m = match next.take().unwrap_or_else(|| {
            let mut pre = [0u8; 4];
            s.read_exact(&mut pre)?;
            read_msg_limited(pre, &mut s, CLEAR_MAX)
        }) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                warn!(
                    "malformed message in clear from {}: {e}; closing (only agents and the layer's link rebuilds may talk to this port)",
                    show(from)
                );
                let _ = write_msg(&mut s, &Msg::Error { reason: e.to_string() });
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let answer = match m {
            Msg::Resume { gid, nonce, from_active } => {
                // A new link for a connection of this node: the process holding it takes the
                // socket and authenticates the dialer itself. (Both ends may live on this
                // node: the one being moved away no longer takes links.)
                match resume(&agent.events, gid, nonce, from_active, s.as_raw_fd()) {
                    Resumed::Handed => return Ok(()),
                    Resumed::Moving => {
                        // Its process is being moved to another node; it dials from there.
                        debug!("resume of {gid:032x}: its process is moving; the dialer waits");
                        Msg::Error { reason: MOVED.into() }
                    }
                    Resumed::Nobody => match agent.events.ended(gid, !from_active) {
                        Some((at, mac)) => {
                            // The process is gone, but its program had ended its stream: the
                            // dialer, which has the secret, checks the proof and reads the
                            // end if it has every byte before it. Nothing more comes here.
                            info!(
                                "connection {gid:032x}: new link from {}: no process here holds it any more, and its stream had ended after {at} bytes; the other end is told so",
                                show(s.peer_addr().ok())
                            );
                            let _ =
                                write_msg(&mut s, &Msg::Ended { gid, at, from_active: !from_active, mac });
                            let _ = s.shutdown(std::net::Shutdown::Both);
                            return Ok(());
                        }
                        None => {
                            info!(
                                "connection {gid:032x}: new link from {} refused: no process on this node holds the connection (it closed, or its process exited); the other end's calls will fail",
                                show(s.peer_addr().ok())
                            );
                            Msg::Error { reason: "no such connection".into() }
                        }
                    },
                }
            }
            other => {
                agent.refusals.note(Refused::Clear, || {
                    format!(
                        "a {} message in clear from {}: agents speak only through the cluster's channel",
                        other.name(),
                        show(from)
                    )
                });
                let _ =
                    write_msg(&mut s, &Msg::Error { reason: "refused: not an agent of this cluster".into() });
                return Ok(());
            }
        };
        write_msg(&mut s, &answer)?;
    }
}

/// How long a resume for a connection no process here holds waits for one to say it does,
/// before the dialer hears "no such connection" (which resets the connection for good). A
/// process says which connections it holds on its event channel, and a forked child or a new
/// image after exec opens its own channel a moment after its parent let go of theirs. The
/// dialer waits a second for the answer.
pub const HOLDER_GRACE: Duration = Duration::from_millis(500);

#[derive(Debug, PartialEq)]
enum Resumed {
    Handed,
    Moving,
    Nobody,
}

fn resume(events: &Events, gid: u128, nonce: u128, from_active: bool, fd: std::os::fd::RawFd) -> Resumed {
    let deadline = Instant::now() + HOLDER_GRACE;
    loop {
        if events.handover(gid, nonce, from_active, fd) {
            return Resumed::Handed;
        }
        if events.is_moving(gid) {
            return Resumed::Moving;
        }
        if Instant::now() >= deadline {
            return Resumed::Nobody;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::read_msg_fd;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    /// A process's event channel to `events`, served on a thread.
    fn channel(events: &Arc<Events>, id: u64, pid: u32) -> UnixStream {
        let (process, agent) = UnixStream::pair().unwrap();
        let e = events.clone();
        std::thread::spawn(move || e.serve(id, pid, agent));
        process
    }

    #[test]
    fn a_resume_waits_for_a_holder_that_speaks_up_late() {
        let events = Arc::new(Events::default());
        let mut child = channel(&events, 1, 100);
        let gid = 0x5eed_u128;
        let link = UnixStream::pair().unwrap().0;
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            child.write_all(&Msg::Hold { gid, active: false }.encode()).unwrap();
            child
        });
        let t = Instant::now();
        assert_eq!(resume(&events, gid, 7, true, link.as_raw_fd()), Resumed::Handed);
        assert!(t.elapsed() >= Duration::from_millis(100), "handed before the holder spoke");
        let child = late.join().unwrap();
        let (m, fd) = read_msg_fd(child.as_raw_fd()).unwrap();
        assert_eq!(m, Msg::Handover { gid, nonce: 7 });
        assert!(fd.is_some(), "the link's socket rides with the hand-over");
    }

    #[test]
    fn a_connection_set_up_before_the_event_channel_opened_is_held_by_it() {
        let events = Arc::new(Events::default());
        // The agent answered the process's first connect; its channel opens afterwards.
        events.hold(3, 200, 0xabc, true);
        // Another process's early hold, whose request socket closes before its channel opens.
        events.hold(4, 201, 0xdef, false);
        events.client_gone(4);
        let process = channel(&events, 1, 200);
        let _other = channel(&events, 2, 201);
        let link = UnixStream::pair().unwrap().0;
        assert_eq!(resume(&events, 0xabc, 5, false, link.as_raw_fd()), Resumed::Handed);
        let (m, fd) = read_msg_fd(process.as_raw_fd()).unwrap();
        assert_eq!(m, Msg::Handover { gid: 0xabc, nonce: 5 });
        assert!(fd.is_some());
        assert_eq!(resume(&events, 0xdef, 6, true, link.as_raw_fd()), Resumed::Nobody);
    }

    #[test]
    fn a_resume_nobody_holds_is_refused_after_the_grace() {
        let events = Arc::new(Events::default());
        let mut other = channel(&events, 1, 100);
        // Held, but by the dialing side's role: not a holder for this resume.
        other.write_all(&Msg::Hold { gid: 9, active: true }.encode()).unwrap();
        let link = UnixStream::pair().unwrap().0;
        let t = Instant::now();
        assert_eq!(resume(&events, 9, 1, true, link.as_raw_fd()), Resumed::Nobody);
        assert!(t.elapsed() >= HOLDER_GRACE);
        assert!(t.elapsed() < HOLDER_GRACE * 3);
    }
}
