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
        let Ok(n) = *result else { return };
        let c = &*self.counters;
        match kind {
            IrbKind::Send if n > 0 => {
                c.bytes_sent.fetch_add(n as u64, Relaxed);
                c.msgs_sent.fetch_add(1, Relaxed);
            }
            IrbKind::Receive if n > 0 => {
                c.bytes_received.fetch_add(n as u64, Relaxed);
                c.msgs_received.fetch_add(1, Relaxed);
            }
            _ => {}
        }
    }
}
