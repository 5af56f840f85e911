//! A virtual connection in this process: its shared memory (state and replay ring), its
//! statistics slot, and its send and receive chains. The kernel-TCP sink at the bottom of
//! both chains is in [`crate::tcp_sink`].

use crate::linkstate;
use crate::shm::{ConnMem, Guarded, Mapping};
use crate::shm_sink::{self, LinkSlot, ShmLink, ShmSink};
use crate::sockswap;
use crate::stats::{Slot, SlotInfo};
use crate::sys::Errno;
use crate::tcp_sink::TcpSink;
use std::net::SocketAddr;
use substrate::reliability::{AppBytes, Gather};

/// Gathered bytes up to this many go through the other devices from a buffer on the stack.
const STAGED: usize = 4096;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering::*};
use std::sync::Arc;
use substrate::devices::CounterFilter;
use substrate::irb::{Chain, Irb, IrbError, IrbKind, Outcome};
use substrate::reliability::{RxState, TxState};

/// What the connection layer asks of the descriptor table above it (which holds the
/// process's connections and listeners); the table registers it at start
/// (`fdtable::install`).
pub struct Descriptors {
    /// Each distinct connection with a descriptor in this process.
    pub connections: fn() -> Vec<Arc<Vc>>,
    /// This process's descriptors of a connection.
    pub fds_of: fn(&Vc) -> Vec<i32>,
    /// This process's listeners under the layer: descriptor and address.
    pub listeners: fn() -> Vec<(i32, SocketAddr)>,
    /// The connection with a GID, if this process has a descriptor of it.
    pub by_gid: fn(u128) -> Option<Arc<Vc>>,
}

static DESCRIPTORS: std::sync::OnceLock<Descriptors> = std::sync::OnceLock::new();

/// Bumped each time a live connection of this process joins or leaves shared memory (a
/// rebuilt link: a move, a failover, a device): the epoll registrations made before look at
/// their connections' substrate again (`ready`), so that a ring that came later is scanned.
static SUBSTRATE_MOVES: AtomicU32 = AtomicU32::new(0);

/// How many times a live connection joined or left shared memory (one load).
#[inline]
pub fn substrate_moves() -> u32 {
    SUBSTRATE_MOVES.load(Acquire)
}

/// Registers the descriptor table (once).
pub fn descriptors_from(d: Descriptors) {
    let _ = DESCRIPTORS.set(d);
}

/// Each distinct connection with a descriptor in this process.
pub fn connections() -> Vec<Arc<Vc>> {
    DESCRIPTORS.get().map_or_else(Vec::new, |d| (d.connections)())
}

/// The connection with GID `gid`, if this process has a descriptor of it.
pub fn by_gid(gid: u128) -> Option<Arc<Vc>> {
    DESCRIPTORS.get().and_then(|d| (d.by_gid)(gid))
}

/// This process's descriptors of `v`.
pub fn fds_of(v: &Vc) -> Vec<i32> {
    DESCRIPTORS.get().map_or_else(Vec::new, |d| (d.fds_of)(v))
}

/// This process's listeners under the layer (descriptor, address).
pub fn listeners() -> Vec<(i32, SocketAddr)> {
    DESCRIPTORS.get().map_or_else(Vec::new, |d| (d.listeners)())
}

/// This process's listeners, one descriptor per address.
pub fn listeners_once() -> Vec<(i32, SocketAddr)> {
    let mut v = listeners();
    v.sort_by_key(|&(_, a)| a);
    v.dedup_by_key(|&mut (_, a)| a);
    v
}

/// The calls taking a link another process rebuilt needs.
const ADOPT_CALLS: &[libc::c_long] = &[
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_getfd,
    libc::SYS_close,
    libc::SYS_dup3,
    libc::SYS_fcntl,
    libc::SYS_openat,
    libc::SYS_epoll_ctl,
];

/// The program's epoll registrations of a connection's descriptors while its link is
/// rebuilt.
#[derive(Default)]
struct ParkedEpoll {
    /// (epoll fd, fd, events, data), registered again at install.
    regs: Vec<sockswap::EpollReg>,
    /// Between taking them off the old socket and registering them on the new one.
    parked: bool,
}

/// A virtual connection. (Laid out in order: what every call reads comes first, so that
/// a program with many connections finds few lines of each missing from its cache.)
#[repr(C)]
pub struct Vc {
    mem: Mapping,
    slot: Option<Slot>,
    /// The link generation this process's descriptors name (behind the shared one after
    /// another process rebuilt the link).
    my_gen: AtomicU32,
    /// The link generation whose first frames a readiness check has taken (see
    /// [`Vc::readable_truth`]).
    truth_gen: AtomicU32,
    /// A wait reported the connection readable and no receive followed yet.
    told_readable: std::sync::atomic::AtomicBool,
    /// The TCP sink's receive hint for calls that skip the chain (see `tcp_sink::recv`).
    small_reads: std::sync::atomic::AtomicBool,
    tapped: std::sync::atomic::AtomicBool,
    /// True once `links` holds a link (it never lets go of one).
    linked: std::sync::atomic::AtomicBool,
    /// The statistics slot was freed at an exec (see [`Vc::exec_hold`]).
    slot_freed: std::sync::atomic::AtomicBool,
    /// While the link is down: the placeholder socket under this process's descriptors.
    parked: AtomicI32,
    /// Shared memory with a peer on this node, when the two layers set it up.
    links: Arc<LinkSlot>,
    /// While the link is down: the program's epoll registrations of the old socket.
    parked_epoll: std::sync::Mutex<ParkedEpoll>,
    send_chain: Guarded<Chain>,
    recv_chain: Guarded<Chain>,
    /// Local address.
    pub local: SocketAddr,
    /// Peer address.
    pub peer: SocketAddr,
    /// True when this side connected.
    pub active: bool,
    /// True when the physical link's addresses differ from what the program sees from the
    /// start (connected through another address of the peer's node).
    pub renamed: bool,
    /// Taps on this end (profile, capture), and whether any is on.
    taps: std::sync::Mutex<crate::tap::Taps>,
}

/// What is needed to set up a virtual connection.
pub struct Setup {
    /// GID.
    pub gid: u128,
    /// Secret.
    pub secret: u128,
    /// Our soft window.
    pub window: u64,
    /// The peer's soft window.
    pub peer_window: u64,
    /// Local address.
    pub local: SocketAddr,
    /// Peer address.
    pub peer: SocketAddr,
    /// True when this side connected.
    pub active: bool,
    /// The peer node's agent addresses (the connecting side dials them after a failure).
    pub peer_agents: Vec<SocketAddr>,
    /// The program sees other addresses than the physical socket's from the start.
    pub renamed: bool,
    /// Shared memory offered (connecting side) or taken (accepting side).
    pub shm: Option<ShmLink>,
}

fn chain_for(mem: ConnMem, slot: Option<Slot>, links: &Arc<LinkSlot>) -> Chain {
    let mut c = Chain::new();
    if let Some(s) = slot {
        let _ = c.attach(0, Box::new(CounterFilter::new(s.counters())));
    }
    let _ = c.attach(usize::MAX, Box::new(ShmSink::new(links.clone(), TcpSink::new(mem, slot), slot)));
    c
}

impl Vc {
    /// Sets up the layer's side of a virtual connection.
    pub fn new(s: Setup) -> Option<Vc> {
        let ring = (s.window * crate::config::ring_factor()) as usize;
        let mem = Mapping::new(ring, s.window, s.gid, s.secret, s.peer_window, s.active, &s.peer_agents)?;
        let slot = crate::stats::table().and_then(|t| {
            t.alloc(&SlotInfo {
                gid: s.gid,
                local: s.local,
                peer: s.peer,
                active: s.active,
                window: s.window,
            })
        });
        let m = *mem;
        let links = Arc::new(LinkSlot::default());
        let linked = s.shm.is_some();
        let code = s.shm.map_or(1, |l| {
            let l = links.set(l);
            l.protect();
            l.code()
        });
        if let Some(sl) = slot {
            sl.set_link(&s.local, &s.peer);
            sl.set_substrate(code);
        }
        let (tx_lock, rx_lock) = (&mem.conn().tx_lock, &mem.conn().rx_lock);
        let send_chain = Guarded::new(chain_for(m, slot, &links), tx_lock);
        let recv_chain = Guarded::new(chain_for(m, slot, &links), rx_lock);
        Some(Vc {
            mem,
            slot,
            local: s.local,
            peer: s.peer,
            active: s.active,
            renamed: s.renamed,
            send_chain,
            recv_chain,
            my_gen: AtomicU32::new(0),
            parked: AtomicI32::new(-1),
            truth_gen: AtomicU32::new(m.conn().link_gen.load(Acquire)),
            told_readable: std::sync::atomic::AtomicBool::new(false),
            parked_epoll: std::sync::Mutex::new(ParkedEpoll::default()),
            links,
            linked: std::sync::atomic::AtomicBool::new(linked),
            slot_freed: std::sync::atomic::AtomicBool::new(false),
            small_reads: std::sync::atomic::AtomicBool::new(true),
            taps: std::sync::Mutex::new(crate::tap::Taps::default()),
            tapped: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The placeholder under this process's descriptors while the link is down (-1: none).
    pub fn parked(&self) -> i32 {
        self.parked.load(Acquire)
    }

    /// Sets the placeholder; returns the previous one.
    pub fn set_parked(&self, fd: i32) -> i32 {
        self.parked.swap(fd, AcqRel)
    }

    /// Takes the sockets under `fds` out of the program's epoll instances and keeps their
    /// registrations aside until [`Vc::unpark_epoll`]. The lock is held from reading them
    /// until they are kept, so a change the program makes meanwhile ([`Vc::epoll_ctl`])
    /// lands before or after, never in between.
    pub fn park_epoll(&self, fds: &[i32]) {
        let mut p = self.parked_epoll.lock().unwrap_or_else(|e| e.into_inner());
        let regs = sockswap::epoll_detach(fds);
        p.regs.extend(regs);
        p.parked = true;
    }

    /// Registers the kept registrations again (on the socket now under their descriptors),
    /// under the same lock.
    pub fn unpark_epoll(&self) {
        let mut p = self.parked_epoll.lock().unwrap_or_else(|e| e.into_inner());
        sockswap::epoll_attach(&std::mem::take(&mut p.regs));
        p.parked = false;
    }

    /// The program's `epoll_ctl` on `fd`, a descriptor of this connection (`ev` as it passed
    /// it), under the lock that moving registrations between sockets holds. While the
    /// registrations are kept aside (the link is rebuilt; a placeholder or a socket not yet
    /// registered is under `fd`), a change of this descriptor's registration with `epfd`
    /// is made to the kept one, and a new one is kept too (`EPOLL_CTL_ADD`: on the
    /// placeholder it would be lost at install, and asyncio adds again after removing a
    /// reader and a writer); install registers them on the new socket. `event` reads the
    /// program's event (only then); `forward` makes the program's call.
    pub fn epoll_ctl(
        &self,
        epfd: i32,
        op: i32,
        fd: i32,
        event: impl FnOnce() -> Option<libc::epoll_event>,
        forward: impl FnOnce() -> Result<i32, Errno>,
    ) -> Result<i32, Errno> {
        // (The instance is noted before the call, and the change after it: a link rebuilt
        // meanwhile must look at this instance, and not at a copy of its registrations made
        // before the change.)
        if op != libc::EPOLL_CTL_DEL {
            sockswap::note_epfd(epfd);
        }
        let mut p = self.parked_epoll.lock().unwrap_or_else(|e| e.into_inner());
        if p.parked {
            let i = p.regs.iter().position(|r| r.0 == epfd && r.1 == fd);
            let e = event();
            // `None`: not about a kept registration (another epoll instance, a bad argument):
            // the kernel answers.
            let kept: Option<Result<i32, Errno>> = match (op, i, e) {
                (libc::EPOLL_CTL_DEL, Some(i), _) => {
                    p.regs.remove(i);
                    Some(Ok(0))
                }
                (libc::EPOLL_CTL_MOD, Some(i), Some(e)) => {
                    p.regs[i].2 = e.events;
                    p.regs[i].3 = e.u64;
                    Some(Ok(0))
                }
                (libc::EPOLL_CTL_ADD, Some(_), _) => Some(Err(Errno(libc::EEXIST))),
                (libc::EPOLL_CTL_ADD, None, Some(e)) => {
                    p.regs.push((epfd, fd, e.events, e.u64));
                    Some(Ok(0))
                }
                _ => None,
            };
            if let Some(r) = kept {
                return r;
            }
        }
        let r = forward();
        sockswap::note_ctl();
        r
    }

    /// The statistics slot.
    pub fn slot(&self) -> Option<Slot> {
        self.slot
    }

    /// This process's descriptors name link generation `gen`.
    pub fn seen_gen(&self, gen: u32) {
        self.my_gen.store(gen, Release);
    }

    /// True when another process rebuilt the link and this process's descriptors still name
    /// the old one.
    pub fn behind(&self) -> bool {
        self.mem.conn().link_gen.load(Acquire) != self.my_gen.load(Relaxed)
    }

    /// Before a call: the control thread of this process runs (a forked child starts its
    /// own), and this process's descriptors name the current link (taken from the process
    /// that rebuilt it; by the control thread where a sandbox forbids the program's thread
    /// the calls that takes).
    #[inline(always)]
    fn prepare(&self) {
        linkstate::ensure_control();
        if self.behind() {
            self.catch_up();
        }
    }

    /// In a process sharing the connection (after fork) whose descriptors still name the old
    /// socket: take the new link from the process that rebuilt it.
    pub fn adopt(&self) {
        let c = self.mem().conn();
        let gen = c.link_gen.load(Acquire);
        let (pid, src) = (c.link_pid.load(Acquire), c.link_fd.load(Acquire));
        if pid <= 0 || pid == crate::pid() || src < 0 || c.link_down.load(Acquire) != 0 {
            self.seen_gen(gen);
            return;
        }
        let got = crate::sys::fd::fd_of_process(pid, src);
        if got < 0 {
            crate::log::warn(format_args!(
                "virtual connection {:032x}: cannot take the rebuilt link from process {pid} (errno {}); this process loses it",
                c.gid,
                crate::sys::errno()
            ));
            self.seen_gen(gen);
            return;
        }
        let fds = fds_of(self);
        let regs = sockswap::epoll_detach(&fds);
        sockswap::put_under(got, &fds);
        crate::sys::fd::close(got);
        sockswap::epoll_attach(&regs);
        self.seen_gen(gen);
    }

    #[cold]
    fn catch_up(&self) {
        if crate::sandbox::allows_all(ADOPT_CALLS) {
            self.adopt();
        } else {
            linkstate::poke_work();
        }
    }

    /// Runs a call, waiting for a rebuilt link when the current one is down (blocking
    /// descriptors), or saying EAGAIN (non-blocking ones).
    fn with_link(
        &self,
        fd: i32,
        flags: i32,
        mut call: impl FnMut(u64) -> Result<usize, IrbError>,
    ) -> Result<usize, IrbError> {
        loop {
            self.prepare();
            // The call's link generation goes down the chain with it (`Irb::ctx`, plus one),
            // so that an error from a socket another process already replaced does not mark
            // the new link down.
            let gen = self.my_gen.load(Relaxed);
            match call(gen as u64 + 1) {
                Err(IrbError::LinkDown) => {
                    if flags & libc::MSG_DONTWAIT != 0 || crate::sys::nonblocking(fd) {
                        return Err(IrbError::WouldBlock);
                    }
                    linkstate::wait_link(self.mem()).map_err(IrbError::Os)?;
                }
                r => return r,
            }
        }
    }

    /// Rebuilds a connection handed over across `exec`: same identity, same stream
    /// positions. `unacked` holds the bytes the peer's layer had not acknowledged
    /// (`tx.acked..tx.next_seq`), carried over by the old image; they go back into the
    /// replay ring. Without them (no memory file could be made or read) they count as
    /// acknowledged, and a replay still owed cannot be made: the connection is then reset
    /// rather than sending anything else in their place.
    pub fn restore(mut s: Setup, mut tx: TxState, rx: RxState, unacked: Option<Vec<u8>>) -> Option<Vc> {
        let window = s.window;
        let owed = tx.next_seq - tx.acked;
        let unacked = unacked.filter(|b| b.len() as u64 == owed);
        if unacked.is_some() {
            // The new ring must hold them even if this image has a smaller window.
            s.window = s.window.max(owed.div_ceil(crate::config::ring_factor()));
        }
        let gid = s.gid;
        let vc = Vc::new(s)?;
        let c = vc.mem.conn();
        let fresh = TxState::with_soft_window(vc.mem.ring_len() as u64, window);
        tx.window = fresh.window;
        tx.soft_window = fresh.soft_window;
        let mut lost = false;
        match unacked {
            Some(b) => {
                let mut g = c.tx_lock.lock();
                vc.mem.with_tx_ring(&mut g, |_, ring| {
                    substrate::reliability::ring_write(ring, tx.ring_pos(tx.acked), &b)
                });
            }
            None => {
                lost = tx.replaying() || tx.in_frame();
                tx.acked = tx.next_seq;
            }
        }
        // (The connection is new and not shared yet: the locks are free.)
        c.with_tx(&mut c.tx_lock.lock(), |t| *t = tx);
        c.with_rx(&mut c.rx_lock.lock(), |r| *r = rx);
        c.delivered.store(rx.delivered, Release);
        c.peer_ack.store(rx.peer_ack, Release);
        c.careful.store(rx.careful, Release);
        c.coding.store(u32::from(tx.chain_cur != 0), Release);
        if let Some(sl) = vc.slot {
            sl.set_chain(tx.chain_now().1, true);
            sl.set_offer(tx.offer_waiting());
            let rx_ids = (1..16).rev().find_map(|n| rx.chain_ids(n).filter(|_| rx.careful != 0)).unwrap_or(0);
            sl.set_chain(rx_ids, false);
        }
        c.ack_sent.store(tx.ack_sent, Release);
        c.ack_tagged.store(tx.ack_tagged, Release);
        c.ack_tags.store(rx.tags_acks() as u32, Release);
        c.wire_hi.store(tx.next_seq, Release);
        c.unacked.store(tx.unacked(), Relaxed);
        if lost {
            crate::log::error(format_args!(
                "virtual connection {gid:032x}: bytes still owed to the peer did not cross the exec; \
                 resetting it (the program sees ECONNRESET)"
            ));
            c.broken.store(libc::ECONNRESET, Release);
        }
        Some(vc)
    }

    /// The shared memory view.
    pub fn mem(&self) -> ConnMem {
        *self.mem
    }

    fn run(chain: &mut Chain, irb: Irb<'_>) -> Result<usize, IrbError> {
        match chain.submit(irb) {
            Outcome::Complete(c) => c.result(),
            Outcome::Pending(_) => Err(IrbError::WouldBlock),
        }
    }

    /// Points the statistics slot at the calling process when it is not the one recorded
    /// (a forked child took the connection over).
    #[inline]
    fn note_user(&self) {
        if let Some(s) = self.slot {
            s.set_pid(crate::pid());
        }
    }

    /// Sends application bytes through the send chain.
    pub fn send(&self, fd: i32, data: &[u8], flags: i32) -> Result<usize, IrbError> {
        self.send_bytes(fd, data, flags)
    }

    /// [`send`](Self::send) of the bytes of several of the program's buffers in order (a
    /// `writev`'s): on kernel TCP with no filters they go as one frame, in one system call,
    /// with no copy other than the replay ring's; elsewhere they are gathered into one
    /// buffer first.
    pub fn send_gather(&self, fd: i32, data: Gather<'_>, flags: i32) -> Result<usize, IrbError> {
        self.send_bytes(fd, data, flags)
    }

    #[inline]
    fn send_bytes<'a>(&self, fd: i32, data: impl AppBytes<'a>, flags: i32) -> Result<usize, IrbError> {
        self.note_user();
        let c = self.mem.conn();
        let r = self.with_link(fd, flags, |ctx| {
            let _g = c.tx_lock.lock();
            self.send_chain.with(&c.tx_lock, |chain| {
                if self.plain(chain) {
                    let r =
                        crate::tcp_sink::send(*self.mem, self.slot, fd, data, flags, Some((ctx - 1) as u32));
                    self.count(r, IrbKind::Send);
                    return r;
                }
                let mut run =
                    |b: &[u8]| Self::run(chain, Irb::send(b, flags).with_handle(fd as i64).with_ctx(ctx));
                match data.parts() {
                    [] => run(&[]),
                    [one] => run(one),
                    parts if data.len() <= STAGED => {
                        // (No allocation for a small message.)
                        let mut raw = std::mem::MaybeUninit::<[u8; STAGED]>::uninit();
                        let mut stage = crate::sys::fd::Stage::new(&mut raw);
                        let flat = stage.zeroed(data.len());
                        let mut at = 0;
                        for p in parts {
                            flat[at..at + p.len()].copy_from_slice(p);
                            at += p.len();
                        }
                        run(flat)
                    }
                    parts => run(&parts.concat()),
                }
            })
        });
        if self.tapped.load(Relaxed) {
            if let Ok(n) = r {
                // (One message for the taps, as the program wrote it.)
                let sent = data.take(n);
                match sent.parts() {
                    [one] => self.tap(crate::tap::SEND, one),
                    parts => self.tap(crate::tap::SEND, &parts.concat()),
                }
            }
        }
        r
    }

    /// The taps see `data` moving in direction `dir`. (Skipped, never waited for, when
    /// another call of this process holds them, or a signal handler interrupted one.)
    #[cold]
    fn tap(&self, dir: usize, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if let Ok(mut t) = self.taps.try_lock() {
            t.record(dir, data);
            if t.is_empty() {
                self.tapped.store(false, Relaxed);
            }
        }
    }

    /// Loads (or unloads) the `profile` tap on this end.
    pub fn set_profile(&self, on: bool) {
        let mut t = self.taps.lock().unwrap_or_else(|p| p.into_inner());
        t.profile = on.then(Default::default);
        self.tapped.store(!t.is_empty(), Relaxed);
    }

    /// The profile as JSON, `None` when the `profile` tap is not loaded.
    pub fn profile_json(&self) -> Option<String> {
        let t = self.taps.lock().unwrap_or_else(|p| p.into_inner());
        t.profile.as_ref().map(|p| p.json(self.mem.conn().gid))
    }

    /// Starts capturing this end's traffic into `fd` (taken over) for `duration_ms`.
    pub fn start_capture(&self, fd: i32, duration_ms: u64) -> bool {
        let gid = self.mem.conn().gid;
        let Some(c) = crate::tap::Capture::start(fd, duration_ms, self.local, self.peer, gid) else {
            crate::sys::fd::close(fd);
            return false;
        };
        let mut t = self.taps.lock().unwrap_or_else(|p| p.into_inner());
        t.capture = Some(c);
        self.tapped.store(true, Relaxed);
        true
    }

    /// Ends a capture whose time is over (the control thread calls it; a busy connection
    /// ends it itself). Returns packets written and lost, when it ended one.
    pub fn end_capture_if_over(&self) -> Option<(u64, u64)> {
        if !self.tapped.load(Relaxed) {
            return None;
        }
        let mut t = self.taps.lock().unwrap_or_else(|p| p.into_inner());
        if !t.capture.as_ref().is_some_and(|c| c.over()) {
            return None;
        }
        let c = t.capture.take()?;
        self.tapped.store(!t.is_empty(), Relaxed);
        Some((c.packets, c.lost))
    }

    /// Receives application bytes through the receive chain.
    pub fn recv(&self, fd: i32, buf: &mut [u8], flags: i32) -> Result<usize, IrbError> {
        self.note_user();
        let c = self.mem.conn();
        // A wait told the program this descriptor is readable: this receive must find data.
        let told = self.told_readable.load(Relaxed) && self.told_readable.swap(false, Relaxed);
        // (Read only then: the common receive pays one relaxed load for all this.)
        let gen = if told { c.link_gen.load(Acquire) } else { 0 };
        let mut r = self.with_link(fd, flags, |ctx| self.recv_once(fd, buf, flags, ctx));
        if told && matches!(r, Err(IrbError::WouldBlock)) && self.promise_pending(gen) {
            r = self.recv_promised(fd, buf, flags, gen);
        }
        if self.tapped.load(Relaxed) && flags & libc::MSG_PEEK == 0 {
            if let Ok(n) = r {
                self.tap(crate::tap::RECV, &buf[..n.min(buf.len())]);
            }
        }
        r
    }

    #[inline]
    fn recv_once(&self, fd: i32, buf: &mut [u8], flags: i32, ctx: u64) -> Result<usize, IrbError> {
        let c = self.mem.conn();
        let _g = c.rx_lock.lock();
        self.recv_chain.with(&c.rx_lock, |chain| {
            if self.plain(chain) {
                let mut small = self.small_reads.load(Relaxed);
                let gen = Some((ctx - 1) as u32);
                let r = crate::tcp_sink::recv(*self.mem, self.slot, fd, buf, flags, &mut small, gen);
                self.small_reads.store(small, Relaxed);
                if flags & libc::MSG_PEEK == 0 {
                    self.count(r, IrbKind::Receive);
                }
                return r;
            }
            Self::run(chain, Irb::receive(buf, flags).with_handle(fd as i64).with_ctx(ctx))
        })
    }

    /// The chain holds nothing but the statistics counter and the sink, and the connection
    /// runs on kernel TCP (no shared memory offered, taken or left): a program's send or
    /// receive goes to the TCP sink directly, as the chain would pass it (the chain's
    /// dispatch, its request blocks and its completion walk cost about a thousand
    /// instructions a call, a quarter of the layer's own work on a small message).
    #[inline]
    fn plain(&self, chain: &Chain) -> bool {
        chain.len() == 1 + usize::from(self.slot.is_some()) && self.link().is_none()
    }

    /// What the statistics counter does on the chain's way back, for a call that skipped it.
    #[inline]
    fn count(&self, r: Result<usize, IrbError>, kind: IrbKind) {
        if let Some(s) = self.slot {
            s.counters().note(kind, &r);
        }
    }

    /// True when the link broke or was rebuilt since generation `gen`.
    fn relinked_since(&self, gen: u32) -> bool {
        let c = self.mem.conn();
        c.link_down.load(Acquire) != 0 || c.link_gen.load(Acquire) != gen
    }

    /// True when a receive that found nothing after a readable report did so for a reason
    /// of the layer's, the report's data still to come: the link broke or was rebuilt since
    /// generation `gen` (the peer sends the data again on the new link), or the socket held
    /// only the start of a frame (part of a header, or a header and none of its payload: a
    /// report that looks only at the kernel's count cannot tell; natively every byte that
    /// makes a socket readable is the program's).
    #[inline]
    fn promise_pending(&self, gen: u32) -> bool {
        self.relinked_since(gen) || (self.shm_now().is_none() && crate::tcp_sink::frame_begun(self.mem()))
    }

    /// A non-blocking receive after a readable report whose data has not come (see
    /// [`promise_pending`](Self::promise_pending)): waits for the link and the data, as the
    /// report promised (at most `PROMISE_WAIT_MS`; then `EAGAIN`). UCX (MPICH) frees its
    /// receive buffer on an `EAGAIN` in the middle of a message, and its next readable event
    /// follows a null pointer.
    #[cold]
    fn recv_promised(&self, fd: i32, buf: &mut [u8], flags: i32, gen: u32) -> Result<usize, IrbError> {
        const PROMISE_WAIT_MS: u64 = 3_000;
        let deadline = crate::sys::now_ms() + PROMISE_WAIT_MS;
        // Whether the socket said readable last time round: then a receive that still finds
        // nothing (a peek leaves a header where it is; a coded frame waits whole in the
        // socket) pauses before the next look instead of spinning on a readable socket.
        let mut was_ready = false;
        loop {
            if !self.promise_pending(gen) {
                // (What the socket held was the whole of a frame of the layer's own.)
                return Err(IrbError::WouldBlock);
            }
            if self.mem.conn().link_down.load(Acquire) != 0 {
                linkstate::wait_link(self.mem()).map_err(IrbError::Os)?;
            }
            match self.with_link(fd, flags | libc::MSG_DONTWAIT, |ctx| {
                self.recv_once(fd, buf, flags | libc::MSG_DONTWAIT, ctx)
            }) {
                Err(IrbError::WouldBlock) if crate::sys::now_ms() < deadline => {
                    if was_ready {
                        crate::sandbox::pause_us(200);
                    }
                    was_ready = crate::sys::wait_fd(fd, libc::POLLIN, 50) & libc::POLLIN != 0;
                }
                r => return r,
            }
        }
    }

    /// A wait reported `fd` readable to the program (see [`Vc::recv`]).
    pub fn told_readable(&self) {
        if !self.told_readable.load(Relaxed) {
            self.told_readable.store(true, Relaxed);
        }
    }

    /// What the kernel's "readable" for `fd` means (see [`crate::ready`]): payload or the
    /// end waits, or only the layer's own bytes did (now taken). While a link is being put
    /// in place (its registration is back before the relinking thread lets go of the
    /// connection) or another thread holds the receive half for a moment, it waits for that
    /// (at most `TRUTH_WAIT_US`): the rebuilt link's first frame is exactly what must not be
    /// reported. Past that the answer is `Unknown`.
    pub fn readable_truth(&self, fd: i32) -> crate::readiness::Truth {
        use crate::readiness::Truth;
        const TRUTH_WAIT_US: u64 = 5_000;
        let c = self.mem.conn();
        let mut deadline = 0;
        let mut later = || {
            let now = crate::sys::now_us();
            if deadline == 0 {
                deadline = now + TRUTH_WAIT_US;
            }
            if now >= deadline {
                return false;
            }
            crate::sandbox::pause_us(50);
            true
        };
        loop {
            if c.broken.load(Acquire) != 0 {
                return Truth::Readable;
            }
            if self.behind() && c.link_down.load(Acquire) == 0 {
                // Another process of the connection rebuilt it: take the new link now.
                self.prepare();
            }
            if c.link_down.load(Acquire) != 0 || self.behind() {
                if later() {
                    continue;
                }
                // Only a link really down has its socket on the way out; otherwise report
                // what the kernel says rather than risk hiding data for good.
                return if c.link_down.load(Acquire) != 0 { Truth::Relinking } else { Truth::Unknown };
            }
            if let Some(l) = self.shm_now() {
                if l.mode() != shm_sink::Mode::Shm {
                    return Truth::Unknown;
                }
                if l.moving() {
                    if later() {
                        continue;
                    }
                    return Truth::Unknown;
                }
                let Some(_g) = c.rx_lock.try_lock() else {
                    if later() {
                        continue;
                    }
                    return Truth::Unknown;
                };
                return match l.truth(fd) {
                    Ok(false) => Truth::Spurious,
                    Err(IrbError::LinkDown) => Truth::Relinking,
                    _ => Truth::Readable,
                };
            }
            if !crate::tcp_sink::stray_frames_possible(self.mem(), self.truth_gen.load(Relaxed)) {
                return Truth::Readable;
            }
            let Some(_g) = c.rx_lock.try_lock() else {
                if later() {
                    continue;
                }
                return Truth::Unknown;
            };
            if c.link_down.load(Acquire) != 0 || self.behind() {
                continue;
            }
            let gen = c.link_gen.load(Acquire);
            let t = crate::tcp_sink::truth(self.mem(), self.slot, fd);
            // Whatever it found, the frames at the head of this link's socket were looked at.
            self.truth_gen.store(gen, Relaxed);
            return t;
        }
    }

    /// The connection's shared-memory link in this process, whatever it carries now.
    pub fn shm(&self) -> Option<&ShmLink> {
        self.link()
    }

    /// [`shm`](Self::shm), from a flag on this connection's first cache line while there
    /// has never been one (the slot itself is in memory of its own: one more line missing
    /// from the cache at every call of a program with many connections).
    #[inline]
    fn link(&self) -> Option<&ShmLink> {
        if !self.linked.load(Acquire) {
            return None;
        }
        self.links.get()
    }

    /// The shared memory carrying the bytes, when it does (or will: the connecting side
    /// waiting for the answer); not after a refusal, nor once the connection left it.
    pub fn shm_now(&self) -> Option<&ShmLink> {
        let c = self.mem.conn();
        self.link().filter(|l| {
            matches!(l.mode(), shm_sink::Mode::Shm | shm_sink::Mode::Pending)
                && l.epoch() == c.shm_epoch.load(Acquire)
        })
    }

    /// For a wait that looks at this connection's ring (descriptor `fd`): true when it holds
    /// bytes (with `sleep`, an empty ring is marked sleeping: the writer rings from now on).
    /// A link still pending takes the peer's answer first if it came: a scanned ring's bells
    /// go to its instance's bell, not through the socket, so the scan may be the only look
    /// the program's thread takes at the connection (a busy loop that waits for input), and
    /// a link left pending would never show its bytes.
    pub fn scan_ready(&self, fd: i32, sleep: bool) -> bool {
        self.shm_now().is_some_and(|l| {
            if l.mode() == shm_sink::Mode::Pending && l.answered() {
                let _ = l.settle(fd, false, false);
            }
            l.scan_ready(sleep)
        })
    }

    /// True when the connection is on shared memory and the peer shut its sending side: the
    /// kernel's socket, which carries only bells, cannot say so (`POLLRDHUP`).
    pub fn shm_peer_shut(&self) -> bool {
        self.shm_now().is_some_and(|l| l.peer_shut())
    }

    /// Its ring's data bells go to epoll instance bell `to` from now on (0: its socket).
    /// True when they went to another instance's bell before: the caller announces it.
    pub fn direct_bells(&self, to: u64) -> bool {
        self.shm_now().is_some_and(|l| l.direct_bells(to))
    }

    /// As [`Vc::direct_bells`]`(0)`, when its bells go to instance bell `id` now.
    pub fn direct_bells_from(&self, id: u64) -> bool {
        self.shm_now().is_some_and(|l| l.bells_at(id) && l.direct_bells(0))
    }

    /// The program waits on descriptor `fd` itself (`poll`, `select`): its ring's bells come
    /// through the socket from now on, and what the ring holds is announced there.
    pub fn announce_to_socket(&self, fd: i32) {
        if let Some(l) = self.shm_now() {
            l.bells_to_socket(fd);
        }
        self.announce(fd);
    }

    /// The datagrams at instance bell `id` were taken: its ring's bell, if it rang there.
    pub fn bell_rang_at(&self, id: u64) {
        if let Some(l) = self.shm_now() {
            l.bell_rang_at(id);
        }
    }

    /// The program may wait on descriptor `fd` in a way the layer does not scan: bytes in
    /// the ring get a bell, and the writer rings for new ones.
    pub fn announce(&self, fd: i32) {
        let Some(l) = self.shm_now() else { return };
        let c = self.mem.conn();
        // Under the receive lock, as a receive's own announcement is. A receive that holds
        // it for long is a blocking one, waiting in the kernel: it marked the ring sleeping
        // itself, so the writer rings anyway.
        let until = crate::sys::now_us() + 2000;
        loop {
            if let Some(_g) = c.rx_lock.try_lock() {
                l.announce(fd);
                return;
            }
            if crate::sys::now_us() >= until {
                return;
            }
            crate::sys::process::sched_yield();
        }
    }

    /// No other process holds the connection.
    pub fn held_here_only(&self) -> bool {
        self.mem.conn().procs.load(Acquire) == 1
    }

    /// True while the connection's bytes go through the rings and its socket carries only
    /// bells.
    pub fn bells_only(&self) -> bool {
        self.shm_now().is_some_and(|l| l.mode() == shm_sink::Mode::Shm)
    }

    /// The program sets TCP option `opt` (`TCP_CORK` or `TCP_NODELAY`) to `on`: remembered
    /// for the connection's later links. True when the kernel socket must not take it now:
    /// it carries only bells, and a bell held by the cork waits up to 200 ms (nginx corks
    /// its responses: each ring-full of a download then stood still that long).
    pub fn program_sets_tcp(&self, opt: i32, on: bool) -> bool {
        use crate::shm::{PROG_CORK, PROG_NODELAY, PROG_NODELAY_SET};
        let (clear, set) = match opt {
            libc::TCP_CORK => (PROG_CORK, if on { PROG_CORK } else { 0 }),
            libc::TCP_NODELAY => (PROG_NODELAY, PROG_NODELAY_SET | if on { PROG_NODELAY } else { 0 }),
            _ => return false,
        };
        let _ = self.mem.conn().prog_tcp.fetch_update(AcqRel, Acquire, |v| Some((v & !clear) | set));
        self.bells_only()
    }

    /// The program's own value of TCP option `opt` while the socket carries only bells
    /// (`None` otherwise: the kernel's value is the program's).
    pub fn program_tcp(&self, opt: i32) -> Option<i32> {
        use crate::shm::{PROG_CORK, PROG_NODELAY};
        if !self.bells_only() {
            return None;
        }
        let v = self.mem.conn().prog_tcp.load(Acquire);
        match opt {
            libc::TCP_CORK => Some(i32::from(v & PROG_CORK != 0)),
            libc::TCP_NODELAY => Some(i32::from(v & PROG_NODELAY != 0)),
            _ => None,
        }
    }

    /// A new link's socket `fd` is under the program's descriptors: it gets the program's
    /// TCP options when it carries the frames, and the bells' (no delay, no cork) when the
    /// connection is on shared memory.
    pub fn link_tcp_options(&self, fd: i32) {
        use crate::shm::{PROG_CORK, PROG_NODELAY, PROG_NODELAY_SET};
        if self.shm_now().is_some() {
            shm_sink::bells_undelayed(fd);
            return;
        }
        let v = self.mem.conn().prog_tcp.load(Acquire);
        if v & PROG_CORK != 0 {
            crate::sys::set_sockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_CORK, 1);
        }
        if v & PROG_NODELAY_SET != 0 {
            let on = i32::from(v & PROG_NODELAY != 0);
            crate::sys::set_sockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, on);
        }
    }

    /// Moves the connection off its shared memory (the stream positions go to the TCP
    /// halves, which a rebuilt link then resumes from). The caller holds both halves' locks.
    pub fn leave_shm(&self) -> Result<(), String> {
        let Some(l) = self.shm_now() else { return Ok(()) };
        let r = l.demote(self.mem());
        self.mem.conn().shm_epoch.fetch_add(1, AcqRel);
        if let Some(s) = self.slot {
            s.set_substrate(1);
        }
        SUBSTRATE_MOVES.fetch_add(1, Release);
        r
    }

    /// A rebuilt link goes through shared memory `l` (offered by this side, or taken). The
    /// caller holds both halves' locks.
    pub fn join_shm(&self, l: ShmLink) {
        let e = self.mem.conn().shm_epoch.fetch_add(1, AcqRel) + 1;
        l.set_epoch(e);
        let l = self.links.set(l);
        self.linked.store(true, Release);
        l.protect();
        if let Some(s) = self.slot {
            s.set_substrate(l.code());
        }
        SUBSTRATE_MOVES.fetch_add(1, Release);
    }

    /// Pushes what a rebuilt link owes the peer (replay, end of stream) without blocking,
    /// through the link's substrate. True when nothing is left. The caller holds the tx lock.
    pub fn replay_now(&self, fd: i32) -> bool {
        if let Some(l) = self.shm_now() {
            if l.mode() == shm_sink::Mode::Pending && l.settle(fd, false, false).is_err() {
                return false;
            }
            if l.mode() == shm_sink::Mode::Shm {
                return l.push_replay(self.mem(), fd).unwrap_or(true);
            }
        }
        self.replay_tcp(fd)
    }

    /// Pushes what a rebuilt link owes the peer over TCP frames, without blocking: a
    /// [`crate::tcp_sink::REPLAY`] IRB down the send chain. True when nothing is left. The
    /// caller holds the tx lock.
    pub fn replay_tcp(&self, fd: i32) -> bool {
        let c = self.mem.conn();
        let irb = Irb::new(crate::tcp_sink::REPLAY).with_handle(fd as i64);
        self.send_chain.with(&c.tx_lock, |chain| Self::run(chain, irb)).map_or(true, |done| done == 1)
    }

    /// An acknowledgement alone on socket `fd`, of what the program read: a
    /// [`crate::tcp_sink::ACK`] IRB down the send chain, if no other thread is sending now
    /// (never waits).
    pub fn send_ack(&self, fd: i32) {
        let c = self.mem.conn();
        let Some(_g) = c.tx_lock.try_lock() else { return };
        let irb = Irb::new(crate::tcp_sink::ACK).with_handle(fd as i64);
        let _ = self.send_chain.with(&c.tx_lock, |chain| Self::run(chain, irb));
    }

    /// Offers the peer a chain of filters for what this side sends from now on (`spec`:
    /// filter names separated by commas, empty for none): a [`crate::tcp_sink::CHAIN`] IRB
    /// down the send chain. The peer's layer answers; a taken chain codes every frame from
    /// the next new byte on. The offer goes in the same write as the next data frame this
    /// side sends (alone, it could make the peer's socket readable with no data for its
    /// program). Returns the chain's number; `EINVAL` for a filter this build lacks, `EBUSY`
    /// while an earlier offer waits for its answer. With `both`, the peer is asked to use the
    /// same chain for what it sends.
    ///
    /// On shared memory the offer waits for the connection's next TCP link: a chain codes
    /// frames that cross a network, and bytes in the rings never leave the node (see
    /// [`on_shm_the_chain_stands_aside`](Self::on_shm_the_chain_stands_aside)). A later
    /// offer made there takes the place of one still waiting.
    pub fn offer_chain(&self, fd: i32, spec: &str, both: bool) -> Result<usize, IrbError> {
        let c = self.mem.conn();
        let _g = c.tx_lock.lock();
        if self.shm_now().is_some() {
            // (Under the tx lock: the send half is ours.)
            c.with_tx_held(|tx| tx.withdraw_unsent_offer());
        }
        let mut irb = Irb::new(crate::tcp_sink::CHAIN).with_handle(fd as i64);
        irb.buf = substrate::irb::Buf::Out(spec.as_bytes());
        if both {
            irb.flags = crate::tcp_sink::BOTH_WAYS;
        }
        let r = self.send_chain.with(&c.tx_lock, |chain| Self::run(chain, irb));
        if let Some(s) = self.slot {
            // (An offer withdrawn above and not replaced shows no more.)
            s.set_offer(c.with_tx_held(|tx| tx.offer_waiting()));
        }
        r
    }

    /// The description of the chain on what this end sends now (`""` for none).
    pub fn send_chain_spec(&self) -> String {
        let ids = self.mem.conn().peek_tx(|tx| tx.chain_now().1);
        substrate::connection::chain::spec_of_ids(ids).unwrap_or_default()
    }

    /// True when the connection is on shared memory with a chain of filters on either
    /// direction, or one offered: the chain stands aside there. Its filters code frames that
    /// cross a network (compression, encryption), and bytes in the rings never leave this
    /// node: both layers go on keeping the chain (its numbers, keys and any offer or answer
    /// still to go) and code with it again from the first frame on the connection's next
    /// TCP link. (Taps, `profile` and `capture`, watch the program's calls and work on every
    /// substrate.)
    pub fn on_shm_the_chain_stands_aside(&self) -> bool {
        let c = self.mem.conn();
        self.shm_now().is_some()
            && (c.coding.load(Acquire) != 0
                || c.careful.load(Acquire) != 0
                || crate::shm::peek_tx!(c, offer_no) != 0)
    }

    /// The last close of a connection over shared memory: a replay still owed to the ring
    /// (a link moved onto shared memory just before) is pushed first, waiting for room for
    /// at most the grace period; then the peer reads the end (with `reset`, a reset).
    pub fn shm_close(&self, l: &ShmLink, fd: i32, reset: bool) {
        let c = self.mem.conn();
        {
            let mut g = c.tx_lock.lock();
            let until = crate::sys::now_ms() + crate::config::grace_ms();
            while c.with_tx(&mut g, |tx| tx.replaying()) && crate::sys::now_ms() < until {
                match l.push_replay(self.mem(), fd) {
                    Ok(false) if l.wait_room(200).is_ok() => {}
                    _ => break,
                }
            }
        }
        l.close(fd, reset);
    }

    /// The program ends its stream on socket `fd` (`shutdown` of the send side, or the close
    /// that ends the connection): a `Disconnect` down the send chain, whose sink sends the Fin
    /// frame (after a replay still under way, if there is one). Returns the shutdown's result.
    pub fn end_stream(&self, fd: i32) -> Result<i32, Errno> {
        let c = self.mem.conn();
        let _g = c.tx_lock.lock();
        let irb = Irb::new(IrbKind::Disconnect).with_handle(fd as i64);
        self.send_chain
            .with(&c.tx_lock, |chain| Self::run(chain, irb))
            .map(|n| n as i32)
            .map_err(crate::error::errno_of)
    }

    /// The program resets the connection on socket `fd` (a close with unread data): a
    /// `Disconnect` with [`crate::tcp_sink::ABORT`] down the send chain, whose sink sends an
    /// Abort frame, so the peer's layer knows the reset is the program's and not a failed
    /// link. Only if no other thread is sending now (never waits).
    pub fn abort(&self, fd: i32) {
        let c = self.mem.conn();
        let Some(_g) = c.tx_lock.try_lock() else { return };
        let mut irb = Irb::new(IrbKind::Disconnect).with_handle(fd as i64);
        irb.flags = crate::tcp_sink::ABORT;
        let _ = self.send_chain.with(&c.tx_lock, |chain| Self::run(chain, irb));
    }

    /// The program shuts its sending side of a connection over shared memory: the end of
    /// stream follows the bytes (after a replay still being pushed, if there is one).
    pub fn shm_shut_send(&self, l: &ShmLink, fd: i32) {
        let c = self.mem.conn();
        let mut g = c.tx_lock.lock();
        c.tx_shut.store(1, Release);
        if c.with_tx(&mut g, |tx| tx.replaying()) {
            c.fin_owed.store(1, Release);
            linkstate::poke();
            return;
        }
        l.shut_send(fd);
    }

    /// Payload bytes readable now (FIONREAD).
    pub fn readable_bytes(&self, fd: i32) -> Result<i32, i32> {
        if let Some(l) = self.shm_now() {
            return Ok(l.readable().min(i32::MAX as usize) as i32);
        }
        let c = self.mem.conn();
        let _g = c.rx_lock.lock();
        crate::tcp_sink::readable_bytes(self.mem(), fd)
    }

    /// One more process holds the connection (before a fork: counted before the parent can
    /// close its copy, so a close in the parent never looks like the last one).
    pub fn hold(&self) {
        self.mem.conn().procs.fetch_add(1, AcqRel);
    }

    /// This process leaves while others still hold the connection: name the parent (the
    /// usual other holder) in the statistics slot instead of this process.
    pub fn hand_back_slot(&self) {
        if let Some(s) = self.slot {
            s.set_pid(crate::sys::process::getppid());
        }
    }

    /// One process less (a fork that failed, or a process leaving).
    pub fn release(&self) -> u32 {
        self.mem.conn().procs.fetch_sub(1, AcqRel)
    }

    /// This process execs (`undo`: the exec failed): its hold and the new image's stay in
    /// `procs` for good (so that no close elsewhere is taken for the last one), but count as
    /// an exec'd process's, whose new image lists the connection in a table of its own.
    /// `own`: this process counts in `procs` itself (not a vfork child).
    ///
    /// When nobody else holds the connection any more (the parent closed its copy before
    /// this exec), the statistics slot is freed here: the new image lists the connection in
    /// its own table, and nobody would free this one.
    pub fn exec_hold(&self, own: bool, undo: bool) {
        let c = self.mem.conn();
        let n = 1 + u32::from(own);
        if undo {
            c.procs.fetch_sub(1, AcqRel);
            c.exec_holds.fetch_sub(n, AcqRel);
            if self.slot_freed.swap(false, AcqRel) && self.slot.is_some_and(|s| !s.reclaim()) {
                crate::log::warn(format_args!(
                    "virtual connection {:032x}: its statistics slot went to another connection during a failed exec",
                    c.gid
                ));
            }
        } else {
            let procs = c.procs.fetch_add(1, AcqRel) + 1;
            let execs = c.exec_holds.fetch_add(n, AcqRel) + n;
            if procs <= execs {
                if let Some(s) = self.slot {
                    s.free();
                    self.slot_freed.store(true, Release);
                }
            }
        }
    }
}

impl Drop for Vc {
    fn drop(&mut self) {
        // This process no longer holds it: the agent must not hand it new links here.
        let before = self.release();
        let c = self.mem.conn();
        linkstate::released(c.gid, c.active != 0, before > 1);
        // The last process to let go frees the statistics slot (holders that exec'd list the
        // connection in their new image's table).
        if before.saturating_sub(1) <= self.mem.conn().exec_holds.load(Acquire)
            && !self.slot_freed.load(Acquire)
        {
            if let Some(s) = self.slot {
                s.free();
            }
        }
    }
}
