//! Tickets: identities for a process's later connections to a listener on another node,
//! agreed ahead with that node's agent, so that the connection is virtual from its `connect`
//! on without anyone asked on the way (no round trip to this agent, none between agents).
//!
//! A ticket is a source port of this node's ticket ports (the upper part of the block of
//! source ports, `setup-ports`, which the agent reserves and no layer binds by itself), a
//! GID and a secret. The agent gives a process a batch of tickets for one listener it
//! subscribed to, announces the batch to the listener's agent (`Msg::Expects`, one way, as
//! it announces single connections), and the listener's process finds each connection in
//! its table of announced connections when it comes. This module keeps which port is out,
//! with whom, until when: a port is given again only once its ticket was used and the
//! connection released, was given back unused, or is older than an announcement lives.
//!
//! Without I/O: the caller passes the time.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How long a process may use a ticket after it got it. Well under the life of the
/// announcement at the listener's node (`directory::PENDING_TTL`, 30 s, a second less in the
/// process's table): a connection whose SYN must be sent again a few times still finds it.
pub const USE_WITHIN: Duration = Duration::from_secs(10);

/// How long an unused ticket's port stays out: the announcement is gone by then, so the
/// port can be announced again without any doubt about which connection it names.
pub const HOLD: Duration = Duration::from_secs(31);

/// How long a port whose socket went into TIME_WAIT is not given again (Linux keeps it a
/// minute): a bind there would fail.
pub const TIME_WAIT: Duration = Duration::from_secs(61);

/// Most tickets given at once.
pub const MAX_BATCH: usize = 64;

/// Most tickets out per process (every listener together): a process cannot take the
/// node's ports from the others.
pub const MAX_PER_CLIENT: usize = 256;

struct Out {
    client: u64,
    gid: u128,
    dst: SocketAddr,
    given: Instant,
    /// The connection was made: the port is out until it is released.
    used: bool,
    /// The port is held by a socket in TIME_WAIT until then (a release does not free it).
    busy_until: Option<Instant>,
}

/// The node's ticket ports and the tickets out.
pub struct Pool {
    first: u16,
    count: u16,
    /// Where the next search starts (an offset in the range).
    cursor: u32,
    by_port: HashMap<u16, Out>,
    by_gid: HashMap<u128, u16>,
    per_client: HashMap<u64, usize>,
}

impl Default for Pool {
    fn default() -> Self {
        Pool::new(0, 0)
    }
}

/// The node's block of source ports (`first`, `count`) split into the part layers bind
/// connections to by themselves (told in `Msg::Welcome`) and the ticket ports (the upper
/// half; none for a block under 256 ports).
pub fn split(first: u16, count: u16) -> ((u16, u16), (u16, u16)) {
    if count < 256 {
        return ((first, count), (0, 0));
    }
    let t = count / 2;
    ((first, count - t), (first + (count - t), t))
}

/// [`split`] of a (first, count) pair.
pub fn split_of(block: (u16, u16)) -> ((u16, u16), (u16, u16)) {
    split(block.0, block.1)
}

impl Pool {
    /// The pool of ports `first .. first + count`.
    pub fn new(first: u16, count: u16) -> Self {
        Pool {
            first,
            count,
            cursor: 0,
            by_port: HashMap::new(),
            by_gid: HashMap::new(),
            per_client: HashMap::new(),
        }
    }

    /// True when `port` is one of the ticket ports.
    pub fn has(&self, port: u16) -> bool {
        self.count > 0 && (self.first..=self.first + (self.count - 1)).contains(&port)
    }

    /// Tickets out (used or not).
    pub fn out(&self) -> usize {
        self.by_port.len()
    }

    /// Takes up to `n` free ports for `client`'s connections to `dst`, with the GIDs
    /// `gids` gives (one per port, in order). Ports whose unused ticket is older than
    /// [`HOLD`] are free again.
    pub fn give(
        &mut self,
        client: u64,
        dst: SocketAddr,
        n: usize,
        now: Instant,
        gids: &mut dyn FnMut() -> u128,
    ) -> Vec<(u16, u128)> {
        let have = self.per_client.get(&client).copied().unwrap_or(0);
        let n = n.min(MAX_BATCH).min(MAX_PER_CLIENT.saturating_sub(have));
        let mut got = Vec::with_capacity(n);
        let count = u32::from(self.count);
        let mut looked = 0;
        while got.len() < n && looked < count {
            let port = self.first + (self.cursor % count) as u16;
            self.cursor = (self.cursor + 1) % count;
            looked += 1;
            if let Some(o) = self.by_port.get(&port) {
                let taken = match o.busy_until {
                    Some(t) => now < t,
                    None => o.used || now.saturating_duration_since(o.given) < HOLD,
                };
                if taken {
                    continue;
                }
                self.free(port);
            }
            let gid = gids();
            self.by_port.insert(port, Out { client, gid, dst, given: now, used: false, busy_until: None });
            self.by_gid.insert(gid, port);
            *self.per_client.entry(client).or_default() += 1;
            got.push((port, gid));
        }
        got
    }

    /// `client` made the connection of ticket `gid`: its destination, if the ticket is
    /// `client`'s and unused (a ticket is used once).
    pub fn used(&mut self, client: u64, gid: u128) -> Option<SocketAddr> {
        let port = *self.by_gid.get(&gid)?;
        let o = self.by_port.get_mut(&port)?;
        if o.client != client || o.used {
            return None;
        }
        o.used = true;
        Some(o.dst)
    }

    /// `client` gives ticket `gid` back unused, or released the connection made with it:
    /// its port is free (unless a socket holds it in TIME_WAIT, see [`Pool::busy`]). Another
    /// client's ticket stays.
    pub fn back(&mut self, client: u64, gid: u128) {
        if let Some(&port) = self.by_gid.get(&gid) {
            if self.by_port.get(&port).is_some_and(|o| o.client == client && o.busy_until.is_none()) {
                self.free(port);
            }
        }
    }

    /// `client` says the port of ticket `gid` is held by a socket in TIME_WAIT (its bind
    /// failed, or its connection was closed from this side first): not given again for
    /// [`TIME_WAIT`].
    pub fn busy(&mut self, client: u64, gid: u128, now: Instant) {
        if let Some(&port) = self.by_gid.get(&gid) {
            if let Some(o) = self.by_port.get_mut(&port).filter(|o| o.client == client) {
                o.busy_until = Some(now + TIME_WAIT);
            }
        }
    }

    /// `client` is gone: the ports of its used tickets are free (its sockets are closed);
    /// its unused ones stay out until [`HOLD`] (they are announced at the listener's node).
    pub fn gone(&mut self, client: u64) {
        let ports: Vec<u16> = self
            .by_port
            .iter()
            .filter(|(_, o)| o.client == client && o.used && o.busy_until.is_none())
            .map(|(p, _)| *p)
            .collect();
        for p in ports {
            self.free(p);
        }
    }

    fn free(&mut self, port: u16) {
        if let Some(o) = self.by_port.remove(&port) {
            self.by_gid.remove(&o.gid);
            if let Some(c) = self.per_client.get_mut(&o.client) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    self.per_client.remove(&o.client);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dst() -> SocketAddr {
        "10.0.0.2:80".parse().unwrap()
    }

    fn counter() -> impl FnMut() -> u128 {
        let mut g = 0u128;
        move || {
            g += 1;
            g
        }
    }

    #[test]
    fn ports_are_given_once_until_released_given_back_or_old() {
        let t0 = Instant::now();
        let mut gids = counter();
        let mut p = Pool::new(60000, 4);
        assert!(p.has(60000) && p.has(60003) && !p.has(60004) && !p.has(59999));
        let a = p.give(1, dst(), 3, t0, &mut gids);
        assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), vec![60000, 60001, 60002]);
        let b = p.give(2, dst(), 3, t0, &mut gids);
        assert_eq!(b.iter().map(|x| x.0).collect::<Vec<_>>(), vec![60003], "one port left");
        assert!(p.give(2, dst(), 3, t0, &mut gids).is_empty(), "all out");

        // Used by its owner only, once.
        assert_eq!(p.used(2, a[0].1), None, "not client 2's ticket");
        assert_eq!(p.used(1, a[0].1), Some(dst()));
        assert_eq!(p.used(1, a[0].1), None, "used once");
        // Given back: free at once; another client cannot give it back.
        p.back(2, a[1].1);
        assert!(p.give(2, dst(), 1, t0, &mut gids).is_empty());
        p.back(1, a[1].1);
        assert_eq!(p.give(2, dst(), 1, t0, &mut gids)[0].0, 60001);

        // Old unused tickets come free; a used one stays out until released.
        let later = t0 + HOLD + Duration::from_secs(1);
        let c = p.give(3, dst(), 4, later, &mut gids);
        assert_eq!(c.iter().map(|x| x.0).collect::<Vec<_>>(), vec![60002, 60003, 60001]);
        p.back(1, a[0].1);
        assert_eq!(p.give(3, dst(), 4, later, &mut gids)[0].0, 60000);
        assert_eq!(p.out(), 4);
    }

    #[test]
    fn a_port_in_time_wait_is_not_given_for_a_minute_even_once_released() {
        let t0 = Instant::now();
        let mut gids = counter();
        let mut p = Pool::new(60000, 2);
        let a = p.give(1, dst(), 2, t0, &mut gids);
        assert_eq!(p.used(1, a[0].1), Some(dst()));
        p.busy(2, a[0].1, t0);
        assert!(p.by_port[&60000].busy_until.is_none(), "only its client marks it");
        p.busy(1, a[0].1, t0);
        p.back(1, a[0].1);
        p.gone(1);
        let later = t0 + HOLD + Duration::from_secs(1);
        assert_eq!(
            p.give(1, dst(), 2, later, &mut gids).iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![60001]
        );
        let after = t0 + TIME_WAIT + Duration::from_secs(1);
        assert_eq!(
            p.give(1, dst(), 2, after, &mut gids).iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![60000]
        );
    }

    #[test]
    fn the_block_is_split_in_two_halves_when_large_enough() {
        assert_eq!(split(59000, 2000), ((59000, 1000), (60000, 1000)));
        assert_eq!(split(40000, 101), ((40000, 101), (0, 0)));
        assert_eq!(split(65000, 535), ((65000, 268), (65268, 267)));
        assert_eq!(split(0, 0), ((0, 0), (0, 0)));
    }

    #[test]
    fn a_gone_client_frees_its_used_ports_and_a_client_takes_at_most_its_share() {
        let t0 = Instant::now();
        let mut gids = counter();
        let mut p = Pool::new(50000, 1000);
        let a = p.give(1, dst(), 1000, t0, &mut gids);
        assert_eq!(a.len(), MAX_BATCH);
        for _ in 0..10 {
            p.give(1, dst(), MAX_BATCH, t0, &mut gids);
        }
        assert_eq!(p.out(), MAX_PER_CLIENT);
        assert_eq!(p.used(1, a[0].1), Some(dst()));
        p.gone(1);
        assert_eq!(p.out(), MAX_PER_CLIENT - 1, "the used one is free, the unused ones stay out");
        assert_eq!(p.give(2, dst(), 2, t0, &mut gids).len(), 2);
        assert!(Pool::new(0, 0).give(1, dst(), 5, t0, &mut gids).is_empty());
        assert!(!Pool::new(0, 0).has(0));
    }
}
