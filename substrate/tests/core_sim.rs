//! Two connection cores, driven as a driver drives them, over simulated links with a virtual
//! clock: links of different rates and delays, several at once, links that die with bytes in
//! flight (in both directions), new links after a total failure with the resume handshake,
//! ends of stream sent while no link is up. Every run checks that each side read exactly the
//! other's stream, byte for byte, and that both ended `Done`.

use std::collections::VecDeque;
use substrate::connection::{CloseReason, Config, Connection, Event, LinkId, Recv, State};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, per_million: u64) -> bool {
        self.below(1_000_000) < per_million
    }
}

/// The byte at offset `i` of side `s`'s stream.
fn byte(s: usize, i: u64) -> u8 {
    (i.wrapping_mul(2654435761).wrapping_add(s as u64 * 97) >> 7) as u8
}

/// A link between the two sides: a rate (bytes per tick, each way) and a delay (ticks).
struct Pipe {
    id: LinkId,
    rate: usize,
    delay: u64,
    /// Bytes on their way, each direction: (arrival tick, bytes).
    ways: [VecDeque<(u64, Vec<u8>)>; 2],
}

struct Side {
    conn: Connection,
    total: u64,
    written: u64,
    read: u64,
    ended: bool,
}

struct Sim {
    rng: Rng,
    now: u64,
    sides: [Side; 2],
    pipes: Vec<Pipe>,
    next_id: u32,
    faults: bool,
    chains: bool,
    /// Bytes the links carried (frames, headers included).
    wire: u64,
}

/// How a run goes.
#[derive(Clone, Copy)]
struct Plan {
    bytes: [u64; 2],
    /// (rate, delay) of the links up at the start.
    links: &'static [(usize, u64)],
    /// Kill a link now and then (per-million chance per tick), and bring new ones.
    fault_ppm: u64,
    /// Cap each link's bytes in flight at rate x (2 x delay + 2), as a driver measuring them
    /// would.
    budgets: bool,
    /// Attach and detach a filter that doubles every byte now and then, both sides.
    chains: bool,
}

impl Sim {
    fn new(seed: u64, plan: Plan) -> Sim {
        let cfg = Config {
            window: 1 << 20,
            peer_window: 1 << 20,
            max_frame: 16 << 10,
            grace_ms: 1 << 40,
            ack_delay_ms: 2,
        };
        let side = |total| Side { conn: Connection::new(cfg, 0), total, written: 0, read: 0, ended: false };
        let mut s = Sim {
            rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            now: 0,
            sides: [side(plan.bytes[0]), side(plan.bytes[1])],
            pipes: Vec::new(),
            next_id: 0,
            faults: plan.fault_ppm > 0,
            chains: plan.chains,
            wire: 0,
        };
        for &(rate, delay) in plan.links {
            s.add_pipe(rate, delay, plan.budgets);
        }
        s
    }

    fn add_pipe(&mut self, rate: usize, delay: u64, budget: bool) {
        let id = LinkId(self.next_id);
        self.next_id += 1;
        let down = self.pipes.is_empty();
        // A link after a total failure starts with the resume handshake: each side says what
        // it delivered.
        let acks = [self.sides[0].conn.resume_ack(), self.sides[1].conn.resume_ack()];
        for i in 0..2 {
            let peer_ack = down.then_some(acks[1 - i]);
            self.sides[i].conn.handle_link_up(self.now, id, peer_ack).expect("resume");
            if budget {
                // What a driver measures of its link: rate and round trip.
                self.sides[i].conn.set_link_budget(id, (rate as u64) * (2 * delay + 2));
                self.sides[i].conn.set_link_estimate(id, rate as u64, 2 * delay + 1);
            }
        }
        self.pipes.push(Pipe { id, rate, delay, ways: [VecDeque::new(), VecDeque::new()] });
    }

    fn kill_pipe(&mut self, k: usize) {
        let p = self.pipes.remove(k);
        for s in &mut self.sides {
            s.conn.handle_link_down(self.now, p.id);
        }
    }

    /// One tick: programs write and read, links carry, faults happen. True when both ended.
    fn tick(&mut self) -> bool {
        self.now += 1;
        // Programs write a random amount, end their stream when all is written.
        for (si, s) in self.sides.iter_mut().enumerate() {
            if s.written < s.total {
                let n = (self.rng.below(400_000) + 1).min(s.total - s.written);
                let chunk: Vec<u8> = (s.written..s.written + n).map(|i| byte(si, i)).collect();
                if let Ok(took) = s.conn.send(&chunk) {
                    s.written += took as u64;
                }
            }
            if s.written == s.total && !s.ended {
                s.ended = true;
                s.conn.shutdown();
            }
        }
        // Links carry, each way, at their rate.
        for p in &mut self.pipes {
            for from in 0..2 {
                let mut room = p.rate;
                while room > 24 {
                    let Some(f) = self.sides[from].conn.poll_transmit(self.now, p.id, room) else { break };
                    room -= f.len();
                    self.wire += f.len() as u64;
                    p.ways[from].push_back((self.now + p.delay, f));
                }
            }
        }
        for p in &mut self.pipes {
            for from in 0..2 {
                while p.ways[from].front().is_some_and(|(t, _)| *t <= self.now) {
                    let (_, f) = p.ways[from].pop_front().expect("front");
                    self.sides[1 - from].conn.handle_link_bytes(self.now, p.id, &f).expect("protocol");
                }
            }
        }
        // Programs read, checking every byte.
        let mut buf = vec![0u8; 50_000];
        for si in 0..2 {
            let other = 1 - si;
            loop {
                match self.sides[si].conn.recv(&mut buf) {
                    Recv::Data(n) => {
                        let at = self.sides[si].read;
                        for (k, b) in buf[..n].iter().enumerate() {
                            assert_eq!(*b, byte(other, at + k as u64), "side {si} byte {}", at + k as u64);
                        }
                        self.sides[si].read += n as u64;
                    }
                    Recv::End => {
                        assert_eq!(
                            self.sides[si].read, self.sides[other].total,
                            "side {si}: end before the last byte"
                        );
                        break;
                    }
                    _ => break,
                }
            }
            while let Some(e) = self.sides[si].conn.poll_event() {
                if let Event::Closed(r) = e {
                    assert_eq!(r, CloseReason::Done, "side {si} closed: {r:?}");
                }
            }
        }
        // Filters switched on and off mid-stream.
        if self.chains {
            for s in &mut self.sides {
                if self.rng.chance(30_000) {
                    let _ = if s.conn.chain().is_empty() {
                        s.conn.attach_filter("double")
                    } else {
                        s.conn.detach_filter("double")
                    };
                }
            }
        }
        // Faults: a link dies with what it carries; links come back.
        if self.faults {
            if !self.pipes.is_empty() && self.rng.chance(20_000) {
                let k = self.rng.below(self.pipes.len() as u64) as usize;
                self.kill_pipe(k);
            }
            let all_down = self.pipes.is_empty();
            if (all_down && self.rng.chance(200_000)) || (self.pipes.len() < 3 && self.rng.chance(10_000)) {
                let rate = [2_000, 20_000, 60_000][self.rng.below(3) as usize];
                let delay = 1 + self.rng.below(5);
                self.add_pipe(rate, delay, true);
            }
        }
        let done =
            |s: &Side| matches!(s.conn.state(), State::Closed(CloseReason::Done)) && !s.conn.ack_owed();
        done(&self.sides[0]) && done(&self.sides[1])
    }

    /// Runs to the end; the ticks it took.
    fn run(&mut self, max_ticks: u64) -> u64 {
        while !self.tick() {
            assert!(
                self.now < max_ticks,
                "not finished after {max_ticks} ticks: {:?} / {:?}",
                self.sides[0].conn.state(),
                self.sides[1].conn.state()
            );
        }
        for (si, s) in self.sides.iter().enumerate() {
            assert_eq!(s.read, self.sides[1 - si].total, "side {si} read everything");
        }
        self.now
    }
}

const ONE: Plan =
    Plan { bytes: [3 << 20, 2 << 20], links: &[(50_000, 2)], fault_ppm: 0, budgets: false, chains: false };

#[test]
fn one_link_carries_both_streams() {
    for seed in 0..4 {
        Sim::new(seed, ONE).run(100_000);
    }
}

#[test]
fn links_dying_and_coming_back_lose_nothing() {
    let plan = Plan { links: &[(50_000, 2), (20_000, 4)], fault_ppm: 1, ..ONE };
    for seed in 0..24 {
        Sim::new(seed, plan).run(1_000_000);
    }
}

#[test]
fn ends_of_stream_during_failures() {
    // Small streams: most runs end their streams while a link is down or replaying.
    let plan =
        Plan { bytes: [300_000, 100_000], links: &[(20_000, 3)], fault_ppm: 1, budgets: true, chains: false };
    for seed in 0..40 {
        Sim::new(seed, plan).run(1_000_000);
    }
}

#[test]
fn two_equal_links_go_twice_as_fast() {
    let one = Sim::new(1, Plan { bytes: [8 << 20, 0], links: &[(20_000, 2)], ..ONE }).run(1_000_000);
    let two =
        Sim::new(1, Plan { bytes: [8 << 20, 0], links: &[(20_000, 2), (20_000, 2)], ..ONE }).run(1_000_000);
    assert!((two as f64) < 0.6 * one as f64, "one link {one} ticks, two links {two}");
}

#[test]
fn a_slow_link_never_slows_the_stripe() {
    let plan = |links| Plan { bytes: [8 << 20, 0], links, fault_ppm: 0, budgets: true, chains: false };
    let fast = Sim::new(2, plan(&[(40_000, 2)])).run(1_000_000);
    let both = Sim::new(2, plan(&[(40_000, 2), (4_000, 20)])).run(1_000_000);
    assert!(both as f64 <= 1.02 * fast as f64, "fast link alone {fast} ticks, with a slow one {both}");
    let sum = Sim::new(2, plan(&[(40_000, 2), (20_000, 2)])).run(1_000_000);
    assert!((sum as f64) < 0.75 * fast as f64, "fast alone {fast} ticks, fast + half {sum}");
}

#[test]
fn filters_switched_mid_stream_through_failures() {
    // A filter that doubles every byte is attached and detached at random on both sides while
    // links die and come back: both streams still arrive exactly.
    let plan = Plan { links: &[(50_000, 2), (20_000, 4)], fault_ppm: 1, chains: true, ..ONE };
    for seed in 0..16 {
        Sim::new(seed, plan).run(1_000_000);
    }
}

#[test]
fn a_doubling_chain_doubles_what_the_links_carry() {
    let plain = Plan { bytes: [4 << 20, 0], links: &[(50_000, 2)], ..ONE };
    let mut a = Sim::new(3, plain);
    a.run(1_000_000);
    let mut b = Sim::new(3, plain);
    b.sides[0].conn.attach_filter("double").unwrap();
    b.run(1_000_000);
    let ratio = b.wire as f64 / a.wire as f64;
    assert!((1.9..2.1).contains(&ratio), "wire bytes plain {} doubled {} ({ratio:.2}x)", a.wire, b.wire);
}
