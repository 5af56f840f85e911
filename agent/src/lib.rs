//! # vmi-agent
//!
//! One agent per node. It knows the node's processes under the layer and their listeners,
//! answers the node's layers ("is this destination a listener under the layer?", "is this
//! accepted connection virtual?") and the agents of other nodes, and reports every virtual
//! connection of the node to `vmictl` from the statistics tables the processes share with it.
//!
//! * [`cluster`]: commands run on other nodes, and the status of the whole cluster.
//! * [`hier`]: cluster heads (summaries pushed to them, queries answered from them) and grid
//!   views over several clusters.
//! * [`config`]: the agent's settings: configuration file, environment, command line.
//! * [`directory`]: listeners and expected connections, no I/O (unit-tested).
//! * [`local`]: the Unix socket the node's layers and `vmictl` talk to (abstract, so each
//!   network namespace has its own agent).
//! * [`peer`]: the TCP port other nodes' agents talk to, and the client side of it.
//! * [`ports`]: source ports that come after the announcement of a connection.
//! * [`paths`]: the node's networks and the health of every path to other nodes.
//! * [`events`]: each process's event channel (path changes, rebuilt links handed over).
//! * [`journal`]: the node's events (`vmictl events`).
//! * [`status`]: the processes' statistics tables and the JSON report.
//! * [`registry`]: the cluster directory in etcd (`--directory`), on a thread of its own.
//! * [`sweep`]: shared-memory offers left by processes that died before they were taken.
//! * [`mesh`]: the cluster key, the encrypted agent channel, sealed heartbeats.
//! * [`metrics`]: Prometheus metrics (`--metrics`).
//! * [`web`]: the cluster in a browser (`--web`).
//! * [`notify`]: readiness for systemd (`Type=notify`).
//! * [`wire`]: reading and writing agent messages on a stream.

pub mod accepts;
pub mod cluster;
pub mod config;
pub mod directory;
pub mod events;
pub mod hier;
pub mod journal;
pub mod local;
pub mod mesh;
pub mod metrics;
pub mod migrate;
pub mod net;
pub mod notify;
pub mod paths;
pub mod peer;
pub mod ports;
pub mod profile_view;
pub mod registry;
pub mod relinks;
pub mod sinks;
pub mod status;
pub mod sweep;
pub mod tickets;
pub mod web;
pub mod wire;

/// Default abstract Unix socket name (the layer's `VMI_AGENT_SOCKET` default too).
pub const DEFAULT_SOCKET: &str = "vmi-agent";
/// Default TCP port for agent-to-agent traffic.
pub const DEFAULT_PORT: u16 = 7787;
