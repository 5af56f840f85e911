//! Two endpoints of a virtual connection over a simulated physical link, driven by a virtual
//! clock and a seeded generator: random write and read sizes, partial writes, a link that
//! dies at random points (whatever it held is lost, partial frames included) and comes back
//! later. After each link comes back both sides resync and replay. The check: each side
//! delivered exactly the stream the other sent, and no byte was ever freed from a replay ring
//! before the peer's layer had delivered it.

use std::collections::VecDeque;
use substrate::reliability::{ack_due, ring_slices, Blocked, Plan, RxState, Source, TxState};
use substrate::wire::frame::{FrameKind, HEADER_LEN};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn stream_byte(side: usize, off: u64) -> u8 {
    let x = off.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (side as u64 * 0xABCD);
    (x >> 29) as u8
}

struct End {
    side: usize,
    tx: TxState,
    rx: RxState,
    ring: Vec<u8>,
    /// Bytes of the own stream handed to the layer so far.
    produced: u64,
    received: Vec<u8>,
}

impl End {
    fn new(side: usize, window: u64) -> Self {
        End {
            side,
            tx: TxState::with_soft_window(window, window / 2),
            rx: RxState::new(),
            ring: vec![0; window as usize],
            produced: 0,
            received: Vec::new(),
        }
    }

    /// Puts the bytes of `plan` on `q`, at most `room`; returns how many went.
    fn push(&mut self, plan: &Plan, app: &[u8], q: &mut VecDeque<u8>, room: usize) -> usize {
        let mut bytes = plan.header_bytes().to_vec();
        match plan.source {
            Source::App => bytes.extend_from_slice(&app[..plan.payload]),
            Source::Ring(seq) => {
                let (a, b) = ring_slices(&self.ring, seq, plan.payload);
                bytes.extend_from_slice(a);
                bytes.extend_from_slice(b);
            }
        }
        let n = bytes.len().min(room);
        q.extend(&bytes[..n]);
        n
    }
}

struct Link {
    q: [VecDeque<u8>; 2],
    cap: usize,
    up: bool,
}

fn write_some(e: &mut End, link: &mut Link, rng: &mut Rng, want: usize, gen: bool) {
    let q = &mut link.q[e.side];
    let room = link.cap - q.len();
    let room = if room > 0 { 1 + rng.below(room as u64) as usize } else { 0 };
    if e.tx.replaying() || e.tx.in_frame() {
        if let Some(plan) = e.tx.plan_replay(e.rx.delivered) {
            let n = e.push(&plan, &[], q, room);
            e.tx.commit(&plan, n, &[], &mut e.ring);
            return;
        }
    }
    let app: Vec<u8> = if gen {
        (0..want as u64).map(|i| stream_byte(e.side, e.tx.next_seq + i)).collect()
    } else {
        Vec::new()
    };
    if app.is_empty() {
        return;
    }
    match e.tx.plan_send(app.len(), e.rx.delivered, rng.below(8) == 0) {
        Ok(plan) => {
            let n = e.push(&plan, &app, q, room);
            let acc = e.tx.commit(&plan, n, &app, &mut e.ring);
            e.produced = e.produced.max(e.tx.next_seq);
            assert!(acc <= app.len());
        }
        Err(Blocked::Window | Blocked::AwaitingResync | Blocked::Replaying) => {}
    }
}

fn send_ack(e: &mut End, link: &mut Link) {
    if e.tx.awaiting_resync() && e.rx.expect_resync != 0 {
        return;
    }
    if !ack_due(e.rx.delivered, e.tx.ack_sent, e.tx.soft_window) {
        return;
    }
    let q = &mut link.q[e.side];
    let room = link.cap - q.len();
    if let Some(plan) = e.tx.plan_control(FrameKind::Ack, e.rx.delivered) {
        let n = e.push(&plan, &[], q, room);
        e.tx.commit(&plan, n, &[], &mut e.ring);
    }
}

fn read_some(e: &mut End, peer_q: &mut VecDeque<u8>, rng: &mut Rng, n: usize) {
    let plan = e.rx.plan_read(n);
    let mut app = vec![0u8; n];
    let avail = peer_q.len().min(plan.total());
    if avail == 0 {
        return;
    }
    let take = 1 + rng.below(avail as u64) as usize;
    let chunk: Vec<u8> = peer_q.drain(..take).collect();
    let (got, r) = e.rx.read_from(plan, &chunk, &mut app);
    assert_eq!(got, take);
    let r = r.expect("honest peer never breaks the protocol");
    e.received.extend_from_slice(&app[..r.payload]);
    e.tx.on_ack(e.rx.peer_ack).expect("ack within what was sent");
    if let Some(r) = e.rx.take_resync() {
        e.tx.resync(r).expect("resync within the replayable range");
    }
}

/// How a rebuilt link learns where each stream stands.
#[derive(Clone, Copy, PartialEq)]
enum Resume {
    /// A resync frame first on the new link, in band.
    InBand,
    /// The layers' handshake states both delivered counts before the link carries frames
    /// (what the preload library does).
    Handshake,
}

fn fail_link(ends: &mut [End; 2], link: &mut Link, mode: Resume) {
    link.q[0].clear();
    link.q[1].clear();
    link.up = false;
    if mode == Resume::InBand {
        for e in ends.iter_mut() {
            e.tx.link_reset();
            e.rx.link_reset();
        }
    }
}

fn restore_link(ends: &mut [End; 2], link: &mut Link, mode: Resume) {
    link.up = true;
    if mode == Resume::Handshake {
        let (d0, d1) = (ends[0].rx.delivered, ends[1].rx.delivered);
        ends[0].tx.relink(d1, d0).expect("peer's count within the replayable range");
        ends[1].tx.relink(d0, d1).expect("peer's count within the replayable range");
        ends[0].rx.relink(d1);
        ends[1].rx.relink(d0);
        return;
    }
    for e in ends.iter_mut() {
        let plan = e.tx.plan_control(FrameKind::Resync, e.rx.delivered).expect("no frame in progress");
        let n = e.push(&plan, &[], &mut link.q[e.side], usize::MAX);
        assert_eq!(n, HEADER_LEN);
        e.tx.commit(&plan, n, &[], &mut e.ring);
    }
}

fn check_invariants(ends: &[End; 2]) {
    for s in 0..2 {
        let (me, peer) = (&ends[s], &ends[1 - s]);
        assert!(me.tx.unacked() <= me.tx.window, "window exceeded");
        assert!(me.tx.acked <= peer.rx.delivered, "freed bytes the peer's layer did not have");
        for (i, b) in me.received.iter().enumerate().skip(me.received.len().saturating_sub(64)) {
            assert_eq!(*b, stream_byte(1 - s, i as u64), "side {s} byte {i}");
        }
    }
}

fn run(seed: u64, steps: u64, window: u64, fail_per_mille: u64) -> (u64, u64, u32) {
    run_with(seed, steps, window, fail_per_mille, Resume::InBand)
}

fn run_with(seed: u64, steps: u64, window: u64, fail_per_mille: u64, mode: Resume) -> (u64, u64, u32) {
    let mut rng = Rng(seed | 1);
    let mut ends = [End::new(0, window), End::new(1, window)];
    let mut link =
        Link { q: [VecDeque::new(), VecDeque::new()], cap: 512 + rng.below(20_000) as usize, up: true };
    let mut down_until = 0u64;
    let mut failures = 0;
    let mut now = 0u64;
    let total = steps * 2;
    while now < total {
        now += 1;
        let generating = now < steps;
        if link.up && generating && rng.below(1000) < fail_per_mille {
            fail_link(&mut ends, &mut link, mode);
            failures += 1;
            down_until = now + 1 + rng.below(50);
            continue;
        }
        if !link.up {
            if now >= down_until {
                restore_link(&mut ends, &mut link, mode);
            }
            continue;
        }
        let s = rng.below(2) as usize;
        match rng.below(10) {
            0..=3 => {
                let big = rng.below(4) == 0;
                let want = 1 + rng.below(if big { 40_000 } else { 300 }) as usize;
                write_some(&mut ends[s], &mut link, &mut rng, want, generating);
            }
            4..=8 => {
                let big = rng.below(3) == 0;
                let n = 1 + rng.below(if big { 60_000 } else { 100 }) as usize;
                let (a, b) = ends.split_at_mut(1);
                let (me, q) = if s == 0 { (&mut a[0], &mut link.q[1]) } else { (&mut b[0], &mut link.q[0]) };
                read_some(me, q, &mut rng, n);
            }
            _ => send_ack(&mut ends[s], &mut link),
        }
        if !generating {
            // Drain: finish replays and frames in progress, then let the readers catch up.
            for e in ends.iter_mut() {
                write_some(e, &mut link, &mut rng, 0, false);
                send_ack(e, &mut link);
            }
        }
        check_invariants(&ends);
    }
    // Final drain with a healthy link.
    for _ in 0..1_000_000 {
        let mut moved = false;
        for s in 0..2 {
            if ends[s].tx.replaying() || ends[s].tx.in_frame() {
                write_some(&mut ends[s], &mut link, &mut rng, 0, false);
                moved = true;
            }
            let (a, b) = ends.split_at_mut(1);
            let (me, q) = if s == 0 { (&mut a[0], &mut link.q[1]) } else { (&mut b[0], &mut link.q[0]) };
            if !q.is_empty() {
                read_some(me, q, &mut rng, 65536);
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    for s in 0..2 {
        let want: Vec<u8> = (0..ends[1 - s].tx.next_seq).map(|i| stream_byte(1 - s, i)).collect();
        assert_eq!(ends[s].received.len(), want.len(), "seed {seed}: side {s} got a different length");
        assert!(ends[s].received == want, "seed {seed}: side {s} got different bytes");
        assert!(!ends[1 - s].tx.replaying());
    }
    (ends[0].tx.next_seq, ends[1].tx.next_seq, failures)
}

#[test]
fn delivered_stream_equals_sent_stream_with_no_failures() {
    for seed in 1..20 {
        let (a, b, f) = run(seed, 3000, 64 * 1024, 0);
        assert_eq!(f, 0);
        assert!(a > 10_000 && b > 10_000, "traffic moved: {a} {b}");
    }
}

#[test]
fn delivered_stream_equals_sent_stream_across_random_link_failures() {
    let mut failures = 0;
    for seed in 1..120 {
        let (_, _, f) = run(seed * 7919, 3000, 4096 * (1 + seed % 16), 5);
        failures += f;
    }
    assert!(failures > 300, "the link really failed often: {failures}");
}

#[test]
fn handshake_resume_keeps_the_streams_across_random_link_failures() {
    let mut failures = 0;
    for seed in 1..120 {
        let (_, _, f) = run_with(seed * 104_729, 3000, 4096 * (1 + seed % 16), 5, Resume::Handshake);
        failures += f;
    }
    assert!(failures > 300, "the link really failed often: {failures}");
}

#[test]
fn tiny_window_forces_back_pressure_and_acks() {
    for seed in 1..30 {
        run(seed, 5000, 4096, 2);
    }
}
