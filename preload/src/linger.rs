//! Closing a virtual connection the way native TCP closes, although the peer's layer keeps
//! sending acknowledgements the program never reads.
//!
//! A kernel socket closed with unread bytes, or receiving bytes after its close, answers with
//! a reset, and a reset makes the *peer's* kernel drop what it had not delivered yet: a
//! download's tail would vanish because of an ack. So the last close of a virtual connection:
//!
//! * resets at once if payload the program never read is waiting (as native TCP does);
//! * otherwise sends the FIN at once and lets a background thread read what still arrives:
//!   ack frames are discarded; the first data frame resets the connection (as native TCP
//!   does when data reaches a closed socket, so the writer gets `EPIPE`); the peer's FIN, or
//!   30 s, end it.
//!
//! At exit the same happens inline for every open virtual connection, until the peer's kernel
//! has everything up to our FIN (at most 5 s).

use crate::fdtable::{self, Entry};
use crate::sys::{self, Errno};
use crate::tcp_sink::{drain_closed, peer_fin, unread_payload, Drained};
use crate::vc::Vc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const LINGER: Duration = Duration::from_secs(30);
const EXIT_LINGER: Duration = Duration::from_secs(5);
/// How long the reaper waits for the next close once no socket is left, before it ends: a
/// program that opens and closes connections one after the other would otherwise start a
/// thread per connection (measured: a third of the layer's extra time per connection in a
/// sequential connect-and-close loop).
const IDLE: Duration = Duration::from_secs(1);
/// The steps of that wait: a main thread that ended meanwhile ends it sooner.
const IDLE_STEP: Duration = Duration::from_millis(250);

struct Lingering {
    socks: Vec<(i32, Arc<Vc>, Instant)>,
    thread: bool,
}

static LIST: Mutex<Lingering> = Mutex::new(Lingering { socks: Vec::new(), thread: false });

/// Wakes an idle reaper when a socket is added to `LIST`.
static MORE: std::sync::Condvar = std::sync::Condvar::new();

/// Held by the reaper while it works on sockets it took off `LIST` (taken before `LIST`
/// wherever both are): the program's closes only ever wait for `LIST`, which is held for
/// list operations alone, never across system calls or the unmapping of a connection.
static BATCH: Mutex<()> = Mutex::new(());

type ForkGuards = (MutexGuard<'static, ()>, MutexGuard<'static, Lingering>, MutexGuard<'static, Vec<i32>>);

thread_local! {
    static FORK_GUARD: std::cell::RefCell<Option<ForkGuards>> = const { std::cell::RefCell::new(None) };
}

fn lock() -> MutexGuard<'static, Lingering> {
    LIST.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lingering sockets whose FIN waits for what is still owed on them: the rest of a frame that
/// a full socket cut short (the program's send took all of it into the ring), or a replay.
/// A FIN before it ends the stream in the middle of a frame: the peer's program got the bytes
/// before it and then a clean end, the rest lost (with a chain, the peer's layer waited for
/// the rest of a coded frame for good).
static SHUT_OWED: Mutex<Vec<i32>> = Mutex::new(Vec::new());

fn shut_owed() -> MutexGuard<'static, Vec<i32>> {
    SHUT_OWED.lock().unwrap_or_else(|e| e.into_inner())
}

/// True while bytes of ours are owed on the connection's link (or its send half is busy in
/// another thread, which may be writing them).
fn owes(vc: &Vc) -> bool {
    let c = vc.mem().conn();
    let Some(mut g) = c.tx_lock.try_lock() else { return true };
    c.with_tx(&mut g, |tx| tx.in_frame() || tx.replaying())
}

/// Our FIN on lingering socket `fd`: now, or once nothing is owed on it ([`SHUT_OWED`];
/// [`shut_if_sent`] sends it).
fn shut_when_sent(fd: i32, vc: &Vc) {
    if owes(vc) {
        shut_owed().push(fd);
    } else {
        crate::sys::fd::shutdown(fd, libc::SHUT_WR);
    }
}

/// The FIN that waited on `fd` goes once what was owed is out (as a Fin frame if the peer's
/// came meanwhile: see `close_last`). True when none waits any more.
fn shut_if_sent(fd: i32, vc: &Vc) -> bool {
    let mut o = shut_owed();
    let Some(i) = o.iter().position(|&f| f == fd) else { return true };
    if owes(vc) {
        return false;
    }
    o.swap_remove(i);
    drop(o);
    if peer_fin(vc.mem()) {
        let _ = vc.end_stream(fd);
    } else {
        crate::sys::fd::shutdown(fd, libc::SHUT_WR);
    }
    true
}

/// `fd` is closed: no FIN waits on it any more.
fn shut_forget(fd: i32) {
    shut_owed().retain(|&f| f != fd);
}

/// Some virtual connection of this process had `SO_LINGER` set: its close looks whether it
/// asks for a reset (one `getsockopt` at close, for such programs only).
static LINGER_SET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The program set `SO_LINGER` on a virtual connection.
pub fn linger_set() {
    LINGER_SET.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// True when the program's close of virtual connection `fd` asks for a reset: `SO_LINGER`
/// on with a time of 0 (a socket then sends a RST, and its peer reads `ECONNRESET` after
/// what it has).
pub fn abortive_close(fd: i32) -> bool {
    LINGER_SET.load(std::sync::atomic::Ordering::Relaxed)
        && sys::fd::linger_of(fd).is_some_and(|l| l.l_onoff != 0 && l.l_linger == 0)
}

/// Closes `fd` with a reset (SO_LINGER 0); returns the close's result.
fn reset(fd: i32) -> Result<i32, Errno> {
    crate::sys::set_linger(fd, libc::linger { l_onoff: 1, l_linger: 0 });
    sys::cvt(sys::fd::close(fd))
}

/// Closes the program's descriptor `fd`, the last hold on `vc` anywhere. Returns the result
/// of the program's close.
pub fn close_last(fd: i32, vc: Arc<Vc>) -> Result<i32, Errno> {
    // A socket whose peer has not closed yet ends in TIME_WAIT after this close (unless it
    // is reset below): a ticket's port it holds is told busy.
    let peer_closed = vc.mem().conn().peer_eof.load(std::sync::atomic::Ordering::Acquire) != 0;
    let gid = vc.mem().conn().gid;
    if !crate::sandbox::allows_all(LINGER_CALLS) || !crate::sandbox::may_spawn() {
        crate::tickets::closed(gid, !peer_closed);
        // A sandbox forbids what lingering needs: the program's close, as it asked.
        return sys::cvt(sys::fd::close(fd));
    }
    // After the peer's Fin frame the socket's receive side is shut: a FIN from us now would
    // put it where the kernel resets the connection on the peer's next ack. The end of stream
    // goes as a Fin frame instead, and the socket closes once the peer acknowledged all.
    let fin_mode = peer_fin(vc.mem());
    // (A program that shut its side already told the agent where its stream ends.)
    let told = vc.mem().conn().tx_shut.load(std::sync::atomic::Ordering::Acquire) != 0;
    if !fin_mode {
        vc.mem().conn().tx_shut.store(1, std::sync::atomic::Ordering::Release);
    }
    if abortive_close(fd) || unread_payload(vc.mem(), fd) {
        // What the kernel itself does when a program closes with unread data, or with
        // SO_LINGER 0; the Abort frame tells the peer's layer it is the program's reset, not
        // a failed link.
        crate::log::debug(format_args!("close with unread payload or SO_LINGER 0: reset"));
        crate::tickets::closed(gid, false);
        vc.abort(fd);
        return reset(fd);
    }
    crate::tickets::closed(gid, !peer_closed);
    if !fin_mode && (nothing_left(&vc) || sent_nothing(&vc)) {
        // The peer's FIN arrived, nothing waits to be read and nothing of ours to be sent:
        // no byte can arrive after this close, so the kernel's own close (a FIN) ends it as
        // the lingering below would, without a descriptor kept, a shutdown and a last read.
        // Or this side never sent anything: no acknowledgement can come, and what else may
        // still arrive (the peer's data) resets the connection as it would natively.
        let r = sys::cvt(sys::fd::close(fd));
        if !told {
            crate::relink::ended(&vc);
        }
        return r;
    }
    let keep = sys::fd::fcntl(fd, libc::F_DUPFD_CLOEXEC, 700);
    let r = sys::cvt(sys::fd::close(fd));
    if keep >= 0 {
        if fin_mode {
            let _ = vc.end_stream(keep);
        } else {
            shut_when_sent(keep, &vc);
        }
        if !told {
            crate::relink::ended(&vc);
        }
        // A peer that closed already (a client closing after the server's end of stream,
        // say) leaves nothing to wait for: done here, without waking the reaper.
        if step(keep, &vc, true, false) {
            return r;
        }
        let mut l = lock();
        l.socks.push((keep, vc, Instant::now() + LINGER));
        if l.thread {
            // (An idle reaper waits on `MORE`; a busy one finds it on its next round.)
            MORE.notify_one();
        } else {
            let clean = crate::sandbox::spawn_is_clean();
            crate::lifetime::layer_thread(true);
            l.thread = std::thread::Builder::new()
                .name("vmi-linger".into())
                .stack_size(64 << 10)
                .spawn(move || {
                    crate::sandbox::layer_thread(clean);
                    let _ = std::panic::catch_unwind(reaper);
                    crate::lifetime::layer_thread(false);
                })
                .is_ok();
            if !l.thread {
                crate::lifetime::layer_thread(false);
            }
            if !l.thread {
                // No thread: give up lingering rather than leak the socket.
                for (f, _, _) in l.socks.drain(..) {
                    shut_forget(f);
                    crate::sys::fd::close(f);
                }
            }
        }
    }
    r
}

/// True when a connection on TCP has nothing left to linger for: the peer's FIN arrived on
/// the socket (its program closed; no frame can follow) and nothing of ours waits to go (the
/// rest of a frame, a Fin frame owed, a replay). (Unread payload was looked at before.)
fn nothing_left(vc: &Vc) -> bool {
    use std::sync::atomic::Ordering::Acquire;
    let c = vc.mem().conn();
    if c.peer_eof.load(Acquire) == 0 || c.fin_owed.load(Acquire) != 0 || vc.shm_now().is_some() {
        return false;
    }
    !owes(vc)
}

/// True when a connection on TCP never sent a byte or a chain offer of ours (a server that
/// accepts and closes, a port check): the peer's layer has nothing to acknowledge, so nothing
/// but the peer's own data can follow our FIN, and that resets the connection natively too.
/// (Unread payload was looked at before.)
fn sent_nothing(vc: &Vc) -> bool {
    use std::sync::atomic::Ordering::Acquire;
    let c = vc.mem().conn();
    if c.fin_owed.load(Acquire) != 0 || vc.shm_now().is_some() {
        return false;
    }
    let Some(mut g) = c.tx_lock.try_lock() else { return false };
    c.with_tx(&mut g, |tx| tx.sent_nothing())
}

/// How long a blocking `shutdown(SHUT_WR)` waits for its end of stream to leave this host.
const SENT_WAIT: Duration = Duration::from_millis(50);

/// After the end of stream of a blocking socket went into the kernel: waits, at most
/// [`SENT_WAIT`], until the kernel has put everything queued on the wire. A program that
/// shuts its side and leaves at once with `_exit` (no exit handlers, so nothing of the
/// layer's runs after it) has its socket closed by the kernel while it holds acknowledgements
/// from the peer's layer that nobody read; the kernel then resets the connection and throws
/// away what was still queued, the end of stream with it, and the peer's program would see a
/// reset after the last byte instead of the end. (What left before the reset stays readable
/// at the peer.) Natively the peer sends nothing, so the kernel's close sends a FIN.
pub fn until_sent(fd: i32) {
    let gate = crate::sys::gate::allows;
    if !gate(libc::SYS_ioctl, [fd as u64, sys::fd::SIOCOUTQNSD, 0, 0, 0, 0]) || !gate(libc::SYS_ppoll, [0; 6])
    {
        return;
    }
    let deadline = Instant::now() + SENT_WAIT;
    while sys::fd::unsent(fd).is_some_and(|n| n > 0) && Instant::now() < deadline {
        sys::fd::ppoll_us(&mut [], 200);
    }
}

/// The calls a lingering close makes (in the program's thread and the reaper's).
const LINGER_CALLS: &[libc::c_long] = &[
    libc::SYS_fcntl,
    libc::SYS_close,
    libc::SYS_shutdown,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_poll,
    libc::SYS_sendmsg,
    libc::SYS_ioctl,
    libc::SYS_futex,
    libc::SYS_clock_nanosleep,
];

/// One look at a lingering socket: true when it is finished (and closed).
fn step(fd: i32, vc: &Vc, ready: bool, expired: bool) -> bool {
    // What the program wrote last may still wait in the ring (the rest of a frame, or the
    // Fin frame behind it): it goes out first.
    let c = vc.mem().conn();
    if let Some(mut g) = c.tx_lock.try_lock() {
        if c.fin_owed.load(std::sync::atomic::Ordering::Acquire) != 0
            || c.with_tx(&mut g, |tx| tx.replaying())
        {
            vc.replay_tcp(fd);
        }
    }
    shut_if_sent(fd, vc);
    match if ready { drain_closed(vc.mem(), fd) } else { Drained::Open } {
        Drained::DataArrived => {
            crate::log::debug(format_args!("data after close: reset"));
            shut_forget(fd);
            let _ = reset(fd);
            true
        }
        Drained::Open if !expired => false,
        d @ (Drained::Finished | Drained::Open) => {
            crate::log::debug(format_args!("linger of fd {fd} ends: {d:?}"));
            shut_forget(fd);
            crate::sys::fd::close(fd);
            true
        }
    }
}

/// Works on the lingering sockets until none is left and no close came for [`IDLE`] (then
/// the thread ends; the next close starts another).
fn reaper() {
    let mut fails = 0u32;
    loop {
        {
            let mut l = lock();
            let idle_until = Instant::now() + IDLE;
            while l.socks.is_empty() {
                let now = Instant::now();
                if now >= idle_until || crate::lifetime::main_gone() {
                    l.thread = false;
                    return;
                }
                l = MORE
                    .wait_timeout(l, (idle_until - now).min(IDLE_STEP))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
        // A socket whose peer sent its Fin frame polls readable for good (our SHUT_RD): it
        // is looked at on every round (at most 100 ms apart) instead of polled.
        let fds: Vec<(i32, bool)> = lock().socks.iter().map(|s| (s.0, peer_fin(s.1.mem()))).collect();
        let mut p: Vec<libc::pollfd> = fds
            .iter()
            .map(|&(fd, fin)| libc::pollfd {
                fd: if fin { -1 } else { fd },
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        if sys::fd::poll(&mut p, 100) < 0 && sys::errno() != libc::EINTR {
            // (A descriptor limit below the list's length, say: never a loop that spins.)
            fails += 1;
            std::thread::sleep(std::time::Duration::from_millis((10u64 << fails.min(4)).min(100)));
        } else {
            fails = 0;
        }
        let now = Instant::now();
        let _batch = BATCH.lock().unwrap_or_else(|e| e.into_inner());
        let mut mine = std::mem::take(&mut lock().socks);
        mine.retain(|(fd, vc, deadline)| {
            let fin = fds.iter().any(|f| f.0 == *fd && f.1);
            let ready = fin || p.iter().any(|q| q.fd == *fd && q.revents != 0);
            !step(*fd, vc, ready, now > *deadline)
        });
        lock().socks.extend(mine);
        // (The finished ones were closed and unmapped without `LIST`.)
    }
}

/// At exit: every virtual connection this process alone holds ends as it would with close;
/// lingering ones get the rest of one second to see their peers close.
pub fn at_exit() {
    if !crate::sandbox::allows_all(LINGER_CALLS) {
        // Under a sandbox that forbids lingering: the sockets close with the process, as the
        // program's own would.
        return;
    }
    let mut socks: Vec<(i32, Arc<Vc>)> = Vec::new();
    let mut done: Vec<*const Vc> = Vec::new();
    for (fd, e) in fdtable::snapshot() {
        if let Entry::Vc(v) = e {
            let p = Arc::as_ptr(&v);
            if done.contains(&p) {
                continue;
            }
            done.push(p);
            // This process lets go; if it was the last, the connection ends here.
            if v.release() != 1 {
                v.hand_back_slot();
            } else if !unread_payload(v.mem(), fd) {
                if peer_fin(v.mem()) {
                    let _ = v.end_stream(fd);
                } else {
                    shut_when_sent(fd, &v);
                }
                socks.push((fd, v));
            }
        }
    }
    // The reaper holds its batch only briefly; wait for it a little (never for ever: the
    // process is exiting). Once it is ours, every lingering socket is on the list.
    let until = Instant::now() + Duration::from_millis(300);
    let _batch = loop {
        match BATCH.try_lock() {
            Ok(g) => break Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(std::sync::TryLockError::WouldBlock) => break None,
        }
    };
    loop {
        match LIST.try_lock() {
            Ok(mut l) => {
                socks.extend(l.socks.drain(..).map(|(fd, v, _)| (fd, v)));
                break;
            }
            Err(std::sync::TryLockError::Poisoned(p)) => {
                socks.extend(p.into_inner().socks.drain(..).map(|(fd, v, _)| (fd, v)));
                break;
            }
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(std::sync::TryLockError::WouldBlock) => break,
        }
    }
    // The agent keeps what is still open (so that the peer's last acks never reach an
    // orphaned socket); only what it cannot take is waited for here.
    socks.retain(|(fd, v)| {
        let c = v.mem().conn();
        match drain_closed(v.mem(), *fd) {
            Drained::DataArrived => {
                let _ = reset(*fd);
                return false;
            }
            Drained::Finished => {
                crate::log::debug(format_args!("exit: fd {fd} finished"));
                crate::sys::fd::close(*fd);
                return false;
            }
            Drained::Open => {}
        }
        // (The program is exiting and the reaper is idle: the lock is free.)
        let boundary = c
            .rx_lock
            .try_lock()
            .is_some_and(|mut g| c.with_rx(&mut g, |rx| rx.frame_rem == 0 && rx.header_len == 0));
        // (Not one whose FIN still waits for the rest of a frame: that is sent below.)
        let handed = boundary && !shut_owed().contains(fd) && crate::relink::hand_over_linger(c.gid, *fd);
        crate::log::debug(format_args!("exit: fd {fd} handed to the agent: {handed}"));
        if handed {
            crate::sys::fd::close(*fd);
            return false;
        }
        true
    });
    let deadline = Instant::now() + EXIT_LINGER;
    while !socks.is_empty() && Instant::now() < deadline {
        let mut p: Vec<libc::pollfd> = socks
            .iter()
            .map(|s| libc::pollfd {
                fd: if peer_fin(s.1.mem()) { -1 } else { s.0 },
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        sys::fd::poll(&mut p, 20);
        socks.retain(|(fd, v)| {
            if !shut_if_sent(*fd, v) {
                // The rest of a frame before the FIN (see `SHUT_OWED`).
                v.replay_tcp(*fd);
                shut_if_sent(*fd, v);
            }
            let ready = peer_fin(v.mem()) || p.iter().any(|q| q.fd == *fd && q.revents != 0);
            if ready && drain_closed(v.mem(), *fd) != Drained::Open {
                return false;
            }
            // Once the peer's kernel has everything up to our FIN, its layer sends no more
            // acks (it sees the FIN): the socket may outlive the process. Before that, an ack
            // frame reaching the orphaned socket would make our kernel reset the connection
            // and the peer would lose what it had not read yet.
            !fin_delivered(*fd)
        });
    }
}

/// True when everything we sent, our FIN included, reached the peer's kernel.
fn fin_delivered(fd: i32) -> bool {
    // FIN_WAIT2, TIME_WAIT, CLOSE (or no socket to ask about).
    sys::tcp_info(fd).is_none_or(|ti| matches!(ti.tcpi_state, 5..=7))
}

/// fork, prepare.
pub fn before_fork() {
    let b = BATCH.lock().unwrap_or_else(|e| e.into_inner());
    let g = lock();
    // (Held across the fork too: a child must never find it taken by a thread it lacks.)
    let o = shut_owed();
    FORK_GUARD.with(|f| *f.borrow_mut() = Some((b, g, o)));
}

/// fork, parent side.
pub fn after_fork_parent() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
}

/// fork, child side: the lingering sockets are the parent's business. Their connections
/// are let go of without running what a process does when it lets go of one: the fork did
/// not count the child among their holders (only the program's descriptors are), so that
/// would take the parent's count down and tell the agent the parent let go, and it would
/// wait on locks the fork handlers still hold. (Their memory stays mapped in the child,
/// unused.)
pub fn after_fork_child() {
    FORK_GUARD.with(|f| {
        if let Some((_b, mut g, mut o)) = f.borrow_mut().take() {
            for (fd, vc, _) in g.socks.drain(..) {
                crate::sys::fd::close(fd);
                std::mem::forget(vc);
            }
            o.clear();
            g.thread = false;
        }
    });
}
