//! Setting shared memory up between the two layers of a connection: the offer in
//! `/dev/shm`, its answer, the exchange of sockets through abstract datagram sockets, and
//! the hand-over of a link across `exec`.

use super::*;

/// The name of an offer: connection `gid`, and `nonce` (0 at set-up; a rebuilt link's
/// dialer nonce later), hashed with the secret so that nobody else can name it.
pub(super) fn tag_of(gid: u128, secret: u128, nonce: u128) -> String {
    let mut b = Vec::with_capacity(56);
    b.extend_from_slice(b"vmi-shm");
    b.extend_from_slice(&secret.to_le_bytes());
    b.extend_from_slice(&gid.to_le_bytes());
    b.extend_from_slice(&nonce.to_le_bytes());
    let h = substrate::auth::sha256(&b);
    h[..12].iter().map(|x| format!("{x:02x}")).collect()
}

pub(super) fn dgram_bound(name: &str) -> Option<i32> {
    let s = sys::fd::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0);
    if s < 0 {
        return None;
    }
    if sys::fd::bind(s, &crate::agent::abstract_addr(name)) != 0 {
        crate::sys::fd::close(s);
        return None;
    }
    Some(crate::ownfd::move_high(s))
}

/// Sends descriptor `fd` to the abstract datagram socket `to`.
pub(super) fn send_fd(s: i32, to: &str, fd: i32) -> bool {
    send_fd_to(s, to, fd).is_ok()
}

/// [`send_fd`], with the error number when the socket could not go.
pub(super) fn send_fd_to(s: i32, to: &str, fd: i32) -> Result<(), i32> {
    let to = crate::agent::abstract_addr(to);
    if sys::fd::send_with_fd(s, b"s", fd, Some(&to), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) == 1 {
        Ok(())
    } else {
        Err(sys::errno())
    }
}

/// A descriptor waiting on datagram socket `s`, if any.
pub(super) fn recv_fd(s: i32) -> Option<i32> {
    sys::recv_with_fd(s, &mut [0u8; 1], libc::MSG_DONTWAIT).1
}

/// True when the kernel's socket `fd` has ended (a reset, an error, or the peer's FIN): a
/// look with no wait, made while a shared-memory offer waits for its answer.
fn socket_ended(fd: i32) -> bool {
    sys::wait_fd(fd, libc::POLLRDHUP, 0) & (libc::POLLERR | libc::POLLHUP | libc::POLLRDHUP) != 0
}

/// True when `theirs` is the other end of our socket `ours` (same addresses, swapped).
pub(super) fn is_other_end(ours: i32, theirs: i32) -> bool {
    let (a, b) = (sys::local_addr(ours), sys::peer_addr(ours));
    a.is_some() && b.is_some() && sys::local_addr(theirs) == b && sys::peer_addr(theirs) == a
}

/// Bells must not wait: with Nagle's algorithm on, a one-byte bell written while another
/// is unacknowledged waits for the peer's (delayed) acknowledgement, up to 40 ms, and a
/// self-bell (written into the peer's socket to make our own readable) arrives after the
/// receive that looked for it gave up: the descriptor then polls readable over an empty ring
/// (OpenSSH's client and server take the `EAGAIN` that follows for a fatal error). A corked
/// socket holds a bell for 200 ms. The socket carries nothing but bells while the
/// connection is on shared memory, so the program's data never meets these settings: what
/// the program sets meanwhile is kept aside (`Vc::program_sets_tcp`) and reads back as set.
pub(crate) fn bells_undelayed(fd: i32) {
    if crate::sandbox::allows_nr(libc::SYS_setsockopt) {
        sys::set_sockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
        sys::set_sockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_CORK, 0);
    }
}

pub(super) fn map(fd: i32) -> Option<Arc<SharedMap>> {
    SharedMap::map_fd(fd, REGION, true).map(Arc::new)
}

/// The two rings of a region (made first when `fresh`): ours to write, then ours to read.
pub(super) fn rings(
    map: &Arc<SharedMap>,
    active: bool,
    fresh: bool,
) -> Result<(MappedRing, MappedRing), RingError> {
    let one = Ring::size(RING).next_multiple_of(PAGE);
    let to_acc = shared::ring(map, PAGE, Ring::size(RING), fresh)?;
    let to_conn = shared::ring(map, PAGE + one, Ring::size(RING), fresh)?;
    Ok(if active { (to_acc, to_conn) } else { (to_conn, to_acc) })
}

/// The region's header, written by its maker before the region is offered.
fn write_head(map: &SharedMap) {
    let h: &Head = map.atomics(0);
    h.state.store(OFFERED, Relaxed);
    h.settled.store(0, Relaxed);
    h.moving.store(0, Relaxed);
    h.creator.store(crate::pid(), Relaxed);
    map.u64(std::mem::offset_of!(Head, magic)).store(MAGIC, Release);
}

/// True when the region's header says it is one.
fn has_head(map: &SharedMap) -> bool {
    map.u64(std::mem::offset_of!(Head, magic)).load(Acquire) == MAGIC
}

/// How long a send waits for the answer to a shared-memory offer before it withdraws it.
pub const OFFER_WAIT_MS: u64 = 100;
/// The same for a non-blocking send, which waits in the call: it cannot say `EAGAIN`, since
/// the kernel socket under it stays writable and a program waiting for an edge of
/// writability (`EPOLLET`) would never be woken again. Short: a server that waits in
/// `accept` or in its event loop takes the offer within a millisecond, and one that accepts
/// later (MPI ranks, busy in their own start) only stalls the caller meanwhile: its
/// connection goes on TCP and moves onto shared memory `SHM_LATER_MS` later. (It was 50 ms,
/// a stall every MPICH rank made on one node, and as long as an event loop's whole turn.)
pub const OFFER_WAIT_NONBLOCKING_MS: u64 = 5;

impl ShmLink {
    /// The connecting side offers shared memory (before its SYN, or a rebuilt link's dialer
    /// before its proof): `None` when it cannot. `bases`: the stream offsets where the
    /// rings start (see the field of that name).
    pub fn offer(gid: u128, secret: u128, nonce: u128, bases: (u64, u64)) -> Option<ShmLink> {
        let tag = tag_of(gid, secret, nonce);
        let path = std::ffi::CString::new(format!("/dev/shm/vmi-{tag}")).ok()?;
        let fd =
            sys::fd::open_mode(&path, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o600);
        if fd < 0 {
            log::info(format_args!(
                "no shared memory for {gid:032x}: cannot create {path:?} ({})",
                sys::errno()
            ));
            return None;
        }
        let sized = sys::fd::ftruncate(fd, REGION as i64) == 0;
        let base = if sized { map(fd) } else { None };
        let Some(base) = base else {
            sys::fd::unlink(&path);
            sys::fd::close(fd);
            return None;
        };
        let fd = crate::ownfd::move_high(fd);
        let dgram = dgram_bound(&format!("vmi-shm-{tag}-c"));
        // (A fresh mapping of a file nobody else has opened yet.)
        let (Ok((tx, rx)), Some(dgram)) = (rings(&base, true, true), dgram) else {
            drop(base);
            sys::fd::unlink(&path);
            sys::fd::close(fd);
            return None;
        };
        write_head(&base);
        Some(ShmLink {
            map: base,
            region: std::sync::Arc::new(AtomicI32::new(fd)),
            tx,
            rx,
            active: true,
            tag,
            path: Some(path),
            offered_ms: sys::now_ms(),
            own_listener: false,
            dgram: std::sync::Arc::new(AtomicI32::new(dgram)),
            peer_sock: std::sync::Arc::new(AtomicI32::new(-1)),
            mode: AtomicU32::new(0),
            eof: AtomicBool::new(false),
            bases,
            epoch: AtomicU32::new(0),
            withdrew: AtomicBool::new(false),
            tries: AtomicU32::new(0),
        })
    }

    /// This offer goes to a listener of this process: a send made before its answer does not
    /// wait for it (the answer comes from this process's own `accept`, which may be the
    /// sending thread's next call: a wait would only stall it). Such a send withdraws the
    /// offer, and the connection moves onto shared memory later, as any withdrawn one does.
    pub fn to_own_listener(mut self) -> Self {
        self.own_listener = true;
        self
    }

    /// The accepting side takes the offer, if there is one and `enabled` (`None`: TCP; an
    /// offer not taken is answered REFUSED). `fd` is its socket of the link.
    pub fn accept(
        gid: u128,
        secret: u128,
        nonce: u128,
        fd: i32,
        enabled: bool,
        bases: (u64, u64),
    ) -> Option<ShmLink> {
        let tag = tag_of(gid, secret, nonce);
        let path = std::ffi::CString::new(format!("/dev/shm/vmi-{tag}")).ok()?;
        let f = sys::fd::open(&path, libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW);
        if f < 0 {
            return None;
        }
        // The offer is ours now; nobody else may open it.
        sys::fd::unlink(&path);
        let size_ok = sys::fd::fstat(f).is_some_and(|st| st.st_size as usize == REGION);
        let base = if size_ok { map(f) } else { None };
        let f = crate::ownfd::move_high(f);
        let refuse = |why: &str, base: Option<Arc<SharedMap>>| {
            crate::sys::fd::close(f);
            let mut withdrawn = false;
            if let Some(b) = base {
                let head: &Head = b.atomics(0);
                // A withdrawn offer needs no answer (and its rendezvous socket is gone).
                match head.state.compare_exchange(OFFERED, REFUSED, AcqRel, Acquire) {
                    Ok(_) => sys::futex_wake(&head.state, i32::MAX),
                    Err(st) => withdrawn = st == WITHDRAWN,
                }
            }
            if withdrawn {
                log::debug(format_args!(
                    "virtual connection {gid:032x}: the connecting side withdrew its shared-memory offer; using TCP"
                ));
            } else {
                log::warn(format_args!(
                    "virtual connection {gid:032x}: shared memory refused ({why}); using TCP"
                ));
            }
            None
        };
        let Some(base) = base else { return refuse("the offer is not a region of the right size", None) };
        if !enabled {
            return refuse("VMI_SHM is not 1 here", Some(base));
        }
        if !has_head(&base) {
            return refuse("the offer has no header", Some(base));
        }
        let Ok((tx, rx)) = rings(&base, false, false) else {
            return refuse("the rings are not set up", Some(base));
        };
        let Some(dgram) = dgram_bound(&format!("vmi-shm-{tag}-a")) else {
            return refuse("no rendezvous socket", Some(base));
        };
        if !send_fd(dgram, &format!("vmi-shm-{tag}-c"), fd) {
            crate::sys::fd::close(dgram);
            return refuse("the connecting layer's rendezvous socket is gone", Some(base));
        }
        let head: &Head = base.atomics(0);
        if head.state.compare_exchange(OFFERED, ACCEPTED, AcqRel, Acquire).is_err() {
            // The connecting program sent before ours accepted: the offer was withdrawn.
            sys::fd::close(dgram);
            sys::fd::close(f);
            log::debug(format_args!(
                "virtual connection {gid:032x}: the connecting side withdrew its shared-memory offer (it sent before this accept); using TCP"
            ));
            return None;
        }
        bells_undelayed(fd);
        // No bell: a byte on the socket would make the connecting program's descriptor
        // readable before any data (Open MPI then spins in a blocking read for data that
        // the other rank, doing the same, never sends). A layer waiting for the answer
        // sleeps on the state word.
        sys::futex_wake(&head.state, i32::MAX);
        Some(ShmLink {
            map: base,
            region: std::sync::Arc::new(AtomicI32::new(f)),
            tx,
            rx,
            active: false,
            tag,
            path: None,
            offered_ms: 0,
            own_listener: false,
            dgram: std::sync::Arc::new(AtomicI32::new(dgram)),
            peer_sock: std::sync::Arc::new(AtomicI32::new(-1)),
            mode: AtomicU32::new(1),
            eof: AtomicBool::new(false),
            bases,
            epoch: AtomicU32::new(0),
            withdrew: AtomicBool::new(false),
            tries: AtomicU32::new(0),
        })
    }

    /// The offer was withdrawn (WITHDRAWN): the rendezvous is over and nobody will take the
    /// file; the connection uses TCP.
    fn withdrawn(&self) {
        let d = self.dgram.swap(-1, AcqRel);
        if d >= 0 {
            crate::sys::fd::close(d);
        }
        if let Some(p) = &self.path {
            // The offer's file (ENOENT if the accepting side had opened it).
            sys::fd::unlink(p);
        }
        self.mode.store(2, Release);
        if self.active && !self.withdrew.swap(true, AcqRel) {
            linkstate::shm_later();
        }
    }

    /// True once the offer has its answer (or was withdrawn): `settle` then decides without
    /// waiting or asking the kernel.
    pub fn answered(&self) -> bool {
        self.head().state.load(Acquire) != OFFERED
    }

    /// The connecting side: the answer, if it came (`Ok(mode)`), taking the peer's socket
    /// and giving ours. `Err(WouldBlock)` while none came and `wait` is false. With
    /// `withdraw`: the caller is about to send; once `OFFER_WAIT_MS` passed since the offer
    /// without an answer, the offer is withdrawn and the connection uses TCP. A send that
    /// must not block waits too, at most `OFFER_WAIT_NONBLOCKING_MS` from the offer: an
    /// `EAGAIN` from a writable socket would never be followed by an edge of writability.
    pub fn settle(&self, fd: i32, wait: bool, withdraw: bool) -> Result<Mode, IrbError> {
        let (wait, limit) = match (wait, withdraw && self.offered_ms > 0) {
            (_, false) => (wait, OFFER_WAIT_MS),
            (_, true) if self.own_listener => (true, 0),
            (true, true) => (true, OFFER_WAIT_MS),
            (false, true) => (true, OFFER_WAIT_NONBLOCKING_MS),
        };
        let mut timeo: Option<Option<u64>> = None;
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
                    // (Refused: the accepting side's program closed the connection already,
                    // and its layer let go of the rendezvous; what it wrote, and the end, are
                    // in the ring. A server that accepts and closes at once must read as an
                    // end of stream here, as natively, not as a reset.)
                    let ok = theirs.is_some_and(|t| is_other_end(fd, t))
                        && match send_fd_to(d, &format!("vmi-shm-{}-a", self.tag), fd) {
                            Ok(()) => true,
                            Err(e) => e == libc::ECONNREFUSED,
                        };
                    if d >= 0 {
                        crate::sys::fd::close(d);
                    }
                    if !ok {
                        if let Some(t) = theirs {
                            crate::sys::fd::close(t);
                        }
                        log::error(format_args!("shared memory: the accepting side's socket did not come or is not the other end of ours"));
                        return Err(IrbError::Os(libc::ECONNRESET));
                    }
                    bells_undelayed(fd);
                    self.peer_sock.store(theirs.unwrap_or(-1), Release);
                    self.mode.store(1, Release);
                    // The accepting side may have written (and rung) already: its bell was
                    // taken with the rest above. Bytes in the ring need a bell again, or a
                    // program that waits on the descriptor (the caller here may be a send,
                    // or the control thread) is never woken for them.
                    self.announce(fd);
                }
                REFUSED => {
                    // (No bell comes with the answer: TCP frames follow at once.)
                    let d = self.dgram.swap(-1, AcqRel);
                    if d >= 0 {
                        crate::sys::fd::close(d);
                    }
                    log::info(format_args!("shared memory refused by the accepting side: TCP"));
                    self.mode.store(2, Release);
                }
                WITHDRAWN => {
                    // This process or another one sharing the connection withdrew it.
                    self.withdrawn();
                }
                _ if self.moving() => return Err(IrbError::LinkDown),
                _ if withdraw && self.offered_ms > 0 && sys::now_ms() >= self.offered_ms + limit => {
                    if self.head().state.compare_exchange(OFFERED, WITHDRAWN, AcqRel, Acquire).is_ok() {
                        log::info(format_args!(
                            "shared memory not used: the program sends and the peer's program has not accepted after {limit} ms (TCP takes the bytes, as natively)"
                        ));
                        self.withdrawn();
                    }
                }
                _ if !wait && withdraw => return Err(IrbError::WouldBlock),
                _ if socket_ended(fd) => {
                    // The connection ended before the accepting side answered (its process
                    // died with the connection in its listener's queue, or its listener
                    // closed): no answer will come. The kernel's socket has what there is
                    // to know (a reset, the end): the connection goes on TCP to read it.
                    if self.head().state.compare_exchange(OFFERED, WITHDRAWN, AcqRel, Acquire).is_ok() {
                        log::info(format_args!(
                            "shared memory not used: the connection ended before the peer's program accepted it"
                        ));
                        self.withdrawn();
                    }
                }
                _ if !wait => return Err(IrbError::WouldBlock),
                _ => {
                    let mut left = if withdraw && self.offered_ms > 0 {
                        (self.offered_ms + limit).saturating_sub(sys::now_ms()).clamp(1, 200)
                    } else {
                        200
                    };
                    // The program's time-out of the call that waits (a send's, a receive's),
                    // as the socket's: EAGAIN once it passed.
                    let opt = if withdraw { libc::SO_SNDTIMEO } else { libc::SO_RCVTIMEO };
                    if let Some(d) = *timeo.get_or_insert_with(|| sys::fd::timeo_deadline(fd, opt)) {
                        let now = sys::now_us();
                        if now >= d {
                            return Err(IrbError::WouldBlock);
                        }
                        left = left.min((d - now).div_ceil(1000).max(1));
                    }
                    sys::futex_wait(&self.head().state, OFFERED, left as i64);
                }
            }
        }
    }

    /// Before an `exec` that hands the connection over: the record of this link (`region
    /// descriptor:peer socket descriptor:side`), with those descriptors left open across the
    /// exec. The connecting side takes the answer first.
    pub fn handover(&self, fd: i32) -> Option<String> {
        if matches!(self.mode(), Mode::Tcp | Mode::Moved) || self.settle(fd, true, true).ok()? != Mode::Shm {
            return None;
        }
        let p = self.peer_socket(fd);
        for d in [self.region.load(Acquire), p] {
            if d >= 0 {
                // Clears close-on-exec on our own descriptor.
                sys::fd::fcntl(d, libc::F_SETFD, 0);
            }
        }
        Some(format!(
            "{}:{}:{}:{}:{}",
            self.region.load(Acquire),
            p,
            u8::from(self.active),
            self.bases.0,
            self.bases.1
        ))
    }

    /// The exec did not happen: the descriptors close on the next one again.
    pub fn handover_undone(&self) {
        for d in [self.region.load(Acquire), self.peer_sock.load(Acquire)] {
            if d >= 0 {
                // Sets close-on-exec on our own descriptor again.
                sys::fd::fcntl(d, libc::F_SETFD, libc::FD_CLOEXEC as libc::c_ulong);
            }
        }
    }

    /// In the new image: the link a handover record describes.
    pub fn adopt(rec: &str) -> Option<ShmLink> {
        let mut it = rec.split(':');
        let region: i32 = it.next()?.parse().ok()?;
        let peer: i32 = it.next()?.parse().ok()?;
        let active = it.next()? == "1";
        let bases = (it.next()?.parse().ok()?, it.next()?.parse().ok()?);
        let base = map(region)?;
        if !has_head(&base) {
            return None;
        }
        let Ok((tx, rx)) = rings(&base, active, false) else { return None };
        for d in [region, peer] {
            if d >= 0 {
                // Our descriptors again, close-on-exec as before.
                sys::fd::fcntl(d, libc::F_SETFD, libc::FD_CLOEXEC as libc::c_ulong);
            }
        }
        let link = ShmLink {
            map: base,
            region: std::sync::Arc::new(AtomicI32::new(region)),
            tx,
            rx,
            active,
            tag: String::new(),
            path: None,
            offered_ms: 0,
            own_listener: false,
            dgram: std::sync::Arc::new(AtomicI32::new(-1)),
            peer_sock: std::sync::Arc::new(AtomicI32::new(peer)),
            mode: AtomicU32::new(1),
            eof: AtomicBool::new(false),
            bases,
            epoch: AtomicU32::new(0),
            withdrew: AtomicBool::new(false),
            tries: AtomicU32::new(0),
        };
        // The old image may have left the ring awake (its waits looked at it themselves) or
        // its bells going to one of its epoll instances, which went with it: this image's
        // program may first wait on the descriptor, so the writer rings through the socket
        // from now on, and what the ring holds gets a bell.
        link.direct_bells(0);
        if link.rx.before_sleep() == Ok(Sleep::Ready)
            && link.rx.ensure_bell() == Bell::Ring
            && (peer < 0 || !bell(peer))
        {
            link.rx.bell_taken();
        }
        Some(link)
    }
}
