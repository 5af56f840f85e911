//! The kernel-TCP sink: the bottom device of a virtual connection's chains. It frames the
//! application's bytes onto the connection's own socket (the descriptor the program holds)
//! and parses frames out of it straight into the program's buffers.
//!
//! Calls run in the program's thread (no progress thread): a send writes header and payload
//! with one system call (`send` of a stack copy for small frames, `sendmsg` otherwise), a
//! receive reads with one call laid out by [`RxState::plan_read`] (`read` into a stack buffer
//! for small reads, `readv` straight into the program's buffer otherwise). Acknowledgements ride on data; an ack goes alone only when
//! five eighths of the peer's window wait for one. A sender whose window is full first reads
//! ack frames waiting at the head of its socket; if data from the peer stands in front of
//! them, it uses the spare room of its ring instead of waiting for the program to read, so
//! the layer never deadlocks a program that native TCP would not.

use crate::readiness::Truth;
use crate::shm::ConnMem;
use crate::shm::{peek_rx, peek_tx};
use crate::stats::Slot;
use crate::sys::Errno;
use crate::{linkstate, log, sandbox, sys};
use libc::c_int;
use std::sync::atomic::Ordering::*;
use substrate::connection::chain::{self, Chain, CODED_MAX};
use substrate::irb::{Buf, Device, Dispatch, Disposition, Irb, IrbError, IrbKind};
use substrate::reliability::{
    lone_ack_due, ring_slices, ring_write, AppBytes, Blocked, OfferError, Plan, ProtoError, ReadPlan,
    RxState, Source, TxState, ANSWER, MIRROR,
};
use substrate::wire::frame::{FrameKind, HEADER_LEN, MAX_PAYLOAD};

/// The kernel-TCP sink device.
pub struct TcpSink {
    mem: ConnMem,
    slot: Option<Slot>,
    /// The last read from the link was small: read the next one into one buffer.
    small_reads: bool,
}

impl TcpSink {
    /// A sink over the connection whose shared memory is `mem`.
    pub fn new(mem: ConnMem, slot: Option<Slot>) -> Self {
        TcpSink { mem, slot, small_reads: true }
    }

    /// The connection's shared memory.
    pub fn mem(&self) -> ConnMem {
        self.mem
    }
}

impl Device for TcpSink {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn dispatch<'a>(&mut self, mut irb: Irb<'a>, _cx: &mut Dispatch<'_>) -> Disposition<'a> {
        let fd = irb.handle as c_int;
        let flags = irb.flags;
        let gen = call_gen(&irb);
        let r = match (irb.kind(), &mut irb.buf) {
            (IrbKind::Send, Buf::Out(d)) => send(self.mem, self.slot, fd, &d[..], flags, gen),
            (IrbKind::Receive, Buf::In(b)) => {
                recv(self.mem, self.slot, fd, b, flags, &mut self.small_reads, gen)
            }
            (IrbKind::Disconnect, _) => disconnect(self.mem, self.slot, fd, flags),
            (ACK, _) => {
                control_held(self.mem, self.slot, fd, FrameKind::Ack);
                Ok(0)
            }
            (REPLAY, _) => Ok(usize::from(replay_now(self.mem, self.slot, fd))),
            (CHAIN, Buf::Out(spec)) => offer(self.mem, self.slot, spec, flags & BOTH_WAYS != 0),
            (IrbKind::Attach | IrbKind::Detach, _) => Ok(0),
            _ => return Disposition::Forward(irb),
        };
        irb.complete(r)
    }
}

/// The link generation a program's call runs on, as `Vc::with_link` put it in the IRB.
pub fn call_gen(irb: &Irb<'_>) -> Option<u32> {
    irb.ctx.checked_sub(1).map(|g| g as u32)
}

fn errno_result(e: c_int) -> IrbError {
    if e == libc::EAGAIN {
        IrbError::WouldBlock
    } else {
        IrbError::Os(e)
    }
}

/// Closes the connection after a protocol violation: a clear log line, `ECONNRESET` for the
/// program from now on, and a shutdown so the peer sees the end too.
fn fail(mem: ConnMem, slot: Option<Slot>, fd: c_int, e: ProtoError) -> IrbError {
    let c = mem.conn();
    if e == ProtoError::PeerAborted {
        // The peer's program reset the connection: the end of it, as native TCP shows it
        // (reported by this call; later ones find the end, see `broken_now`).
        if c.broken.swap(libc::ECONNRESET, AcqRel) == 0 {
            c.peer_reset.store(2, Release);
            if let Some(s) = slot {
                s.set_error(libc::ECONNRESET);
            }
        }
        return IrbError::Os(libc::ECONNRESET);
    }
    if c.broken.swap(libc::ECONNRESET, AcqRel) == 0 {
        let peer = if sandbox::allows_nr(libc::SYS_getpeername) { sys::peer_addr(fd) } else { None };
        let peer = peer.map(|a| a.to_string()).unwrap_or_else(|| "?".into());
        log::error(format_args!(
            "virtual connection {:032x} with {peer}: {e}; closing it (the program sees ECONNRESET)",
            c.gid
        ));
        if let Some(s) = slot {
            s.set_error(libc::ECONNRESET);
        }
        if sandbox::allows_nr(libc::SYS_shutdown) {
            crate::sys::fd::shutdown(fd, libc::SHUT_RDWR);
        }
    }
    IrbError::Os(libc::ECONNRESET)
}

fn publish_tx(mem: ConnMem, tx: &TxState, slot: Option<Slot>) {
    let c = mem.conn();
    c.ack_sent.store(tx.ack_sent, Release);
    c.unacked.store(tx.unacked(), Relaxed);
    if let Some(s) = slot {
        s.set_unacked(tx.unacked());
    }
}

/// Publishes what the receive half learned; refuses an ack for bytes that were never on the
/// wire.
#[inline]
fn publish_rx(mem: ConnMem, slot: Option<Slot>, rx: &mut RxState) -> Result<(), ProtoError> {
    let c = mem.conn();
    c.delivered.store(rx.delivered, Release);
    if (rx.answer_in | rx.answer_owed | rx.careful) != 0 || c.careful.load(Relaxed) != 0 {
        publish_chain(mem, slot, rx);
    }
    let hi = c.wire_hi.load(Acquire);
    if rx.peer_ack > hi {
        return Err(ProtoError::AckBeyondSent { ack: rx.peer_ack, sent: hi });
    }
    // Only the receive half (under its lock) writes it.
    if rx.peer_ack > c.peer_ack.load(Relaxed) {
        c.peer_ack.store(rx.peer_ack, Release);
    }
    Ok(())
}

/// The chain business a read may have brought: the peer's answer to our offer, the answer
/// we owe to its offer, and whether it may code its frames.
#[cold]
#[inline(never)]
fn publish_chain(mem: ConnMem, slot: Option<Slot>, rx: &mut RxState) {
    let c = mem.conn();
    if rx.answer_in != 0 {
        c.set_share(crate::shm::SHARE_IN, &rx.share_in);
        c.chain_answer.store(std::mem::take(&mut rx.answer_in), Release);
    }
    if let Some((no, taken, both)) = rx.take_answer_owed() {
        // Whether our acknowledgements alone carry a tag from now on, set before the answer
        // can go: every acknowledgement after it has one while the peer's stream is sealed.
        c.ack_tags.store(rx.tags_acks() as u32, Release);
        c.set_share(crate::shm::SHARE_OWED, &rx.answer_share);
        let mirror = match rx.chain_ids(no as u32).filter(|_| taken && both) {
            Some(ids) => {
                c.mirror_ids.store(ids, Release);
                MIRROR
            }
            None => 0,
        };
        c.answer_owed.store(ANSWER | mirror | u32::from(taken) << 8 | no as u32, Release);
        log_offer(mem, rx, no, taken);
        if let (Some(s), Some(ids)) = (slot, rx.chain_ids(no as u32).filter(|_| taken)) {
            s.set_chain(ids, false);
        }
    }
    if c.careful.load(Relaxed) != rx.careful {
        c.careful.store(rx.careful, Release);
    }
}

/// The peer's FIN arrived.
fn note_peer_eof(mem: ConnMem) {
    if mem.conn().peer_eof.swap(1, AcqRel) == 0 {
        log::debug(format_args!("virtual connection {:032x}: the peer closed the link", mem.conn().gid));
    }
}

/// Frames up to this many payload bytes go to the kernel as one contiguous buffer through
/// `send`: a copy onto the stack costs less than the kernel's two-segment `sendmsg` path
/// (measured here: 830-930 ns against 1,060-1,100 ns per 64 B call, 1,180-1,290 against
/// 1,370-1,540 ns at 1 KiB).
const FLAT_SEND: usize = 4096;

/// No bytes of the program's (replays, control frames).
const NO_APP: &[u8] = &[];

/// Writes what `plan` says, with one system call. Returns the kernel's answer.
#[inline]
fn write_plan<'a>(fd: c_int, plan: &Plan, app: impl AppBytes<'a>, ring: &[u8], flags: c_int) -> isize {
    if plan.source == Source::App && app.parts().len() > 1 {
        return write_after(fd, &[], plan, app, ring, &[], flags);
    }
    // Never a SIGPIPE from the physical socket: a failed link is not the program's business
    // (the layer raises SIGPIPE itself when the program's connection really ended).
    let flags = flags | libc::MSG_NOSIGNAL;
    let (a, b) = match plan.source {
        Source::App => (app.parts().first().map_or(&[][..], |p| &p[..plan.payload.min(p.len())]), &[][..]),
        Source::Ring(seq) => ring_slices(ring, plan.ring_pos(seq), plan.payload),
        // (Coded frames, offers and answers with a key share go through `write_coded`.)
        Source::Coded { .. } | Source::Spec { .. } | Source::Share { .. } => (&[][..], &[][..]),
    };
    let parts = [plan.header_bytes(), a, b];
    if sandbox::active() {
        return sandboxed_send(fd, &parts, flags);
    }
    let live = parts.iter().filter(|p| !p.is_empty()).count();
    if live <= 1 {
        let one = parts.iter().find(|p| !p.is_empty()).copied().unwrap_or_default();
        return sys::fd::send(fd, one, flags);
    }
    if plan.payload <= FLAT_SEND {
        // A header, and a payload of at most FLAT_SEND in one or two pieces.
        return sys::fd::send_flat::<{ FLAT_SEND + HEADER_LEN }>(fd, &parts, flags);
    }
    let mut live_parts = [&[][..]; 3];
    for (v, p) in live_parts.iter_mut().zip(parts.iter().filter(|p| !p.is_empty())) {
        *v = p;
    }
    sys::fd::send_parts(fd, &live_parts[..live], flags)
}

/// Most parts of one frame's write: an offer before it, its header, and its payload from
/// the program's buffers (or two pieces of the ring, or one coded buffer).
const WRITE_PARTS: usize = 2 + substrate::reliability::GATHER_PARTS;

/// The parts of one write, in order and none empty, and how many: `before` (a whole chain
/// offer, or nothing), the frame's header, and its payload (from `app`, the ring or `made`,
/// as the plan says).
fn frame_parts<'s, 'a: 's>(
    before: &'s [u8],
    plan: &'s Plan,
    app: impl AppBytes<'a>,
    ring: &'s [u8],
    made: &'s [u8],
) -> ([&'s [u8]; WRITE_PARTS], usize) {
    let mut out = [&[][..]; WRITE_PARTS];
    let mut n = 0;
    let mut put = |p: &'s [u8]| {
        if !p.is_empty() && n < WRITE_PARTS {
            out[n] = p;
            n += 1;
        }
    };
    put(before);
    put(plan.header_bytes());
    match plan.source {
        Source::App => {
            let app = app.take(plan.payload);
            app.parts().iter().for_each(|p| put(p))
        }
        Source::Ring(seq) => {
            let (a, b) = ring_slices(ring, plan.ring_pos(seq), plan.payload);
            put(a);
            put(b);
        }
        Source::Coded { skip, .. } | Source::Spec { skip, .. } | Source::Share { skip } => {
            let at = (skip as usize).min(made.len());
            put(&made[at..(at + plan.payload).min(made.len())]);
        }
    }
    (out, n)
}

/// [`write_plan`] for any plan: `made` is the whole payload of a coded frame or of an offer
/// (empty for the others: then it is `write_plan`).
#[inline]
fn write_coded<'a>(
    fd: c_int,
    plan: &Plan,
    app: impl AppBytes<'a>,
    ring: &[u8],
    made: &[u8],
    flags: c_int,
) -> isize {
    if made.is_empty() {
        return write_plan(fd, plan, app, ring, flags);
    }
    if crate::tamper::slipping() {
        crate::tamper::slip(fd);
    }
    write_after(fd, &[], plan, app, ring, made, flags)
}

/// [`write_coded`] with `before` (a whole chain offer) written first, by the same call; also
/// a new frame whose payload is gathered from several of the program's buffers.
#[inline(never)]
fn write_after<'a>(
    fd: c_int,
    before: &[u8],
    plan: &Plan,
    app: impl AppBytes<'a>,
    ring: &[u8],
    made: &[u8],
    flags: c_int,
) -> isize {
    // Never a SIGPIPE from the physical socket: a failed link is not the program's business
    // (the layer raises SIGPIPE itself when the program's connection really ended).
    let flags = flags | libc::MSG_NOSIGNAL;
    let (parts, live) = frame_parts(before, plan, app, ring, made);
    let parts = &parts[..live];
    if sandbox::active() {
        return sandboxed_send(fd, parts, flags);
    }
    if parts.iter().map(|p| p.len()).sum::<usize>() <= FLAT_SEND + HEADER_LEN {
        return sys::fd::send_flat::<{ FLAT_SEND + HEADER_LEN }>(fd, parts, flags);
    }
    sys::fd::send_parts(fd, parts, flags)
}

/// The highest stream offset put on the wire is now at least `hi`. Only the send half
/// (under its lock) writes it, before the bytes can reach the peer: a load and a store, no
/// read-modify-write.
#[inline]
fn raise_wire_hi(c: &crate::shm::SharedConn, hi: u64) {
    if hi > c.wire_hi.load(Relaxed) {
        c.wire_hi.store(hi, Release);
    }
}

/// A write that needs more than the new plain frame `plan` (a frame carries at most
/// `MAX_PAYLOAD` bytes: a 1 MiB message with the few bytes of a header the program writes
/// with it needs two): the next frame is planned with the first counted as written whole
/// (its payload copied into the ring), and both go with one call. Returns the kernel's
/// answer, and when it took all of the first frame, the program's bytes the two frames
/// carry and the bytes offered (both counted in `tx`); otherwise `tx` is as it was, and the
/// answer is the first frame's alone. Only a plain frame of the program's bytes goes so.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn send_two<'a>(
    c: &crate::shm::SharedConn,
    fd: c_int,
    tx: &mut TxState,
    plan: &Plan,
    made: &[u8],
    app: impl AppBytes<'a>,
    delivered: u64,
    ring: &mut [u8],
    flags: c_int,
) -> (isize, Option<(usize, usize)>) {
    if !made.is_empty() || plan.source != Source::App || plan.header_len != HEADER_LEN || sandbox::active() {
        return (write_coded(fd, plan, app, ring, made, flags), None);
    }
    let before = *tx;
    let first_app =
        tx.commit_gather(plan, plan.header_len + plan.payload, app, ring, crate::sys::copy::to_ring);
    let rest = app.skip(first_app);
    let second = match tx.plan_send(rest.len(), delivered, false) {
        Ok(p) if p.source == Source::App && p.header_len == HEADER_LEN && tx.frame_chain().is_none() => p,
        _ => {
            *tx = before;
            return (write_coded(fd, plan, app, ring, made, flags), None);
        }
    };
    raise_wire_hi(c, tx.next_seq + second.payload as u64);
    let r = write_two(fd, plan, app, &second, rest, flags);
    let first = plan.header_len + plan.payload;
    if r < first as isize {
        // Not even the first frame went whole: as if it had been written alone.
        *tx = before;
        return (r, None);
    }
    let more = tx.commit_gather(&second, r as usize - first, rest, ring, crate::sys::copy::to_ring);
    (r, Some((first_app + more, first + second.header_len + second.payload)))
}

/// Two new plain frames of the program's bytes, `first` then `second`, with one call.
#[inline(never)]
fn write_two<'a>(
    fd: c_int,
    first: &Plan,
    app: impl AppBytes<'a>,
    second: &Plan,
    app2: impl AppBytes<'a>,
    flags: c_int,
) -> isize {
    let flags = flags | libc::MSG_NOSIGNAL;
    let (a, n) = frame_parts(&[], first, app, &[], &[]);
    let (b, m) = frame_parts(&[], second, app2, &[], &[]);
    let mut parts = [&[][..]; 2 * WRITE_PARTS];
    parts[..n].copy_from_slice(&a[..n]);
    parts[n..n + m].copy_from_slice(&b[..m]);
    // (At most `sys::fd::MAX_PARTS` go: the kernel's count then covers a prefix of the two.)
    sys::fd::send_parts(fd, &parts[..n + m], flags)
}

/// A send under a sandbox: the first form of the call its filters allow. With none, a call
/// that must not block says `EAGAIN` (the control thread, free of the filter, does it later);
/// a blocking one fails with `EPERM` and a log line (the program's own call would have been
/// refused too).
#[cold]
fn sandboxed_send(fd: c_int, parts: &[&[u8]], flags: c_int) -> isize {
    if let Some(r) = sandbox::send_parts(fd, parts, flags) {
        return r;
    }
    if flags & libc::MSG_DONTWAIT != 0 {
        sys::set_errno(libc::EAGAIN);
    } else {
        log::warn(format_args!("the sandbox forbids every call that could carry a write on fd {fd}"));
        sys::set_errno(libc::EPERM);
    }
    -1
}

/// `recv` on the connection's socket, in a form the sandbox allows (`EAGAIN` when none).
fn sock_recv(fd: c_int, buf: &mut [u8], flags: c_int) -> isize {
    if !sandbox::active() {
        return sys::fd::recv(fd, buf, flags);
    }
    sandbox::recv_into(fd, buf, flags).unwrap_or_else(|| {
        sys::set_errno(libc::EAGAIN);
        -1
    })
}

/// An error from the physical socket: either the link failed (the connection waits for a
/// new one) or the connection really ended (the peer's program closed or reset it, or ours
/// shut its sending side): then the program sees `e`, with SIGPIPE for EPIPE unless it
/// asked for MSG_NOSIGNAL.
fn physical_error(mem: ConnMem, e: c_int, sending: bool, flags: c_int, gen: Option<u32>) -> IrbError {
    let c = mem.conn();
    if never_made(mem) {
        // The kernel's answer to a `connect` that did not complete (ECONNREFUSED said once
        // by `SO_ERROR`, EPIPE on every send after it): the program's, as natively.
        if e == libc::EPIPE && sending && flags & libc::MSG_NOSIGNAL == 0 {
            raise_sigpipe();
        }
        return errno_result(e);
    }
    let ended = c.peer_eof.load(Acquire) != 0 || (sending && c.tx_shut.load(Acquire) != 0);
    if !ended && (linkstate::is_link_error(e) || c.link_down.load(Acquire) != 0) {
        linkstate::link_broken_on(mem, &errno_name(e), gen);
        return IrbError::LinkDown;
    }
    if e == libc::EPIPE && sending && flags & libc::MSG_NOSIGNAL == 0 {
        raise_sigpipe();
    }
    errno_result(e)
}

/// True for a connection whose `connect` returned before its handshake completed (see
/// `SharedConn::unconfirmed`) and that has shown no sign of having been made since: no
/// byte of the peer's delivered, no acknowledgement of ours.
#[cold]
fn never_made(mem: ConnMem) -> bool {
    let c = mem.conn();
    c.unconfirmed.load(Acquire) != 0 && c.delivered.load(Acquire) == 0 && c.peer_ack.load(Acquire) == 0
}

/// SIGPIPE for the calling thread, as the kernel raises it for a write on a closed
/// connection (not where a sandbox forbids the calls `raise` makes).
pub(crate) fn raise_sigpipe() {
    if sandbox::allows_all(&[libc::SYS_tgkill, libc::SYS_rt_sigprocmask, libc::SYS_getpid, libc::SYS_gettid])
    {
        // In the calling thread, as the kernel would have.
        sys::process::raise(libc::SIGPIPE);
    }
}

fn read_error(mem: ConnMem, e: c_int, gen: Option<u32>) -> IrbError {
    if e == libc::EAGAIN || e == libc::EINTR {
        return errno_result(e);
    }
    physical_error(mem, e, false, 0, gen)
}

fn errno_name(e: c_int) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

/// After an ingest: if the peer's Fin frame just arrived, the socket must read as ended from
/// now on (and poll as readable), as after a FIN, while acks can still arrive on it.
#[inline]
fn fin_check(mem: ConnMem, fd: c_int, fin_before: u32, rx: &RxState) {
    if fin_before == 0 && rx.fin != 0 {
        if sandbox::allows_nr(libc::SYS_shutdown) {
            crate::sys::fd::shutdown(fd, libc::SHUT_RD);
        }
        // Acknowledge everything now: the peer, done sending, may be waiting for nothing
        // else before it lets go of the connection.
        send_control(mem, None, fd, FrameKind::Ack);
    }
}

/// Returns the link-down marker while the link is being rebuilt.
#[inline]
fn check_link(mem: ConnMem) -> Result<(), IrbError> {
    if mem.conn().link_down.load(Acquire) != 0 {
        return Err(IrbError::LinkDown);
    }
    Ok(())
}

/// True when the link a call started on (generation `gen`) is down or was replaced.
fn link_changed(mem: ConnMem, gen: Option<u32>) -> bool {
    let c = mem.conn();
    c.link_down.load(Acquire) != 0 || gen.is_some_and(|g| g != c.link_gen.load(Acquire))
}

/// Whether the program gave socket `fd` a receive time-out.
fn has_rcvtimeo(fd: c_int) -> bool {
    let mut buf = [0u8; 32];
    sys::fd::getsockopt_bytes(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &mut buf)
        .is_some_and(|n| buf[..n].iter().any(|&b| b != 0))
}

/// Pushes replayed bytes onto a rebuilt link without blocking. The caller holds the tx
/// lock. True when nothing remains to replay.
fn replay_now(mem: ConnMem, slot: Option<Slot>, fd: c_int) -> bool {
    let c = mem.conn();
    mem.with_tx_ring_held(|tx, ring| loop {
        if !tx.in_frame() && !tx.replaying() {
            chain_frames(mem, slot, fd, tx, ring);
        }
        // Replayed bytes first; then an end of stream still owed (a sealed stream's Fin
        // carries its tag).
        let (plan, fin) = match tx.plan_replay(c.delivered.load(Acquire)) {
            Some(p) => (p, false),
            None if c.fin_owed.load(Acquire) == 0 => return !tx.in_frame(),
            None => match tx.plan_control(FrameKind::Fin, c.delivered.load(Acquire)) {
                Some(p) => (p, true),
                None => return false,
            },
        };
        let (plan, made) = match make_payload(mem, tx, plan, NO_APP, ring) {
            Ok(p) => p,
            Err(e) => {
                let _ = fail(mem, slot, fd, e);
                return true;
            }
        };
        let r = write_coded(fd, &plan, NO_APP, ring, &made, libc::MSG_DONTWAIT);
        if r < 0 {
            let e = sys::errno();
            tx.commit(&plan, 0, &[], ring);
            if e != libc::EAGAIN && e != libc::EINTR {
                let _ = physical_error(mem, e, true, libc::MSG_NOSIGNAL, None);
                return true;
            }
            return false;
        }
        if fin && r > 0 {
            // Begun: the rest of it, if any, is the frame in progress.
            c.fin_owed.store(0, Release);
        }
        tx.commit(&plan, r as usize, &[], ring);
        publish_tx(mem, tx, slot);
        if (r as usize) < plan.header_len + plan.payload {
            return false;
        }
    })
}

/// An IRB asking the sink for an acknowledgement alone, of what the program read (the tx
/// lock held by the caller; nothing when a frame is half on the wire).
pub const ACK: IrbKind = IrbKind::Other(0x100);
/// An IRB asking the sink to push what a rebuilt link owes the peer (replay, end of stream)
/// without blocking; completes with 1 when nothing is left, 0 otherwise. The tx lock is held
/// by the caller.
pub const REPLAY: IrbKind = IrbKind::Other(0x101);

/// An IRB asking the sink to offer the peer a chain of filters for what this side sends
/// from now on: `Buf::Out` holds its description (filter names separated by commas, empty
/// for none). Completes with the chain's number once the offer is made; it goes with the
/// next data frame this side sends (the peer answers; a taken chain codes every frame from
/// the next new byte on). `EINVAL` for a description this build cannot make, `EBUSY` while
/// an earlier offer waits for its answer. The tx lock is held by the caller.
pub const CHAIN: IrbKind = IrbKind::Other(0x102);

/// `IrbKind::Disconnect` with this flag: the program resets the connection (an Abort frame,
/// only if a frame can start now); without it, the program ends its stream (a Fin frame).
pub const ABORT: i32 = 1;

/// A `Disconnect` IRB on the send chain, whose lock the caller holds.
fn disconnect(mem: ConnMem, slot: Option<Slot>, fd: c_int, flags: c_int) -> Result<usize, IrbError> {
    if flags & ABORT != 0 {
        control_held(mem, slot, fd, FrameKind::Abort);
        return Ok(0);
    }
    fin_held(mem, fd).map(|r| r as usize).map_err(|e| IrbError::Os(e.0))
}

/// The program shuts its sending side down: a Fin frame says so to the peer's layer (the
/// physical socket stays open both ways, so the peer can still acknowledge what we sent).
/// Returns the shutdown's result. The caller holds the tx lock.
fn fin_held(mem: ConnMem, fd: c_int) -> Result<c_int, Errno> {
    let c = mem.conn();
    if c.tx_shut.swap(1, AcqRel) != 0 {
        return Ok(0);
    }
    if c.link_down.load(Acquire) != 0 {
        c.fin_owed.store(1, Release);
        return Ok(0);
    }
    mem.with_tx_ring_held(|tx, ring| {
        if tx.replaying() {
            c.fin_owed.store(1, Release);
            linkstate::poke();
            return Ok(0);
        }
        let Some(mut plan) = tx.plan_control(FrameKind::Fin, c.delivered.load(Acquire)) else {
            // A frame is half on the wire (a write the kernel cut short): end it the plain way.
            return sys::cvt(sys::fd::shutdown(fd, libc::SHUT_WR));
        };
        loop {
            // (A sealed stream's Fin carries its tag.)
            let (part, made) =
                make_payload(mem, tx, plan, NO_APP, ring).map_err(|_| Errno(libc::ECONNRESET))?;
            let r = write_coded(fd, &part, NO_APP, ring, &made, 0);
            if r < 0 {
                let e = sys::errno();
                if e == libc::EAGAIN {
                    sys::wait_fd(fd, libc::POLLOUT, 100);
                    continue;
                }
                if e == libc::EINTR {
                    continue;
                }
                tx.commit(&part, 0, &[], ring);
                if linkstate::is_link_error(e) {
                    c.fin_owed.store(1, Release);
                    linkstate::link_broken(mem, &errno_name(e));
                    return Ok(0);
                }
                return Err(Errno(e));
            }
            tx.commit(&part, r as usize, &[], ring);
            // What the kernel did not take yet is the frame in progress.
            match tx.in_frame().then(|| tx.plan_replay(c.delivered.load(Acquire))).flatten() {
                Some(rest) => plan = rest,
                None => return Ok(0),
            }
        }
    })
}

/// Sends a control frame (ack, abort) acknowledging what was delivered, if a frame can start
/// now and no other thread is sending (never waits).
fn send_control(mem: ConnMem, slot: Option<Slot>, fd: c_int, kind: FrameKind) {
    let Some(_g) = mem.conn().tx_lock.try_lock() else { return };
    control_held(mem, slot, fd, kind);
}

/// As [`send_control`], the tx lock held by the caller.
fn control_held(mem: ConnMem, slot: Option<Slot>, fd: c_int, kind: FrameKind) {
    let c = mem.conn();
    mem.with_tx_ring_held(|tx, ring| {
        chain_frames(mem, slot, fd, tx, ring);
        if kind == FrameKind::ChainAnswer {
            return;
        }
        let delivered = c.delivered.load(Acquire);
        let plan = match kind {
            // (Tagged while the peer's stream is sealed: see `RxState::tags_acks`.)
            FrameKind::Ack => {
                tx.plan_ack(delivered, (c.ack_tags.load(Acquire) != 0).then_some(c.active != 0))
            }
            _ => tx.plan_control(kind, delivered),
        };
        let Some(plan) = plan else { return };
        if kind == FrameKind::Ack && crate::tamper::active() {
            crate::tamper::ack(mem, fd, tx.wire_seq, delivered);
        }
        let tag = tx.control_payload(plan.source);
        let r = write_coded(fd, &plan, NO_APP, ring, &tag, libc::MSG_DONTWAIT);
        tx.commit(&plan, r.max(0) as usize, &[], ring);
        if !tag.is_empty() {
            // (Only a tagged acknowledgement moves it; a relink's count is published there.)
            c.ack_tagged.store(tx.ack_tagged, Release);
        }
        if r > 0 && tx.in_frame() {
            // (The rest of its tag goes with our next frame, or from the control thread.)
            linkstate::owed_later();
        }
        if r == (plan.header_len + plan.payload) as isize && kind == FrameKind::Ack {
            offer_after_ack(fd, tx, ring, c.delivered.load(Acquire));
        }
        publish_tx(mem, tx, slot);
        if r > 0 && kind == FrameKind::Ack {
            quick_acks(fd);
        }
        if r < 0 && kind == FrameKind::Ack && sandbox::active() && sys::errno() == libc::EAGAIN {
            // The sandbox may have forbidden it: the control thread sends it.
            c.ctl_owed.fetch_or(crate::shm::CTL_ACK, AcqRel);
            linkstate::poke_work();
        }
    })
}

/// Our chain offer, waiting for a data frame to carry it, goes right after an
/// acknowledgement sent alone. Alone it would wake the peer's program with nothing to read,
/// so it waits for our program's next send; but an end that only receives sends nothing
/// else, and a device loaded there would never take effect. An ack alone already wakes the
/// peer's layer, which expects one (it has bytes of ours unacknowledged: see
/// `stray_frames_possible`) and takes the frames at the head of its socket for what they are,
/// the offer with the ack. The caller holds the tx lock; the ack went whole.
#[cold]
fn offer_after_ack(fd: c_int, tx: &mut TxState, ring: &mut [u8], delivered: u64) {
    if tx.offer_no == 0 || tx.in_frame() || tx.replaying() || tx.awaiting_resync() {
        return;
    }
    let Some(op) = tx.plan_offer(delivered) else { return };
    let payload = offer_payload(tx, &op);
    let r = write_coded(fd, &op, NO_APP, ring, &payload, libc::MSG_DONTWAIT);
    tx.commit(&op, r.max(0) as usize, &[], ring);
    if r > 0 && tx.in_frame() {
        // (The rest goes with our next send, or from the control thread.)
        linkstate::owed_later();
    }
}

/// The payload of our offer's frame `op` (planned by `TxState::plan_offer`), altered when a
/// tamper test asks for it.
fn offer_payload(tx: &TxState, op: &Plan) -> Vec<u8> {
    let mut payload = tx.control_payload(op.source);
    if crate::tamper::active() {
        crate::tamper::offer(&mut payload);
    }
    payload
}

/// After an acknowledgement sent alone. It is data going the other way, so the kernel takes the
/// connection for an interactive one ("pingpong" mode) and holds back its own ACKs of the
/// peer's segments, hoping to carry them on a reply that a bulk receiver never sends: the
/// peer's sender then waits on them (iperf3 with four streams in one thread: 18-22 Gbit/s so,
/// 29-36 without). `TCP_QUICKACK` takes the socket out of that mode again.
fn quick_acks(fd: c_int) {
    if sandbox::allows_nr(libc::SYS_setsockopt) {
        let one: c_int = 1;
        let _ = sys::fd::setsockopt_bytes(fd, libc::IPPROTO_TCP, libc::TCP_QUICKACK, &one.to_ne_bytes());
    }
}

/// Reads acknowledgements waiting on the socket for a sender that cannot read them itself
/// (the control thread, for a sandboxed program thread).
pub fn harvest_acks(mem: ConnMem, slot: Option<Slot>, fd: c_int) {
    let c = mem.conn();
    let before = c.peer_reset.load(Acquire);
    let _ = harvest(mem, slot, fd, None);
    if before == 0 {
        // (A reset found here reached no call of the program: its next call reports it.)
        let _ = c.peer_reset.compare_exchange(2, 1, AcqRel, Acquire);
    }
}

/// A broken connection's answer to a program's call: its error; or, once the peer's reset
/// was reported to a call (as a socket reports a RST once), `None`: the caller answers as
/// a socket after its reset does (the end of stream for a read, `EPIPE` for a write).
fn broken_now(c: &crate::shm::SharedConn, b: c_int) -> Option<IrbError> {
    if c.peer_reset.load(Acquire) != 0 && c.peer_reset.swap(2, AcqRel) == 2 {
        return None;
    }
    Some(IrbError::Os(b))
}

/// The send path. The caller holds the tx lock.
pub fn send<'a>(
    mem: ConnMem,
    slot: Option<Slot>,
    fd: c_int,
    data: impl AppBytes<'a>,
    flags: c_int,
    gen: Option<u32>,
) -> Result<usize, IrbError> {
    let c = mem.conn();
    let b = c.broken.load(Acquire);
    if b != 0 {
        return match broken_now(c, b) {
            Some(e) => Err(e),
            None => {
                if flags & libc::MSG_NOSIGNAL == 0 {
                    raise_sigpipe();
                }
                Err(IrbError::Os(libc::EPIPE))
            }
        };
    }
    if flags & libc::MSG_OOB != 0 {
        return Err(IrbError::Os(libc::EOPNOTSUPP));
    }
    check_link(mem)?;
    if c.tx_shut.load(Acquire) != 0 {
        // Native TCP after shutdown(SHUT_WR): EPIPE, with SIGPIPE unless MSG_NOSIGNAL.
        if flags & libc::MSG_NOSIGNAL == 0 {
            raise_sigpipe();
        }
        return Err(IrbError::Os(libc::EPIPE));
    }
    if data.is_empty() {
        return Ok(0);
    }
    mem.with_tx_ring_held(|tx, ring| {
        let kflags = flags & (libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | libc::MSG_MORE);
        let mut nonblock = (flags & libc::MSG_DONTWAIT != 0).then_some(true);
        // The program's send time-out, looked up when a wait for the window begins.
        let mut timeo: Option<Option<u64>> = None;
        let mut total = 0;
        // Whether this call's frames may go by reference (`VMI_SPLICE=auto`: a large
        // message, and the call began with every byte acknowledged).
        let mut idle = None;
        if data.len() <= FLAT_SEND {
            match send_plain(mem, slot, fd, data, kflags, gen, tx, ring) {
                Some(Ok(n)) if n == data.len() && !tx.in_frame() => return Ok(n),
                Some(Ok(n)) => {
                    // The kernel took part of the frame (its whole payload is in the ring) or
                    // the window only part of the message: as below.
                    total = n;
                    if tx.in_frame() && *nonblock.get_or_insert_with(|| sys::nonblocking(fd)) {
                        linkstate::owed_later();
                        return Ok(total);
                    }
                }
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        loop {
            if let Err(e) = tx.on_ack(c.peer_ack.load(Acquire)) {
                return Err(fail(mem, slot, fd, e));
            }
            let idle = *idle.get_or_insert(tx.acked == tx.next_seq && data.len() >= SPLICE_IDLE_MIN);
            if c.peer_eof.load(Acquire) != 0 {
                if c.spliced_hi.load(Relaxed) > tx.acked && tx.acked < tx.next_seq {
                    release_spliced(mem, tx, ring);
                }
                tx.peer_finished();
            }
            if let Err(e) = check_link(mem) {
                return if total > 0 { Ok(total) } else { Err(e) };
            }
            // (`mirror_owed`: a peer's both-ways chain waits for our offer's answer, or for
            // acknowledgements that free a chain number.)
            if (c.chain_answer.load(Relaxed)
                | c.answer_owed.load(Relaxed)
                | c.mirror_owed.load(Relaxed)
                | tx.offer_no)
                != 0
                && !tx.in_frame()
                && !tx.replaying()
            {
                chain_frames(mem, slot, fd, tx, ring);
            }
            if total == data.len() && !tx.in_frame() {
                return Ok(total);
            }
            let rest = data.skip(total);
            let delivered = c.delivered.load(Acquire);
            if tx.chain_cur != 0 && tx.offer_no == 0 && !tx.in_frame() {
                rekey_if_due(mem, slot, tx);
            }
            // Our chain offer, not on this link yet, goes in the same write as this data frame
            // (taken as written whole here; undone below if the kernel takes less of it).
            let mut offer_first = None;
            if tx.offer_no != 0 && !tx.in_frame() && !tx.replaying() && !tx.awaiting_resync() {
                let before = *tx;
                if let Some(op) = tx.plan_offer(delivered) {
                    let mut spec = op.header_bytes().to_vec();
                    spec.extend_from_slice(&offer_payload(tx, &op));
                    tx.commit(&op, op.header_len + op.payload, &[], ring);
                    offer_first = Some((before, op, spec));
                }
            }
            let planned = tx.plan_send(rest.len(), delivered, false);
            if planned.is_err() {
                // No data frame to carry our offer: it was not written, so it is not sent.
                if let Some((before, _, _)) = offer_first.take() {
                    *tx = before;
                }
            }
            let plan = match planned {
                Ok(p) => p,
                Err(Blocked::Window) => {
                    let h = harvest(mem, slot, fd, gen)?;
                    if h == Harvest::Opened {
                        continue;
                    }
                    let nb = *nonblock.get_or_insert_with(|| sys::nonblocking(fd));
                    // The ring's spare room is for acks stuck behind data the program has not read
                    // (waiting could deadlock it), and for non-blocking senders, which must not be
                    // told EAGAIN while the kernel would take the bytes (an edge-triggered poller
                    // would wait for a writability edge that never comes).
                    let spare = if h == Harvest::Stuck || nb {
                        tx.plan_send(rest.len(), delivered, true).ok()
                    } else {
                        None
                    };
                    match spare {
                        Some(p) => p,
                        None => {
                            if total > 0 {
                                return Ok(total);
                            }
                            if nb {
                                return Err(IrbError::WouldBlock);
                            }
                            // The program's send time-out (SO_SNDTIMEO), as the socket's:
                            // the window full that long is an EAGAIN.
                            let d =
                                *timeo.get_or_insert_with(|| sys::fd::timeo_deadline(fd, libc::SO_SNDTIMEO));
                            if d.is_some_and(|d| sys::now_us() >= d) {
                                return Err(IrbError::WouldBlock);
                            }
                            wait_for_acks(mem, fd);
                            continue;
                        }
                    }
                }
                Err(Blocked::Replaying) => {
                    // A rebuilt link: what the peer did not deliver goes first.
                    if let Some(p) = tx.plan_replay(delivered) {
                        let (p, made) =
                            make_payload(mem, tx, p, NO_APP, ring).map_err(|e| fail(mem, slot, fd, e))?;
                        let r = match splice_plan(mem, fd, &p, &made, NO_APP, tx, ring, kflags, false) {
                            Some(r) => r,
                            None => write_coded(fd, &p, NO_APP, ring, &made, kflags),
                        };
                        if r < 0 {
                            let e = sys::errno();
                            tx.commit(&p, 0, &[], ring);
                            if e == libc::EAGAIN {
                                // (On a blocking socket the kernel says EAGAIN once the
                                // program's send time-out passed: the program hears it, as
                                // from the socket, and the rest of the frame goes later.)
                                if *nonblock.get_or_insert_with(|| sys::nonblocking(fd))
                                    || sys::fd::timeo_deadline(fd, libc::SO_SNDTIMEO).is_some()
                                {
                                    linkstate::owed_later();
                                    return if total > 0 { Ok(total) } else { Err(IrbError::WouldBlock) };
                                }
                                sys::wait_fd(fd, libc::POLLOUT, 50);
                                continue;
                            }
                            let err = physical_error(mem, e, true, flags, gen);
                            return if total > 0 { Ok(total) } else { Err(err) };
                        }
                        tx.commit(&p, r as usize, &[], ring);
                        publish_tx(mem, tx, slot);
                    }
                    continue;
                }
                Err(_) => return if total > 0 { Ok(total) } else { Err(IrbError::WouldBlock) },
            };
            raise_wire_hi(c, tx.next_seq + plan.payload as u64);
            let (plan, made) = make_payload(mem, tx, plan, rest, ring).map_err(|e| fail(mem, slot, fd, e))?;
            let mut r;
            let mut spliced = false;
            // Two frames written by one call: the program's bytes both carry, and the bytes
            // offered to the kernel.
            let mut two = None;
            if let Some((before, op, spec)) = offer_first.take() {
                r = write_after(fd, &spec, &plan, rest, ring, &made, kflags);
                let off = op.header_len + op.payload;
                if r < off as isize {
                    // Not even the whole offer went: it alone is owed; the data frame was not
                    // sent at all.
                    *tx = before;
                    tx.commit(&op, r.max(0) as usize, &[], ring);
                    publish_tx(mem, tx, slot);
                    if r < 0 {
                        let e = sys::errno();
                        if e == libc::EAGAIN || e == libc::EINTR {
                            return if total > 0 { Ok(total) } else { Err(errno_result(e)) };
                        }
                        let err = physical_error(mem, e, true, flags, gen);
                        return if total > 0 { Ok(total) } else { Err(err) };
                    }
                    if *nonblock.get_or_insert_with(|| sys::nonblocking(fd)) {
                        linkstate::owed_later();
                        return if total > 0 { Ok(total) } else { Err(IrbError::WouldBlock) };
                    }
                    continue;
                }
                r -= off as isize;
            } else if let Some(n) = splice_plan(
                mem,
                fd,
                &plan,
                &made,
                rest,
                tx,
                ring,
                // (Another frame of this call follows: the kernel holds the last packet for it,
                // as one send of both frames would.)
                if plan.payload < rest.len() { kflags | libc::MSG_MORE } else { kflags },
                idle,
            ) {
                r = n;
                spliced = true;
            } else if plan.payload < rest.len() {
                // The write needs more than this frame: the next may go by the same call.
                (r, two) = send_two(c, fd, tx, &plan, &made, rest, delivered, ring, kflags);
            } else {
                r = write_coded(fd, &plan, rest, ring, &made, kflags);
            }
            if r < 0 {
                let e = sys::errno();
                tx.commit_gather(&plan, 0, rest, ring, |d, s| d.copy_from_slice(s));
                if e == libc::EAGAIN || e == libc::EINTR {
                    return if total > 0 { Ok(total) } else { Err(errno_result(e)) };
                }
                let err = physical_error(mem, e, true, flags, gen);
                return if total > 0 { Ok(total) } else { Err(err) };
            }
            total += if let Some((app, _)) = two {
                // (Both frames counted already.)
                app
            } else if spliced {
                // (The payload is in the ring already.)
                tx.commit_gather(&plan, r as usize, rest, ring, |_, _| {})
            } else {
                tx.commit_gather(&plan, r as usize, rest, ring, crate::sys::copy::to_ring)
            };
            publish_tx(mem, tx, slot);
            if tx.in_frame() {
                // The kernel took part of the frame; the rest is in the ring. A blocking sender
                // pushes it out now (below); a non-blocking one returns, and the control thread
                // pushes it if the program does not call again.
                if *nonblock.get_or_insert_with(|| sys::nonblocking(fd)) {
                    linkstate::owed_later();
                    return Ok(total);
                }
                continue;
            }
            if total == data.len() {
                return Ok(total);
            }
            if (r as usize) < two.map_or(plan.header_len + plan.payload, |(_, offered)| offered) && total > 0
            {
                // (A coded frame's payload counts coded bytes: any shortfall is one.)
                // The kernel took less than offered (signal, or a full non-blocking buffer).
                return Ok(total);
            }
        }
    })
}

/// The usual send of a small message, in a function of its own (its code together, not spread
/// through the general loop of [`send`], whose first turn it stands for): one plain data
/// frame, planned, written with one system call, committed. `None` when anything unusual is
/// going on (a chain or an offer, a frame owed, a replay, the peer's end, the window full, a
/// sandbox): nothing was done, and the general loop takes the call. Otherwise what the first
/// turn of that loop would have made of it: the payload bytes taken (the frame may be owed in
/// part, or carry only part of the message when the window is short), or the error.
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn send_plain<'a>(
    mem: ConnMem,
    slot: Option<Slot>,
    fd: c_int,
    data: impl AppBytes<'a>,
    kflags: c_int,
    gen: Option<u32>,
    tx: &mut TxState,
    ring: &mut [u8],
) -> Option<Result<usize, IrbError>> {
    let c = mem.conn();
    if (c.chain_answer.load(Relaxed)
        | c.answer_owed.load(Relaxed)
        | c.mirror_owed.load(Relaxed)
        | c.peer_eof.load(Acquire)
        | c.link_down.load(Acquire)
        | tx.offer_no
        | tx.chain_cur)
        != 0
        || tx.in_frame()
        || tx.replaying()
        || tx.awaiting_resync()
        || sandbox::active()
    {
        return None;
    }
    tx.on_ack(c.peer_ack.load(Acquire)).ok()?;
    let delivered = c.delivered.load(Acquire);
    let plan = tx.plan_send(data.len(), delivered, false).ok()?;
    raise_wire_hi(c, tx.next_seq + plan.payload as u64);
    let r = write_plan(fd, &plan, data, ring, kflags);
    if r < 0 {
        let e = sys::errno();
        tx.commit_gather(&plan, 0, data, ring, |d, s| d.copy_from_slice(s));
        if e == libc::EAGAIN || e == libc::EINTR {
            return Some(Err(errno_result(e)));
        }
        return Some(Err(physical_error(mem, e, true, kflags, gen)));
    }
    let n = tx.commit_gather(&plan, r as usize, data, ring, crate::sys::copy::to_ring);
    publish_tx(mem, tx, slot);
    Some(Ok(n))
}

/// Frames with at least this many payload bytes go to the kernel from the ring by reference
/// (`sys::splice`), not by copy.
const SPLICE_MIN: usize = 32 << 10;

/// With `VMI_SPLICE=auto`, the smallest send call whose frames go by reference (when it
/// begins with every byte acknowledged). Measured with NetPIPE's ping-pong between two
/// namespace hosts over veth (2026-11-28): by reference is 2-3 times slower than the copy
/// from 32 KiB to 384 KiB, and 1.2-1.4 times faster from 768 KiB on (1 MiB: 21.4 against
/// 17.2 Gbit/s, native 18.8), where a message no longer fits the socket's buffer.
const SPLICE_IDLE_MIN: usize = 512 << 10;

/// Sends a plain data frame's header and payload with the payload taken from the replay ring
/// by reference: the program's bytes (`app`, for a new frame) are copied into the ring first,
/// the only copy they get. `None` when the frame does not go that way (small, coded, the
/// peer's layer cannot acknowledge any more, a sandbox, no pipe free, or with
/// `VMI_SPLICE=auto` a call that is not `idle`: see [`SPLICE_IDLE_MIN`]): nothing was sent.
#[allow(clippy::too_many_arguments)]
#[inline]
fn splice_plan<'a>(
    mem: ConnMem,
    fd: c_int,
    plan: &Plan,
    made: &[u8],
    app: impl AppBytes<'a>,
    tx: &TxState,
    ring: &mut [u8],
    flags: c_int,
    idle: bool,
) -> Option<isize> {
    if plan.payload < SPLICE_MIN
        || !made.is_empty()
        || !sys::splice::available()
        || (!idle && sys::splice::only_when_idle())
    {
        return None;
    }
    splice_slow(mem, fd, plan, app, tx, ring, flags)
}

#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn splice_slow<'a>(
    mem: ConnMem,
    fd: c_int,
    plan: &Plan,
    app: impl AppBytes<'a>,
    tx: &TxState,
    ring: &mut [u8],
    flags: c_int,
) -> Option<isize> {
    let c = mem.conn();
    // After the peer's end of stream its layer acknowledges nothing, so the ring's space is
    // reused at once: its pages must not be lent to the kernel then.
    if c.peer_eof.load(Acquire) != 0 || sandbox::active() {
        return None;
    }
    // `splice` can only say "do not wait" through the socket's own flag.
    if flags & libc::MSG_DONTWAIT != 0 && !sys::nonblocking(fd) {
        return None;
    }
    let at = match plan.source {
        Source::App => tx.next_seq,
        Source::Ring(seq) => seq,
        _ => return None,
    };
    let pipe = sys::splice::take()?;
    if plan.source == Source::App {
        let mut seq = at;
        for p in app.take(plan.payload).parts() {
            ring_write(ring, tx.ring_pos(seq), p);
            seq += p.len() as u64;
        }
    }
    let hi = at + plan.payload as u64;
    if hi > c.spliced_hi.load(Relaxed) {
        c.spliced_hi.store(hi, Relaxed);
    }
    let (a, b) = ring_slices(ring, tx.ring_pos(at), plan.payload);
    sys::splice::send(&pipe, fd, plan.header_bytes(), [a, b], flags & libc::MSG_MORE != 0)
}

/// The peer's end of stream came while bytes spliced from the ring may still be in the
/// kernel's hands (its layer will not acknowledge them now): the ring gets new pages before
/// its space is reused, keeping the bytes not on the wire yet (the rest of a frame in
/// progress).
#[cold]
fn release_spliced(mem: ConnMem, tx: &TxState, ring: &mut [u8]) {
    let keep_len = (tx.next_seq - tx.wire_seq) as usize;
    let keep = {
        let (a, b) = ring_slices(ring, tx.ring_pos(tx.wire_seq), keep_len);
        [a, b].concat()
    };
    if !sys::splice::release_ring(ring) {
        log::warn(format_args!(
            "the replay ring's pages could not be replaced after the peer's end of stream; \
             bytes the kernel still holds by reference may change"
        ));
    }
    ring_write(ring, tx.ring_pos(tx.wire_seq), &keep);
    mem.conn().spliced_hi.store(0, Relaxed);
    log::info(format_args!(
        "virtual connection {:032x}: the peer's socket ended with {} spliced bytes unacknowledged; \
         the replay ring takes new pages",
        mem.conn().gid,
        tx.next_seq - tx.acked
    ));
}

/// What reading acks at the head of the socket gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Harvest {
    /// Acknowledgements opened the window.
    Opened,
    /// Nothing to read yet (or another thread is reading): acks are on their way.
    Empty,
    /// The peer's data stands in front of any acks; only the program's reads get past it.
    Stuck,
}

/// Reads ack frames waiting at the head of the socket (never payload). The caller holds the
/// tx lock.
fn harvest(mem: ConnMem, slot: Option<Slot>, fd: c_int, gen: Option<u32>) -> Result<Harvest, IrbError> {
    let c = mem.conn();
    let Some(_g) = c.rx_lock.try_lock() else { return Ok(Harvest::Empty) };
    c.with_rx_held(|rx| {
        coding_policy(rx);
        let before = c.peer_ack.load(Acquire);
        let mut may_block = true;
        while rx.frame_rem == 0 && rx.coded_len == 0 {
            let r = if sandbox::active() {
                harvest_read(fd, rx.header_slot(), &mut may_block)
            } else {
                sock_recv(fd, rx.header_slot(), libc::MSG_DONTWAIT)
            };
            if r == 0 {
                check_link(mem)?;
                if rx.fin != 0 {
                    // Our own SHUT_RD after the peer's Fin: nothing queued now.
                    break;
                }
                if socket_gone(fd) {
                    if never_made(mem) {
                        // (The send that follows meets the kernel's own error.)
                        return Ok(Harvest::Empty);
                    }
                    return Err(physical_error(mem, libc::ENOTCONN, false, 0, gen));
                }
                // The peer half-closed: no ack will come again.
                note_peer_eof(mem);
                return Ok(Harvest::Opened);
            }
            if r < 0 {
                break;
            }
            let fin_before = rx.fin;
            if let Err(e) =
                rx.ingest(rx.header_only_plan(), r as usize, &mut []).and_then(|_| publish_rx(mem, slot, rx))
            {
                return Err(fail(mem, slot, fd, e));
            }
            fin_check(mem, fd, fin_before, rx);
        }
        Ok(if c.peer_ack.load(Acquire) > before {
            Harvest::Opened
        } else if rx.frame_rem > 0 || rx.coded_len > 0 {
            Harvest::Stuck
        } else {
            Harvest::Empty
        })
    })
}

/// A sender with a full window reads a header off its socket under a sandbox: without
/// waiting where it may; else, when no control thread can do it, with the plain read its
/// program's call implies, which waits for the peer's next frame (an acknowledgement comes
/// before five eighths of a window are unacknowledged), as the program's write itself would
/// wait for room.
#[cold]
fn harvest_read(fd: c_int, slot: &mut [u8], may_block: &mut bool) -> isize {
    if let Some(r) = sandbox::recv_into(fd, slot, libc::MSG_DONTWAIT) {
        return r;
    }
    if std::mem::take(may_block) && !linkstate::control_running() {
        if let Some(r) = sandbox::recv_into(fd, slot, 0) {
            return r;
        }
    }
    sys::set_errno(libc::EAGAIN);
    -1
}

/// Blocks briefly for acknowledgements (blocking sockets with a full window).
fn wait_for_acks(mem: ConnMem, fd: c_int) {
    let c = mem.conn();
    if c.peer_eof.load(Acquire) != 0 {
        return;
    }
    // (Read racily, only to choose how to wait.)
    let (mid_frame, fin) = (mid_frame(c), peek_rx!(c, fin) != 0);
    if sandbox::active() {
        // The sender may not be allowed to read them itself: the control thread does.
        c.ctl_owed.fetch_or(crate::shm::CTL_HARVEST, AcqRel);
        linkstate::poke_work();
        sandbox::pause_us(500);
        return;
    }
    // (After the peer's Fin the socket always polls readable: sleep instead.)
    if c.rx_lock.try_lock().is_some() && !mid_frame && !fin {
        sys::wait_fd(fd, libc::POLLIN, 10);
    } else {
        std::thread::sleep(std::time::Duration::from_micros(500));
    }
}

/// Sends an ack alone if five eighths of the peer's window wait for one. The caller holds
/// the rx lock.
#[inline]
fn maybe_ack(mem: ConnMem, slot: Option<Slot>, fd: c_int, delivered: u64) {
    let c = mem.conn();
    let careful = c.careful.load(Relaxed);
    if (c.answer_owed.load(Relaxed) | careful) != 0 {
        answer_if_owed(mem, slot, fd);
        ensure_rcvbuf(mem, fd);
    }
    // (On a sealed stream of the peer's, it counts only the acknowledgements that carry a
    // tag: those are what it has. Such a stream is always read carefully, so a connection
    // with no chain reads nothing more.)
    let tagged = careful != 0 && c.ack_tags.load(Relaxed) != 0;
    let sent = if tagged { &c.ack_tagged } else { &c.ack_sent };
    if !lone_ack_due(delivered, sent.load(Acquire), c.peer_window) || peer_closed(fd) {
        return;
    }
    send_control(mem, slot, fd, FrameKind::Ack);
}

/// True once the peer's FIN arrived on the socket (whatever we shut down ourselves): the
/// peer's program closed, so it needs no acknowledgement, and one arriving after its process
/// ended would make its kernel reset the connection (and drop what we had not read yet).
fn peer_closed(fd: c_int) -> bool {
    if !sandbox::allows_nr(libc::SYS_getsockopt) {
        // (Cannot ask: the ack goes; the rare reset it may cause is a lost link, rebuilt.)
        return false;
    }
    // TIME_WAIT, CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING (or no socket to ask about).
    sys::tcp_info(fd).is_none_or(|ti| matches!(ti.tcpi_state, 6..=9 | 11))
}

/// An end of stream that no FIN explains: the socket is closed without the peer having
/// closed (a reset, or a socket restored closed after a checkpoint): the link is lost, the
/// stream did not end.
#[cold]
pub fn socket_gone(fd: c_int) -> bool {
    sandbox::allows_nr(libc::SYS_getsockopt) && sys::tcp_info(fd).is_some_and(|ti| ti.tcpi_state == 7)
}

/// True when the peer's Fin frame arrived (the socket polls readable from then on).
pub fn peer_fin(mem: ConnMem) -> bool {
    // (A racy read, only to choose how to wait.)
    peek_rx!(mem.conn(), fin) != 0
}

/// Reads of at most this many link bytes go through a buffer on the stack with one `read`
/// (then the payload is copied out) instead of a `readv` laid out by the plan: the kernel's
/// one-buffer path costs about 100-130 ns less per call here, more than the copy of a small
/// read.
const STAGE: usize = 4096 + HEADER_LEN;

/// Reads at most `want` (<= [`STAGE`]) link bytes into `stage` with one call.
fn read_staged(fd: c_int, stage: &mut sys::fd::Stage<'_, STAGE>, want: usize, flags: c_int) -> isize {
    debug_assert!(want <= STAGE);
    if sandbox::active() {
        return sock_recv(fd, stage.zeroed(want), flags);
    }
    stage.read(fd, want, flags)
}

/// Reads as `plan` says, with one recvmsg.
fn read_plan(fd: c_int, rx: &mut RxState, plan: ReadPlan, app: &mut [u8], flags: c_int) -> isize {
    let slot = rx.header_slot();
    let (first, after) = match plan {
        ReadPlan::HeaderFirst { app_max, .. } => (app_max, 0),
        ReadPlan::PayloadFirst { payload, rest, .. } => (payload, rest),
    };
    let (head, tail) = app.split_at_mut(first);
    let tail = &mut tail[..after];
    let mut parts: [&mut [u8]; 3] = match plan {
        ReadPlan::HeaderFirst { .. } => [slot, head, tail],
        ReadPlan::PayloadFirst { header: 0, .. } => [head, &mut [], &mut []],
        ReadPlan::PayloadFirst { .. } => [head, slot, tail],
    };
    let n = parts.iter().rposition(|p| !p.is_empty()).map_or(1, |i| i + 1);
    if flags == 0 {
        // readv: the cheaper path through the kernel for the common case.
        return sys::fd::read_parts(fd, &mut parts[..n]);
    }
    sys::fd::recv_parts(fd, &mut parts[..n], flags)
}

/// The receive path. The caller holds the rx lock. `small_reads` is the connection's hint
/// that reads are small: set while staged reads (see `STAGE`) come back at most half
/// full, so that a program reading messages into a large buffer takes the one-buffer path,
/// and one streaming bulk data the plan's `readv` straight into its buffer.
pub fn recv(
    mem: ConnMem,
    slot: Option<Slot>,
    fd: c_int,
    buf: &mut [u8],
    flags: c_int,
    small_reads: &mut bool,
    gen: Option<u32>,
) -> Result<usize, IrbError> {
    let c = mem.conn();
    let b = c.broken.load(Acquire);
    if b != 0 {
        return broken_now(c, b).map_or(Ok(0), Err);
    }
    if flags & (libc::MSG_OOB | libc::MSG_TRUNC) != 0 {
        return Err(IrbError::Os(libc::EOPNOTSUPP));
    }
    check_link(mem)?;
    if buf.is_empty() {
        return Ok(0);
    }
    c.with_rx_held(|rx| {
        coding_policy(rx);
        let kflags = flags & libc::MSG_DONTWAIT;
        if rx.fin != 0 && rx.frame_rem == 0 && sandbox::active() {
            // The peer's end of stream arrived, and the sandbox may have kept us from shutting
            // the socket's receive side: nothing more comes.
            return Ok(0);
        }
        if flags & libc::MSG_PEEK != 0 {
            return peek(mem, slot, rx, fd, buf, kflags, gen);
        }
        let waitall = flags & libc::MSG_WAITALL != 0;
        let mut total = 0;
        loop {
            let space = &mut buf[total..];
            if rx.coded_len > 0 && !take_stored(mem, slot, rx, fd)? {
                match recv_coded(mem, slot, rx, fd, space, kflags, false, gen) {
                    Ok(0) => return Ok(total),
                    Ok(n) => {
                        total += n;
                        if !waitall || total == buf.len() {
                            return Ok(total);
                        }
                        continue;
                    }
                    Err(e) => return if total > 0 { Ok(total) } else { Err(e) },
                }
            }
            let plan = rx.plan_read(space.len());
            let fin_before = rx.fin;
            // Every plan reads at most as many payload bytes as `space` holds, so a staged read
            // of `want <= plan.total()` link bytes never leaves payload behind in the layer.
            let want = plan.total();
            // (Under a sandbox: one plain read, the call the program's own read implies.)
            let staged = want <= STAGE || *small_reads || sandbox::active();
            let mut raw = std::mem::MaybeUninit::<[u8; STAGE]>::uninit();
            let mut stage = sys::fd::Stage::new(&mut raw);
            let r = if staged {
                read_staged(fd, &mut stage, want.min(STAGE), kflags)
            } else {
                read_plan(fd, rx, plan, space, kflags)
            };
            if r < 0 {
                let e = sys::errno();
                if total > 0 {
                    return Ok(total);
                }
                if e == libc::EAGAIN || e == libc::EINTR {
                    return Err(errno_result(e));
                }
                return Err(physical_error(mem, e, false, 0, gen));
            }
            if r == 0 {
                if c.link_down.load(Acquire) != 0 {
                    return if total > 0 { Ok(total) } else { Err(IrbError::LinkDown) };
                }
                if rx.fin != 0 {
                    return Ok(total);
                }
                if socket_gone(fd) {
                    if never_made(mem) {
                        // (A refused connect reads as the end of stream natively.)
                        return Ok(total);
                    }
                    let err = physical_error(mem, libc::ENOTCONN, false, 0, gen);
                    return if total > 0 { Ok(total) } else { Err(err) };
                }
                note_peer_eof(mem);
                return Ok(total);
            }
            *small_reads = 2 * r as usize <= STAGE;
            let ingested = if staged {
                let got = stage.filled(r as usize);
                match rx.take_plain_frame(got) {
                    // (One whole plain frame, the usual small message: its payload copied
                    // once, from where it lies.)
                    Some(n) => {
                        space[..n].copy_from_slice(&got[HEADER_LEN..]);
                        Ok(substrate::reliability::Ingested { payload: n, headers: 1 })
                    }
                    None => rx
                        .parse_buffer(got)
                        .inspect(|i| space[..i.payload].copy_from_slice(&got[..i.payload])),
                }
            } else {
                rx.ingest(plan, r as usize, space)
            };
            let got = match ingested.and_then(|i| publish_rx(mem, slot, rx).map(|_| i.payload)) {
                Ok(n) => n,
                Err(e) => {
                    let err = fail(mem, slot, fd, e);
                    return if total > 0 { Ok(total) } else { Err(err) };
                }
            };
            total += got;
            fin_check(mem, fd, fin_before, rx);
            maybe_ack(mem, slot, fd, rx.delivered);
            if rx.coded_len > 0 && total > 0 {
                // A coded frame is next: deliver what is here first.
                return Ok(total);
            }
            if total > 0 && (!waitall || total == buf.len()) {
                return Ok(total);
            }
        }
    })
}

fn peek(
    mem: ConnMem,
    slot: Option<Slot>,
    rx: &mut RxState,
    fd: c_int,
    buf: &mut [u8],
    kflags: c_int,
    gen: Option<u32>,
) -> Result<usize, IrbError> {
    loop {
        if rx.coded_len > 0 {
            return recv_coded(mem, slot, rx, fd, buf, kflags, true, gen);
        }
        if rx.frame_rem > 0 {
            // Peek past frame boundaries as native TCP does: look at the raw bytes, parse a
            // copy of the receive state, hand over the payload.
            let mut raw = vec![0u8; buf.len() + 16 * HEADER_LEN];
            let r = sock_recv(fd, &mut raw, libc::MSG_PEEK | kflags);
            if r < 0 {
                return Err(read_error(mem, sys::errno(), gen));
            }
            let mut copy = *rx;
            let n = match copy.parse_buffer(&mut raw[..r as usize]) {
                Ok(i) => i.payload,
                // Garbage further on is dealt with when it is really read (and a coded
                // frame is not peeked past); the current frame's payload is fine.
                Err(_) => (r as u64).min(rx.frame_rem) as usize,
            };
            let n = n.min(buf.len());
            buf[..n].copy_from_slice(&raw[..n]);
            return Ok(n);
        }
        // At a frame boundary: take headers (invisible to the program) until data starts.
        let r = sock_recv(fd, rx.header_slot(), kflags);
        if r < 0 {
            return Err(read_error(mem, sys::errno(), gen));
        }
        if r == 0 {
            if mem.conn().link_down.load(Acquire) != 0 {
                return Err(IrbError::LinkDown);
            }
            if rx.fin != 0 {
                return Ok(0);
            }
            note_peer_eof(mem);
            return Ok(0);
        }
        let fin_before = rx.fin;
        if let Err(e) =
            rx.ingest(rx.header_only_plan(), r as usize, &mut []).and_then(|_| publish_rx(mem, slot, rx))
        {
            return Err(fail(mem, slot, fd, e));
        }
        fin_check(mem, fd, fin_before, rx);
    }
}

/// True if payload the program never read waits on the socket (or is on its way, mid-frame):
/// closing now must reset the connection, as native TCP does.
pub fn unread_payload(mem: ConnMem, fd: c_int) -> bool {
    // (A racy read, only to choose how to close.)
    let mid_frame = mid_frame(mem.conn());
    // Once a read met the kernel's end of stream, the socket holds nothing and nothing can
    // follow the FIN: not asked again.
    mid_frame || (mem.conn().peer_eof.load(Acquire) == 0 && readable_bytes(mem, fd).unwrap_or(0) > 0)
}

/// What reading a closed connection's socket gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drained {
    /// Nothing more for now.
    Open,
    /// The peer closed too (or the socket failed): done.
    Finished,
    /// Data arrived for a program that closed: reset, as native TCP does.
    DataArrived,
}

/// Reads ack frames of a closed connection (the linger after close).
pub fn drain_closed(mem: ConnMem, fd: c_int) -> Drained {
    let c = mem.conn();
    let _g = c.rx_lock.lock();
    c.with_rx_held(|rx| {
        loop {
            if rx.frame_rem > 0 || rx.coded_len > 0 {
                return Drained::DataArrived;
            }
            let r = sock_recv(fd, rx.header_slot(), libc::MSG_DONTWAIT);
            if r == 0 {
                // After the peer's Fin frame our own SHUT_RD reads as an end too: the peer is
                // done when its FIN arrived, or when it acknowledged everything we sent (it has
                // nothing more to send: no frame will follow).
                if rx.fin != 0 && !peer_closed(fd) {
                    // (A racy read; the program closed the connection.)
                    let sent = peek_tx!(c, next_seq);
                    return if rx.peer_ack >= sent { Drained::Finished } else { Drained::Open };
                }
                return Drained::Finished;
            }
            if r < 0 {
                let e = sys::errno();
                return if e == libc::EAGAIN || e == libc::EINTR { Drained::Open } else { Drained::Finished };
            }
            if rx.ingest(rx.header_only_plan(), r as usize, &mut []).is_err() {
                return Drained::DataArrived;
            }
        }
    })
}

/// True when the receive half is inside a frame (a plain one's payload, or a coded one not
/// yet whole): two loads, not a copy of the state.
fn mid_frame(c: &crate::shm::SharedConn) -> bool {
    peek_rx!(c, frame_rem) > 0 || peek_rx!(c, coded_len) > 0
}

/// True when the receive half has begun a frame whose payload has not all come: part of a
/// header taken, or a data frame's header and not yet its payload. Bytes of the peer's
/// stream are then on their way (they left the peer in the same call as the header, or
/// follow at its layer's next send), while the socket may hold nothing more.
pub fn frame_begun(mem: ConnMem) -> bool {
    let c = mem.conn();
    mid_frame(c) || peek_rx!(c, header_len) > 0
}

/// True when the layer's own frames may be what makes the socket readable: a rebuilt link
/// since `checked_gen` (its first frame), our end of stream sent (the peer acknowledges it
/// alone), or enough of our stream unacknowledged that the peer may send an ack alone (it
/// does at five eighths of our window, and a layer before 2026-11-28 at a quarter; an
/// eighth leaves a margin). Otherwise acks ride on
/// data and every readable report is payload or the end.
#[inline]
pub fn stray_frames_possible(mem: ConnMem, checked_gen: u32) -> bool {
    let c = mem.conn();
    if c.link_gen.load(Relaxed) != checked_gen
        || c.tx_shut.load(Relaxed) != 0
        || c.careful.load(Relaxed) | c.offering.load(Relaxed) != 0
    {
        return true;
    }
    // (A racy read of a value that changes only at set-up and exec.)
    let window = peek_tx!(c, soft_window);
    c.wire_hi.load(Relaxed).saturating_sub(c.peer_ack.load(Relaxed)) >= window / 8
}

/// What a readable report of the connection's socket means: the layer's frames at its head
/// (acknowledgements, a rebuilt link's first frame) are taken, as the program's `recv` would
/// take them, and what is left says. The caller holds the rx lock.
pub fn truth(mem: ConnMem, slot: Option<Slot>, fd: c_int) -> Truth {
    let c = mem.conn();
    c.with_rx_held(|rx| {
        coding_policy(rx);
        let mut took = false;
        loop {
            if rx.coded_len > 0 {
                // Readable once the whole coded frame is there; until then the kernel is told
                // to wake waiters only then.
                return if sys::fd::fionread(fd).is_some_and(|n| n as u64 >= rx.coded_len as u64) {
                    Truth::Readable
                } else {
                    set_lowat(mem, fd, rx.coded_len as usize);
                    Truth::Spurious
                };
            }
            if rx.frame_rem > 0 {
                if !took {
                    // Mid-frame since an earlier call: what made it readable is payload.
                    return Truth::Readable;
                }
                // We took a data frame's header: is any of its payload here yet?
                let mut b = [0u8; 1];
                let r = sock_recv(fd, &mut b, libc::MSG_PEEK | libc::MSG_DONTWAIT);
                return if r < 0 && matches!(sys::errno(), libc::EAGAIN | libc::EINTR) {
                    Truth::Spurious
                } else {
                    Truth::Readable
                };
            }
            if rx.fin != 0 {
                return Truth::Readable;
            }
            // Looked at first, not taken: a data frame with payload stays where it is, for the
            // program's read to take whole (its header and payload in one call); a lone
            // acknowledgement with nothing behind it is taken, and then there is nothing to read.
            let mut lone_ack = false;
            if !took {
                let mut peek = [0u8; HEADER_LEN + 1];
                let r = sock_recv(fd, &mut peek, libc::MSG_PEEK | libc::MSG_DONTWAIT);
                if r > 0 && rx.data_ahead(&peek[..r as usize]) {
                    return Truth::Readable;
                }
                if r < 0 && matches!(sys::errno(), libc::EAGAIN | libc::EINTR) {
                    return Truth::Spurious;
                }
                lone_ack = r == HEADER_LEN as isize
                    && peek[1] == FrameKind::Ack as u8
                    && rx.header_len == 0
                    && rx.ctl_rem == 0;
            }
            let r = sock_recv(fd, rx.header_slot(), libc::MSG_DONTWAIT);
            if r < 0 {
                return if matches!(sys::errno(), libc::EAGAIN | libc::EINTR) {
                    Truth::Spurious
                } else {
                    Truth::Readable
                };
            }
            if r == 0 {
                return Truth::Readable;
            }
            took = true;
            let fin_before = rx.fin;
            if let Err(e) =
                rx.ingest(rx.header_only_plan(), r as usize, &mut []).and_then(|_| publish_rx(mem, slot, rx))
            {
                // The program's next call reports it.
                let _ = fail(mem, slot, fd, e);
                return Truth::Readable;
            }
            fin_check(mem, fd, fin_before, rx);
            answer_if_owed(mem, slot, fd);
            ensure_rcvbuf(mem, fd);
            if lone_ack && r == HEADER_LEN as isize {
                // (Bytes that came since wake the program's wait again.)
                return Truth::Spurious;
            }
        }
    })
}

/// Payload bytes readable without blocking (FIONREAD / SIOCINQ). The caller holds the rx lock.
pub fn readable_bytes(mem: ConnMem, fd: c_int) -> Result<i32, i32> {
    let Some(n) = sys::fd::fionread(fd) else { return Err(sys::errno()) };
    // A copy to work on (the caller holds the rx lock, or the program closed the
    // connection and no one reads it).
    let mut rx = mem.conn().peek_rx(|rx| *rx);
    if rx.coded_len > 0 {
        if (n.max(0) as u64) < rx.coded_len as u64 {
            return Ok(0);
        }
        let mut enc = vec![0u8; rx.coded_len as usize];
        let r = sock_recv(fd, &mut enc, libc::MSG_PEEK | libc::MSG_DONTWAIT);
        if r != enc.len() as isize {
            return Ok(0);
        }
        return Ok(
            decode_frame(&rx, enc).map_or(0, |d| d.len().saturating_sub(rx.coded_taken as usize) as i32)
        );
    }
    if n <= 0 || rx.frame_rem >= n as u64 {
        return Ok(n.max(0));
    }
    let mut tmp = vec![0u8; (n as usize).min(4 << 20)];
    let r = sock_recv(fd, &mut tmp, libc::MSG_PEEK | libc::MSG_DONTWAIT);
    if r <= 0 {
        return Ok(0);
    }
    Ok(rx.parse_buffer(&mut tmp[..r as usize]).map(|i| i.payload as i32).unwrap_or(0))
}

/// The chain of compact form `ids`, `None` for one this build cannot make (never for ids
/// that were agreed: both sides checked them).
fn chain_of(ids: u32) -> Option<Chain> {
    Chain::from_ids(ids)
}

/// A chain's key (zero for a chain with no keyed filter).
type Key = [u8; 32];

thread_local! {
    /// Chains this thread built, by compact form and key: a compressor's context and tables
    /// (and a cipher's key schedule) are made once per thread, not once per frame (a zstd
    /// context costs far more than a frame).
    static BUILT: std::cell::RefCell<Vec<(u32, Key, Chain)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The chain of compact form `ids` with `key`.
fn keyed_chain(ids: u32, key: &Key) -> Option<Chain> {
    let mut c = chain_of(ids)?;
    if c.keyed() {
        c.set_key(key);
    }
    Some(c)
}

/// Runs `f` with the chain of compact form `ids` and key `key`, built once per thread (or
/// afresh when this thread is already inside one, from a signal handler). `None` for an
/// unknown chain.
fn with_chain<R>(ids: u32, key: &Key, f: impl FnOnce(&mut Chain) -> R) -> Option<R> {
    const KEPT: usize = 4;
    let mut f = Some(f);
    let cached = BUILT
        .try_with(|b| {
            let mut b = b.try_borrow_mut().ok()?;
            let at = match b.iter().position(|(i, k, _)| *i == ids && k == key) {
                Some(at) => at,
                None => {
                    let c = keyed_chain(ids, key)?;
                    if b.len() >= KEPT {
                        b.remove(0);
                    }
                    b.push((ids, *key, c));
                    b.len() - 1
                }
            };
            Some((f.take()?)(&mut b[at].2))
        })
        .ok()
        .flatten();
    match (cached, f) {
        (Some(r), _) => Some(r),
        (None, Some(f)) => keyed_chain(ids, key).map(|mut c| f(&mut c)),
        (None, None) => None,
    }
}

/// The description of compact form `ids`, for log lines and `vmictl`.
pub fn chain_spec(ids: u32) -> String {
    chain::spec_of_ids(ids).unwrap_or_else(|| format!("?{ids:#x}"))
}

/// Codes the frame `plan` just planned when its chain says so, or makes the payload of a
/// coded frame or offer in progress again (from the ring). Returns the plan to write and
/// the payload it names (empty for plain frames).
#[inline]
fn make_payload<'a>(
    mem: ConnMem,
    tx: &mut TxState,
    plan: Plan,
    app: impl AppBytes<'a>,
    ring: &[u8],
) -> Result<(Plan, Scratch), ProtoError> {
    if tx.frame_chain().is_none() && matches!(plan.source, Source::App | Source::Ring(_)) {
        return Ok((plan, Scratch::default()));
    }
    match app.parts() {
        [] => make_coded(mem, tx, plan, &[], ring),
        [one] => make_coded(mem, tx, plan, one, ring),
        _ => {
            // (Coded frames from a gathered write: the program's bytes in one buffer first.)
            let flat: Vec<u8> = app.parts().concat();
            make_coded(mem, tx, plan, &flat, ring)
        }
    }
}

#[cold]
#[inline(never)]
fn make_coded(
    mem: ConnMem,
    tx: &mut TxState,
    plan: Plan,
    app: &[u8],
    ring: &[u8],
) -> Result<(Plan, Scratch), ProtoError> {
    let raw_of = |source: Source, len: usize| -> Scratch {
        let mut v = Scratch::take();
        match source {
            Source::App | Source::Coded { app: true, .. } => v.extend_from_slice(&app[..len]),
            Source::Coded { raw_seq, app: false, .. } | Source::Ring(raw_seq) => {
                let (a, b) = ring_slices(ring, tx.ring_pos(raw_seq), len);
                v.extend_from_slice(a);
                v.extend_from_slice(b);
            }
            Source::Spec { .. } | Source::Share { .. } => {}
        }
        v
    };
    if let Some((no, ids)) = tx.frame_chain() {
        // A frame no filter of its chain would change (incompressible bytes under the
        // compressors) goes plain: no copy into a coded frame here, none out of it there.
        let head = match plan.source {
            Source::App => Some(&app[..plan.payload]),
            Source::Ring(at) => Some(ring_slices(ring, tx.ring_pos(at), plan.payload).0),
            _ => None,
        };
        if let Some(head) = head.filter(|_| !Chain::ids_keyed(ids)) {
            if with_chain(ids, tx.chain_key(no), |c| c.passes(head)) == Some(true) {
                return Ok((tx.send_plain(plan), Scratch::default()));
            }
        }
        let seq = match plan.source {
            Source::Ring(at) => at,
            _ => tx.next_seq,
        };
        let raw = raw_of(plan.source, plan.payload);
        let mut coded = Scratch::take();
        with_chain(ids, tx.chain_key(no), |c| c.encode_into(seq, &raw, &mut coded));
        if crate::tamper::active() {
            let ack = u64::from_le_bytes(plan.header[16..24].try_into().unwrap_or_default());
            crate::tamper::frame(mem, ids, tx.chain_key(no), seq, ack, &mut coded);
        }
        if coded.is_empty() || coded.len() > MAX_PAYLOAD as usize {
            crate::log::error(format_args!(
                "virtual connection {:032x}: chain \"{}\" coded {} bytes into {}",
                mem.conn().gid,
                chain_spec(ids),
                raw.len(),
                coded.len()
            ));
            return Err(ProtoError::Undecodable);
        }
        let plan = tx.code_frame(plan, coded.len());
        return Ok((plan, coded));
    }
    let made = match plan.source {
        Source::Coded { raw_seq, raw_len, chain, .. } => {
            let raw = raw_of(plan.source, raw_len as usize);
            let mut coded = Scratch::take();
            with_chain(tx.chain_ids[chain as usize], tx.chain_key(chain), |c| {
                c.encode_into(raw_seq, &raw, &mut coded)
            });
            coded
        }
        Source::Spec { .. } | Source::Share { .. } => Scratch(tx.control_payload(plan.source)),
        _ => return Ok((plan, Scratch::default())),
    };
    Ok((plan, made))
}

thread_local! {
    /// Buffers of coded frames this thread used, kept for the next frames.
    static SCRATCH: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A buffer for one coded frame, given back to its thread when dropped: a frame of 128 KiB
/// built or read in a new allocation each time would be fresh pages from the kernel (the
/// allocator maps blocks that large), faulted in and unmapped again, which cost more than
/// the cipher (measured: a third of the receiver's time under `aead`).
#[derive(Default)]
pub struct Scratch(Vec<u8>);

impl Scratch {
    /// An empty buffer, one this thread used before if it has one.
    fn take() -> Scratch {
        let v = SCRATCH.try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p.pop())).ok().flatten();
        Scratch(v.unwrap_or_default())
    }

    /// Gives the buffer back to this thread (out of line: a plain frame's send never comes
    /// here).
    #[inline(never)]
    fn keep(&mut self) {
        let mut v = std::mem::take(&mut self.0);
        // (Kept: a few, of at most a frame and its chain's overhead.)
        if v.capacity() == 0 || v.capacity() > 2 * MAX_PAYLOAD as usize {
            return;
        }
        v.clear();
        let _ = SCRATCH.try_with(|p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                if p.len() < 4 {
                    p.push(v);
                }
            }
        });
    }
}

impl Drop for Scratch {
    #[inline]
    fn drop(&mut self) {
        if self.0.capacity() == 0 {
            // (A plain frame's: nothing to give back.)
            return;
        }
        self.keep();
    }
}

impl std::ops::Deref for Scratch {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.0
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }
}

/// Offers the peer the chain `spec` describes for what this side sends from now on (the
/// `CHAIN` IRB; with `both`, its flag [`BOTH_WAYS`], the peer is asked to put the chain on
/// its own stream too). The tx lock is held by the caller.
fn offer(mem: ConnMem, slot: Option<Slot>, spec: &[u8], both: bool) -> Result<usize, IrbError> {
    let c = mem.conn();
    let spec = std::str::from_utf8(spec).map_err(|_| IrbError::Os(libc::EINVAL))?;
    let ch = Chain::build(spec).ok_or(IrbError::Os(libc::EINVAL))?;
    let ids = ch.ids().ok_or(IrbError::Os(libc::EINVAL))?;
    let b = c.broken.load(Acquire);
    if b != 0 {
        return Err(IrbError::Os(b));
    }
    mem.with_tx_ring_held(|tx, _| {
        if tx.chain_now().1 == ids && tx.offer_no == 0 && !both {
            // Already so.
            return Ok(tx.chain_cur as usize);
        }
        begin_offer(mem, slot, tx, &ch, both).map(usize::from)
    })
}

/// Offers our keyed chain again (a new key exchange) when its key is due for renewal
/// (see `TxState::rekey_due` and `VMI_REKEY`).
#[cold]
#[inline(never)]
fn rekey_if_due(mem: ConnMem, slot: Option<Slot>, tx: &mut TxState) {
    let (cur, ids) = tx.chain_now();
    if *tx.chain_key(cur as u8) == [0; 32] || mem.conn().mirror_owed.load(Relaxed) != 0 {
        return;
    }
    let (bytes, ms) = crate::config::rekey();
    if !tx.rekey_due(sys::unix_ms(), bytes, ms) {
        return;
    }
    let Some(ch) = Chain::from_ids(ids) else { return };
    if begin_offer(mem, slot, tx, &ch, false).is_ok() {
        crate::log::info(format_args!(
            "virtual connection {:032x}: chain \"{}\" takes a new key (offered again at byte {})",
            mem.conn().gid,
            ch.spec,
            tx.next_seq
        ));
    }
}

/// The `CHAIN` IRB's flag that asks for the chain both ways.
pub const BOTH_WAYS: i32 = 1;

/// Starts our offer of chain `ch` (see [`offer`]).
fn begin_offer(
    mem: ConnMem,
    slot: Option<Slot>,
    tx: &mut TxState,
    ch: &Chain,
    both: bool,
) -> Result<u8, IrbError> {
    let c = mem.conn();
    let ids = ch.ids().ok_or(IrbError::Os(libc::EINVAL))?;
    let fit = if ch.is_empty() { MAX_PAYLOAD as usize } else { ch.fit(CODED_MAX) };
    if fit == 0 {
        return Err(IrbError::Os(libc::EINVAL));
    }
    let secret = if ch.keyed() {
        // A fresh secret for every offer: every offer of a keyed chain is a new key.
        Some(substrate::connection::aead::random_secret().ok_or_else(|| {
            crate::log::warn(format_args!(
                "virtual connection {:032x}: no random numbers for a key exchange; chain \"{}\" not offered",
                c.gid, ch.spec
            ));
            IrbError::Os(libc::EAGAIN)
        })?)
    } else {
        None
    };
    let no = tx.begin_offer(ids, fit, both, secret).map_err(|e| match e {
        OfferError::Busy => IrbError::Os(libc::EBUSY),
        OfferError::NoKey => IrbError::Os(libc::EINVAL),
    })?;
    // The answer may come alone: readable reports are checked until it is here.
    c.offering.store(1, Release);
    if let Some(s) = slot {
        s.set_offer(Some(ids));
    }
    crate::log::debug(format_args!(
        "virtual connection {:032x}: offers chain {no} \"{}\" for what it sends{}",
        c.gid,
        ch.spec,
        if both { " (and asks the peer to use it too)" } else { "" }
    ));
    Ok(no)
}

/// The peer took a chain for its stream and asked for the same on ours: offered back
/// (unless ours already is that chain, or an offer of our own waits).
#[cold]
fn mirror(mem: ConnMem, slot: Option<Slot>, tx: &mut TxState, ids: u32) {
    let gid = mem.conn().gid;
    if tx.chain_now().1 == ids && tx.offer_no == 0 {
        return;
    }
    let Some(ch) = Chain::from_ids(ids) else { return };
    match begin_offer(mem, slot, tx, &ch, false) {
        Ok(_) => crate::log::info(format_args!(
            "virtual connection {gid:032x}: offers chain \"{}\" for what it sends too, as the peer asked",
            ch.spec
        )),
        Err(IrbError::Os(libc::EBUSY)) => {
            // An offer of this side waits for its answer (a new key, say): this one goes once
            // it is answered (see `chain_frames`).
            mem.conn().mirror_owed.store(1, Release);
            crate::log::debug(format_args!(
                "virtual connection {gid:032x}: chain \"{}\" to be offered back once this side's own \
                 offer is answered",
                ch.spec
            ));
        }
        Err(_) => crate::log::warn(format_args!(
            "virtual connection {gid:032x}: the peer asked for chain \"{}\" both ways; not offered back",
            ch.spec
        )),
    }
}

/// Chain business of the send half, at a frame boundary: takes the peer's answer to our
/// offer, and sends the answer we owe to the peer's offer. (Our own offer goes only in
/// the same write as a data frame, see `send`, or right after an ack sent alone, see
/// `offer_after_ack`: alone, it could make the peer's socket readable with no data for its
/// program.) Never waits. The caller holds the tx lock.
fn chain_frames(mem: ConnMem, slot: Option<Slot>, fd: c_int, tx: &mut TxState, ring: &mut [u8]) {
    let c = mem.conn();
    let a = c.chain_answer.swap(0, AcqRel);
    if a != 0 {
        let share = Some(c.share(crate::shm::SHARE_IN)).filter(|s| *s != [0; 32]);
        let keyed = tx.offer_keyed();
        if let Some((no, taken, ids)) = tx.take_answer(a, share, sys::unix_ms()) {
            c.coding.store(u32::from(tx.chain_cur != 0), Release);
            c.offering.store(u32::from(tx.offer_no != 0), Release);
            if let Some(s) = slot {
                s.set_chain(tx.chain_now().1, true);
                s.set_offer(tx.offer_waiting());
            }
            if taken {
                crate::log::info(format_args!(
                    "virtual connection {:032x}: what it sends goes through chain \"{}\" from byte {}",
                    c.gid,
                    chain_spec(ids),
                    tx.next_seq
                ));
            } else if keyed && a & 0x100 != 0 {
                crate::log::error(format_args!(
                    "virtual connection {:032x}: the peer took chain {no} \"{}\" with a key share no key \
                     comes from; the stream goes on as it was",
                    c.gid,
                    chain_spec(ids)
                ));
            } else {
                crate::log::warn(format_args!(
                    "virtual connection {:032x}: the peer refused chain {no} \"{}\" (its layer lacks a filter, \
                     or cannot read coded frames under its sandbox); the stream goes on as it was",
                    c.gid,
                    chain_spec(ids)
                ));
            }
        }
    }
    if c.mirror_owed.load(Relaxed) != 0 && tx.offer_no == 0 && c.mirror_owed.swap(0, AcqRel) != 0 {
        mirror(mem, slot, tx, c.mirror_ids.load(Acquire));
    }
    let owed = c.answer_owed.load(Acquire);
    if owed != 0 && !tx.in_frame() {
        let share = Some(c.share(crate::shm::SHARE_OWED)).filter(|s| *s != [0; 32] && owed & 0x100 != 0);
        if let Some(p) = tx.plan_answer(owed as u8, owed & 0x100 != 0, c.delivered.load(Acquire), share) {
            let made = tx.control_payload(p.source);
            let r = write_coded(fd, &p, NO_APP, ring, &made, libc::MSG_DONTWAIT);
            tx.commit(&p, r.max(0) as usize, &[], ring);
            publish_tx(mem, tx, slot);
            if r > 0 && c.answer_owed.compare_exchange(owed, 0, AcqRel, Relaxed).is_ok() && owed & MIRROR != 0
            {
                mirror(mem, slot, tx, c.mirror_ids.load(Acquire));
            }
        }
    }
}

/// Sends the answer owed to the peer's chain offer, if one is owed and no other thread
/// sends now (that thread sends it at its next frame boundary). Never waits.
#[cold]
#[inline(never)]
fn answer_if_owed(mem: ConnMem, slot: Option<Slot>, fd: c_int) {
    let c = mem.conn();
    if c.answer_owed.load(Relaxed) == 0 {
        return;
    }
    match c.tx_lock.try_lock() {
        Some(_g) => control_held(mem, slot, fd, FrameKind::ChainAnswer),
        None => {
            // A sender holds the half; it sends the answer at its next frame boundary, and
            // the control thread if it does not come back.
            c.ctl_owed.fetch_or(crate::shm::CTL_ACK, AcqRel);
            linkstate::poke_work();
        }
    }
}

/// A log line for the peer's chain offer, taken or refused.
fn log_offer(mem: ConnMem, rx: &RxState, no: u8, taken: bool) {
    let gid = mem.conn().gid;
    match rx.chain_ids(no as u32) {
        Some(ids) if taken => crate::log::info(format_args!(
            "virtual connection {gid:032x}: what the peer sends goes through chain \"{}\" (number {no})",
            chain_spec(ids)
        )),
        _ if rx.refuse_coding != 0 => crate::log::warn(format_args!(
            "virtual connection {gid:032x}: refused the peer's chain {no}: the sandbox forbids setsockopt, \
             which coded frames need (a receive buffer that holds them whole)"
        )),
        _ => crate::log::warn(format_args!(
            "virtual connection {gid:032x}: refused the peer's chain {no}: a filter this build does not have"
        )),
    }
}

/// Decodes the coded frame being read from its whole payload `enc`.
fn decode_frame(rx: &RxState, enc: Vec<u8>) -> Result<Vec<u8>, ProtoError> {
    let ids = rx.chain_ids(rx.coded_chain).ok_or(ProtoError::BadChain(rx.coded_chain as u8))?;
    let d = with_chain(ids, rx.chain_key(rx.coded_chain), |c| c.decode(rx.coded_seq, enc))
        .ok_or(ProtoError::BadChain(rx.coded_chain as u8))?
        .map_err(|e| match e {
            chain::DecodeError::Malformed => ProtoError::Undecodable,
            e => ProtoError::Record(e),
        })?;
    if d.is_empty() || (rx.coded_taken as usize) > d.len() {
        return Err(ProtoError::Undecodable);
    }
    Ok(d)
}

/// Under a sandbox that forbids `setsockopt`, the receive buffer cannot be made big enough
/// for coded frames (see `ensure_rcvbuf`): the peer's offers of filters are refused, and the
/// stream goes on as it was.
#[inline]
fn coding_policy(rx: &mut RxState) {
    if sandbox::active() {
        rx.refuse_coding = u32::from(!sandbox::allows_nr(libc::SYS_setsockopt));
    }
}

/// Receive buffer asked for on a link that carries coded frames: several whole frames.
const CODED_RCVBUF: usize = 4 * CODED_MAX;

/// A link whose peer codes its frames needs a receive buffer that holds several whole coded
/// frames: each waits whole in the socket before it is read, and the kernel charges small
/// segments several times their length (a default buffer can fill with less than one frame,
/// and the connection stalls). Asked for once per link, never made smaller.
#[cold]
#[inline(never)]
fn ensure_rcvbuf(mem: ConnMem, fd: c_int) {
    let c = mem.conn();
    if c.careful.load(Relaxed) == 0 {
        return;
    }
    let g = c.link_gen.load(Relaxed).wrapping_add(1);
    if c.rcvbuf_gen.swap(g, Relaxed) == g || !sandbox::allows_nr(libc::SYS_setsockopt) {
        return;
    }
    let mut cur = [0u8; 4];
    let now = sys::fd::getsockopt_bytes(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, &mut cur)
        .map_or(0, |_| i32::from_ne_bytes(cur).max(0) as usize);
    // (The kernel reports twice what was asked for.)
    if now < 2 * CODED_RCVBUF {
        let v = (CODED_RCVBUF as i32).to_ne_bytes();
        sys::fd::setsockopt_bytes(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, &v);
    }
}

/// Asks the kernel to call the socket readable only once `n` bytes wait (1: as usual).
pub(crate) fn set_lowat(mem: ConnMem, fd: c_int, n: usize) {
    let n = n.clamp(1, i32::MAX as usize) as u32;
    let c = mem.conn();
    if c.lowat.load(Relaxed).max(1) == n {
        return;
    }
    if sandbox::allows_nr(libc::SYS_setsockopt) {
        let v = (n as i32).to_ne_bytes();
        sys::fd::setsockopt_bytes(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, &v);
        c.lowat.store(n, Relaxed);
    }
}

/// A coded frame of a compressor that passed its bytes as they were (tag `0`): the tag is
/// taken off the socket and the rest is read as a plain frame, straight into the program's
/// buffer (no peek of the whole frame, no copy, no decode). False when the frame is not
/// such a one, or its first byte is not here yet. The caller holds the rx lock.
#[inline]
fn take_stored(mem: ConnMem, slot: Option<Slot>, rx: &mut RxState, fd: c_int) -> Result<bool, IrbError> {
    if rx.coded_taken != 0 || !rx.chain_ids(rx.coded_chain).is_some_and(Chain::ids_store_plain) {
        return Ok(false);
    }
    let mut tag = [0u8; 1];
    if sock_recv(fd, &mut tag, libc::MSG_PEEK | libc::MSG_DONTWAIT) != 1 || tag[0] != 0 {
        return Ok(false);
    }
    if sock_recv(fd, &mut tag, libc::MSG_DONTWAIT) != 1 {
        return Ok(false);
    }
    rx.take_stored().map_err(|e| fail(mem, slot, fd, e))?;
    set_lowat(mem, fd, 1);
    Ok(true)
}

/// Reads from the coded frame whose header was taken: its whole payload is looked at in the
/// socket (it stays there until the program has every decoded byte, so the socket's
/// readiness stays the program's), decoded, and the program gets the bytes it has not had.
/// With `peek`, nothing is taken. The caller holds the rx lock.
#[allow(clippy::too_many_arguments)]
fn recv_coded(
    mem: ConnMem,
    slot: Option<Slot>,
    rx: &mut RxState,
    fd: c_int,
    space: &mut [u8],
    kflags: c_int,
    peek: bool,
    gen: Option<u32>,
) -> Result<usize, IrbError> {
    let len = rx.coded_len as usize;
    ensure_rcvbuf(mem, fd);
    let mut enc = Scratch::take();
    enc.resize(len, 0);
    let mut r = sock_recv(fd, &mut enc, libc::MSG_PEEK | libc::MSG_DONTWAIT);
    if r < len as isize && (r >= 0 || sys::errno() == libc::EAGAIN) {
        // Not all there yet. The kernel is told that nothing less is worth a wake-up, which
        // also grows the socket's receive buffer (and window) to hold the whole frame: the
        // frame stays in the socket until it is read whole, so a buffer smaller than it
        // would stall the connection.
        set_lowat(mem, fd, len);
        if kflags & libc::MSG_DONTWAIT != 0 || sys::nonblocking(fd) {
            return Err(IrbError::WouldBlock);
        }
        loop {
            r = sock_recv(fd, &mut enc, libc::MSG_PEEK | libc::MSG_WAITALL);
            if r <= 0 || r as usize >= len {
                break;
            }
            // The wait was cut short with the frame still incomplete: the link was taken
            // away under it (a relink disconnects the old socket to wake its readers; the
            // caller then waits for the new link and reads the frame again there), the
            // program's receive time-out passed, or a signal came (the program sees no
            // EINTR: the kernel would have restarted a read that had taken nothing).
            if link_changed(mem, gen) {
                return Err(IrbError::LinkDown);
            }
            if has_rcvtimeo(fd) {
                return Err(IrbError::WouldBlock);
            }
        }
    }
    if r < 0 {
        return Err(read_error(mem, sys::errno(), gen));
    }
    if r == 0 {
        check_link(mem)?;
        if socket_gone(fd) {
            return Err(physical_error(mem, libc::ENOTCONN, false, 0, gen));
        }
        // The peer's kernel closed in the middle of a frame: the link is lost.
        linkstate::link_broken_on(mem, "the link ended inside a frame", gen);
        return Err(IrbError::LinkDown);
    }
    if (r as usize) < len {
        // Not all there without waiting.
        return Err(IrbError::WouldBlock);
    }
    let mut dec = match decode_frame(rx, std::mem::take(&mut *enc)) {
        Ok(d) => Scratch(d),
        Err(e) => return Err(fail(mem, slot, fd, e)),
    };
    let at = rx.coded_taken as usize;
    let n = space.len().min(dec.len() - at);
    space[..n].copy_from_slice(&dec[at..at + n]);
    if peek {
        return Ok(n);
    }
    rx.coded_delivered(n);
    if at + n == dec.len() {
        // Every decoded byte is the program's: take the payload off the socket (it is all
        // there: we just looked at it, and only this half reads). MSG_TRUNC: the kernel
        // drops the bytes without copying them.
        if dec.len() < len {
            dec.resize(len, 0);
        }
        let r = sock_recv(fd, &mut dec[..len], libc::MSG_DONTWAIT | libc::MSG_TRUNC);
        if r != len as isize {
            let e = if r < 0 { sys::errno() } else { libc::EIO };
            let _ = physical_error(mem, e, false, 0, gen);
        }
        rx.coded_done();
        set_lowat(mem, fd, 1);
    }
    if let Err(e) = publish_rx(mem, slot, rx) {
        return Err(fail(mem, slot, fd, e));
    }
    maybe_ack(mem, slot, fd, rx.delivered);
    Ok(n)
}
