//! Setting up virtual connections: what `connect`, `listen` and `accept` do besides the real
//! call. The rule: a connection becomes virtual only when the node agents *know* both ends
//! run the layer (the destination is a listener registered by a layer, and the connecting
//! layer registered the connection before its SYN left). Anything else stays plain TCP, byte
//! for byte, with no added delay on the data.

use crate::fdtable::{self, Entry, Listener};
use crate::vc::{Setup, Vc};
use crate::{agent, config, log, sys};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use substrate::wire::agent::Msg;

/// A connect the agents agreed to make virtual.
pub struct Pending {
    gid: u128,
    secret: u128,
    peer_window: u64,
    dst: SocketAddr,
    peer_agents: Vec<SocketAddr>,
    /// Where to connect instead of `dst` (its network is down), if anywhere.
    pub via: Option<SocketAddr>,
    /// Shared memory offered to the accepting layer (both ends on this node).
    shm: Option<crate::shm_sink::ShmLink>,
    /// Announced without a source port: the agent learns it after `connect`.
    unbound: bool,
    /// Made with a ticket (see `crate::tickets`), bound to this address: the agent learns of
    /// it after `connect`.
    ticket: Option<SocketAddr>,
}

/// What the agent answered before a `connect`. (It lives on the stack for one call, as the
/// bare `Pending` did: no box.)
#[allow(clippy::large_enum_variant)]
pub enum Before {
    /// The connection is virtual: set up once the real `connect` is made.
    Virtual(Pending),
    /// `dst` is no listener under the layer: the connection stays plain.
    Plain(SocketAddr),
}

/// Before the real `connect`: asks the agent whether `dst` is a listener under the layer and,
/// if so, registers the connection. A socket the program did not bind is announced without
/// its source port: the kernel picks the port at `connect` (per destination, as for any
/// connection, so a node is not held to one port per connection in all), and
/// [`after_connect`] tells the agent which one.
pub fn before_connect(fd: i32, dst: SocketAddr) -> Option<Before> {
    if config::disabled() || fdtable::is_managed(fd) || dst.port() == 0 || !crate::sandbox::may_set_up() {
        return None;
    }
    if !sys::is_tcp(fd) || agent::known_down() || agent::known_plain(&dst) {
        return None;
    }
    // (An address of either IP family, or `None`: the family is checked here.)
    let mut local = sys::local_addr(fd)?;
    if local.port() == 0 && local.ip().is_unspecified() && may_bind(fd) {
        if let Some(p) = ticketed(fd, local, dst) {
            return Some(Before::Virtual(p));
        }
        if let Some(bound) = bind_in_block(fd, local) {
            local = bound;
        }
    }
    let r: [u8; 32] = sys::random();
    let gid = u128::from_le_bytes(r[..16].try_into().ok()?);
    let secret = u128::from_le_bytes(r[16..].try_into().ok()?);
    let m =
        Msg::Connect { src: local, dst, gid, secret, window: config::window(), aim: dst, agents: Vec::new() };
    match agent::request(&m) {
        Some(Msg::Virtual { gid: issued, window, addrs, alias, .. }) => {
            // The agent puts its cluster's id in the GID's top bits; the rest is ours.
            if !substrate::Gid(issued).same_draw(substrate::Gid(gid)) {
                log::warn(format_args!(
                    "the node agent answered a connect with GID {issued:032x}, not ours ({gid:032x}): plain TCP"
                ));
                return None;
            }
            let gid = issued;
            let via = (alias.port() != 0).then(|| {
                log::info(format_args!("the network toward {dst} is down: connecting through {alias}"));
                alias
            });
            // Offered before the SYN leaves, so the accepting layer finds it at accept.
            let shm = (via.is_none() && crate::shm_sink::same_node(&addrs))
                .then(|| shm_offer(gid, secret, dst))
                .flatten();
            if !crate::shm_sink::same_node(&addrs) {
                sink_asked(dst);
            }
            if via.is_none() && dst.is_ipv4() {
                // Its next connections may come with tickets (to a listener on this node
                // too: its agent expects them at once).
                crate::tickets::note_virtual(dst);
            }
            let unbound = local.port() == 0;
            Some(Before::Virtual(Pending {
                gid,
                secret,
                peer_window: window,
                dst,
                peer_agents: addrs,
                via,
                shm,
                unbound,
                ticket: None,
            }))
        }
        Some(Msg::Plain) => {
            // Remembered only once the real `connect` is under way (`plain_connect`): a
            // client that tries before its server listens asks again on its next try.
            Some(Before::Plain(dst))
        }
        Some(other) => {
            log::debug(format_args!("agent answered {other:?} to a connect: plain TCP"));
            None
        }
        None => None,
    }
}

/// Shared memory offered, before the SYN leaves, for a new connection to `dst` on this node
/// (`None` when it is off or cannot be had). When `dst` is a listener of this very process,
/// its `accept` of the connection is this process's own, and a send does not wait for it
/// (`ShmLink::to_own_listener`).
fn shm_offer(gid: u128, secret: u128, dst: SocketAddr) -> Option<crate::shm_sink::ShmLink> {
    if !config::shm() {
        return None;
    }
    let l = crate::shm_sink::ShmLink::offer(gid, secret, 0, (0, 0))?;
    let own = fdtable::listeners()
        .iter()
        .any(|(_, a)| a.port() == dst.port() && (a.ip().is_unspecified() || a.ip() == dst.ip()));
    Some(if own { l.to_own_listener() } else { l })
}

/// Most tickets one `connect` tries (each one's port may be held by another socket).
const TICKET_TRIES: u32 = 4;

/// True when the layer may bind an unbound socket to a port of its choosing: the sandbox
/// allows `bind`, and the program did not ask for address reuse (its `connect` could then
/// meet a connection in TIME_WAIT with the same addresses).
fn may_bind(fd: i32) -> bool {
    crate::sandbox::allows_nr(libc::SYS_bind)
        && sys::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR) == Some(0)
        && sys::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_REUSEPORT) == Some(0)
}

/// A connection to `dst` made with a ticket (see `crate::tickets`): the socket bound to the
/// ticket's port, and the connection virtual without a word to the agent before `connect`.
/// `None` when there is no ticket to be had (or the tickets' ports are all held).
fn ticketed(fd: i32, unbound: SocketAddr, dst: SocketAddr) -> Option<Pending> {
    if !unbound.is_ipv4() || !dst.is_ipv4() {
        return None;
    }
    for _ in 0..TICKET_TRIES {
        let t = crate::tickets::take(dst)?;
        // (The address it was announced with, not the wildcard: the kernel could pick
        // another source address for the connection, which the listener's node would not
        // find announced.)
        if sys::fd::bind(fd, &sys::fd::RawAddr::ip(&t.src, false)) == 0 {
            // A listener on this node: the rings are offered before the SYN leaves, as for
            // a connection the agent answered.
            let shm = crate::shm_sink::same_node(&t.addrs).then(|| shm_offer(t.gid, t.secret, dst)).flatten();
            return Some(Pending {
                gid: t.gid,
                secret: t.secret,
                peer_window: t.window,
                dst,
                peer_agents: t.addrs,
                via: None,
                shm,
                unbound: false,
                ticket: Some(t.src),
            });
        }
        let e = sys::errno();
        crate::tickets::give_back(t.gid, e == libc::EADDRINUSE);
        if e != libc::EADDRINUSE {
            return None;
        }
    }
    None
}

/// Where the next search of the node's port block starts (0: not chosen yet).
static CURSOR: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Most ports of the block one `connect` tries.
const BIND_TRIES: u32 = 16;

/// Binds a socket the program did not bind to a free port of the node's block of source
/// ports for layered connections (which the agent reserved, so that the kernel gives them to
/// no other socket), so that the connection is announced with its source port: the
/// accepting side's agent then finds it at once, where a connection announced without its
/// port waits for the port to follow through both agents. A port some socket holds (in
/// TIME_WAIT too: no `SO_REUSEADDR` here) is skipped for another, drawn at random; after
/// [`BIND_TRIES`] taken ports, or no block, the socket stays unbound and is announced
/// without its port. (The caller looked that the layer may bind it: [`may_bind`].) The
/// address bound, or `None`.
fn bind_in_block(fd: i32, unbound: SocketAddr) -> Option<SocketAddr> {
    use std::sync::atomic::Ordering::Relaxed;
    let (first, count) = agent::port_block()?;
    if FULL_UNTIL.load(Relaxed) > sys::now_ns() {
        return None;
    }
    let count = u32::from(count);
    // (Kept plus one: 0 is "not chosen yet".) Processes of the node start at different
    // places of the block.
    let mut at = match CURSOR.load(Relaxed) {
        0 => u32::from_le_bytes(sys::random16()[..4].try_into().ok()?),
        c => c - 1,
    };
    let v6 = unbound.is_ipv6();
    for _ in 0..BIND_TRIES {
        let port = first as u32 + at % count;
        let a = SocketAddr::new(unbound.ip(), port as u16);
        if sys::fd::bind(fd, &sys::fd::RawAddr::ip(&a, v6)) == 0 {
            // The next connection takes the next port.
            CURSOR.store(at.wrapping_add(2), Relaxed);
            return Some(a);
        }
        if sys::errno() != libc::EADDRINUSE {
            return None;
        }
        // Taken: somewhere else in the block, not the next port (a process that connected
        // many times holds a run of ports, in TIME_WAIT for a minute after they close).
        at |= 1;
        at ^= at << 13;
        at ^= at >> 17;
        at ^= at << 5;
    }
    CURSOR.store(at.wrapping_add(1), Relaxed);
    // (Many connections at once can hold the whole block: not tried again for a while.)
    FULL_UNTIL.store(sys::now_ns() + BLOCK_FULL_NS, Relaxed);
    None
}

/// Until when (`sys::now_ns`) the block is taken to be full.
static FULL_UNTIL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How long a block found full is not tried again.
const BLOCK_FULL_NS: u64 = 100_000_000;

/// `VMI_SUBSTRATE` named a sink plug-in: the first connection to another node asks the agent
/// whether the node has devices for it (the agent probed its plug-ins at start; the program
/// loads none of their libraries to learn it). The layer does not carry connections over
/// plug-in sinks yet, so the answer picks kernel TCP either way, with one log line that says
/// why; later connections do not ask again.
fn sink_asked(dst: SocketAddr) {
    static TOLD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(name) = config::sink() else { return };
    if TOLD.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    match agent::request(&Msg::Sink { name: name.to_string() }) {
        Some(Msg::SinkReply { devices, why }) if devices > 0 => log::warn(format_args!(
            "VMI_SUBSTRATE={name}: the node has {devices} devices ({why}), but connections do not run over sink plug-ins yet: kernel TCP to {dst} and every other node"
        )),
        Some(Msg::SinkReply { devices: 0, why }) => log::warn(format_args!(
            "VMI_SUBSTRATE={name}: {why}: kernel TCP to {dst} and every other node"
        )),
        Some(Msg::SinkReply { why, .. }) => {
            log::warn(format_args!("VMI_SUBSTRATE={name}: not usable here ({why}): kernel TCP to {dst} and every other node"))
        }
        _ => log::warn(format_args!(
            "VMI_SUBSTRATE={name}: the node agent did not say whether the node has devices for it: kernel TCP to {dst} and every other node"
        )),
    }
}

/// After the real `connect` to `dst`, which the agent said is no listener under the layer,
/// was made (or is under way): that answer is kept a while, so that more connections there
/// do not ask again. (A refused one is not kept.)
pub fn plain_connect(dst: SocketAddr) {
    agent::remember_plain(dst);
}

/// After the real `connect` succeeded or is in progress: the socket is virtual from now on.
/// `in_progress`: the `connect` returned before the handshake completed.
pub fn after_connect(fd: i32, p: Pending, in_progress: bool) {
    // (A ticket's address was bound whole: not asked of the kernel again.)
    let local = p
        .ticket
        .or_else(|| sys::local_addr(fd))
        .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
    if p.ticket.is_some() {
        crate::tickets::opened(p.gid);
        crate::relink::hold_later(&Msg::Used { gid: p.gid, local });
    }
    if p.unbound {
        // The accepting side's agent holds the accept until this comes (or a short time
        // passes): sent before anything else, not waited for.
        agent::tell(&Msg::Bound { ports: vec![(p.gid, local)] });
    }
    let s = Setup {
        gid: p.gid,
        secret: p.secret,
        window: config::window(),
        peer_window: p.peer_window,
        local,
        peer: p.dst,
        active: true,
        peer_agents: p.peer_agents,
        renamed: p.via.is_some(),
        shm: p.shm,
    };
    match Vc::new(s) {
        Some(vc) => {
            if in_progress {
                vc.mem().conn().unconfirmed.store(1, std::sync::atomic::Ordering::Release);
            }
            log::info(format_args!("virtual connection {:032x}: {local} -> {}", p.gid, p.dst));
            if let (Some(via), Some(sl)) = (p.via, vc.slot()) {
                sl.set_link(&local, &via);
            }
            offer_configured_chain(&vc, fd, p.dst.ip());
            fdtable::insert(fd, Entry::Vc(Arc::new(vc)));
            crate::relink::held();
        }
        None => {
            log::error(format_args!(
                "cannot map memory for virtual connection {:032x}; the peer expects frames, closing",
                p.gid
            ));
            crate::relink::released(p.gid, true, false);
        }
    }
}

/// The chain for a new connection with `peer`: `VMI_CHAIN` when the program's environment
/// gives one (`none` for none), else the node's default for that peer (the agent's `chain`
/// rules), else none.
pub fn chain_for(peer: std::net::IpAddr) -> String {
    match config::chain_env() {
        Some(c) => c.to_string(),
        None => agent::default_chain(peer).unwrap_or_default(),
    }
}

/// The chain for this connection (see [`chain_for`]) is offered for what this side sends,
/// with its first frame (on shared memory, with the first frame of its first TCP link: the
/// chain stands aside while the bytes stay on this node).
fn offer_configured_chain(vc: &Vc, fd: i32, peer: std::net::IpAddr) {
    let spec = chain_for(peer);
    if spec.is_empty() {
        return;
    }
    let from = if config::chain_env().is_some() { "VMI_CHAIN" } else { "the node's default chain" };
    match vc.offer_chain(fd, &spec, false) {
        Err(e) => log::warn(format_args!(
            "virtual connection {:032x}: chain \"{spec}\" ({from}) not offered: {}",
            vc.mem().conn().gid,
            std::io::Error::from_raw_os_error(crate::error::errno_of(e).0)
        )),
        Ok(_) if vc.on_shm_the_chain_stands_aside() => log::debug(format_args!(
            "virtual connection {:032x}: chain \"{spec}\" ({from}) stands aside on shared memory; it codes \
             from the connection's first TCP link on",
            vc.mem().conn().gid
        )),
        Ok(_) => {}
    }
}

/// The real `connect` failed: the connection the agent set up for it never existed here.
pub fn connect_failed(p: Pending) {
    if p.unbound {
        // Port 0: never bound; the accepting side need not wait for it.
        let none = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
        agent::tell(&Msg::Bound { ports: vec![(p.gid, none)] });
    }
    crate::relink::released(p.gid, true, false);
}

/// Before `listen` on a socket already bound to an address: registers the listener with
/// the agent (so that it knows the listener before the first SYN can be taken); the address
/// registered, if any.
pub fn before_listen(fd: i32) -> Option<SocketAddr> {
    if config::disabled() || !crate::sandbox::may_set_up() || sys::tcp_family(fd).is_none() {
        return None;
    }
    let addr = sys::local_addr(fd)?;
    if addr.port() == 0 {
        // Not bound: `listen` picks the port.
        return None;
    }
    agent::register_listener(addr, Some(fd)).then_some(addr)
}

/// After a successful `listen`: the socket is a listener of the layer's from now on; it is
/// registered with the agent here unless [`before_listen`] did.
pub fn after_listen(fd: i32, registered: Option<SocketAddr>) {
    if config::disabled() || !crate::sandbox::may_set_up() || sys::tcp_family(fd).is_none() {
        return;
    }
    let Some(addr) = sys::local_addr(fd) else { return };
    // Kept even if no agent answers now: the listener is registered whenever the process
    // next reaches an agent (a restarted one included).
    fdtable::insert(fd, Entry::Listener(Arc::new(Listener { addr })));
    if registered != Some(addr) {
        agent::register_listener(addr, Some(fd));
    }
}

/// `listen` failed after [`before_listen`] registered `addr`: unregistered, unless another
/// listener of this process has that address.
pub fn listen_failed(addr: SocketAddr) {
    if !fdtable::listeners().iter().any(|(_, a)| *a == addr) {
        let _ = agent::request(&Msg::Unlisten { addr });
    }
}

/// A listener is closed for good.
pub fn closed_listener(l: &Listener) {
    let _ = agent::request(&Msg::Unlisten { addr: l.addr });
}

/// After a successful `accept` on a registered listener: asks the agent whether the
/// connection is virtual.
pub fn after_accept(listen_fd: i32, fd: i32) {
    let Some(Entry::Listener(_)) = fdtable::get(listen_fd) else { return };
    if !crate::sandbox::may_set_up() {
        // (The listeners were taken back from the agent when the sandbox went in.)
        return;
    }
    let (Some(local), Some(peer)) = (sys::local_addr(fd), sys::peer_addr(fd)) else { return };
    // Announced to this process's listener: in the table the agent shares with us (nothing
    // to wait for; the agent hears of it after), or else asked.
    let answer = match crate::accepts::take(local, peer) {
        Some(e) => {
            crate::relink::hold_later(&Msg::Accepted { local, peer, gid: e.gid });
            Some(Msg::Virtual {
                gid: e.gid,
                secret: e.secret,
                window: e.window,
                addrs: e.agents,
                alias: e.alias.unwrap_or(substrate::wire::agent::NO_ADDR),
            })
        }
        // (With the accepted socket: only a process holding it may learn the connection.)
        None => agent::request_passing(&Msg::Accept { local, peer }, Some(fd)),
    };
    let Some(Msg::Virtual { gid, secret, window, addrs, alias }) = answer else {
        return;
    };
    // The connecting program asked for another address of this node (its network was down):
    // that is the local address this program sees.
    let renamed = alias.port() != 0;
    let local = if renamed { alias } else { local };
    // The connecting layer may have offered shared memory (both ends on this node).
    let shm = if crate::shm_sink::same_node(&addrs) {
        crate::shm_sink::ShmLink::accept(gid, secret, 0, fd, config::shm(), (0, 0))
    } else {
        None
    };
    let s = Setup {
        gid,
        secret,
        window: config::window(),
        peer_window: window,
        local,
        peer,
        active: false,
        peer_agents: addrs,
        renamed,
        shm,
    };
    match Vc::new(s) {
        Some(vc) => {
            log::info(format_args!("virtual connection {gid:032x}: {local} <- {peer}"));
            // (Only then: the address is asked of the kernel.)
            if renamed {
                if let (Some(sl), Some(l)) = (vc.slot(), sys::local_addr(fd)) {
                    sl.set_link(&l, &peer);
                }
            }
            offer_configured_chain(&vc, fd, peer.ip());
            fdtable::insert(fd, Entry::Vc(Arc::new(vc)));
            crate::relink::held();
        }
        None => {
            log::error(format_args!("cannot map memory for virtual connection {gid:032x}; closing it"));
            crate::relink::released(gid, false, false);
            crate::sys::fd::shutdown(fd, libc::SHUT_RDWR);
        }
    }
}
