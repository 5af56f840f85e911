//! Readiness that tells the truth. The program waits on its descriptor, a kernel socket, and
//! the kernel calls it readable when *bytes* wait there; under the layer some of those bytes
//! are the layer's own: an acknowledgement sent alone, the first frame of a rebuilt link, a
//! bell that woke a writer of shared memory. A native socket that polls readable always has
//! data or the end for `recv`; some programs depend on it (UCX's TCP transport, under MPICH,
//! frees its receive buffer on a `recv` that says `EAGAIN` in the middle of a message and
//! then follows a null pointer).
//!
//! So `epoll_wait`, `poll` and `select` (and their variants) check each readable virtual
//! connection they report when the layer's own frames may be what made it readable: the
//! layer takes its frames off the socket (as the program's `recv` would have) and drops
//! the readable bit when no payload and no end is left. A wait left with no event goes on
//! waiting for the rest of its time-out.
//!
//! The check costs nothing on the paths where such frames cannot be there: a connection on
//! TCP whose peer cannot owe it an acknowledgement alone (less than an eighth of the window
//! unacknowledged, acknowledgements riding on data) and no rebuilt link since the last check
//! is reported as the kernel says. On shared memory the ring is looked at (no system call when
//! bytes are there).
//!
//! For `epoll`, the layer keeps which registration (epoll instance, data) is which virtual
//! connection, from the program's `epoll_ctl` calls; registrations it did not see (made before
//! the socket became a virtual connection, or inherited across `exec`) are reported as the
//! kernel says, as before.
//!
//! **Bells left out for event loops.** A connection on shared memory is announced to a
//! receiver that may sleep by a bell: one system call to write it and one to take it, per
//! request for a program that waits in `epoll_wait` between requests (redis, nginx), which
//! costs what loopback TCP costs. When the layer knows every way the program waits for such a
//! connection (it is registered, for input, in one epoll instance this process waits on
//! itself, not nested in another, not one-shot, and no other process holds it), the
//! connection is *scanned*: its receive no longer tells the writer it may sleep, and every
//! wait on that instance looks at the scanned rings first, reporting those with bytes as
//! readable itself, and marks the others as sleeping (the writer then rings) only when it is
//! about to sleep. A `poll` or `select` that includes a scanned connection, and a thread
//! that reads it while another waits on the instance, announce it as before.

use crate::error::Real;
use crate::fdtable;
use crate::readiness::Truth;
use crate::readiness::{
    set_scan, swapped_since, wait_enter, wait_leave, FdBits, DIRECTED, POLLED, POLL_SLEEPERS, SCANNED,
    SCAN_EPFD, SCAN_EPFDS, SCAN_FDS, SLEEPERS, UNANNOUNCED,
};
use crate::sys;
use crate::sys::prog::ProgArray;
use crate::vc::Vc;
use libc::c_int;
use shadow::{Quick, Shadows, KEPT, SHADOWS};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize, Ordering::*};
use std::sync::Arc;
use std::sync::{Mutex, RwLock};

mod shadow;

impl Default for &'static Shadows {
    fn default() -> Self {
        &SHADOWS
    }
}

/// Most connections on shared memory an instance scans (`VMI_EPOLL_SCAN_MAX`): a wait looks
/// at each of them, and one with more (idle keep-alive connections, say) is cheaper with bells.
fn scan_max() -> usize {
    crate::config::epoll_scan_max()
}
/// Descriptors the program added to some epoll instance (other than virtual connections):
/// an epoll instance among them is nested, and its waits are not the only ones.
static CONTAINED: FdBits = FdBits::new();
/// Epoll instances with at least one registration of a virtual connection (one load in
/// the hooks of every other instance).
static TRACKED_EPFD: FdBits = FdBits::new();
/// Registrations known, for programs with descriptors beyond the bitmap.
static REG_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Epoll instances with a bell of the layer's own registered in them (`crate::bells`):
/// their waits take its event out of what the program sees.
static BELLED: FdBits = FdBits::new();

/// An instance's bell: its socket and its id (0 when the instance cannot have one).
struct InstanceBell {
    slot: Option<Arc<AtomicI32>>,
    id: u64,
}

/// Per descriptor the program put in epoll instances (other than virtual connections): the
/// instances that hold it, and whether each waits for its input.
type Nesting = HashMap<c_int, Vec<(c_int, bool)>>;
static NESTING: Mutex<Option<Nesting>> = Mutex::new(None);
/// Descriptors with an entry in `NESTING`.
static IN_NESTING: FdBits = FdBits::new();

/// The program changed the registration of `fd` (not a virtual connection) in epoll
/// instance `outer` (`op`; `input`: the registration asks for input). When `fd` is an
/// epoll instance, it is *nested* while some instance waits for its input: its
/// connections are not scanned then (a wait on the outer one would not look at their
/// rings). An instance held for errors and hang-ups only is not: an epoll instance never
/// reports those (UCX holds its worker's instance in its progress thread's so, until the
/// program asks to sleep in it).
pub fn note_nesting(outer: c_int, op: c_int, fd: c_int, input: bool) {
    if fd < 0 || fd as usize >= SCAN_EPFDS || (op == libc::EPOLL_CTL_DEL && !IN_NESTING.has(fd)) {
        // (An instance numbered that high never scans.)
        return;
    }
    let (was, now) = {
        let mut g = NESTING.lock().unwrap_or_else(|e| e.into_inner());
        let m = g.get_or_insert_with(HashMap::default);
        IN_NESTING.set(fd);
        let v = m.entry(fd).or_default();
        let was = v.iter().any(|&(_, i)| i);
        v.retain(|&(o, _)| o != outer);
        if op != libc::EPOLL_CTL_DEL {
            v.push((outer, input));
        }
        let now = v.iter().any(|&(_, i)| i);
        if v.is_empty() {
            m.remove(&fd);
            IN_NESTING.clear(fd);
        }
        (was, now)
    };
    if now {
        CONTAINED.set(fd);
    } else {
        CONTAINED.clear(fd);
    }
    if was != now && tracking(fd) {
        // A scanning instance is nested now (its connections are announced again), or is not
        // any more (they may be scanned).
        let again = with_regs(|r| r.rescan_members(fd));
        announce_all(again);
    }
}

/// `fd` was closed: it is nobody's member any more. (An instance closed that held others
/// stays in their lists until they close: they stay nested, which costs bells, never a
/// wake-up.)
pub fn note_closed_fd(fd: c_int) {
    if IN_NESTING.has(fd) {
        let mut g = NESTING.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = g.as_mut() {
            m.remove(&fd);
        }
        IN_NESTING.clear(fd);
    }
    CONTAINED.clear(fd);
}

/// Connections that stopped being scanned: whatever their rings hold is announced the
/// usual way (a bell), as the next wait may not look at them.
#[inline]
fn announce_all(vcs: Vec<(c_int, Arc<Vc>)>) {
    // (Nearly always nothing: a check where the caller is, the work out of its way.)
    if !vcs.is_empty() {
        announce_each(vcs);
    }
}

#[cold]
#[inline(never)]
fn announce_each(vcs: Vec<(c_int, Arc<Vc>)>) {
    for (fd, vc) in vcs {
        crate::error::quietly(|| {
            vc.announce(fd);
            Some(())
        });
    }
}

/// Before `fork`: the child shares every connection, and may wait on it in ways this
/// process does not see; no connection is scanned any more.
pub fn unscan_all() {
    let mut polled = Vec::new();
    POLLED.each(|fd| polled.push(fd));
    for fd in polled {
        POLLED.clear(fd);
        if UNANNOUNCED.has(fd) {
            announce_one(fd);
        }
    }
    if REG_COUNT.load(Relaxed) == 0 {
        return;
    }
    let all = with_regs(|r| {
        let fds: Vec<c_int> = r.members.values().flatten().map(|m| m.fd).collect();
        let mut out = Vec::new();
        for fd in fds {
            out.extend(r.unscan(fd));
        }
        out
    });
    announce_all(all);
}

/// Before a sandbox goes in (the layer may not be allowed its bells' calls afterwards):
/// every instance's bell goes, and their rings' bells come through the sockets again.
pub fn drop_instance_bells() {
    let again = with_regs(|r| {
        let epfds: Vec<c_int> = r.bells.keys().copied().collect();
        epfds.into_iter().flat_map(|e| r.drop_bell(e)).collect::<Vec<_>>()
    });
    announce_all(again);
}

/// One registration of a virtual connection in an instance, for the scan.
struct Member {
    fd: c_int,
    data: u64,
    events: u32,
    vc: Arc<Vc>,
}

/// One registration: the descriptor and the events the program asked for. (Of a
/// registration without `EPOLLONESHOT`, only the bits the layer looks at, `LOOKED_BITS`, are
/// kept up to date: see `note_ctl`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reg {
    fd: c_int,
    events: u32,
}

/// The events of a registration the layer looks at: input and the peer's end (what it
/// checks and reports) and one-shot (what it arms again).
const LOOKED_BITS: u32 = IN_BITS | RDHUP | libc::EPOLLONESHOT as u32;

/// True when a registration's events changing from `old` to `new` changes nothing the
/// layer looks at (a program that asks for writability around each send, as wrk and UCX
/// do). A one-shot registration is armed again with its events, so all of them count.
fn same_to_the_layer(old: u32, new: u32) -> bool {
    old == new || (old & LOOKED_BITS == new & LOOKED_BITS && old & libc::EPOLLONESHOT as u32 == 0)
}

/// A data value used by two registrations of one instance: the event cannot be told apart.
const AMBIGUOUS: c_int = -1;

/// A multiply-rotate hash for the registration maps (looked up at every readable event; the
/// default SipHash took most of the check's time there). The keys are the program's own
/// descriptors and epoll data, not input from outside.
#[derive(Default, Clone, Copy)]
struct WordHasher(u64);

impl WordHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl std::hash::Hasher for WordHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.add(u64::from(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_i32(&mut self, i: i32) {
        self.add(u64::from(i as u32));
    }
}

type Map<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<WordHasher>>;

/// One registration of a connection with an epoll instance, as `Regs::per_fd` keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FdReg {
    epfd: c_int,
    data: u64,
    /// False once the program took a connection on TCP out of the instance
    /// (`EPOLL_CTL_DEL`): the registration is kept, dormant, with its place in `by_data`, so
    /// that putting it back with the same data (event loops do it around every request)
    /// touches nothing else. A dormant registration is never scanned and never reported
    /// by the kernel; another registration with its data in that instance, or its
    /// descriptor closed, removes it for good.
    live: bool,
}

/// The registrations of virtual connections, three ways.
#[derive(Default)]
struct Regs {
    /// The words of descriptors with one registration, flipped without the lock
    /// (`shadow`): while a descriptor's word is valid, its `live` is the truth.
    shadows: &'static Shadows,
    /// (epoll fd, data) -> registration, and how many registrations use that data.
    by_data: Map<(c_int, u64), (Reg, u32)>,
    /// fd -> the epoll instances it is registered with, and the data of each. (An empty
    /// list stays until `fd` is closed: programs that take a connection out of an instance
    /// and put it back around every request, as redis-benchmark does, would otherwise free
    /// and allocate it each time.)
    per_fd: Map<c_int, Vec<FdReg>>,
    /// How many registrations `per_fd` holds (dormant ones too).
    count: usize,
    /// epoll fd -> its registrations of virtual connections (the scan's list).
    members: Map<c_int, Vec<Member>>,
    /// An instance whose list just went past the bound (its members are to be rescanned).
    overflowed: Option<c_int>,
    /// epoll fd -> its bell (made when it first scans a connection).
    bells: Map<c_int, InstanceBell>,
}

impl Regs {
    /// Records a successful `EPOLL_CTL_ADD`/`MOD` of virtual connection `fd`.
    /// Returns false when the change cannot change whether `fd` is scanned (the same
    /// registration with other events than input and one-shot: a program that asks for
    /// writability and then no more around each send).
    /// `vc` is the connection (`None`: not one, in the unit tests).
    fn set(&mut self, epfd: c_int, fd: c_int, events: u32, data: u64, vc: Option<&Arc<Vc>>) -> bool {
        self.absorb(fd);
        let on_shm = vc.is_some_and(|v| v.shm_now().is_some());
        if let Some(r) = self.reg_mut(epfd, fd).filter(|r| r.data == data && (r.live || !on_shm)) {
            const SCAN_BITS: u32 = IN_BITS | libc::EPOLLONESHOT as u32;
            // (A dormant registration put back: live again; scanning may change.)
            let mut same = r.live;
            r.live = true;
            if let Some((g, _)) = self.by_data.get_mut(&(epfd, data)) {
                if g.fd == fd {
                    same &= g.events & SCAN_BITS == events & SCAN_BITS;
                    g.events = events;
                }
            }
            if let Some(m) = self.members.get_mut(&epfd).and_then(|v| v.iter_mut().find(|m| m.fd == fd)) {
                same &= m.events & SCAN_BITS == events & SCAN_BITS;
                m.events = events;
            }
            return !same;
        }
        self.forget(epfd, fd);
        self.end_dormant(epfd, data);
        let (g, n) = self.by_data.entry((epfd, data)).or_insert((Reg { fd, events }, 0));
        *n += 1;
        let mut shared = None;
        if *n > 1 {
            shared = Some(g.fd);
            g.fd = AMBIGUOUS;
        }
        if let Some(f) = shared.filter(|&f| f != AMBIGUOUS) {
            // (Its word stood for a registration whose data was its own.)
            self.absorb(f);
        }
        self.per_fd.entry(fd).or_default().push(FdReg { epfd, data, live: true });
        self.count += 1;
        // (Only connections on shared memory: scanning is of no use to the others, and
        // keeping them out keeps `epoll_ctl` as cheap as before for them.)
        if let Some(vc) = vc.filter(|_| on_shm) {
            let v = self.members.entry(epfd).or_default();
            v.push(Member { fd, data, events, vc: vc.clone() });
            if v.len() == scan_max() + 1 {
                // Past the bound: none of the instance's connections is scanned any more
                // (`note_ctl` announces them).
                self.overflowed = Some(epfd);
            }
        }
        true
    }

    /// Whether connection `fd` can be scanned, and by which instance: registered for input
    /// in exactly one instance, which is not nested, with data of its own, not one-shot,
    /// and held by this process alone.
    fn scan_instance(&self, fd: c_int) -> Option<c_int> {
        if (fd as usize) >= SCAN_FDS {
            return None;
        }
        let &[r @ FdReg { epfd, .. }] = self.per_fd.get(&fd)?.as_slice() else { return None };
        if !self.live_of(fd, &r) {
            return None;
        }
        if (epfd as usize) >= SCAN_EPFDS || epfd < 0 || CONTAINED.get(epfd, Relaxed) == Some(true) {
            return None;
        }
        let members = self.members.get(&epfd)?;
        if members.len() > scan_max() {
            return None;
        }
        let m = members.iter().find(|m| m.fd == fd)?;
        let reg = self.lookup(epfd, m.data)?;
        let wanted = reg.events & libc::EPOLLIN as u32 != 0 && reg.events & libc::EPOLLONESHOT as u32 == 0;
        (wanted && m.vc.held_here_only()).then_some(epfd)
    }

    /// Sets whether `fd` is scanned. When it is not but some registration waits for its
    /// input, a ring left unannounced is returned to be announced. (With no such
    /// registration nothing waits: a later `poll`, `select` or registration announces it.)
    fn rescan(&mut self, fd: c_int) -> Option<(c_int, Arc<Vc>)> {
        if (fd as usize) >= SCAN_FDS || (self.members.is_empty() && SCAN_EPFD[fd as usize].load(Relaxed) == 0)
        {
            // (No connection on shared memory is registered anywhere: nothing to do, which
            // keeps `epoll_ctl` on TCP connections as cheap as before.)
            return None;
        }
        let scanner = self.scan_instance(fd);
        let now = scanner.map_or(0, |e| e as u16 + 1);
        set_scan(fd, now);
        // Its ring's bells go to the scanning instance's bell, or through the socket.
        let to = scanner.map_or(0, |e| self.instance_bell(e));
        if to != 0 || DIRECTED.has(fd) {
            if let Some(vc) = fdtable::vc(fd) {
                if to != 0 {
                    DIRECTED.set(fd);
                } else {
                    DIRECTED.clear(fd);
                }
                let mut left = vc.direct_bells(to);
                if to != 0 && crate::readiness::in_wait(fd) {
                    // A thread waits on the socket itself (`poll`, `select`; looked at after
                    // the bells went to the instance, as that wait looks at them after it is
                    // counted): they come through the socket.
                    DIRECTED.clear(fd);
                    left |= vc.direct_bells(0);
                }
                if left {
                    // A bell pending at the old place stands for nothing at the new one:
                    // what the ring holds is announced.
                    return Some((fd, vc));
                }
            }
        }
        if now == 0 && UNANNOUNCED.has(fd) && self.wants_input(fd) {
            return fdtable::vc(fd).map(|v| (fd, v));
        }
        None
    }

    /// The id of `epfd`'s bell, made when first asked for; 0 when it cannot have one.
    fn instance_bell(&mut self, epfd: c_int) -> u64 {
        if let Some(b) = self.bells.get(&epfd) {
            return b.id;
        }
        let (slot, id) = match crate::bells::open(epfd) {
            Some((slot, id)) => (Some(slot), id),
            None => (None, 0),
        };
        if slot.is_some() {
            BELLED.set(epfd);
        }
        self.bells.insert(epfd, InstanceBell { slot, id });
        id
    }

    /// `epfd`'s bell goes (the instance closed, or its program uses the bell's data itself):
    /// the rings that named it are returned, to be announced through their sockets.
    fn drop_bell(&mut self, epfd: c_int) -> Vec<(c_int, Arc<Vc>)> {
        let Some(b) = self.bells.remove(&epfd) else { return Vec::new() };
        BELLED.clear(epfd);
        if let Some(slot) = &b.slot {
            crate::bells::close(slot);
        }
        let mut out = Vec::new();
        for m in self.members.values().flatten() {
            if m.vc.direct_bells_from(b.id) {
                DIRECTED.clear(m.fd);
                out.push((m.fd, m.vc.clone()));
            }
        }
        out
    }

    /// Some registration of `fd` asks for input.
    fn wants_input(&self, fd: c_int) -> bool {
        self.per_fd.get(&fd).is_some_and(|es| {
            es.iter().any(|FdReg { epfd: e, .. }| {
                self.members
                    .get(e)
                    .and_then(|v| v.iter().find(|m| m.fd == fd))
                    .is_some_and(|m| m.events & IN_BITS != 0)
            })
        })
    }

    /// `fd` is not scanned any more (whatever its registrations); returned when its ring
    /// may be unannounced.
    fn unscan(&self, fd: c_int) -> Option<(c_int, Arc<Vc>)> {
        if (fd as usize) < SCAN_FDS {
            set_scan(fd, 0);
            let left_bell = DIRECTED.has(fd) && {
                DIRECTED.clear(fd);
                fdtable::vc(fd).is_some_and(|v| v.direct_bells(0))
            };
            if left_bell || UNANNOUNCED.has(fd) {
                return fdtable::vc(fd).map(|v| (fd, v));
            }
        }
        None
    }

    /// The registered connections that joined shared memory since they were registered
    /// become members of their instances (a ring that came with a later move is scanned like
    /// one that came at set-up), and those that left it stop being members; each changed one
    /// is rescanned. Returned: the rings to announce (see `rescan`).
    fn follow_substrates(&mut self) -> Vec<(c_int, Arc<Vc>)> {
        let fds: Vec<c_int> = self.per_fd.keys().copied().collect();
        let mut changed = Vec::new();
        for fd in fds {
            // (A connection that joined shared memory becomes a member: its word goes.)
            self.absorb(fd);
            let vc = fdtable::vc(fd).filter(|v| v.shm_now().is_some());
            let regs = self.per_fd.get(&fd).cloned().unwrap_or_default();
            let mut moved = false;
            // (A dormant registration joins when it is put back.)
            for FdReg { epfd, data, .. } in regs.into_iter().filter(|r| r.live) {
                let member = self.members.get(&epfd).is_some_and(|v| v.iter().any(|m| m.fd == fd));
                match &vc {
                    Some(vc) if !member => {
                        // (A data value two registrations share keeps the first one's events:
                        // such a registration is never scanned anyway, see `scan_instance`.)
                        let events = self.by_data.get(&(epfd, data)).map_or(0, |(g, _)| g.events);
                        let v = self.members.entry(epfd).or_default();
                        v.push(Member { fd, data, events, vc: vc.clone() });
                        if v.len() == scan_max() + 1 {
                            self.overflowed = Some(epfd);
                        }
                        moved = true;
                    }
                    None if member => {
                        if let Some(v) = self.members.get_mut(&epfd) {
                            v.retain(|m| m.fd != fd);
                            if v.is_empty() {
                                self.members.remove(&epfd);
                            }
                        }
                        moved = true;
                    }
                    _ => {}
                }
            }
            if moved {
                changed.push(fd);
            }
        }
        let mut again: Vec<_> = changed.into_iter().filter_map(|fd| self.rescan(fd)).collect();
        if let Some(e) = self.overflowed.take() {
            again.extend(self.rescan_members(e));
        }
        again
    }

    /// Every member of `epfd` again (the instance changed: nested).
    fn rescan_members(&mut self, epfd: c_int) -> Vec<(c_int, Arc<Vc>)> {
        let fds: Vec<c_int> =
            self.members.get(&epfd).map(|v| v.iter().map(|m| m.fd).collect()).unwrap_or_default();
        fds.into_iter().filter_map(|fd| self.rescan(fd)).collect()
    }

    /// Forgets the registration of `fd` with `epfd` (`EPOLL_CTL_DEL`, a close, or a
    /// descriptor number now used by something else); true if there was one.
    fn forget(&mut self, epfd: c_int, fd: c_int) -> bool {
        self.absorb(fd);
        let Some(v) = self.per_fd.get_mut(&fd) else { return false };
        let Some(i) = v.iter().position(|r| r.epfd == epfd) else { return false };
        let FdReg { data, .. } = v.swap_remove(i);
        self.count -= 1;
        if let Some(v) = self.members.get_mut(&epfd) {
            v.retain(|m| m.fd != fd);
            if v.is_empty() {
                self.members.remove(&epfd);
            }
        }
        if let Some((g, n)) = self.by_data.get_mut(&(epfd, data)) {
            *n -= 1;
            if *n == 0 {
                self.by_data.remove(&(epfd, data));
            } else if *n == 1 && g.fd == AMBIGUOUS {
                // One registration is left with that data: it is known again.
                let left =
                    self.per_fd.iter().find(|(_, v)| v.iter().any(|r| r.epfd == epfd && r.data == data));
                if let Some((&f, _)) = left {
                    g.fd = f;
                }
            }
        }
        true
    }

    /// `fd` is closed: its registrations go; if it was an epoll instance, everything
    /// registered with it goes too. Returns how many went.
    fn close(&mut self, fd: c_int) -> usize {
        let mut gone = 0;
        let epfds: Vec<c_int> =
            self.per_fd.get(&fd).map(|v| v.iter().map(|r| r.epfd).collect()).unwrap_or_default();
        for e in epfds {
            gone += usize::from(self.forget(e, fd));
        }
        self.per_fd.remove(&fd);
        let members: Vec<c_int> =
            self.per_fd.iter().filter(|(_, v)| v.iter().any(|r| r.epfd == fd)).map(|(&f, _)| f).collect();
        for f in members {
            gone += usize::from(self.forget(fd, f));
        }
        gone
    }

    /// The registration behind an event of `epfd`.
    fn lookup(&self, epfd: c_int, data: u64) -> Option<Reg> {
        let mut g = self.by_data.get(&(epfd, data)).map(|&(g, _)| g).filter(|g| g.fd != AMBIGUOUS)?;
        if let Some((_, bits)) = self.shadows.state(g.fd, epfd) {
            // (Its word has the truth about the bits it keeps.)
            g.events = (g.events & !KEPT) | bits;
        }
        Some(g)
    }

    fn len(&self) -> usize {
        self.count
    }

    /// The data of `fd`'s live registration with `epfd`.
    fn data_of(&self, epfd: c_int, fd: c_int) -> Option<u64> {
        self.per_fd.get(&fd)?.iter().find(|r| r.epfd == epfd && self.live_of(fd, r)).map(|r| r.data)
    }

    /// `fd`'s registration with `epfd`, live or dormant.
    fn reg_mut(&mut self, epfd: c_int, fd: c_int) -> Option<&mut FdReg> {
        self.per_fd.get_mut(&fd)?.iter_mut().find(|r| r.epfd == epfd)
    }

    /// `EPOLL_CTL_DEL` of connection `fd` on TCP from `epfd`: the registration stays,
    /// dormant (see `FdReg::live`), unless the instance scans it or it is a member of its
    /// list (a connection on shared memory), which only [`forget`](Self::forget) undoes.
    /// Returns false when it was not made dormant.
    fn sleep(&mut self, epfd: c_int, fd: c_int) -> bool {
        self.absorb(fd);
        let scanned = (fd as usize) < SCAN_FDS && SCAN_EPFD[fd as usize].load(Relaxed) != 0;
        if scanned || self.members.get(&epfd).is_some_and(|v| v.iter().any(|m| m.fd == fd)) {
            return false;
        }
        match self.reg_mut(epfd, fd) {
            Some(r) if r.live => {
                r.live = false;
                true
            }
            _ => false,
        }
    }

    /// Whether registration `r` of `fd` is live (its word says, while it stands for it).
    fn live_of(&self, fd: c_int, r: &FdReg) -> bool {
        self.shadows.live(fd, r.epfd).unwrap_or(r.live)
    }

    /// `fd`'s word is void, what it said of the registration kept here: before anything
    /// else changes `fd`'s registrations.
    fn absorb(&mut self, fd: c_int) {
        if let Some((epfd, live, bits)) = self.shadows.retract(fd) {
            let Some(r) = self.reg_mut(epfd, fd) else { return };
            r.live = live;
            let data = r.data;
            if let Some((g, _)) = self.by_data.get_mut(&(epfd, data)).filter(|(g, _)| g.fd == fd) {
                g.events = (g.events & !KEPT) | bits;
            }
        }
    }

    /// `fd`'s word stands for its registration when it has exactly one, with data of its
    /// own, that no instance scans or lists (a connection on TCP; `tcp`): the calls around
    /// each request are then answered without the lock (`Shadows::quick`).
    fn publish(&mut self, fd: c_int, tcp: bool) {
        self.absorb(fd);
        if !tcp {
            return;
        }
        let Some(&[FdReg { epfd, data, live }]) = self.per_fd.get(&fd).map(Vec::as_slice) else { return };
        let scanned = (fd as usize) < SCAN_FDS && SCAN_EPFD[fd as usize].load(Relaxed) != 0;
        if scanned || self.members.get(&epfd).is_some_and(|v| v.iter().any(|m| m.fd == fd)) {
            return;
        }
        if let Some(&(g, 1)) = self.by_data.get(&(epfd, data)) {
            if g.fd == fd {
                self.shadows.publish(fd, epfd, data, g.events, live);
            }
        }
    }

    /// Another registration takes `data` in `epfd`: a dormant one that had it goes for good
    /// (its events would otherwise be taken for the newcomer's).
    fn end_dormant(&mut self, epfd: c_int, data: u64) {
        let Some(&(g, _)) = self.by_data.get(&(epfd, data)) else { return };
        if g.fd != AMBIGUOUS
            && self
                .per_fd
                .get(&g.fd)
                .is_some_and(|v| v.iter().any(|r| r.epfd == epfd && !self.live_of(g.fd, r)))
        {
            self.forget(epfd, g.fd);
        }
    }
}

static REGS: RwLock<Option<Regs>> = RwLock::new(None);

/// True when `epfd` may report virtual connections (one atomic load).
#[inline]
pub fn tracking(epfd: c_int) -> bool {
    TRACKED_EPFD.get(epfd, Relaxed).unwrap_or_else(|| REG_COUNT.load(Relaxed) > 0)
}

fn with_regs<T>(f: impl FnOnce(&mut Regs) -> T) -> T {
    let mut g = REGS.write().unwrap_or_else(|e| e.into_inner());
    let r = g.get_or_insert_with(Regs::default);
    let out = f(r);
    REG_COUNT.store(r.len(), Relaxed);
    out
}

/// The program changed a registration (the call succeeded): remembers it when `fd` is a
/// virtual connection (`vc`, looked up by the caller), forgets it otherwise.
pub fn note_ctl(epfd: c_int, op: c_int, fd: c_int, vc: Option<&Arc<Vc>>, events: u32, data: u64) {
    let virtual_fd = vc.is_some();
    if !virtual_fd && !tracking(epfd) {
        return;
    }
    if data == crate::bells::BELL_DATA && op != libc::EPOLL_CTL_DEL && BELLED.has(epfd) {
        // The program's own registration with the bell's data: the bell goes, so that its
        // events are never taken for the bell's.
        let again = with_regs(|r| r.drop_bell(epfd));
        announce_all(again);
    }
    let tcp = vc.is_some_and(|v| v.shm_now().is_none());
    if tcp && SHADOWS.quick(epfd, op, fd, events, data) == Quick::Done {
        // Taken out, put back or changed in bits the layer does not keep, on TCP: see
        // `shadow`. (What `set` does for a registration put back, for a connection on TCP.)
        if op == libc::EPOLL_CTL_ADD {
            POLLED.clear(fd);
        }
        return;
    }
    if virtual_fd && op == libc::EPOLL_CTL_MOD {
        // The same registration again, or changed only in bits the layer never looks at
        // (UCX and wrk ask for writability and then no more around every send): one read
        // lock. (Not for `ADD`: the kernel refuses a registration that is there.)
        let g = REGS.read().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_some_and(|r| {
            r.data_of(epfd, fd) == Some(data)
                && r.lookup(epfd, data).is_some_and(|g| g.fd == fd && same_to_the_layer(g.events, events))
        }) {
            return;
        }
    }
    if virtual_fd && op == libc::EPOLL_CTL_ADD {
        // (Its epoll waits decide from now on: see `rescan`.)
        POLLED.clear(fd);
    }
    let again = with_regs(|r| {
        let again = 'change: {
            match op {
                libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD if virtual_fd => {
                    TRACKED_EPFD.set(epfd);
                    if !r.set(epfd, fd, events, data, vc) {
                        break 'change Vec::new();
                    }
                }
                libc::EPOLL_CTL_DEL if tcp && r.sleep(epfd, fd) => {
                    // (Dormant: nothing else changes, see `FdReg::live`.)
                    break 'change Vec::new();
                }
                libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
                    // Not a connection (a descriptor number now used by something else): its
                    // data is its own from now on.
                    r.forget(epfd, fd);
                    r.end_dormant(epfd, data);
                }
                _ => {
                    r.forget(epfd, fd);
                }
            }
            let mut again: Vec<_> = r.rescan(fd).into_iter().collect();
            if let Some(e) = r.overflowed.take() {
                again.extend(r.rescan_members(e));
            }
            again
        };
        r.publish(fd, tcp);
        again
    });
    announce_all(again);
}

/// The count of substrate changes the registrations were last brought up to date with.
static MOVES_SEEN: AtomicU32 = AtomicU32::new(0);

/// Before an epoll wait on an instance with connections: when a connection of this process
/// joined or left shared memory since the last look (`vc::substrate_moves`, one load), the
/// registrations follow (`Regs::follow_substrates`). Without this, a connection registered
/// while on TCP that moved onto shared memory later (MPI ranks on one node: their offers
/// are withdrawn at set-up and the layer moves them once both have accepted) was never
/// scanned: every message took a bell through its socket each way, and a busy loop asked
/// the kernel at every turn.
fn follow_moves() {
    let now = crate::vc::substrate_moves();
    if MOVES_SEEN.load(Relaxed) == now {
        return;
    }
    MOVES_SEEN.store(now, Relaxed);
    if REG_COUNT.load(Relaxed) == 0 {
        return;
    }
    let again = with_regs(|r| r.follow_substrates());
    announce_all(again);
}

/// A descriptor is closed: its registrations go (the kernel drops them with the last
/// reference; a registration that survives through a duplicate is then simply not
/// checked), and so does everything of an epoll instance closed.
pub fn note_close(fd: c_int) {
    POLLED.clear(fd);
    if REG_COUNT.load(Relaxed) == 0 && !BELLED.has(fd) {
        return;
    }
    let again = with_regs(|r| {
        let members: Vec<c_int> =
            r.members.get(&fd).map(|v| v.iter().map(|m| m.fd).collect()).unwrap_or_default();
        if let Some(b) = r.bells.remove(&fd) {
            // (Its rings are rescanned below: they name another bell, or their socket.)
            BELLED.clear(fd);
            if let Some(slot) = &b.slot {
                crate::bells::close(slot);
            }
        }
        r.close(fd);
        r.unscan(fd);
        // An instance closed: what it scanned is announced again.
        members.into_iter().filter_map(|m| r.rescan(m)).collect::<Vec<_>>()
    });
    TRACKED_EPFD.clear(fd);
    announce_all(again);
}

/// What a readable report of `fd` means (never blocks; a panic counts as "report it").
fn truth(fd: c_int) -> Truth {
    truth_end(fd, false).0
}

/// [`truth`], and with `rdhup` (the program asked for `POLLRDHUP`), whether the connection
/// is on shared memory with its peer's side shut: the kernel's socket, which carries only
/// bells there, cannot say so.
fn truth_end(fd: c_int, rdhup: bool) -> (Truth, bool) {
    let Some(vc) = fdtable::vc(fd) else { return (Truth::Unknown, false) };
    // (The program's wait succeeds: the entry point gives it back its errno.)
    let t = crate::error::quietly(|| Some(vc.readable_truth(fd))).unwrap_or(Truth::Unknown);
    if matches!(t, Truth::Readable | Truth::Unknown) {
        vc.told_readable();
        return (t, rdhup && vc.shm_peer_shut());
    }
    (t, false)
}

const IN_BITS: u32 = (libc::EPOLLIN | libc::EPOLLRDNORM) as u32;
const END_BITS: u32 = (libc::EPOLLERR | libc::EPOLLHUP | libc::EPOLLRDHUP) as u32;

const RDHUP: u32 = libc::EPOLLRDHUP as u32;

/// Drops the readable bit of events that are not true; returns how many events are left
/// (compacted to the front of `evs`, the events the kernel just wrote).
fn filter_epoll(epfd: c_int, evs: &mut [libc::epoll_event]) -> usize {
    let n = evs.len();
    // The registrations behind readable events (on the stack for the usual few; the rest on
    // the heap): first those whose data is their descriptor's number, as event libraries
    // make it, found from the descriptor's word without the lock (`Shadows::find`); then
    // the others, under one read lock.
    let mut near = [(0usize, Reg { fd: 0, events: 0 }); 16];
    let mut far: Vec<(usize, Reg)> = Vec::new();
    let mut found = 0;
    let mut keep = |i: usize, reg: Reg| {
        if found < near.len() {
            near[found] = (i, reg);
        } else {
            far.push((i, reg));
        }
        found += 1;
    };
    // (Which events were found so, for the first 256.)
    let mut quick = [0u64; 4];
    let mut others = false;
    for (i, e) in evs.iter().enumerate() {
        if e.events & (IN_BITS | END_BITS) != 0 {
            match SHADOWS.find(epfd, e.u64).filter(|_| i < 256) {
                Some((fd, events)) => {
                    keep(i, Reg { fd, events });
                    quick[i / 64] |= 1 << (i % 64);
                }
                None => others = true,
            }
        }
    }
    if others {
        let g = REGS.read().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = g.as_ref() {
            for (i, e) in evs.iter().enumerate() {
                if e.events & (IN_BITS | END_BITS) != 0 && (i >= 256 || quick[i / 64] & (1 << (i % 64)) == 0)
                {
                    if let Some(reg) = r.lookup(epfd, e.u64) {
                        keep(i, reg);
                    }
                }
            }
        }
    }
    if found == 0 {
        return n;
    }
    let mut drop = false;
    for &(i, reg) in near[..found.min(near.len())].iter().chain(far.iter()) {
        let e = &mut evs[i];
        let asked = reg.events & RDHUP != 0 && e.events & IN_BITS != 0;
        let left = match truth_end(reg.fd, asked) {
            (Truth::Spurious, _) if e.events & END_BITS == 0 => e.events & !IN_BITS,
            (Truth::Relinking, _) => 0,
            (_, shut) => {
                if shut {
                    e.events |= RDHUP;
                }
                continue;
            }
        };
        e.events = left;
        if left == 0 {
            drop = true;
            if reg.events & libc::EPOLLONESHOT as u32 != 0 {
                // The kernel disarmed it for an event we take away: arm it again.
                let mut again = libc::epoll_event { events: reg.events, u64: e.u64 };
                // The program's own registration, as it made it.
                sys::fd::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, reg.fd, Some(&mut again));
            }
        }
    }
    if !drop {
        return n;
    }
    let mut k = 0;
    for i in 0..n {
        if evs[i].events != 0 {
            evs[k] = evs[i];
            k += 1;
        }
    }
    k
}

/// The end of a wait of `us` microseconds (negative: no end).
struct Deadline(Option<u64>);

impl Deadline {
    fn us(us: i64) -> Self {
        Deadline((us > 0).then(|| sys::now_us() + us as u64))
    }

    /// Microseconds left for a wait of `us` given at the start (`None`: the time is up;
    /// negative: no end).
    fn left_us(&self, us: i64) -> Option<i64> {
        if us < 0 {
            return Some(us);
        }
        let end = self.0?;
        let now = sys::now_us();
        (now < end).then(|| (end - now) as i64)
    }
}

/// A time-out in milliseconds (negative: none) in microseconds.
pub fn ms_to_us(ms: c_int) -> i64 {
    if ms < 0 {
        -1
    } else {
        ms as i64 * 1000
    }
}

fn us_to_ms(us: i64) -> c_int {
    if us < 0 {
        -1
    } else {
        ((us + 999) / 1000).min(c_int::MAX as i64) as c_int
    }
}

/// A timespec of `us` microseconds (>= 0).
pub fn us_ts(us: i64) -> libc::timespec {
    libc::timespec { tv_sec: (us / 1_000_000) as _, tv_nsec: ((us % 1_000_000) * 1000) as _ }
}

/// Runs `wait(first, left)` (`first`: the call with the program's own time-out; `left`:
/// microseconds left, negative for none) and `filter(n)` on what it reports, again for the
/// rest of the time while the filter leaves nothing.
fn wait_loop(
    timeout_us: i64,
    mut wait: impl FnMut(bool, i64) -> Real,
    mut filter: impl FnMut(c_int) -> c_int,
) -> Real {
    let deadline = Deadline::us(timeout_us);
    let mut first = true;
    let mut left = timeout_us;
    loop {
        let n = wait(first, left)?;
        first = false;
        if n <= 0 || crate::sandbox::active() {
            return Ok(n);
        }
        let k = filter(n);
        if k > 0 || timeout_us == 0 {
            return Ok(k);
        }
        match deadline.left_us(timeout_us) {
            Some(l) => left = l,
            None => return Ok(0),
        }
    }
}

/// `epoll_wait` and its variants: `wait(first, us_left)` is the real call, which writes
/// into `events`.
pub fn epoll_wait(
    epfd: c_int,
    events: &mut ProgArray<libc::epoll_event>,
    timeout_us: i64,
    mut wait: impl FnMut(bool, i64) -> Real,
) -> Real {
    if tracking(epfd) {
        follow_moves();
    }
    let sleepers = (epfd >= 0 && (epfd as usize) < SCAN_EPFDS).then(|| &SLEEPERS[epfd as usize]);
    if let Some(sl) = sleepers {
        // Counted before the scan: a thread reading a scanned connection from now on
        // announces it (see `elided`).
        sl.fetch_add(1, SeqCst);
    }
    let scans = sleepers.is_some() && SCANNED[epfd as usize].load(Relaxed) > 0 && !events.is_empty();
    let reported = if scans { scan_then_report(epfd, events, timeout_us, &mut wait) } else { None };
    let r = match reported {
        Some(r) => Ok(r),
        None => wait_loop(timeout_us, wait, |n| {
            if events.is_empty() {
                return n;
            }
            // The kernel wrote `n` events (at most the array's length).
            let len = events.len();
            events.with(len, |evs| {
                let n = (n as usize).min(len);
                let k = filter_epoll(epfd, &mut evs[..n]);
                after_bell(epfd, evs, k)
            }) as c_int
        }),
    };
    if let Some(sl) = sleepers {
        sl.fetch_sub(1, SeqCst);
    }
    match r {
        // (A bell's event never reaches the program: a sandbox that went in while the wait
        // was in the kernel skips the filter, which takes it out on every other path.)
        Ok(n) if n > 0 && BELLED.has(epfd) && crate::sandbox::active() => {
            let len = events.len();
            Ok(events.with(len, |evs| strip_bell(&mut evs[..(n as usize).min(len)])) as c_int)
        }
        r => r,
    }
}

/// Takes the bell's events out of `evs`; returns how many are left (compacted).
fn strip_bell(evs: &mut [libc::epoll_event]) -> usize {
    let mut k = 0;
    for i in 0..evs.len() {
        if evs[i].u64 != crate::bells::BELL_DATA {
            evs[k] = evs[i];
            k += 1;
        }
    }
    k
}

/// After a wait on `epfd` reported `n` events at the front of `evs` (the program's whole
/// array): if the instance's bell rang, its event goes, its datagrams are taken, the bells of
/// the rings that named it are taken, and the rings that hold bytes are reported (in that
/// order: a writer that rings after the take finds its bell taken and rings again, one that
/// rang before has its bytes seen by the look). Returns how many events are left.
fn after_bell(epfd: c_int, evs: &mut [libc::epoll_event], n: usize) -> usize {
    if !BELLED.has(epfd) {
        return n;
    }
    let k = strip_bell(&mut evs[..n]);
    if k == n {
        return n;
    }
    let mut found = [(0u64, 0u32); 64];
    let f = {
        let g = REGS.read().unwrap_or_else(|e| e.into_inner());
        let Some(r) = g.as_ref() else { return k };
        let Some(b) = r.bells.get(&epfd) else { return k };
        if let Some(slot) = &b.slot {
            crate::bells::take(slot);
        }
        let me = epfd as u16 + 1;
        if let Some(members) = r.members.get(&epfd) {
            for m in members {
                if (m.fd as usize) < SCAN_FDS && SCAN_EPFD[m.fd as usize].load(Relaxed) == me {
                    m.vc.bell_rang_at(b.id);
                }
            }
        }
        scan_in(r, epfd, &mut found, false)
    };
    merge_found(evs, k, &found[..f])
}

/// Adds the rings found by a scan (`(data, events)`) to the `m` events at the front of
/// `evs`; returns how many there are then.
fn merge_found(evs: &mut [libc::epoll_event], mut m: usize, found: &[(u64, u32)]) -> usize {
    let len = evs.len();
    for &(data, bits) in found {
        if let Some(e) = evs[..m].iter_mut().find(|e| e.u64 == data) {
            e.events |= bits;
        } else if m < len {
            evs[m] = libc::epoll_event { events: bits, u64: data };
            m += 1;
        }
    }
    m
}

/// The scan before a wait on `epfd`. First a look without telling the writers anything (a
/// busy loop finds bytes and does not sleep); only a wait that may sleep marks the empty
/// rings sleeping, then looks again. When rings hold bytes, they are reported with whatever
/// the kernel has now (a zero time-out call), and the wait is over: `Some(events)`.
fn scan_then_report(
    epfd: c_int,
    events: &mut ProgArray<libc::epoll_event>,
    timeout_us: i64,
    wait: &mut impl FnMut(bool, i64) -> Real,
) -> Option<c_int> {
    let mut found = [(0u64, 0u32); 64];
    let mut k = scan(epfd, &mut found, false);
    if timeout_us == 0 && looked_lately() {
        // A busy loop of zero-time-out waits: the rings alone (see `rings_only`).
        let len = events.len();
        return Some(events.with(len, |evs| merge_found(evs, 0, &found[..k])) as c_int);
    }
    if k == 0 && timeout_us != 0 {
        match spin(epfd, &mut found, events, timeout_us, wait) {
            Spun::Rings(n) => k = n,
            Spun::Kernel(n) => return Some(n),
            Spun::Nothing => k = scan(epfd, &mut found, true),
        }
    }
    if k == 0 {
        if timeout_us == 0 {
            // (Asked below, by the caller's wait.)
            looked_now();
        }
        return None;
    }
    // (A failed look finds nothing more: the scan's reports go alone.)
    let n = wait(false, 0).unwrap_or(0).max(0);
    if timeout_us == 0 {
        looked_now();
    }
    let len = events.len();
    Some(events.with(len, |evs| {
        let n = (n as usize).min(len);
        let m = filter_epoll(epfd, &mut evs[..n]);
        let m = after_bell(epfd, evs, m);
        merge_found(evs, m, &found[..k])
    }) as c_int)
}

/// What a wait's spin found.
enum Spun {
    /// Rings with bytes (that many in `found`).
    Rings(usize),
    /// Events from the kernel, in the program's array (that many).
    Kernel(c_int),
    /// Nothing: the wait marks the rings sleeping and sleeps.
    Nothing,
}

/// Per epoll instance: its last spins that found nothing, in a row.
static SPIN_MISSES: [AtomicU32; SCAN_EPFDS] = [const { AtomicU32::new(0) }; SCAN_EPFDS];

/// Spins that found nothing in a row after which an instance spins only once in
/// [`SPIN_RETRY`] waits (a program whose bytes come seldom would burn the spin at every
/// wait for nothing).
const SPIN_MISS_MAX: u32 = 4;
const SPIN_RETRY: u32 = 32;

/// How often a spin asks the kernel about the instance's other descriptors (microseconds).
const SPIN_LOOK_US: u64 = 5;

/// Before a wait on `epfd` that would sleep: looks at its scanned rings for
/// `VMI_SHM_SPIN_US` (as a blocking receive on shared memory spins before it sleeps), and at
/// the kernel's events every few microseconds. Bytes a writer puts in a ring meanwhile are
/// found without a bell, and the waiter is not woken from a sleep: for an event loop whose
/// peer answers within the spin, neither side makes a system call per message.
fn spin(
    epfd: c_int,
    found: &mut [(u64, u32)],
    events: &mut ProgArray<libc::epoll_event>,
    timeout_us: i64,
    wait: &mut impl FnMut(bool, i64) -> Real,
) -> Spun {
    let mut us = crate::config::shm_spin_us();
    if timeout_us > 0 {
        us = us.min(timeout_us as u64);
    }
    let misses = &SPIN_MISSES[epfd as usize];
    let m = misses.load(Relaxed);
    if us == 0 || (m >= SPIN_MISS_MAX && !m.is_multiple_of(SPIN_RETRY)) {
        misses.store(m.wrapping_add(1).max(SPIN_MISS_MAX), Relaxed);
        return Spun::Nothing;
    }
    let start = sys::now_us();
    let mut look = start + SPIN_LOOK_US;
    loop {
        let k = scan(epfd, found, false);
        if k > 0 {
            misses.store(0, Relaxed);
            return Spun::Rings(k);
        }
        let now = sys::now_us();
        if now >= look {
            let n = wait(false, 0).unwrap_or(0).max(0);
            if n > 0 {
                let len = events.len();
                let got = events.with(len, |evs| {
                    let n = (n as usize).min(len);
                    let g = filter_epoll(epfd, &mut evs[..n]);
                    after_bell(epfd, evs, g)
                });
                if got > 0 {
                    // (Not what the spin is for: a program whose events come through the
                    // kernel, a listener's accepts, would spin before every one of them and
                    // take the CPU its peers need. It counts as a miss.)
                    misses.store(m.wrapping_add(1), Relaxed);
                    return Spun::Kernel(got as c_int);
                }
            }
            look = now + SPIN_LOOK_US;
        }
        if now >= start + us {
            misses.store(m.wrapping_add(1), Relaxed);
            return Spun::Nothing;
        }
        std::hint::spin_loop();
    }
}

/// The scanned connections of `epfd` whose rings hold bytes (or the end), as (data, events)
/// into `found`; with `sleep`, every other one is marked sleeping (the writer rings from now
/// on). Returns how many were found.
fn scan(epfd: c_int, found: &mut [(u64, u32)], sleep: bool) -> usize {
    let g = REGS.read().unwrap_or_else(|e| e.into_inner());
    g.as_ref().map_or(0, |r| scan_in(r, epfd, found, sleep))
}

/// [`scan`] with the registrations at hand.
fn scan_in(r: &Regs, epfd: c_int, found: &mut [(u64, u32)], sleep: bool) -> usize {
    let Some(members) = r.members.get(&epfd) else { return 0 };
    if members.len() > scan_max() {
        return 0;
    }
    let me = epfd as u16 + 1;
    let mut k = 0;
    for m in members {
        if (m.fd as usize) >= SCAN_FDS || SCAN_EPFD[m.fd as usize].load(Relaxed) != me {
            continue;
        }
        if m.vc.scan_ready(m.fd, sleep) && k < found.len() {
            let rdhup = if m.events & RDHUP != 0 && m.vc.shm_peer_shut() { RDHUP } else { 0 };
            found[k] = (m.data, m.events & IN_BITS | rdhup);
            k += 1;
        }
    }
    k
}

/// Milliseconds for a real call: the program's own at first, then what is left.
pub fn ms_for(first: bool, timeout_ms: c_int, left_us: i64) -> c_int {
    if first {
        timeout_ms
    } else {
        us_to_ms(left_us)
    }
}

/// `poll` and `ppoll`: `wait(first, us_left)` is the real call on `fds`.
pub fn poll(
    fds: &mut ProgArray<libc::pollfd>,
    timeout_us: i64,
    mut wait: impl FnMut(bool, i64) -> Real,
) -> Real {
    if !fdtable::any() || fds.is_empty() {
        return wait(true, timeout_us);
    }
    let n = fds.len();
    if timeout_us == 0 {
        return poll_now(fds, wait);
    }
    POLL_SLEEPERS.fetch_add(1, SeqCst);
    let _counted = Counted(&POLL_SLEEPERS);
    let mut vcs = Vec::new();
    fds.with(n, |p| {
        for f in p.iter() {
            if f.events & libc::POLLIN != 0 && (UNANNOUNCED.has(f.fd) || DIRECTED.has(f.fd)) {
                announce_one(f.fd);
            }
            if fdtable::is_managed(f.fd) {
                vcs.push(f.fd);
            }
        }
    });
    // (See `readiness::replace_under`.)
    let seen = std::cell::Cell::new(0);
    let vcs = &vcs;
    wait_loop(
        timeout_us,
        |first, left| {
            seen.set(wait_enter(vcs));
            undirect_waited(vcs);
            let r = wait(first, left);
            wait_leave(vcs);
            r
        },
        |r| fds.with(n, |p| filter_poll(p, r, seen.get())),
    )
}

/// A `poll` with a zero time-out (a progress engine's busy loop: Open MPI's): it never
/// sleeps, so nothing is announced and nothing counts it as a sleeper. The kernel's answer
/// is checked as for any `poll`, and connections on shared memory asked for input are
/// readable when their rings hold bytes: the layer looks at the rings itself. Such a
/// connection (held by this process alone, in no epoll instance) is *polled* from then on:
/// a receive that ends at `EAGAIN` leaves its ring awake, as for a connection an epoll
/// instance scans, so the writer makes no system call per message either (a `poll` or
/// `select` that may sleep, an epoll registration and a blocking receive announce it first,
/// see `readiness::elided`).
///
/// Such a loop asks the kernel about its other descriptors at most every
/// `VMI_POLL_LOOK_US` ([`rings_only`]): the kernel's answer is the loop's only system call.
fn poll_now(fds: &mut ProgArray<libc::pollfd>, mut wait: impl FnMut(bool, i64) -> Real) -> Real {
    if let Some(k) = rings_only(fds) {
        return Ok(k);
    }
    let n = fds.len();
    // The connections among the descriptors (on the stack for the usual few: this runs at
    // every turn of a busy loop).
    let mut near = [0 as c_int; 16];
    let mut far: Vec<c_int> = Vec::new();
    let mut nv = 0;
    let mut polled = false;
    fds.with(n, |p| {
        for f in p.iter().filter(|f| fdtable::is_managed(f.fd)) {
            polled |= POLLED.has(f.fd);
            if nv < near.len() {
                near[nv] = f.fd;
            } else {
                if far.is_empty() {
                    far.extend_from_slice(&near);
                }
                far.push(f.fd);
            }
            nv += 1;
        }
    });
    let vcs: &[c_int] = if nv <= near.len() { &near[..nv] } else { &far };
    let seen = wait_enter(vcs);
    let r = wait(true, 0);
    wait_leave(vcs);
    let r = r?;
    if polled {
        // (Only a set with a polled connection may be answered from the rings later.)
        looked_now();
    }
    if crate::sandbox::active() {
        return Ok(r);
    }
    let registered = |fd: c_int| {
        REG_COUNT.load(Relaxed) > 0
            && REGS
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .is_some_and(|g| g.per_fd.get(&fd).is_some_and(|v| v.iter().any(|r| g.live_of(fd, r))))
    };
    Ok(fds.with(n, |p| {
        let mut k = if r > 0 { filter_poll(p, r, seen) } else { 0 };
        for f in p.iter_mut() {
            if f.events & libc::POLLIN == 0
                || f.revents & libc::POLLIN != 0
                || (f.fd as usize) >= SCAN_FDS
                || !fdtable::is_managed(f.fd)
            {
                continue;
            }
            // (A look under the table's read lock, without a count on the connection: most
            // connections in such a loop are on TCP, and this runs at every turn.)
            let Some((held, bytes, shut)) = fdtable::with_vc(f.fd, |vc| {
                vc.bells_only().then(|| {
                    let rdhup = f.events & libc::POLLRDHUP != 0;
                    let new = !POLLED.has(f.fd) && vc.held_here_only();
                    (new, vc.scan_ready(f.fd, false), rdhup && vc.shm_peer_shut())
                })
            })
            .flatten() else {
                continue;
            };
            if held && !registered(f.fd) {
                POLLED.set(f.fd);
            }
            if bytes {
                if f.revents == 0 {
                    k += 1;
                }
                f.revents |= libc::POLLIN;
                if shut {
                    f.revents |= libc::POLLRDHUP;
                }
            }
        }
        k
    }))
}

thread_local! {
    /// When this thread's last zero-time-out wait (`poll`, `epoll_wait`) on connections
    /// asked the kernel (microseconds; 0: its next one asks).
    static LOOKED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Set when a thread of this process first marks a look ([`looked_now`]): only from then on
/// may a zero-time-out wait be answered from the rings alone, so only then does a call need
/// [`kernel_touched`]'s thread-local store (every call the layer hands to libc makes it, and
/// a thread-local of this library costs a call to `__tls_get_addr`).
static LOOKING: AtomicBool = AtomicBool::new(false);

/// The thread made a call the kernel carried that may make one of its own descriptors
/// ready (a write to a pipe, a close): its next zero-time-out wait asks the kernel, so
/// that it sees what the thread itself caused.
#[inline]
pub fn kernel_touched() {
    if LOOKING.load(Relaxed) {
        let _ = LOOKED.try_with(|c| c.set(0));
    }
}

/// True when this thread's last zero-time-out wait on connections asked the kernel less
/// than `VMI_POLL_LOOK_US` ago, and the thread touched no descriptor through the kernel
/// since: its next such wait may answer from the rings alone.
fn looked_lately() -> bool {
    let look = crate::config::poll_look_us();
    if look == 0 {
        return false;
    }
    let last = LOOKED.try_with(|c| c.get()).unwrap_or(0);
    last != 0 && sys::now_us() < last.saturating_add(look) && !crate::sandbox::active()
}

/// A zero-time-out wait asks (or asked) the kernel now.
fn looked_now() {
    if crate::config::poll_look_us() > 0 {
        if !LOOKING.load(Relaxed) {
            LOOKING.store(true, Relaxed);
        }
        let _ = LOOKED.try_with(|c| c.set(sys::now_us()));
    }
}

/// A zero-time-out `poll` answered from the rings alone, without a system call: when this
/// thread asked the kernel less than `VMI_POLL_LOOK_US` ago and has not touched a
/// descriptor through it since ([`kernel_touched`]), only input is asked for, and every
/// connection in the set that may carry it is on shared memory and polled (`POLLED`: its
/// bytes come through its ring, never through its socket). What the kernel would add is
/// an event that another thread or process caused in that interval; the next look reports
/// it, as a call made a moment later would. `None`: ask the kernel.
fn rings_only(fds: &mut ProgArray<libc::pollfd>) -> Option<c_int> {
    let n = fds.len();
    fds.with(n, |p| {
        let mut any = false;
        for f in p.iter() {
            if f.fd < 0 {
                continue;
            }
            if f.events & !(libc::POLLIN | libc::POLLRDNORM) != 0 {
                return None;
            }
            any |= POLLED.has(f.fd);
        }
        // (The clock last: a loop over connections on TCP reads none.)
        if !any || !looked_lately() {
            return None;
        }
        let mut ready = [false; 64];
        if p.len() > ready.len() {
            return None;
        }
        for (i, f) in p.iter().enumerate() {
            if f.fd < 0 || !POLLED.has(f.fd) {
                continue;
            }
            // (Whether it is still on shared memory and its ring, in one look at the table; a
            // pending link is not polled, so nothing settles under the table's lock.)
            let (shm, bytes) = fdtable::with_vc(f.fd, |vc| {
                let shm = vc.bells_only();
                (shm, shm && vc.scan_ready(f.fd, false))
            })?;
            if !shm {
                return None;
            }
            ready[i] = bytes;
        }
        let mut k = 0;
        for (i, f) in p.iter_mut().enumerate() {
            f.revents = if ready[i] { f.events & (libc::POLLIN | libc::POLLRDNORM) } else { 0 };
            k += c_int::from(ready[i]);
        }
        Some(k)
    })
}

/// A `poll` or `select` is about to wait on connection `fd`, whose ring a receive left
/// unannounced: announced the usual way.
fn announce_one(fd: c_int) {
    if let Some(vc) = fdtable::vc(fd) {
        DIRECTED.clear(fd);
        crate::error::quietly(|| {
            vc.announce_to_socket(fd);
            Some(())
        });
    }
}

/// A `poll` or `select` counted in on `fds` (`wait_enter`): those whose bells went to an
/// instance's bell come through their sockets now. (Looked at after the count: a
/// registration that directs a ring's bells meanwhile sees the count and takes it back.)
fn undirect_waited(fds: &[c_int]) {
    for &fd in fds {
        if DIRECTED.has(fd) {
            announce_one(fd);
        }
    }
}

/// Takes one off a count of waiting threads when dropped.
struct Counted(&'static AtomicU32);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

/// Drops the readable bit of `poll` reports that are not true; `r` of them were reported,
/// by a call that began when the count of socket replacements was `seen`.
fn filter_poll(p: &mut [libc::pollfd], r: c_int, seen: u32) -> c_int {
    {
        let mut left = r;
        const IN: i16 = libc::POLLIN | libc::POLLRDNORM;
        const END: i16 = libc::POLLERR | libc::POLLHUP | libc::POLLRDHUP;
        for f in p.iter_mut() {
            let bits = f.revents;
            if bits == 0 || bits & libc::POLLNVAL != 0 || !fdtable::is_managed(f.fd) {
                continue;
            }
            if swapped_since(seen, f.fd) {
                // About the socket that went, maybe: the next call asks the new one.
                f.revents = 0;
                left -= 1;
                continue;
            }
            if bits & (IN | END) == 0 {
                continue;
            }
            let asked = f.events & libc::POLLRDHUP != 0 && bits & libc::POLLIN != 0;
            f.revents = match truth_end(f.fd, asked) {
                (Truth::Spurious, _) if bits & END == 0 => bits & !IN,
                (Truth::Relinking, _) => 0,
                (_, shut) => {
                    if shut {
                        f.revents |= libc::POLLRDHUP;
                    }
                    continue;
                }
            };
            if f.revents == 0 {
                left -= 1;
            }
        }
        left
    }
}

/// `select` and `pselect`: `wait(first, us_left)` is the real call on the program's sets
/// (`sets`: read, write, exceptions; each of one `fd_set`, or empty for none).
pub fn select(
    nfds: c_int,
    sets: &mut [ProgArray<libc::fd_set>; 3],
    timeout_us: i64,
    mut wait: impl FnMut(bool, i64) -> Real,
) -> Real {
    if !fdtable::any() || sets[0].is_empty() || nfds <= 0 {
        return wait(true, timeout_us);
    }
    POLL_SLEEPERS.fetch_add(1, SeqCst);
    let _counted = Counted(&POLL_SLEEPERS);
    for fd in 0..nfds.min(libc::FD_SETSIZE as c_int) {
        if (UNANNOUNCED.has(fd) || DIRECTED.has(fd)) && sets[0].has(fd) {
            announce_one(fd);
        }
    }
    // The sets the program asked about, for each repeated call.
    let saved: Vec<Option<libc::fd_set>> =
        sets.iter_mut().map(|s| s.with(1, |s| s.first().copied())).collect();
    let nfds = nfds.min(libc::FD_SETSIZE as c_int);
    let vcs: Vec<c_int> =
        (0..nfds).filter(|&fd| sets.iter_mut().any(|s| s.has(fd)) && fdtable::is_managed(fd)).collect();
    let mut again = false;
    let sets = std::cell::RefCell::new(sets);
    // (See `readiness::replace_under`.)
    let seen = std::cell::Cell::new(0);
    wait_loop(
        timeout_us,
        |first, left| {
            if std::mem::replace(&mut again, true) {
                for (s, c) in sets.borrow_mut().iter_mut().zip(&saved) {
                    if let Some(c) = c {
                        s.with(1, |s| s[0] = *c);
                    }
                }
            }
            seen.set(wait_enter(&vcs));
            undirect_waited(&vcs);
            let r = wait(first, left);
            wait_leave(&vcs);
            r
        },
        |r| {
            let mut sets = sets.borrow_mut();
            let mut left = r;
            for &fd in &vcs {
                if swapped_since(seen.get(), fd) {
                    // About the socket that went, maybe: the next call asks the new one.
                    for s in sets.iter_mut() {
                        if s.has(fd) {
                            s.clear(fd);
                            left -= 1;
                        }
                    }
                    continue;
                }
                if !sets[0].has(fd) {
                    continue;
                }
                match truth(fd) {
                    Truth::Spurious => {}
                    Truth::Relinking => {
                        // Not writable nor exceptional either until the new link is in place.
                        for s in sets[1..].iter_mut() {
                            if s.has(fd) {
                                s.clear(fd);
                                left -= 1;
                            }
                        }
                    }
                    _ => continue,
                }
                sets[0].clear(fd);
                left -= 1;
            }
            left
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_are_found_by_their_data_and_forgotten_with_their_descriptor() {
        let mut r = Regs::default();
        r.set(5, 10, 1, 0xa, None);
        r.set(5, 11, 1, 0xb, None);
        r.set(6, 10, 4, 0xa, None);
        assert_eq!(r.lookup(5, 0xa), Some(Reg { fd: 10, events: 1 }));
        assert_eq!(r.lookup(6, 0xa), Some(Reg { fd: 10, events: 4 }));
        // MOD with other events, then with other data.
        r.set(5, 10, 5, 0xa, None);
        assert_eq!(r.lookup(5, 0xa), Some(Reg { fd: 10, events: 5 }));
        r.set(5, 10, 5, 0xc, None);
        assert_eq!(r.lookup(5, 0xa), None);
        assert_eq!(r.lookup(5, 0xc), Some(Reg { fd: 10, events: 5 }));
        assert_eq!(r.len(), 3);
        // Closing fd 10 forgets it in both instances.
        assert_eq!(r.close(10), 2);
        assert_eq!(r.lookup(5, 0xc), None);
        assert_eq!(r.lookup(6, 0xa), None);
        assert_eq!(r.lookup(5, 0xb), Some(Reg { fd: 11, events: 1 }));
        // Closing the epoll instance forgets what it held.
        assert_eq!(r.close(5), 1);
        assert_eq!(r.len(), 0);
        assert!(r.by_data.is_empty() && r.per_fd.values().all(|v| v.is_empty()));
    }

    #[test]
    fn writability_alone_changes_nothing_the_layer_looks_at() {
        let (i, o, h, one) = (libc::EPOLLIN as u32, libc::EPOLLOUT as u32, RDHUP, libc::EPOLLONESHOT as u32);
        assert!(same_to_the_layer(i, i | o));
        assert!(same_to_the_layer(i | o, i));
        assert!(!same_to_the_layer(i, o), "input asked for no more");
        assert!(!same_to_the_layer(i, i | h), "the peer's end asked for");
        assert!(!same_to_the_layer(i | one, i | o | one), "a one-shot one is armed again with all of them");
        assert!(same_to_the_layer(i | one, i | one));
    }

    #[test]
    fn a_registration_taken_out_and_put_back_sleeps_in_between() {
        let mut r = Regs::default();
        r.set(5, 10, 1, 0xa, None);
        assert!(r.sleep(5, 10));
        assert!(!r.sleep(5, 10), "already dormant");
        assert_eq!(r.data_of(5, 10), None, "not live");
        assert_eq!(r.len(), 1);
        // Put back with the same data: live again, and said to have changed.
        assert!(r.set(5, 10, 4, 0xa, None));
        assert_eq!(r.data_of(5, 10), Some(0xa));
        assert_eq!(r.lookup(5, 0xa), Some(Reg { fd: 10, events: 4 }));
        // Put back with other data: the old data is free.
        assert!(r.sleep(5, 10));
        assert!(r.set(5, 10, 1, 0xb, None));
        assert_eq!(r.lookup(5, 0xa), None);
        assert_eq!(r.lookup(5, 0xb), Some(Reg { fd: 10, events: 1 }));
        // Another descriptor takes a dormant one's data: the dormant one goes for good
        // (not two registrations with one data value, which would be trusted for neither).
        assert!(r.sleep(5, 10));
        r.set(5, 11, 1, 0xb, None);
        assert_eq!(r.lookup(5, 0xb), Some(Reg { fd: 11, events: 1 }));
        assert!(r.reg_mut(5, 10).is_none());
        // So does a descriptor that is not a connection (`end_dormant`, as `note_ctl` calls it).
        assert!(r.sleep(5, 11));
        r.end_dormant(5, 0xb);
        assert_eq!(r.lookup(5, 0xb), None);
        assert_eq!(r.len(), 0);
        // A dormant registration goes with its descriptor.
        r.set(6, 12, 1, 0xc, None);
        assert!(r.sleep(6, 12));
        assert_eq!(r.close(12), 1);
        assert!(r.by_data.is_empty() && r.len() == 0);
    }

    #[test]
    fn a_word_flipped_without_the_lock_is_what_the_registrations_see() {
        use libc::{EPOLL_CTL_ADD as ADD, EPOLL_CTL_DEL as DEL, EPOLL_CTL_MOD as MOD};
        let i = libc::EPOLLIN as u32;
        let mut r = Regs { shadows: Shadows::own(64), ..Default::default() };
        r.set(5, 10, i, 0xa, None);
        r.publish(10, true);
        assert_eq!(r.shadows.quick(5, MOD, 10, i | libc::EPOLLOUT as u32, 0xa), Quick::Done);
        // The peer's end asked for: what an event's check reads says so, and so does the
        // registration once the word is void.
        assert_eq!(r.shadows.quick(5, MOD, 10, i | RDHUP, 0xa), Quick::Done);
        assert_eq!(r.lookup(5, 0xa), Some(Reg { fd: 10, events: i | RDHUP }));
        r.absorb(10);
        assert_eq!(r.by_data.get(&(5, 0xa)).map(|g| g.0), Some(Reg { fd: 10, events: i | RDHUP }));
        r.publish(10, true);
        assert_eq!(r.shadows.quick(5, MOD, 10, i, 0xa), Quick::Done);
        assert_eq!(r.lookup(5, 0xa), Some(Reg { fd: 10, events: i }));
        assert_eq!(r.shadows.quick(5, DEL, 10, 0, 0), Quick::Done);
        assert_eq!(r.data_of(5, 10), None, "dormant");
        assert!(!r.sleep(5, 10), "already dormant, as the word said");
        r.publish(10, true);
        assert_eq!(r.shadows.quick(5, ADD, 10, i, 0xa), Quick::Done);
        assert_eq!(r.data_of(5, 10), Some(0xa));
        // Taken out again, and another descriptor takes its data: the dormant one goes for
        // good, and its word with it.
        assert_eq!(r.shadows.quick(5, DEL, 10, 0, 0), Quick::Done);
        r.set(5, 11, i, 0xa, None);
        assert_eq!(r.lookup(5, 0xa), Some(Reg { fd: 11, events: i }));
        assert!(r.reg_mut(5, 10).is_none());
        assert_eq!(r.shadows.live(10, 5), None);
        r.publish(11, true);
        assert_eq!(r.shadows.live(11, 5), Some(true));
        // A second registration of the descriptor: no word stands for either.
        r.set(6, 11, i, 0xb, None);
        r.publish(11, true);
        assert_eq!(r.shadows.live(11, 5), None);
        assert_eq!(r.shadows.live(11, 6), None);
        // Nor for a connection on shared memory, nor one whose data another shares.
        r.forget(6, 11);
        r.publish(11, false);
        assert_eq!(r.shadows.live(11, 5), None);
        r.set(5, 12, i, 0xa, None);
        r.publish(11, true);
        assert_eq!(r.shadows.live(11, 5), None, "data 0xa is 12's too");
        // Closing the descriptor: its word goes.
        r.forget(5, 12);
        r.publish(11, true);
        assert_eq!(r.shadows.live(11, 5), Some(true));
        r.close(11);
        assert_eq!(r.shadows.live(11, 5), None);
        assert_eq!(r.len(), 0);
    }

    #[test]
    fn one_data_value_for_two_descriptors_is_not_trusted_until_one_goes() {
        let mut r = Regs::default();
        r.set(5, 10, 1, 7, None);
        r.set(5, 11, 1, 7, None);
        assert_eq!(r.lookup(5, 7), None, "an event with data 7 could be either");
        assert!(r.forget(5, 10));
        assert_eq!(r.lookup(5, 7), Some(Reg { fd: 11, events: 1 }));
        assert!(r.forget(5, 11));
        assert!(!r.forget(5, 11));
        assert!(r.by_data.is_empty());
        // The same data used again later is known.
        r.set(5, 12, 1, 7, None);
        assert_eq!(r.lookup(5, 7), Some(Reg { fd: 12, events: 1 }));
    }

    #[test]
    fn deadlines_count_down_and_never_end_for_negative_time_outs() {
        assert_eq!(ms_for(true, 250, 0), 250);
        assert_eq!(ms_for(false, 250, 1_001), 2);
        assert_eq!(ms_for(false, -1, -1), -1);
        let d = Deadline::us(-1);
        assert_eq!(d.left_us(-1), Some(-1));
        let d = Deadline::us(1);
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(d.left_us(1), None);
        let t = us_ts(1_500_000);
        assert_eq!((t.tv_sec, t.tv_nsec), (1, 500_000_000));
    }
}
