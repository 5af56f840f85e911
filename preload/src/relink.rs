//! Failover: rebuilding a virtual connection's physical link over a network that works,
//! under the same descriptor number, with nothing lost, repeated or reordered.
//!
//! Each process with virtual connections runs one control thread. It keeps an *event
//! channel* open to the node agent (which connections this process holds; which network
//! paths died), and does the slow work so the program's threads only ever wait:
//!
//! * **Detection.** The agent says a path died (its probes went silent), or a program's call
//!   met an error on the physical socket (reset, timeout, unreachable) that the peer's layer
//!   did not announce as the program's own reset. Either way the link is marked down; calls
//!   on it then wait (blocking sockets) or return `EAGAIN` (non-blocking ones), for at most
//!   the grace period (`VMI_GRACE`), after which they fail with `ETIMEDOUT`.
//! * **Rebuild.** The side that connected dials the peer node's agent over a working path
//!   (the agent lists them) and says `Resume{gid, nonce}`; that agent hands the socket to the
//!   process holding the connection. Both sides prove they know the connection's secret
//!   ([`substrate::auth`]) and state how many bytes of the other's stream they delivered.
//! * **Install.** The old socket is disconnected (waking any thread blocked on it), the new
//!   one is put under every descriptor number of the connection with `dup3`, with the old
//!   one's file flags and socket options, and the program's epoll registrations are made
//!   again. Each side then replays what the other did not deliver from its replay ring, and
//!   the end of stream if the program had shut its side down.

use crate::fdtable::{self, OWN_EVENTS, OWN_WAKE};
use crate::shm::ConnMem;
use crate::shm_sink::ShmLink;
use crate::vc::Vc;
use crate::{agent, config, log, real, sys};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex};
use substrate::auth::{proofs_equal, resume_mac, Role};
use substrate::wire::agent::{addrs_bytes, Msg};
use substrate::wire::frame::FrameKind;

/// Internal error code: the link is down, wait for a new one (never reaches the program).
pub const LINK_DOWN: i32 = 0x7f00_0001;

/// Pid of the process whose control thread runs (0: none yet; another pid: a fork parent's).
static CONTROL_PID: AtomicI32 = AtomicI32::new(0);
static START: Mutex<()> = Mutex::new(());

/// 1 while some rebuilt link still has bytes to replay.
static REPLAYING: AtomicU32 = AtomicU32::new(0);

// ---------------------------------------------------------------------------------------------
// Link state shared with the data path

/// The physical socket failed with `e` (or the agent said its path died): mark the link
/// down and tell the control thread. True if it was up until now.
pub fn link_broken(mem: ConnMem, why: &str) -> bool {
    let c = mem.conn();
    if c.broken.load(Acquire) != 0 {
        return false;
    }
    if c.link_down.compare_exchange(0, 1, AcqRel, Acquire).is_ok() {
        c.down_since_ms.store(sys::now_ms(), Release);
        log::info(format_args!("virtual connection {:032x}: link lost ({why}); rebuilding it", c.gid));
        wake();
        return true;
    }
    false
}

/// True if `e` from the physical socket means the link (not the peer's program) failed.
pub fn is_link_error(e: i32) -> bool {
    matches!(
        e,
        libc::ECONNRESET
            | libc::EPIPE
            | libc::ETIMEDOUT
            | libc::EHOSTUNREACH
            | libc::ENETUNREACH
            | libc::ENETDOWN
            | libc::ECONNABORTED
            | libc::ENOTCONN
            | libc::EHOSTDOWN
    )
}

/// Waits (a blocking call) until the link is up again or the connection failed; the
/// connection's errno in the second case.
pub fn wait_link(vc: &Vc) -> Result<(), i32> {
    let c = vc.mem().conn();
    ensure_control();
    loop {
        let b = c.broken.load(Acquire);
        if b != 0 {
            return Err(b);
        }
        let gen = c.link_gen.load(Acquire);
        if c.link_down.load(Acquire) == 0 {
            return Ok(());
        }
        sys::futex_wait(&c.link_gen, gen, 200);
    }
}

// ---------------------------------------------------------------------------------------------
// epoll registrations

/// A registration of one of the program's descriptors with one of its epoll instances:
/// (epoll fd, fd, events, data).
pub type EpollReg = (i32, i32, u32, u64);

/// The epoll registrations of the sockets under `fds`, read from `/proc/self/fdinfo` (the
/// kernel lists every epoll instance's targets with their events, data and inode), so the
/// program's `epoll_ctl` calls cost nothing extra.
fn epoll_regs(fds: &[i32]) -> Vec<EpollReg> {
    let mut inos = Vec::new();
    for &fd in fds {
        // SAFETY: zeroed stat filled by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointer.
        if unsafe { libc::fstat(fd, &mut st) } == 0 {
            inos.push((fd, st.st_ino));
        }
    }
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return out };
    for e in dir.flatten() {
        let Some(epfd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if !std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:[eventpoll]") {
            continue;
        }
        let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{epfd}")) else { continue };
        for line in info.lines().filter(|l| l.starts_with("tfd:")) {
            let mut it = line.split_whitespace();
            let mut field = |name: &str| -> Option<String> {
                while let Some(k) = it.next() {
                    if k == name {
                        return it.next().map(str::to_string);
                    }
                    if let Some(v) = k.strip_prefix(name) {
                        return Some(v.to_string());
                    }
                }
                None
            };
            let tfd = field("tfd:").and_then(|v| v.parse::<i32>().ok());
            let events = field("events:").and_then(|v| u32::from_str_radix(&v, 16).ok());
            let data = field("data:").and_then(|v| u64::from_str_radix(&v, 16).ok());
            let ino = field("ino:").and_then(|v| u64::from_str_radix(&v, 16).ok());
            if let (Some(tfd), Some(events), Some(data)) = (tfd, events, data) {
                if inos.iter().any(|&(f, i)| f == tfd && ino.is_none_or(|x| x == i)) {
                    out.push((epfd, tfd, events, data));
                }
            }
        }
    }
    out
}

/// Takes the sockets under `fds` out of the program's epoll instances; returns what to
/// register again later.
fn epoll_detach(fds: &[i32]) -> Vec<EpollReg> {
    let regs = epoll_regs(fds);
    for r in &regs {
        // SAFETY: removes the old socket from the program's epoll instance.
        unsafe { real::epoll_ctl(r.0, libc::EPOLL_CTL_DEL, r.1, std::ptr::null_mut()) };
    }
    regs
}

/// Registers the descriptors again, with the program's events and data.
fn epoll_attach(regs: &[EpollReg]) {
    for &(epfd, fd, events, data) in regs {
        let mut ev = libc::epoll_event { events, u64: data };
        // SAFETY: registers the socket now under `fd` with the program's events and data.
        if unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
            log::warn(format_args!(
                "cannot register fd {fd} again with epoll fd {epfd}: errno {}",
                sys::errno()
            ));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The control thread

fn wake() {
    let fd = fdtable::own_fd(OWN_WAKE);
    if fd >= 0 {
        let one = 1u64;
        // SAFETY: an 8-byte write to our eventfd.
        unsafe { libc::write(fd, &one as *const u64 as *const _, 8) };
    }
}

/// Starts this process's control thread if it does not run yet (first connection, or the
/// first call in a forked child).
pub fn ensure_control() {
    let me = crate::pid();
    if CONTROL_PID.load(Acquire) == me {
        return;
    }
    let _g = START.lock().unwrap_or_else(|e| e.into_inner());
    if CONTROL_PID.load(Acquire) == me {
        return;
    }
    // A forked child inherited its parent's descriptors: close them, they are the parent's.
    for role in [OWN_EVENTS, OWN_WAKE] {
        let fd = fdtable::unprotect(role);
        if fd >= 0 {
            // SAFETY: our own descriptor (the child's copy).
            unsafe { real::close(fd) };
        }
    }
    // SAFETY: plain eventfd creation.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if efd >= 0 {
        fdtable::protect(OWN_WAKE, fdtable::move_high(efd));
    }
    let ok = std::thread::Builder::new()
        .name("vmi-control".into())
        .stack_size(256 << 10)
        .spawn(|| {
            let _ = std::panic::catch_unwind(control_loop);
        })
        .is_ok();
    if ok {
        CONTROL_PID.store(me, Release);
    } else {
        log::error(format_args!("cannot start the control thread: connections cannot fail over"));
    }
}

/// Partial writes by non-blocking senders so far (the rest of each frame waits in the ring).
static OWED: AtomicU64 = AtomicU64::new(0);

/// A non-blocking send left the rest of a frame in the ring. The program's next send usually
/// finishes it; if none comes, the control thread does, a few milliseconds later. (No system
/// call here: this happens on most writes of a sender that fills its socket.)
#[inline]
pub fn owed_later() {
    OWED.fetch_add(1, Relaxed);
}

/// Asks the control thread to look at the connections now (a Fin waits for a replay).
pub fn poke() {
    if REPLAYING.swap(1, Relaxed) == 0 {
        ensure_control();
        wake();
    }
}

/// A new connection in this process: tell the agent we hold it.
pub fn held(gid: u128, active: bool) {
    ensure_control();
    send_event(&Msg::Hold { gid, active });
}

/// This process let go of a connection.
pub fn released(gid: u128) {
    send_event(&Msg::Release { gid });
}

static EVT_WRITE: Mutex<()> = Mutex::new(());

type Guards = (std::sync::MutexGuard<'static, ()>, std::sync::MutexGuard<'static, ()>);

thread_local! {
    static FORK_GUARD: std::cell::RefCell<Option<Guards>> = const { std::cell::RefCell::new(None) };
}

/// fork, prepare: no thread of ours may hold one of these locks across the fork (the child
/// would find it locked forever).
pub fn before_fork() {
    let g = (
        START.lock().unwrap_or_else(|e| e.into_inner()),
        EVT_WRITE.lock().unwrap_or_else(|e| e.into_inner()),
    );
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// fork, parent and child: let go.
pub fn after_fork() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
}

fn send_event(m: &Msg) {
    let _g = EVT_WRITE.lock().unwrap_or_else(|e| e.into_inner());
    let fd = fdtable::own_fd(OWN_EVENTS);
    if fd >= 0 && !agent::write_all(fd, &m.encode(), None) {
        log::debug(format_args!("event channel write failed"));
    }
}

/// At exit: gives the socket of a closed connection to the agent, which keeps it until the
/// peer closes too. True if the agent took it.
pub fn hand_over_linger(gid: u128, fd: i32) -> bool {
    let _g = EVT_WRITE.lock().unwrap_or_else(|e| e.into_inner());
    let evt = fdtable::own_fd(OWN_EVENTS);
    evt >= 0 && agent::write_all(evt, &Msg::Linger { gid }.encode(), Some(fd))
}

fn open_events() -> Option<i32> {
    let fd = agent::open_socket(OWN_EVENTS)?;
    let _g = EVT_WRITE.lock().unwrap_or_else(|e| e.into_inner());
    if !agent::write_all(fd, &Msg::Events { pid: crate::pid() as u32 }.encode(), None) {
        return None;
    }
    for v in fdtable::distinct_vcs() {
        let c = v.mem().conn();
        if !agent::write_all(fd, &Msg::Hold { gid: c.gid, active: c.active != 0 }.encode(), None) {
            return None;
        }
    }
    Some(fd)
}

fn close_events() {
    let fd = fdtable::unprotect(OWN_EVENTS);
    if fd >= 0 {
        // SAFETY: our own socket.
        unsafe { real::close(fd) };
    }
}

/// Reads one message (and a descriptor riding with it) from the event channel.
fn read_event(fd: i32) -> Option<(Msg, Option<i32>)> {
    let mut pre = [0u8; 4];
    // (MSG_WAITALL gets the whole prefix.)
    let (r, passed) = sys::recv_with_fd(fd, &mut pre, libc::MSG_WAITALL);
    let close_passed = |p: Option<i32>| {
        if let Some(p) = p {
            // SAFETY: a descriptor we were passed and will not use.
            unsafe { real::close(p) };
        }
    };
    if r != 4 {
        close_passed(passed);
        return None;
    }
    let Ok(n) = Msg::body_len(pre) else {
        close_passed(passed);
        return None;
    };
    let mut body = vec![0u8; n];
    if !agent::read_exact(fd, &mut body) {
        close_passed(passed);
        return None;
    }
    match Msg::decode(&body) {
        Ok(m) => Some((m, passed)),
        Err(e) => {
            log::warn(format_args!("agent sent a malformed event: {e}"));
            close_passed(passed);
            None
        }
    }
}

/// Connections whose link is down, with when this process last tried to dial.
struct Pending {
    next_try_ms: u64,
}

/// Connections this side answers for (it did not dial them) whose path the agent says is
/// dead: when it last saw the peer's kernel acknowledge anything, and when it last asked.
struct Suspect {
    since_ms: u64,
    poked_ms: u64,
}

#[derive(Default)]
struct Work {
    pending: HashMap<u128, Pending>,
    suspects: HashMap<u128, Suspect>,
    owed_seen: u64,
    last_wire: HashMap<u128, u64>,
    /// Connections this side must dial whatever its role: the process was restored on
    /// another node, and only it knows where it is now.
    must_dial: std::collections::HashSet<u128>,
    /// A thaw whose report to `vmi-migrate` waits for the links to be rebuilt.
    thawing: Option<Thawing>,
}

/// The report owed to `vmi-migrate` after a thaw.
struct Thawing {
    fd: i32,
    since_ms: u64,
    moved: bool,
    conns: u32,
    to_rebuild: Vec<u128>,
    /// Links of `to_rebuild` that came back, counted when they did (the program may close
    /// some of them before the report goes out).
    rebuilt: std::collections::HashSet<u128>,
    replayed_before: u64,
}

// ---------------------------------------------------------------------------------------------
// Checkpoints (migration)

/// 1 from a `Freeze` until the thaw has looked at every link (a restored process's program
/// threads may run before that and must take a dead socket for a lost link, not an end).
pub static FROZEN: AtomicU32 = AtomicU32::new(0);

/// How long a frozen process waits for its thaw before it goes on by itself (a
/// `vmi-migrate` that died): 600 waits of 200 ms. Counted in waits, not by the clock, which
/// may jump when the process is restored on another machine.
const THAW_WAITS: u32 = 600;

/// The network namespace this process is in (its inode), to tell a restore elsewhere.
fn netns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).unwrap_or(0)
}

/// The abstract Unix name a frozen process waits for its thaw on (scoped by network
/// namespace, like the agent's): `<agent socket>-thaw-<pid>`.
pub fn thaw_name(agent_socket: &str, pid: i32) -> String {
    format!("{agent_socket}-thaw-{pid}")
}

/// A socket that is gone: restored closed by the checkpoint tool, or reset.
fn socket_dead(fd: i32) -> bool {
    sys::tcp_info(fd).is_none() || crate::tcp_sink::socket_gone(fd) || sys::peer_addr(fd).is_none()
}

/// The agent asks this process to get ready for a checkpoint: no Unix socket to the agent
/// may stay open (the checkpoint could not restore its other end), and a process killed
/// after its checkpoint must not end its connections (a reset, not a FIN, so that the
/// peers take it for a lost link and wait for the process to come back). Then wait for the
/// thaw: `vmi-migrate` connects to this process's thaw socket, here if the checkpoint
/// failed, on the new node if it was restored there.
fn freeze(w: &mut Work) {
    let pid = crate::pid();
    let closed =
        fdtable::distinct_vcs().iter().filter(|v| v.shm_now().is_some_and(|l| l.peer_closed())).count();
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
    for v in fdtable::distinct_vcs() {
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
    for v in fdtable::distinct_vcs() {
        if v.parked() >= 0 {
            continue;
        }
        for fd in fdtable::fds_of(&v).into_iter().take(1) {
            // SAFETY: zeroed linger is valid; valid pointers to locals.
            let mut l: libc::linger = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::linger>() as libc::socklen_t;
            // SAFETY: as above.
            if unsafe {
                libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, &mut l as *mut _ as *mut _, &mut len)
            } == 0
            {
                lingers.push((fd, l));
            }
            sys::set_linger(fd, libc::linger { l_onoff: 1, l_linger: 0 });
        }
    }
    let placeheld = crate::relisten::before_checkpoint();
    // The thaw socket first (so it exists before anyone is told we are ready).
    let name = thaw_name(agent::socket_name(), pid);
    // SAFETY: plain socket creation.
    let lfd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    let (sun, len) = agent::abstract_addr(&name);
    // SAFETY: binds and listens on our own socket.
    let listening = lfd >= 0
        && unsafe {
            libc::bind(lfd, &sun as *const _ as *const libc::sockaddr, len) == 0 && real::listen(lfd, 4) == 0
        };
    if !listening {
        log::warn(format_args!("cannot open the thaw socket ({}); not ready for a checkpoint", sys::errno()));
        if lfd >= 0 {
            // SAFETY: our socket.
            unsafe { real::close(lfd) };
        }
        restore_lingers(&lingers);
        let _ = crate::relisten::after_thaw(&placeheld);
        FROZEN.store(0, SeqCst);
        agent::wake_up();
        return;
    }
    let lfd = fdtable::move_high(lfd);
    send_event(&Msg::Ok);
    close_events();
    // Wait for the thaw.
    let mut conn = -1;
    for _ in 0..THAW_WAITS {
        if sys::wait_fd(lfd, libc::POLLIN, 200) & libc::POLLIN != 0 {
            // SAFETY: accept on our listening socket.
            let c =
                unsafe { libc::accept4(lfd, std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC) };
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
                    // SAFETY: our socket.
                    unsafe { real::close(c) };
                }
            }
        }
    }
    // SAFETY: our listening socket.
    unsafe { real::close(lfd) };
    if conn < 0 {
        log::warn(format_args!("no thaw after the checkpoint; going on"));
    }
    thaw(w, conn, &lingers, &placeheld, ns_before);
}

fn restore_lingers(lingers: &[(i32, libc::linger)]) {
    for &(fd, l) in lingers {
        sys::set_linger(fd, l);
    }
}

/// After the checkpoint: connections whose socket died (the process was restored, here or
/// elsewhere) are rebuilt, dialed from this side whatever its role; the others go on as
/// they were. Then the agent (the new node's, maybe) learns this process again.
fn thaw(
    w: &mut Work,
    conn: i32,
    lingers: &[(i32, libc::linger)],
    placeheld: &[(i32, SocketAddr)],
    ns_before: u64,
) {
    let mut moved = netns() != ns_before;
    let vcs = fdtable::distinct_vcs();
    for v in &vcs {
        let c = v.mem().conn();
        if c.broken.load(Acquire) != 0 {
            continue;
        }
        let Some(&fd) = fdtable::fds_of(v).first() else { continue };
        if c.link_down.load(Acquire) != 0 || socket_dead(fd) {
            moved |= c.link_down.load(Acquire) == 0;
        }
    }
    for v in &vcs {
        let c = v.mem().conn();
        if c.broken.load(Acquire) != 0 {
            continue;
        }
        let Some(&fd) = fdtable::fds_of(v).first() else { continue };
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
    let everywhere = crate::relisten::after_thaw(placeheld);
    FROZEN.store(0, SeqCst);
    agent::wake_up();
    for addr in everywhere {
        crate::setup::register_listener(addr);
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
fn report_thaw(w: &mut Work) {
    let Some(t) = &mut w.thawing else { return };
    let now = sys::now_ms();
    let elapsed = now.saturating_sub(t.since_ms);
    if !w.must_dial.is_empty() && elapsed < 20_000 {
        return;
    }
    for c in fdtable::distinct_vcs().iter().map(|v| v.mem().conn()) {
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
    // SAFETY: our socket.
    unsafe { real::close(t.fd) };
    w.thawing = None;
}

fn control_loop() {
    let mut next_connect = 0u64;
    let mut w = Work::default();
    loop {
        let now = sys::now_ms();
        let mut evt = fdtable::own_fd(OWN_EVENTS);
        if evt < 0 && now >= next_connect {
            match open_events() {
                Some(fd) => evt = fd,
                None => {
                    close_events();
                    next_connect = now + 500;
                }
            }
        }
        let wake_fd = fdtable::own_fd(OWN_WAKE);
        let mut pfds = [
            libc::pollfd { fd: evt, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: wake_fd, events: libc::POLLIN, revents: 0 },
        ];
        let owed = OWED.load(Relaxed);
        let timeout = if REPLAYING.load(Relaxed) != 0 {
            2
        } else if owed != w.owed_seen {
            w.owed_seen = owed;
            REPLAYING.store(1, Relaxed);
            5
        } else if w.pending.is_empty() && w.suspects.is_empty() {
            500
        } else {
            50
        };
        // SAFETY: two valid pollfds (negative fds are ignored by poll).
        unsafe { libc::poll(pfds.as_mut_ptr(), 2, timeout) };
        if pfds[1].revents != 0 {
            let mut v = 0u64;
            // SAFETY: drains our eventfd.
            unsafe { libc::read(wake_fd, &mut v as *mut u64 as *mut _, 8) };
        }
        if pfds[0].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            match read_event(evt) {
                Some((m, passed)) => on_event(m, passed, &mut w),
                None => {
                    log::info(format_args!("event channel to the node agent closed; reconnecting"));
                    close_events();
                    next_connect = sys::now_ms() + 200;
                }
            }
        }
        work(&mut w);
    }
}

fn find(gid: u128) -> Option<Arc<Vc>> {
    fdtable::distinct_vcs().into_iter().find(|v| v.mem().conn().gid == gid)
}

fn on_event(m: Msg, passed: Option<i32>, w: &mut Work) {
    match (m, passed) {
        (Msg::Path { local, peer, up: false }, _) => {
            for v in fdtable::distinct_vcs() {
                let c = v.mem().conn();
                // (Shared memory does not use the network.)
                if c.link_down.load(Acquire) != 0 || c.broken.load(Acquire) != 0 || v.shm_now().is_some() {
                    continue;
                }
                let Some(&fd) = fdtable::fds_of(&v).first() else { continue };
                let (Some(l), Some(p)) = (sys::local_addr(fd), sys::peer_addr(fd)) else { continue };
                if !(same_ip(l, local) && same_ip(p, peer)) {
                    continue;
                }
                if c.active != 0 {
                    link_broken(v.mem(), &format!("path {} -> {} died", local.ip(), peer.ip()));
                } else {
                    // The dialing side moves the link. If it cannot (its node lost every
                    // network), this side gives up after the grace period, unless the peer's
                    // kernel still acknowledges (the path is fine, only probes were lost).
                    let now = sys::now_ms();
                    w.suspects.entry(c.gid).or_insert(Suspect { since_ms: now, poked_ms: 0 });
                }
            }
        }
        (Msg::Path { up: true, .. }, _) => {
            // Try at once what waits for a network.
            for p in w.pending.values_mut() {
                p.next_try_ms = 0;
            }
            w.suspects.clear();
        }
        (Msg::Freeze { .. }, _) => freeze(w),
        (Msg::Move { gid, shm }, _) => move_conn(gid, shm),
        (Msg::Handover { gid, nonce }, Some(fd)) => {
            w.suspects.remove(&gid);
            answer(gid, nonce, fd)
        }
        (other, passed) => {
            if let Some(p) = passed {
                // SAFETY: a descriptor we did not ask for.
                unsafe { real::close(p) };
            }
            log::debug(format_args!("event ignored: {other:?}"));
        }
    }
}

/// The operator moves connection `gid` to shared memory or to TCP (`vmictl move`).
fn move_conn(gid: u128, shm: bool) {
    let Some(v) = find(gid) else { return };
    let c = v.mem().conn();
    c.pin_tcp.store(u32::from(!shm), Release);
    if !shm {
        if v.shm_now().is_some_and(|l| l.peer_closed()) {
            log::warn(format_args!(
                "virtual connection {gid:032x} stays on shared memory: the peer closed it (it ends there)"
            ));
            return;
        }
        move_off_shm(&v, "moving to TCP, as the operator asked");
        return;
    }
    if v.shm_now().is_some() || c.link_down.load(Acquire) != 0 || c.broken.load(Acquire) != 0 {
        return;
    }
    if !shm_wanted(&v) || !crate::shm_sink::same_node(&c.peer_agents()) {
        log::warn(format_args!(
            "virtual connection {gid:032x} stays on TCP: shared memory needs both ends on this node, \
             VMI_SHM=1 and the connection held by one process"
        ));
        return;
    }
    // A new link, negotiated again: shared memory, since both ends are here.
    link_broken(v.mem(), "moving to shared memory, as the operator asked");
    kick(&v);
}

/// Milliseconds since the socket last received an acknowledgement.
fn last_ack_ms(fd: i32) -> Option<u64> {
    sys::tcp_info(fd).map(|ti| ti.tcpi_last_ack_recv as u64)
}

/// A suspect connection's fate: alive again (the peer's kernel acknowledged something since
/// the path was declared dead), failed (silent for the grace period), or still waiting (an
/// ack frame is sent now and then so that a live peer has something to acknowledge).
fn check_suspect(v: &Vc, s: &mut Suspect, now: u64) -> bool {
    let c = v.mem().conn();
    let Some(&fd) = fdtable::fds_of(v).first() else { return true };
    if c.link_down.load(Acquire) != 0 || c.broken.load(Acquire) != 0 {
        return true;
    }
    let Some(quiet) = last_ack_ms(fd) else { return true };
    let age = now.saturating_sub(s.since_ms);
    if quiet < age.saturating_sub(50) {
        return true;
    }
    if age > config::grace_ms() {
        link_broken(v.mem(), "the peer's node stopped answering on every network");
        give_up(v, libc::ETIMEDOUT, "no network reached the peer within the grace period");
        return true;
    }
    if now.saturating_sub(s.poked_ms) >= 500 {
        s.poked_ms = now;
        crate::tcp_sink::send_control(v.mem(), v.slot(), fd, FrameKind::Ack);
    }
    false
}

fn same_ip(a: SocketAddr, b: SocketAddr) -> bool {
    let norm = |x: SocketAddr| match x.ip() {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map(std::net::IpAddr::V4).unwrap_or(x.ip()),
        ip => ip,
    };
    norm(a) == norm(b)
}

/// Dials, gives up after the grace period, for every connection whose link is down.
fn work(w: &mut Work) {
    let now = sys::now_ms();
    let mut seen = Vec::new();
    REPLAYING.store(0, Relaxed);
    for v in fdtable::distinct_vcs() {
        let c = v.mem().conn();
        if c.broken.load(Acquire) != 0 {
            continue;
        }
        if let Some(s) = w.suspects.get_mut(&c.gid) {
            if check_suspect(&v, s, now) {
                w.suspects.remove(&c.gid);
            }
        }
        if c.link_down.load(Acquire) == 0 {
            // A rebuilt link whose replay did not fit in the socket at once: keep pushing
            // it (the program may be waiting for an answer to bytes only the replay carries).
            // A program that keeps sending pushes it itself: only a connection whose send
            // position did not move since the last look is helped.
            // SAFETY: racy reads of plain integers, only to choose whether to look.
            let (owed, wire) = unsafe { ((*c.tx.get()).replaying(), (*c.tx.get()).wire_seq) };
            if owed || c.fin_owed.load(Acquire) != 0 {
                let moved = w.last_wire.insert(c.gid, wire) != Some(wire);
                if moved && c.fin_owed.load(Acquire) == 0 {
                    REPLAYING.store(1, Relaxed);
                } else if let (Some(_g), Some(&fd)) = (c.tx_lock.try_lock(), fdtable::fds_of(&v).first()) {
                    if !v.replay_now(fd) {
                        REPLAYING.store(1, Relaxed);
                    }
                } else {
                    REPLAYING.store(1, Relaxed);
                }
            } else {
                w.last_wire.remove(&c.gid);
            }
            continue;
        }
        seen.push(c.gid);
        if v.parked() < 0 && v.shm().is_some_and(|l| l.moving()) {
            // Leaving shared memory: the program's polls wait quietly on a placeholder
            // (the old socket, reset by the peer, would poll ready forever).
            kick(&v);
        }
        let since = c.down_since_ms.load(Acquire);
        if now.saturating_sub(since) > config::grace_ms() {
            give_up(&v, libc::ETIMEDOUT, "no network reached the peer within the grace period");
            continue;
        }
        if let Some(s) = v.slot() {
            s.set_relinking(true, false);
        }
        let p = w.pending.entry(c.gid).or_insert(Pending { next_try_ms: 0 });
        if (c.active != 0 || w.must_dial.contains(&c.gid)) && now >= p.next_try_ms {
            match dial(&v) {
                None => {
                    w.pending.remove(&c.gid);
                    w.must_dial.remove(&c.gid);
                    if let Some(t) = w.thawing.as_mut() {
                        let back = c.link_down.load(Acquire) == 0 && c.broken.load(Acquire) == 0;
                        if back && t.to_rebuild.contains(&c.gid) {
                            t.rebuilt.insert(c.gid);
                        }
                    }
                }
                Some(ms) => {
                    if let Some(p) = w.pending.get_mut(&c.gid) {
                        p.next_try_ms = sys::now_ms() + ms;
                    }
                }
            }
        }
    }
    w.pending.retain(|g, _| seen.contains(g));
    w.must_dial.retain(|g| seen.contains(g));
    report_thaw(w);
    let live: Vec<u128> = fdtable::distinct_vcs().iter().map(|v| v.mem().conn().gid).collect();
    w.suspects.retain(|g, _| live.contains(g));
    w.last_wire.retain(|g, _| live.contains(g));
}

/// The connection failed for good: every call reports `e` from now on.
fn give_up(v: &Vc, e: i32, why: &str) {
    let c = v.mem().conn();
    if c.broken.compare_exchange(0, e, AcqRel, Acquire).is_ok() {
        log::warn(format_args!("virtual connection {:032x}: {why}; the program sees errno {e}", c.gid));
        if let Some(s) = v.slot() {
            s.set_error(e);
            s.set_relinking(false, false);
        }
    }
    // Threads blocked on the old socket wake up, pollers see the descriptor ready, and every
    // call reports the failure.
    kick(v);
    unpark(v);
    epoll_attach(&v.take_epoll());
    c.link_gen.fetch_add(1, AcqRel);
    sys::futex_wake(&c.link_gen, i32::MAX);
}

// ---------------------------------------------------------------------------------------------
// Handshake

fn send_msg(fd: i32, m: &Msg) -> bool {
    agent::write_all(fd, &m.encode(), None)
}

fn recv_msg(fd: i32) -> Option<Msg> {
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
fn connect_to(local: SocketAddr, peer: SocketAddr, ms: i32) -> Option<i32> {
    let v6 = peer.is_ipv6();
    let fam = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    // SAFETY: plain socket creation.
    let fd = unsafe { libc::socket(fam, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return None;
    }
    let fail = |fd: i32| {
        // SAFETY: our socket.
        unsafe { real::close(fd) };
        None
    };
    if !local.ip().is_unspecified() && local.is_ipv6() == v6 {
        let (st, len) = sys::to_raw(&SocketAddr::new(local.ip(), 0), v6);
        // SAFETY: binds our own socket.
        if unsafe { libc::bind(fd, &st as *const _ as *const libc::sockaddr, len) } != 0 {
            return fail(fd);
        }
    }
    let (st, len) = sys::to_raw(&peer, v6);
    // SAFETY: connects our own socket.
    let r = unsafe { real::connect(fd, &st as *const _ as *const libc::sockaddr, len) };
    if r != 0 && sys::errno() != libc::EINPROGRESS {
        return fail(fd);
    }
    if r != 0 {
        if sys::wait_fd(fd, libc::POLLOUT, ms) & libc::POLLOUT == 0 {
            return fail(fd);
        }
        let mut err: i32 = 0;
        let mut l = 4 as libc::socklen_t;
        // SAFETY: valid pointers to locals.
        unsafe {
            libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ERROR, &mut err as *mut _ as *mut _, &mut l)
        };
        if err != 0 {
            return fail(fd);
        }
    }
    // Back to blocking, with time-outs, for the handshake.
    // SAFETY: F_SETFL with an integer argument.
    unsafe { real::fcntl(fd, libc::F_SETFL, 0) };
    sys::set_timeouts(fd, 1000);
    let one: i32 = 1;
    // SAFETY: valid pointer to a local int.
    unsafe { libc::setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, &one as *const _ as *const _, 4) };
    Some(fd)
}

/// Dials the peer node's agent over a working path and resumes. `None` when the link is up
/// again (or the connection was given up), else how long to wait before the next try.
fn dial(v: &Vc) -> Option<u64> {
    let c = v.mem().conn();
    let peers = c.peer_agents();
    if peers.is_empty() {
        give_up(v, libc::ECONNRESET, "the peer's node agent is unknown, the link cannot be rebuilt");
        return None;
    }
    let paths: Vec<(SocketAddr, SocketAddr)> = match agent::request(&Msg::Paths { peers: peers.clone() }) {
        Some(Msg::PathList { pairs }) => pairs,
        // No agent here: try every address of the peer's node.
        _ => peers.iter().map(|p| (SocketAddr::new(unspecified(p), 0), *p)).collect(),
    };
    for (local, peer) in paths {
        let Some(fd) = connect_to(local, peer, 500) else {
            log::debug(format_args!("resume {:032x}: cannot reach {peer} from {}", c.gid, local.ip()));
            continue;
        };
        match resume_as_dialer(v, fd) {
            Ok(()) => {
                log::info(format_args!(
                    "virtual connection {:032x}: link rebuilt from {} to {peer} after {} ms",
                    c.gid,
                    local.ip(),
                    sys::now_ms().saturating_sub(c.down_since_ms.load(Acquire))
                ));
                return None;
            }
            Err(Final(e, why)) => {
                // SAFETY: our socket.
                unsafe { real::close(fd) };
                give_up(v, e, &why);
                return None;
            }
            Err(Retry(why)) => {
                // SAFETY: our socket.
                unsafe { real::close(fd) };
                log::info(format_args!("resume {:032x} via {peer}: {why}", c.gid));
            }
            Err(Wait(why)) => {
                // SAFETY: our socket.
                unsafe { real::close(fd) };
                log::debug(format_args!("resume {:032x} via {peer}: {why}", c.gid));
                return Some(250);
            }
        }
    }
    Some(100)
}

/// Bytes replayed on rebuilt links, for the report after a migration.
static REPLAYED: AtomicU64 = AtomicU64::new(0);

fn note_replay(tx: &substrate::reliability::TxState, peer_delivered: u64) {
    REPLAYED.fetch_add(tx.next_seq.saturating_sub(peer_delivered), Relaxed);
}

fn unspecified(p: &SocketAddr) -> std::net::IpAddr {
    if p.is_ipv6() {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    }
}

enum Failure {
    /// The connection cannot be rebuilt: give it up with this errno.
    Final(i32, String),
    /// Try another path, or again soon.
    Retry(String),
    /// The peer is being moved to another node: it dials once it is there.
    Wait(String),
}
use Failure::{Final, Retry, Wait};

/// Error reason an agent gives for a connection whose process is being moved away.
pub const MOVED: &str = "moved";

/// Where this node's agent can be reached (what the other side of a rebuilt link must dial
/// next time); empty without an agent.
fn my_agents() -> Vec<SocketAddr> {
    match agent::request(&Msg::WhereAmI) {
        Some(Msg::Here { addrs }) => addrs,
        _ => Vec::new(),
    }
}

fn resume_as_dialer(v: &Vc, fd: i32) -> Result<(), Failure> {
    let c = v.mem().conn();
    let nonce_a = sys::random_u128();
    let mine = my_agents();
    if !send_msg(fd, &Msg::Resume { gid: c.gid, nonce: nonce_a, from_active: c.active != 0 }) {
        return Err(Retry("cannot send".into()));
    }
    let nonce_b = match recv_msg(fd) {
        Some(Msg::Challenge { nonce }) => nonce,
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
    // SAFETY: we hold both locks.
    let (tx, rx) = unsafe { (&mut *c.tx.get(), &mut *c.rx.get()) };
    let delivered_a = rx.delivered;
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
    if let Err(e) = tx.relink(delivered_b, delivered_a) {
        return Err(Final(libc::ECONNRESET, format!("the peer's stream position is impossible: {e}")));
    }
    note_replay(tx, delivered_b);
    rx.relink(delivered_b);
    c.set_peer_agents(&theirs);
    publish(v.mem(), tx, rx);
    if let Some(mut l) = offer {
        // The holder answers in the offer's header (and a bell) right after its Ready.
        l.set_bases((delivered_b, delivered_a));
        v.join_shm(l);
    }
    install(v, fd);
    Ok(())
}

/// Whether this side may put the connection on shared memory (the peer must be on this
/// node too): enabled, not pinned to TCP by the operator, and held by this process alone
/// (the memory is mapped by the process that sets it up).
fn shm_wanted(v: &Vc) -> bool {
    let c = v.mem().conn();
    config::shm() && c.pin_tcp.load(Acquire) == 0 && c.procs.load(Acquire) == 1
}

/// Moves a connection off shared memory now (a checkpoint, or the operator): the peer is
/// told, both sides' stream positions go to their TCP halves, and the link is rebuilt over
/// TCP (by the dialing side, as after any failure).
fn move_off_shm(v: &Vc, why: &str) {
    let Some(l) = v.shm_now() else { return };
    if let Some(&fd) = fdtable::fds_of(v).first() {
        l.set_moving(fd);
    }
    link_broken(v.mem(), why);
    kick(v);
    let c = v.mem().conn();
    let tx = c.tx_lock.lock();
    let rx = c.rx_lock.lock();
    let r = v.leave_shm();
    drop((rx, tx));
    if let Err(e) = r {
        give_up(v, libc::ECONNRESET, &format!("cannot leave shared memory: {e}"));
    }
}

/// The side that was connected to: a dialer reached our agent, which passed its socket.
fn answer(gid: u128, nonce_a: u128, fd: i32) {
    let close = |fd: i32| {
        // SAFETY: the socket we were passed.
        unsafe { real::close(fd) };
    };
    let from = sys::peer_addr(fd).map(|a| a.to_string()).unwrap_or_else(|| "?".into());
    let Some(v) = find(gid) else {
        let _ = send_msg(fd, &Msg::Error { reason: "no such connection".into() });
        close(fd);
        return;
    };
    let c = v.mem().conn();
    // SAFETY: F_SETFL with an integer argument.
    unsafe { real::fcntl(fd, libc::F_SETFL, 0) };
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
    // SAFETY: we hold both locks.
    let (tx, rx) = unsafe { (&mut *c.tx.get(), &mut *c.rx.get()) };
    let delivered_b = rx.delivered;
    if let Err(e) = tx.relink(delivered_a, delivered_b) {
        let _ = send_msg(fd, &Msg::Error { reason: "impossible stream position".into() });
        close(fd);
        drop((_rx, _tx));
        give_up(&v, libc::ECONNRESET, &format!("the peer's stream position is impossible: {e}"));
        return;
    }
    let mine = my_agents();
    let take = offered && shm_wanted(&v) && mine.iter().any(|a| theirs.contains(a));
    let mac_b = resume_mac(c.secret, Role::Holder, gid, nonce_a, nonce_b, delivered_b, &addrs_bytes(&mine));
    let ready = Msg::Ready { delivered: delivered_b, mac: mac_b, agents: mine, sent: tx.next_seq, shm: take };
    if !send_msg(fd, &ready) {
        // The dialer tries again (the states stay consistent: it replays from what we said).
        close(fd);
        return;
    }
    note_replay(tx, delivered_a);
    rx.relink(delivered_a);
    c.set_peer_agents(&theirs);
    publish(v.mem(), tx, rx);
    if take {
        // (A refusal is said in the offer's header and by one bell, before any frame.)
        if let Some(l) = ShmLink::accept(gid, c.secret, nonce_a, fd, true, (delivered_a, delivered_b)) {
            v.join_shm(l);
        }
    }
    install(&v, fd);
    log::info(format_args!(
        "virtual connection {gid:032x}: link rebuilt by the peer from {from} after {} ms",
        sys::now_ms().saturating_sub(c.down_since_ms.load(Acquire))
    ));
}

fn publish(mem: ConnMem, tx: &substrate::reliability::TxState, rx: &substrate::reliability::RxState) {
    let c = mem.conn();
    c.delivered.store(rx.delivered, Release);
    if rx.peer_ack > c.peer_ack.load(Relaxed) {
        c.peer_ack.store(rx.peer_ack, Release);
    }
    c.ack_sent.store(tx.ack_sent, Release);
    c.unacked.store(tx.unacked(), Relaxed);
}

// ---------------------------------------------------------------------------------------------
// Swapping the socket under the program's descriptors

/// Takes the old socket away from the program: its descriptors get a *placeholder* (a
/// listening socket on loopback, which never polls readable or writable, so `select` and
/// `poll` callers wait quietly instead of seeing the dead socket's error), its epoll
/// registrations are taken out, and the old socket is disconnected, which wakes any thread
/// blocked on it (that thread then waits for the new link, or says EAGAIN).
fn kick(v: &Vc) {
    if v.parked() >= 0 {
        return;
    }
    let fds = fdtable::fds_of(v);
    v.keep_epoll(epoll_detach(&fds));
    let Some(&fd0) = fds.first() else { return };
    // SAFETY: F_DUPFD_CLOEXEC with an integer argument: our own handle on the old socket.
    let old = unsafe { real::fcntl(fd0, libc::F_DUPFD_CLOEXEC, 700) };
    if let Some(ph) = placeholder(sys::tcp_family(fd0) == Some(libc::AF_INET6)) {
        // The program's settings wait on the placeholder (and change there if it sets any).
        carry_state(fd0, ph);
        put_under(ph, &fds);
        v.set_parked(ph);
    }
    let target = if old >= 0 { old } else { fd0 };
    // SAFETY: zeroed sockaddr with AF_UNSPEC: "disconnect" for TCP.
    let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
    sa.sa_family = libc::AF_UNSPEC as _;
    // SAFETY: valid pointer and length.
    unsafe { real::connect(target, &sa, std::mem::size_of::<libc::sockaddr>() as _) };
    if old >= 0 {
        // SAFETY: our own handle.
        unsafe { real::close(old) };
    }
}

/// Puts socket `sock` under each of the program's descriptor numbers `fds`, keeping each
/// number's close-on-exec flag.
/// Puts the new socket `sock` under the program's descriptor `fd` (same number, its epoll
/// registrations made again) and closes our copy.
pub fn swap_socket(sock: i32, fd: i32) {
    let regs = epoll_detach(&[fd]);
    put_under(sock, &[fd]);
    // SAFETY: our copy; `fd` now names the socket too.
    unsafe { real::close(sock) };
    epoll_attach(&regs);
}

fn put_under(sock: i32, fds: &[i32]) {
    for &fd in fds {
        // SAFETY: F_GETFD has no argument.
        let cloexec = unsafe { real::fcntl(fd, libc::F_GETFD, 0) } & libc::FD_CLOEXEC != 0;
        // SAFETY: replaces the program's descriptor with `sock` (same number).
        if unsafe { real::dup3(sock, fd, if cloexec { libc::O_CLOEXEC } else { 0 }) } < 0 {
            log::warn(format_args!("cannot put a socket under fd {fd}: errno {}", sys::errno()));
        }
    }
}

/// A socket that never polls readable or writable until it is shut down.
fn placeholder(v6: bool) -> Option<i32> {
    let fam = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    // SAFETY: plain socket creation.
    let fd = unsafe { libc::socket(fam, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    let lo: SocketAddr = if v6 { "[::1]:0".parse().ok()? } else { "127.0.0.1:0".parse().ok()? };
    let (st, len) = sys::to_raw(&lo, v6);
    // SAFETY: binds and listens on our own socket.
    let ok = unsafe {
        libc::bind(fd, &st as *const _ as *const libc::sockaddr, len) == 0 && real::listen(fd, 0) == 0
    };
    if !ok {
        // SAFETY: our socket.
        unsafe { real::close(fd) };
        return None;
    }
    Some(fdtable::move_high(fd))
}

/// Wakes whoever polls the placeholder (after the real socket took its place, or to show
/// the program a failed connection) and drops it.
fn unpark(v: &Vc) {
    let ph = v.set_parked(-1);
    if ph >= 0 {
        // SAFETY: our placeholder: shutting it down wakes its pollers, who look again at
        // the descriptor number (now the new socket).
        unsafe {
            real::shutdown(ph, libc::SHUT_RDWR);
            real::close(ph);
        }
    }
}

/// Socket options a program commonly sets, carried from the old socket to the new one.
const CARRIED: &[(i32, i32)] = &[
    (libc::IPPROTO_TCP, libc::TCP_NODELAY),
    (libc::SOL_SOCKET, libc::SO_KEEPALIVE),
    (libc::SOL_SOCKET, libc::SO_RCVTIMEO),
    (libc::SOL_SOCKET, libc::SO_SNDTIMEO),
    (libc::SOL_SOCKET, libc::SO_LINGER),
    (libc::SOL_SOCKET, libc::SO_PRIORITY),
    (libc::SOL_SOCKET, libc::SO_RCVLOWAT),
    (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
    (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL),
    (libc::IPPROTO_TCP, libc::TCP_KEEPCNT),
    (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
];

/// Copies what the program set on socket `from` (non-blocking mode, common options) to `to`.
fn carry_state(from: i32, to: i32) {
    for &(level, opt) in CARRIED {
        let mut buf = [0u8; 32];
        let mut len = buf.len() as libc::socklen_t;
        // SAFETY: valid buffer and length.
        if unsafe { libc::getsockopt(from, level, opt, buf.as_mut_ptr() as *mut _, &mut len) } == 0 {
            // SAFETY: the same bytes on the other socket.
            unsafe { libc::setsockopt(to, level, opt, buf.as_ptr() as *const _, len) };
        }
    }
    // SAFETY: F_GETFL/F_SETFL with integer arguments.
    unsafe {
        let fl = real::fcntl(from, libc::F_GETFL, 0);
        if fl >= 0 {
            real::fcntl(to, libc::F_SETFL, (fl & libc::O_NONBLOCK) as libc::c_ulong);
        }
    }
}

/// Puts the new socket `nfd` under every descriptor of `v` in this process. The caller
/// holds both halves' locks.
fn install(v: &Vc, nfd: i32) {
    let c = v.mem().conn();
    let fds = fdtable::fds_of(v);
    log::debug(format_args!(
        "virtual connection {:032x}: new link {:?} -> {:?} under fds {fds:?}",
        c.gid,
        sys::local_addr(nfd),
        sys::peer_addr(nfd)
    ));
    if let Some(&old) = fds.first() {
        // From the old socket, or the placeholder that took its options while it waited.
        carry_state(old, nfd);
    }
    put_under(nfd, &fds);
    // SAFETY: our copy; the program's descriptors keep the socket.
    unsafe { real::close(nfd) };
    unpark(v);
    epoll_attach(&v.take_epoll());
    if let Some(&fd) = fds.first() {
        if let (Some(s), Some(l), Some(p)) = (v.slot(), sys::local_addr(fd), sys::peer_addr(fd)) {
            s.set_link(&l, &p);
        }
        c.link_pid.store(crate::pid(), Release);
        c.link_fd.store(fd, Release);
    }
    finish(v);
}

/// The new link is in place: wake the waiters; replay what the peer did not deliver and the
/// end of stream if the program shut its side down.
fn finish(v: &Vc) {
    let c = v.mem().conn();
    c.link_down.store(0, Release);
    let gen = c.link_gen.fetch_add(1, AcqRel) + 1;
    v.seen_gen(gen);
    if let Some(s) = v.slot() {
        s.set_relinking(false, true);
    }
    sys::futex_wake(&c.link_gen, i32::MAX);
    if let Some(&fd) = fdtable::fds_of(v).first() {
        // The caller holds the tx lock: push the replay now (the program may be waiting
        // for an answer to bytes only the replay carries).
        // After the peer's end of stream the new socket must read as ended too.
        if crate::tcp_sink::peer_fin(v.mem()) {
            // SAFETY: shutdown of the receive side of the new socket.
            unsafe { real::shutdown(fd, libc::SHUT_RD) };
        }
        if c.tx_shut.load(Acquire) != 0 {
            // The program shut its side down: the new link says so too, after the replay.
            c.fin_owed.store(1, Release);
        }
        if !v.replay_now(fd) {
            REPLAYING.store(1, Relaxed);
            wake();
        }
    }
}

/// In a process sharing the connection (after fork) whose descriptors still name the old
/// socket: take the new link from the process that rebuilt it.
pub fn adopt(v: &Vc) {
    let c = v.mem().conn();
    let gen = c.link_gen.load(Acquire);
    let (pid, src) = (c.link_pid.load(Acquire), c.link_fd.load(Acquire));
    if pid <= 0 || pid == crate::pid() || src < 0 || c.link_down.load(Acquire) != 0 {
        v.seen_gen(gen);
        return;
    }
    // SAFETY: pidfd_open and pidfd_getfd take integers; failures are checked.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    let got = if pidfd >= 0 {
        // SAFETY: as above.
        let n = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, src, 0) } as i32;
        // SAFETY: our pidfd.
        unsafe { real::close(pidfd) };
        n
    } else {
        -1
    };
    if got < 0 {
        log::warn(format_args!(
            "virtual connection {:032x}: cannot take the rebuilt link from process {pid} (errno {}); this process loses it",
            c.gid,
            sys::errno()
        ));
        v.seen_gen(gen);
        return;
    }
    let fds = fdtable::fds_of(v);
    let regs = epoll_detach(&fds);
    put_under(got, &fds);
    // SAFETY: our copy.
    unsafe { real::close(got) };
    epoll_attach(&regs);
    v.seen_gen(gen);
}
