//! The shared-memory sink: a virtual connection between two programs on one node whose bytes
//! go through two rings in memory both processes map (`substrate::shmring`), while the
//! program's descriptor stays the TCP socket and carries only *bells* (one-byte wake-ups).
//!
//! Set-up, when both layers know they are on one node (the peer's agent addresses are this
//! node's) and `VMI_SHM=1`:
//!
//! ```text
//!  connecting layer (before its SYN)               accepting layer (at accept)
//!  /dev/shm/vmi-<hash(secret, gid)>  O_EXCL 0600
//!  rings initialised, state OFFERED
//!  bind datagram socket @vmi-shm-<hash>-c
//!                                                  open + map the file, unlink it
//!                                                  bind @vmi-shm-<hash>-a
//!                                                  its socket ──SCM_RIGHTS──► @...-c
//!                                                  state ACCEPTED (futex wake; no byte on
//!                                                  the socket, which must not look readable)
//!  first call after that: take the peer's
//!  socket (checked: it is the other end of
//!  ours), send ours ──SCM_RIGHTS──► @...-a
//! ```
//!
//! The connecting side waits for that answer before its first byte (a non-blocking receive
//! says `EAGAIN`; a non-blocking send waits in the call, at most `OFFER_WAIT_NONBLOCKING_MS`
//! from the offer, because its socket stays writable and a program waiting for an edge of
//! writability would never hear again), so nothing ever sits in a ring the other side will
//! not read. The wait is bounded (`OFFER_WAIT_MS` from the offer): natively a connected socket takes bytes before
//! the peer's program accepts, and programs rely on it (UCX connects to its own listener,
//! sends, and only then accepts, on one thread); past the bound a send withdraws the offer
//! (WITHDRAWN, by compare-and-swap against the answer) and the connection uses TCP. If the accepting
//! layer cannot use the memory it answers REFUSED and both sides use TCP frames, with a log
//! line saying why.
//!
//! Each side keeps the other's socket to ring *itself*: a receive that leaves bytes in the
//! ring for the program's next `poll` writes a bell into the peer's socket, which arrives at
//! its own. A producer waiting for room sleeps on a futex in the ring header.

use crate::stats::Slot;
use crate::sys::shared::{self, MappedRing, SharedMap};
use crate::tcp_sink::TcpSink;
use crate::{linkstate, log, sys};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering::*};
use std::sync::Arc;
use substrate::irb::IrbError;
use substrate::irb::{Buf, Device, Dispatch, Disposition, Irb, IrbKind};
use substrate::shmring::{Bell, Ring, RingError, Sleep};
use substrate::shmring::{RegionHead as Head, ACCEPTED, OFFERED, REFUSED, REGION_MAGIC as MAGIC, WITHDRAWN};

mod moves;
mod setup;

pub(crate) use setup::bells_undelayed;
use setup::*;

/// Bytes of each ring.
const RING: usize = 1 << 20;
/// Most bytes copied into or out of a ring before the other side is shown them: a large
/// message then goes through in pieces that both programs copy at once, the writer the next
/// while the reader takes the last, as the kernel pipelines a TCP stream by segment.
const PIECE: usize = 64 << 10;
/// The region: a page of header, then the ring toward the accepting side, then the other.
const PAGE: usize = 4096;
const REGION: usize = PAGE + 2 * Ring::size(RING).next_multiple_of(PAGE);

/// What carries the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Waiting for the accepting side's answer.
    Pending,
    /// The rings.
    Shm,
    /// TCP frames (the other side refused).
    Tcp,
    /// The connection left this memory (moved to TCP); the rings are not touched again.
    Moved,
}

/// One side's view of a shared-memory connection.
pub struct ShmLink {
    map: Arc<SharedMap>,
    /// The region's file (unlinked once taken), kept open to hand the region over across
    /// `exec`.
    region: std::sync::Arc<AtomicI32>,
    tx: MappedRing,
    rx: MappedRing,
    active: bool,
    tag: String,
    /// The file, until the accepting side unlinked it (connecting side only).
    path: Option<std::ffi::CString>,
    /// The rendezvous datagram socket, until the exchange is done.
    dgram: std::sync::Arc<AtomicI32>,
    /// The peer's socket (to ring ourselves), once known.
    peer_sock: std::sync::Arc<AtomicI32>,
    mode: AtomicU32,
    /// The peer's socket ended (FIN): no bell will come any more.
    eof: AtomicBool,
    /// Stream offsets of the rings' first bytes: our stream (`tx`) and the peer's (`rx`).
    /// Zero for memory set up with the connection; a link moved onto shared memory later
    /// starts where the two sides' streams stood.
    bases: (u64, u64),
    /// The connection's `shm_epoch` this link belongs to (set when it is installed).
    epoch: AtomicU32,
    /// When the offer was made (ms, `sys::now_ms`; connecting side only): a send still
    /// without an answer `OFFER_WAIT_MS` later withdraws it.
    offered_ms: u64,
    /// The offer went to a listener of this very process (`own_listener`): a send does not
    /// wait for the answer, which this process's own `accept` gives, often on the thread
    /// that sends (UCX connects to its own listener, sends, and only then accepts).
    own_listener: bool,
    /// The offer was withdrawn (the program sent before its peer accepted): the connection
    /// moves onto shared memory later, by itself (`relink::shm_later`); the tries so far.
    withdrew: AtomicBool,
    tries: AtomicU32,
}

impl ShmLink {
    fn head(&self) -> &Head {
        self.map.atomics(0)
    }

    /// True while a connection whose offer was withdrawn at set-up waits to be moved onto
    /// shared memory; `tries` counts the tries (the caller stops when it says so).
    pub fn withdrawn_waits(&self) -> bool {
        self.withdrew.load(Acquire)
    }

    /// One more try of that move; how many there were before it.
    pub fn withdrawn_try(&self) -> u32 {
        self.tries.fetch_add(1, AcqRel)
    }

    /// The move was asked for, or will never be: no more tries.
    pub fn withdrawn_done(&self) {
        self.withdrew.store(false, Release);
    }

    /// What carries the bytes now.
    pub fn mode(&self) -> Mode {
        match self.mode.load(Acquire) {
            1 => Mode::Shm,
            2 => Mode::Tcp,
            3 => Mode::Moved,
            _ => Mode::Pending,
        }
    }

    /// True once either side is moving the connection off this memory.
    pub fn moving(&self) -> bool {
        self.head().moving.load(Acquire) != 0
    }

    /// Reads every bell waiting in our socket (a bell announced but still on its way is
    /// waited for, briefly: left behind, it would make the descriptor look readable with an
    /// empty ring); notes the peer's end.
    fn take_bells(&self, fd: i32) {
        let mut b = [0u8; 64];
        let mut got = 0;
        for round in 0..2 {
            loop {
                let r = if crate::sandbox::active() {
                    crate::sandbox::recv_into(fd, &mut b, libc::MSG_DONTWAIT).unwrap_or(-1)
                } else {
                    sys::fd::recv(fd, &mut b, libc::MSG_DONTWAIT)
                };
                if r == 0 {
                    self.eof.store(true, Release);
                    break;
                }
                if r < 0 {
                    break;
                }
                got += r;
                if (r as usize) < b.len() {
                    // A short read took everything there was.
                    break;
                }
            }
            if got > 0
                || round == 1
                || !self.rx.bell_pending()
                || self.eof.load(Acquire)
                || self.rx.bell_to() != 0
            {
                // (A ring whose bells go to an epoll instance's bell: the pending one may be
                // there, not on its way here.)
                break;
            }
            // The producer announced a bell and is writing it right now.
            sys::wait_fd(fd, libc::POLLIN, 2);
        }
        self.rx.bell_taken();
    }

    /// The peer's socket (the accepting side learns it when first needed).
    fn peer_socket(&self, fd: i32) -> i32 {
        let p = self.peer_sock.load(Acquire);
        if p >= 0 {
            return p;
        }
        let d = self.dgram.load(Acquire);
        if d < 0 {
            return -1;
        }
        if !crate::sandbox::allows_nr(libc::SYS_recvmsg) {
            return -1;
        }
        let Some(t) = recv_fd(d) else { return -1 };
        if !is_other_end(fd, t) {
            crate::sys::fd::close(t);
            return -1;
        }
        let t = crate::ownfd::move_high(t);
        if self.peer_sock.compare_exchange(-1, t, AcqRel, Acquire).is_err() {
            crate::sys::fd::close(t);
        }
        if self.dgram.compare_exchange(d, -1, AcqRel, Acquire).is_ok() {
            crate::sys::fd::close(d);
        }
        self.peer_sock.load(Acquire)
    }

    /// A receive returns to the program, which may wait on the descriptor next: announced
    /// (see `announce`) unless every wait of the program looks at the ring first
    /// (`ready::elided`).
    fn leave(&self, fd: i32) {
        if !crate::readiness::elided(fd) {
            self.announce(fd);
            return;
        }
        // A bell rung while the ring was marked sleeping may still be in the socket: once
        // the ring is empty it is taken, or it would stand for bytes that are gone and, as
        // the pending flag, hold back the next bell (an edge-triggered waiter would then
        // never see another event).
        if self.rx.bell_pending() && self.rx.readable().unwrap_or(0) == 0 && !self.rx.closed() {
            self.take_bells(fd);
        }
    }

    /// True once the peer shut its sending side (its end is in the ring, read or not): what
    /// a socket reports as `POLLRDHUP` from the peer's FIN on.
    pub fn peer_shut(&self) -> bool {
        // (Pending too: the accepting side writes the rings once it answered, before this
        // side took the answer; before that nothing is closed.)
        matches!(self.mode(), Mode::Shm | Mode::Pending) && (self.rx.closed() || self.eof.load(Acquire))
    }

    /// For an epoll wait that scans: true when the ring holds bytes (or the end); with
    /// `sleep`, otherwise the writer rings from now on.
    pub fn scan_ready(&self, sleep: bool) -> bool {
        if self.mode() != Mode::Shm {
            return false;
        }
        if sleep {
            self.rx.before_sleep() == Ok(Sleep::Ready)
        } else {
            self.rx.readable().unwrap_or(0) > 0 || self.rx.closed()
        }
    }

    /// The program may wait on the descriptor now: it must look readable exactly when the
    /// ring holds bytes (or the end). Bytes left behind need a bell (rung through the peer's
    /// socket); an empty ring must leave no bell behind.
    pub fn announce(&self, fd: i32) {
        if self.mode() != Mode::Shm {
            return;
        }
        crate::readiness::announced(fd);
        let mut ready = self.rx.before_sleep() == Ok(Sleep::Ready);
        if !ready && self.rx.bell_pending() {
            self.take_bells(fd);
            ready = self.rx.before_sleep() == Ok(Sleep::Ready);
        }
        if ready && self.rx.ensure_bell() == Bell::Ring {
            // Where the ring's bells go: its instance's bell, or through the peer's socket.
            if rang_at_instance(&self.rx) {
                return;
            }
            let p = self.peer_socket(fd);
            if p < 0 || !bell(p) {
                // No way to ring ourselves: take the bell back; the next call finds the bytes.
                self.rx.bell_taken();
            }
        }
    }

    /// The reader: this ring's data bells go to `to` from now on (an epoll instance's bell,
    /// `crate::bells`; 0: the socket). True when they went to another such bell before: a
    /// bell pending there stands for nothing now and is taken back, and the caller announces
    /// what the ring holds (see `announce`).
    pub fn direct_bells(&self, to: u64) -> bool {
        let was = self.rx.bell_to();
        if was == to {
            return false;
        }
        self.rx.direct_bells(to);
        if was == 0 {
            return false;
        }
        // (After the new name is out: a writer that rang the old one looks again and rings
        // the socket too; one that rang before this takes it back is covered by the
        // announcement.)
        self.rx.bell_taken();
        true
    }

    /// The reader, before the program may wait on the descriptor in a way that does not look
    /// at an instance's bell: bells come through the socket again.
    pub fn bells_to_socket(&self, fd: i32) {
        if self.rx.bell_to() != 0 {
            self.direct_bells(0);
            crate::readiness::undirected(fd);
        }
    }

    /// Whether this ring's data bells go to instance bell `id`.
    pub fn bells_at(&self, id: u64) -> bool {
        self.rx.bell_to() == id
    }

    /// An epoll wait took the datagrams at bell `to`: this ring's bell, if it rang there, is
    /// taken (the wait looks at the ring next).
    pub fn bell_rang_at(&self, to: u64) {
        if self.bells_at(to) {
            self.rx.bell_taken();
        }
    }

    /// Rings the reader for bytes just written: at the bell its ring names, or through the
    /// socket.
    fn ring(&self, fd: i32) {
        if !rang_at_instance(&self.tx) {
            bell(fd);
        }
    }

    /// Sends from `data`; the caller holds the tx lock.
    pub fn send(&self, fd: i32, data: &[u8], flags: i32) -> Result<usize, IrbError> {
        // Asked of the kernel only when the answer matters (a full ring).
        let mut nb = None;
        let mut nonblock =
            || *nb.get_or_insert_with(|| flags & libc::MSG_DONTWAIT != 0 || sys::nonblocking(fd));
        let mut sent = 0;
        // The program's send time-out (SO_SNDTIMEO), looked up when a wait begins.
        let mut timeo: Option<Option<u64>> = None;
        self.tx.room_wait_reset();
        loop {
            if self.tx.reader_gone() {
                if sent > 0 {
                    return Ok(sent);
                }
                // As a socket whose peer closed: a reset the peer sent is reported first,
                // once; the first write after the peer left goes (nowhere), the next fail
                // with EPIPE, and SIGPIPE unless the program said MSG_NOSIGNAL.
                if self.rx.take_reset() {
                    return Err(IrbError::Os(libc::ECONNRESET));
                }
                if self.tx.first_write_after_reader_left() {
                    return Ok(data.len());
                }
                if flags & libc::MSG_NOSIGNAL == 0 {
                    crate::tcp_sink::raise_sigpipe();
                }
                return Err(IrbError::Os(libc::EPIPE));
            }
            let end = data.len().min(sent + PIECE);
            let n = self.tx.write(&data[sent..end]).map_err(|_| corrupt())?;
            sent += n;
            if n > 0 && self.tx.after_write() == Bell::Ring {
                self.ring(fd);
            }
            if sent == data.len() {
                return Ok(sent);
            }
            if n > 0 {
                // (The next piece: a full ring stops this call, not a piece.)
                continue;
            }
            if sent > 0 && nonblock() {
                return Ok(sent);
            }
            if nonblock() {
                // The program will wait on the descriptor: the reader rings it when it makes
                // room (an edge-triggered waiter gets no other event).
                if self.tx.before_wait_room_nonblocking().map_err(|_| corrupt())? == Sleep::Ready {
                    continue;
                }
                return Err(IrbError::WouldBlock);
            }
            let deadline = *timeo.get_or_insert_with(|| sys::fd::timeo_deadline(fd, libc::SO_SNDTIMEO));
            let now = deadline.map_or(0, |_| sys::now_us());
            if deadline.is_some_and(|d| now >= d) {
                // The program's send time-out, as the socket's: what went, or EAGAIN.
                return if sent > 0 { Ok(sent) } else { Err(IrbError::WouldBlock) };
            }
            let ms = deadline.map_or(200, |d| (d - now).div_ceil(1000).clamp(1, 200) as i64);
            if let Err(e) = self.wait_room(ms) {
                return if sent > 0 { Ok(sent) } else { Err(e) };
            }
        }
    }

    /// A full ring: spin a little, then sleep until the consumer makes room (or the
    /// connection leaves the memory: `IrbError::LinkDown`), at most `ms` milliseconds.
    pub fn wait_room(&self, ms: i64) -> Result<(), IrbError> {
        let until = sys::now_us() + crate::config::shm_spin_us();
        while self.tx.writable().map_err(|_| corrupt())? == 0 && sys::now_us() < until {
            std::hint::spin_loop();
        }
        if self.tx.writable().map_err(|_| corrupt())? == 0
            && self.tx.before_wait_room().map_err(|_| corrupt())? == Sleep::Ok
            && !self.moving()
        {
            sys::futex_wait(self.tx.space_word(), 0, ms);
        }
        self.tx.space_bell_taken();
        self.tx.room_wait_over();
        if self.moving() {
            return Err(IrbError::LinkDown);
        }
        Ok(())
    }

    /// Receives into `buf`; the caller holds the rx lock.
    pub fn recv(&self, fd: i32, buf: &mut [u8], flags: i32) -> Result<usize, IrbError> {
        // Asked of the kernel only when the answer matters (an empty ring).
        let mut nb = None;
        let mut nonblock =
            || *nb.get_or_insert_with(|| flags & libc::MSG_DONTWAIT != 0 || sys::nonblocking(fd));
        let peek = flags & libc::MSG_PEEK != 0;
        let waitall = flags & libc::MSG_WAITALL != 0 && !peek;
        let mut got = 0;
        self.rx.awake();
        // The spin's deadline, set when the ring is first found empty (no clock read when
        // bytes are already there).
        let mut spin_until = 0;
        // The program's receive time-out (SO_RCVTIMEO), looked up when the wait begins.
        let mut timeo: Option<Option<u64>> = None;
        let r = loop {
            // (A piece at a time, each shown to the writer as soon as it is out; a peek
            // takes everything at once, as it frees nothing.)
            let want = if peek { buf.len() - got } else { (buf.len() - got).min(PIECE) };
            let n = match self.rx.read(&mut buf[got..got + want], peek) {
                Ok(n) => n,
                Err(_) => break Err(corrupt()),
            };
            if n > 0 {
                got += n;
                if !peek && self.rx.after_read() == Bell::Ring {
                    sys::futex_wake(self.rx.space_word(), i32::MAX);
                    if self.rx.take_nonblocking_waiter() && self.tx.force_bell() == Bell::Ring {
                        // Through our socket to the writer's.
                        bell(fd);
                    }
                }
                if got == buf.len() || (!waitall && n < want) {
                    break Ok(got);
                }
                spin_until = 0;
                continue;
            }
            if got > 0 && !waitall {
                // (The ring ran dry after a whole piece: what came is the answer.)
                break Ok(got);
            }
            if buf.is_empty() || self.rx.at_end().unwrap_or(true) || self.eof.load(Acquire) {
                if got == 0 && !buf.is_empty() && !peek && self.rx.take_reset() {
                    // The peer's program reset the connection: after its last byte, as a
                    // socket reads a reset, once.
                    break Err(IrbError::Os(libc::ECONNRESET));
                }
                break Ok(got);
            }
            if nonblock() {
                // Going back to the program, which will wait on the descriptor: the writer
                // rings from now on, unless every wait of the program looks at the ring
                // before it sleeps (an epoll instance that scans it, or zero-time-out polls:
                // `readiness::elided`), which then marks it sleeping only if it must.
                let quiet = crate::readiness::elided(fd);
                let ready = if quiet {
                    self.rx.readable().unwrap_or(0) > 0
                } else {
                    self.rx.before_sleep() == Ok(Sleep::Ready)
                };
                if ready {
                    continue;
                }
                if got == 0 && (!quiet || self.rx.bell_pending()) {
                    // The program will wait on the descriptor: no byte may be left in the
                    // socket, or it polls readable for ever over an empty ring (a bell the
                    // peer rang to wake a writer, say; Open MPI's progress loop then spins
                    // and never sends what its peer waits for). The socket carries only
                    // bells now, so whatever is there is taken.
                    self.take_bells(fd);
                    if self.rx.readable().unwrap_or(0) > 0 || self.eof.load(Acquire) {
                        continue;
                    }
                }
                break if got > 0 { Ok(got) } else { Err(IrbError::WouldBlock) };
            }
            let now = sys::now_us();
            if spin_until == 0 {
                spin_until = now + crate::config::shm_spin_us();
            }
            if now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            if self.moving() {
                break if got > 0 { Ok(got) } else { Err(IrbError::LinkDown) };
            }
            let deadline = *timeo.get_or_insert_with(|| sys::fd::timeo_deadline(fd, libc::SO_RCVTIMEO));
            if deadline.is_some_and(|d| now >= d) {
                // The program's time-out, as the socket's: what came, or EAGAIN.
                break if got > 0 { Ok(got) } else { Err(IrbError::WouldBlock) };
            }
            let ms = deadline.map_or(200, |d| (d - now).div_ceil(1000).clamp(1, 200) as i32);
            // (It sleeps on the socket: the bells must come there.)
            self.bells_to_socket(fd);
            if self.rx.before_sleep() == Ok(Sleep::Ok) {
                sys::wait_fd(fd, libc::POLLIN, ms);
            }
            self.take_bells(fd);
            self.rx.awake();
            spin_until = 0;
        };
        self.leave(fd);
        r
    }

    /// What the kernel's "readable" for the descriptor means (see `crate::ready`): true when
    /// bytes or the end wait, and then nothing changes (the program reads next; a scanned
    /// ring must not be marked sleeping for it). Otherwise only bells were there: they are
    /// taken, and the writer rings from now on (the program's wait goes on). The caller
    /// holds the rx lock.
    pub fn truth(&self, fd: i32) -> Result<bool, IrbError> {
        let there = || -> Result<bool, IrbError> {
            Ok(self.rx.readable().map_err(|_| corrupt())? > 0
                || self.rx.at_end().unwrap_or(true)
                || self.eof.load(Acquire))
        };
        if there()? {
            return Ok(true);
        }
        if self.moving() {
            return Err(IrbError::LinkDown);
        }
        // (A scanned ring is marked sleeping by the scan itself, only when its wait may
        // sleep: a wait that reports other rings must not make the writers ring.)
        if !crate::readiness::scanned(fd) && self.rx.before_sleep() == Ok(Sleep::Ready) {
            return Ok(true);
        }
        self.take_bells(fd);
        there()
    }

    /// Unread bytes (FIONREAD).
    pub fn readable(&self) -> usize {
        self.rx.readable().unwrap_or(0)
    }

    /// The program shut its sending side: the peer reads the end after the last byte.
    pub fn shut_send(&self, fd: i32) {
        self.tx.close();
        if self.tx.after_write() == Bell::Ring {
            self.ring(fd);
        }
    }

    /// The last descriptor closes: the end of stream for the peer (with `reset`, a reset:
    /// the program closed with unread bytes, or with `SO_LINGER` 0, where a socket sends a
    /// RST), and no reader here.
    pub fn close(&self, fd: i32, reset: bool) {
        if reset {
            self.tx.reset();
            if self.tx.after_write() == Bell::Ring {
                self.ring(fd);
            }
        } else {
            self.shut_send(fd);
        }
        if self.rx.reader_leaves() == Bell::Ring {
            sys::futex_wake(self.rx.space_word(), i32::MAX);
        }
    }

    /// From now on (the link is where it stays, inside its `Arc`), the program cannot close
    /// or replace the link's descriptors.
    pub fn protect(&self) {
        for slot in [&self.region, &self.peer_sock, &self.dgram] {
            crate::ownfd::protect_slot(slot);
        }
    }

    /// The layer's descriptors of this link (rendezvous socket, peer's socket, region file)
    /// are let go and closed.
    fn let_go_fds(&self) {
        self.unprotect();
        for fd in [self.dgram.swap(-1, AcqRel), self.peer_sock.swap(-1, AcqRel), self.region.swap(-1, AcqRel)]
        {
            if fd >= 0 {
                crate::sys::fd::close(fd);
            }
        }
    }

    fn unprotect(&self) {
        for slot in [&self.region, &self.peer_sock, &self.dgram] {
            crate::ownfd::unprotect_slot(slot);
        }
    }

    /// Substrate code for statistics.
    pub fn code(&self) -> u32 {
        if matches!(self.mode(), Mode::Tcp | Mode::Moved) {
            1
        } else {
            2
        }
    }

    /// The connection's `shm_epoch` this link belongs to.
    pub fn epoch(&self) -> u32 {
        self.epoch.load(Acquire)
    }

    /// Sets the epoch (when the link is installed).
    pub fn set_epoch(&self, e: u32) {
        self.epoch.store(e, Release);
    }

    /// Another process sharing the connection moved it off this memory: this process stops
    /// using the rings (the mapping stays until the connection goes).
    pub fn retire_here(&self) {
        self.mode.store(3, Release);
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        if !crate::sandbox::allows_all(&[libc::SYS_munmap, libc::SYS_close, libc::SYS_unlink]) {
            // A sandbox forbids it: mapping and descriptors stay until the process ends.
            self.unprotect();
            return;
        }
        self.let_go_fds();
        if let (Some(p), Mode::Pending) = (&self.path, self.mode()) {
            // The offer nobody took.
            sys::fd::unlink(p);
        }
        // (The mapping goes with the last of `map` and the rings.)
    }
}

/// A connection's shared-memory link in this process, if any: set up with the connection,
/// or installed later when a rebuilt link moves it onto shared memory. Links are kept until
/// the connection goes (a reader racing a move may still look at the one it found).
pub type LinkSlot = crate::shm::Kept<ShmLink>;

/// The sink device at the bottom of every virtual connection's chains: the shared-memory
/// rings when the connection has them, else (or when the other side refused them, or the
/// connection left them) the TCP sink.
pub struct ShmSink {
    links: Arc<LinkSlot>,
    tcp: TcpSink,
    slot: Option<Slot>,
}

impl ShmSink {
    /// The device over `links`, falling back to `tcp`.
    pub fn new(links: Arc<LinkSlot>, tcp: TcpSink, slot: Option<Slot>) -> Self {
        ShmSink { links, tcp, slot }
    }
}

impl Device for ShmSink {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn dispatch<'a>(&mut self, mut irb: Irb<'a>, cx: &mut Dispatch<'_>) -> Disposition<'a> {
        let Some(link) = self.links.get() else { return self.tcp.dispatch(irb, cx) };
        if !matches!(irb.kind(), IrbKind::Send | IrbKind::Receive) {
            return self.tcp.dispatch(irb, cx);
        }
        let fd = irb.handle as i32;
        let flags = irb.flags;
        let mem = self.tcp.mem();
        let c = mem.conn();
        let mut mode = link.mode();
        if matches!(mode, Mode::Shm | Mode::Pending) && link.epoch() != c.shm_epoch.load(Acquire) {
            // Another process sharing the connection moved it off this memory.
            link.retire_here();
            mode = Mode::Moved;
        }
        if matches!(mode, Mode::Tcp | Mode::Moved) {
            if let Some(s) = self.slot {
                s.set_substrate(1);
            }
            return self.tcp.dispatch(irb, cx);
        }
        let b = c.broken.load(Acquire);
        if b != 0 {
            return irb.complete(Err(IrbError::Os(b)));
        }
        let gen = crate::tcp_sink::call_gen(&irb);
        if link.moving() {
            linkstate::link_broken_on(mem, "the connection leaves shared memory", gen);
        }
        if c.link_down.load(Acquire) != 0 {
            return irb.complete(Err(IrbError::LinkDown));
        }
        let nonblock = || flags & libc::MSG_DONTWAIT != 0 || sys::nonblocking(fd);
        if mode == Mode::Pending {
            match link.settle(fd, !nonblock(), irb.kind() == IrbKind::Send) {
                Ok(Mode::Tcp) => {
                    if let Some(s) = self.slot {
                        s.set_substrate(1);
                    }
                    return self.tcp.dispatch(irb, cx);
                }
                Ok(_) => {}
                Err(e) => return irb.complete(Err(e)),
            }
        }
        let r = match (irb.kind(), &mut irb.buf) {
            (IrbKind::Send, Buf::Out(d)) => {
                // (Under our tx lock: the send half is ours.)
                let owed = c.with_tx_held(|tx| tx.replaying()) || c.fin_owed.load(Acquire) != 0;
                let r = if owed { replay_first(link, mem, fd, nonblock()) } else { Ok(()) };
                r.and_then(|_| link.send(fd, d, flags))
            }
            (IrbKind::Receive, Buf::In(b)) => link.recv(fd, b, flags),
            _ => return Disposition::Forward(irb),
        };
        if let Err(IrbError::LinkDown) = r {
            linkstate::link_broken_on(mem, "the connection leaves shared memory", gen);
        }
        irb.complete(r)
    }
}

/// A link moved onto shared memory pushes its replay before new bytes (waiting for room,
/// unless `nonblock`). The caller holds the tx lock.
fn replay_first(link: &ShmLink, mem: crate::shm::ConnMem, fd: i32, nonblock: bool) -> Result<(), IrbError> {
    loop {
        if link.push_replay(mem, fd)? {
            return Ok(());
        }
        if nonblock {
            return Err(IrbError::WouldBlock);
        }
        link.wait_room(200)?;
    }
}

fn corrupt() -> IrbError {
    log::error(format_args!(
        "shared memory: the ring's positions are impossible (a confused or hostile peer); resetting"
    ));
    IrbError::Os(libc::ECONNRESET)
}

/// One bell byte into socket `s` (it arrives at the other end).
/// Rings the epoll instance's bell `ring` names, if it names one: true when the datagram
/// went and the ring still names that bell after it (else the caller rings through a
/// socket: the reader may have stopped waiting there before the datagram came).
fn rang_at_instance(ring: &substrate::shmring::Ring) -> bool {
    let to = ring.bell_to();
    to != 0 && crate::bells::ring(to) && ring.bell_to() == to
}

fn bell(s: i32) -> bool {
    if crate::sandbox::active() {
        // (A bell is never more than one byte waiting in the socket: a plain write, where the
        // sandbox allows only that, cannot block.)
        return crate::sandbox::send_parts(s, &[b"b"], 0) == Some(1);
    }
    sys::fd::send(s, b"b", libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) == 1
}

/// Whether this node is where the peer's agent is (its addresses are this node's agent's).
pub fn same_node(peer_agents: &[std::net::SocketAddr]) -> bool {
    let own = crate::agent::own_addrs();
    !own.is_empty() && peer_agents.iter().any(|a| own.contains(a))
}
