//! Checkpoints (migration): getting a process ready for one (`Freeze`), and its thaw
//! afterwards, on the same node or on a new one.

use super::*;

/// 1 from a `Freeze` until the thaw has looked at every link (a restored process's program
/// threads may run before that and must take a dead socket for a lost link, not an end).
pub static FROZEN: AtomicU32 = AtomicU32::new(0);

/// How long a frozen process waits for its thaw before it goes on by itself (a
/// `vmi-migrate` that died): 600 waits of 200 ms. Counted in waits, not by the clock, which
/// may jump when the process is restored on another machine.
pub(super) const THAW_WAITS: u32 = 600;

/// The network namespace this process is in (its inode), to tell a restore elsewhere.
pub(super) fn netns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).unwrap_or(0)
}

/// The abstract Unix name a frozen process waits for its thaw on (scoped by network
/// namespace, like the agent's): `<agent socket>-thaw-<pid>`.
pub fn thaw_name(agent_socket: &str, pid: i32) -> String {
    format!("{agent_socket}-thaw-{pid}")
}

/// A socket that is gone: restored closed by the checkpoint tool, or reset.
pub(super) fn socket_dead(fd: i32) -> bool {
    sys::tcp_info(fd).is_none() || crate::tcp_sink::socket_gone(fd) || sys::peer_addr(fd).is_none()
}

/// The agent asks this process to get ready for a checkpoint: no Unix socket to the agent
/// may stay open (the checkpoint could not restore its other end), and a process killed
/// after its checkpoint must not end its connections (a reset, not a FIN, so that the
/// peers take it for a lost link and wait for the process to come back). Then wait for the
/// thaw: `vmi-migrate` connects to this process's thaw socket, here if the checkpoint
/// failed, on the new node if it was restored there.
pub(super) fn freeze(w: &mut Work) {
    let pid = crate::pid();
    // Tickets name this node's address: not used after the checkpoint, wherever that is.
    crate::tickets::forget();
    let closed =
        crate::vc::connections().iter().filter(|v| v.shm_now().is_some_and(|l| l.peer_closed())).count();
    if closed > 0 {
        // Their peers' programs closed them: no rebuilt link could carry what they wrote and
        // this program has not read yet.
        let reason = format!(
            "{closed} connection(s) over shared memory whose peer closed them are still being read; \
             try again once they end"
        );
        log::warn(format_args!("not ready for a checkpoint: {reason}"));
        send_event(&Msg::Error { reason });
        return;
    }
    // Memory mapped with a peer on this node cannot travel in the checkpoint: those
    // connections move to TCP first (their links are rebuilt after the thaw, wherever the
    // process is then, and come back to shared memory if the peer is on that node).
    for v in crate::vc::connections() {
        if v.shm_now().is_some() {
            move_off_shm(&v, "the process is being checkpointed; leaving shared memory");
        }
    }
    log::info(format_args!("getting ready for a checkpoint"));
    FROZEN.store(1, SeqCst);
    agent::quiesce();
    let ns_before = netns();
    // The program's own linger settings, given back if the process stays.
    let mut lingers: Vec<(i32, libc::linger)> = Vec::new();
    for v in crate::vc::connections() {
        if v.parked() >= 0 {
            continue;
        }
        for fd in crate::vc::fds_of(&v).into_iter().take(1) {
            if let Some(l) = sys::fd::linger_of(fd) {
                lingers.push((fd, l));
            }
            sys::set_linger(fd, libc::linger { l_onoff: 1, l_linger: 0 });
        }
    }
    let placeheld = crate::relink::relisten::before_checkpoint();
    // The thaw socket first (so it exists before anyone is told we are ready).
    let name = thaw_name(agent::socket_name(), pid);
    let lfd = sys::fd::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
    let listening =
        lfd >= 0 && sys::fd::bind(lfd, &agent::abstract_addr(&name)) == 0 && sys::fd::listen(lfd, 4) == 0;
    if !listening {
        log::warn(format_args!("cannot open the thaw socket ({}); not ready for a checkpoint", sys::errno()));
        if lfd >= 0 {
            crate::sys::fd::close(lfd);
        }
        restore_lingers(&lingers);
        let _ = crate::relink::relisten::after_thaw(&placeheld);
        FROZEN.store(0, SeqCst);
        agent::wake_up();
        return;
    }
    let lfd = crate::ownfd::move_high(lfd);
    // What is kept back for the event channel (holds of connections made with a ticket or
    // taken from the table, ends of streams, releases) goes to this agent before the answer:
    // it moves the connections it knows this process holds, and a peer dialing here during
    // the move is told to wait only for those (one it did not know of was refused, and its
    // peer's program saw a reset).
    flush_ended();
    flush_released();
    send_event(&Msg::Ok);
    close_events();
    // Wait for the thaw.
    let mut conn = -1;
    for _ in 0..THAW_WAITS {
        if sys::wait_fd(lfd, libc::POLLIN, 200) & libc::POLLIN != 0 {
            let c = sys::fd::accept4(lfd, libc::SOCK_CLOEXEC);
            if c < 0 {
                continue;
            }
            sys::set_timeouts(c, 1000);
            match recv_msg(c) {
                Some(Msg::Thaw { pid: p }) if p as i32 == pid => {
                    conn = c;
                    break;
                }
                other => {
                    log::warn(format_args!("thaw socket: unexpected {other:?}"));
                    crate::sys::fd::close(c);
                }
            }
        }
    }
    crate::sys::fd::close(lfd);
    if conn < 0 {
        log::warn(format_args!("no thaw after the checkpoint; going on"));
    }
    thaw(w, conn, &lingers, &placeheld, ns_before);
}

pub(super) fn restore_lingers(lingers: &[(i32, libc::linger)]) {
    for &(fd, l) in lingers {
        sys::set_linger(fd, l);
    }
}

/// After the checkpoint: connections whose socket died (the process was restored, here or
/// elsewhere) are rebuilt, dialed from this side whatever its role; the others go on as
/// they were. Then the agent (the new node's, maybe) learns this process again.
pub(super) fn thaw(
    w: &mut Work,
    conn: i32,
    lingers: &[(i32, libc::linger)],
    placeheld: &[(i32, SocketAddr)],
    ns_before: u64,
) {
    let mut moved = netns() != ns_before;
    let vcs = crate::vc::connections();
    for v in &vcs {
        let c = v.mem().conn();
        if c.broken.load(Acquire) != 0 {
            continue;
        }
        let Some(&fd) = crate::vc::fds_of(v).first() else { continue };
        if c.link_down.load(Acquire) != 0 || socket_dead(fd) {
            moved |= c.link_down.load(Acquire) == 0;
        }
    }
    for v in &vcs {
        let c = v.mem().conn();
        if c.broken.load(Acquire) != 0 {
            continue;
        }
        let Some(&fd) = crate::vc::fds_of(v).first() else { continue };
        if c.link_down.load(Acquire) == 0 && (moved || socket_dead(fd)) {
            link_broken(v.mem(), "the process was restored from a checkpoint");
        }
        if moved && c.link_down.load(Acquire) != 0 {
            w.must_dial.insert(c.gid);
            if let Some(p) = w.pending.get_mut(&c.gid) {
                p.next_try_ms = 0;
            }
        }
    }
    if !moved {
        restore_lingers(lingers);
    }
    let everywhere = crate::relink::relisten::after_thaw(placeheld);
    FROZEN.store(0, SeqCst);
    agent::wake_up();
    let socks = crate::vc::listeners();
    for addr in everywhere {
        let sock = socks.iter().find(|&&(_, a)| a == addr).map(|&(f, _)| f);
        agent::register_listener(addr, sock);
    }
    log::info(format_args!(
        "thawed {}: {} connections to rebuild",
        if moved { "after a restore" } else { "in place (no restore)" },
        w.must_dial.len()
    ));
    if conn >= 0 {
        w.thawing = Some(Thawing {
            fd: conn,
            since_ms: sys::now_ms(),
            moved,
            conns: vcs.len() as u32,
            to_rebuild: w.must_dial.iter().copied().collect(),
            rebuilt: Default::default(),
            replayed_before: REPLAYED.load(Relaxed),
        });
    }
}

/// Reports to `vmi-migrate` once every link that had to be rebuilt is (or after 20 s).
pub(super) fn report_thaw(w: &mut Work) {
    let Some(t) = &mut w.thawing else { return };
    let now = sys::now_ms();
    let elapsed = now.saturating_sub(t.since_ms);
    if !w.must_dial.is_empty() && elapsed < 20_000 {
        return;
    }
    for c in crate::vc::connections().iter().map(|v| v.mem().conn()) {
        if t.to_rebuild.contains(&c.gid) && c.link_down.load(Acquire) == 0 && c.broken.load(Acquire) == 0 {
            t.rebuilt.insert(c.gid);
        }
    }
    let m = Msg::Thawed {
        moved: t.moved,
        conns: t.conns,
        rebuilt: t.rebuilt.len() as u32,
        waiting: w.must_dial.len() as u32,
        replayed: REPLAYED.load(Relaxed).saturating_sub(t.replayed_before),
        ms: elapsed as u32,
    };
    let _ = send_msg(t.fd, &m);
    crate::sys::fd::close(t.fd);
    w.thawing = None;
}
