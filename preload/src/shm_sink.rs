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
//!                                                  state ACCEPTED, a bell through its socket
//!  first call after that: take the bell, take
//!  the peer's socket (checked: it is the other
//!  end of ours), send ours ──SCM_RIGHTS──► @...-a
//! ```
//!
//! The connecting side waits for that answer before its first byte (a non-blocking call says
//! `EAGAIN`), so nothing ever sits in a ring the other side will not read. If the accepting
//! layer cannot use the memory it answers REFUSED and both sides use TCP frames, with a log
//! line saying why.
//!
//! Each side keeps the other's socket to ring *itself*: a receive that leaves bytes in the
//! ring for the program's next `poll` writes a bell into the peer's socket, which arrives at
//! its own. A producer waiting for room sleeps on a futex in the ring header.

use crate::stats::Slot;
use crate::tcp_sink::TcpSink;
use crate::{log, real, sys};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering::*};
use std::sync::Arc;
use substrate::irb::IrbError;
use substrate::irb::{Buf, Device, Dispatch, Disposition, Irb, IrbKind};
use substrate::shmring::{Bell, Ring, RingError, Sleep};

/// Bytes of each ring.
const RING: usize = 1 << 20;
/// The region: a page of header, then the ring toward the accepting side, then the other.
const PAGE: usize = 4096;
const REGION: usize = PAGE + 2 * Ring::size(RING).next_multiple_of(PAGE);
const MAGIC: u64 = 0x766d_692d_7368_6d72; // "vmi-shmr"

const OFFERED: u32 = 0;
const ACCEPTED: u32 = 1;
const REFUSED: u32 = 2;

/// What carries the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Waiting for the accepting side's answer.
    Pending,
    /// The rings.
    Shm,
    /// TCP frames (the other side refused).
    Tcp,
}

#[repr(C)]
struct Head {
    magic: u64,
    state: AtomicU32,
    /// 1 once a process of the connecting side took the answer (after a fork, the others
    /// adopt it).
    settled: AtomicU32,
}

/// One side's view of a shared-memory connection.
pub struct ShmLink {
    base: *mut u8,
    /// The region's file (unlinked once taken), kept open to hand the region over across
    /// `exec`.
    region: AtomicI32,
    tx: Ring,
    rx: Ring,
    active: bool,
    tag: String,
    /// The file, until the accepting side unlinked it (connecting side only).
    path: Option<std::ffi::CString>,
    /// The rendezvous datagram socket, until the exchange is done.
    dgram: AtomicI32,
    /// The peer's socket (to ring ourselves), once known.
    peer_sock: AtomicI32,
    mode: AtomicU32,
    /// The peer's socket ended (FIN): no bell will come any more.
    eof: AtomicBool,
}

// SAFETY: the mapping is shared memory used through atomics and the rings' protocol; the
// rest is atomics or immutable.
unsafe impl Send for ShmLink {}
// SAFETY: as above.
unsafe impl Sync for ShmLink {}

fn tag_of(gid: u128, secret: u128) -> String {
    let mut b = Vec::with_capacity(40);
    b.extend_from_slice(b"vmi-shm");
    b.extend_from_slice(&secret.to_le_bytes());
    b.extend_from_slice(&gid.to_le_bytes());
    let h = substrate::auth::sha256(&b);
    h[..12].iter().map(|x| format!("{x:02x}")).collect()
}

fn dgram_bound(name: &str) -> Option<i32> {
    // SAFETY: plain socket creation.
    let s = unsafe {
        libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0)
    };
    if s < 0 {
        return None;
    }
    let (sun, len) = crate::agent::abstract_addr(name);
    // SAFETY: binds our own socket.
    if unsafe { libc::bind(s, &sun as *const _ as *const libc::sockaddr, len) } != 0 {
        // SAFETY: our socket.
        unsafe { real::close(s) };
        return None;
    }
    Some(crate::fdtable::move_high(s))
}

/// Sends descriptor `fd` to the abstract datagram socket `to`.
fn send_fd(s: i32, to: &str, fd: i32) -> bool {
    let (sun, len) = crate::agent::abstract_addr(to);
    let mut byte = [b's'];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr() as *mut _, iov_len: 1 };
    let mut cbuf: sys::FdCmsg = [0; 4];
    // SAFETY: zeroed msghdr is valid; fields point at live locals.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = &sun as *const _ as *mut _;
    msg.msg_namelen = len;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    sys::attach_fd(&mut msg, &mut cbuf, fd);
    // SAFETY: msg is fully initialised.
    unsafe { real::sendmsg(s, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) == 1 }
}

/// A descriptor waiting on datagram socket `s`, if any.
fn recv_fd(s: i32) -> Option<i32> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr() as *mut _, iov_len: 1 };
    let mut cbuf: sys::FdCmsg = [0; 4];
    // SAFETY: zeroed msghdr is valid; fields point at live locals.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    sys::expect_fd(&mut msg, &mut cbuf);
    // SAFETY: msg is valid.
    if unsafe { real::recvmsg(s, &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) } < 0 {
        return None;
    }
    sys::passed_fd(&msg)
}

/// True when `theirs` is the other end of our socket `ours` (same addresses, swapped).
fn is_other_end(ours: i32, theirs: i32) -> bool {
    let (a, b) = (sys::local_addr(ours), sys::peer_addr(ours));
    a.is_some() && b.is_some() && sys::local_addr(theirs) == b && sys::peer_addr(theirs) == a
}

fn map(fd: i32) -> Option<*mut u8> {
    // SAFETY: maps REGION bytes of a file we hold open.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), REGION, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
    };
    (p != libc::MAP_FAILED).then_some(p as *mut u8)
}

fn rings(base: *mut u8, active: bool) -> Result<(Ring, Ring), RingError> {
    let one = Ring::size(RING).next_multiple_of(PAGE);
    let (to_acc, to_conn) = (base.wrapping_add(PAGE), base.wrapping_add(PAGE + one));
    // SAFETY: both lie inside the REGION-byte mapping, page aligned.
    let (a, b) =
        unsafe { (Ring::attach(to_acc, Ring::size(RING))?, Ring::attach(to_conn, Ring::size(RING))?) };
    Ok(if active { (a, b) } else { (b, a) })
}

impl ShmLink {
    fn head(&self) -> &Head {
        // SAFETY: the first page of the mapping.
        unsafe { &*(self.base as *const Head) }
    }

    /// What carries the bytes now.
    pub fn mode(&self) -> Mode {
        match self.mode.load(Acquire) {
            1 => Mode::Shm,
            2 => Mode::Tcp,
            _ => Mode::Pending,
        }
    }

    /// The connecting side offers shared memory (before its SYN): `None` when it cannot.
    pub fn offer(gid: u128, secret: u128) -> Option<ShmLink> {
        let tag = tag_of(gid, secret);
        let path = std::ffi::CString::new(format!("/dev/shm/vmi-{tag}")).ok()?;
        // SAFETY: creating a new file of our own.
        let fd = unsafe {
            libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o600)
        };
        if fd < 0 {
            log::info(format_args!(
                "no shared memory for {gid:032x}: cannot create {path:?} ({})",
                sys::errno()
            ));
            return None;
        }
        // SAFETY: our file.
        let sized = unsafe { libc::ftruncate(fd, REGION as libc::off_t) } == 0;
        let base = if sized { map(fd) } else { None };
        let Some(base) = base else {
            // SAFETY: removes the file we made; our descriptor.
            unsafe {
                libc::unlink(path.as_ptr());
                real::close(fd);
            }
            return None;
        };
        let fd = crate::fdtable::move_high(fd);
        let one = Ring::size(RING).next_multiple_of(PAGE);
        // SAFETY: fresh mapping; the rings lie inside it, page aligned.
        let ok = unsafe {
            Ring::init(base.add(PAGE), Ring::size(RING)).is_ok()
                && Ring::init(base.add(PAGE + one), Ring::size(RING)).is_ok()
        };
        let dgram = dgram_bound(&format!("vmi-shm-{tag}-c"));
        let (Ok((tx, rx)), true, Some(dgram)) = (rings(base, true), ok, dgram) else {
            // SAFETY: undoing what we made.
            unsafe {
                libc::munmap(base as *mut _, REGION);
                libc::unlink(path.as_ptr());
                real::close(fd);
            }
            return None;
        };
        // SAFETY: the first page is ours to initialise.
        unsafe {
            std::ptr::write(
                base as *mut Head,
                Head { magic: MAGIC, state: AtomicU32::new(OFFERED), settled: AtomicU32::new(0) },
            );
        }
        Some(ShmLink {
            base,
            region: AtomicI32::new(fd),
            tx,
            rx,
            active: true,
            tag,
            path: Some(path),
            dgram: AtomicI32::new(dgram),
            peer_sock: AtomicI32::new(-1),
            mode: AtomicU32::new(0),
            eof: AtomicBool::new(false),
        })
    }

    /// The accepting side takes the offer, if there is one and `enabled` (`None`: TCP; an
    /// offer not taken is answered REFUSED).
    pub fn accept(gid: u128, secret: u128, fd: i32, enabled: bool) -> Option<ShmLink> {
        let tag = tag_of(gid, secret);
        let path = std::ffi::CString::new(format!("/dev/shm/vmi-{tag}")).ok()?;
        // SAFETY: opening a path.
        let f = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW) };
        if f < 0 {
            return None;
        }
        // SAFETY: the offer is ours now; nobody else may open it.
        unsafe { libc::unlink(path.as_ptr()) };
        // SAFETY: zeroed stat is valid.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: our descriptor, valid pointer.
        let size_ok = unsafe { libc::fstat(f, &mut st) } == 0 && st.st_size as usize == REGION;
        let base = if size_ok { map(f) } else { None };
        let f = crate::fdtable::move_high(f);
        let refuse = |why: &str, base: Option<*mut u8>| {
            // SAFETY: our descriptor.
            unsafe { real::close(f) };
            log::warn(format_args!(
                "virtual connection {gid:032x}: shared memory refused ({why}); using TCP"
            ));
            if let Some(b) = base {
                // SAFETY: the header of a mapping we checked.
                unsafe { (*(b as *const Head)).state.store(REFUSED, Release) };
                let _ = bell(fd);
                // SAFETY: our mapping.
                unsafe { libc::munmap(b as *mut _, REGION) };
            }
            None
        };
        let Some(base) = base else { return refuse("the offer is not a region of the right size", None) };
        if !enabled {
            return refuse("VMI_SHM is not 1 here", Some(base));
        }
        // SAFETY: the first page of the mapping.
        if unsafe { (*(base as *const Head)).magic } != MAGIC {
            return refuse("the offer has no header", Some(base));
        }
        let Ok((tx, rx)) = rings(base, false) else { return refuse("the rings are not set up", Some(base)) };
        let Some(dgram) = dgram_bound(&format!("vmi-shm-{tag}-a")) else {
            return refuse("no rendezvous socket", Some(base));
        };
        if !send_fd(dgram, &format!("vmi-shm-{tag}-c"), fd) {
            // SAFETY: our socket.
            unsafe { real::close(dgram) };
            return refuse("the connecting layer's rendezvous socket is gone", Some(base));
        }
        // SAFETY: the first page of the mapping.
        unsafe { (*(base as *const Head)).state.store(ACCEPTED, Release) };
        let _ = bell(fd);
        Some(ShmLink {
            base,
            region: AtomicI32::new(f),
            tx,
            rx,
            active: false,
            tag,
            path: None,
            dgram: AtomicI32::new(dgram),
            peer_sock: AtomicI32::new(-1),
            mode: AtomicU32::new(1),
            eof: AtomicBool::new(false),
        })
    }

    /// The connecting side: the answer, if it came (`Ok(mode)`), taking the peer's socket
    /// and giving ours. `Err(WouldBlock)` while none came and `wait` is false.
    pub fn settle(&self, fd: i32, wait: bool) -> Result<Mode, IrbError> {
        loop {
            match self.mode() {
                Mode::Pending => {}
                m => return Ok(m),
            }
            match self.head().state.load(Acquire) {
                ACCEPTED if self.head().settled.swap(1, AcqRel) == 1 => {
                    // Another process sharing the connection (a fork) took the answer.
                    self.mode.store(1, Release);
                }
                ACCEPTED => {
                    self.take_bells(fd);
                    let d = self.dgram.swap(-1, AcqRel);
                    let theirs = if d >= 0 { recv_fd(d) } else { None };
                    let ok = theirs.is_some_and(|t| is_other_end(fd, t))
                        && send_fd(d, &format!("vmi-shm-{}-a", self.tag), fd);
                    if d >= 0 {
                        // SAFETY: our socket.
                        unsafe { real::close(d) };
                    }
                    if !ok {
                        if let Some(t) = theirs {
                            // SAFETY: a descriptor we were passed.
                            unsafe { real::close(t) };
                        }
                        log::error(format_args!("shared memory: the accepting side's socket did not come or is not the other end of ours"));
                        return Err(IrbError::Os(libc::ECONNRESET));
                    }
                    self.peer_sock.store(theirs.unwrap_or(-1), Release);
                    self.mode.store(1, Release);
                }
                REFUSED => {
                    self.take_bells(fd);
                    let d = self.dgram.swap(-1, AcqRel);
                    if d >= 0 {
                        // SAFETY: our socket.
                        unsafe { real::close(d) };
                    }
                    log::info(format_args!("shared memory refused by the accepting side: TCP"));
                    self.mode.store(2, Release);
                }
                _ if !wait => return Err(IrbError::WouldBlock),
                _ => {
                    sys::wait_fd(fd, libc::POLLIN, 200);
                }
            }
        }
    }

    /// Reads every bell waiting in our socket (a bell announced but still on its way is
    /// waited for, briefly: left behind, it would make the descriptor look readable with an
    /// empty ring); notes the peer's end.
    fn take_bells(&self, fd: i32) {
        let mut b = [0u8; 64];
        let mut got = 0;
        for round in 0..2 {
            loop {
                // SAFETY: reads into a local buffer.
                let r = unsafe { real::recv(fd, b.as_mut_ptr() as *mut _, b.len(), libc::MSG_DONTWAIT) };
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
            if got > 0 || round == 1 || !self.rx.bell_pending() || self.eof.load(Acquire) {
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
        let Some(t) = recv_fd(d) else { return -1 };
        if !is_other_end(fd, t) {
            // SAFETY: a descriptor we were passed and do not trust.
            unsafe { real::close(t) };
            return -1;
        }
        let t = crate::fdtable::move_high(t);
        if self.peer_sock.compare_exchange(-1, t, AcqRel, Acquire).is_err() {
            // SAFETY: another thread stored one first; ours is a spare.
            unsafe { real::close(t) };
        }
        if self.dgram.compare_exchange(d, -1, AcqRel, Acquire).is_ok() {
            // SAFETY: the exchange is done; our socket.
            unsafe { real::close(d) };
        }
        self.peer_sock.load(Acquire)
    }

    /// The program may wait on the descriptor now: it must look readable exactly when the
    /// ring holds bytes (or the end). Bytes left behind need a bell (rung through the peer's
    /// socket); an empty ring must leave no bell behind.
    fn leave(&self, fd: i32) {
        let mut ready = self.rx.before_sleep() == Ok(Sleep::Ready);
        if !ready && self.rx.bell_pending() {
            self.take_bells(fd);
            ready = self.rx.before_sleep() == Ok(Sleep::Ready);
        }
        if ready && self.rx.ensure_bell() == Bell::Ring {
            let p = self.peer_socket(fd);
            if p < 0 || !bell(p) {
                // No way to ring ourselves: take the bell back; the next call finds the bytes.
                self.rx.bell_taken();
            }
        }
    }

    /// Sends from `data`; the caller holds the tx lock.
    pub fn send(&self, fd: i32, data: &[u8], flags: i32) -> Result<usize, IrbError> {
        // Asked of the kernel only when the answer matters (a full ring).
        let mut nb = None;
        let mut nonblock =
            || *nb.get_or_insert_with(|| flags & libc::MSG_DONTWAIT != 0 || sys::nonblocking(fd));
        let mut sent = 0;
        loop {
            if self.tx.reader_gone() {
                return if sent > 0 { Ok(sent) } else { Err(IrbError::Os(libc::EPIPE)) };
            }
            let n = self.tx.write(&data[sent..]).map_err(|_| corrupt())?;
            sent += n;
            if n > 0 && self.tx.after_write() == Bell::Ring {
                bell(fd);
            }
            if sent == data.len() || (sent > 0 && nonblock()) {
                return Ok(sent);
            }
            if n > 0 {
                continue;
            }
            if nonblock() {
                return Err(IrbError::WouldBlock);
            }
            // Full: spin a little, then sleep until the consumer makes room.
            let until = sys::now_us() + crate::config::shm_spin_us();
            while self.tx.writable().map_err(|_| corrupt())? == 0 && sys::now_us() < until {
                std::hint::spin_loop();
            }
            if self.tx.writable().map_err(|_| corrupt())? == 0
                && self.tx.before_wait_room().map_err(|_| corrupt())? == Sleep::Ok
            {
                sys::futex_wait(self.tx.space_word(), 0, 200);
            }
            self.tx.space_bell_taken();
            self.tx.room_wait_over();
        }
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
        let r = loop {
            let n = match self.rx.read(&mut buf[got..], peek) {
                Ok(n) => n,
                Err(_) => break Err(corrupt()),
            };
            if n > 0 {
                got += n;
                if !peek && self.rx.after_read() == Bell::Ring {
                    sys::futex_wake(self.rx.space_word(), i32::MAX);
                }
                if !waitall || got == buf.len() {
                    break Ok(got);
                }
                spin_until = 0;
                continue;
            }
            if buf.is_empty() || self.rx.at_end().unwrap_or(true) || self.eof.load(Acquire) {
                break Ok(got);
            }
            if nonblock() {
                // Going back to the program, which will wait on the descriptor.
                if self.rx.before_sleep() == Ok(Sleep::Ready) {
                    continue;
                }
                if self.rx.bell_pending() {
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
            if self.rx.before_sleep() == Ok(Sleep::Ok) {
                sys::wait_fd(fd, libc::POLLIN, 200);
            }
            self.take_bells(fd);
            self.rx.awake();
            spin_until = 0;
        };
        self.leave(fd);
        r
    }

    /// Unread bytes (FIONREAD).
    pub fn readable(&self) -> usize {
        self.rx.readable().unwrap_or(0)
    }

    /// The program shut its sending side: the peer reads the end after the last byte.
    pub fn shut_send(&self, fd: i32) {
        self.tx.close();
        if self.tx.after_write() == Bell::Ring {
            bell(fd);
        }
    }

    /// The last descriptor closes: the end of stream for the peer, and no reader here.
    pub fn close(&self, fd: i32) {
        self.shut_send(fd);
        if self.rx.reader_leaves() == Bell::Ring {
            sys::futex_wake(self.rx.space_word(), i32::MAX);
        }
    }

    /// Before an `exec` that hands the connection over: the record of this link (`region
    /// descriptor:peer socket descriptor:side`), with those descriptors left open across the
    /// exec. The connecting side takes the answer first.
    pub fn handover(&self, fd: i32) -> Option<String> {
        if self.mode() == Mode::Tcp || self.settle(fd, true).ok()? != Mode::Shm {
            return None;
        }
        let p = self.peer_socket(fd);
        for d in [self.region.load(Acquire), p] {
            if d >= 0 {
                // SAFETY: clears close-on-exec on our own descriptor.
                unsafe { real::fcntl(d, libc::F_SETFD, 0) };
            }
        }
        Some(format!("{}:{}:{}", self.region.load(Acquire), p, u8::from(self.active)))
    }

    /// The exec did not happen: the descriptors close on the next one again.
    pub fn handover_undone(&self) {
        for d in [self.region.load(Acquire), self.peer_sock.load(Acquire)] {
            if d >= 0 {
                // SAFETY: sets close-on-exec on our own descriptor.
                unsafe { real::fcntl(d, libc::F_SETFD, libc::FD_CLOEXEC as libc::c_ulong) };
            }
        }
    }

    /// In the new image: the link a handover record describes.
    pub fn adopt(rec: &str) -> Option<ShmLink> {
        let mut it = rec.split(':');
        let region: i32 = it.next()?.parse().ok()?;
        let peer: i32 = it.next()?.parse().ok()?;
        let active = it.next()? == "1";
        let base = map(region)?;
        // SAFETY: the first page of the mapping.
        if unsafe { (*(base as *const Head)).magic } != MAGIC {
            // SAFETY: our mapping.
            unsafe { libc::munmap(base as *mut _, REGION) };
            return None;
        }
        let Ok((tx, rx)) = rings(base, active) else {
            // SAFETY: our mapping.
            unsafe { libc::munmap(base as *mut _, REGION) };
            return None;
        };
        for d in [region, peer] {
            if d >= 0 {
                // SAFETY: our descriptors again, close-on-exec as before.
                unsafe { real::fcntl(d, libc::F_SETFD, libc::FD_CLOEXEC as libc::c_ulong) };
            }
        }
        Some(ShmLink {
            base,
            region: AtomicI32::new(region),
            tx,
            rx,
            active,
            tag: String::new(),
            path: None,
            dgram: AtomicI32::new(-1),
            peer_sock: AtomicI32::new(peer),
            mode: AtomicU32::new(1),
            eof: AtomicBool::new(false),
        })
    }

    /// From now on (the link is where it stays, inside its `Arc`), the program cannot close
    /// or replace the link's descriptors.
    pub fn protect(&self) {
        for slot in [&self.region, &self.peer_sock, &self.dgram] {
            crate::fdtable::protect_slot(slot);
        }
    }

    fn unprotect(&self) {
        for slot in [&self.region, &self.peer_sock, &self.dgram] {
            crate::fdtable::unprotect_slot(slot);
        }
    }

    /// Substrate code for statistics.
    pub fn code(&self) -> u32 {
        if self.mode() == Mode::Tcp {
            1
        } else {
            2
        }
    }

    /// True on the connecting side.
    pub fn active(&self) -> bool {
        self.active
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.unprotect();
        for fd in [self.dgram.swap(-1, AcqRel), self.peer_sock.swap(-1, AcqRel), self.region.swap(-1, AcqRel)]
        {
            if fd >= 0 {
                // SAFETY: our descriptors.
                unsafe { real::close(fd) };
            }
        }
        if let (Some(p), Mode::Pending) = (&self.path, self.mode()) {
            // SAFETY: the offer nobody took.
            unsafe { libc::unlink(p.as_ptr()) };
        }
        // SAFETY: unmaps our mapping.
        unsafe { libc::munmap(self.base as *mut _, REGION) };
    }
}

/// The sink device of a connection that offered or took shared memory: the rings, or TCP
/// frames when the other side refused.
pub struct ShmSink {
    link: Arc<ShmLink>,
    tcp: TcpSink,
    slot: Option<Slot>,
}

impl ShmSink {
    /// The device over `link`, falling back to `tcp`.
    pub fn new(link: Arc<ShmLink>, tcp: TcpSink, slot: Option<Slot>) -> Self {
        ShmSink { link, tcp, slot }
    }
}

impl Device for ShmSink {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn dispatch<'a>(&mut self, mut irb: Irb<'a>, cx: &mut Dispatch<'_>) -> Disposition<'a> {
        let fd = irb.handle as i32;
        let flags = irb.flags;
        if !matches!(irb.kind(), IrbKind::Send | IrbKind::Receive) {
            return self.tcp.dispatch(irb, cx);
        }
        let mode = match self.link.mode() {
            Mode::Pending => {
                let nonblock = flags & libc::MSG_DONTWAIT != 0 || sys::nonblocking(fd);
                match self.link.settle(fd, !nonblock) {
                    Ok(m) => m,
                    Err(e) => return irb.complete(Err(e)),
                }
            }
            m => m,
        };
        if mode == Mode::Tcp {
            if let Some(s) = self.slot {
                s.set_substrate(1);
            }
            return self.tcp.dispatch(irb, cx);
        }
        let r = match (irb.kind(), &mut irb.buf) {
            (IrbKind::Send, Buf::Out(d)) => self.link.send(fd, d, flags),
            (IrbKind::Receive, Buf::In(b)) => self.link.recv(fd, b, flags),
            _ => return Disposition::Forward(irb),
        };
        irb.complete(r)
    }
}

fn corrupt() -> IrbError {
    log::error(format_args!(
        "shared memory: the ring's positions are impossible (a confused or hostile peer); resetting"
    ));
    IrbError::Os(libc::ECONNRESET)
}

/// One bell byte into socket `s` (it arrives at the other end).
fn bell(s: i32) -> bool {
    // SAFETY: writes one byte from a local.
    unsafe { real::send(s, b"b".as_ptr() as *const _, 1, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) == 1 }
}

/// Whether this node is where the peer's agent is (its addresses are this node's agent's).
pub fn same_node(peer_agents: &[std::net::SocketAddr]) -> bool {
    let own = crate::agent::own_addrs();
    !own.is_empty() && peer_agents.iter().any(|a| own.contains(a))
}
