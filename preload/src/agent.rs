//! The layer's side of the node agent: one Unix stream connection per process (abstract
//! socket, so each network namespace has its own agent), request and answer in order,
//! short time-outs. Any failure means "no agent": the caller falls back to plain TCP and the
//! agent is not asked again for a second.

use crate::ownfd::{OWN_AGENT, OWN_STATS};
use crate::sys::cell::Kept;
use crate::{log, sys};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard, OnceLock};
use substrate::wire::agent::Msg;

/// Default abstract socket name of the node agent (overridden by `VMI_AGENT_SOCKET`).
pub const DEFAULT_SOCKET: &str = "vmi-agent";
const RETRY_NS: u64 = 1_000_000_000;
const NEGATIVE_TTL_NS: u64 = 1_000_000_000;

struct State {
    down_until: u64,
    said_hello: bool,
    plain: BTreeMap<SocketAddr, u64>,
}

static STATE: Mutex<State> = Mutex::new(State { down_until: 0, said_hello: false, plain: BTreeMap::new() });
static SOCKET_NAME: OnceLock<String> = OnceLock::new();

thread_local! {
    static FORK_GUARD: RefCell<Option<MutexGuard<'static, State>>> = const { RefCell::new(None) };
}

/// The agent's abstract socket name.
pub fn socket_name() -> &'static str {
    SOCKET_NAME.get().map(String::as_str).unwrap_or(DEFAULT_SOCKET)
}

/// What this module asks of the layers above it, registered at start.
pub struct Above {
    /// This process's listeners under the layer, one descriptor per address (the agent
    /// must know each).
    pub listeners: fn() -> Vec<(i32, std::net::SocketAddr)>,
    /// Runs after each exchange with the agent: the process's control thread must run from
    /// then on (the agent reaches the process on its event channel, e.g. before a checkpoint).
    pub after_contact: fn(),
}

static ABOVE: std::sync::OnceLock<Above> = std::sync::OnceLock::new();

/// Sets the agent socket name (from the environment) and what the layers above provide, at
/// start.
pub fn init(name: Option<String>, above: Above) {
    let _ = SOCKET_NAME.set(name.unwrap_or_else(|| DEFAULT_SOCKET.to_string()));
    let _ = ABOVE.set(above);
}

fn lock() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// fork, prepare: hold the lock so no other thread is inside a request.
pub fn before_fork() {
    let g = lock();
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// fork, parent side.
pub fn after_fork_parent() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
}

/// fork, child side: the agent socket belongs to the parent; the child opens its own.
pub fn after_fork_child() {
    FORK_GUARD.with(|f| {
        if let Some(mut g) = f.borrow_mut().take() {
            g.said_hello = false;
            g.down_until = 0;
        }
    });
    let fd = crate::ownfd::unprotect(OWN_AGENT);
    if fd >= 0 {
        sys::fd::close(fd);
    }
}

/// The program closed (or replaced) our agent socket: forget it.
pub fn lost_socket() {
    crate::ownfd::unprotect(OWN_AGENT);
    if let Ok(mut g) = STATE.try_lock() {
        g.said_hello = false;
    }
}

/// The address of the abstract Unix socket `name` (scoped by network namespace).
pub(crate) fn abstract_addr(name: &str) -> sys::fd::RawAddr {
    let mut b = vec![0u8];
    b.extend_from_slice(&name.as_bytes()[..name.len().min(100)]);
    sys::fd::RawAddr::unix(&b).unwrap_or_else(sys::fd::RawAddr::unspec)
}

/// Opens a new connection to the node agent, kept as the layer's own descriptor `role`.
pub(crate) fn open_socket(role: usize) -> Option<i32> {
    let name = SOCKET_NAME.get().map(String::as_str).unwrap_or(DEFAULT_SOCKET);
    let fd = sys::fd::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
    if fd < 0 {
        return None;
    }
    sys::set_timeouts(fd, 1000);
    if sys::fd::connect(fd, &abstract_addr(name)) != 0 {
        sys::fd::close(fd);
        return None;
    }
    let fd = crate::ownfd::move_high(fd);
    crate::ownfd::protect(role, fd);
    Some(fd)
}

pub(crate) fn write_all(fd: i32, mut b: &[u8], pass_fd: Option<i32>) -> bool {
    let mut first = true;
    while !b.is_empty() {
        let r = match (first, pass_fd) {
            (true, Some(pfd)) => sys::fd::send_with_fd(fd, b, pfd, None, libc::MSG_NOSIGNAL),
            _ => sys::fd::send_parts(fd, &[b], libc::MSG_NOSIGNAL),
        };
        if r < 0 {
            if sys::errno() == libc::EINTR {
                continue;
            }
            return false;
        }
        first = false;
        b = &b[r as usize..];
    }
    true
}

pub(crate) fn read_exact(fd: i32, b: &mut [u8]) -> bool {
    read_patiently(fd, b, 0)
}

/// As [`read_exact`], waiting `extra` more receive timeouts (a second each) for the data.
fn read_patiently(fd: i32, b: &mut [u8], extra: u32) -> bool {
    let n = b.len();
    read_at_least(fd, b, n, extra) == Some(n)
}

/// Reads at least `min` bytes into `b` (more if they come in the same receive, up to its
/// length), waiting `extra` more receive timeouts for them; how many came.
fn read_at_least(fd: i32, b: &mut [u8], min: usize, mut extra: u32) -> Option<usize> {
    let mut got = 0;
    while got < min {
        let r = sys::fd::recv(fd, &mut b[got..], 0);
        if r < 0 && sys::errno() == libc::EINTR {
            continue;
        }
        if r < 0 && extra > 0 && matches!(sys::errno(), libc::EAGAIN | libc::ETIMEDOUT) {
            extra -= 1;
            continue;
        }
        if r <= 0 {
            return None;
        }
        got += r as usize;
    }
    Some(got)
}

fn exchange(fd: i32, m: &Msg, pass_fd: Option<i32>) -> Option<Msg> {
    if !write_all(fd, &m.encode(), pass_fd) {
        return None;
    }
    // The socket's receive timeout is a second; a connect may wait longer.
    let extra = match m {
        Msg::Connect { .. } => (substrate::wire::agent::CONNECT_WAIT_MS / 1000).saturating_sub(1) as u32,
        _ => 0,
    };
    // An answer comes whole in one receive as a rule: read as much as fits here at once,
    // the rest (a long answer) after. The agent answers only what is asked, so nothing
    // after the answer can be in the socket.
    let mut first = [0u8; 512];
    // Waited for with `poll`, not in `recv`: a thread asleep in a blocking `recv` on a Unix
    // socket is woken as well when the peer frees memory this socket sent (the agent reading
    // our request wakes us, for nothing, before its answer does), one more wake-up per
    // request. (The receive below still has its own time-out.)
    sys::wait_fd(fd, libc::POLLIN, 1000 * (extra as i32 + 1));
    let got = read_at_least(fd, &mut first, 4, extra)?;
    let n = Msg::body_len(first[..4].try_into().ok()?).ok()?;
    let have = got - 4;
    let mut big = Vec::new();
    let body: &[u8] = if n <= first.len() - 4 {
        if have < n && !read_exact(fd, &mut first[got..4 + n]) {
            return None;
        }
        if have > n {
            log::warn(format_args!("agent sent {} bytes after its answer", have - n));
            return None;
        }
        &first[4..4 + n]
    } else {
        big.extend_from_slice(&first[4..got]);
        big.resize(n, 0);
        if !read_exact(fd, &mut big[have..]) {
            return None;
        }
        &big
    };
    match Msg::decode(body) {
        Ok(m) => Some(m),
        Err(e) => {
            log::warn(format_args!("agent sent a malformed answer: {e}"));
            None
        }
    }
}

fn program_name() -> String {
    std::fs::read_to_string("/proc/self/comm").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Opens the agent socket and says hello if that is not done yet; the socket, or `None`.
fn ensure(st: &mut State, now: u64) -> Option<i32> {
    if st.down_until > now {
        return None;
    }
    let mut fd = crate::ownfd::own_fd(OWN_AGENT);
    if fd >= 0 && st.said_hello {
        return Some(fd);
    }
    if fd < 0 {
        fd = match open_socket(OWN_AGENT) {
            Some(fd) => fd,
            None => {
                st.down_until = now + RETRY_NS;
                log::debug(format_args!("no node agent reachable: plain TCP"));
                return None;
            }
        };
    }
    crate::stats::table();
    SESSION.fetch_add(1, SeqCst);
    let stats_fd = crate::ownfd::own_fd(OWN_STATS);
    let hello = Msg::Hello { pid: crate::pid() as u32, name: program_name() };
    match exchange(fd, &hello, (stats_fd >= 0).then_some(stats_fd)) {
        Some(Msg::Ok) => {
            set_policy(None);
            st.said_hello = true;
        }
        Some(Msg::Welcome { chain, first_port, ports }) => {
            take_policy(&chain);
            PORT_BLOCK.store(u32::from(first_port) << 16 | u32::from(ports), Ordering::Relaxed);
            st.said_hello = true;
        }
        _ => return fail(st, now),
    }
    // A table of announced connections made in an earlier session (the agent restarted, or
    // this is a forked child) goes to this one.
    if let Some(t) = crate::accepts::existing_fd() {
        if !write_all(fd, &Msg::Table.encode(), Some(t)) {
            return fail(st, now);
        }
    }
    // First contact, or the agent restarted: it must know every listener we have (each
    // with its socket, the proof that we hold it).
    for (sock, addr) in ABOVE.get().map_or_else(Vec::new, |a| (a.listeners)()) {
        if exchange(fd, &Msg::Listen { addr, window: crate::config::window() }, Some(sock)).is_none() {
            return fail(st, now);
        }
    }
    Some(fd)
}

/// The node's default chains as the agent gave them (empty: none).
fn take_policy(chain: &str) {
    if chain.is_empty() {
        set_policy(None);
        return;
    }
    match substrate::connection::chain::Policy::parse([chain]) {
        Ok(p) => set_policy(Some(p)),
        Err(e) => {
            log::warn(format_args!("the node agent's default chains are not valid here ({e}): none"));
            set_policy(None);
        }
    }
}

/// How many times this process said hello to an agent (a new socket: the agent restarted,
/// or this is a forked child). What an agent gave in one session (tickets) is not used in
/// another: a restarted agent does not know it.
static SESSION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The current session with the agent (see [`SESSION`]).
pub fn session() -> u64 {
    SESSION.load(SeqCst)
}

/// The node's block of source ports for layered connections, from the agent's answer to our
/// `Hello`: first port in the high 16 bits, count in the low ones (0: none).
static PORT_BLOCK: AtomicU32 = AtomicU32::new(0);

/// The node's block of source ports for layered connections: first port and count.
pub fn port_block() -> Option<(u16, u16)> {
    let mut b = PORT_BLOCK.load(Ordering::Relaxed);
    if b == 0 {
        // Not told yet (the first connection of the process), or the node has none.
        hello();
        b = PORT_BLOCK.load(Ordering::Relaxed);
    }
    ((b & 0xffff) != 0).then_some(((b >> 16) as u16, b as u16))
}

/// The node's default chains, from the agent's answer to our `Hello` (read with one load:
/// set-up paths take no lock a fork could leave held).
static POLICY: std::sync::LazyLock<Kept<Option<substrate::connection::chain::Policy>>> =
    std::sync::LazyLock::new(Kept::default);

fn set_policy(p: Option<substrate::connection::chain::Policy>) {
    if POLICY.get().map_or(p.is_some(), |cur| *cur != p) {
        POLICY.set(p);
    }
}

/// The node's default chain for a connection with `peer` (the agent's `chain` rules), if
/// one applies.
pub fn default_chain(peer: std::net::IpAddr) -> Option<String> {
    POLICY.get()?.as_ref()?.chain_for(peer).map(String::from)
}

/// Introduces this process to the agent now (a new image that inherited connections).
pub fn hello() {
    let mut st = lock_awake();
    let _ = ensure(&mut st, sys::now_ns());
}

/// The node agent went away and one answers again (the control thread opened its event
/// channel anew): the request socket, if any, is the old agent's. A new one is opened now and
/// the process introduces itself again, which registers its listeners with the new agent at
/// once: otherwise only the process's next request would (an accept, a second after the one
/// that found the old agent gone), and connections to its listeners would be plain TCP until
/// then.
pub fn agent_back() {
    if QUIET.load(SeqCst) {
        // (A checkpoint: `wake_up` introduces the process again.)
        return;
    }
    let mut st = lock();
    close_socket(&mut st);
    st.down_until = 0;
    if ensure(&mut st, sys::now_ns()).is_some() {
        log::info(format_args!(
            "the node agent is back: this process introduced itself and its listeners again"
        ));
    }
}

/// True while the process gets ready for (or goes through) a checkpoint: it holds no agent
/// socket then, and requests wait.
static QUIET: AtomicBool = AtomicBool::new(false);

/// Closes the agent socket for a checkpoint (waiting for a request in flight); requests
/// wait until [`wake_up`].
pub fn quiesce() {
    QUIET.store(true, SeqCst);
    let mut st = lock();
    close_socket(&mut st);
}

/// After a checkpoint (here or restored elsewhere): talk to the node agent again, which
/// learns this process and its listeners anew.
pub fn wake_up() {
    QUIET.store(false, SeqCst);
    let mut st = lock();
    st.down_until = 0;
    st.plain.clear();
    let _ = ensure(&mut st, sys::now_ns());
}

/// The lock, once no checkpoint is under way (at most a few minutes: a thaw that never
/// comes is given up by the control thread).
fn lock_awake() -> MutexGuard<'static, State> {
    loop {
        while QUIET.load(SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let g = lock();
        if !QUIET.load(SeqCst) {
            return g;
        }
    }
}

/// Sends `m` to the node agent and returns its answer; `None` if there is no agent.
pub fn request(m: &Msg) -> Option<Msg> {
    request_passing(m, None)
}

/// As [`request`], handing the agent descriptor `pass_fd` with the message.
pub fn request_passing(m: &Msg, pass_fd: Option<i32>) -> Option<Msg> {
    if !crate::sandbox::may_set_up() {
        return None;
    }
    let answer = {
        let mut st = lock_awake();
        let now = sys::now_ns();
        let fd = ensure(&mut st, now)?;
        match exchange(fd, m, pass_fd) {
            Some(a) => Some(a),
            None => fail(&mut st, now),
        }
    };
    // Every process the agent knows keeps an event channel (the agent reaches it there,
    // e.g. before a checkpoint). Started outside the lock: fork takes the control thread's
    // lock first.
    if let Some(a) = ABOVE.get() {
        (a.after_contact)();
    }
    answer
}

/// Sends `m` to the node agent without waiting: for messages the agent does not answer.
pub fn tell(m: &Msg) {
    tell_passing(m, None)
}

/// As [`tell`], handing the agent descriptor `pass_fd` with the message.
fn tell_passing(m: &Msg, pass_fd: Option<i32>) {
    if !crate::sandbox::may_set_up() {
        return;
    }
    let mut st = lock_awake();
    let now = sys::now_ns();
    let Some(fd) = ensure(&mut st, now) else { return };
    if !write_all(fd, &m.encode(), pass_fd) {
        let _: Option<()> = fail(&mut st, now);
    }
}

/// Closes the agent socket (the agent closes it after an answer it calls an error): the
/// next request opens one and says hello again, without the pause a failure makes.
pub fn drop_socket() {
    close_socket(&mut lock());
}

/// Closes the agent socket; the next request opens one and says hello again.
fn close_socket(st: &mut State) {
    let fd = crate::ownfd::unprotect(OWN_AGENT);
    if fd >= 0 {
        sys::fd::close(fd);
    }
    st.said_hello = false;
}

fn fail<T>(st: &mut State, now: u64) -> Option<T> {
    close_socket(st);
    st.down_until = now + RETRY_NS;
    log::warn(format_args!("the node agent stopped answering: plain TCP for new connections for now"));
    None
}

/// This node's agent addresses (asked once, kept for 10 s: a migrated process learns its
/// new node's soon after).
pub fn own_addrs() -> Vec<SocketAddr> {
    static CACHE: std::sync::Mutex<(u64, Vec<SocketAddr>)> = std::sync::Mutex::new((0, Vec::new()));
    let now = sys::now_ns();
    {
        let c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if c.0 > now {
            return c.1.clone();
        }
    }
    let addrs = match request(&Msg::WhereAmI) {
        Some(Msg::Here { addrs }) => addrs,
        _ => Vec::new(),
    };
    let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    *c = (now + 10_000_000_000, addrs.clone());
    addrs
}

/// True if `dst` was recently found not to be a listener under the layer.
pub fn known_plain(dst: &SocketAddr) -> bool {
    let st = lock();
    st.plain.get(dst).is_some_and(|&t| t > sys::now_ns())
}

/// Remembers that `dst` is plain TCP for a while.
pub fn remember_plain(dst: SocketAddr) {
    let mut st = lock();
    if st.plain.len() > 4096 {
        st.plain.clear();
    }
    st.plain.insert(dst, sys::now_ns() + NEGATIVE_TTL_NS);
}

/// True when the agent is known to be unreachable right now.
pub fn known_down() -> bool {
    lock().down_until > sys::now_ns()
}

/// Tells the agent about a listener; true if it took note.
pub fn register_listener(addr: std::net::SocketAddr, sock: Option<i32>) -> bool {
    // The first listener makes the table of announced connections; it goes to the agent
    // before the registration (later sessions get it right after their hello).
    if crate::accepts::existing_fd().is_none() {
        if let Some(t) = crate::accepts::fd() {
            tell_passing(&Msg::Table, Some(t));
        }
    }
    // (With the listening socket: the proof that this process holds it.)
    match request_passing(&Msg::Listen { addr, window: crate::config::window() }, sock) {
        Some(Msg::Ok) => {
            log::debug(format_args!("listener {addr} registered"));
            true
        }
        _ => false,
    }
}
