//! Devices that sit on chains: filters that look at or change IRBs, and sinks that move the
//! bytes. The kernel-TCP sink lives in the preload library (it owns the socket); these are
//! the devices with no I/O of their own.

pub mod counter;
pub mod fault;
pub mod loopback;

pub use counter::{CounterFilter, Counters};
pub use fault::FaultInjector;
pub use loopback::LoopbackSink;
