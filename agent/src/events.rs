//! Event channels: each process under the layer keeps one Unix connection open to its agent
//! (besides its request socket) on which it says which virtual connections it holds, and the
//! agent tells it when a network path dies or comes back, and hands it the sockets of links
//! other nodes rebuilt for its connections.

use crate::journal::Journal;
use crate::wire::send_with_fd;
use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use substrate::wire::agent::Msg;
use substrate::wire::frame::{FrameHeader, FrameKind, HEADER_LEN};
use tracing::{debug, info, warn};

struct Chan {
    pid: u32,
    out: UnixStream,
    /// Connections this process holds, with its sides.
    holds: Holds,
}

/// The connections a process holds, each with the sides it holds: one as a rule, both for a
/// process connected to its own listener (one GID, two ends), whose child may keep one end
/// and let the other go.
#[derive(Default)]
struct Holds(HashMap<u128, u8>);

/// The bit of a side in [`Holds`] (true: the connecting side's end).
fn side_bit(active: bool) -> u8 {
    if active {
        2
    } else {
        1
    }
}

impl Holds {
    fn insert(&mut self, gid: u128, active: bool) {
        *self.0.entry(gid).or_default() |= side_bit(active);
    }

    /// Lets side `active` of `gid` go; true if it was held.
    fn remove_side(&mut self, gid: u128, active: bool) -> bool {
        let Some(bits) = self.0.get_mut(&gid) else { return false };
        let had = *bits & side_bit(active) != 0;
        *bits &= !side_bit(active);
        if *bits == 0 {
            self.0.remove(&gid);
        }
        had
    }

    /// Lets every side of `gid` go; the sides that were held.
    fn remove_all(&mut self, gid: u128) -> Vec<bool> {
        let bits = self.0.remove(&gid).unwrap_or(0);
        [false, true].into_iter().filter(|&a| bits & side_bit(a) != 0).collect()
    }

    fn has(&self, gid: u128) -> bool {
        self.0.contains_key(&gid)
    }

    fn has_side(&self, gid: u128, active: bool) -> bool {
        self.0.get(&gid).is_some_and(|b| b & side_bit(active) != 0)
    }

    fn gids(&self) -> impl Iterator<Item = u128> + '_ {
        self.0.keys().copied()
    }

    /// Every (GID, side) held.
    fn sides(&self) -> impl Iterator<Item = (u128, bool)> + '_ {
        self.0.iter().flat_map(|(&g, &b)| {
            [false, true].into_iter().filter(move |&a| b & side_bit(a) != 0).map(move |a| (g, a))
        })
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// How long a connection of a process that was frozen for a checkpoint is answered
/// "moved" (its process comes back, here or elsewhere, well within this).
const MOVING_TTL: Duration = Duration::from_secs(600);

/// The node's event channels.
#[derive(Default)]
pub struct Events {
    chans: Mutex<HashMap<u64, Chan>>,
    /// Connections whose process was frozen for a checkpoint: (process, since when).
    moving: Mutex<HashMap<u128, (u32, std::time::Instant)>>,
    /// Processes that said they are ready for their checkpoint.
    /// Answers to a Freeze: `None` ready, `Some(why)` refused.
    frozen: Mutex<HashMap<u32, Option<String>>>,
    frozen_cv: std::sync::Condvar,
    /// Connections set up for a process (through its request socket `client`) before it
    /// opened its event channel: `(client, pid, gid, active)`, moved to the channel when it
    /// opens, dropped when the request socket closes first.
    early: Mutex<Vec<(u64, u32, u128, bool)>>,
    /// Where what happens is recorded.
    pub journal: Arc<Journal>,
    /// Failovers the processes reported, for the metrics.
    pub relinks: crate::relinks::Relinks,
    /// Streams whose program ended them: (GID, the ending side is the connecting one) ->
    /// (length, the layer's proof, since when). Kept for [`ENDED_TTL`], at most
    /// [`ENDED_MAX`] at once.
    ended: Mutex<Ended>,
    /// The node's ticket ports and the tickets out (see `crate::tickets`): a connection
    /// made with one gives its port back when released, a process that ends its used ones.
    pub tickets: Mutex<crate::tickets::Pool>,
    /// What the agent does when a process says on its event channel that it took a
    /// connection from its table of announced connections (`Msg::Accepted`; process,
    /// local and peer address, GID): set at start, the directory being the agent's.
    pub on_accepted: std::sync::OnceLock<AcceptedHook>,
}

/// See [`Events::on_accepted`].
pub type AcceptedHook = Box<dyn Fn(u32, std::net::SocketAddr, std::net::SocketAddr, u128) + Send + Sync>;

/// The ends of streams kept, and the order they came in (oldest first) so that the oldest
/// go first at constant cost: a node closing connections fast keeps [`ENDED_MAX`] and
/// replaces one per new end.
#[derive(Default)]
struct Ended {
    by_stream: HashMap<(u128, bool), EndedStream>,
    order: std::collections::VecDeque<((u128, bool), std::time::Instant, u64)>,
    told: u64,
}

/// A stream's length, its layer's proof, when it was told, and the number of that telling.
type EndedStream = (u64, u128, std::time::Instant, u64);

/// How long the end of a stream is kept to answer a link rebuilt after its process is gone
/// (a connection waits at most its grace period, 60 s by default, for a working network).
const ENDED_TTL: Duration = Duration::from_secs(120);
/// Ends of streams kept at once, at most (older ones go first; a node closing connections
/// faster than this per two minutes keeps the newest).
const ENDED_MAX: usize = 100_000;

/// True once the peer's FIN arrived (TIME_WAIT, CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING).
fn peer_fin_received(fd: RawFd) -> bool {
    // SAFETY: zeroed tcp_info is valid; the kernel fills at most `len` bytes.
    let mut ti: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: valid pointers to locals.
    let r = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut ti as *mut _ as *mut _, &mut len)
    };
    r != 0 || matches!(ti.tcpi_state, 6..=9 | 11)
}

/// How long a closed connection's socket is kept for its peer, at most.
const LINGER: Duration = Duration::from_secs(30);

/// Keeps the socket of a connection whose process exited until the peer closes too: reads
/// and drops its ack frames; a data frame (the peer writes to a closed connection) resets it,
/// as native TCP does.
fn linger(gid: u128, fd: OwnedFd) {
    let s = std::net::TcpStream::from(fd);
    let spawned = std::thread::Builder::new().name("linger".into()).spawn(move || {
        let deadline = std::time::Instant::now() + LINGER;
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut h = [0u8; HEADER_LEN];
        let mut got = 0;
        // Bytes of a control frame's payload still to drop (the tag of an acknowledgement
        // or an end of stream of a sealed stream).
        let mut skip = 0usize;
        let reset = loop {
            if std::time::Instant::now() > deadline {
                break false;
            }
            let want = if skip > 0 { &mut h[..skip.min(HEADER_LEN)] } else { &mut h[got..] };
            match (&s).read(want) {
                // The end: the peer's FIN, or only our own SHUT_RD (after the peer's Fin
                // frame), which the TCP state tells apart.
                Ok(0) if peer_fin_received(s.as_raw_fd()) => break false,
                Ok(0) => std::thread::sleep(Duration::from_millis(20)),
                Ok(n) if skip > 0 => skip -= n,
                Ok(n) => {
                    got += n;
                    if got < HEADER_LEN {
                        continue;
                    }
                    got = 0;
                    match FrameHeader::decode(&h) {
                        Ok(f) if matches!(f.kind, FrameKind::Ack | FrameKind::Fin) => skip = f.len as usize,
                        Ok(f) if f.kind == FrameKind::Data || f.len > 0 => break true,
                        Ok(_) => {}
                        Err(_) => break true,
                    }
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                Err(_) => break false,
            }
        };
        if reset {
            debug!("virtual connection {gid:032x}: data after its process closed it; reset");
            let l = libc::linger { l_onoff: 1, l_linger: 0 };
            // SAFETY: sets an option on the socket we own, which is closed right after.
            unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    &l as *const _ as *const _,
                    std::mem::size_of_val(&l) as _,
                )
            };
        }
    });
    if let Err(e) = spawned {
        warn!(
            "connection {gid:032x}: cannot keep its socket after its process exited: {e}; the peer may see a reset instead of the last bytes (too many threads? see TasksMax)"
        );
    }
}

impl Events {
    /// Event channels that record what happens in `journal`.
    pub fn new(journal: Arc<Journal>) -> Self {
        Events { journal, ..Default::default() }
    }

    /// Serves the event channel `id` of process `pid` until it closes.
    pub fn serve(&self, id: u64, pid: u32, s: UnixStream) {
        let out = match s.try_clone() {
            Ok(o) => o,
            Err(e) => {
                warn!("event channel of process {pid}: {e}");
                return;
            }
        };
        // A process that stops reading must not stall the agent.
        let _ = out.set_write_timeout(Some(Duration::from_millis(200)));
        {
            let mut chans = self.lock();
            let mut holds = Holds::default();
            self.early.lock().unwrap_or_else(|e| e.into_inner()).retain(|&(_, p, gid, active)| {
                if p == pid {
                    holds.insert(gid, active);
                }
                p != pid
            });
            chans.insert(id, Chan { pid, out, holds });
        }
        // Restored here, or back after a failed checkpoint: no longer frozen.
        self.frozen.lock().unwrap_or_else(|e| e.into_inner()).remove(&pid);
        debug!("event channel {id} of process {pid}");
        // (Buffered: a layer tells its holds, releases and ends in batches.)
        let mut reader = crate::wire::MsgReader::default();
        loop {
            match reader.next(s.as_raw_fd()) {
                Ok((Msg::Linger { gid }, Some(fd))) => linger(gid, fd),
                Ok((Msg::Hold { gid, active }, _)) => {
                    if let Some(c) = self.lock().get_mut(&id) {
                        c.holds.insert(gid, active);
                    }
                    crate::registry::hold_again(gid, active, pid);
                    // A process holding it here again (back after a failed checkpoint, or
                    // restored on this node).
                    self.moving().remove(&gid);
                }
                Ok((Msg::Used { gid, .. }, _)) => {
                    // A connection made with one of the process's tickets (told after it was
                    // made, with others, a little later).
                    let dst =
                        self.tickets.lock().unwrap_or_else(|e| e.into_inner()).used(u64::from(pid), gid);
                    match dst {
                        Some(dst) => {
                            if let Some(c) = self.lock().get_mut(&id) {
                                c.holds.insert(gid, true);
                            }
                            crate::registry::hold(gid, true, pid);
                            self.journal.record_connection(pid, gid, "out", None, dst);
                        }
                        None => debug!(
                            "process {pid} said it used ticket {gid:032x}, which is not one of its unused tickets"
                        ),
                    }
                }
                Ok((Msg::Accepted { local, peer, gid }, _)) => {
                    if let Some(c) = self.lock().get_mut(&id) {
                        c.holds.insert(gid, false);
                    }
                    if let Some(f) = self.on_accepted.get() {
                        f(pid, local, peer, gid);
                    }
                }
                Ok((Msg::Ok, _)) => {
                    // The answer to a Freeze: the process closes this channel next. Holds it
                    // told just before (it tells some later, in batches: connections made
                    // with a ticket or taken from the table) move too.
                    self.mark_moving(pid);
                    self.frozen.lock().unwrap_or_else(|e| e.into_inner()).insert(pid, None);
                    self.frozen_cv.notify_all();
                }
                Ok((Msg::Error { reason }, _)) => {
                    // The process cannot be checkpointed now; it goes on as it was.
                    self.frozen.lock().unwrap_or_else(|e| e.into_inner()).insert(pid, Some(reason));
                    self.frozen_cv.notify_all();
                }
                Ok((Msg::Relinked { gid, stall_ms, replayed, dialer, local, peer }, _)) => {
                    self.relinks.note(dialer, stall_ms, replayed);
                    self.journal.record(
                        "failover",
                        Some(pid),
                        serde_json::json!({
                            "gid": format!("{gid:032x}"),
                            "stall_ms": stall_ms,
                            "replayed": replayed,
                            "side": if dialer { "dialer" } else { "holder" },
                            "local": local.to_string(),
                            "peer": peer.to_string(),
                        }),
                    );
                }
                Ok((Msg::Ended { gid, at, from_active, mac }, _)) => {
                    self.note_ended(gid, at, from_active, mac)
                }
                Ok((Msg::Release { gid }, _)) => {
                    self.tickets.lock().unwrap_or_else(|e| e.into_inner()).back(u64::from(pid), gid);
                    let sides = self.lock().get_mut(&id).map(|c| c.holds.remove_all(gid)).unwrap_or_default();
                    for active in sides {
                        crate::registry::release(gid, active, true);
                    }
                    self.journal.record_closed(pid, gid, None);
                }
                Ok((Msg::ReleaseSide { gid, active }, _)) => {
                    if active {
                        self.tickets.lock().unwrap_or_else(|e| e.into_inner()).back(u64::from(pid), gid);
                    }
                    let had = self.lock().get_mut(&id).is_some_and(|c| c.holds.remove_side(gid, active));
                    if had {
                        crate::registry::release(gid, active, true);
                    }
                    self.journal.record_closed(pid, gid, None);
                }
                Ok((other, _)) => {
                    warn!("process {pid} sent {other:?} on its event channel; closing it");
                    break;
                }
                Err(e) => {
                    if e.kind() != io::ErrorKind::UnexpectedEof {
                        info!("event channel of process {pid}: {e}");
                    }
                    break;
                }
            }
        }
        let gone = self.lock().remove(&id);
        self.tickets.lock().unwrap_or_else(|e| e.into_inner()).gone(u64::from(pid));
        if let Some(c) = gone {
            // Frozen for a checkpoint: the node it is restored on takes its records over.
            let moving =
                matches!(self.frozen.lock().unwrap_or_else(|e| e.into_inner()).get(&pid), Some(None));
            for (gid, active) in c.holds.sides() {
                crate::registry::release(gid, active, !moving);
                self.journal.record_closed(pid, gid, Some("its process ended"));
            }
        }
    }

    /// A process ended the stream of connection `gid` it sends (`from_active`: the
    /// connecting side's) at `at`, with the proof `mac` (the agent cannot check it: it is
    /// for the peer's layer).
    pub fn note_ended(&self, gid: u128, at: u64, from_active: bool, mac: u128) {
        let now = std::time::Instant::now();
        let mut e = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        let Ended { by_stream, order, told } = &mut *e;
        // The oldest go while they are too old or too many. (An entry of `order` whose
        // stream was told again later is not the one kept: it removes only its own telling.)
        while let Some(&(k, t, n)) = order.front() {
            if now.duration_since(t) < ENDED_TTL && order.len() < ENDED_MAX {
                break;
            }
            order.pop_front();
            if by_stream.get(&k).is_some_and(|v| v.3 == n) {
                by_stream.remove(&k);
            }
        }
        *told += 1;
        by_stream.insert((gid, from_active), (at, mac, now, *told));
        order.push_back(((gid, from_active), now, *told));
    }

    /// The end of the stream the side `from_active` of `gid` sends, if its program ended it
    /// within [`ENDED_TTL`]: its length and proof.
    pub fn ended(&self, gid: u128, from_active: bool) -> Option<(u64, u128)> {
        let e = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        e.by_stream.get(&(gid, from_active)).filter(|v| v.2.elapsed() < ENDED_TTL).map(|v| (v.0, v.1))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Chan>> {
        self.chans.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Process `pid` (request socket `client`) holds `gid` from now on, on side `active`: the
    /// agent answered its connect or accept with a virtual connection. (The layer does not
    /// say so itself: one message less per connection. What a process lets go of it says,
    /// in batches.)
    pub fn hold(&self, client: u64, pid: u32, gid: u128, active: bool) {
        let mut chans = self.lock();
        let mut found = false;
        for c in chans.values_mut().filter(|c| c.pid == pid) {
            c.holds.insert(gid, active);
            found = true;
        }
        if !found {
            self.early.lock().unwrap_or_else(|e| e.into_inner()).push((client, pid, gid, active));
        }
    }

    /// The request socket `client` closed: what it set up for a channel that never opened
    /// is forgotten.
    pub fn client_gone(&self, client: u64) {
        self.early.lock().unwrap_or_else(|e| e.into_inner()).retain(|e| e.0 != client);
    }

    /// Tells every process (each keeps only what concerns its connections).
    pub fn broadcast(&self, m: &Msg) {
        let body = m.encode();
        let mut chans = self.lock();
        let mut dead = Vec::new();
        for (id, c) in chans.iter() {
            if let Err(e) = send_with_fd(&c.out, &body, None) {
                info!("process {} does not take events ({e}); dropping its channel", c.pid);
                dead.push(*id);
            }
        }
        for id in dead {
            if let Some(c) = chans.remove(&id) {
                let _ = c.out.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// Hands the new link `fd` of connection `gid` to a process holding the side other than
    /// the dialer's (`from_active`: the dialer connected). False if no process here does.
    pub fn handover(&self, gid: u128, nonce: u128, from_active: bool, fd: RawFd) -> bool {
        let body = Msg::Handover { gid, nonce }.encode();
        let chans = self.lock();
        for c in chans.values().filter(|c| c.holds.has_side(gid, !from_active)) {
            match send_with_fd(&c.out, &body, Some(fd)) {
                Ok(()) => {
                    debug!("link for {gid:032x} handed to process {}", c.pid);
                    self.journal.record(
                        "relink",
                        Some(c.pid),
                        serde_json::json!({ "gid": format!("{gid:032x}") }),
                    );
                    return true;
                }
                Err(e) => info!(
                    "connection {gid:032x}: cannot hand its new link to process {}: {e} (the process is gone or stopped reading its event channel)",
                    c.pid
                ),
            }
        }
        false
    }

    fn moving(&self) -> std::sync::MutexGuard<'_, HashMap<u128, (u32, std::time::Instant)>> {
        self.moving.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks process `pid` to get ready for a checkpoint (close its agent sockets) and waits
    /// until it says it is, at most `timeout`. From then on its connections are answered
    /// "moved" ([`Events::is_moving`]). `Ok(false)`: the process has no event channel here.
    pub fn freeze(&self, pid: u32, timeout: Duration) -> Result<bool, String> {
        let body = Msg::Freeze { pid }.encode();
        self.frozen.lock().unwrap_or_else(|e| e.into_inner()).remove(&pid);
        {
            let chans = self.lock();
            if !chans.values().any(|c| c.pid == pid) {
                return Ok(false);
            }
            Self::mark_moving_in(&chans, &mut self.moving(), pid);
            for c in chans.values().filter(|c| c.pid == pid) {
                send_with_fd(&c.out, &body, None).map_err(|e| format!("cannot tell process {pid}: {e}"))?;
            }
        }
        let deadline = std::time::Instant::now() + timeout;
        let mut done = self.frozen.lock().unwrap_or_else(|e| e.into_inner());
        while !done.contains_key(&pid) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                drop(done);
                self.unfreeze(pid);
                return Err(format!("process {pid} did not get ready for the checkpoint within {timeout:?}"));
            }
            done = self.frozen_cv.wait_timeout(done, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        // A process that is ready stays marked so until its event channels close (they tell
        // its records to stay for the node it is restored on), or it opens a new one here.
        if let Some(Some(why)) = done.get(&pid).cloned() {
            done.remove(&pid);
            drop(done);
            self.unfreeze(pid);
            info!("process {pid} cannot be checkpointed: {why}");
            return Err(why);
        }
        info!("process {pid} is ready for its checkpoint");
        self.journal.record(
            "migration",
            Some(pid),
            serde_json::json!({ "phase": "frozen for its checkpoint" }),
        );
        Ok(true)
    }

    /// Every connection process `pid` holds here is answered "moved" from now on.
    fn mark_moving(&self, pid: u32) {
        let chans = self.lock();
        Self::mark_moving_in(&chans, &mut self.moving(), pid);
    }

    fn mark_moving_in(
        chans: &HashMap<u64, Chan>,
        moving: &mut HashMap<u128, (u32, std::time::Instant)>,
        pid: u32,
    ) {
        let now = std::time::Instant::now();
        for c in chans.values().filter(|c| c.pid == pid) {
            for g in c.holds.gids() {
                moving.entry(g).or_insert((pid, now));
            }
        }
    }

    /// Process `pid` stays here after all (its checkpoint failed): its connections are its
    /// own again.
    pub fn unfreeze(&self, pid: u32) {
        self.moving().retain(|_, (p, _)| *p != pid);
    }

    /// True when `gid` belongs to a process that was frozen for a checkpoint (its new link
    /// will be dialed from wherever it is restored).
    pub fn is_moving(&self, gid: u128) -> bool {
        let mut m = self.moving();
        m.retain(|_, (_, t)| t.elapsed() < MOVING_TTL);
        m.contains_key(&gid)
    }

    /// Connections held here (by process `pid` only, when given), each with the processes
    /// holding it.
    pub fn held_by(&self, pid: Option<u32>) -> Vec<(u128, Vec<u32>)> {
        let chans = self.lock();
        let mut gids: Vec<u128> =
            chans.values().filter(|c| pid.is_none_or(|p| c.pid == p)).flat_map(|c| c.holds.gids()).collect();
        gids.sort_unstable();
        gids.dedup();
        gids.into_iter()
            .map(|g| (g, chans.values().filter(|c| c.holds.has(g)).map(|c| c.pid).collect()))
            .collect()
    }

    /// Processes here holding `gid`.
    pub fn holders(&self, gid: u128) -> Vec<u32> {
        self.lock().values().filter(|c| c.holds.has(gid)).map(|c| c.pid).collect()
    }

    /// Tells every process holding `gid` to move it to shared memory or to TCP. False if
    /// none here does.
    pub fn move_conn(&self, gid: u128, shm: bool) -> bool {
        self.tell_holders(gid, &Msg::Move { gid, shm })
    }

    /// Sends `m` with descriptor `fd` to one process holding `gid` (the first that takes
    /// it); its pid, `None` if none here does.
    pub fn tell_one_with_fd(&self, gid: u128, m: &Msg, fd: RawFd) -> Option<u32> {
        let body = m.encode();
        let chans = self.lock();
        for c in chans.values().filter(|c| c.holds.has(gid)) {
            match send_with_fd(&c.out, &body, Some(fd)) {
                Ok(()) => return Some(c.pid),
                Err(e) => info!(
                    "connection {gid:032x}: cannot pass {} to process {}: {e} (the process is gone or stopped reading its event channel)",
                    m.name(),
                    c.pid
                ),
            }
        }
        None
    }

    /// Sends `m` to every process holding `gid`. False if none here does (or none took it).
    pub fn tell_holders(&self, gid: u128, m: &Msg) -> bool {
        let body = m.encode();
        let chans = self.lock();
        let mut told = false;
        for c in chans.values().filter(|c| c.holds.has(gid)) {
            match send_with_fd(&c.out, &body, None) {
                Ok(()) => told = true,
                Err(e) => info!(
                    "connection {gid:032x}: cannot pass {} to process {}: {e} (the process is gone or stopped reading its event channel)",
                    m.name(),
                    c.pid
                ),
            }
        }
        told
    }

    /// Number of GIDs held by processes of this node (for reports).
    pub fn held(&self) -> usize {
        self.lock().values().map(|c| c.holds.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_holding_both_ends_keeps_one_when_it_lets_the_other_go() {
        let mut h = Holds::default();
        h.insert(7, true);
        h.insert(7, false);
        h.insert(9, false);
        assert_eq!(h.len(), 2);
        let mut sides: Vec<(u128, bool)> = h.sides().collect();
        sides.sort_unstable();
        assert_eq!(sides, vec![(7, false), (7, true), (9, false)]);
        // A forked child lets the connecting end go and keeps the accepted one.
        assert!(h.remove_side(7, true));
        assert!(h.has(7) && h.has_side(7, false) && !h.has_side(7, true));
        assert!(!h.remove_side(7, true), "a side let go twice");
        assert!(h.remove_side(7, false));
        assert!(!h.has(7));
        // An older layer's Release lets every side go.
        h.insert(9, true);
        let mut gone = h.remove_all(9);
        gone.sort_unstable();
        assert_eq!(gone, vec![false, true]);
        assert_eq!(h.len(), 0);
    }

    #[test]
    fn holds_told_just_before_the_answer_to_a_freeze_move_with_the_process() {
        use std::io::Write;
        use std::net::SocketAddr;
        use std::time::Instant;
        let events = Arc::new(Events::new(Arc::new(Journal::default())));
        let (mut process, agent_end) = std::os::unix::net::UnixStream::pair().unwrap();
        let e = events.clone();
        std::thread::spawn(move || e.serve(1, 100, agent_end));
        // One hold told at once, before the freeze.
        process.write_all(&Msg::Hold { gid: 5, active: true }.encode()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while events.held() == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let e = events.clone();
        let freezing = std::thread::spawn(move || e.freeze(100, Duration::from_secs(5)));
        let mut pre = [0u8; 4];
        std::io::Read::read_exact(&mut process, &mut pre).unwrap();
        assert!(matches!(
            crate::wire::read_msg_limited(pre, &mut process, 1 << 16),
            Ok(Msg::Freeze { pid: 100 })
        ));
        // Kept back until now: a connection taken from the table, and one made with a
        // ticket that is not this process's (told, but not a hold).
        let local: SocketAddr = "10.0.0.2:80".parse().unwrap();
        let peer: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let mut told = Msg::Accepted { local, peer, gid: 6 }.encode();
        told.extend_from_slice(&Msg::Used { gid: 7, local: peer }.encode());
        told.extend_from_slice(&Msg::Ok.encode());
        process.write_all(&told).unwrap();
        assert_eq!(freezing.join().unwrap(), Ok(true));
        assert!(events.is_moving(5) && events.is_moving(6), "every hold moves");
        assert!(!events.is_moving(7), "a ticket not given to the process is not its connection");
        events.unfreeze(100);
        assert!(!events.is_moving(6));
    }

    #[test]
    fn ends_of_streams_are_kept_up_to_the_bound_oldest_out_first() {
        let ev = Events::new(Arc::new(Journal::default()));
        for g in 0..(ENDED_MAX as u128 + 10) {
            ev.note_ended(g, g as u64, true, g);
        }
        let e = ev.ended.lock().unwrap();
        assert_eq!(e.by_stream.len(), ENDED_MAX);
        assert_eq!(e.order.len(), ENDED_MAX);
        drop(e);
        assert_eq!(ev.ended(0, true), None, "the oldest went first");
        assert_eq!(ev.ended(9, true), None);
        assert_eq!(ev.ended(10, true), Some((10, 10)));
        let last = ENDED_MAX as u128 + 9;
        assert_eq!(ev.ended(last, true), Some((last as u64, last)));
        assert_eq!(ev.ended(last, false), None, "the other side's stream was not told");
        // Told again: the newer end is the one kept, and the older entry's turn in the
        // order does not take it away.
        ev.note_ended(10, 99, true, 7);
        for g in 0..5u128 {
            ev.note_ended(1_000_000 + g, 0, true, 0);
        }
        assert_eq!(ev.ended(10, true), Some((99, 7)));
    }
}
