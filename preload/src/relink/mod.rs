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
//!
//! Here: the control thread and its event channel (the link state the data path writes is
//! `crate::linkstate`, below). `handshake`: the resume handshake. `swap`: putting the new
//! socket under the program's descriptors (with `crate::sockswap`, which also carries the
//! program's epoll registrations across the swap). `freeze`: checkpoints.

use crate::linkstate;
use crate::linkstate::{attention, wake, ALIVE, CONTROL_PID, OWED, REPLAYING};
use crate::linkstate::{control_running, link_broken, SHM_LATER_DUE, SHM_LATER_MS};
use crate::ownfd::{OWN_EVENTS, OWN_WAKE};
use crate::shm::ConnMem;
use crate::shm_sink::ShmLink;
use crate::vc::Vc;
use crate::{agent, config, log, sys};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex};
use substrate::auth::{proofs_equal, resume_mac, Role};
use substrate::wire::agent::{addrs_bytes, Msg};

mod freeze;
mod handshake;
pub mod relisten;
mod swap;

pub(crate) use crate::sockswap::put_under;
use freeze::*;
pub use freeze::{thaw_name, FROZEN};
pub use handshake::MOVED;
use handshake::*;
use swap::*;

static START: Mutex<()> = Mutex::new(());

// ---------------------------------------------------------------------------------------------
// Link state shared with the data path

// ---------------------------------------------------------------------------------------------
// The control thread

/// The control thread stopped for good (a sandbox forbids its work, or its calls fail in a way
/// that cannot heal): it is not started again in this process.
static RETIRED: AtomicBool = AtomicBool::new(false);
/// Asks the control thread to stop for good.
static RETIRE: AtomicBool = AtomicBool::new(false);
/// Stops the control thread for good and waits (at most 2 s) until it is out of its work:
/// a filter is about to forbid what it does.
pub fn retire_control() {
    RETIRED.store(true, Release);
    if !control_running() {
        return;
    }
    RETIRE.store(true, Release);
    wake();
    let deadline = sys::now_ms() + 2_000;
    while ALIVE.load(Acquire) && sys::now_ms() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
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
    if RETIRED.load(Acquire) {
        return;
    }
    if !crate::sandbox::may_spawn() {
        RETIRED.store(true, Release);
        log::info(format_args!(
            "the sandbox forbids what a control thread needs: connections keep working, without failover"
        ));
        return;
    }
    // (A forked child closed its parent's wake descriptor in `after_fork_child`.)
    let old = crate::ownfd::unprotect(OWN_WAKE);
    if old >= 0 {
        crate::sys::fd::close(old);
    }
    let efd = sys::fd::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
    if efd >= 0 {
        crate::ownfd::protect(OWN_WAKE, crate::ownfd::move_high(efd));
    }
    let clean = crate::sandbox::spawn_is_clean();
    crate::lifetime::open_status();
    ALIVE.store(true, Release);
    crate::lifetime::layer_thread(true);
    let ok = std::thread::Builder::new()
        .name("vmi-control".into())
        .stack_size(256 << 10)
        .spawn(move || {
            crate::sandbox::layer_thread(clean);
            let end = std::panic::catch_unwind(control_loop).unwrap_or(Ending::Normally);
            crate::lifetime::layer_thread(false);
            ALIVE.store(false, Release);
            if end == Ending::Bare {
                crate::lifetime::exit_thread_bare();
            }
        })
        .is_ok();
    if ok {
        CONTROL_PID.store(me, Release);
    } else {
        ALIVE.store(false, Release);
        crate::lifetime::layer_thread(false);
        log::error(format_args!("cannot start the control thread: connections cannot fail over"));
    }
}

/// A new connection in this process, set up by the agent (which therefore knows this
/// process holds it): the control thread must run to take its rebuilt links.
pub fn held() {
    ensure_control();
}

/// Connections this process let go of for good, not told to the agent yet.
static RELEASED: Mutex<Vec<(u128, bool)>> = Mutex::new(Vec::new());

/// This process let go of a connection. If other processes hold it too (after fork), the
/// agent hears it now: a link rebuilt for it must go to one of them. Otherwise nobody holds
/// it any more and there is no hurry: the control thread tells the agent with what else is
/// kept back, within [`ENDED_DELAY_MS`], many at once; a link offered here meanwhile is
/// answered "no such connection", which is the truth.
pub fn released(gid: u128, active: bool, others_hold: bool) {
    if others_hold && crate::sandbox::allows_nr(libc::SYS_sendmsg) {
        // (What is kept back goes first: a hold must never arrive after its release.)
        flush_ended();
        send_event(&Msg::ReleaseSide { gid, active });
        return;
    }
    let mut r = RELEASED.lock().unwrap_or_else(|e| e.into_inner());
    r.push((gid, active));
    if !crate::sandbox::allows_nr(libc::SYS_sendmsg) {
        // The control thread tells the agent.
        drop(r);
        wake();
        return;
    }
    if r.len() >= 1024 {
        let all = std::mem::take(&mut *r);
        drop(r);
        flush_ended();
        tell_released(all);
    } else if r.len() == 1 {
        drop(r);
        // Told with what is kept back, when that is due (set now if nothing is).
        if ENDED_DUE.compare_exchange(0, sys::now_ms() + ENDED_DELAY_MS, Relaxed, Relaxed).is_ok() {
            crate::linkstate::wake_for_ends();
        }
    }
}

/// Tells the agent what `released` kept back.
fn flush_released() {
    let all = std::mem::take(&mut *RELEASED.lock().unwrap_or_else(|e| e.into_inner()));
    if !all.is_empty() {
        tell_released(all);
    }
}

fn tell_released(ends: Vec<(u128, bool)>) {
    let mut buf = Vec::with_capacity(ends.len() * 26);
    for (gid, active) in ends {
        buf.extend_from_slice(&Msg::ReleaseSide { gid, active }.encode());
    }
    send_events(&buf);
}

static EVT_WRITE: Mutex<()> = Mutex::new(());

type Guards = (
    std::sync::MutexGuard<'static, ()>,
    std::sync::MutexGuard<'static, ()>,
    std::sync::MutexGuard<'static, Vec<(u128, bool)>>,
    std::sync::MutexGuard<'static, Vec<u8>>,
);

thread_local! {
    static FORK_GUARD: std::cell::RefCell<Option<Guards>> = const { std::cell::RefCell::new(None) };
}

/// fork, prepare: no thread of ours may hold one of these locks across the fork (the child
/// would find it locked forever).
pub fn before_fork() {
    let g = (
        START.lock().unwrap_or_else(|e| e.into_inner()),
        EVT_WRITE.lock().unwrap_or_else(|e| e.into_inner()),
        RELEASED.lock().unwrap_or_else(|e| e.into_inner()),
        ENDED.lock().unwrap_or_else(|e| e.into_inner()),
    );
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// fork, parent and child: let go.
pub fn after_fork() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
}

/// fork, child side: the event channel and the wake descriptor are the parent's. Anything the
/// child said on that channel would be taken for the parent's word (a child closing its copy
/// of a connection would tell the agent the parent let go of it).
pub fn after_fork_child() {
    // Nor does the parent's control thread run here, and what it let go of is its own word.
    ALIVE.store(false, SeqCst);
    RETIRE.store(false, SeqCst);
    IN_WORK.store(false, SeqCst);
    EXECING.store(0, SeqCst);
    RELEASED.lock().unwrap_or_else(|e| e.into_inner()).clear();
    // (The parent tells them.)
    ENDED.lock().unwrap_or_else(|e| e.into_inner()).clear();
    for role in [OWN_EVENTS, OWN_WAKE] {
        let fd = crate::ownfd::unprotect(role);
        if fd >= 0 {
            crate::sys::fd::close(fd);
        }
    }
}

/// A forked child that inherited connections: tell the agent at once that it holds them,
/// before the program runs on (its parent may close its copies right away, and a link rebuilt
/// from the other side must then find this process), and start the control thread that takes
/// such links.
pub fn forked_child() {
    if crate::ownfd::own_fd(OWN_EVENTS) < 0 && open_events().is_none() {
        // No agent (or it is restarting): the control thread tries again.
        close_events();
    }
    ensure_control();
}

fn send_event(m: &Msg) {
    send_events(&m.encode());
}

/// Writes encoded messages on the event channel, whole.
fn send_events(buf: &[u8]) {
    let _g = EVT_WRITE.lock().unwrap_or_else(|e| e.into_inner());
    let fd = crate::ownfd::own_fd(OWN_EVENTS);
    if fd >= 0 && !agent::write_all(fd, buf, None) {
        log::debug(format_args!("event channel write failed"));
    }
}

/// The program ended the stream it sends on `v` (its end is queued after its last byte):
/// the agent keeps the stream's length with a proof made with the connection's secret. If
/// this process is gone when the peer rebuilds a link (it left with `_exit` and its kernel
/// reset the socket, the end still in it), the agent answers with that instead of "no such
/// connection", and the peer's program reads the end of stream after the last byte instead
/// of a reset. (Over shared memory the end travels in the ring: nothing to keep.)
pub fn ended(v: &Vc) {
    if v.shm_now().is_some() {
        return;
    }
    let c = v.mem().conn();
    let at = {
        let mut g = c.tx_lock.lock();
        c.with_tx(&mut g, |tx| tx.next_seq)
    };
    let from_active = c.active != 0;
    let mac = substrate::auth::ended_mac(c.secret, c.gid, at, from_active);
    keep_back(&Msg::Ended { gid: c.gid, at, from_active, mac }.encode());
}

/// This process holds a connection from now on, the agent not told yet: one made with a
/// ticket (`Msg::Used`) or taken from the table of announced connections
/// (`Msg::Accepted`). Told on the event channel within [`ENDED_DELAY_MS`], with everything
/// else kept back (ends of streams, other holds): one wake-up of the agent for all of them,
/// where one message per connection woke it once per connection. (Releases are told after
/// what is kept back, never before: the agent must see a hold before its release.)
pub fn hold_later(m: &Msg) {
    keep_back(&m.encode());
}

/// Keeps encoded messages for the event channel back until [`ENDED_DUE`] (set by the first).
fn keep_back(m: &[u8]) {
    let mut e = ENDED.lock().unwrap_or_else(|e| e.into_inner());
    let first = e.is_empty();
    e.extend_from_slice(m);
    if e.len() >= ENDED_MAX {
        let all = std::mem::take(&mut *e);
        drop(e);
        send_events(&all);
    } else if first {
        drop(e);
        // The control thread tells the agent within [`ENDED_DELAY_MS`], with every end that
        // comes meanwhile: one wake-up for all of them.
        ENDED_DUE.store(sys::now_ms() + ENDED_DELAY_MS, Relaxed);
        crate::linkstate::wake_for_ends();
    }
}

/// How long an end of stream may wait to be told: well within the time the agent gives a
/// process to claim a connection before it answers a rebuilt link with the end (500 ms).
const ENDED_DELAY_MS: u64 = 50;

/// When the ends kept back are due (`sys::now_ms`; 0: none kept).
static ENDED_DUE: AtomicU64 = AtomicU64::new(0);

/// Tries of the move onto shared memory after a withdrawn offer (`linkstate::shm_later`),
/// each twice as long after the one before (the last about 5 s after the withdrawal).
const SHM_LATER_TRIES: u32 = 9;

/// Moves the connections whose offer was withdrawn onto shared memory, once due: through the
/// agent, as `vmictl move GID shm` does, so that both ends are told (the agent checks that
/// both are on this node). A connection that cannot move now (the peer's program has not
/// accepted it yet) is tried again later, [`SHM_LATER_TRIES`] times in all.
fn shm_later_due(now: u64) {
    let due = SHM_LATER_DUE.load(Relaxed);
    if due == 0 || now < due {
        return;
    }
    SHM_LATER_DUE.store(0, Relaxed);
    let due_at = |at| linkstate::due_at(&SHM_LATER_DUE, at);
    for v in crate::vc::connections() {
        let Some(l) = v.shm() else { continue };
        if !l.withdrawn_waits() {
            continue;
        }
        let c = v.mem().conn();
        let gid = c.gid;
        if c.link_down.load(Acquire) != 0 {
            // (A failover under way: after it.)
            due_at(now + SHM_LATER_MS);
            continue;
        }
        let not_now = if v.shm_now().is_some() {
            Some("on shared memory already")
        } else if c.broken.load(Acquire) != 0 || c.peer_eof.load(Acquire) != 0 || c.tx_shut.load(Acquire) != 0
        {
            Some("ending")
        } else if !shm_wanted(&v) {
            Some("shared memory is off here, or the connection is shared or filtered")
        } else if !crate::shm_sink::same_node(&c.peer_agents()) {
            Some("the peer is on another node")
        } else {
            None
        };
        if let Some(why) = not_now {
            l.withdrawn_done();
            log::debug(format_args!("virtual connection {gid:032x}: not moved onto shared memory ({why})"));
            continue;
        }
        let tries = l.withdrawn_try() + 1;
        match agent::request(&Msg::Move { gid, shm: true }) {
            Some(Msg::Ok) => {
                l.withdrawn_done();
                log::info(format_args!(
                    "virtual connection {gid:032x}: onto shared memory now (its offer was withdrawn at set-up: the program sent before the peer's program accepted)"
                ));
            }
            answer if tries < SHM_LATER_TRIES => {
                log::debug(format_args!(
                    "virtual connection {gid:032x}: not moved onto shared memory yet (the agent answered {answer:?})"
                ));
                due_at(now + (SHM_LATER_MS << tries));
            }
            answer => {
                l.withdrawn_done();
                let why = match answer {
                    Some(Msg::Error { reason }) => reason,
                    Some(other) => format!("the agent answered {other:?}"),
                    None => "no agent answered".to_string(),
                };
                log::info(format_args!(
                    "virtual connection {gid:032x} stays on TCP after {tries} tries to move it onto shared memory: {why}"
                ));
            }
        }
    }
}

/// Ends of streams not told to the agent yet (encoded `Ended` messages). They matter only
/// once this process no longer holds the connection, so they go together: at most
/// [`ENDED_DELAY_MS`] after the first of them (the control thread writes every end that came
/// meanwhile at once), before an exec, and at exit, `_exit` included; a message to the agent
/// for each closed connection cost a wake-up of the agent per connection. (A process killed
/// by a signal within those 50 ms loses them: its peer then gets a reset after the last
/// byte, not the end, if the link fails before the end reached it.)
static ENDED: Mutex<Vec<u8>> = Mutex::new(Vec::new());

/// Most bytes of `ENDED` kept back (about 900 ends).
const ENDED_MAX: usize = 64 << 10;

/// Tells the agent what is kept back (ends of streams, holds). Kept while there is no event
/// channel (the agent restarting): the control thread tries again each round.
pub fn flush_ended() {
    ENDED_DUE.store(0, Relaxed);
    if crate::ownfd::own_fd(OWN_EVENTS) < 0 {
        return;
    }
    let all = std::mem::take(&mut *ENDED.lock().unwrap_or_else(|e| e.into_inner()));
    if !all.is_empty() {
        send_events(&all);
    }
}

/// The same from `_exit`, which may come from a thread that holds either lock (a signal
/// handler): tried, never waited for.
pub fn flush_ended_at_exit() {
    let Ok(mut e) = ENDED.try_lock() else { return };
    let all = std::mem::take(&mut *e);
    drop(e);
    if all.is_empty() {
        return;
    }
    if let Ok(_g) = EVT_WRITE.try_lock() {
        let fd = crate::ownfd::own_fd(OWN_EVENTS);
        if fd >= 0 {
            let _ = agent::write_all(fd, &all, None);
        }
    }
}

/// At exit: gives the socket of a closed connection to the agent, which keeps it until the
/// peer closes too. True if the agent took it.
pub fn hand_over_linger(gid: u128, fd: i32) -> bool {
    let _g = EVT_WRITE.lock().unwrap_or_else(|e| e.into_inner());
    let evt = crate::ownfd::own_fd(OWN_EVENTS);
    evt >= 0 && agent::write_all(evt, &Msg::Linger { gid }.encode(), Some(fd))
}

fn open_events() -> Option<i32> {
    let fd = agent::open_socket(OWN_EVENTS)?;
    let _g = EVT_WRITE.lock().unwrap_or_else(|e| e.into_inner());
    if !agent::write_all(fd, &Msg::Events { pid: crate::pid() as u32 }.encode(), None) {
        return None;
    }
    for v in crate::vc::connections() {
        let c = v.mem().conn();
        if !agent::write_all(fd, &Msg::Hold { gid: c.gid, active: c.active != 0 }.encode(), None) {
            return None;
        }
    }
    Some(fd)
}

fn close_events() {
    let fd = crate::ownfd::unprotect(OWN_EVENTS);
    if fd >= 0 {
        crate::sys::fd::close(fd);
    }
}

/// Reads one message (and a descriptor riding with it) from the event channel.
fn read_event(fd: i32) -> Option<(Msg, Option<i32>)> {
    let mut pre = [0u8; 4];
    // (MSG_WAITALL gets the whole prefix.)
    let (r, passed) = sys::recv_with_fd(fd, &mut pre, libc::MSG_WAITALL);
    let close_passed = |p: Option<i32>| {
        if let Some(p) = p {
            crate::sys::fd::close(p);
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
    /// This side dials it (the other side waits for its dialer: looked at only by the walks
    /// of every connection).
    dials: bool,
}

/// Connections this side answers for (it did not dial them) whose path the agent says is
/// dead: when it last saw the peer's kernel acknowledge anything, and when it last asked.
struct Suspect {
    since_ms: u64,
    poked_ms: u64,
    /// Last look at its socket (see [`suspect_look_ms`]).
    looked_ms: u64,
}

/// How often a suspect connection's socket is asked whether the peer's kernel acknowledged:
/// every 200 ms, and 1 ms more per 10 suspects (a failover of a node's network makes every
/// connection held here a suspect: 12,500 of them asked every 200 ms took a fifth of a CPU,
/// while their dialers needed it).
fn suspect_look_ms(suspects: usize) -> u64 {
    200 + suspects as u64 / 10
}

#[derive(Default)]
struct Work {
    pending: HashMap<u128, Pending>,
    suspects: HashMap<u128, Suspect>,
    owed_seen: u64,
    last_wire: HashMap<u128, u64>,
    /// Connections this side must dial whatever its role: the process was restored on
    /// another node, and only it knows where it is now.
    must_dial: HashSet<u128>,
    /// A thaw whose report to `vmi-migrate` waits for the links to be rebuilt.
    thawing: Option<Thawing>,
    /// When an idle thread next walks the connections (see [`sweep_ms`]).
    next_sweep_ms: u64,
    /// When the connections were last walked.
    walked_ms: u64,
    /// When every connection was last looked at.
    all_walked_ms: u64,
    /// The next walk looks at every connection.
    look_at_all: bool,
    /// Connections seen by the last walk of them all.
    conns_seen: usize,
}

/// Longest time between two walks of every connection while something is under way: 50 ms,
/// and 1 ms more per 20 connections (a walk touches every connection's memory, about a
/// microsecond each, and must not take much of the thread's time at 100,000).
fn full_walk_ms(conns: usize) -> u64 {
    50 + conns as u64 / 20
}

/// Most events read from the agent in one round of the control thread.
const EVENTS_PER_ROUND: usize = 256;

/// The report owed to `vmi-migrate` after a thaw.
struct Thawing {
    fd: i32,
    since_ms: u64,
    moved: bool,
    conns: u32,
    to_rebuild: Vec<u128>,
    /// Links of `to_rebuild` that came back, counted when they did (the program may close
    /// some of them before the report goes out).
    rebuilt: HashSet<u128>,
    replayed_before: u64,
}

/// How the control thread ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    /// Return from the thread (glibc ends the process if it was the last thread).
    Normally,
    /// The bare `exit` system call (see [`crate::lifetime`]).
    Bare,
}

/// Errors of a call that will fail the same way every time (a sandbox refusing it).
fn cannot_heal(e: i32) -> bool {
    matches!(e, libc::EPERM | libc::EACCES | libc::ENOSYS)
}

/// Back-off after a failed wait: doubles from 10 ms up to 5 s.
fn backoff(fails: &mut u32) {
    let ms = (10u64 << (*fails).min(9)).min(5_000);
    *fails += 1;
    std::thread::sleep(std::time::Duration::from_millis(ms));
}

/// Waits for the two descriptors like `poll`. A `poll` refused because the process's
/// descriptor limit is below two (OpenSSH's sandboxed child sets it to zero) is done with
/// `select`, which that limit does not bound. Returns the system call's result.
fn wait_two(pfds: &mut [libc::pollfd; 2], timeout: i32) -> i32 {
    // (Negative fds are ignored by poll.)
    let r = sys::fd::poll(pfds, timeout);
    if r >= 0 || sys::errno() != libc::EINVAL {
        return r;
    }
    let fds: Vec<i32> = pfds.iter().map(|p| p.fd).filter(|&f| f >= 0).collect();
    if fds.iter().any(|&f| f >= libc::FD_SETSIZE as i32) {
        return -1;
    }
    let (r, ready) = sys::fd::select_readable(&fds, timeout);
    if r > 0 {
        for (p, _) in pfds.iter_mut().filter(|p| p.fd >= 0).zip(&ready).filter(|(_, &ok)| ok) {
            p.revents = libc::POLLIN;
        }
    }
    r
}

fn control_loop() -> Ending {
    // The event channel closed under us (the agent went away): once it opens again, the
    // process introduces itself to the new agent at once.
    let mut agent_lost = false;
    let mut next_connect = 0u64;
    let mut connect_fails = 0u32;
    let mut wait_fails = 0u32;
    let mut w = Work::default();
    loop {
        if RETIRE.load(Acquire) {
            return Ending::Normally;
        }
        let watch = match crate::lifetime::verdict() {
            crate::lifetime::Verdict::Run => false,
            crate::lifetime::Verdict::Watch => true,
            crate::lifetime::Verdict::EndNormally => return Ending::Normally,
            crate::lifetime::Verdict::EndBare => return Ending::Bare,
        };
        let now = sys::now_ms();
        let mut evt = crate::ownfd::own_fd(OWN_EVENTS);
        if evt < 0 && now >= next_connect {
            match open_events() {
                Some(fd) => {
                    evt = fd;
                    connect_fails = 0;
                    if std::mem::take(&mut agent_lost) {
                        agent::agent_back();
                    }
                }
                None => {
                    let e = sys::errno();
                    close_events();
                    // No agent: ask again every half second at first, then less often (never
                    // a loop: at most every 30 s), and never again when refused for good.
                    connect_fails += 1;
                    next_connect = if cannot_heal(e) {
                        u64::MAX
                    } else {
                        now + (500u64 << connect_fails.min(6).saturating_sub(1)).min(30_000)
                    };
                }
            }
        }
        if EXECING.load(Relaxed) == 0 {
            // What is kept back (holds, ends of streams, releases) goes when due, all at once:
            // a program that opens and closes connections one after the other woke this
            // thread and the agent once per connection, where once per ENDED_DELAY_MS does.
            let due = ENDED_DUE.load(Relaxed);
            if due == 0 || due <= sys::now_ms() {
                // (Holds kept back go before the releases.)
                flush_ended();
                flush_released();
            }
            shm_later_due(sys::now_ms());
        }
        let wake_fd = crate::ownfd::own_fd(OWN_WAKE);
        let mut pfds = [
            libc::pollfd { fd: evt, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: wake_fd, events: libc::POLLIN, revents: 0 },
        ];
        let owed = OWED.load(Relaxed);
        let timeout = if REPLAYING.load(Relaxed) != 0 {
            2
        } else if owed != w.owed_seen {
            w.owed_seen = owed;
            w.look_at_all = true;
            REPLAYING.store(1, Relaxed);
            5
        } else if w.pending.is_empty() && w.suspects.is_empty() {
            crate::sandbox::control_poll_ms(if watch { 200 } else { 500 })
        } else {
            50
        };
        // Anything under way is looked at every `timeout`; otherwise only what woke the
        // thread (an event, a broken link) makes it walk the connections, plus a slow
        // sweep: with thousands of idle connections a walk costs milliseconds.
        let busy = timeout < 500 || w.thawing.is_some() || !w.last_wire.is_empty();
        // (Ends of streams kept back are told when due; that alone is no work under way.)
        let wait = [ENDED_DUE.load(Relaxed), SHM_LATER_DUE.load(Relaxed)]
            .into_iter()
            .filter(|&due| due != 0)
            .fold(timeout, |t, due| t.min(due.saturating_sub(sys::now_ms()).clamp(1, 60_000) as i32));
        let r = wait_two(&mut pfds, wait);
        if r < 0 {
            let e = sys::errno();
            if e != libc::EINTR {
                if cannot_heal(e) || wait_fails > 64 {
                    log::warn(format_args!(
                        "the control thread cannot wait for events ({}); it stops: connections                          keep working, without failover",
                        std::io::Error::from_raw_os_error(e)
                    ));
                    RETIRED.store(true, Release);
                    return Ending::Normally;
                }
                backoff(&mut wait_fails);
                continue;
            }
        } else {
            wait_fails = 0;
        }
        if pfds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
            // A descriptor of ours is gone (closed behind the layer's back): open them again
            // later rather than poll a dead one in a loop.
            if pfds[0].revents & libc::POLLNVAL != 0 {
                crate::ownfd::unprotect(OWN_EVENTS);
                next_connect = sys::now_ms() + 500;
            }
            if pfds[1].revents & libc::POLLNVAL != 0 {
                crate::ownfd::unprotect(OWN_WAKE);
            }
            backoff(&mut wait_fails);
        }
        if pfds[1].revents & libc::POLLIN != 0 {
            // Drains our eventfd.
            sys::fd::read_raw(wake_fd, &mut [0u8; 8]);
        }
        if !enter_work() {
            std::thread::sleep(std::time::Duration::from_millis(5));
            continue;
        }
        // Events waiting are read together (a failover of thousands of connections brings
        // a hand-over each), and a hand-over needs no walk of the connections: it is
        // answered on the spot. A wake-up for broken links looks at those only.
        let mut walk = false;
        let mut extra = Vec::new();
        if pfds[1].revents != 0 {
            let for_ends = crate::linkstate::WOKEN_FOR_ENDS.swap(false, AcqRel);
            match attention() {
                Some(gids) if !gids.is_empty() => extra = gids,
                // (Nothing asked for a walk: the ends are told when due.)
                Some(_) if for_ends => {}
                _ => walk = true,
            }
        }
        if pfds[0].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            for n in 0..EVENTS_PER_ROUND {
                if n > 0 && sys::wait_fd(evt, libc::POLLIN, 0) & (libc::POLLIN | libc::POLLHUP) == 0 {
                    break;
                }
                match read_event(evt) {
                    Some((m, passed)) => {
                        walk |= !matches!(m, Msg::Handover { .. });
                        on_event(m, passed, &mut w);
                    }
                    None => {
                        log::info(format_args!("event channel to the node agent closed; reconnecting"));
                        close_events();
                        agent_lost = true;
                        next_connect = sys::now_ms() + 200;
                        walk = true;
                        break;
                    }
                }
            }
        }
        // Under way (a replay to push, links to dial, suspects): a walk per `timeout`, not
        // per wake-up; otherwise what woke the thread, and the slow sweep. A walk looks at
        // every connection when something may concern any of them (a wake-up, an event, a
        // replay owed somewhere, the sweep, at least every [`full_walk_ms`] while busy); in
        // between only at those under way: a failover of thousands of connections otherwise
        // walks them all every 2 ms.
        let now = sys::now_ms();
        let due = if busy { now >= w.walked_ms + timeout.max(0) as u64 } else { now >= w.next_sweep_ms };
        let reaches = crate::sandbox::wake_reaches();
        if walk || due || !reaches || !extra.is_empty() {
            let all = walk
                || !busy
                || !reaches
                || std::mem::take(&mut w.look_at_all)
                || w.thawing.is_some()
                || now >= w.all_walked_ms + full_walk_ms(w.conns_seen);
            work(&mut w, all, extra);
            w.walked_ms = now;
            if all {
                w.all_walked_ms = now;
            }
            w.next_sweep_ms = now + sweep_ms(w.conns_seen);
        }
        IN_WORK.store(false, SeqCst);
    }
}

/// Threads of the program inside an exec (see [`quiet_for_exec`]).
static EXECING: AtomicU32 = AtomicU32::new(0);
/// The control thread is handling an event or walking the connections.
static IN_WORK: AtomicBool = AtomicBool::new(false);

/// Keeps the control thread away from the connections while the program execs; undone on
/// drop (the exec failed).
pub struct ExecQuiet(bool);

impl Drop for ExecQuiet {
    fn drop(&mut self) {
        if self.0 {
            EXECING.fetch_sub(1, SeqCst);
        }
    }
}

/// Before an exec: waits until the control thread is out of its work and keeps it out. Exec
/// ends the thread wherever it is, and a lock it held in memory shared with another process
/// (a parent that forked this one) would stay taken for good: the process keeps its id, so
/// nobody could tell its holder died.
pub fn quiet_for_exec() -> ExecQuiet {
    // The real id, not the cached one: a vfork child shares our memory (the cache says its
    // parent's id) but not our threads, and its exec must not touch the parent's control
    // thread (nor leave it kept out: the guard never drops when the exec succeeds).
    if CONTROL_PID.load(Acquire) != sys::process::getpid() {
        return ExecQuiet(false);
    }
    // (The new image does not know them.)
    flush_ended();
    EXECING.fetch_add(1, SeqCst);
    // A handshake under way takes at most a few of its one-second time-outs.
    let deadline = sys::now_ms() + 3_000;
    while IN_WORK.load(SeqCst) && sys::now_ms() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    ExecQuiet(true)
}

/// The control thread starts handling something; false (and it must not) while the program
/// execs.
fn enter_work() -> bool {
    IN_WORK.store(true, SeqCst);
    if EXECING.load(SeqCst) == 0 {
        return true;
    }
    IN_WORK.store(false, SeqCst);
    false
}

/// How often an idle control thread walks the connections anyway (everything that needs it
/// sooner wakes the thread): every 10 s, or 10 ms per connection if that is longer, so that
/// the walk (about a microsecond per connection) costs an idle process at most a ten
/// thousandth of a CPU (12,500 connections: every 125 s).
fn sweep_ms(conns: usize) -> u64 {
    (conns as u64 * 10).max(10_000)
}

fn on_event(m: Msg, passed: Option<i32>, w: &mut Work) {
    match (m, passed) {
        (Msg::Path { local, peer, up: false }, _) => {
            for v in crate::vc::connections() {
                let c = v.mem().conn();
                // (Shared memory does not use the network.)
                if c.link_down.load(Acquire) != 0 || c.broken.load(Acquire) != 0 || v.shm_now().is_some() {
                    continue;
                }
                let Some(&fd) = crate::vc::fds_of(&v).first() else { continue };
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
                    w.suspects.entry(c.gid).or_insert(Suspect { since_ms: now, poked_ms: 0, looked_ms: 0 });
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
        // A listener on another node is gone or moved: its tickets are no good any more (a
        // connection there asks the agent, which knows where it went).
        (Msg::Unlisten { addr }, _) => crate::tickets::drop_book(addr),
        (Msg::Move { gid, shm }, _) => move_conn(gid, shm),
        (Msg::Chain { gid, spec }, _) => chain_conn(gid, &spec),
        (Msg::Device { load, name, gid, .. }, _)
            if substrate::connection::chain::TAPS.contains(&name.as_str()) =>
        {
            if let Some(v) = crate::vc::by_gid(gid) {
                v.set_profile(load);
                log::info(format_args!(
                    "virtual connection {gid:032x}: device {name} {} on this end, as the operator asked",
                    if load { "loaded" } else { "unloaded" }
                ));
            }
        }
        (Msg::Device { load, name, gid, .. }, _) => device_conn(gid, load, &name),
        (Msg::Profile { gid }, Some(fd)) => {
            let json = match crate::vc::by_gid(gid) {
                Some(v) => v.profile_json().unwrap_or_else(|| {
                    format!(
                        "{{\"error\": \"connection {gid:032x} has no profile: load the device first \
                         (vmictl device load profile --gid {gid:032x})\"}}"
                    )
                }),
                None => format!("{{\"error\": \"no connection {gid:032x} in process {}\"}}", crate::pid()),
            };
            // (A pipe from the agent, which reads it whole.)
            let mut at = 0;
            while at < json.len() {
                let r = crate::sys::fd::write(fd, &json.as_bytes()[at..]);
                if r <= 0 {
                    break;
                }
                at += r as usize;
            }
            crate::sys::fd::close(fd);
        }
        (Msg::Capture { gid, duration_ms }, Some(fd)) => match crate::vc::by_gid(gid) {
            Some(v) if v.start_capture(fd, duration_ms as u64) => {
                log::info(format_args!(
                    "virtual connection {gid:032x}: capturing its traffic for {} ms, as the operator asked",
                    duration_ms
                ));
                // (The control thread ends it on time even if the program goes quiet.)
                w.look_at_all = true;
            }
            Some(_) => log::warn(format_args!(
                "virtual connection {gid:032x}: no capture: the file passed takes nothing"
            )),
            None => {
                crate::sys::fd::close(fd);
            }
        },
        (Msg::Handover { gid, nonce }, Some(fd)) => {
            w.suspects.remove(&gid);
            answer(gid, nonce, fd)
        }
        (other, passed) => {
            if let Some(p) = passed {
                crate::sys::fd::close(p);
            }
            log::debug(format_args!("event ignored: {other:?}"));
        }
    }
}

/// Offers chain `spec` for what connection `v` sends (see `Vc::offer_chain`), waiting (at
/// most a second) while an offer of its own waits for its answer: the operator's command
/// must not be lost because the connection was re-keying its sealing device at that moment.
fn offer_when_free(
    v: &crate::vc::Vc,
    fd: i32,
    spec: &str,
    both: bool,
) -> Result<usize, substrate::irb::IrbError> {
    let deadline = sys::now_ms() + 1_000;
    loop {
        match v.offer_chain(fd, spec, both) {
            Err(substrate::irb::IrbError::Os(libc::EBUSY)) if sys::now_ms() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            r => return r,
        }
    }
}

/// The operator puts a chain of filters on what this end of connection `gid` sends
/// (`vmictl chain`).
fn chain_conn(gid: u128, spec: &str) {
    let Some(v) = crate::vc::by_gid(gid) else { return };
    let Some(&fd) = crate::vc::fds_of(&v).first() else { return };
    match offer_when_free(&v, fd, spec, false) {
        Ok(no) => log::info(format_args!(
            "virtual connection {gid:032x}: chain {no} \"{spec}\" offered to the peer, as the operator asked{}",
            aside_on_shm(&v)
        )),
        Err(e) => log::warn(format_args!(
            "virtual connection {gid:032x}: chain \"{spec}\" not offered: {}",
            std::io::Error::from_raw_os_error(crate::error::errno_of(e).0)
        )),
    }
}

/// The operator loads device `name` onto connection `gid`, or unloads it (`vmictl device`):
/// the chain of what this end sends, with the device added at its end or taken out, is
/// offered to the peer, which is asked to use the same chain for what it sends.
fn device_conn(gid: u128, load: bool, name: &str) {
    let Some(v) = crate::vc::by_gid(gid) else { return };
    let Some(&fd) = crate::vc::fds_of(&v).first() else { return };
    let now = v.send_chain_spec();
    let mut names: Vec<&str> = now.split(',').filter(|n| !n.is_empty()).collect();
    let had = names.contains(&name);
    if load && !had {
        names.push(name);
    } else if !load {
        names.retain(|n| *n != name);
    }
    let spec = names.join(",");
    let verb = if load { "load" } else { "unload" };
    match offer_when_free(&v, fd, &spec, true) {
        Ok(no) => log::info(format_args!(
            "virtual connection {gid:032x}: device {name} {verb}ed as the operator asked: chain {no} \"{spec}\" \
             offered to the peer for both directions{}",
            aside_on_shm(&v)
        )),
        Err(e) => log::warn(format_args!(
            "virtual connection {gid:032x}: device {name} not {verb}ed: {}",
            std::io::Error::from_raw_os_error(crate::error::errno_of(e).0)
        )),
    }
}

/// What a log line about a chain says of a connection on shared memory: the chain stands
/// aside there (see `Vc::on_shm_the_chain_stands_aside`).
fn aside_on_shm(v: &crate::vc::Vc) -> &'static str {
    if v.on_shm_the_chain_stands_aside() {
        " (the connection is on shared memory, where bytes do not leave this node: the chain codes \
         from its next TCP link on)"
    } else {
        ""
    }
}

/// The operator moves connection `gid` to shared memory or to TCP (`vmictl move`).
fn move_conn(gid: u128, shm: bool) {
    let Some(v) = crate::vc::by_gid(gid) else { return };
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
    link_broken(
        v.mem(),
        "moving to shared memory, as asked (by an operator, or after an offer withdrawn at set-up)",
    );
    if c.active != 0 {
        kick(&v);
    }
    // (The accepting end keeps its old socket until the new link comes, `handshake::answer`:
    // the agent told both ends, and the connecting end dials. Swapped here as well, the old
    // socket's reset reached the connecting end first about one move in three, as a failure
    // of its link, and the link was rebuilt twice.)
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
    let Some(&fd) = crate::vc::fds_of(v).first() else { return true };
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
        v.send_ack(fd);
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

/// Dials, gives up after the grace period, for every connection whose link is down; pushes
/// replays; watches suspects. `every`: looks at every connection of the process, else only
/// at those under way.
fn work(w: &mut Work, every: bool, extra: Vec<u128>) {
    let now = sys::now_ms();
    let mut seen = HashSet::new();
    let mut visited: HashSet<u128> = HashSet::new();
    // (Only a walk of every connection can tell that no replay is owed anywhere.)
    if every {
        REPLAYING.store(0, Relaxed);
    }
    let all: Vec<Arc<Vc>> = if every {
        crate::vc::connections()
    } else {
        // (Suspects, and links this side waits for its peer to dial, wait for the walks of
        // every connection: a failover makes every connection held here one.)
        let due = w.pending.iter().filter(|(_, p)| p.dials && now >= p.next_try_ms).map(|(g, _)| g);
        visited = (due.chain(w.last_wire.keys()).chain(w.must_dial.iter()).copied()).chain(extra).collect();
        visited.iter().copied().filter_map(crate::vc::by_gid).collect()
    };
    let look = suspect_look_ms(w.suspects.len());
    for v in &all {
        let v = &**v;
        let c = v.mem().conn();
        if let Some((packets, lost)) = v.end_capture_if_over() {
            log::info(format_args!(
                "virtual connection {:032x}: capture over: {packets} packets written, {lost} lost",
                c.gid
            ));
        }
        if c.broken.load(Acquire) != 0 {
            continue;
        }
        for_sandboxed_threads(v);
        if let Some(s) = w.suspects.get_mut(&c.gid).filter(|s| now >= s.looked_ms + look) {
            s.looked_ms = now;
            if check_suspect(v, s, now) {
                w.suspects.remove(&c.gid);
            }
        }
        if c.link_down.load(Acquire) == 0 {
            // A rebuilt link whose replay did not fit in the socket at once: keep pushing
            // it (the program may be waiting for an answer to bytes only the replay carries).
            // A program that keeps sending pushes it itself: only a connection whose send
            // position did not move since the last look is helped.
            // (Racy reads, only to choose whether to look.)
            let (owed, wire) = c.peek_tx(|tx| (tx.replaying(), tx.wire_seq));
            if owed || c.fin_owed.load(Acquire) != 0 {
                let moved = w.last_wire.insert(c.gid, wire) != Some(wire);
                if moved && c.fin_owed.load(Acquire) == 0 {
                    REPLAYING.store(1, Relaxed);
                } else if let (Some(_g), Some(&fd)) = (c.tx_lock.try_lock(), crate::vc::fds_of(v).first()) {
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
        seen.insert(c.gid);
        if v.parked() < 0 && v.shm().is_some_and(|l| l.moving()) {
            // Leaving shared memory: the program's polls wait quietly on a placeholder
            // (the old socket, reset by the peer, would poll ready forever).
            kick(v);
        }
        let since = c.down_since_ms.load(Acquire);
        if now.saturating_sub(since) > config::grace_ms() {
            give_up(v, libc::ETIMEDOUT, "no network reached the peer within the grace period");
            continue;
        }
        if let Some(s) = v.slot() {
            s.set_relinking(true, false);
        }
        let dials = c.active != 0 || w.must_dial.contains(&c.gid);
        let p = w.pending.entry(c.gid).or_insert(Pending { next_try_ms: 0, dials });
        p.dials = dials;
        if dials && now >= p.next_try_ms {
            match dial(v) {
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
    if every {
        w.conns_seen = all.len();
    }
    // (What was not looked at stays as it was.)
    let keep = |g: &u128| seen.contains(g) || (!every && !visited.contains(g));
    w.pending.retain(|g, _| keep(g));
    w.must_dial.retain(keep);
    report_thaw(w);
    let live: HashSet<u128> = all.iter().map(|v| v.mem().conn().gid).collect();
    if every {
        w.suspects.retain(|g, _| live.contains(g));
    }
    w.last_wire.retain(|g, _| live.contains(g));
}

/// What a sandboxed program thread could not do itself: read acknowledgements for a sender
/// with a full window, send one for a reader, take a link another process rebuilt.
fn for_sandboxed_threads(v: &Vc) {
    let c = v.mem().conn();
    // (Nothing owed, the common case, costs two loads: the walk visits every connection.)
    let owed = if c.ctl_owed.load(Relaxed) != 0 { c.ctl_owed.swap(0, AcqRel) } else { 0 };
    if owed & (crate::shm::CTL_HARVEST | crate::shm::CTL_ACK) != 0 {
        let Some(&fd) = crate::vc::fds_of(v).first() else { return };
        if owed & crate::shm::CTL_HARVEST != 0 {
            crate::tcp_sink::harvest_acks(v.mem(), v.slot(), fd);
        }
        if owed & crate::shm::CTL_ACK != 0 {
            v.send_ack(fd);
        }
    }
    if crate::sandbox::active() && c.link_down.load(Acquire) == 0 && v.behind() {
        v.adopt();
    }
}

/// The connection failed for good: every call reports `e` from now on.
fn give_up(v: &Vc, e: i32, why: &str) {
    let c = v.mem().conn();
    if c.broken.compare_exchange(0, e, AcqRel, Acquire).is_ok() {
        if crate::tcp_sink::peer_fin(v.mem()) || c.peer_eof.load(Acquire) != 0 {
            // The peer had ended its stream: its program closed the connection, and a reset
            // after that (this side wrote to it) is what native TCP gives too.
            log::info(format_args!(
                "virtual connection {:032x}: {why}, after the peer's end of stream (its program closed the connection); the program sees errno {e}",
                c.gid
            ));
        } else {
            log::warn(format_args!("virtual connection {:032x}: {why}; the program sees errno {e}", c.gid));
        }
        if let Some(s) = v.slot() {
            s.set_error(e);
            s.set_relinking(false, false);
        }
    }
    // Threads blocked on the old socket wake up, pollers see the descriptor ready, and every
    // call reports the failure.
    kick(v);
    unpark(v);
    v.unpark_epoll();
    c.link_gen.fetch_add(1, AcqRel);
    sys::futex_wake(&c.link_gen, i32::MAX);
}
