//! Per-connection state in memory shared across `fork`: a process-shared futex lock for each
//! half, the reliability state and the replay ring, all in one anonymous shared mapping, so
//! a parent and a child that both use an inherited socket keep one sequence space.

pub use crate::sys::cell::Kept;
use crate::sys::cell::{HeadRing, LendCell, RingHead};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use substrate::reliability::{RxState, TxState};

/// A lock that works across processes sharing the memory (no `FUTEX_PRIVATE_FLAG`). If its
/// owner process died holding it, the next locker takes it over.
#[repr(C)]
pub struct FutexLock {
    state: AtomicU32,
    owner: AtomicI32,
    /// The holding thread (`pthread_self`, with `owner` naming its process).
    holder: AtomicUsize,
}

impl FutexLock {
    const fn new() -> FutexLock {
        FutexLock { state: AtomicU32::new(0), owner: AtomicI32::new(0), holder: AtomicUsize::new(0) }
    }

    /// True when the calling thread holds the lock (`holder` is set only while the lock is
    /// held, and cleared before it is let go).
    #[inline]
    pub fn held_here(&self) -> bool {
        self.holder.load(Relaxed) == crate::sys::process::pthread_self()
            && self.owner.load(Relaxed) == crate::pid()
    }
}

/// Holds a [`FutexLock`]; unlocks on drop.
pub struct FutexGuard<'a>(&'a FutexLock);

impl FutexLock {
    /// Takes the lock, waiting as long as needed.
    pub fn lock(&self) -> FutexGuard<'_> {
        for _ in 0..64 {
            if let Some(g) = self.try_lock() {
                return g;
            }
            std::hint::spin_loop();
        }
        loop {
            if self.state.swap(2, Acquire) == 0 {
                self.owner.store(crate::pid(), Relaxed);
                self.holder.store(crate::sys::process::pthread_self(), Relaxed);
                return FutexGuard(self);
            }
            crate::sys::futex_wait(&self.state, 2, 200);
            self.reap_dead_owner();
        }
    }

    /// Takes the lock if it is free.
    pub fn try_lock(&self) -> Option<FutexGuard<'_>> {
        if self.state.compare_exchange(0, 1, Acquire, Relaxed).is_ok() {
            self.owner.store(crate::pid(), Relaxed);
            self.holder.store(crate::sys::process::pthread_self(), Relaxed);
            Some(FutexGuard(self))
        } else {
            None
        }
    }

    fn reap_dead_owner(&self) {
        let owner = self.owner.load(Relaxed);
        if owner > 0 && !crate::sys::process::may_exist(owner) {
            crate::log::warn(format_args!("process {owner} died holding a connection lock; taking it over"));
            self.owner.store(0, Relaxed);
            self.state.store(0, Release);
        }
    }
}

impl FutexGuard<'_> {
    /// True if this guard holds `lock`.
    pub fn holds(&self, lock: &FutexLock) -> bool {
        std::ptr::eq(self.0, lock)
    }
}

impl Drop for FutexGuard<'_> {
    fn drop(&mut self) {
        self.0.holder.store(0, Relaxed);
        if self.0.state.swap(0, Release) == 2 {
            crate::sys::futex_wake(&self.0.state, 1);
        }
    }
}

/// Data of this process's that one of a connection's shared locks guards (a send or
/// receive chain): lent to the thread holding that lock, one borrow at a time.
pub struct Guarded<T> {
    cell: LendCell<T>,
    /// Address of the guarding lock.
    lock: usize,
}

impl<T> Guarded<T> {
    /// `v`, guarded by `lock`.
    pub fn new(v: T, lock: &FutexLock) -> Guarded<T> {
        Guarded { cell: LendCell::new(v), lock: lock as *const FutexLock as usize }
    }

    /// Runs `f` on the data. `lock` must be the guarding lock, held by this thread, and no
    /// other borrow of the data live (all checked).
    #[inline]
    pub fn with<R>(&self, lock: &FutexLock, f: impl FnOnce(&mut T) -> R) -> R {
        debug_assert!(std::ptr::eq(lock, self.lock as *const FutexLock), "chain under the wrong lock");
        debug_assert!(lock.held_here(), "chain used without its lock");
        self.cell.lend(f)
    }
}

/// A cell that begins a cache line: its lent flag and the first fields of its value, the
/// ones every call touches, share the line.
#[repr(C, align(64))]
struct LineCell<T>(LendCell<T>);

/// The shared part of a virtual connection (first page of its mapping; the ring follows).
/// What every send or receive looks at comes first, in its first two cache lines (a
/// program with many connections finds few of their lines in its cache between calls);
/// the send and the receive half each begin a line of their own.
#[repr(C)]
pub struct SharedConn {
    /// Guards `tx` and the send chain.
    pub tx_lock: FutexLock,
    /// Guards `rx` and the receive chain.
    pub rx_lock: FutexLock,
    /// errno every call reports once the connection is broken (0 = healthy).
    pub broken: AtomicI32,
    /// 1 once the peer's FIN arrived: it sends no more acks.
    pub peer_eof: AtomicU32,
    /// Copy of `rx.delivered` for the send half's piggy-backed acks.
    pub delivered: AtomicU64,
    /// Highest ack the receive half saw, for the send half to apply.
    pub peer_ack: AtomicU64,
    /// Copy of `tx.ack_sent`, for the receive half's decision to send an ack alone.
    pub ack_sent: AtomicU64,
    /// Highest stream offset that may be on the wire (set before each write), the bound for
    /// the peer's acknowledgements.
    pub wire_hi: AtomicU64,
    /// Copy of `tx.unacked()`, for statistics.
    pub unacked: AtomicU64,
    /// The peer's window (an ack of ours goes alone at five eighths of it; the peer's at five
    /// eighths of ours).
    pub peer_window: u64,
    /// Bumped each time a new physical link is installed (waiters sleep on it).
    pub link_gen: AtomicU32,
    /// 1 while the physical link is broken and being rebuilt.
    pub link_down: AtomicU32,
    /// 1 once the program shut down its sending side (shutdown or close): a rebuilt link
    /// carries the end of stream again after the replay.
    pub tx_shut: AtomicU32,
    /// Copy of `rx.careful`: the peer may send coded frames (readable reports are checked).
    pub careful: AtomicU32,
    /// 1 while our own stream is coded by a chain (`tx.chain_cur` is not 0).
    pub coding: AtomicU32,
    /// 1 while our chain offer waits for its answer (which may come alone: readable
    /// reports are checked).
    pub offering: AtomicU32,
    /// The peer's answer to our chain offer, for the send half (`rx::ANSWER | taken << 8 |
    /// number`; 0: none).
    pub chain_answer: AtomicU32,
    /// The answer we owe the peer's chain offer (same form, and `rx::MIRROR` when the peer
    /// asked for the chain both ways), sent by whichever half can.
    pub answer_owed: AtomicU32,
    /// 1 when the peer asked for its chain on our stream too while this side could not
    /// offer (an offer of ours waited): `mirror_ids` is offered back as soon as it can be.
    /// (Next to `answer_owed`: the send path reads both.)
    pub mirror_owed: AtomicU32,
    /// Work a sandboxed program thread could not do itself and left to a control thread
    /// (`CTL_ACK`, `CTL_HARVEST`).
    pub ctl_owed: AtomicU32,
    /// Processes holding the connection.
    pub procs: AtomicU32,
    /// End of the stream's bytes that went to the kernel by reference to the ring's pages
    /// (`sys::splice`); ring space below it is reused only after the peer's acknowledgement,
    /// or once the ring has new pages. Written under the tx lock.
    pub spliced_hi: AtomicU64,
    /// When the link broke (ms, monotonic), for the grace period.
    pub down_since_ms: AtomicU64,
    /// 1 when a rebuilt link still owes the peer our Fin frame (after the replay).
    pub fin_owed: AtomicU32,
    /// 1 when the operator pinned the connection to TCP (`vmictl move GID tcp`): rebuilt
    /// links neither offer nor take shared memory.
    pub pin_tcp: AtomicU32,
    /// The TCP options the program set on the connection (`PROG_CORK`, `PROG_NODELAY_SET`,
    /// `PROG_NODELAY`): the kernel socket has them while it carries the connection's
    /// frames, not while it carries only shared-memory bells (a corked bell waits 200 ms).
    pub prog_tcp: AtomicU32,
    /// Bumped each time the connection leaves or joins shared memory: a process whose
    /// shared-memory link names an older one (a fork sharing the connection) drops it.
    pub shm_epoch: AtomicU32,
    /// Process that rebuilt the link last, and the descriptor it put it under (other
    /// processes sharing the connection after a fork pick the new link up from there).
    pub link_pid: AtomicI32,
    /// See `link_pid`.
    pub link_fd: AtomicI32,
    /// Holds in `procs` that belong to processes that exec'd (their new images hold the
    /// connection through memory of their own and never give these back).
    pub exec_holds: AtomicU32,
    /// With `rx::MIRROR` in `answer_owed`: the compact form of the chain to offer back.
    pub mirror_ids: AtomicU32,
    /// `link_gen + 1` of the link whose receive buffer was made big enough for coded
    /// frames.
    pub rcvbuf_gen: AtomicU32,
    /// The receive low-water mark the layer last gave the link's socket (0 or 1: the
    /// kernel's default), so that it is set only when it changes.
    pub lowat: AtomicU32,
    /// 1 when the program's `connect` returned before the TCP handshake completed
    /// (non-blocking, or interrupted): until a byte of the peer's or an acknowledgement of
    /// ours shows the connection was made, an error of the socket is the kernel's answer to
    /// the `connect` (refused, timed out), which the program gets as it is; there is nothing
    /// to fail over.
    pub unconfirmed: AtomicU32,
    /// 1 when `broken` is the peer's program's reset (an Abort frame: it closed with unread
    /// bytes or with `SO_LINGER` 0), 2 once a call of the program got it: as from a socket,
    /// the reset is reported once, later reads find the end and later writes `EPIPE`. (A
    /// connection the layer itself had to end reports its error every time.)
    pub peer_reset: AtomicU32,
    /// 1 while this side tags the acknowledgements it sends alone (`rx.tags_acks()`: the
    /// chain the peer's stream took last is keyed, and its layer counts only tagged ones).
    /// Set by the receive half when it takes an offer, before the answer is owed.
    pub ack_tags: AtomicU32,
    /// Copy of `tx.ack_tagged`: with `ack_tags`, the acknowledgement the peer has counted.
    pub ack_tagged: AtomicU64,
    /// 1 when this side connected (it dials new links; the other side answers).
    pub active: u32,
    /// How many of `peer_agents` are set.
    pub n_peer_agents: AtomicU32,
    /// Where the peer's node agent can be reached, one address per network (slot form).
    /// Changed only by the process rebuilding the link, holding both halves' locks, when the
    /// peer moved to another node.
    peer_agents: [[AtomicU8; 20]; MAX_PEER_AGENTS],
    /// The connection's GID.
    pub gid: u128,
    /// Its secret.
    pub secret: u128,
    /// Send half (under `tx_lock`), lent with the replay ring.
    tx: LineCell<TxState>,
    /// Receive half (under `rx_lock`).
    rx: LineCell<RxState>,
    /// Key shares from the receive half to the send half: [`SHARE_OWED`] is ours for the
    /// answer owed (written before `answer_owed`), [`SHARE_IN`] the peer's that came with
    /// its answer (written before `chain_answer`).
    shares: [[AtomicU64; 4]; 2],
}

/// `SharedConn::share`: this side's key share for the answer it owes.
pub const SHARE_OWED: usize = 0;
/// `SharedConn::share`: the peer's key share from its answer to our offer.
pub const SHARE_IN: usize = 1;

impl RingHead for SharedConn {
    type Half = TxState;
    fn ring_cell(&self) -> &LendCell<TxState> {
        &self.tx.0
    }
}

/// `prog_tcp`: the program corked the connection (TCP_CORK 1).
pub const PROG_CORK: u32 = 1;
/// `prog_tcp`: the program set TCP_NODELAY (its value is `PROG_NODELAY`).
pub const PROG_NODELAY_SET: u32 = 2;
/// `prog_tcp`: the program's TCP_NODELAY value, when `PROG_NODELAY_SET`.
pub const PROG_NODELAY: u32 = 4;

/// `ctl_owed`: an acknowledgement is owed to the peer.
pub const CTL_ACK: u32 = 1;
/// `ctl_owed`: a sender waits for acknowledgements it cannot read off the socket itself.
pub const CTL_HARVEST: u32 = 2;

/// Most agent addresses kept for a peer node.
pub const MAX_PEER_AGENTS: usize = 8;

/// Bytes before the ring in a connection's mapping.
pub const HEAD: usize = 4096;
const _: () = assert!(std::mem::size_of::<SharedConn>() <= HEAD);
// (The fields every call reads stay in the first two lines.)
const _: () = assert!(std::mem::offset_of!(SharedConn, ctl_owed) < 128);

/// A view of one connection's memory: a [`SharedConn`] then the replay ring. Copyable; the
/// owning [`Mapping`] keeps it mapped.
#[derive(Clone, Copy)]
pub struct ConnMem(HeadRing<SharedConn>);

/// Owns a connection's mapping; unmaps it (in this process) on drop, where the sandbox
/// allows (see `SharedMap`).
pub struct Mapping {
    view: ConnMem,
    /// (Taken only in `drop`.)
    map: Option<crate::sys::shared::SharedMap>,
}

/// A connection that wrote more than this into its replay ring leaves its mapping to be
/// unmapped rather than kept for the next connection (the pages it touched would stay).
const SPARE_MAX_WRITTEN: u64 = 1 << 20;

impl Drop for Mapping {
    fn drop(&mut self) {
        let Some(map) = self.map.take() else { return };
        let c = self.view.conn();
        // Kept for the next connection only when no process holds this one any more (a
        // fork child or an exec'd image could still use it otherwise) and it touched little
        // of its ring.
        if c.procs.load(Acquire) == 0
            && c.exec_holds.load(Acquire) == 0
            && c.wire_hi.load(Acquire) <= SPARE_MAX_WRITTEN
        {
            map.spare();
        }
    }
}

impl std::ops::Deref for Mapping {
    type Target = ConnMem;
    fn deref(&self) -> &ConnMem {
        &self.view
    }
}

impl Mapping {
    /// Maps a new connection with a ring of `ring` bytes and a soft window of `soft`.
    pub fn new(
        ring: usize,
        soft: u64,
        gid: u128,
        secret: u128,
        peer_window: u64,
        active: bool,
        peer_agents: &[std::net::SocketAddr],
    ) -> Option<Mapping> {
        let len = HEAD + ring;
        let map = crate::sys::shared::SharedMap::anonymous_reused(len)?;
        let sc = SharedConn {
            tx_lock: FutexLock::new(),
            rx_lock: FutexLock::new(),
            procs: AtomicU32::new(1),
            broken: AtomicI32::new(0),
            delivered: AtomicU64::new(0),
            peer_ack: AtomicU64::new(0),
            ack_sent: AtomicU64::new(0),
            unacked: AtomicU64::new(0),
            wire_hi: AtomicU64::new(0),
            spliced_hi: AtomicU64::new(0),
            peer_eof: AtomicU32::new(0),
            link_gen: AtomicU32::new(0),
            link_down: AtomicU32::new(0),
            down_since_ms: AtomicU64::new(0),
            tx_shut: AtomicU32::new(0),
            fin_owed: AtomicU32::new(0),
            pin_tcp: AtomicU32::new(0),
            prog_tcp: AtomicU32::new(0),
            shm_epoch: AtomicU32::new(0),
            link_pid: AtomicI32::new(0),
            link_fd: AtomicI32::new(-1),
            ctl_owed: AtomicU32::new(0),
            exec_holds: AtomicU32::new(0),
            chain_answer: AtomicU32::new(0),
            answer_owed: AtomicU32::new(0),
            mirror_ids: AtomicU32::new(0),
            mirror_owed: AtomicU32::new(0),
            careful: AtomicU32::new(0),
            coding: AtomicU32::new(0),
            offering: AtomicU32::new(0),
            rcvbuf_gen: AtomicU32::new(0),
            lowat: AtomicU32::new(0),
            unconfirmed: AtomicU32::new(0),
            peer_reset: AtomicU32::new(0),
            ack_tags: AtomicU32::new(0),
            ack_tagged: AtomicU64::new(0),
            active: active as u32,
            n_peer_agents: AtomicU32::new(peer_agents.len().min(MAX_PEER_AGENTS) as u32),
            peer_agents: std::array::from_fn(|i| {
                let a = peer_agents.get(i).map(substrate::stats::encode_addr).unwrap_or([0; 20]);
                a.map(AtomicU8::new)
            }),
            gid,
            secret,
            peer_window,
            tx: LineCell(LendCell::new({
                let mut t = TxState::with_soft_window(ring as u64, soft);
                t.set_auth(secret);
                t
            })),
            rx: LineCell(LendCell::new({
                let mut r = RxState::new();
                r.set_auth(secret, active);
                r
            })),
            shares: Default::default(),
        };
        let view = ConnMem(HeadRing::init(&map, HEAD, sc)?);
        Some(Mapping { view, map: Some(map) })
    }
}

impl SharedConn {
    /// Puts a key share in place `which` ([`SHARE_OWED`] or [`SHARE_IN`]); the atomic
    /// store that publishes the answer it goes with comes after (release).
    pub fn set_share(&self, which: usize, share: &[u8; 32]) {
        for (w, c) in self.shares[which].iter().zip(share.chunks_exact(8)) {
            w.store(u64::from_le_bytes(c.try_into().expect("8 bytes")), Relaxed);
        }
    }

    /// The key share in place `which` (after an acquire load of the answer it goes with).
    pub fn share(&self, which: usize) -> [u8; 32] {
        let mut s = [0u8; 32];
        for (w, c) in self.shares[which].iter().zip(s.chunks_exact_mut(8)) {
            c.copy_from_slice(&w.load(Relaxed).to_le_bytes());
        }
        s
    }

    /// The peer node's agent addresses.
    pub fn peer_agents(&self) -> Vec<std::net::SocketAddr> {
        let n = (self.n_peer_agents.load(Acquire) as usize).min(MAX_PEER_AGENTS);
        // (They change only while a link is rebuilt, by the thread that also reads them to
        // dial: see `set_peer_agents`.)
        self.peer_agents[..n]
            .iter()
            .filter_map(|b| substrate::stats::decode_addr(&b.each_ref().map(|x| x.load(Relaxed))))
            .collect()
    }

    /// The peer now lives at another node: where its agent can be reached. The caller holds
    /// both halves' locks.
    pub fn set_peer_agents(&self, addrs: &[std::net::SocketAddr]) {
        if addrs.is_empty() || addrs == self.peer_agents().as_slice() {
            return;
        }
        for (d, s) in self.peer_agents.iter().zip(addrs) {
            for (d, b) in d.iter().zip(substrate::stats::encode_addr(s)) {
                d.store(b, Relaxed);
            }
        }
        self.n_peer_agents.store(addrs.len().min(MAX_PEER_AGENTS) as u32, Release);
    }
}

impl SharedConn {
    /// Runs `f` on the send half. `g` must hold this connection's `tx_lock` (checked): the
    /// guard is borrowed for the call, so no other access to the half can overlap it.
    #[inline]
    pub fn with_tx<R>(&self, g: &mut FutexGuard<'_>, f: impl FnOnce(&mut TxState) -> R) -> R {
        assert!(g.holds(&self.tx_lock), "send half without its lock");
        debug_assert!(self.tx_lock.held_here(), "connection state used without its lock");
        self.tx.0.lend(f)
    }

    /// Runs `f` on the receive half; `g` must hold `rx_lock` (checked).
    #[inline]
    pub fn with_rx<R>(&self, g: &mut FutexGuard<'_>, f: impl FnOnce(&mut RxState) -> R) -> R {
        assert!(g.holds(&self.rx_lock), "receive half without its lock");
        debug_assert!(self.rx_lock.held_here(), "connection state used without its lock");
        self.rx.0.lend(f)
    }

    /// Runs `f` on the send half, whose lock a caller of this thread took (checked, as is
    /// that no other borrow of the half is live).
    #[inline]
    pub fn with_tx_held<R>(&self, f: impl FnOnce(&mut TxState) -> R) -> R {
        debug_assert!(self.tx_lock.held_here(), "connection state used without its lock");
        self.tx.0.lend(f)
    }

    /// Runs `f` on the receive half, whose lock a caller of this thread took (checked).
    #[inline]
    pub fn with_rx_held<R>(&self, f: impl FnOnce(&mut RxState) -> R) -> R {
        debug_assert!(self.rx_lock.held_here(), "connection state used without its lock");
        self.rx.0.lend(f)
    }

    /// A look at the send half without its lock: a racy read that may see a value a
    /// moment old, taken only to choose whether and how to wait or look again (never to
    /// change anything). Goes away when the connection's state moves into atomics.
    pub fn peek_tx<R>(&self, f: impl FnOnce(&TxState) -> R) -> R {
        self.tx.0.peek(f)
    }

    /// As [`peek_tx`](Self::peek_tx), for the receive half.
    pub fn peek_rx<R>(&self, f: impl FnOnce(&RxState) -> R) -> R {
        self.rx.0.peek(f)
    }

    /// One field of the send half, as [`peek_tx`](Self::peek_tx) reads it, in one load: the
    /// field's offset and the field (through [`peek_tx!`], which names it once).
    #[inline]
    pub fn peek_tx_field<R: crate::sys::cell::Plain>(&self, at: usize, field: fn(&TxState) -> &R) -> R {
        self.tx.0.peek_field(at, field)
    }

    /// As [`peek_tx_field`](Self::peek_tx_field), for the receive half.
    #[inline]
    pub fn peek_rx_field<R: crate::sys::cell::Plain>(&self, at: usize, field: fn(&RxState) -> &R) -> R {
        self.rx.0.peek_field(at, field)
    }
}

/// One field of a connection's send half in one load: `peek_tx!(conn, next_seq)` (see
/// [`SharedConn::peek_tx_field`]; the field is named once, so its offset and its type agree).
macro_rules! peek_tx {
    ($c:expr, $f:ident) => {
        $c.peek_tx_field(std::mem::offset_of!(substrate::reliability::TxState, $f), |t| &t.$f)
    };
}
pub(crate) use peek_tx;

/// As [`peek_tx!`], for the receive half.
macro_rules! peek_rx {
    ($c:expr, $f:ident) => {
        $c.peek_rx_field(std::mem::offset_of!(substrate::reliability::RxState, $f), |r| &r.$f)
    };
}
pub(crate) use peek_rx;

impl ConnMem {
    /// Runs `f` on the send half and the replay ring; `g` must hold `tx_lock` (checked).
    #[inline]
    pub fn with_tx_ring<R>(&self, g: &mut FutexGuard<'_>, f: impl FnOnce(&mut TxState, &mut [u8]) -> R) -> R {
        assert!(g.holds(&self.conn().tx_lock), "send half without its lock");
        self.with_tx_ring_held(f)
    }

    /// Runs `f` on the send half and the replay ring, whose lock a caller of this thread
    /// took (checked, as is that no other borrow of the half is live).
    #[inline]
    pub fn with_tx_ring_held<R>(&self, f: impl FnOnce(&mut TxState, &mut [u8]) -> R) -> R {
        debug_assert!(self.conn().tx_lock.held_here(), "connection state used without its lock");
        self.0.with_ring(f)
    }

    /// The shared state.
    #[inline]
    pub fn conn(&self) -> &'static SharedConn {
        self.0.head()
    }

    /// Ring length in bytes.
    pub fn ring_len(&self) -> usize {
        self.0.ring_len()
    }
}
