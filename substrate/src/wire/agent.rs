//! Messages between a layer and its node agent (over the agent's Unix socket) and between
//! agents (over TCP). Each message travels as a little-endian `u32` body length, then the
//! body: a tag byte and the fields in order. Addresses are a family byte (4 or 6), the IP
//! bytes and a `u16` port.
//!
//! The decoder refuses anything malformed with an [`AgentWireError`] and never allocates more
//! than the stated body length, which is itself bounded by [`MAX_BODY`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Largest body accepted (a status reply for tens of thousands of connections fits).
pub const MAX_BODY: usize = 64 << 20;

/// How long a layer waits for its agent's answer to a `Connect` (the agent may have to reach
/// another node's agent first, and gives it less than this), in milliseconds. Other requests
/// are answered from the agent's own state and get a second.
pub const CONNECT_WAIT_MS: u64 = 3000;

/// A message on an agent socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Layer → agent: a process under the layer introduces itself (its statistics table
    /// travels beside this message as a file descriptor).
    Hello {
        /// The process id.
        pid: u32,
        /// The program's name.
        name: String,
    },
    /// Layer → agent: a socket under the layer listens at `addr`.
    Listen {
        /// Listening address (the IP may be unspecified).
        addr: SocketAddr,
        /// The listening process's window (its accepted connections use it).
        window: u64,
    },
    /// Layer → agent: the listener at `addr` is closed.
    Unlisten {
        /// Listening address.
        addr: SocketAddr,
    },
    /// Layer → local agent, and agent → the destination's agent: a connection from `src` to
    /// `dst` is about to be made; if `dst` is a listener under the layer, expect it as the
    /// virtual connection `gid`.
    Connect {
        /// Source address (layer → agent: the IP may be unspecified).
        src: SocketAddr,
        /// Destination address.
        dst: SocketAddr,
        /// The new connection's identity.
        gid: u128,
        /// Secret that authenticates the connection's ends later.
        secret: u128,
        /// The connecting side's window.
        window: u64,
        /// The destination the program asked for, when the connection is made to another
        /// address of the same node (its network is down): what the accepting program must
        /// see as its local address. Equal to `dst` otherwise.
        aim: SocketAddr,
        /// Agent → agent: where the connecting node's agent can be reached, one address per
        /// network (the accepting side dials them if it has to rebuild the link). Empty
        /// from a layer.
        agents: Vec<SocketAddr>,
    },
    /// Layer → agent: a listener accepted a connection from `peer`; is it virtual?
    Accept {
        /// The accepted socket's local address.
        local: SocketAddr,
        /// The peer's address.
        peer: SocketAddr,
    },
    /// Layer → agent, not answered: a listener accepted the connection `gid` from `peer`,
    /// found in the process's table of announced connections (`crate::accepts`) rather than
    /// asked about with [`Msg::Accept`]. (On the event channel, kept back a little with
    /// others, since 2026-11-28; before, on the request socket, which agents still take.)
    Accepted {
        /// The accepted socket's local address.
        local: SocketAddr,
        /// The peer's address.
        peer: SocketAddr,
        /// The connection's GID, as the table gave it.
        gid: u128,
    },
    /// Layer → agent, not answered: the process's table of announced connections
    /// (`crate::accepts`) rides with this message as a passed descriptor.
    Table,
    /// Answer: the connection is virtual.
    Virtual {
        /// Its identity.
        gid: u128,
        /// Its secret.
        secret: u128,
        /// The other side's window.
        window: u64,
        /// Where the other side's node agent can be reached, one address per network (the
        /// connecting side dials them to rebuild the link after a failure).
        addrs: Vec<SocketAddr>,
        /// To a connecting layer: the address to connect to instead of the program's (its
        /// network is down). To an accepting layer: the address the connecting program
        /// asked for, to show as the local address. Port 0: none.
        alias: SocketAddr,
    },
    /// Answer: plain TCP.
    Plain,
    /// Answer: done.
    Ok,
    /// Answer: the request failed.
    Error {
        /// Why.
        reason: String,
    },
    /// `vmictl` → agent: report everything.
    Status,
    /// Agent → `vmictl`: the report, as JSON.
    StatusReply {
        /// JSON document.
        json: String,
    },
    /// Dialer → the holder's node agent, first message on a new link: rebuild the link of
    /// virtual connection `gid` (the agent hands the socket to the process holding it).
    Resume {
        /// The connection.
        gid: u128,
        /// The dialer's fresh nonce.
        nonce: u128,
        /// True when the dialer is the side that connected (both ends may live on one
        /// node: the link goes to the other one).
        from_active: bool,
    },
    /// Holder → dialer: the holder's fresh nonce.
    Challenge {
        /// Nonce.
        nonce: u128,
    },
    /// Dialer → holder: bytes of the holder's stream the dialer delivered, with its proof of
    /// the secret ([`crate::auth::resume_mac`]).
    Proof {
        /// Bytes delivered.
        delivered: u64,
        /// Proof (it covers `agents` too).
        mac: u128,
        /// Where the dialer's node agent can be reached now, one address per network (the
        /// dialer may have moved to another node).
        agents: Vec<SocketAddr>,
        /// The dialer offers shared memory for the new link (both ends are on one node).
        shm: bool,
    },
    /// Holder → dialer: the proof was right; bytes of the dialer's stream the holder
    /// delivered, with the holder's proof.
    Ready {
        /// Bytes delivered.
        delivered: u64,
        /// Proof (it covers `agents` too).
        mac: u128,
        /// Where the holder's node agent can be reached now.
        agents: Vec<SocketAddr>,
        /// Bytes of its stream the holder has sent so far (with `delivered` of the proof,
        /// how much it replays: for reports).
        sent: u64,
        /// The holder answers the dialer's shared-memory offer (accepted or refused in the
        /// offer's header); false: it did not look at it, the link is TCP.
        shm: bool,
    },
    /// Layer → agent, first message on a process's event channel (agent → layer notices).
    Events {
        /// The process id.
        pid: u32,
    },
    /// Layer → agent (event channel): this process holds virtual connection `gid`.
    Hold {
        /// The connection.
        gid: u128,
        /// True when this process's side connected.
        active: bool,
    },
    /// Layer → agent (event channel): this process no longer holds `gid` (either side; a
    /// layer before 2026-11-28 says only this).
    Release {
        /// The connection.
        gid: u128,
    },
    /// Layer → agent (event channel): this process no longer holds side `active` of `gid`
    /// (a process connected to its own listener holds both ends, each with its side).
    ReleaseSide {
        /// The connection.
        gid: u128,
        /// True for the connecting side's end.
        active: bool,
    },
    /// Agent → layer (event channel): the network path from `local` to `peer` (IPs; ports
    /// are 0) stopped working, or works again (`up`).
    Path {
        /// Local address of the path.
        local: SocketAddr,
        /// Peer node's address of the path.
        peer: SocketAddr,
        /// True when the path works again.
        up: bool,
    },
    /// Agent → layer (event channel): a new link for `gid`, its socket passed beside this
    /// message; the dialer's `Resume` nonce.
    Handover {
        /// The connection.
        gid: u128,
        /// The dialer's nonce.
        nonce: u128,
    },
    /// Layer → agent: which paths to the node reachable at `peers` work now?
    Paths {
        /// The peer node's agent addresses.
        peers: Vec<SocketAddr>,
        /// The connection whose link is rebuilt (its GID picks one of the peer agent's
        /// relink ports); 0: none (the agent port only).
        gid: u128,
    },
    /// Agent → layer: working paths, best first, as (local IP, peer agent address).
    PathList {
        /// The paths.
        pairs: Vec<(SocketAddr, SocketAddr)>,
    },
    /// `vmictl` → agent: take a network out of service (`up` false) or put it back.
    Net {
        /// Interface name or one of the node's addresses.
        name: String,
        /// Back in service.
        up: bool,
    },
    /// Layer → agent (event channel), at the exit of a process: a closed connection's socket
    /// rides along; the agent keeps it until the peer closes too, so the peer's last acks do
    /// not reach an orphaned socket (whose kernel would reset the connection).
    Linger {
        /// The connection.
        gid: u128,
    },
    /// `vmi-migrate` → agent: get process `pid` ready for a checkpoint. The agent tells the
    /// process (event channel, same message), which closes its agent sockets and answers
    /// `Ok`; connections it holds are then answered "moved" to dialers until it comes back.
    Freeze {
        /// The process.
        pid: u32,
    },
    /// Answer to `Freeze` (agent → `vmi-migrate`): the process is ready; its listeners.
    Frozen {
        /// Listening addresses the process had registered here.
        listeners: Vec<SocketAddr>,
    },
    /// `vmi-migrate` → the process itself (its thaw socket), after the checkpoint: go on.
    Thaw {
        /// The process (a check).
        pid: u32,
    },
    /// Process → `vmi-migrate`: back in service (answered once every connection that had to
    /// be rebuilt is, or after a time-out).
    Thawed {
        /// True when the process found itself restored (its old sockets were gone).
        moved: bool,
        /// Virtual connections held.
        conns: u32,
        /// Links rebuilt.
        rebuilt: u32,
        /// Connections that could not be rebuilt (yet).
        waiting: u32,
        /// Bytes replayed on the rebuilt links (both directions as this side sent them).
        replayed: u64,
        /// Milliseconds from the thaw to the last link rebuilt.
        ms: u32,
    },
    /// `vmi-migrate` → the agent of the node a process left: its listeners now live at the
    /// node whose agents are at `to`; forward new connections there. Its connections are
    /// no longer here (dialers are told "moved").
    Moved {
        /// The process.
        pid: u32,
        /// Listening addresses it had here.
        listeners: Vec<SocketAddr>,
        /// The new node's agent addresses.
        to: Vec<SocketAddr>,
    },
    /// `vmi-migrate` → agent: the process `pid` comes back here (its checkpoint failed):
    /// forget that it was frozen.
    Unfreeze {
        /// The process.
        pid: u32,
    },
    /// Layer or `vmi-migrate` → agent: where can this node's agent be reached?
    WhereAmI,
    /// Answer to `WhereAmI`: one address per network in service.
    Here {
        /// Agent addresses.
        addrs: Vec<SocketAddr>,
    },
    /// `vmictl` → agent, and agent → the layer (event channel): move connection `gid` to
    /// shared memory (`shm`, when both ends are on one node) or to TCP, now and after any
    /// later rebuild of its link.
    Move {
        /// The connection.
        gid: u128,
        /// Shared memory (true) or TCP (false).
        shm: bool,
    },
    /// `vmictl` → its node's agent: pass the command `cmd` (an encoded message) to the agent
    /// of node `to` (a node name or an address) and answer with what that agent answered.
    Remote {
        /// The node: its name in reports, or one of its addresses.
        to: String,
        /// The command, encoded with its length prefix.
        cmd: Vec<u8>,
    },
    /// Agent → agent (cluster channel): run `cmd` for the user `uid` of the asking node (the
    /// asking agent read it from the kernel); root there is root here.
    AsUser {
        /// The user on the asking node.
        uid: u32,
        /// The command, encoded with its length prefix.
        cmd: Vec<u8>,
    },
    /// `vmictl` → agent: the status of every node this agent knows, as one JSON report.
    ClusterStatus,
    /// `vmictl` → agent: where the ends of connection `gid` live, by the cluster directory
    /// (answered with a `StatusReply`, or an `Error` when no directory answers).
    Locate {
        /// The connection.
        gid: u128,
    },
    /// `vmictl` → agent: the node's events after number `after`, each as a `Happened`; then
    /// `Ok`, or (with `follow`) every later event as it happens.
    Watch {
        /// Events after this number (0: all kept).
        after: u64,
        /// Keep sending new events.
        follow: bool,
    },
    /// Agent → `vmictl`: one event, as JSON.
    Happened {
        /// The event.
        json: String,
    },
    /// Agent → agent over UDP, on every network path: a heartbeat (sealed with the
    /// cluster's key on the wire).
    Probe {
        /// The sender's node name.
        node: String,
        /// Heartbeat number.
        seq: u64,
        /// The sender's random start-up number (heartbeat numbers restart with it).
        boot: u64,
        /// The last `boot` heard from the receiver on this path (0: none yet).
        echo_boot: u64,
        /// The last `seq` heard from the receiver on this path: proves the heartbeat is
        /// new, not a recording.
        echo_seq: u64,
        /// The longest the sender will wait before its next heartbeat on this path, in
        /// milliseconds (longer while its node is idle).
        every_ms: u32,
    },
    /// Agent → agent (inside `AsUser`), or run on this node: the node's events after number
    /// `after` that the user may see, answered with a `StatusReply` holding
    /// `{node, boot, last, events}`.
    Journal {
        /// Events after this number (0: all kept).
        after: u64,
    },
    /// `vmictl` → agent: the events of node `to` (a name or an address), or of every node
    /// of the cluster (`to` empty), each as a `Happened` naming its node; then `Ok`, or
    /// (with `follow`) every later event as it happens.
    WatchCluster {
        /// The node, or empty for the whole cluster.
        to: String,
        /// Keep sending new events.
        follow: bool,
    },
    /// Agent → its cluster head (inside `AsUser`): a summary of the node (its status, the
    /// owners of its processes, its latest events), as JSON; answered with a `StatusReply`.
    Summary {
        /// The summary.
        json: String,
    },
    /// Agent → its cluster head (inside `AsUser`): the status of every node the head holds,
    /// as `ClusterStatus` answers it (`brief`: a line of figures per node).
    HeadStatus {
        /// Figures per node instead of each node's whole report.
        brief: bool,
    },
    /// Agent → its cluster head (inside `AsUser`): the events of every node the head holds
    /// after the head's number `after`.
    HeadEvents {
        /// Events after this number of the head's (0: all it holds).
        after: u64,
    },
    /// `vmictl` → agent: the status of every cluster of the agent's grid view.
    GridStatus,
    /// Layer → agent (event channel): a link of `gid` was rebuilt after a failure.
    Relinked {
        /// The connection.
        gid: u128,
        /// Milliseconds from the moment this side saw the link fail to the rebuilt link.
        stall_ms: u32,
        /// Bytes this side sends again on the new link (the peer had not delivered them).
        replayed: u64,
        /// True when this side dialed the new link (false: the peer's node handed it over).
        dialer: bool,
        /// The new link's local address.
        local: SocketAddr,
        /// The new link's peer address.
        peer: SocketAddr,
    },
    /// Layer → its agent, and agent → the agent that took the `Connect`: the ports the
    /// kernel chose at `connect` for connections announced without one (source port 0). Not
    /// answered when a layer sends it (the layer does not wait); `Ok` between agents.
    Bound {
        /// Each connection and its source address as the kernel bound it.
        ports: Vec<(u128, SocketAddr)>,
    },
    /// `vmictl` → agent (or an agent → agent, inside `AsUser`): move process `pid` of this
    /// node to host `to` with CRIU (the agent runs vmi-migrate); answered with its report
    /// (`StatusReply`) or an `Error`.
    Migrate {
        /// The process.
        pid: u32,
        /// Where it goes (as vmi-migrate's `--to`).
        to: String,
    },
    /// `vmictl` → agent, and agent → the layer (event channel): put the chain of filters
    /// `spec` (names separated by commas, empty for none) on what each end of connection
    /// `gid` on this node sends, at the next frame boundary both layers agree on.
    Chain {
        /// The connection.
        gid: u128,
        /// The chain's description.
        spec: String,
    },
    /// `vmictl device load|unload` → agent: put device `name` on (or take it off) both
    /// directions of connection `gid` (when not 0), of every connection of process `pid`
    /// (when not 0), or of every connection on the node the asker may manage (both 0).
    /// Agent → the layer: the same for one connection (`gid`); the agent answers `vmictl`
    /// with [`Msg::DeviceReply`].
    Device {
        /// Load (true) or unload.
        load: bool,
        /// The device (a filter's name).
        name: String,
        /// The connection, or 0.
        gid: u128,
        /// The process, or 0.
        pid: u32,
    },
    /// Agent → `vmictl`: a `Device` command was passed to the layers of `conns` connections.
    DeviceReply {
        /// How many.
        conns: u32,
    },
    /// `vmictl profile` → agent: the profile of connection `gid` (the `profile` device's
    /// histograms). Agent → the layer holding it, with the write end of a pipe: write the
    /// profile there as JSON and close it. The agent answers with [`Msg::ProfileReply`].
    Profile {
        /// The connection.
        gid: u128,
    },
    /// Agent → `vmictl`: the profile, as JSON.
    ProfileReply {
        /// The profile.
        json: String,
    },
    /// `vmictl capture` → agent, with the file to write (a descriptor `vmictl` opened):
    /// capture the traffic of connection `gid` as its program sees it, as pcapng, for
    /// `duration_ms`. Agent → the layer holding it: the same, with the descriptor.
    Capture {
        /// The connection.
        gid: u128,
        /// For how long.
        duration_ms: u32,
    },
    /// Layer → agent: does this node have devices of sink `name` (a sink plug-in the agent
    /// probed at start)? Answered with [`Msg::SinkReply`].
    Sink {
        /// The sink.
        name: String,
    },
    /// Agent → layer: the node's devices of the sink asked for (0: none, negative: the sink
    /// cannot work here or is not installed), and what the probe said.
    SinkReply {
        /// How many.
        devices: i32,
        /// The probe's words.
        why: String,
    },
    /// Layer → agent (event channel): the program ended the stream it sends on connection
    /// `gid` at offset `at`; agent → a layer rebuilding a link (instead of a challenge): no
    /// process here holds the connection any more, and its stream had ended at `at`. The
    /// proof is [`crate::auth::ended_mac`], made by the layer with the connection's secret.
    Ended {
        /// The connection.
        gid: u128,
        /// The stream's length.
        at: u64,
        /// The stream is the one the connecting side sends.
        from_active: bool,
        /// The proof.
        mac: u128,
    },
    /// Agent → the layer, the answer to its `Hello`: the node's default chains (the rules of
    /// `connection::chain::Policy`, separated by `;`; empty: none) and the block of source
    /// ports the node's layers bind connections to before `connect` (`ports` from
    /// `first_port` on; 0: no block).
    Welcome {
        /// The node's default chains.
        chain: String,
        /// First port of the block.
        first_port: u16,
        /// How many ports.
        ports: u16,
    },
    /// Agent → agent: this node's layers will announce their connections to the listener
    /// that takes `listener` with [`Msg::Expect`], without waiting for an answer, each
    /// from a source port of the block given (`ports` from `first_port` on). Answered
    /// [`Msg::Ok`] (the node will hold the accept of a connection from such a port until
    /// its announcement comes, and tells the asking agent with [`Msg::Unlisten`] once the
    /// listener is gone), or [`Msg::Plain`] (no listener under the layer takes it).
    Subscribe {
        /// The destination connections are made to.
        listener: SocketAddr,
        /// First port of the asking node's block.
        first_port: u16,
        /// How many ports.
        ports: u16,
    },
    /// Agent → agent: a connection to a listener the sender subscribed to is on its way
    /// (the fields of [`Msg::Connect`]). Never answered.
    Expect {
        /// Source address (its port from the sender's block).
        src: SocketAddr,
        /// Destination address.
        dst: SocketAddr,
        /// The connection's identity.
        gid: u128,
        /// Its secret.
        secret: u128,
        /// The connecting side's window.
        window: u64,
        /// As in [`Msg::Connect`].
        aim: SocketAddr,
        /// The connecting node's agent addresses.
        agents: Vec<SocketAddr>,
    },
    /// Layer → agent: identities for later connections to listener `dst` on another node,
    /// agreed ahead with its agent (see [`Msg::TicketBook`]); `returned` names tickets the
    /// layer will not use (their port was taken, or they grew too old). Answered with a
    /// [`Msg::TicketBook`], or [`Msg::Plain`] when there are none to give.
    Tickets {
        /// The listener.
        dst: SocketAddr,
        /// How many tickets the layer would like.
        want: u16,
        /// The layer's window (announced with each ticket).
        window: u64,
        /// GIDs of tickets given back unused.
        returned: Vec<u128>,
        /// GIDs of tickets whose port is held by a socket in TIME_WAIT (a bind failed, or this
        /// side closed the connection first): not to be given again for a minute.
        busy: Vec<u128>,
    },
    /// Agent → layer: tickets for connections to `dst`, each (source port, GID, secret),
    /// already announced to the listener's agent: a connection bound to a ticket's port and
    /// made within `use_ms` is virtual without asking anyone. `window` and `addrs` are the
    /// listener's window and its node's agents, as in [`Msg::Virtual`].
    TicketBook {
        /// The listener.
        dst: SocketAddr,
        /// The source address the tickets were announced with (port 0): the layer binds it
        /// with the ticket's port.
        src: SocketAddr,
        /// The listener's window.
        window: u64,
        /// The listener's node's agent addresses.
        addrs: Vec<SocketAddr>,
        /// How long the tickets may be used, from when they arrive (milliseconds).
        use_ms: u32,
        /// Source port, GID, secret.
        tickets: Vec<(u16, u128, u128)>,
    },
    /// Layer → agent (event channel, kept back a little with others): the connection of
    /// ticket `gid` was made from `local`. Never answered.
    Used {
        /// The ticket's GID.
        gid: u128,
        /// The connection's local address.
        local: SocketAddr,
    },
    /// Agent → agent: connections to `dst` that may come from the sender's node, announced
    /// ahead (tickets): each (source address, GID, secret); the other fields as in
    /// [`Msg::Expect`]. Never answered.
    Expects {
        /// Destination address.
        dst: SocketAddr,
        /// The connecting side's window.
        window: u64,
        /// The connecting node's agent addresses.
        agents: Vec<SocketAddr>,
        /// Source address, GID, secret.
        entries: Vec<(SocketAddr, u128, u128)>,
    },
}

/// Why a message was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentWireError {
    /// The body ended before a field did.
    Truncated,
    /// The stated body length is over [`MAX_BODY`].
    TooLong(usize),
    /// Unknown message tag.
    UnknownTag(u8),
    /// Address family byte other than 4 or 6.
    BadFamily(u8),
    /// A string that is not UTF-8.
    BadString,
    /// Bytes left over after the last field.
    TrailingBytes(usize),
    /// A flag byte other than 0 or 1.
    BadBool,
}

/// Smallest encoded address (family, IPv4, port).
const MIN_ADDR: usize = 7;

/// "No address" where an address field is optional (0.0.0.0:0).
pub const NO_ADDR: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);

impl std::fmt::Display for AgentWireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentWireError::Truncated => write!(f, "message truncated"),
            AgentWireError::TooLong(n) => write!(f, "message of {n} bytes is too long"),
            AgentWireError::UnknownTag(t) => write!(f, "unknown message tag {t}"),
            AgentWireError::BadFamily(x) => write!(f, "bad address family {x}"),
            AgentWireError::BadString => write!(f, "string is not UTF-8"),
            AgentWireError::TrailingBytes(n) => write!(f, "{n} bytes after the message"),
            AgentWireError::BadBool => write!(f, "flag byte is not 0 or 1"),
        }
    }
}

impl std::error::Error for AgentWireError {}

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v)
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u128(&mut self, v: u128) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes())
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
    fn addrs(&mut self, v: &[SocketAddr]) {
        self.u32(v.len() as u32);
        for a in v {
            self.addr(a);
        }
    }
    fn addr(&mut self, a: &SocketAddr) {
        match a.ip() {
            IpAddr::V4(ip) => {
                self.u8(4);
                self.0.extend_from_slice(&ip.octets())
            }
            IpAddr::V6(ip) => {
                self.u8(6);
                self.0.extend_from_slice(&ip.octets())
            }
        }
        self.0.extend_from_slice(&a.port().to_le_bytes())
    }
}

struct R<'a>(&'a [u8]);

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], AgentWireError> {
        if self.0.len() < n {
            return Err(AgentWireError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, AgentWireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, AgentWireError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, AgentWireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, AgentWireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn u128(&mut self) -> Result<u128, AgentWireError> {
        Ok(u128::from_le_bytes(self.take(16)?.try_into().expect("16")))
    }
    fn str(&mut self) -> Result<String, AgentWireError> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| AgentWireError::BadString)
    }
    fn bytes(&mut self) -> Result<Vec<u8>, AgentWireError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn bool(&mut self) -> Result<bool, AgentWireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(AgentWireError::BadBool),
        }
    }
    /// A count of items each at least `min` bytes long: refused if the body cannot hold
    /// them (so a hostile count never makes a large allocation).
    fn count(&mut self, min: usize) -> Result<usize, AgentWireError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min) > self.0.len() {
            return Err(AgentWireError::Truncated);
        }
        Ok(n)
    }
    fn addrs(&mut self) -> Result<Vec<SocketAddr>, AgentWireError> {
        let n = self.count(MIN_ADDR)?;
        (0..n).map(|_| self.addr()).collect()
    }
    fn addr(&mut self) -> Result<SocketAddr, AgentWireError> {
        let ip = match self.u8()? {
            4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(self.take(4)?).expect("4"))),
            6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(self.take(16)?).expect("16"))),
            f => return Err(AgentWireError::BadFamily(f)),
        };
        Ok(SocketAddr::new(ip, self.u16()?))
    }
}

/// A list of addresses as messages carry it (for proofs that cover one).
pub fn addrs_bytes(v: &[SocketAddr]) -> Vec<u8> {
    let mut w = W(Vec::new());
    w.addrs(v);
    w.0
}

impl Msg {
    /// The message's kind, for log lines (which must never show a connection's secret, as
    /// `Debug` of a `Connect` or `Virtual` would).
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "Hello",
            Msg::Listen { .. } => "Listen",
            Msg::Unlisten { .. } => "Unlisten",
            Msg::Connect { .. } => "Connect",
            Msg::Accept { .. } => "Accept",
            Msg::Accepted { .. } => "Accepted",
            Msg::Table => "Table",
            Msg::Virtual { .. } => "Virtual",
            Msg::Plain => "Plain",
            Msg::Ok => "Ok",
            Msg::Error { .. } => "Error",
            Msg::Status => "Status",
            Msg::StatusReply { .. } => "StatusReply",
            Msg::Resume { .. } => "Resume",
            Msg::Challenge { .. } => "Challenge",
            Msg::Proof { .. } => "Proof",
            Msg::Ready { .. } => "Ready",
            Msg::Events { .. } => "Events",
            Msg::Hold { .. } => "Hold",
            Msg::Release { .. } => "Release",
            Msg::ReleaseSide { .. } => "ReleaseSide",
            Msg::Path { .. } => "Path",
            Msg::Handover { .. } => "Handover",
            Msg::Paths { .. } => "Paths",
            Msg::PathList { .. } => "PathList",
            Msg::Net { .. } => "Net",
            Msg::Linger { .. } => "Linger",
            Msg::Freeze { .. } => "Freeze",
            Msg::Frozen { .. } => "Frozen",
            Msg::Thaw { .. } => "Thaw",
            Msg::Thawed { .. } => "Thawed",
            Msg::Moved { .. } => "Moved",
            Msg::Unfreeze { .. } => "Unfreeze",
            Msg::WhereAmI => "WhereAmI",
            Msg::Here { .. } => "Here",
            Msg::Move { .. } => "Move",
            Msg::Remote { .. } => "Remote",
            Msg::AsUser { .. } => "AsUser",
            Msg::ClusterStatus => "ClusterStatus",
            Msg::Locate { .. } => "Locate",
            Msg::Watch { .. } => "Watch",
            Msg::Happened { .. } => "Happened",
            Msg::Relinked { .. } => "Relinked",
            Msg::Bound { .. } => "Bound",
            Msg::Migrate { .. } => "Migrate",
            Msg::Chain { .. } => "Chain",
            Msg::Device { .. } => "Device",
            Msg::DeviceReply { .. } => "DeviceReply",
            Msg::Profile { .. } => "Profile",
            Msg::ProfileReply { .. } => "ProfileReply",
            Msg::Capture { .. } => "Capture",
            Msg::Sink { .. } => "Sink",
            Msg::SinkReply { .. } => "SinkReply",
            Msg::Ended { .. } => "Ended",
            Msg::Welcome { .. } => "Welcome",
            Msg::Subscribe { .. } => "Subscribe",
            Msg::Expect { .. } => "Expect",
            Msg::Tickets { .. } => "Tickets",
            Msg::TicketBook { .. } => "TicketBook",
            Msg::Used { .. } => "Used",
            Msg::Expects { .. } => "Expects",
            Msg::Probe { .. } => "Probe",
            Msg::Journal { .. } => "Journal",
            Msg::WatchCluster { .. } => "WatchCluster",
            Msg::Summary { .. } => "Summary",
            Msg::HeadStatus { .. } => "HeadStatus",
            Msg::HeadEvents { .. } => "HeadEvents",
            Msg::GridStatus => "GridStatus",
        }
    }

    /// Encodes the message with its length prefix.
    pub fn encode(&self) -> Vec<u8> {
        // (Room for the messages of every connection's set-up at once: no growing.)
        let mut v = Vec::with_capacity(160);
        v.extend_from_slice(&[0; 4]);
        let mut w = W(v);
        match self {
            Msg::Hello { pid, name } => {
                w.u8(1);
                w.u32(*pid);
                w.str(name);
            }
            Msg::Listen { addr, window } => {
                w.u8(2);
                w.addr(addr);
                w.u64(*window);
            }
            Msg::Unlisten { addr } => {
                w.u8(3);
                w.addr(addr);
            }
            Msg::Connect { src, dst, gid, secret, window, aim, agents } => {
                w.u8(4);
                w.addr(src);
                w.addr(dst);
                w.u128(*gid);
                w.u128(*secret);
                w.u64(*window);
                w.addr(aim);
                w.addrs(agents);
            }
            Msg::Accept { local, peer } => {
                w.u8(5);
                w.addr(local);
                w.addr(peer);
            }
            Msg::Table => w.u8(81),
            Msg::Accepted { local, peer, gid } => {
                w.u8(80);
                w.addr(local);
                w.addr(peer);
                w.u128(*gid);
            }
            Msg::Virtual { gid, secret, window, addrs, alias } => {
                w.u8(6);
                w.u128(*gid);
                w.u128(*secret);
                w.u64(*window);
                w.addrs(addrs);
                w.addr(alias);
            }
            Msg::Plain => w.u8(7),
            Msg::Ok => w.u8(8),
            Msg::Error { reason } => {
                w.u8(9);
                w.str(reason);
            }
            Msg::Status => w.u8(10),
            Msg::StatusReply { json } => {
                w.u8(11);
                w.str(json);
            }
            Msg::Resume { gid, nonce, from_active } => {
                w.u8(12);
                w.u128(*gid);
                w.u128(*nonce);
                w.u8(*from_active as u8);
            }
            Msg::Challenge { nonce } => {
                w.u8(13);
                w.u128(*nonce);
            }
            Msg::Proof { delivered, mac, agents, shm } => {
                w.u8(14);
                w.u64(*delivered);
                w.u128(*mac);
                w.addrs(agents);
                w.u8(*shm as u8);
            }
            Msg::Ready { delivered, mac, agents, sent, shm } => {
                w.u8(15);
                w.u64(*delivered);
                w.u128(*mac);
                w.addrs(agents);
                w.u64(*sent);
                w.u8(*shm as u8);
            }
            Msg::Events { pid } => {
                w.u8(16);
                w.u32(*pid);
            }
            Msg::Hold { gid, active } => {
                w.u8(17);
                w.u128(*gid);
                w.u8(*active as u8);
            }
            Msg::Release { gid } => {
                w.u8(18);
                w.u128(*gid);
            }
            Msg::ReleaseSide { gid, active } => {
                w.u8(82);
                w.u128(*gid);
                w.u8(*active as u8);
            }
            Msg::Path { local, peer, up } => {
                w.u8(19);
                w.addr(local);
                w.addr(peer);
                w.u8(*up as u8);
            }
            Msg::Handover { gid, nonce } => {
                w.u8(20);
                w.u128(*gid);
                w.u128(*nonce);
            }
            Msg::Paths { peers, gid } => {
                w.u8(21);
                w.addrs(peers);
                w.u128(*gid);
            }
            Msg::PathList { pairs } => {
                w.u8(22);
                w.u32(pairs.len() as u32);
                for (a, b) in pairs {
                    w.addr(a);
                    w.addr(b);
                }
            }
            Msg::Net { name, up } => {
                w.u8(23);
                w.str(name);
                w.u8(*up as u8);
            }
            Msg::Probe { node, seq, boot, echo_boot, echo_seq, every_ms } => {
                w.u8(24);
                w.str(node);
                w.u64(*seq);
                w.u64(*boot);
                w.u64(*echo_boot);
                w.u64(*echo_seq);
                w.u32(*every_ms);
            }
            Msg::Linger { gid } => {
                w.u8(25);
                w.u128(*gid);
            }
            Msg::Freeze { pid } => {
                w.u8(26);
                w.u32(*pid);
            }
            Msg::Frozen { listeners } => {
                w.u8(27);
                w.addrs(listeners);
            }
            Msg::Thaw { pid } => {
                w.u8(28);
                w.u32(*pid);
            }
            Msg::Thawed { moved, conns, rebuilt, waiting, replayed, ms } => {
                w.u8(29);
                w.u8(*moved as u8);
                w.u32(*conns);
                w.u32(*rebuilt);
                w.u32(*waiting);
                w.u64(*replayed);
                w.u32(*ms);
            }
            Msg::Moved { pid, listeners, to } => {
                w.u8(30);
                w.u32(*pid);
                w.addrs(listeners);
                w.addrs(to);
            }
            Msg::Unfreeze { pid } => {
                w.u8(31);
                w.u32(*pid);
            }
            Msg::WhereAmI => w.u8(32),
            Msg::Move { gid, shm } => {
                w.u8(34);
                w.u128(*gid);
                w.u8(*shm as u8);
            }
            Msg::Remote { to, cmd } => {
                w.u8(35);
                w.str(to);
                w.bytes(cmd);
            }
            Msg::AsUser { uid, cmd } => {
                w.u8(36);
                w.u32(*uid);
                w.bytes(cmd);
            }
            Msg::ClusterStatus => w.u8(37),
            Msg::Locate { gid } => {
                w.u8(90);
                w.u128(*gid);
            }
            Msg::Watch { after, follow } => {
                w.u8(38);
                w.u64(*after);
                w.u8(*follow as u8);
            }
            Msg::Relinked { gid, stall_ms, replayed, dialer, local, peer } => {
                w.u8(64);
                w.u128(*gid);
                w.u32(*stall_ms);
                w.u64(*replayed);
                w.u8(*dialer as u8);
                w.addr(local);
                w.addr(peer);
            }
            Msg::Bound { ports } => {
                w.u8(66);
                w.u32(ports.len() as u32);
                for (gid, a) in ports {
                    w.u128(*gid);
                    w.addr(a);
                }
            }
            Msg::Migrate { pid, to } => {
                w.u8(65);
                w.u32(*pid);
                w.str(to);
            }
            Msg::Chain { gid, spec } => {
                w.u8(67);
                w.u128(*gid);
                w.str(spec);
            }
            Msg::Device { load, name, gid, pid } => {
                w.u8(68);
                w.u8(u8::from(*load));
                w.str(name);
                w.u128(*gid);
                w.u32(*pid);
            }
            Msg::DeviceReply { conns } => {
                w.u8(69);
                w.u32(*conns);
            }
            Msg::Profile { gid } => {
                w.u8(71);
                w.u128(*gid);
            }
            Msg::ProfileReply { json } => {
                w.u8(72);
                w.str(json);
            }
            Msg::Capture { gid, duration_ms } => {
                w.u8(73);
                w.u128(*gid);
                w.u32(*duration_ms);
            }
            Msg::Sink { name } => {
                w.u8(74);
                w.str(name);
            }
            Msg::SinkReply { devices, why } => {
                w.u8(75);
                w.u32(*devices as u32);
                w.str(why);
            }
            Msg::Ended { gid, at, from_active, mac } => {
                w.u8(76);
                w.u128(*gid);
                w.u64(*at);
                w.u8(*from_active as u8);
                w.u128(*mac);
            }
            Msg::Welcome { chain, first_port, ports } => {
                w.u8(77);
                w.str(chain);
                w.u16(*first_port);
                w.u16(*ports);
            }
            Msg::Subscribe { listener, first_port, ports } => {
                w.u8(78);
                w.addr(listener);
                w.u16(*first_port);
                w.u16(*ports);
            }
            Msg::Expect { src, dst, gid, secret, window, aim, agents } => {
                w.u8(79);
                w.addr(src);
                w.addr(dst);
                w.u128(*gid);
                w.u128(*secret);
                w.u64(*window);
                w.addr(aim);
                w.addrs(agents);
            }
            Msg::Tickets { dst, want, window, returned, busy } => {
                w.u8(83);
                w.addr(dst);
                w.u16(*want);
                w.u64(*window);
                for list in [returned, busy] {
                    w.u32(list.len() as u32);
                    for g in list {
                        w.u128(*g);
                    }
                }
            }
            Msg::TicketBook { dst, src, window, addrs, use_ms, tickets } => {
                w.u8(84);
                w.addr(dst);
                w.addr(src);
                w.u64(*window);
                w.addrs(addrs);
                w.u32(*use_ms);
                w.u32(tickets.len() as u32);
                for (port, gid, secret) in tickets {
                    w.u16(*port);
                    w.u128(*gid);
                    w.u128(*secret);
                }
            }
            Msg::Used { gid, local } => {
                w.u8(85);
                w.u128(*gid);
                w.addr(local);
            }
            Msg::Expects { dst, window, agents, entries } => {
                w.u8(86);
                w.addr(dst);
                w.u64(*window);
                w.addrs(agents);
                w.u32(entries.len() as u32);
                for (src, gid, secret) in entries {
                    w.addr(src);
                    w.u128(*gid);
                    w.u128(*secret);
                }
            }
            Msg::Happened { json } => {
                w.u8(39);
                w.str(json);
            }
            Msg::Here { addrs } => {
                w.u8(33);
                w.addrs(addrs);
            }
            Msg::Journal { after } => {
                w.u8(40);
                w.u64(*after);
            }
            Msg::WatchCluster { to, follow } => {
                w.u8(41);
                w.str(to);
                w.u8(*follow as u8);
            }
            Msg::Summary { json } => {
                w.u8(42);
                w.str(json);
            }
            Msg::HeadStatus { brief } => {
                w.u8(43);
                w.u8(*brief as u8);
            }
            Msg::HeadEvents { after } => {
                w.u8(44);
                w.u64(*after);
            }
            Msg::GridStatus => w.u8(45),
        }
        let body = (w.0.len() - 4) as u32;
        w.0[..4].copy_from_slice(&body.to_le_bytes());
        w.0
    }

    /// Reads the body length from a 4-byte prefix, refusing lengths over [`MAX_BODY`].
    pub fn body_len(prefix: [u8; 4]) -> Result<usize, AgentWireError> {
        let n = u32::from_le_bytes(prefix) as usize;
        if n > MAX_BODY {
            return Err(AgentWireError::TooLong(n));
        }
        Ok(n)
    }

    /// Decodes one message body (without its length prefix).
    pub fn decode(body: &[u8]) -> Result<Msg, AgentWireError> {
        let mut r = R(body);
        let m = match r.u8()? {
            1 => Msg::Hello { pid: r.u32()?, name: r.str()? },
            2 => Msg::Listen { addr: r.addr()?, window: r.u64()? },
            3 => Msg::Unlisten { addr: r.addr()? },
            4 => Msg::Connect {
                src: r.addr()?,
                dst: r.addr()?,
                gid: r.u128()?,
                secret: r.u128()?,
                window: r.u64()?,
                aim: r.addr()?,
                agents: r.addrs()?,
            },
            5 => Msg::Accept { local: r.addr()?, peer: r.addr()? },
            6 => Msg::Virtual {
                gid: r.u128()?,
                secret: r.u128()?,
                window: r.u64()?,
                addrs: r.addrs()?,
                alias: r.addr()?,
            },
            7 => Msg::Plain,
            8 => Msg::Ok,
            9 => Msg::Error { reason: r.str()? },
            10 => Msg::Status,
            11 => Msg::StatusReply { json: r.str()? },
            12 => Msg::Resume { gid: r.u128()?, nonce: r.u128()?, from_active: r.bool()? },
            13 => Msg::Challenge { nonce: r.u128()? },
            14 => Msg::Proof { delivered: r.u64()?, mac: r.u128()?, agents: r.addrs()?, shm: r.bool()? },
            15 => Msg::Ready {
                delivered: r.u64()?,
                mac: r.u128()?,
                agents: r.addrs()?,
                sent: r.u64()?,
                shm: r.bool()?,
            },
            16 => Msg::Events { pid: r.u32()? },
            17 => Msg::Hold { gid: r.u128()?, active: r.bool()? },
            18 => Msg::Release { gid: r.u128()? },
            82 => Msg::ReleaseSide { gid: r.u128()?, active: r.bool()? },
            19 => Msg::Path { local: r.addr()?, peer: r.addr()?, up: r.bool()? },
            20 => Msg::Handover { gid: r.u128()?, nonce: r.u128()? },
            21 => Msg::Paths { peers: r.addrs()?, gid: r.u128()? },
            22 => {
                let n = r.count(2 * MIN_ADDR)?;
                let mut pairs = Vec::with_capacity(n);
                for _ in 0..n {
                    pairs.push((r.addr()?, r.addr()?));
                }
                Msg::PathList { pairs }
            }
            23 => Msg::Net { name: r.str()?, up: r.bool()? },
            24 => Msg::Probe {
                node: r.str()?,
                seq: r.u64()?,
                boot: r.u64()?,
                echo_boot: r.u64()?,
                echo_seq: r.u64()?,
                every_ms: r.u32()?,
            },
            25 => Msg::Linger { gid: r.u128()? },
            26 => Msg::Freeze { pid: r.u32()? },
            27 => Msg::Frozen { listeners: r.addrs()? },
            28 => Msg::Thaw { pid: r.u32()? },
            29 => Msg::Thawed {
                moved: r.bool()?,
                conns: r.u32()?,
                rebuilt: r.u32()?,
                waiting: r.u32()?,
                replayed: r.u64()?,
                ms: r.u32()?,
            },
            30 => Msg::Moved { pid: r.u32()?, listeners: r.addrs()?, to: r.addrs()? },
            31 => Msg::Unfreeze { pid: r.u32()? },
            32 => Msg::WhereAmI,
            33 => Msg::Here { addrs: r.addrs()? },
            34 => Msg::Move { gid: r.u128()?, shm: r.bool()? },
            35 => Msg::Remote { to: r.str()?, cmd: r.bytes()? },
            36 => Msg::AsUser { uid: r.u32()?, cmd: r.bytes()? },
            37 => Msg::ClusterStatus,
            90 => Msg::Locate { gid: r.u128()? },
            83 => {
                let dst = r.addr()?;
                let want = r.u16()?;
                let window = r.u64()?;
                let mut lists = [Vec::new(), Vec::new()];
                for list in lists.iter_mut() {
                    let n = r.count(16)?;
                    list.reserve(n);
                    for _ in 0..n {
                        list.push(r.u128()?);
                    }
                }
                let [returned, busy] = lists;
                Msg::Tickets { dst, want, window, returned, busy }
            }
            84 => {
                let dst = r.addr()?;
                let src = r.addr()?;
                let window = r.u64()?;
                let addrs = r.addrs()?;
                let use_ms = r.u32()?;
                let n = r.count(2 + 16 + 16)?;
                let mut tickets = Vec::with_capacity(n);
                for _ in 0..n {
                    tickets.push((r.u16()?, r.u128()?, r.u128()?));
                }
                Msg::TicketBook { dst, src, window, addrs, use_ms, tickets }
            }
            85 => Msg::Used { gid: r.u128()?, local: r.addr()? },
            86 => {
                let dst = r.addr()?;
                let window = r.u64()?;
                let agents = r.addrs()?;
                let n = r.count(MIN_ADDR + 16 + 16)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    entries.push((r.addr()?, r.u128()?, r.u128()?));
                }
                Msg::Expects { dst, window, agents, entries }
            }
            38 => Msg::Watch { after: r.u64()?, follow: r.bool()? },
            39 => Msg::Happened { json: r.str()? },
            40 => Msg::Journal { after: r.u64()? },
            41 => Msg::WatchCluster { to: r.str()?, follow: r.bool()? },
            42 => Msg::Summary { json: r.str()? },
            43 => Msg::HeadStatus { brief: r.bool()? },
            44 => Msg::HeadEvents { after: r.u64()? },
            45 => Msg::GridStatus,
            65 => Msg::Migrate { pid: r.u32()?, to: r.str()? },
            67 => Msg::Chain { gid: r.u128()?, spec: r.str()? },
            69 => Msg::DeviceReply { conns: r.u32()? },
            71 => Msg::Profile { gid: r.u128()? },
            72 => Msg::ProfileReply { json: r.str()? },
            73 => Msg::Capture { gid: r.u128()?, duration_ms: r.u32()? },
            74 => Msg::Sink { name: r.str()? },
            75 => Msg::SinkReply { devices: r.u32()? as i32, why: r.str()? },
            76 => Msg::Ended { gid: r.u128()?, at: r.u64()?, from_active: r.bool()?, mac: r.u128()? },
            77 => Msg::Welcome { chain: r.str()?, first_port: r.u16()?, ports: r.u16()? },
            78 => Msg::Subscribe { listener: r.addr()?, first_port: r.u16()?, ports: r.u16()? },
            80 => Msg::Accepted { local: r.addr()?, peer: r.addr()?, gid: r.u128()? },
            81 => Msg::Table,
            79 => Msg::Expect {
                src: r.addr()?,
                dst: r.addr()?,
                gid: r.u128()?,
                secret: r.u128()?,
                window: r.u64()?,
                aim: r.addr()?,
                agents: r.addrs()?,
            },
            68 => Msg::Device { load: r.bool()?, name: r.str()?, gid: r.u128()?, pid: r.u32()? },
            64 => Msg::Relinked {
                gid: r.u128()?,
                stall_ms: r.u32()?,
                replayed: r.u64()?,
                dialer: r.bool()?,
                local: r.addr()?,
                peer: r.addr()?,
            },
            66 => {
                let n = r.count(16 + MIN_ADDR)?;
                let mut ports = Vec::with_capacity(n);
                for _ in 0..n {
                    ports.push((r.u128()?, r.addr()?));
                }
                Msg::Bound { ports }
            }
            t => return Err(AgentWireError::UnknownTag(t)),
        };
        if !r.0.is_empty() {
            return Err(AgentWireError::TrailingBytes(r.0.len()));
        }
        Ok(m)
    }

    /// Decodes a whole buffer holding one length-prefixed message.
    pub fn decode_framed(buf: &[u8]) -> Result<Msg, AgentWireError> {
        if buf.len() < 4 {
            return Err(AgentWireError::Truncated);
        }
        let n = Self::body_len(buf[..4].try_into().expect("4"))?;
        let body = buf.get(4..4 + n).ok_or(AgentWireError::Truncated)?;
        if buf.len() > 4 + n {
            return Err(AgentWireError::TrailingBytes(buf.len() - 4 - n));
        }
        Self::decode(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_message() {
        let a: SocketAddr = "10.77.0.1:5201".parse().unwrap();
        let b: SocketAddr = "[fe80::1]:80".parse().unwrap();
        for m in [
            Msg::Hello { pid: 42, name: "iperf3".into() },
            Msg::Listen { addr: a, window: 9 },
            Msg::Unlisten { addr: b },
            Msg::Connect {
                src: a,
                dst: b,
                gid: u128::MAX,
                secret: 7,
                window: 1 << 22,
                aim: b,
                agents: vec![a],
            },
            Msg::Accept { local: b, peer: a },
            Msg::Accepted { local: a, peer: b, gid: 0x5555 },
            Msg::Table,
            Msg::Virtual { gid: 1, secret: 2, window: 3, addrs: vec![a, b], alias: a },
            Msg::Resume { gid: 1, nonce: 2, from_active: true },
            Msg::Challenge { nonce: 3 },
            Msg::Proof { delivered: 4, mac: 5, agents: vec![a, b], shm: true },
            Msg::Ready { delivered: 6, mac: 7, agents: vec![], sent: 8, shm: false },
            Msg::Events { pid: 8 },
            Msg::Hold { gid: 9, active: false },
            Msg::Release { gid: 10 },
            Msg::ReleaseSide { gid: 10, active: true },
            Msg::Path { local: a, peer: b, up: true },
            Msg::Handover { gid: 11, nonce: 12 },
            Msg::Paths { peers: vec![a], gid: 0x1234 },
            Msg::PathList { pairs: vec![(a, b), (b, a)] },
            Msg::Net { name: "eth0".into(), up: false },
            Msg::Probe {
                node: "n".into(),
                seq: 13,
                boot: 131,
                echo_boot: 132,
                echo_seq: 133,
                every_ms: 1000,
            },
            Msg::Linger { gid: 14 },
            Msg::Freeze { pid: 15 },
            Msg::Frozen { listeners: vec![a] },
            Msg::Thaw { pid: 16 },
            Msg::Thawed { moved: true, conns: 17, rebuilt: 18, waiting: 19, replayed: 20, ms: 21 },
            Msg::Moved { pid: 22, listeners: vec![a], to: vec![b, a] },
            Msg::Unfreeze { pid: 23 },
            Msg::WhereAmI,
            Msg::Here { addrs: vec![b] },
            Msg::Move { gid: 24, shm: true },
            Msg::Remote { to: "n2".into(), cmd: Msg::Status.encode() },
            Msg::AsUser { uid: 25, cmd: Msg::Net { name: "eth1".into(), up: true }.encode() },
            Msg::ClusterStatus,
            Msg::Locate { gid: 0xfeed },
            Msg::Watch { after: 26, follow: true },
            Msg::Happened { json: "{}".into() },
            Msg::Journal { after: 27 },
            Msg::WatchCluster { to: "n3".into(), follow: true },
            Msg::WatchCluster { to: String::new(), follow: false },
            Msg::Summary { json: "{\"node\":\"n\"}".into() },
            Msg::HeadStatus { brief: true },
            Msg::HeadStatus { brief: false },
            Msg::HeadEvents { after: 28 },
            Msg::GridStatus,
            Msg::AsUser { uid: 0, cmd: Msg::HeadEvents { after: 29 }.encode() },
            Msg::Migrate { pid: 4242, to: "ssh:root@node7".into() },
            Msg::Chain { gid: 5 << 64 | 3, spec: "double,double".into() },
            Msg::Device { load: true, name: "lz4".into(), gid: 0, pid: 4242 },
            Msg::Device { load: false, name: "double".into(), gid: 9 << 64 | 1, pid: 0 },
            Msg::DeviceReply { conns: 12 },
            Msg::Profile { gid: 7 << 100 | 3 },
            Msg::ProfileReply { json: "{\"dirs\": {}}".into() },
            Msg::Capture { gid: 1, duration_ms: 10_000 },
            Msg::Sink { name: "verbs".into() },
            Msg::SinkReply { devices: 0, why: "no RDMA device".into() },
            Msg::SinkReply { devices: -1, why: String::new() },
            Msg::Ended { gid: 3 << 90 | 7, at: 52_953_088, from_active: false, mac: 0xfeed << 64 | 0xbeef },
            Msg::Welcome { chain: String::new(), first_port: 59000, ports: 2000 },
            Msg::Welcome { chain: "lz4;10.78.1.0/24=zstd:1".into(), first_port: 0, ports: 0 },
            Msg::Subscribe { listener: b, first_port: 59000, ports: 2000 },
            Msg::Expect {
                src: a,
                dst: b,
                gid: 3 << 99 | 4,
                secret: 9,
                window: 1 << 21,
                aim: b,
                agents: vec![a, b],
            },
            Msg::Relinked {
                gid: 7 << 64 | 9,
                stall_ms: 812,
                replayed: 1 << 33,
                dialer: true,
                local: "10.0.0.1:40000".parse().unwrap(),
                peer: "[fe80::1]:7787".parse().unwrap(),
            },
            Msg::Bound { ports: vec![(1 << 100 | 5, a), (6, b)] },
            Msg::Bound { ports: vec![] },
            Msg::Tickets {
                dst: b,
                want: 32,
                window: 1 << 22,
                returned: vec![1 << 120 | 3, 4],
                busy: vec![9],
            },
            Msg::Tickets { dst: a, want: 0, window: 0, returned: vec![], busy: vec![] },
            Msg::TicketBook {
                dst: a,
                src: "10.0.0.9:0".parse().unwrap(),
                window: 1 << 22,
                addrs: vec![a, b],
                use_ms: 10_000,
                tickets: vec![(59_999, 1 << 127 | 1, 2), (60_000, 3, u128::MAX)],
            },
            Msg::Used { gid: 5 << 64 | 6, local: a },
            Msg::Expects { dst: b, window: 9, agents: vec![b], entries: vec![(a, 1, 2), (b, 3, 4)] },
            Msg::Expects { dst: a, window: 0, agents: vec![], entries: vec![] },
            Msg::Plain,
            Msg::Ok,
            Msg::Error { reason: "no".into() },
            Msg::Status,
            Msg::StatusReply { json: "{}".into() },
        ] {
            assert_eq!(Msg::decode_framed(&m.encode()), Ok(m));
        }
    }

    #[test]
    fn refuses_malformed() {
        assert_eq!(Msg::decode(&[]), Err(AgentWireError::Truncated));
        assert_eq!(Msg::decode(&[99]), Err(AgentWireError::UnknownTag(99)));
        assert_eq!(Msg::decode(&[2, 5, 0]), Err(AgentWireError::BadFamily(5)));
        assert_eq!(Msg::decode(&[3, 4, 1, 2, 3, 4, 0]), Err(AgentWireError::Truncated));
        assert_eq!(Msg::decode(&[8, 0]), Err(AgentWireError::TrailingBytes(1)));
        assert_eq!(Msg::decode(&[43, 2]), Err(AgentWireError::BadBool));
        assert_eq!(Msg::decode(&[40, 1, 2]), Err(AgentWireError::Truncated));
        assert_eq!(Msg::decode(&[45, 0]), Err(AgentWireError::TrailingBytes(1)));
        assert_eq!(Msg::decode(&[46]), Err(AgentWireError::UnknownTag(46)));
        assert_eq!(Msg::decode(&[9, 255, 255, 255, 255]), Err(AgentWireError::Truncated));
        assert!(Msg::body_len([255, 255, 255, 255]).is_err());
    }
}
