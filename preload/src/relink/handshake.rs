//! The resume handshake on a rebuilt link: dialing the peer node's agent, proving the
//! connection's secret, exchanging what each side delivered, and settling the substrate.

use super::*;

pub(super) fn send_msg(fd: i32, m: &Msg) -> bool {
    agent::write_all(fd, &m.encode(), None)
}

pub(super) fn recv_msg(fd: i32) -> Option<Msg> {
    let mut pre = [0u8; 4];
    if !agent::read_exact(fd, &mut pre) {
        return None;
    }
    let n = Msg::body_len(pre).ok()?;
    if n > 4096 {
        return None;
    }
    let mut body = vec![0u8; n];
    if !agent::read_exact(fd, &mut body) {
        return None;
    }
    Msg::decode(&body).ok()
}

/// Connects a new socket from `local` (IP; unspecified: any) to `peer`, within `ms`.
pub(super) fn connect_to(local: SocketAddr, peer: SocketAddr, ms: i32) -> Option<i32> {
    let v6 = peer.is_ipv6();
    let fam = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    let fd = sys::fd::socket(fam, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0);
    if fd < 0 {
        return None;
    }
    let fail = |fd: i32| {
        crate::sys::fd::close(fd);
        None
    };
    // The port is chosen at connect, not at bind: a bound port would be this socket's alone
    // toward every destination, and the links rebuilt at once would then be as many as the
    // ephemeral port range, not that many per peer agent port (see `relink_ports` in the
    // agent).
    if !local.ip().is_unspecified() && local.is_ipv6() == v6 {
        sys::set_sockopt_int(fd, libc::IPPROTO_IP, libc::IP_BIND_ADDRESS_NO_PORT, 1);
    }
    if !local.ip().is_unspecified()
        && local.is_ipv6() == v6
        && sys::fd::bind(fd, &sys::fd::RawAddr::ip(&SocketAddr::new(local.ip(), 0), v6)) != 0
    {
        return fail(fd);
    }
    let r = sys::fd::connect(fd, &sys::fd::RawAddr::ip(&peer, v6));
    if r != 0 && sys::errno() != libc::EINPROGRESS {
        if sys::errno() == libc::EADDRNOTAVAIL {
            ports_used_up(peer);
        }
        return fail(fd);
    }
    if r != 0 {
        if sys::wait_fd(fd, libc::POLLOUT, ms) & libc::POLLOUT == 0 {
            return fail(fd);
        }
        let mut err = [0u8; 4];
        let got = sys::fd::getsockopt_bytes(fd, libc::SOL_SOCKET, libc::SO_ERROR, &mut err);
        if got != Some(4) || i32::from_ne_bytes(err) != 0 {
            return fail(fd);
        }
    }
    // Back to blocking, with time-outs, for the handshake.
    sys::fd::fcntl(fd, libc::F_SETFL, 0);
    sys::set_timeouts(fd, 1000);
    sys::set_sockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
    Some(fd)
}

/// Every local port toward `peer` is taken: said once a minute, with what helps.
fn ports_used_up(peer: SocketAddr) {
    static SAID: AtomicU64 = AtomicU64::new(0);
    let now = sys::now_ms();
    let last = SAID.load(Relaxed);
    if (last == 0 || now.saturating_sub(last) >= 60_000)
        && SAID.compare_exchange(last, now, Relaxed, Relaxed).is_ok()
    {
        log::warn(format_args!(
            "no local port is free toward {peer} for rebuilt links (the ephemeral port range, net.ipv4.ip_local_port_range, is used up toward it): links wait for ports; more relink ports on the agents (vmi-agent --relink-ports) let more connections between two nodes move at once"
        ));
    }
}

/// Dials the peer node's agent over a working path and resumes. `None` when the link is up
/// again (or the connection was given up), else how long to wait before the next try.
pub(super) fn dial(v: &Vc) -> Option<u64> {
    let c = v.mem().conn();
    let peers = c.peer_agents();
    if peers.is_empty() {
        give_up(v, libc::ECONNRESET, "the peer's node agent is unknown, the link cannot be rebuilt");
        return None;
    }
    let paths: Vec<(SocketAddr, SocketAddr)> =
        match agent::request(&Msg::Paths { peers: peers.clone(), gid: c.gid }) {
            Some(Msg::PathList { pairs }) => pairs,
            // No agent here: try every address of the peer's node.
            _ => peers.iter().map(|p| (SocketAddr::new(unspecified(p), 0), *p)).collect(),
        };
    for (local, peer) in paths {
        let Some(fd) = connect_to(local, peer, 500) else {
            log::debug(format_args!("resume {:032x}: cannot reach {peer} from {}", c.gid, local.ip()));
            continue;
        };
        let at = ends(fd);
        match resume_as_dialer(v, fd) {
            Ok(replayed) => {
                report(v, at, replayed, true);
                return None;
            }
            Err(Final(e, why)) => {
                crate::sys::fd::close(fd);
                give_up(v, e, &why);
                return None;
            }
            Err(Retry(why)) => {
                crate::sys::fd::close(fd);
                log::info(format_args!("resume {:032x} via {peer}: {why}", c.gid));
            }
            Err(Wait(why)) => {
                crate::sys::fd::close(fd);
                log::debug(format_args!("resume {:032x} via {peer}: {why}", c.gid));
                return Some(250);
            }
            // (The socket went under the program's descriptors.)
            Err(Failure::Ended) => return None,
        }
    }
    Some(100)
}

/// Bytes replayed on rebuilt links, for the report after a migration.
pub(super) static REPLAYED: AtomicU64 = AtomicU64::new(0);

pub(super) fn note_replay(tx: &substrate::reliability::TxState, peer_delivered: u64) -> u64 {
    let n = tx.next_seq.saturating_sub(peer_delivered);
    REPLAYED.fetch_add(n, Relaxed);
    n
}

/// The two addresses of a link's socket (unspecified where the kernel does not say).
type Ends = (SocketAddr, SocketAddr);

fn ends(fd: i32) -> Ends {
    let unknown = || SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), 0);
    (sys::local_addr(fd).unwrap_or_else(unknown), sys::peer_addr(fd).unwrap_or_else(unknown))
}

/// A rebuilt link (with its socket's addresses `ends`): one log line, and the failover
/// told to the node's agent (its stall and what this side sends again), which records it as
/// an event and in its relink-time histogram.
fn report(v: &Vc, ends: Ends, replayed: u64, dialer: bool) {
    let c = v.mem().conn();
    let stall_ms = sys::now_ms().saturating_sub(c.down_since_ms.load(Acquire));
    let (local, peer) = ends;
    log::info(format_args!(
        "virtual connection {:032x}: link rebuilt {} {peer} from {local} after {stall_ms} ms, {replayed} bytes sent again",
        c.gid,
        if dialer { "to" } else { "by the peer at" },
    ));
    super::send_event(&Msg::Relinked {
        gid: c.gid,
        stall_ms: stall_ms.min(u32::MAX as u64) as u32,
        replayed,
        dialer,
        local,
        peer,
    });
}

pub(super) fn unspecified(p: &SocketAddr) -> std::net::IpAddr {
    if p.is_ipv6() {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    }
}

pub(super) enum Failure {
    /// The connection cannot be rebuilt: give it up with this errno.
    Final(i32, String),
    /// The peer's process is gone after its program ended its stream, and every byte of it
    /// was delivered here: the connection reads its end from now on (done, nothing to
    /// report).
    Ended,
    /// Try another path, or again soon.
    Retry(String),
    /// The peer is being moved to another node: it dials once it is there.
    Wait(String),
}
use Failure::{Final, Retry, Wait};

/// The peer's agent answered a resume with the end of the peer's stream (`at` bytes, proof
/// `mac`): no process there holds the connection any more. With the proof right and every
/// byte before the end delivered, the end is all that was lost (the peer's kernel reset the
/// socket it was in when its process left): the program reads the end of stream, as
/// natively after the peer's FIN, and what it sends goes nowhere (EPIPE, as natively to a
/// peer that closed). Bytes missing before the end: a reset, as before.
fn peer_ended(v: &Vc, fd: i32, at: u64, from_active: bool, mac: u128) -> Failure {
    let c = v.mem().conn();
    if !proofs_equal(mac, substrate::auth::ended_mac(c.secret, c.gid, at, from_active)) {
        log::warn(format_args!(
            "virtual connection {:032x}: an end of stream for it failed its proof (not made with the connection's secret); ignored",
            c.gid
        ));
        return Retry("an end of stream without a valid proof".into());
    }
    kick(v);
    let _tx = c.tx_lock.lock();
    let _rx = c.rx_lock.lock();
    if let Err(e) = v.leave_shm() {
        return Final(libc::ECONNRESET, format!("cannot leave shared memory: {e}"));
    }
    let delivered = c.with_rx_held(|rx| rx.delivered);
    if delivered != at {
        return Final(
            libc::ECONNRESET,
            format!(
                "the peer's process is gone; its stream had ended after {at} bytes, of which {} never arrived",
                at.saturating_sub(delivered)
            ),
        );
    }
    let done = c.with_tx_held(|tx| {
        c.with_rx_held(|rx| {
            // Nothing of ours is read there any more: nothing to send again.
            let sent = tx.next_seq;
            tx.relink(sent, delivered).ok()?;
            rx.relink(sent);
            rx.fin = 1;
            publish(v.mem(), tx, rx);
            Some(())
        })
    });
    if done.is_none() {
        return Final(libc::ECONNRESET, "the stream's state does not allow its end here".into());
    }
    // What this side sends from now on meets a closed socket: an error, never another
    // rebuild.
    c.peer_eof.store(1, Release);
    log::info(format_args!(
        "virtual connection {:032x}: the peer's process is gone after ending its stream ({at} bytes, all delivered): the program reads the end",
        c.gid
    ));
    // The agent's socket, which it closed after its answer, reads as ended.
    install(v, fd);
    Failure::Ended
}

/// Error reason an agent gives for a connection whose process is being moved away.
pub const MOVED: &str = "moved";

/// Where this node's agent can be reached (what the other side of a rebuilt link must dial
/// next time); empty without an agent.
pub(super) fn my_agents() -> Vec<SocketAddr> {
    match agent::request(&Msg::WhereAmI) {
        Some(Msg::Here { addrs }) => addrs,
        _ => Vec::new(),
    }
}

pub(super) fn resume_as_dialer(v: &Vc, fd: i32) -> Result<u64, Failure> {
    let c = v.mem().conn();
    let nonce_a = sys::random_u128();
    let mine = my_agents();
    if !send_msg(fd, &Msg::Resume { gid: c.gid, nonce: nonce_a, from_active: c.active != 0 }) {
        return Err(Retry("cannot send".into()));
    }
    let nonce_b = match recv_msg(fd) {
        Some(Msg::Challenge { nonce }) => nonce,
        Some(Msg::Ended { gid, at, from_active, mac }) if gid == c.gid && from_active != (c.active != 0) => {
            return Err(peer_ended(v, fd, at, from_active, mac));
        }
        Some(Msg::Error { reason }) if reason == MOVED => {
            return Err(Wait("the peer is moving to another node; it will dial".into()))
        }
        Some(Msg::Error { reason }) => {
            return Err(Final(libc::ECONNRESET, format!("the peer's node no longer has it ({reason})")))
        }
        other => return Err(Retry(format!("no challenge ({other:?})"))),
    };
    // From here the old link is dead for good: freeze both halves.
    kick(v);
    let _tx = c.tx_lock.lock();
    let _rx = c.rx_lock.lock();
    if let Err(e) = v.leave_shm() {
        return Err(Final(libc::ECONNRESET, format!("cannot leave shared memory: {e}")));
    }
    let delivered_a = c.with_rx_held(|rx| rx.delivered);
    // Both ends on this node: offer shared memory for the new link.
    let mut offer = (shm_wanted(v) && mine.iter().any(|a| c.peer_agents().contains(a)))
        .then(|| ShmLink::offer(c.gid, c.secret, nonce_a, (0, 0)))
        .flatten();
    let mac = resume_mac(c.secret, Role::Dialer, c.gid, nonce_a, nonce_b, delivered_a, &addrs_bytes(&mine));
    let proof = Msg::Proof { delivered: delivered_a, mac, agents: mine, shm: offer.is_some() };
    if !send_msg(fd, &proof) {
        return Err(Retry("cannot send the proof".into()));
    }
    let (delivered_b, theirs) = match recv_msg(fd) {
        Some(Msg::Ready { delivered, mac, agents, sent, shm }) => {
            if !shm {
                offer = None;
            }
            let want =
                resume_mac(c.secret, Role::Holder, c.gid, nonce_a, nonce_b, delivered, &addrs_bytes(&agents));
            if !proofs_equal(mac, want) {
                log::warn(format_args!(
                    "resume of virtual connection {:032x} refused: the answering side does not know the secret",
                    c.gid
                ));
                return Err(Retry("bad proof from the holder".into()));
            }
            // What the holder replays (for reports).
            REPLAYED.fetch_add(sent.saturating_sub(delivered_a), Relaxed);
            (delivered, agents)
        }
        Some(Msg::Error { reason }) => return Err(Retry(format!("refused: {reason}"))),
        other => return Err(Retry(format!("no answer to the proof ({other:?})"))),
    };
    let replayed = c.with_tx_held(|tx| {
        c.with_rx_held(|rx| {
            tx.relink(delivered_b, delivered_a).map_err(|e| {
                Final(libc::ECONNRESET, format!("the peer's stream position is impossible: {e}"))
            })?;
            let n = note_replay(tx, delivered_b);
            rx.relink(delivered_b);
            publish(v.mem(), tx, rx);
            Ok(n)
        })
    })?;
    c.set_peer_agents(&theirs);
    if let Some(mut l) = offer {
        // The holder answers in the offer's header (and a bell) right after its Ready.
        l.set_bases((delivered_b, delivered_a));
        v.join_shm(l);
    }
    install(v, fd);
    Ok(replayed)
}

/// Whether this side may put the connection on shared memory (the peer must be on this
/// node too): enabled, not pinned to TCP by the operator, and held by this process alone
/// (the memory is mapped by the process that sets it up).
pub(super) fn shm_wanted(v: &Vc) -> bool {
    let c = v.mem().conn();
    config::shm() && c.pin_tcp.load(Acquire) == 0 && c.procs.load(Acquire) == 1
}

/// Moves a connection off shared memory now (a checkpoint, or the operator): the peer is
/// told, both sides' stream positions go to their TCP halves, and the link is rebuilt over
/// TCP (by the dialing side, as after any failure).
pub(super) fn move_off_shm(v: &Vc, why: &str) {
    let Some(l) = v.shm_now() else { return };
    if let Some(&fd) = crate::vc::fds_of(v).first() {
        l.set_moving(fd);
    }
    link_broken(v.mem(), why);
    // The locks first, then the old socket's swap (`kick`): the threads of ours that hold a
    // lock here sleep on the rings' bells and futexes, which `set_moving` just rang. Swapped
    // first, a receiver asleep on the socket missed the bell about one move in three and slept
    // out its 200 ms with the receive lock held, and the move with it. (After a failure on
    // TCP the order is the other way round: there a thread may be blocked in the kernel on
    // the old socket, and only the swap frees it.)
    let c = v.mem().conn();
    let tx = c.tx_lock.lock();
    let rx = c.rx_lock.lock();
    kick(v);
    let r = v.leave_shm();
    drop((rx, tx));
    if let Err(e) = r {
        give_up(v, libc::ECONNRESET, &format!("cannot leave shared memory: {e}"));
    }
}

/// The side that was connected to: a dialer reached our agent, which passed its socket.
pub(super) fn answer(gid: u128, nonce_a: u128, fd: i32) {
    let close = |fd: i32| {
        crate::sys::fd::close(fd);
    };
    let from = sys::peer_addr(fd).map(|a| a.to_string()).unwrap_or_else(|| "?".into());
    let Some(v) = crate::vc::by_gid(gid) else {
        let _ = send_msg(fd, &Msg::Error { reason: "no such connection".into() });
        close(fd);
        return;
    };
    let c = v.mem().conn();
    sys::fd::fcntl(fd, libc::F_SETFL, 0);
    sys::set_timeouts(fd, 1000);
    let nonce_b = sys::random_u128();
    if !send_msg(fd, &Msg::Challenge { nonce: nonce_b }) {
        close(fd);
        return;
    }
    let (delivered_a, mac, theirs, offered) = match recv_msg(fd) {
        Some(Msg::Proof { delivered, mac, agents, shm }) => (delivered, mac, agents, shm),
        other => {
            log::warn(format_args!(
                "resume of virtual connection {gid:032x} from {from} refused: no proof ({other:?})"
            ));
            close(fd);
            return;
        }
    };
    let want = resume_mac(c.secret, Role::Dialer, gid, nonce_a, nonce_b, delivered_a, &addrs_bytes(&theirs));
    if !proofs_equal(mac, want) {
        log::warn(format_args!(
            "resume of virtual connection {gid:032x} from {from} refused: wrong proof of the secret"
        ));
        let _ = send_msg(fd, &Msg::Error { reason: "refused".into() });
        close(fd);
        return;
    }
    link_broken(v.mem(), &format!("the peer rebuilds it from {from}"));
    kick(&v);
    let _tx = c.tx_lock.lock();
    let _rx = c.rx_lock.lock();
    if let Err(e) = v.leave_shm() {
        let _ = send_msg(fd, &Msg::Error { reason: "cannot leave shared memory".into() });
        close(fd);
        drop((_rx, _tx));
        give_up(&v, libc::ECONNRESET, &format!("cannot leave shared memory: {e}"));
        return;
    }
    let delivered_b = c.with_rx_held(|rx| rx.delivered);
    let sent = match c.with_tx_held(|tx| tx.relink(delivered_a, delivered_b).map(|_| tx.next_seq)) {
        Ok(sent) => sent,
        Err(e) => {
            let _ = send_msg(fd, &Msg::Error { reason: "impossible stream position".into() });
            close(fd);
            drop((_rx, _tx));
            give_up(&v, libc::ECONNRESET, &format!("the peer's stream position is impossible: {e}"));
            return;
        }
    };
    let mine = my_agents();
    let take = offered && shm_wanted(&v) && mine.iter().any(|a| theirs.contains(a));
    let mac_b = resume_mac(c.secret, Role::Holder, gid, nonce_a, nonce_b, delivered_b, &addrs_bytes(&mine));
    let ready = Msg::Ready { delivered: delivered_b, mac: mac_b, agents: mine, sent, shm: take };
    if !send_msg(fd, &ready) {
        // The dialer tries again (the states stay consistent: it replays from what we said).
        close(fd);
        return;
    }
    let replayed = c.with_tx_held(|tx| {
        c.with_rx_held(|rx| {
            let n = note_replay(tx, delivered_a);
            rx.relink(delivered_a);
            publish(v.mem(), tx, rx);
            n
        })
    });
    // The dialer may live on a node this node's agent has not heard of (its process was
    // restored there): the agent starts probing it, so that its paths, `vmictl where` and
    // the cluster view know where the connection lives now.
    let _ = agent::request(&Msg::Paths { peers: theirs.clone(), gid: 0 });
    c.set_peer_agents(&theirs);
    if take {
        // (A refusal is said in the offer's header and by one bell, before any frame.)
        if let Some(l) = ShmLink::accept(gid, c.secret, nonce_a, fd, true, (delivered_a, delivered_b)) {
            v.join_shm(l);
        }
    }
    report(&v, ends(fd), replayed, false);
    install(&v, fd);
}

pub(super) fn publish(
    mem: ConnMem,
    tx: &substrate::reliability::TxState,
    rx: &substrate::reliability::RxState,
) {
    let c = mem.conn();
    c.delivered.store(rx.delivered, Release);
    if rx.peer_ack > c.peer_ack.load(Relaxed) {
        c.peer_ack.store(rx.peer_ack, Release);
    }
    c.ack_sent.store(tx.ack_sent, Release);
    c.ack_tagged.store(tx.ack_tagged, Release);
    c.unacked.store(tx.unacked(), Relaxed);
}
