//! One direction of a shared-memory connection: a single-producer, single-consumer byte ring
//! in memory both processes map, and the *doorbell protocol* that keeps the program's view of
//! its descriptor exact without a system call per message.
//!
//! The program's descriptor stays the connection's TCP socket (ARCHITECTURE.md, "Which
//! descriptor the program holds"); with shared memory the bytes go through the ring and the
//! socket carries only **bells**, one-byte wake-ups. The rule this module keeps:
//!
//! > while the consumer may sleep (`sleeping`), unread bytes in the ring imply a bell is
//! > pending in its socket (`bell`).
//!
//! So `poll`/`select`/`epoll` on the descriptor say readable exactly when the ring has bytes,
//! a blocked reader is woken by the bell, and a consumer that is busy (spinning inside a
//! receive) costs the producer no system call at all.
//!
//! ```text
//!  producer                                   consumer
//!  write(bytes) ── tail += n (Release)        read() ── head += n (Release)
//!  after_write():                             before_sleep():  sleeping = 1, fence,
//!    fence; sleeping && bell 0→1 ?              data? → don't sleep
//!      → Bell::Ring: send one byte            bell_taken(): after reading the byte
//!  waiting for room: writer_waiting = 1       after_read(): writer_waiting && space?
//!                                               → Bell::Ring toward the producer
//! ```
//!
//! The two `fence`s (one on each side, sequentially consistent) are the classic store-buffer
//! pairing: of "producer published bytes, then looked at `sleeping`" and "consumer set
//! `sleeping`, then looked at the bytes", at least one side sees the other's store, so no
//! wake-up is ever lost. Nothing here makes a system call; bells are returned to the caller,
//! which writes them to a socket.
//!
//! The memory is shared with another process, which may be confused or hostile: positions
//! read from it are checked (`tail - head` never exceeds the capacity, neither goes back),
//! and a violation is an error, never an out-of-bounds access.

use std::sync::atomic::{fence, AtomicI32, AtomicU32, AtomicU64, Ordering::*};

/// The first page of a shared-memory region, before its two rings: the offer's state and
/// who made it.
#[repr(C)]
pub struct RegionHead {
    /// [`REGION_MAGIC`] once initialised.
    pub magic: u64,
    /// [`OFFERED`], [`ACCEPTED`], [`REFUSED`] or [`WITHDRAWN`].
    pub state: AtomicU32,
    /// 1 once a process of the connecting side took the answer (after a fork, the others
    /// adopt it).
    pub settled: AtomicU32,
    /// 1 once either side moves the connection off this memory.
    pub moving: AtomicU32,
    /// The process that made the offer (its node agent removes an offer nobody took whose
    /// maker died).
    pub creator: AtomicI32,
}

/// Marks an initialised region.
pub const REGION_MAGIC: u64 = 0x766d_692d_7368_6d72; // "vmi-shmr"
/// Offered, not answered yet.
pub const OFFERED: u32 = 0;
/// Taken by the accepting side.
pub const ACCEPTED: u32 = 1;
/// Refused by the accepting side.
pub const REFUSED: u32 = 2;
/// Withdrawn by the connecting side before an answer came: its program sent before the
/// peer's program accepted (natively such bytes wait in the kernel), so the connection
/// uses TCP. Set and answered with compare-and-swap from [`OFFERED`]: exactly one wins.
pub const WITHDRAWN: u32 = 3;

/// Whether a region file whose first bytes are `head` is an offer nobody will take: still
/// OFFERED and its maker is not alive (`alive(pid)`). Anything else, or too short, is left.
pub fn abandoned_offer(head: &[u8], alive: impl Fn(i32) -> bool) -> bool {
    let (Some(m), Some(st), Some(pid)) = (head.get(0..8), head.get(8..12), head.get(20..24)) else {
        return false;
    };
    let m = u64::from_le_bytes(m.try_into().expect("8"));
    let st = u32::from_le_bytes(st.try_into().expect("4"));
    let pid = i32::from_le_bytes(pid.try_into().expect("4"));
    m == REGION_MAGIC && st == OFFERED && pid > 0 && !alive(pid)
}

/// Marks an initialised ring header.
pub const MAGIC: u64 = 0x766d_692d_7368_6d31; // "vmi-shm1"

/// Bytes taken by the header before a ring's data.
pub const HEADER: usize = 256;

/// The shared header of one ring. Producer and consumer fields sit on separate cache lines.
#[repr(C, align(64))]
pub struct RingHeader {
    magic: AtomicU64,
    cap: AtomicU64,
    _pad0: [u64; 6],
    /// Bytes written so far (producer).
    tail: AtomicU64,
    /// 1 once the producer will write no more (end of stream).
    closed: AtomicU32,
    /// 1 while the producer waits for room: the consumer rings it after freeing some.
    writer_waiting: AtomicU32,
    /// 1 while a space bell is pending for the producer (the word it sleeps on).
    space_bell: AtomicU32,
    /// 1 once the consumer is gone (closed): writing is pointless (`EPIPE`).
    reader_gone: AtomicU32,
    /// 1 while the waiting producer is a non-blocking one, back in its program waiting on its
    /// descriptor: room must be announced through its socket, not only on the futex.
    nb_waiting: AtomicU32,
    /// 1 when the producer's program reset the connection (closed it with unread bytes, or
    /// with `SO_LINGER` 0): after the last byte the consumer reads a reset, not the end.
    /// Set before `closed`, which a layer that does not know this field reads as the end.
    reset: AtomicU32,
    _pad1: [u32; 10],
    /// Bytes consumed so far (consumer): what the consumer's program has.
    head: AtomicU64,
    /// 1 while the consumer may sleep in the kernel: new bytes need a bell.
    sleeping: AtomicU32,
    /// 1 while a data bell is (or is about to be) in the consumer's socket.
    bell: AtomicU32,
    /// Where the consumer wants its data bells (0: its socket; else a name of the
    /// consumer's choosing, see [`Ring::bell_to`]). Set by the consumer only.
    bell_to: AtomicU64,
    _pad2: [u64; 5],
}

const _: () = assert!(std::mem::size_of::<RingHeader>() <= HEADER);

/// What a ring operation found wrong with the shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingError {
    /// The header is not a ring's (wrong magic) or names another capacity.
    NotARing,
    /// The positions are impossible: the other process is confused or hostile.
    Corrupt,
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RingError::NotARing => "the shared memory holds no ring of that size",
            RingError::Corrupt => "the ring's positions are impossible (a confused or hostile peer)",
        })
    }
}

impl std::error::Error for RingError {}

/// A wake-up the caller must deliver by writing one byte to a socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bell {
    /// Nothing to do.
    Quiet,
    /// Write one bell byte.
    Ring,
}

/// Whether a consumer about to sleep may do so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sleep {
    /// Go to sleep in the kernel: the producer rings when bytes come.
    Ok,
    /// Bytes (or the end) are already there: read them instead.
    Ready,
}

/// One ring in shared memory: header then `cap` data bytes. Both sides hold one; only the
/// producer calls the `write` family and only the consumer the `read` family (the layer keeps
/// each side under its own lock).
// (Not Copy: a ring is as valid as the mapping under it, which its owner keeps.)
pub struct Ring {
    h: *const RingHeader,
    data: *mut u8,
    cap: u64,
}

// SAFETY: all shared state is atomics; data bytes are only touched in ranges the protocol
// gives to one side at a time.
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

impl Ring {
    /// Bytes of memory a ring of `cap` data bytes takes.
    pub const fn size(cap: usize) -> usize {
        HEADER + cap
    }

    /// Initialises a new ring in `mem`.
    ///
    /// # Safety
    /// `mem` is valid for `len` bytes, 64-byte aligned, and stays mapped while the ring (or a
    /// copy) is used; nobody else uses it yet.
    pub unsafe fn init(mem: *mut u8, len: usize) -> Result<Ring, RingError> {
        if len <= HEADER || !(mem as usize).is_multiple_of(64) {
            return Err(RingError::NotARing);
        }
        let cap = (len - HEADER) as u64;
        let h = mem as *mut RingHeader;
        // SAFETY: the caller gives us `len >= HEADER` aligned bytes to ourselves.
        unsafe {
            std::ptr::write_bytes(mem, 0, HEADER);
            (*h).cap.store(cap, Relaxed);
            // A consumer is "sleeping" unless it is inside a receive: a program's first wait
            // on the descriptor (select before any read) must be rung.
            (*h).sleeping.store(1, Relaxed);
            (*h).magic.store(MAGIC, Release);
        }
        Ok(Ring { h, data: mem.wrapping_add(HEADER), cap })
    }

    /// Attaches to a ring another process initialised.
    ///
    /// # Safety
    /// As for [`Ring::init`], except that the memory holds a ring already.
    pub unsafe fn attach(mem: *mut u8, len: usize) -> Result<Ring, RingError> {
        if len <= HEADER || !(mem as usize).is_multiple_of(64) {
            return Err(RingError::NotARing);
        }
        let h = mem as *const RingHeader;
        let cap = (len - HEADER) as u64;
        // SAFETY: valid, aligned memory per the caller.
        let ok = unsafe { (*h).magic.load(Acquire) == MAGIC && (*h).cap.load(Relaxed) == cap };
        if !ok {
            return Err(RingError::NotARing);
        }
        Ok(Ring { h, data: mem.wrapping_add(HEADER), cap })
    }

    fn h(&self) -> &RingHeader {
        // SAFETY: mapped for the life of the ring (the constructors' contract).
        unsafe { &*self.h }
    }

    /// Data capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.cap as usize
    }

    /// (head, tail), checked.
    fn positions(&self) -> Result<(u64, u64), RingError> {
        let head = self.h().head.load(Acquire);
        let tail = self.h().tail.load(Acquire);
        if tail < head || tail - head > self.cap {
            return Err(RingError::Corrupt);
        }
        Ok((head, tail))
    }

    /// Bytes the consumer has not read yet.
    pub fn readable(&self) -> Result<usize, RingError> {
        self.positions().map(|(h, t)| (t - h) as usize)
    }

    /// Room for the producer.
    pub fn writable(&self) -> Result<usize, RingError> {
        self.positions().map(|(h, t)| (self.cap - (t - h)) as usize)
    }

    /// Bytes the consumer has taken since the ring was made (what its program has: the
    /// acknowledgement for the producer's replay).
    pub fn consumed(&self) -> u64 {
        self.h().head.load(Acquire)
    }

    /// Bytes the producer has written since the ring was made.
    pub fn produced(&self) -> u64 {
        self.h().tail.load(Acquire)
    }

    fn copy_out(&self, from: u64, dst: &mut [u8]) {
        let cap = self.cap as usize;
        let off = (from % self.cap) as usize;
        let first = dst.len().min(cap - off);
        // SAFETY: `off + first <= cap` and the rest wraps to the start; the range is the
        // consumer's (written and published by the producer, not yet released by `head`).
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(off), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data, dst.as_mut_ptr().add(first), dst.len() - first);
        }
    }

    // --- producer -------------------------------------------------------------------------

    /// Copies the producer's own bytes from position `from` (not yet consumed when the
    /// producer stopped writing) into `dst`: what it must send again another way when the
    /// connection leaves the ring. Refused when the range is not in the ring any more.
    pub fn copy_written(&self, from: u64, dst: &mut [u8]) -> Result<(), RingError> {
        let tail = self.h().tail.load(Acquire);
        let end = from.checked_add(dst.len() as u64).ok_or(RingError::Corrupt)?;
        if end > tail || tail - from > self.cap {
            return Err(RingError::Corrupt);
        }
        self.copy_out(from, dst);
        Ok(())
    }

    /// Copies as much of `src` as fits; returns how much.
    pub fn write(&self, src: &[u8]) -> Result<usize, RingError> {
        let (head, tail) = self.positions()?;
        let n = src.len().min((self.cap - (tail - head)) as usize);
        if n == 0 {
            return Ok(0);
        }
        let cap = self.cap as usize;
        let off = (tail % self.cap) as usize;
        let first = n.min(cap - off);
        // SAFETY: the free range [tail, head + cap) is the producer's alone; `off + first <=
        // cap`, and the rest wraps to the start.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(off), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data, n - first);
        }
        self.h().tail.store(tail + n as u64, Release);
        Ok(n)
    }

    /// After writes (or [`Ring::close`]): whether the consumer must be rung.
    pub fn after_write(&self) -> Bell {
        fence(SeqCst);
        let h = self.h();
        if h.sleeping.load(Relaxed) == 1 && h.bell.load(Relaxed) == 0 && h.bell.swap(1, AcqRel) == 0 {
            Bell::Ring
        } else {
            Bell::Quiet
        }
    }

    /// The producer writes no more (end of stream); follow with [`Ring::after_write`].
    pub fn close(&self) {
        self.h().closed.store(1, Release);
    }

    /// The producer's program resets the connection: as [`Ring::close`], and the consumer
    /// reads a reset after the last byte ([`Ring::take_reset`]).
    pub fn reset(&self) {
        self.h().reset.store(1, Release);
        self.h().closed.store(1, Release);
    }

    /// True the first time a consumer asks after the producer reset the connection (see
    /// [`Ring::reset`]): the reset is read once, as a socket's error is, and the end after
    /// it.
    pub fn take_reset(&self) -> bool {
        self.h().reset.compare_exchange(1, 2, AcqRel, Acquire).is_ok()
    }

    /// The producer is about to sleep until there is room: returns [`Sleep::Ready`] when
    /// there is some already.
    pub fn before_wait_room(&self) -> Result<Sleep, RingError> {
        self.h().writer_waiting.store(1, Relaxed);
        fence(SeqCst);
        if self.writable()? > 0 {
            self.h().writer_waiting.store(0, Relaxed);
            return Ok(Sleep::Ready);
        }
        Ok(Sleep::Ok)
    }

    /// A non-blocking producer found the ring full and goes back to its program, which will
    /// wait on its descriptor (perhaps edge-triggered, so only a new event wakes it). The
    /// consumer freeing room must then also ring its socket ([`Ring::take_nonblocking_waiter`]).
    /// Returns [`Sleep::Ready`] when there is room already (write again instead).
    pub fn before_wait_room_nonblocking(&self) -> Result<Sleep, RingError> {
        self.h().nb_waiting.store(1, Relaxed);
        let r = self.before_wait_room()?;
        if r == Sleep::Ready {
            self.h().nb_waiting.store(0, Relaxed);
        }
        Ok(r)
    }

    /// The producer is back (it holds the producing side: nobody else waits for room now):
    /// what a non-blocking wait left set is cleared, so that the next wait is rung again.
    pub fn room_wait_reset(&self) {
        let h = self.h();
        if h.writer_waiting.load(Relaxed) == 1 || h.space_bell.load(Relaxed) == 1 {
            h.nb_waiting.store(0, Relaxed);
            h.writer_waiting.store(0, Relaxed);
            h.space_bell.store(0, Release);
        }
    }

    /// The word a producer waiting for room sleeps on (a futex: 0 until rung).
    pub fn space_word(&self) -> &AtomicU32 {
        &self.h().space_bell
    }

    /// True once the consumer closed its end.
    pub fn reader_gone(&self) -> bool {
        self.h().reader_gone.load(Acquire) != 0
    }

    /// True the first time the producer asks after the consumer left: a socket takes the
    /// first write after its peer closed (the peer's kernel answers it with a reset), and
    /// fails the ones after it.
    pub fn first_write_after_reader_left(&self) -> bool {
        self.h().reader_gone.compare_exchange(1, 2, AcqRel, Acquire).is_ok()
    }

    /// The consumer closes its end; returns whether a waiting producer must be woken.
    pub fn reader_leaves(&self) -> Bell {
        self.h().reader_gone.store(1, Release);
        self.after_read_force()
    }

    fn after_read_force(&self) -> Bell {
        fence(SeqCst);
        let h = self.h();
        if h.writer_waiting.load(Relaxed) == 1 && h.space_bell.swap(1, AcqRel) == 0 {
            Bell::Ring
        } else {
            Bell::Quiet
        }
    }

    /// The producer took a space bell from its socket.
    pub fn space_bell_taken(&self) {
        self.h().space_bell.store(0, Release);
    }

    /// The producer stopped waiting for room.
    pub fn room_wait_over(&self) {
        self.h().writer_waiting.store(0, Relaxed);
    }

    // --- consumer -------------------------------------------------------------------------

    /// Copies up to `dst.len()` unread bytes; with `peek`, leaves them unread.
    pub fn read(&self, dst: &mut [u8], peek: bool) -> Result<usize, RingError> {
        let (head, tail) = self.positions()?;
        let n = dst.len().min((tail - head) as usize);
        if n == 0 {
            return Ok(0);
        }
        self.copy_out(head, &mut dst[..n]);
        if !peek {
            // The bytes must be copied out before the producer may reuse their room.
            self.h().head.store(head + n as u64, Release);
        }
        Ok(n)
    }

    /// True once the producer closed and every byte was read.
    pub fn at_end(&self) -> Result<bool, RingError> {
        let closed = self.h().closed.load(Acquire) == 1;
        Ok(closed && self.readable()? == 0)
    }

    /// True once the producer closed (bytes may still be unread).
    pub fn closed(&self) -> bool {
        self.h().closed.load(Acquire) == 1
    }

    /// After reads: whether the producer, waiting for room, must be rung.
    pub fn after_read(&self) -> Bell {
        fence(SeqCst);
        let h = self.h();
        if h.writer_waiting.load(Relaxed) == 1
            && h.space_bell.load(Relaxed) == 0
            && h.space_bell.swap(1, AcqRel) == 0
        {
            Bell::Ring
        } else {
            Bell::Quiet
        }
    }

    /// After [`Ring::after_read`] said [`Bell::Ring`]: true if the producer it rings waits
    /// in its program rather than on the futex, so a byte must reach its socket too (through
    /// the other ring's [`Ring::force_bell`]).
    pub fn take_nonblocking_waiter(&self) -> bool {
        self.h().nb_waiting.swap(0, AcqRel) == 1
    }

    /// The consumer is about to sleep in the kernel (a blocking read, or its program is
    /// about to wait on the descriptor): from now on new bytes ring. Returns
    /// [`Sleep::Ready`] when bytes (or the end) are already there; the consumer then stays
    /// "sleeping" for the producer, and must make sure a bell is pending (see
    /// [`Ring::ensure_bell`]) if it leaves the bytes to its program's next wait.
    pub fn before_sleep(&self) -> Result<Sleep, RingError> {
        self.h().sleeping.store(1, Relaxed);
        fence(SeqCst);
        if self.readable()? > 0 || self.closed() {
            return Ok(Sleep::Ready);
        }
        Ok(Sleep::Ok)
    }

    /// The consumer is busy (spinning inside a receive): the producer need not ring.
    pub fn awake(&self) {
        self.h().sleeping.store(0, Relaxed);
    }

    /// Where data bells go (producer; see [`Ring::direct_bells`]): 0 for the consumer's
    /// socket, else the consumer's name for another place it waits on. A producer that rang
    /// there looks again after ringing: if the name changed meanwhile, it rings the socket
    /// too (the consumer may have stopped waiting on the other place before the bell came).
    pub fn bell_to(&self) -> u64 {
        self.h().bell_to.load(SeqCst)
    }

    /// The consumer's data bells go to `to` from now on (0: its socket). A bell pending at
    /// the old place stands for nothing at the new one: the caller takes the bell back
    /// ([`Ring::bell_taken`]) when it leaves another place, and announces what the ring holds.
    pub fn direct_bells(&self, to: u64) {
        self.h().bell_to.store(to, SeqCst);
    }

    /// Whether a data bell is pending (or about to be) in the consumer's socket.
    pub fn bell_pending(&self) -> bool {
        self.h().bell.load(Acquire) == 1
    }

    /// The consumer took the data bell from its socket.
    pub fn bell_taken(&self) {
        self.h().bell.store(0, Release);
    }

    /// A bell byte goes to the consumer's socket whatever is pending there (a new event for
    /// a program waiting edge-triggered: room for its writes, announced from the other ring);
    /// its receive takes it out with the data bells.
    pub fn force_bell(&self) -> Bell {
        self.h().bell.store(1, Release);
        Bell::Ring
    }

    /// The consumer leaves unread bytes (or the end) for its program's next wait: if no
    /// bell is pending, one must be written (by the consumer, through the producer's socket).
    pub fn ensure_bell(&self) -> Bell {
        let h = self.h();
        if h.bell.load(Relaxed) == 0 && h.bell.swap(1, AcqRel) == 0 {
            Bell::Ring
        } else {
            Bell::Quiet
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, Condvar, Mutex};

    /// Test memory, never freed (threads may still hold copies of the ring).
    struct Leak(*mut u8);

    impl Leak {
        fn as_ptr(&self) -> *const u8 {
            self.0
        }
    }

    // SAFETY: a plain address.
    unsafe impl Send for Leak {}

    fn aligned(cap: usize) -> (Leak, Ring) {
        let layout = std::alloc::Layout::from_size_align(Ring::size(cap), 64).unwrap();
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        // SAFETY: aligned, valid for the size; the memory is leaked (tests only), so it
        // outlives every copy of the ring.
        let r = unsafe { Ring::init(p, Ring::size(cap)).unwrap() };
        (Leak(p), r)
    }

    #[test]
    fn only_an_offer_whose_maker_died_is_abandoned() {
        let head = |magic: u64, state: u32, pid: i32| {
            let mut b = Vec::new();
            b.extend_from_slice(&magic.to_le_bytes());
            b.extend_from_slice(&state.to_le_bytes());
            b.extend_from_slice(&[0; 8]);
            b.extend_from_slice(&pid.to_le_bytes());
            b
        };
        let dead = |_| false;
        assert!(abandoned_offer(&head(REGION_MAGIC, OFFERED, 42), dead));
        assert!(!abandoned_offer(&head(REGION_MAGIC, OFFERED, 42), |p| p == 42));
        assert!(!abandoned_offer(&head(REGION_MAGIC, ACCEPTED, 42), dead));
        assert!(!abandoned_offer(&head(REGION_MAGIC, OFFERED, 0), dead));
        assert!(!abandoned_offer(&head(7, OFFERED, 42), dead));
        assert!(!abandoned_offer(&head(REGION_MAGIC, OFFERED, 42)[..20], dead));
        assert_eq!(std::mem::offset_of!(RegionHead, creator), 20);
        assert_eq!(std::mem::offset_of!(RegionHead, state), 8);
    }

    #[test]
    fn a_reset_is_read_after_the_last_byte_once_and_an_end_is_never_a_reset() {
        let (_m, r) = aligned(16);
        let mut out = [0u8; 16];
        assert_eq!(r.write(b"last").unwrap(), 4);
        r.reset();
        assert!(r.closed());
        // The bytes first (the consumer's reader looks for the reset only at the end)...
        assert_eq!(r.read(&mut out, false).unwrap(), 4);
        assert!(r.at_end().unwrap());
        // ...then the reset, once, then the plain end.
        assert!(r.take_reset());
        assert!(!r.take_reset());
        let (_m2, e) = aligned(16);
        e.close();
        assert!(e.at_end().unwrap() && !e.take_reset());
    }

    #[test]
    fn bytes_wrap_around() {
        let (_m, r) = aligned(10);
        let mut out = [0u8; 10];
        let mut expect = Vec::new();
        let mut got = Vec::new();
        for i in 0..50u8 {
            let chunk: Vec<u8> = (0..(i % 7) + 1).map(|k| i.wrapping_mul(31).wrapping_add(k)).collect();
            let n = r.write(&chunk).unwrap();
            expect.extend_from_slice(&chunk[..n]);
            let m = r.read(&mut out[..(i as usize % 5) + 1], false).unwrap();
            got.extend_from_slice(&out[..m]);
        }
        loop {
            let m = r.read(&mut out, false).unwrap();
            if m == 0 {
                break;
            }
            got.extend_from_slice(&out[..m]);
        }
        assert_eq!(got, expect);
        assert_eq!(r.produced(), r.consumed());
    }

    #[test]
    fn the_producer_gets_back_what_was_not_consumed_across_the_wrap() {
        let (_m, r) = aligned(8);
        let mut out = [0u8; 8];
        assert_eq!(r.write(b"abcdef").unwrap(), 6);
        assert_eq!(r.read(&mut out[..5], false).unwrap(), 5);
        assert_eq!(r.write(b"ghijklm").unwrap(), 7);
        // Unconsumed: "fghijklm" from position 5, wrapping inside the ring.
        let mut back = [0u8; 8];
        r.copy_written(r.consumed(), &mut back).unwrap();
        assert_eq!(&back, b"fghijklm");
        // Bytes overwritten since, or not written yet, are refused.
        assert_eq!(r.copy_written(2, &mut back[..3]), Err(RingError::Corrupt));
        assert_eq!(r.copy_written(12, &mut back[..2]), Err(RingError::Corrupt));
        r.copy_written(13, &mut []).unwrap();
    }

    #[test]
    fn full_ring_takes_nothing_and_peek_leaves_bytes() {
        let (_m, r) = aligned(8);
        assert_eq!(r.write(b"0123456789").unwrap(), 8);
        assert_eq!(r.write(b"x").unwrap(), 0);
        let mut out = [0u8; 4];
        assert_eq!(r.read(&mut out, true).unwrap(), 4);
        assert_eq!(&out, b"0123");
        assert_eq!(r.readable().unwrap(), 8);
        assert_eq!(r.read(&mut out, false).unwrap(), 4);
        assert_eq!(r.writable().unwrap(), 4);
    }

    #[test]
    fn a_busy_consumer_costs_no_bell_and_a_sleeping_one_gets_exactly_one() {
        let (_m, r) = aligned(64);
        r.awake();
        r.write(b"a").unwrap();
        assert_eq!(r.after_write(), Bell::Quiet);
        let mut out = [0u8; 64];
        r.read(&mut out, false).unwrap();
        assert_eq!(r.before_sleep().unwrap(), Sleep::Ok);
        r.write(b"b").unwrap();
        assert_eq!(r.after_write(), Bell::Ring);
        r.write(b"c").unwrap();
        assert_eq!(r.after_write(), Bell::Quiet, "one bell is enough until it is taken");
        r.bell_taken();
        assert_eq!(r.read(&mut out, false).unwrap(), 2);
    }

    #[test]
    fn leftover_bytes_need_a_bell_once() {
        let (_m, r) = aligned(64);
        r.awake();
        r.write(b"hello").unwrap();
        assert_eq!(r.after_write(), Bell::Quiet);
        let mut out = [0u8; 2];
        r.read(&mut out, false).unwrap();
        assert_eq!(r.before_sleep().unwrap(), Sleep::Ready);
        assert_eq!(r.ensure_bell(), Bell::Ring);
        assert_eq!(r.ensure_bell(), Bell::Quiet);
        r.write(b"!").unwrap();
        assert_eq!(r.after_write(), Bell::Quiet);
    }

    #[test]
    fn a_waiting_writer_is_rung_when_room_comes() {
        let (_m, r) = aligned(4);
        assert_eq!(r.write(b"abcd").unwrap(), 4);
        assert_eq!(r.before_wait_room().unwrap(), Sleep::Ok);
        let mut out = [0u8; 1];
        r.read(&mut out, false).unwrap();
        assert_eq!(r.after_read(), Bell::Ring);
        r.read(&mut out, false).unwrap();
        assert_eq!(r.after_read(), Bell::Quiet);
        r.space_bell_taken();
        r.room_wait_over();
        assert_eq!(r.before_wait_room().unwrap(), Sleep::Ready);
    }

    #[test]
    fn a_nonblocking_writer_is_rung_through_its_socket_at_every_full_ring() {
        let (_m, ab) = aligned(4); // the writer's ring
        let (_n, ba) = aligned(4); // the other way: its bell reaches the writer's socket
        let mut out = [0u8; 4];
        for round in 0..3 {
            ab.room_wait_reset();
            assert_eq!(ab.write(b"abcd").unwrap(), 4, "round {round}");
            assert_eq!(ab.write(b"e").unwrap(), 0);
            assert_eq!(ab.before_wait_room_nonblocking().unwrap(), Sleep::Ok);
            // The reader frees room: the futex word is rung, and the writer's socket must get
            // a byte even though a bell may be pending there already.
            ab.read(&mut out[..1], false).unwrap();
            assert_eq!(ab.after_read(), Bell::Ring, "round {round}");
            assert!(ab.take_nonblocking_waiter());
            assert_eq!(ba.force_bell(), Bell::Ring);
            assert!(ba.bell_pending());
            // Rung once per wait.
            ab.read(&mut out[..1], false).unwrap();
            assert_eq!(ab.after_read(), Bell::Quiet);
            assert!(!ab.take_nonblocking_waiter());
            ab.read(&mut out[..2], false).unwrap();
        }
        // A blocking waiter is rung on the futex only.
        ab.room_wait_reset();
        ab.write(b"abcd").unwrap();
        assert_eq!(ab.before_wait_room().unwrap(), Sleep::Ok);
        ab.read(&mut out[..1], false).unwrap();
        assert_eq!(ab.after_read(), Bell::Ring);
        assert!(!ab.take_nonblocking_waiter());
        // Room already there: no wait.
        ab.room_wait_reset();
        assert_eq!(ab.before_wait_room_nonblocking().unwrap(), Sleep::Ready);
        assert!(!ab.take_nonblocking_waiter());
    }

    #[test]
    fn a_new_consumer_is_rung_before_its_first_read() {
        let (_m, r) = aligned(16);
        r.write(b"x").unwrap();
        assert_eq!(r.after_write(), Bell::Ring);
    }

    #[test]
    fn end_of_stream_after_the_last_byte() {
        let (_m, r) = aligned(16);
        r.write(b"xy").unwrap();
        r.close();
        assert!(!r.at_end().unwrap());
        let mut out = [0u8; 16];
        assert_eq!(r.read(&mut out, false).unwrap(), 2);
        assert!(r.at_end().unwrap());
    }

    #[test]
    fn impossible_positions_are_errors_not_accesses() {
        let (m, r) = aligned(16);
        let h = m.as_ptr() as *const RingHeader;
        // A hostile peer moves the tail far past the head.
        // SAFETY: the test owns the memory.
        unsafe { (*h).tail.store(1000, Relaxed) };
        let mut out = [0u8; 16];
        assert_eq!(r.read(&mut out, false), Err(RingError::Corrupt));
        assert_eq!(r.write(b"a"), Err(RingError::Corrupt));
        // SAFETY: as above; now the head runs ahead of the tail.
        unsafe {
            (*h).tail.store(0, Relaxed);
            (*h).head.store(5, Relaxed);
        }
        assert_eq!(r.readable(), Err(RingError::Corrupt));
        // SAFETY: the memory holds the ring; a wrong size is refused.
        assert!(unsafe { Ring::attach(m.as_ptr() as *mut u8, Ring::size(8)) }.is_err());
        // SAFETY: as above, the right size is accepted.
        assert!(unsafe { Ring::attach(m.as_ptr() as *mut u8, Ring::size(16)) }.is_ok());
    }

    /// A socket stand-in: bell bytes queued, and a wait that ends when one is there.
    #[derive(Default)]
    struct Sock {
        bells: Mutex<u32>,
        cv: Condvar,
    }

    impl Sock {
        fn ring(&self) {
            *self.bells.lock().unwrap() += 1;
            self.cv.notify_all();
        }
        /// Sleeps until a bell is there (it stays until taken), or 2 s (a lost wake-up).
        fn wait(&self) -> bool {
            let g = self.bells.lock().unwrap();
            let (g, t) =
                self.cv.wait_timeout_while(g, std::time::Duration::from_secs(2), |b| *b == 0).unwrap();
            drop(g);
            !t.timed_out()
        }
        fn take(&self) -> bool {
            let mut g = self.bells.lock().unwrap();
            if *g > 0 {
                *g -= 1;
                true
            } else {
                false
            }
        }
    }

    /// Two threads stream pseudo-random chunks through a small ring. Both sleep in their
    /// "kernel" (a condvar) after a short spin, as the layer does: if a wake-up were ever
    /// lost, a wait would time out. The consumer also leaves bytes behind at random and
    /// waits as a program would (poll), relying on `ensure_bell`. Bytes must arrive intact.
    #[test]
    fn no_wake_up_is_lost_and_no_byte_either() {
        const TOTAL: u64 = 3_000_000;
        let (m, r) = aligned(97);
        // The producer's own handle on the same ring (as the other process has).
        // SAFETY: the memory holds the ring just made and is leaked (tests only).
        let producer_ring = unsafe { Ring::attach(m.0, Ring::size(97)).unwrap() };
        let m = Arc::new(Mutex::new(m));
        let to_consumer = Arc::new(Sock::default());
        let to_producer = Arc::new(Sock::default());
        let lost = Arc::new(AtomicBool::new(false));
        let (tc, tp, l2) = (to_consumer.clone(), to_producer.clone(), lost.clone());
        let producer = std::thread::spawn(move || {
            let r = producer_ring;
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            let mut sent = 0u64;
            let mut buf = [0u8; 300];
            while sent < TOTAL {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let n = ((x % 300) as usize + 1).min((TOTAL - sent) as usize);
                for (i, b) in buf[..n].iter_mut().enumerate() {
                    *b = ((sent + i as u64) % 251) as u8;
                }
                let mut off = 0;
                while off < n {
                    let w = r.write(&buf[off..n]).unwrap();
                    off += w;
                    if r.after_write() == Bell::Ring {
                        tc.ring();
                    }
                    if w == 0 {
                        if r.before_wait_room().unwrap() == Sleep::Ok && !tp.wait() {
                            l2.store(true, SeqCst);
                            return;
                        }
                        if tp.take() {
                            r.space_bell_taken();
                        }
                        r.room_wait_over();
                    }
                }
                sent += n as u64;
            }
            r.close();
            if r.after_write() == Bell::Ring {
                tc.ring();
            }
        });
        let mut got = 0u64;
        let mut out = [0u8; 173];
        let mut y: u64 = 12345;
        'outer: loop {
            r.awake();
            let mut spins = 0;
            loop {
                y = y.wrapping_mul(6364136223846793005).wrapping_add(1);
                let want = (y >> 33) as usize % out.len() + 1;
                let n = r.read(&mut out[..want], false).unwrap();
                if n > 0 {
                    for (i, b) in out[..n].iter().enumerate() {
                        assert_eq!(*b, ((got + i as u64) % 251) as u8, "byte {} differs", got + i as u64);
                    }
                    got += n as u64;
                    if r.after_read() == Bell::Ring {
                        to_producer.ring();
                    }
                    // Sometimes leave bytes and wait the way a program's poll would.
                    if (y >> 20).is_multiple_of(5) {
                        break;
                    }
                    continue;
                }
                if r.at_end().unwrap() {
                    break 'outer;
                }
                spins += 1;
                if spins > 50 {
                    break;
                }
                std::hint::spin_loop();
            }
            // Sleep: "poll" on the socket.
            if r.before_sleep().unwrap() == Sleep::Ready && r.ensure_bell() == Bell::Ring {
                to_consumer.ring();
            }
            if !to_consumer.wait() {
                lost.store(true, SeqCst);
                break;
            }
            if to_consumer.take() {
                r.bell_taken();
            }
        }
        producer.join().unwrap();
        drop(m);
        assert!(!lost.load(SeqCst), "a wake-up was lost");
        assert_eq!(got, TOTAL);
    }
}
