//! Two endpoints of a virtual connection over a simulated physical link, driven by a virtual
//! clock and a seeded generator: random write and read sizes, partial writes, a link that
//! dies at random points (whatever it held is lost, partial frames included) and comes back
//! later. After each link comes back both sides resync and replay. The check: each side
//! delivered exactly the stream the other sent, and no byte was ever freed from a replay ring
//! before the peer's layer had delivered it. With `chains`, each side also offers filter
//! chains for its stream at random (in band, as the kernel-TCP sink does) and codes its frames
//! with the taken one: frames sent again are coded with the chain of their own offsets.

use std::collections::VecDeque;
use substrate::connection::chain::{Chain, CODED_MAX};
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
    /// The answer owed to the peer's chain offer (number, taken, asked both ways), not
    /// sent yet.
    answer: Option<(u8, bool, bool)>,
    /// Chains this end put on its own stream because the peer asked for them both ways.
    mirrored: u32,
    /// Chains taken by the peer for our stream, and coded frames sent.
    switches: u32,
    coded_frames: u64,
}

impl End {
    fn new(side: usize, window: u64) -> Self {
        End {
            side,
            tx: {
                let mut t = TxState::with_soft_window(window, window / 2);
                t.set_auth(SECRET);
                t
            },
            rx: {
                // (Side 0 connected.)
                let mut r = RxState::new();
                r.set_auth(SECRET, side == 0);
                r
            },
            ring: vec![0; window as usize],
            produced: 0,
            received: Vec::new(),
            answer: None,
            mirrored: 0,
            switches: 0,
            coded_frames: 0,
        }
    }

    /// The raw bytes a coded frame carries.
    fn raw(&self, source: Source, app: &[u8], len: usize) -> Vec<u8> {
        match source {
            Source::App | Source::Coded { app: true, .. } => app[..len].to_vec(),
            Source::Ring(at) | Source::Coded { raw_seq: at, .. } => {
                let (a, b) = ring_slices(&self.ring, self.tx.ring_pos(at), len);
                [a, b].concat()
            }
            Source::Spec { .. } | Source::Share { .. } => Vec::new(),
        }
    }

    /// Our chain number `no`, with its key.
    fn tx_chain(&self, no: u8) -> Chain {
        let mut c = Chain::from_ids(self.tx.chain_ids[no as usize]).expect("agreed chain");
        c.set_key(self.tx.chain_key(no));
        c
    }

    /// Codes the frame just planned if its chain says so (as the kernel-TCP sink does).
    fn code(&mut self, plan: Plan, app: &[u8]) -> Plan {
        let Some((no, _)) = self.tx.frame_chain() else { return plan };
        let seq = match plan.source {
            Source::Ring(at) => at,
            _ => self.tx.next_seq,
        };
        let raw = self.raw(plan.source, app, plan.payload);
        if self.tx_chain(no).passes(&raw) {
            // (As the sink does: a frame no filter would change goes plain, naming its chain.)
            return self.tx.send_plain(plan);
        }
        let coded = self.tx_chain(no).encode(seq, &raw);
        assert!(!coded.is_empty() && coded.len() <= CODED_MAX, "a coded frame fits");
        self.coded_frames += 1;
        self.tx.code_frame(plan, coded.len())
    }

    /// Chain business at a frame boundary: the answer we owe, our offer.
    fn chain_frames(&mut self, q: &mut VecDeque<u8>, room: usize) {
        if self.tx.in_frame() || self.tx.replaying() || self.tx.awaiting_resync() {
            return;
        }
        if let Some((no, taken, both)) = self.answer {
            let share = Some(self.rx.answer_share)
                .filter(|_| self.rx.chain_ids(no as u32).is_some_and(Chain::ids_keyed));
            if let Some(plan) = self.tx.plan_answer(no, taken, self.rx.delivered, share) {
                let n = self.push(&plan, &[], q, room);
                self.tx.commit(&plan, n, &[], &mut self.ring);
                if n > 0 {
                    self.answer = None;
                    // Asked for the same chain both ways: offered back (as the layer does;
                    // busy with an offer of its own, it does not).
                    if let Some(ids) = self.rx.chain_ids(no as u32).filter(|_| taken && both) {
                        let c = Chain::from_ids(ids).expect("a taken chain");
                        let fit = if c.is_empty() { 1 << 20 } else { c.fit(CODED_MAX) };
                        if self.tx.chain_now().1 != ids
                            && self.tx.begin_offer(ids, fit, false, secret()).is_ok()
                        {
                            self.mirrored += 1;
                        }
                    }
                }
            }
        }
        if self.tx.in_frame() {
            return;
        }
        if let Some(plan) = self.tx.plan_offer(self.rx.delivered) {
            let n = self.push(&plan, &[], q, room.saturating_sub(HEADER_LEN));
            self.tx.commit(&plan, n, &[], &mut self.ring);
        }
    }

    /// Puts the bytes of `plan` on `q`, at most `room`; returns how many went.
    fn push(&mut self, plan: &Plan, app: &[u8], q: &mut VecDeque<u8>, room: usize) -> usize {
        let mut bytes = plan.header_bytes().to_vec();
        match plan.source {
            Source::App => bytes.extend_from_slice(&app[..plan.payload]),
            Source::Ring(seq) => {
                let (a, b) = ring_slices(&self.ring, plan.ring_pos(seq), plan.payload);
                bytes.extend_from_slice(a);
                bytes.extend_from_slice(b);
            }
            Source::Coded { raw_seq, raw_len, chain, skip, .. } => {
                // Made again from the raw bytes each time, as the sink does.
                let raw = self.raw(plan.source, app, raw_len as usize);
                let coded = self.tx_chain(chain).encode(raw_seq, &raw);
                bytes.extend_from_slice(&coded[skip as usize..skip as usize + plan.payload]);
            }
            Source::Spec { skip, .. } | Source::Share { skip } => {
                bytes.extend_from_slice(
                    &self.tx.control_payload(plan.source)[skip as usize..][..plan.payload],
                );
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
    e.chain_frames(q, room);
    let room = link.cap.saturating_sub(q.len()).min(room);
    if e.tx.replaying() || e.tx.in_frame() {
        if let Some(plan) = e.tx.plan_replay(e.rx.delivered) {
            let plan = e.code(plan, &[]);
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
            let plan = e.code(plan, &app);
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
    // As the sink: once the peer's stream is sealed, acknowledgements alone carry a tag and
    // only they count for the peer.
    let tag = e.rx.tags_acks().then_some(e.side == 0);
    let sent = if tag.is_some() { e.tx.ack_tagged } else { e.tx.ack_sent };
    if !ack_due(e.rx.delivered, sent, e.tx.soft_window) {
        return;
    }
    let q = &mut link.q[e.side];
    let room = link.cap - q.len();
    e.chain_frames(q, room);
    let room = link.cap - q.len();
    if let Some(plan) = e.tx.plan_ack(e.rx.delivered, tag) {
        let n = e.push(&plan, &[], q, room);
        e.tx.commit(&plan, n, &[], &mut e.ring);
    }
}

/// The connection's secret both ends hold (the key of acknowledgements' tags).
const SECRET: u128 = 0x5eed_0fa1_1acc;

fn read_some(e: &mut End, peer_q: &mut VecDeque<u8>, rng: &mut Rng, n: usize) {
    if e.rx.coded_len > 0 {
        // As the sink: the whole coded frame is looked at where it waits, decoded, and the
        // program gets what it has not had; the frame leaves the link once all is given.
        let len = e.rx.coded_len as usize;
        if peer_q.len() < len {
            return;
        }
        let enc: Vec<u8> = peer_q.iter().take(len).copied().collect();
        let ids = e.rx.chain_ids(e.rx.coded_chain).expect("a taken chain");
        let mut c = Chain::from_ids(ids).unwrap();
        c.set_key(e.rx.chain_key(e.rx.coded_chain));
        let dec = c.decode(e.rx.coded_seq, enc).expect("honest peer");
        let at = e.rx.coded_taken as usize;
        let k = n.min(dec.len() - at);
        e.received.extend_from_slice(&dec[at..at + k]);
        e.rx.coded_delivered(k);
        if at + k == dec.len() {
            peer_q.drain(..len);
            e.rx.coded_done();
        }
        return;
    }
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
    if let Some(a) = e.rx.take_answer_owed() {
        e.answer = Some(a);
    }
    if e.rx.answer_in != 0 {
        let a = std::mem::take(&mut e.rx.answer_in);
        let share = Some(e.rx.share_in).filter(|s| *s != [0; 32]);
        if let Some((_, true, _)) = e.tx.take_answer(a, share, 0) {
            e.switches += 1;
        }
    }
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
    for e in ends.iter_mut() {
        // An answer owed to an offer the lost link carried: the offer comes again.
        e.answer = None;
    }
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
    let (a, b, f, _) = run_chains(seed, steps, window, fail_per_mille, mode, false);
    (a, b, f)
}

/// The filter chains offered at random (`chains`): double, double twice, none.
const SPECS: [&str; 8] =
    ["double", "double,double", "", "lz4,double", "aead", "lz4,aead:chacha20-poly1305", "lz4", "zstd:1"];

/// Returns both streams' lengths, the link failures, and chain switches and coded frames.
fn run_chains(
    seed: u64,
    steps: u64,
    window: u64,
    fail_per_mille: u64,
    mode: Resume,
    chains: bool,
) -> (u64, u64, u32, (u32, u64)) {
    let mut rng = Rng(seed | 1);
    let mut ends = [End::new(0, window), End::new(1, window)];
    // A coded frame is read only once it waits whole: the link must hold one (as the
    // kernel's receive buffer does).
    let least = if chains { CODED_MAX + HEADER_LEN } else { 0 };
    let mut link = Link {
        q: [VecDeque::new(), VecDeque::new()],
        cap: least + 512 + rng.below(20_000) as usize,
        up: true,
    };
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
        if chains && generating && rng.below(200) == 0 {
            let c = Chain::build(SPECS[rng.below(SPECS.len() as u64) as usize]).unwrap();
            let fit = if c.is_empty() { 1 << 20 } else { c.fit(CODED_MAX) };
            let _ = ends[s].tx.begin_offer(c.ids().unwrap(), fit, rng.below(2) == 0, secret());
        }
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
    let sw = ends[0].switches + ends[1].switches;
    let coded = ends[0].coded_frames + ends[1].coded_frames;
    MIRRORED.with(|m| m.set(m.get() + (ends[0].mirrored + ends[1].mirrored) as u64));
    (ends[0].tx.next_seq, ends[1].tx.next_seq, failures, (sw, coded))
}

thread_local! {
    /// Chains put on a stream because the peer asked for them both ways, over this test's runs.
    static MIRRORED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[test]
fn chains_switched_at_random_keep_the_streams() {
    let (mut sw, mut coded) = (0, 0);
    for seed in 1..40 {
        let (a, b, _, (s, c)) = run_chains(seed * 31, 4000, 64 * 1024, 0, Resume::Handshake, true);
        assert!(a > 10_000 && b > 10_000, "traffic moved: {a} {b}");
        sw += s;
        coded += c;
    }
    assert!(sw > 100 && coded > 1000, "chains really changed ({sw}) and coded frames went ({coded})");
    let m = MIRRORED.with(|m| m.get());
    assert!(m > 10, "offers asked both ways were offered back ({m})");
}

#[test]
fn chains_switched_at_random_keep_the_streams_across_link_failures() {
    let (mut failures, mut sw, mut coded) = (0, 0, 0);
    for seed in 1..120 {
        let mode = if seed % 2 == 0 { Resume::Handshake } else { Resume::InBand };
        let (_, _, f, (s, c)) = run_chains(seed * 7907, 3000, 4096 * (1 + seed % 16), 5, mode, true);
        failures += f;
        sw += s;
        coded += c;
    }
    assert!(failures > 300 && sw > 100 && coded > 1000, "failures {failures}, switches {sw}, coded {coded}");
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

/// A fresh secret for a key exchange (as the layer draws one for every offer).
fn secret() -> Option<[u8; 32]> {
    substrate::connection::aead::random_secret()
}

/// Runs both ends over a healthy link until nothing moves (side 0 writing `bytes` more).
fn settle(ends: &mut [End; 2], link: &mut Link, rng: &mut Rng, bytes: usize) {
    let mut left = bytes;
    for _ in 0..100_000 {
        let want = left.min(3000);
        write_some(&mut ends[0], link, rng, want, want > 0);
        write_some(&mut ends[1], link, rng, 0, false);
        left = left.saturating_sub(want);
        for s in 0..2 {
            send_ack(&mut ends[s], link);
            let (a, b) = ends.split_at_mut(1);
            let (me, q) = if s == 0 { (&mut a[0], &mut link.q[1]) } else { (&mut b[0], &mut link.q[0]) };
            read_some(me, q, rng, 65536);
        }
        let busy = ends.iter().any(|e| e.tx.in_frame() || e.tx.replaying() || e.answer.is_some());
        if left == 0 && !busy && link.q[0].is_empty() && link.q[1].is_empty() {
            return;
        }
    }
    panic!("the link did not settle");
}

/// What side 1's receive half (a copy of it) makes of `bytes` arriving from the link.
fn feed(rx: &RxState, bytes: &[u8]) -> (RxState, Result<usize, substrate::reliability::ProtoError>) {
    let mut rx = *rx;
    let mut app = vec![0u8; 1 << 16];
    let (mut at, mut payload) = (0, 0);
    while at < bytes.len() {
        // (Reads on a stream with coded frames take one header at a time.)
        let plan = rx.plan_read(1 << 16);
        let (got, r) = rx.read_from(plan, &bytes[at..], &mut app);
        match r {
            Ok(i) => payload += i.payload,
            Err(e) => return (rx, Err(e)),
        }
        at += got;
    }
    (rx, Ok(payload))
}

#[test]
fn a_sealed_stream_takes_no_forged_end_chain_change_or_clear_frame() {
    use substrate::reliability::ProtoError::ControlForged;
    use substrate::wire::frame::FrameHeader;
    let mut rng = Rng(7);
    let mut ends = [End::new(0, 1 << 20), End::new(1, 1 << 20)];
    let mut link = Link { q: [VecDeque::new(), VecDeque::new()], cap: 4 << 20, up: true };
    let aead = Chain::build("aead").unwrap();
    ends[0].tx.begin_offer(aead.ids().unwrap(), aead.fit(CODED_MAX), false, secret()).unwrap();
    settle(&mut ends, &mut link, &mut rng, 50_000);
    assert_eq!(ends[0].tx.chain_now().1, aead.ids().unwrap(), "the sealing chain is on");
    assert!(ends[0].coded_frames > 0 && ends[0].tx.seal().is_some(), "sealed frames went");
    let rx = ends[1].rx;
    let at = rx.delivered;
    let ack = rx.peer_ack;
    // Someone on the path ends the stream, turns the sealing off, or slips bytes in.
    let fin = FrameHeader::control(FrameKind::Fin, at, ack).encode();
    assert_eq!(feed(&rx, &fin).1, Err(ControlForged("an end of stream with no tag")));
    let mut tagged = FrameHeader::control(FrameKind::Fin, at, ack);
    tagged.len = 16;
    let forged = [&tagged.encode()[..], &[0x5a; 16]].concat();
    assert_eq!(feed(&rx, &forged).1, Err(ControlForged("an end of stream")));
    let mut offer = FrameHeader::control(FrameKind::ChainOffer, 9, ack);
    offer.len = 6;
    let offer = [&offer.encode()[..], b"double"].concat();
    assert_eq!(feed(&rx, &offer).1, Err(ControlForged("a change of chain")));
    let clear = [&FrameHeader::data(5, at, ack).encode()[..], b"hello"].concat();
    assert_eq!(feed(&rx, &clear).1, Err(ControlForged("a data frame in clear")));
    // The peer's own end of stream carries its tag.
    let mut tx = ends[0].tx;
    let plan = tx.plan_control(FrameKind::Fin, ends[0].rx.delivered).unwrap();
    assert_eq!(plan.payload, 16);
    let bytes = [plan.header_bytes(), &tx.control_payload(plan.source)].concat();
    let (after, r) = feed(&rx, &bytes);
    assert_eq!(r, Ok(0));
    assert_eq!(after.fin, 1, "a genuine end of stream is taken");
    // So does its offer of a chain that turns the sealing off; frames in clear follow.
    let double = Chain::build("double").unwrap();
    ends[0].tx.begin_offer(double.ids().unwrap(), double.fit(CODED_MAX), false, None).unwrap();
    settle(&mut ends, &mut link, &mut rng, 50_000);
    assert_eq!(ends[0].tx.chain_now().1, double.ids().unwrap(), "the clear chain is on");
    assert!(ends[0].tx.seal().is_none());
    let want: Vec<u8> = (0..ends[0].tx.next_seq).map(|i| stream_byte(0, i)).collect();
    assert!(ends[1].received == want, "the stream arrived whole");
}
