//! The node's directory: listeners under the layer, and connections announced by connecting
//! layers and not yet accepted. Pure data; the callers do the I/O.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// How long an announced connection waits for its accept.
pub const PENDING_TTL: Duration = Duration::from_secs(30);

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

/// A listener whose process moved to another node: connections to it go there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forward {
    /// The address it listened on here.
    pub addr: SocketAddr,
    /// The agent addresses of the node it moved to.
    pub to: Vec<SocketAddr>,
}

/// Listeners and expected connections.
#[derive(Default, Debug)]
pub struct Directory {
    listeners: Vec<ListenerRec>,
    expected: HashMap<(SocketAddr, SocketAddr), Expected>,
    forwards: Vec<Forward>,
}

impl Directory {
    /// Records a listener (idempotent per owner and address). A listener that comes back
    /// here ends the forward of its address.
    pub fn listen(&mut self, addr: SocketAddr, window: u64, owner: u64) {
        self.forwards.retain(|f| f.addr != addr);
        if !self.listeners.iter().any(|l| l.addr == addr && l.owner == owner) {
            self.listeners.push(ListenerRec { addr, window, owner });
        }
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
    /// listener under the layer (the connection is then expected), `None` otherwise.
    pub fn expect(&mut self, src: SocketAddr, dst: SocketAddr, e: Expected) -> Option<u64> {
        let w = self.listener_for(dst)?.window;
        let now = e.at;
        self.expected.retain(|_, x| now.duration_since(x.at) < PENDING_TTL);
        self.expected.insert((src, dst), e);
        Some(w)
    }

    /// A listener accepted `peer → local`: the expected connection, if it was announced.
    pub fn accept(&mut self, local: SocketAddr, peer: SocketAddr) -> Option<Expected> {
        self.expected.remove(&(peer, local))
    }

    /// Connections announced and not accepted yet.
    pub fn expected_count(&self) -> usize {
        self.expected.len()
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
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.2:4001")), None);
        let e = d.accept(a("10.0.0.1:80"), a("10.0.0.2:4000")).unwrap();
        assert_eq!((e.gid, e.secret, e.window), (1, 2, 3));
        assert_eq!(d.accept(a("10.0.0.1:80"), a("10.0.0.2:4000")), None, "consumed");
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
}
