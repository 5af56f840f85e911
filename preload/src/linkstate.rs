//! The link state the data path shares with the control thread ([`crate::relink`]): how a
//! device or a connection says its link failed, waits for a rebuilt one, and asks the control
//! thread for work, without depending on the control thread itself. The devices (`tcp_sink`,
//! `shm_sink`) and the connection (`vc`) import this; `relink` reads what it gathers
//! (connections to attend, owed writes, replays under way), and `lib.rs`'s constructor hands
//! down what only the control thread can do ([`Control`], [`init`]).

use crate::ownfd::OWN_WAKE;
use crate::shm::ConnMem;
use crate::{log, sys};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering::*};
use std::sync::OnceLock;

/// What the control thread does for the layers below it.
pub struct Control {
    /// Starts this process's control thread if it does not run (`relink::ensure_control`).
    pub start: fn(),
    /// This process let go of a connection: its GID, and whether other processes still hold
    /// it (`relink::released`).
    pub released: fn(u128, bool, bool),
}

static CONTROL: OnceLock<Control> = OnceLock::new();

/// When the connections whose shared-memory offer was withdrawn at set-up are looked at
/// next by the control thread (`sys::now_ms`; 0: none waits).
pub static SHM_LATER_DUE: AtomicU64 = AtomicU64::new(0);
/// How long after a withdrawal the move onto shared memory is first tried: by then the
/// peer's program has accepted, as a rule (MPI ranks and UCX accept right after their first
/// sends), and if not, the next try comes twice as late. Short, because a program's first
/// exchanges (an MPI benchmark's, its measurement included) all go over TCP until the move:
/// since a non-blocking send waits only 5 ms for the offer's answer, more connections
/// start on TCP, and at 40 ms one NetPIPE run in eight on one node measured TCP.
pub const SHM_LATER_MS: u64 = 10;

/// A connection of this process withdrew its shared-memory offer (its program sent before
/// the peer's program accepted): the control thread moves it onto shared memory later
/// (`relink::shm_later_due`).
pub fn shm_later() {
    due_at(&SHM_LATER_DUE, sys::now_ms() + SHM_LATER_MS);
}

/// Makes `due` at most `at` (0 counts as no time set).
pub fn due_at(due: &AtomicU64, at: u64) {
    let _ = due.fetch_update(Relaxed, Relaxed, |d| (d == 0 || d > at).then_some(at));
}

/// Hands down what the control thread does (once, at start).
pub fn init(c: Control) {
    let _ = CONTROL.set(c);
}

/// Starts this process's control thread if it does not run yet (first connection, or the
/// first call in a forked child). One load and a compare when it runs.
#[inline]
pub fn ensure_control() {
    if CONTROL_PID.load(Acquire) != crate::pid() {
        if let Some(c) = CONTROL.get() {
            (c.start)();
        }
    }
}

/// This process let go of connection `gid` (`others_hold`: other processes still hold it):
/// the agent hears it (see `relink::released`).
pub fn released(gid: u128, active: bool, others_hold: bool) {
    if let Some(c) = CONTROL.get() {
        (c.released)(gid, active, others_hold);
    }
}

/// Waits (a blocking call) until the link is up again or the connection failed; the
/// connection's errno in the second case.
pub fn wait_link(mem: ConnMem) -> Result<(), i32> {
    let c = mem.conn();
    ensure_control();
    loop {
        let b = c.broken.load(Acquire);
        if b != 0 {
            return Err(b);
        }
        let gen = c.link_gen.load(Acquire);
        if c.link_down.load(Acquire) == 0 {
            return Ok(());
        }
        sys::futex_wait(&c.link_gen, gen, 200);
    }
}

/// Pid of the process whose control thread runs (0: none yet; another pid: a fork parent's).
pub(crate) static CONTROL_PID: AtomicI32 = AtomicI32::new(0);

/// 1 while some rebuilt link still has bytes to replay.
pub(crate) static REPLAYING: AtomicU32 = AtomicU32::new(0);

/// The control thread of this process runs.
pub(crate) static ALIVE: AtomicBool = AtomicBool::new(false);

/// True while this process's control thread runs.
pub fn control_running() -> bool {
    ALIVE.load(Acquire) && CONTROL_PID.load(Acquire) == crate::pid()
}

/// The physical socket failed with `e` (or the agent said its path died): mark the link
/// down and tell the control thread. True if it was up until now.
pub fn link_broken(mem: ConnMem, why: &str) -> bool {
    link_broken_on(mem, why, None)
}

/// As [`link_broken`], from a program's call that ran on link generation `call_gen` (see
/// `Vc::with_link`): an error from a socket another process already replaced does not mark
/// the new link down.
pub fn link_broken_on(mem: ConnMem, why: &str, call_gen: Option<u32>) -> bool {
    let c = mem.conn();
    if c.broken.load(Acquire) != 0 {
        return false;
    }
    if call_gen.is_some_and(|g| g != c.link_gen.load(Acquire)) {
        // The program's call used a socket another process (after fork) has already
        // replaced: the old socket's error says nothing about the new link. The caller
        // takes the new one (`Vc::prepare`) and tries again.
        log::debug(format_args!(
            "virtual connection {:032x}: {why} on a link another process already replaced",
            c.gid
        ));
        return false;
    }
    if c.link_down.compare_exchange(0, 1, AcqRel, Acquire).is_ok() {
        if call_gen.is_some_and(|g| g != c.link_gen.load(Acquire)) {
            // Replaced between the look and the mark: undo.
            c.link_down.store(0, Release);
            return false;
        }
        c.down_since_ms.store(sys::now_ms(), Release);
        log::info(format_args!("virtual connection {:032x}: link lost ({why}); rebuilding it", c.gid));
        attend(c.gid);
        wake();
        return true;
    }
    false
}

/// True if `e` from the physical socket means the link (not the peer's program) failed.
pub fn is_link_error(e: i32) -> bool {
    matches!(
        e,
        libc::ECONNRESET
            | libc::EPIPE
            | libc::ETIMEDOUT
            | libc::EHOSTUNREACH
            | libc::ENETUNREACH
            | libc::ENETDOWN
            | libc::ECONNABORTED
            | libc::ENOTCONN
            | libc::EHOSTDOWN
    )
}

/// Connections whose link broke since the control thread last looked, so that it looks at
/// them without a walk of every connection (a failover breaks thousands in a burst, each
/// waking the thread). Never waited for: a program thread that finds it taken, or full, asks
/// for a walk of every connection instead ([`ATTEND_ALL`]).
static ATTENTION: std::sync::Mutex<Vec<u128>> = std::sync::Mutex::new(Vec::new());
static ATTEND_ALL: AtomicBool = AtomicBool::new(false);
/// Most connections [`ATTENTION`] holds.
const ATTENTION_MAX: usize = 1 << 16;

pub(crate) fn attend(gid: u128) {
    match ATTENTION.try_lock() {
        Ok(mut a) if a.len() < ATTENTION_MAX => a.push(gid),
        _ => ATTEND_ALL.store(true, Release),
    }
}

/// The connections to look at since last time; `None`: look at every one.
pub(crate) fn attention() -> Option<Vec<u128>> {
    let taken = match ATTENTION.try_lock() {
        Ok(mut a) => std::mem::take(&mut *a),
        Err(_) => return None,
    };
    (!ATTEND_ALL.swap(false, AcqRel)).then_some(taken)
}

pub(crate) fn wake() {
    let fd = crate::ownfd::own_fd(OWN_WAKE);
    if fd >= 0 && crate::sandbox::allows(libc::SYS_write, [fd as u64, 0, 8, 0, 0, 0]) {
        // An 8-byte write to our eventfd.
        sys::fd::write_raw(fd, &1u64.to_ne_bytes());
    }
    // (Otherwise the control thread looks often: `sandbox::control_poll_ms`.)
}

/// Partial writes by non-blocking senders so far (the rest of each frame waits in the ring).
pub(crate) static OWED: AtomicU64 = AtomicU64::new(0);

/// A non-blocking send left the rest of a frame in the ring. The program's next send usually
/// finishes it; if none comes, the control thread does, a few milliseconds later. (No system
/// call here: this happens on most writes of a sender that fills its socket.)
#[inline]
pub fn owed_later() {
    OWED.fetch_add(1, Relaxed);
}

/// Asks the control thread to look at the connections now (a Fin waits for a replay).
pub fn poke() {
    if REPLAYING.swap(1, Relaxed) == 0 {
        // (A forked child may hold a connection still replaying with no thread yet.)
        ensure_control();
        wake();
    }
}

/// Asks the control thread to walk the connections now: work a sandboxed program thread left
/// to it (an acknowledgement to send, acknowledgements to read).
pub fn poke_work() {
    ATTEND_ALL.store(true, Release);
    wake();
}

/// The control thread was woken only to tell the agent the ends of streams kept back (see
/// `relink::ended`): no walk of the connections for that.
pub(crate) static WOKEN_FOR_ENDS: AtomicBool = AtomicBool::new(false);

/// Wakes the control thread for the ends of streams kept back.
pub(crate) fn wake_for_ends() {
    WOKEN_FOR_ENDS.store(true, Release);
    wake();
}
