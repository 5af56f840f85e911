//! A descriptor's one registration, readable without the registrations' lock.
//!
//! Event loops change a connection's registration around every request: redis-benchmark
//! takes it out of its instance and puts it back, asks for writability and then no more, five
//! `epoll_ctl` calls a request, each time with other events (writability alone, then input
//! alone); UCX and wrk ask for writability around every send. For a connection on TCP with
//! exactly one registration, none of these changes anything but whether the registration is
//! live or dormant (see `FdReg::live`) and which of the bits the layer looks at it asks for, so
//! `note_ctl` answers them from a word per descriptor with one compare-and-swap, where it took
//! the registrations' write lock and three hash lookups.
//!
//! The word of descriptor `fd`:
//!
//! ```text
//!  bits  0..32  the epoll instance (its descriptor)
//!  bit      32  VALID: the word stands for fd's registration (else everything below is void)
//!  bit      33  LIVE: the registration is live (else dormant: taken out, kept for its return)
//!  bits 34..37  the input and end-of-stream bits it asked for (IN, RDNORM, RDHUP)
//!  bits 40..64  a version, one more at every change (a compare-and-swap never takes a word
//!               that changed and changed back)
//! ```
//!
//! and beside it the registration's data. Only `Regs`, under the write lock, makes a word
//! valid (`publish`) or void (`retract`), and it changes the data only while the word is
//! void; the quick paths only change LIVE and the kept bits of a valid word, by
//! compare-and-swap. While a word is valid, its LIVE and bits are the truth for whoever
//! reads the registration (`state`); whoever changes the registration in any other way makes
//! the word void first and keeps what it said (`retract` returns it).

use libc::c_int;
use std::sync::atomic::{fence, AtomicU64, Ordering::*};

/// Descriptors below this have a word.
pub(super) const SHADOW_FDS: usize = 1 << 16;

const VALID: u64 = 1 << 32;
const LIVE: u64 = 1 << 33;
const BITS_SHIFT: u32 = 34;
const BITS_MASK: u64 = 0b111 << BITS_SHIFT;
const VERSION_ONE: u64 = 1 << 40;
const VERSION_MASK: u64 = !((1 << 40) - 1);

const IN: u32 = libc::EPOLLIN as u32;
const RDNORM: u32 = libc::EPOLLRDNORM as u32;
const RDHUP: u32 = libc::EPOLLRDHUP as u32;
const ONESHOT: u32 = libc::EPOLLONESHOT as u32;

/// The bits of a registration's events a word keeps.
pub(super) const KEPT: u32 = IN | RDNORM | RDHUP;

/// The kept bits of `events`, as the word keeps them.
fn looked(events: u32) -> u64 {
    (u64::from(events & IN != 0) | u64::from(events & RDNORM != 0) << 1 | u64::from(events & RDHUP != 0) << 2)
        << BITS_SHIFT
}

/// The events a word's bits stand for.
fn events_of(w: u64) -> u32 {
    let b = (w & BITS_MASK) >> BITS_SHIFT;
    (if b & 1 != 0 { IN } else { 0 })
        | (if b & 2 != 0 { RDNORM } else { 0 })
        | (if b & 4 != 0 { RDHUP } else { 0 })
}

/// What a quick path did with a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Quick {
    /// The call is recorded (or changes nothing the layer keeps).
    Done,
    /// The registrations' lock is needed.
    Slow,
}

/// The words and data of every descriptor below the bound.
pub(super) struct Shadows {
    word: &'static [AtomicU64],
    data: &'static [AtomicU64],
}

static WORDS: [AtomicU64; SHADOW_FDS] = [const { AtomicU64::new(0) }; SHADOW_FDS];
static DATA: [AtomicU64; SHADOW_FDS] = [const { AtomicU64::new(0) }; SHADOW_FDS];

/// The process's words.
pub(super) static SHADOWS: Shadows = Shadows { word: &WORDS, data: &DATA };

impl Shadows {
    /// A table of its own, of `n` descriptors (for the unit tests).
    #[cfg(test)]
    pub(super) fn own(n: usize) -> &'static Shadows {
        let mk = || -> &'static [AtomicU64] { Box::leak((0..n).map(|_| AtomicU64::new(0)).collect()) };
        Box::leak(Box::new(Shadows { word: mk(), data: mk() }))
    }

    fn at(&self, fd: c_int) -> Option<usize> {
        let i = usize::try_from(fd).ok()?;
        (i < self.word.len()).then_some(i)
    }

    /// `epoll_ctl(epfd, op, fd, {events, data})` succeeded for a connection on TCP: recorded
    /// here when the word of `fd` stands for its registration with `epfd` and the call only
    /// takes it out, puts it back with the same data, or changes its events (not to
    /// one-shot).
    #[inline]
    pub(super) fn quick(&self, epfd: c_int, op: c_int, fd: c_int, events: u32, data: u64) -> Quick {
        let Some(i) = self.at(fd) else { return Quick::Slow };
        let w = self.word[i].load(Acquire);
        if w & VALID == 0 || w as u32 != epfd as u32 {
            return Quick::Slow;
        }
        let live = w & LIVE != 0;
        let next = match op {
            libc::EPOLL_CTL_DEL if live => w & !LIVE,
            libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
                // (`ADD` of a live one or `MOD` of a dormant one: the kernel refused it, and
                // the layer is not told; a one-shot registration is armed again with all its
                // events, which the word does not keep.)
                if live != (op == libc::EPOLL_CTL_MOD) || events & ONESHOT != 0 {
                    return Quick::Slow;
                }
                if self.data[i].load(Relaxed) != data {
                    return Quick::Slow;
                }
                let next = (w & !BITS_MASK) | looked(events) | LIVE;
                if next == w {
                    // Nothing changes (writability asked for, or no more): the data read
                    // belongs to the word read if the word is still that one.
                    fence(Acquire);
                    return if self.word[i].load(Relaxed) == w { Quick::Done } else { Quick::Slow };
                }
                next
            }
            _ => return Quick::Slow,
        };
        match self.word[i].compare_exchange(
            w,
            (next & !VERSION_MASK) | ((w & VERSION_MASK).wrapping_add(VERSION_ONE)),
            AcqRel,
            Relaxed,
        ) {
            Ok(_) => Quick::Done,
            Err(_) => Quick::Slow,
        }
    }

    /// The descriptor behind an event of `epfd` with `data`, found without the lock when the
    /// data's low 32 bits are the descriptor's number (as event libraries make it) and the
    /// descriptor's word stands for a registration with `epfd` and that data (the only one
    /// with that data in `epfd`: see `Regs::publish`); and its kept bits.
    #[inline]
    pub(super) fn find(&self, epfd: c_int, data: u64) -> Option<(c_int, u32)> {
        let fd = data as u32 as c_int;
        let i = self.at(fd)?;
        let w = self.word[i].load(Acquire);
        if w & VALID == 0 || w as u32 != epfd as u32 || self.data[i].load(Relaxed) != data {
            return None;
        }
        fence(Acquire);
        (self.word[i].load(Relaxed) == w).then(|| (fd, events_of(w)))
    }

    /// Whether `fd`'s registration with `epfd` is live, and its kept bits (`KEPT`), if the
    /// word stands for it.
    pub(super) fn state(&self, fd: c_int, epfd: c_int) -> Option<(bool, u32)> {
        let w = self.word[self.at(fd)?].load(Acquire);
        (w & VALID != 0 && w as u32 == epfd as u32).then(|| (w & LIVE != 0, events_of(w)))
    }

    /// Whether `fd`'s registration with `epfd` is live, if the word stands for it.
    pub(super) fn live(&self, fd: c_int, epfd: c_int) -> Option<bool> {
        self.state(fd, epfd).map(|s| s.0)
    }

    /// The word of `fd` is void from now on (its version kept); returned: the instance it
    /// stood for, whether that registration was live, and its kept bits.
    pub(super) fn retract(&self, fd: c_int) -> Option<(c_int, bool, u32)> {
        let i = self.at(fd)?;
        let mut w = self.word[i].load(Relaxed);
        loop {
            if w & VALID == 0 {
                return None;
            }
            let void = (w & VERSION_MASK).wrapping_add(VERSION_ONE);
            match self.word[i].compare_exchange_weak(w, void, AcqRel, Relaxed) {
                Ok(_) => return Some((w as u32 as c_int, w & LIVE != 0, events_of(w))),
                Err(now) => w = now,
            }
        }
    }

    /// The word of `fd` stands for its one registration, with `epfd`, `data` and `events`
    /// (the caller holds the lock and retracted the word first).
    pub(super) fn publish(&self, fd: c_int, epfd: c_int, data: u64, events: u32, live: bool) {
        let Some(i) = self.at(fd) else { return };
        if epfd < 0 || events & ONESHOT != 0 {
            return;
        }
        let w = self.word[i].load(Relaxed);
        debug_assert!(w & VALID == 0, "published over a valid word");
        self.data[i].store(data, Relaxed);
        let word = ((w & VERSION_MASK).wrapping_add(VERSION_ONE))
            | looked(events)
            | if live { LIVE } else { 0 }
            | VALID
            | u64::from(epfd as u32);
        self.word[i].store(word, Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libc::{EPOLL_CTL_ADD as ADD, EPOLL_CTL_DEL as DEL, EPOLL_CTL_MOD as MOD};

    const OUT: u32 = libc::EPOLLOUT as u32;

    #[test]
    fn the_calls_around_a_request_are_answered_without_the_lock() {
        let s = Shadows::own(16);
        assert_eq!(s.quick(3, MOD, 7, IN, 9), Quick::Slow, "nothing published");
        s.publish(7, 3, 9, IN, true);
        assert_eq!(s.live(7, 3), Some(true));
        assert_eq!(s.live(7, 4), None, "another instance");
        // Writability on and off: nothing the layer keeps.
        assert_eq!(s.quick(3, MOD, 7, IN | OUT, 9), Quick::Done);
        assert_eq!(s.quick(3, MOD, 7, IN, 9), Quick::Done);
        assert_eq!(s.state(7, 3), Some((true, IN)));
        // Writability alone, then input and the peer's end: kept.
        assert_eq!(s.quick(3, MOD, 7, OUT, 9), Quick::Done);
        assert_eq!(s.state(7, 3), Some((true, 0)));
        assert_eq!(s.quick(3, MOD, 7, IN | RDHUP | OUT, 9), Quick::Done);
        assert_eq!(s.state(7, 3), Some((true, IN | RDHUP)));
        assert_eq!(s.quick(3, MOD, 7, IN, 9), Quick::Done);
        // Taken out and put back.
        assert_eq!(s.quick(3, DEL, 7, 0, 0), Quick::Done);
        assert_eq!(s.live(7, 3), Some(false));
        assert_eq!(s.quick(3, DEL, 7, 0, 0), Quick::Slow, "already dormant");
        assert_eq!(s.quick(3, MOD, 7, IN, 9), Quick::Slow, "a dormant one is not modified");
        assert_eq!(s.quick(3, ADD, 7, OUT, 9), Quick::Done, "put back for writability alone");
        assert_eq!(s.state(7, 3), Some((true, 0)));
        assert_eq!(s.quick(3, ADD, 7, IN, 9), Quick::Slow, "a live one is not added");
    }

    #[test]
    fn an_event_whose_data_is_its_descriptor_is_found_without_the_lock() {
        let s = Shadows::own(16);
        assert_eq!(s.find(3, 7), None);
        s.publish(7, 3, 7, IN | RDHUP, true);
        assert_eq!(s.find(3, 7), Some((7, IN | RDHUP)));
        assert_eq!(s.find(4, 7), None, "another instance");
        assert_eq!(s.find(3, 7 | 1 << 40), None, "other data");
        s.retract(7);
        assert_eq!(s.find(3, 7), None);
        // Data that is not the descriptor's number: the lock's map finds it.
        s.publish(8, 3, 0x7f00_1234_5678, IN, true);
        assert_eq!(s.find(3, 0x7f00_1234_5678), None);
        // The low half is taken as the number; the whole must match.
        s.publish(9, 3, 9 | 1 << 33, IN, true);
        assert_eq!(s.find(3, 9 | 1 << 33), Some((9, IN)));
        assert_eq!(s.find(3, 9), None);
    }

    #[test]
    fn anything_else_takes_the_lock() {
        let s = Shadows::own(16);
        s.publish(7, 3, 9, IN, true);
        assert_eq!(s.quick(3, MOD, 7, IN, 10), Quick::Slow, "other data");
        assert_eq!(s.quick(3, MOD, 7, IN | ONESHOT, 9), Quick::Slow, "one-shot");
        assert_eq!(s.quick(4, MOD, 7, IN, 9), Quick::Slow, "another instance");
        assert_eq!(s.quick(3, MOD, 8, IN, 9), Quick::Slow, "another descriptor");
        assert_eq!(s.quick(3, MOD, 99, IN, 9), Quick::Slow, "beyond the table");
        assert_eq!(s.quick(3, MOD, -1, IN, 9), Quick::Slow);
        s.quick(3, DEL, 7, 0, 0);
        assert_eq!(s.quick(3, ADD, 7, IN, 10), Quick::Slow, "put back with other data");
        assert_eq!(s.quick(3, ADD, 7, IN | ONESHOT, 9), Quick::Slow, "put back one-shot");
        // A one-shot registration is never published.
        s.retract(7);
        s.publish(7, 3, 9, IN | ONESHOT, true);
        assert_eq!(s.live(7, 3), None);
    }

    #[test]
    fn a_retracted_word_says_what_it_held_and_stands_for_nothing() {
        let s = Shadows::own(16);
        assert_eq!(s.retract(7), None);
        s.publish(7, 3, 9, IN, true);
        s.quick(3, DEL, 7, 0, 0);
        assert_eq!(s.retract(7), Some((3, false, IN)));
        assert_eq!(s.retract(7), None);
        assert_eq!(s.live(7, 3), None);
        assert_eq!(s.quick(3, ADD, 7, IN, 9), Quick::Slow);
        // Published again with other data: the old data is not taken.
        s.publish(7, 3, 11, IN | RDHUP, false);
        assert_eq!(s.quick(3, ADD, 7, IN | RDHUP, 9), Quick::Slow);
        assert_eq!(s.quick(3, ADD, 7, IN | RDHUP, 11), Quick::Done);
        assert_eq!(s.state(7, 3), Some((true, IN | RDHUP)));
    }

    #[test]
    fn flips_from_many_threads_are_each_taken_once() {
        // Threads take the registration out and put it back as fast as they can; a flip
        // is taken only from the state it expects, so the dels and adds that succeed
        // alternate, and the word ends live exactly when the adds match the dels.
        let s = Shadows::own(4);
        s.publish(1, 3, 5, IN, true);
        let (dels, adds) = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    sc.spawn(|| {
                        let (mut d, mut a) = (0u64, 0u64);
                        for _ in 0..20_000 {
                            d += u64::from(s.quick(3, DEL, 1, 0, 0) == Quick::Done);
                            a += u64::from(s.quick(3, ADD, 1, IN, 5) == Quick::Done);
                        }
                        (d, a)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).fold((0, 0), |x, y| (x.0 + y.0, x.1 + y.1))
        });
        assert!(dels > 0);
        assert_eq!(s.live(1, 3), Some(dels == adds));
        assert!(dels == adds || dels == adds + 1);
    }
}
