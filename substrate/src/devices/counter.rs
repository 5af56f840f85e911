//! A filter that counts the bytes and messages that really moved (it counts in its
//! completion routine, so a send the sink refused is not counted).

use crate::irb::{Device, IrbKind, IrbResult};
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Counters of one connection. `repr(C)` so they can live in a shared statistics table.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Counters {
    /// Application bytes sent.
    pub bytes_sent: AtomicU64,
    /// Application bytes received.
    pub bytes_received: AtomicU64,
    /// Completed send calls.
    pub msgs_sent: AtomicU64,
    /// Completed receive calls that returned data.
    pub msgs_received: AtomicU64,
}

impl Counters {
    /// A call of `kind` completed with `result`: counted if it moved bytes. Each counter has
    /// one writer (a connection's send chain under its send lock, its receive chain under
    /// its receive lock, or a call that skips the chain under the same lock), so a plain add
    /// is enough, and readers see whole values.
    #[inline]
    pub fn note(&self, kind: IrbKind, result: &IrbResult) {
        let Ok(n) = *result else { return };
        let add = |a: &AtomicU64, v: u64| a.store(a.load(Relaxed).wrapping_add(v), Relaxed);
        match kind {
            IrbKind::Send if n > 0 => {
                add(&self.bytes_sent, n as u64);
                add(&self.msgs_sent, 1);
            }
            IrbKind::Receive if n > 0 => {
                add(&self.bytes_received, n as u64);
                add(&self.msgs_received, 1);
            }
            _ => {}
        }
    }
}

/// Counts traffic into `C`'s counters (an `Arc<Counters>`, or a reference into shared memory).
pub struct CounterFilter<C> {
    counters: C,
}

impl<C: Deref<Target = Counters>> CounterFilter<C> {
    /// A filter counting into `counters`.
    pub fn new(counters: C) -> Self {
        CounterFilter { counters }
    }
    /// The counters.
    pub fn get_ref(&self) -> &Counters {
        &self.counters
    }
}

impl<C: Deref<Target = Counters> + Send> Device for CounterFilter<C> {
    fn name(&self) -> &'static str {
        "counter"
    }

    fn on_complete(&mut self, kind: IrbKind, result: &IrbResult) {
        self.counters.note(kind, result);
    }
}
