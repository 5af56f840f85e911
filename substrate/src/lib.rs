//! # vmi substrate
//!
//! The core of vmi, with no system calls inside: everything here takes bytes and time as
//! arguments, so it can be unit-tested, simulated and fuzzed.
//!
//! How a byte travels, top to bottom:
//!
//! ```text
//!  application send(buf)
//!        |
//!   [irb]  Irb::send(buf) ──► send Chain: filters (counter, ...) ──► sink device
//!        |                                                           |
//!   [reliability]  TxState: frame header (seq, piggy-backed ack), copy into the replay ring
//!        |                                                           |
//!   [wire::frame]  24-byte header + payload on the physical link (kernel TCP today)
//!        |
//!   peer: RxState parses headers out of the link straight into the application's buffer,
//!         counts delivered bytes (that is what it acknowledges), and hands acks to its TxState
//! ```
//!
//! * [`wire`]: the frame header and the agent protocol.
//! * [`connection`]: the connection core with no I/O (stream, acks, replay, window, end of
//!   stream, several links at once), which the data path is moving onto.
//! * [`auth`]: SHA-256, HMAC and the proofs that authenticate a resumed connection.
//! * [`reliability`]: sequence numbers, acks, replay ring, window, resync.
//! * [`irb`]: IRBs and device chains (VMI 2.0's model).
//! * [`devices`]: filters and test sinks.
//! * [`mx`]: a Myrinet-style messaging protocol over raw Ethernet (message classes, pull for
//!   large messages, its own acknowledgement and retransmission).
//! * [`shmring`]: a shared-memory byte ring and its doorbell protocol (the shared-memory sink's core).
//! * [`seccomp`]: seccomp filters read and run as the kernel does (what a sandboxed program lets
//!   the layer do).
//! * [`procfs`]: the `/proc` text the layer reads about its own process.
//! * [`gid`]: global connection identities.
//! * [`stats`]: the statistics table shared between a process and its agent.

#![warn(missing_docs)]

pub mod accepts;
pub mod auth;
pub mod connection;
pub mod devices;
pub mod gid;
pub mod handover;
pub mod irb;
pub mod mx;
pub mod procfs;
pub mod reliability;
pub mod seccomp;
pub mod shmring;
pub mod stats;
pub mod wire;

pub use gid::Gid;
