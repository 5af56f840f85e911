//! The node's directory: listeners under the layer, and connections announced by connecting
//! layers and not yet accepted. Pure data; the callers do the I/O.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// How long an announced connection waits for its accept.
pub const PENDING_TTL: Duration = Duration::from_secs(30);

/// How long a connection announced without its source port waits for the port (the
/// layer sends it right after `connect`; a process killed in between never does).
pub const UNBOUND_TTL: Duration = Duration::from_secs(5);

/// A registered listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerRec {
    /// Address it listens on (IP may be unspecified).
    pub addr: SocketAddr,
    /// Window of its process.
    pub window: u64,
    /// Which local client registered it.
    pub owner: u64,
}

/// An announced connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    /// GID.
    pub gid: u128,
    /// Secret.
    pub secret: u128,
    /// The connecting side's window.
    pub window: u64,
    /// When it was announced.
    pub at: Instant,
    /// The destination the connecting program asked for (another address of this node
    /// when its own network is down).
    pub aim: SocketAddr,
    /// The connecting node's agent addresses.
    pub agents: Vec<SocketAddr>,
}

/// What an accepted connection is, as far as the directory knows now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Announced: a virtual connection.
    Found(Expected),
    /// Not announced, but a connection to the same address was announced without its port,
    /// whose port has not come yet: it may be this one.
    Wait,
    /// Plain TCP.
    Plain,
}

/// A listener whose process moved to another node: connections to it go there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forward {
    /// The address it listened on here.
    pub addr: SocketAddr,
    /// The agent addresses of the node it moved to.
    pub to: Vec<SocketAddr>,
}

/// Another node whose agent announces connections to a listener here one way
/// ([`Directory::subscribe`]), each from a source port of its block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sub {
    /// The listener's registered address.
    pub listener: SocketAddr,
    /// The destination the other node's connections go to (what it asked about).
    pub dst: SocketAddr,
    /// The other node's address (the one its agent's channel came from).
    pub node: IpAddr,
    /// Its block of source ports: first, count.
    pub block: (u16, u16),
}

impl Sub {
    fn covers(&self, peer: SocketAddr) -> bool {
        let (first, count) = (u32::from(self.block.0), u32::from(self.block.1));
        peer.ip() == self.node && (first..first + count).contains(&u32::from(peer.port()))
    }
}

/// Most subscriptions kept (a node each per listener).
pub const MAX_SUBS: usize = 65536;

/// Listeners and expected connections.
#[derive(Default, Debug)]
pub struct Directory {
    listeners: Vec<ListenerRec>,
    expected: HashMap<(SocketAddr, SocketAddr), Expected>,
    /// Announced without a source port (the kernel picks it at `connect`), by GID: the
    /// destination and the rest.
    unbound: HashMap<u128, (SocketAddr, Expected)>,
    swept: Option<Instant>,
    forwards: Vec<Forward>,
    /// Connections announced lately to an address where nothing listened (the newest last):
    /// their programs may be trying again and again until a server listens.
    misses: std::collections::VecDeque<(SocketAddr, Instant)>,
    subs: Vec<Sub>,
}

/// How long after a connection was announced to an address where nothing listened a new
/// listener there holds its `listen` (see [`Directory::listen`]).
pub const MISS_HOLD: Duration = Duration::from_millis(50);
/// Most misses remembered.
const MISSES: usize = 64;

impl Directory {
    /// Records a listener (idempotent per owner and address). A listener that comes back
    /// here ends the forward of its address.
    ///
    /// Returns how long the program should wait before it really listens: a connection
    /// announced here a moment ago, when nothing listened, was answered "plain", and its
    /// program may connect again any moment (a client that starts before its server). Had
    /// the kernel taken its connection before the answer reached it, the connection would be
    /// plain at both ends; the wait lets such answers land first (any later announcement
    /// finds the listener).
    pub fn listen(&mut self, addr: SocketAddr, window: u64, owner: u64) -> Duration {
        self.listen_at(addr, window, owner, Instant::now())
    }

    /// [`Directory::listen`] at time `now`.
    pub fn listen_at(&mut self, addr: SocketAddr, window: u64, owner: u64, now: Instant) -> Duration {
        self.forwards.retain(|f| f.addr != addr);
        if !self.listeners.iter().any(|l| l.addr == addr && l.owner == owner) {
            self.listeners.push(ListenerRec { addr, window, owner });
        }
        let takes = |d: &SocketAddr| {
            *d == addr
                || (d.port() == addr.port()
                    && addr.ip().is_unspecified()
                    && (matches!(addr.ip(), IpAddr::V6(_)) || d.is_ipv4()))
        };
        self.misses
            .iter()
            .rev()
            .find(|(d, _)| takes(d))
            .map_or(Duration::ZERO, |(_, t)| MISS_HOLD.saturating_sub(now.saturating_duration_since(*t)))
    }

    /// Listening addresses registered by any of `owners`.
    pub fn listeners_of(&self, owners: &[u64]) -> Vec<SocketAddr> {
        let mut v: Vec<SocketAddr> =
            self.listeners.iter().filter(|l| owners.contains(&l.owner)).map(|l| l.addr).collect();
        v.dedup();
        v
    }

    /// The listener at `addr` moved to the node whose agents are at `to` (replaces an older
    /// forward for the same address).
    pub fn forward(&mut self, addr: SocketAddr, to: Vec<SocketAddr>) {
        self.forwards.retain(|f| f.addr != addr);
        if !to.is_empty() {
            self.forwards.push(Forward { addr, to });
        }
    }

    /// Where a connection to `dst` must go instead, when no listener here takes it and the
    /// listener that did moved away.
    pub fn forward_for(&self, dst: SocketAddr) -> Option<&Forward> {
        if self.listener_for(dst).is_some() {
            return None;
        }
        let exact = self.forwards.iter().find(|f| f.addr == dst);
        exact.or_else(|| {
            self.forwards.iter().find(|f| {
                f.addr.port() == dst.port()
                    && f.addr.ip().is_unspecified()
                    && (matches!(f.addr.ip(), IpAddr::V6(_)) || dst.is_ipv4())
            })
        })
    }

    /// Forwards, for reports.
    pub fn forwards(&self) -> &[Forward] {
        &self.forwards
    }

    /// Forgets a listener.
    pub fn unlisten(&mut self, addr: SocketAddr, owner: u64) {
        self.listeners.retain(|l| !(l.addr == addr && l.owner == owner));
    }

    /// Forgets every listener of a client that went away.
    pub fn drop_owner(&mut self, owner: u64) {
        self.listeners.retain(|l| l.owner != owner);
    }

    /// Listeners, for reports.
    pub fn listeners(&self) -> &[ListenerRec] {
        &self.listeners
    }

    /// The listener that would accept a connection to `dst` (an address of this node).
    pub fn listener_for(&self, dst: SocketAddr) -> Option<&ListenerRec> {
        let exact = self.listeners.iter().find(|l| l.addr == dst);
        exact.or_else(|| {
            self.listeners.iter().find(|l| {
                l.addr.port() == dst.port()
                    && l.addr.ip().is_unspecified()
                    && (matches!(l.addr.ip(), IpAddr::V6(_)) || dst.is_ipv4())
            })
        })
    }

    /// A connecting layer announces `src → dst`. Returns the listener's window if `dst` is a
    /// listener under the layer (the connection is then expected), `None` otherwise. A
    /// source port 0 means the port comes later ([`Directory::bind`]).
    pub fn expect(&mut self, src: SocketAddr, dst: SocketAddr, e: Expected) -> Option<u64> {
        let Some(w) = self.listener_for(dst).map(|l| l.window) else {
            if self.misses.len() == MISSES {
                self.misses.pop_front();
            }
            self.misses.push_back((dst, e.at));
            return None;
        };
        let now = e.at;
        // Expired entries go at most once per 1/64 of the time to live (a sweep of every
        // entry at each announcement would cost O(n) per connection at 100,000 pending).
        if self.swept.is_none_or(|t| now.saturating_duration_since(t) > PENDING_TTL / 64) {
            self.expected.retain(|_, x| now.saturating_duration_since(x.at) < PENDING_TTL);
            self.unbound.retain(|_, x| now.saturating_duration_since(x.1.at) < UNBOUND_TTL);
            self.swept = Some(now);
        }
        if src.port() == 0 {
            self.unbound.insert(e.gid, (dst, e));
        } else {
            self.expected.insert((src, dst), e);
        }
        Some(w)
    }

    /// The kernel bound connection `gid`, announced without a port, to `src`: expected from
    /// there now. False if no such announcement waits here.
    pub fn bind(&mut self, gid: u128, src: SocketAddr) -> bool {
        match self.unbound.remove(&gid) {
            Some((dst, e)) => {
                self.expected.insert((src, dst), e);
                true
            }
            None => false,
        }
    }

    /// A listener accepted `peer → local`: the expected connection if it was announced;
    /// [`Lookup::Wait`] while a connection to `local` announced without a port may still be
    /// this one, or while `peer` is a source port of a node that announces its connections
    /// to this listener one way (the announcement may still be on its way).
    pub fn accept(&mut self, local: SocketAddr, peer: SocketAddr) -> Lookup {
        if let Some(e) = self.expected.remove(&(peer, local)) {
            return Lookup::Found(e);
        }
        if self.unbound.values().any(|(dst, _)| *dst == local) || self.may_be_announced(local, peer) {
            Lookup::Wait
        } else {
            Lookup::Plain
        }
    }

    /// The listener's process took `peer → local` (GID `gid`) from its table: the
    /// directory forgets it. False when it was not here (expired, or a newer announcement
    /// of the same addresses replaced it, which then stays).
    pub fn taken(&mut self, local: SocketAddr, peer: SocketAddr, gid: u128) -> bool {
        if self.expected.get(&(peer, local)).is_some_and(|e| e.gid == gid) {
            self.expected.remove(&(peer, local));
            return true;
        }
        false
    }

    fn may_be_announced(&self, local: SocketAddr, peer: SocketAddr) -> bool {
        if self.subs.is_empty() {
            return false;
        }
        let Some(l) = self.listener_for(local) else { return false };
        self.subs.iter().any(|s| s.listener == l.addr && s.covers(peer))
    }

    /// The agent of the node at `node` will announce its connections to `dst` one way, from
    /// source ports of `block`: accepts of connections from there wait for their
    /// announcements. False when no listener here takes `dst` (or too many are kept).
    pub fn subscribe(&mut self, dst: SocketAddr, node: IpAddr, block: (u16, u16)) -> bool {
        let Some(listener) = self.listener_for(dst).map(|l| l.addr) else { return false };
        if block.1 == 0 || u32::from(block.0) + u32::from(block.1) > 65536 {
            return false;
        }
        if let Some(s) = self.subs.iter_mut().find(|s| s.dst == dst && s.node == node) {
            s.listener = listener;
            s.block = block;
            return true;
        }
        if self.subs.len() >= MAX_SUBS {
            return false;
        }
        self.subs.push(Sub { listener, dst, node, block });
        true
    }

    /// Subscriptions whose listener is gone (unregistered, or moved to another node): taken
    /// out, for their nodes to be told.
    pub fn gone_subs(&mut self) -> Vec<Sub> {
        if self.subs.is_empty() {
            return Vec::new();
        }
        let (listeners, forwards) = (&self.listeners, &self.forwards);
        let (gone, kept) = std::mem::take(&mut self.subs).into_iter().partition(|s: &Sub| {
            !listeners.iter().any(|l| l.addr == s.listener) || forwards.iter().any(|f| f.addr == s.listener)
        });
        self.subs = kept;
        gone
    }

    /// Subscriptions, for reports.
    pub fn subs(&self) -> &[Sub] {
        &self.subs
    }

    /// Connections announced and not accepted yet.
    pub fn expected_count(&self) -> usize {
        self.expected.len() + self.unbound.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn ex(gid: u128, secret: u128, window: u64, aim: SocketAddr, at: Instant) -> Expected {
        Expected { gid, secret, window, at, aim, agents: Vec::new() }
    }

    #[test]
    fn expect_then_accept_once() {
        let mut d = Directory::default();
        let now = Instant::now();
        assert_eq!(d.expect(a("10.0.0.2:4000"), a("10.0.0.1:80"), ex(1, 2, 3, a("10.0.0.1:80"), now)), None);
        d.listen(a("0.0.0.0:80"), 77, 1);
        assert_eq!(
            d.expect(a("10.0.0.2:4000"), a("10.0.0.1:80"), ex(1, 2, 3, a("10.0.0.1:80"), now)),
            Some(77)
        );
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.2:4001")), Lookup::Plain);
        let Lookup::Found(e) = d.accept(a("10.0.0.1:80"), a("10.0.0.2:4000")) else { panic!("announced") };
        assert_eq!((e.gid, e.secret, e.window), (1, 2, 3));
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.2:4000")), Lookup::Plain, "consumed");
    }

    #[test]
    fn announced_without_port_then_bound() {
        let mut d = Directory::default();
        let now = Instant::now();
        d.listen(a("0.0.0.0:80"), 77, 1);
        assert_eq!(d.expect(a("10.0.0.2:0"), a("10.0.0.1:80"), ex(9, 2, 3, a("10.0.0.1:80"), now)), Some(77));
        // Accepted before the port came: it may be the announced one.
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.2:41000")), Lookup::Wait);
        // Another address of the node is not concerned.
        assert_eq!(d.accept(a("10.0.1.1:80"), a("10.0.1.2:41000")), Lookup::Plain);
        assert!(!d.bind(8, a("10.0.0.2:41000")), "no such announcement");
        assert!(d.bind(9, a("10.0.0.2:41000")));
        assert!(!d.bind(9, a("10.0.0.2:41000")), "bound once");
        let Lookup::Found(e) = d.accept(a("10.0.0.1:80"), a("10.0.0.2:41000")) else { panic!("bound") };
        assert_eq!(e.gid, 9);
        // Nothing waits any more: a plain connection is plain at once.
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.2:41001")), Lookup::Plain);
        assert_eq!(d.expected_count(), 0);
    }

    #[test]
    fn a_subscribed_node_s_ports_wait_for_their_announcement_and_a_gone_listener_ends_it() {
        let mut d = Directory::default();
        let now = Instant::now();
        let node: IpAddr = "10.0.0.2".parse().unwrap();
        assert!(!d.subscribe(a("10.0.0.1:80"), node, (59000, 2000)), "no listener");
        d.listen(a("0.0.0.0:80"), 77, 1);
        assert!(!d.subscribe(a("10.0.0.1:80"), node, (65000, 2000)), "past port 65535");
        assert!(d.subscribe(a("10.0.0.1:80"), node, (59000, 2000)));
        assert!(d.subscribe(a("10.0.0.1:80"), node, (59000, 2000)), "again: one subscription");
        assert_eq!(d.subs().len(), 1);
        // From the node's block: may be announced yet; from elsewhere: plain at once.
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.2:59100")), Lookup::Wait);
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.2:41000")), Lookup::Plain);
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.3:59100")), Lookup::Plain);
        assert_eq!(d.accept(a("10.0.0.1:81"), a("10.0.0.2:59100")), Lookup::Plain);
        // The announcement comes: found.
        d.expect(a("10.0.0.2:59100"), a("10.0.0.1:80"), ex(5, 6, 7, a("10.0.0.1:80"), now));
        let Lookup::Found(e) = d.accept(a("10.0.0.1:80"), a("10.0.0.2:59100")) else { panic!("announced") };
        assert_eq!(e.gid, 5);
        // Another owner's listener on the address keeps it; the last one's end takes it out.
        d.listen(a("0.0.0.0:80"), 77, 2);
        d.unlisten(a("0.0.0.0:80"), 1);
        assert!(d.gone_subs().is_empty());
        d.drop_owner(2);
        let gone = d.gone_subs();
        assert_eq!(gone.len(), 1);
        assert_eq!((gone[0].dst, gone[0].node), (a("10.0.0.1:80"), node));
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.2:59100")), Lookup::Plain);
        // A listener that moved away ends its subscriptions too.
        d.listen(a("10.0.0.1:90"), 1, 3);
        assert!(d.subscribe(a("10.0.0.1:90"), node, (59000, 2000)));
        d.forward(a("10.0.0.1:90"), vec![a("10.0.0.9:7787")]);
        assert_eq!(d.gone_subs().len(), 1);
        assert!(d.subs().is_empty());
    }

    #[test]
    fn unbound_announcements_expire() {
        let mut d = Directory::default();
        d.listen(a("0.0.0.0:80"), 1, 1);
        let t0 = Instant::now();
        d.expect(a("10.0.0.2:0"), a("10.0.0.1:80"), ex(1, 1, 1, a("10.0.0.1:80"), t0));
        d.expect(a("10.0.0.2:0"), a("10.0.0.1:80"), ex(2, 1, 1, a("10.0.0.1:80"), t0 + UNBOUND_TTL * 2));
        assert_eq!(d.expected_count(), 1, "the first one's process never said its port");
    }

    #[test]
    fn specific_listener_and_owner_cleanup() {
        let mut d = Directory::default();
        d.listen(a("127.0.0.1:6379"), 1, 5);
        assert!(d.listener_for(a("127.0.0.1:6379")).is_some());
        assert!(d.listener_for(a("10.0.0.1:6379")).is_none());
        d.listen(a("[::]:22"), 1, 6);
        assert!(d.listener_for(a("10.0.0.1:22")).is_some(), "dual-stack wildcard");
        d.drop_owner(5);
        assert!(d.listener_for(a("127.0.0.1:6379")).is_none());
    }

    #[test]
    fn forwards_only_where_no_listener_takes_it() {
        let mut d = Directory::default();
        let to = vec![a("10.0.0.3:7946")];
        d.forward(a("0.0.0.0:80"), to.clone());
        assert_eq!(d.forward_for(a("10.0.0.1:80")).map(|f| f.to.clone()), Some(to.clone()));
        assert!(d.forward_for(a("10.0.0.1:81")).is_none());
        d.forward(a("10.0.0.1:6379"), to.clone());
        assert!(d.forward_for(a("10.0.0.1:6379")).is_some());
        assert!(d.forward_for(a("10.0.1.1:6379")).is_none(), "a specific address forwards only itself");
        // The listener came back: no forward any more.
        d.listen(a("0.0.0.0:80"), 1, 1);
        assert!(d.forward_for(a("10.0.0.1:80")).is_none());
        assert_eq!(d.forwards().len(), 1);
        d.listen(a("0.0.0.0:443"), 1, 7);
        d.listen(a("10.0.0.1:8080"), 1, 7);
        d.listen(a("10.0.0.1:9090"), 1, 8);
        assert_eq!(d.listeners_of(&[7]), vec![a("0.0.0.0:443"), a("10.0.0.1:8080")]);
    }

    #[test]
    fn stale_expectations_expire() {
        let mut d = Directory::default();
        d.listen(a("0.0.0.0:80"), 1, 1);
        let t0 = Instant::now();
        d.expect(a("10.0.0.2:1"), a("10.0.0.1:80"), ex(1, 1, 1, a("10.0.0.1:80"), t0));
        d.expect(
            a("10.0.0.2:2"),
            a("10.0.0.1:80"),
            ex(1, 1, 1, a("10.0.0.1:80"), t0 + PENDING_TTL + Duration::from_secs(1)),
        );
        assert_eq!(d.expected_count(), 1);
    }

    #[test]
    fn a_listener_where_a_connection_just_found_none_waits_before_it_listens() {
        let mut d = Directory::default();
        let t0 = Instant::now();
        let e = |at| Expected { gid: 1, secret: 2, window: 3, at, aim: a("10.0.0.1:80"), agents: vec![] };
        assert_eq!(d.expect(a("10.0.0.2:5000"), a("10.0.0.1:80"), e(t0)), None);
        // Another address, or long after: no wait.
        assert_eq!(d.listen_at(a("10.0.0.1:81"), 1, 1, t0), Duration::ZERO);
        assert_eq!(d.listen_at(a("10.0.0.1:80"), 1, 1, t0 + MISS_HOLD * 2), Duration::ZERO);
        // A listener on that address (or the wildcard of its port) right after: the rest of
        // the hold.
        let mut d = Directory::default();
        d.expect(a("10.0.0.2:5000"), a("10.0.0.1:80"), e(t0));
        let w = d.listen_at(a("0.0.0.0:80"), 1, 1, t0 + Duration::from_millis(10));
        assert_eq!(w, MISS_HOLD - Duration::from_millis(10));
        // With the listener there, announcements find it and leave no miss.
        assert!(d.expect(a("10.0.0.2:5001"), a("10.0.0.1:80"), e(t0)).is_some());
        assert_eq!(d.misses.len(), 1);
        // Misses are bounded.
        for p in 0..200u16 {
            d.expect(a("10.0.0.2:5000"), SocketAddr::new(a("10.0.0.9:1").ip(), 1000 + p), e(t0));
        }
        assert_eq!(d.misses.len(), MISSES);
    }
}
