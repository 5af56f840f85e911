//! The processes under the layer on this node, their statistics tables (mapped read-only
//! from the memfd each one handed over), and the JSON report `vmictl` prints.

use crate::local::Agent;
use serde::Serialize;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use substrate::stats::{SlotView, SLOT_SIZE, TABLE_BYTES, TABLE_HEADER};

/// A process's statistics table, mapped read-only.
pub struct Table {
    base: *const u8,
    len: usize,
    /// Inode of the memfd (a forked child hands over the same table).
    pub inode: u64,
}

// SAFETY: read-only shared mapping; reads copy bytes out.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

impl Table {
    /// Maps a table from its memfd; `None` if it is not one, or if its process could still
    /// shrink it (a read past its end would kill the agent with SIGBUS).
    pub fn map(fd: &OwnedFd) -> Option<Table> {
        // SAFETY: F_GET_SEALS takes no argument; fails on anything but a memfd.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            tracing::warn!("a statistics table that is not a memfd sealed against shrinking is refused");
            return None;
        }
        // SAFETY: zeroed stat is valid; fstat fills it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || (st.st_size as usize) < TABLE_BYTES {
            return None;
        }
        // SAFETY: maps TABLE_BYTES of the memfd read-only.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                TABLE_BYTES,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let t = Table { base: p as *const u8, len: TABLE_BYTES, inode: st.st_ino };
        SlotView::table_slots(&t.bytes(0, TABLE_HEADER), t.len)?;
        Some(t)
    }

    fn bytes(&self, off: usize, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        // SAFETY: off + n <= len (callers stay inside the table); the copy is volatile-free
        // but only reads plain bytes the process may be writing (torn values are harmless).
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(off), v.as_mut_ptr(), n.min(self.len - off)) };
        v
    }

    /// Every used slot.
    pub fn slots(&self) -> Vec<SlotView> {
        let n = SlotView::table_in_use(&self.bytes(0, TABLE_HEADER), self.len).unwrap_or(0);
        let mut out = Vec::new();
        for i in 0..n {
            let off = TABLE_HEADER + i * SLOT_SIZE;
            // SAFETY: the USED word of slot i is inside the table.
            let used = unsafe { std::ptr::read_volatile(self.base.add(off) as *const u32) };
            if used == 1 {
                if let Some(v) = SlotView::parse(&self.bytes(off, SLOT_SIZE)) {
                    out.push(v);
                }
            }
        }
        out
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: unmaps what `map` mapped.
        unsafe { libc::munmap(self.base as *mut _, self.len) };
    }
}

/// A process under the layer.
pub struct Proc {
    /// Its id.
    pub pid: u32,
    /// Its name.
    pub name: String,
    /// Its table.
    pub table: Option<Arc<Table>>,
}

/// All processes, by local client.
#[derive(Default)]
pub struct Procs {
    live: HashMap<u64, Proc>,
    /// Tables of processes that went away but whose forked children may still use them.
    orphans: Vec<Arc<Table>>,
}

/// True if process `pid` exists and lives on this node: in this agent's network namespace.
/// (A process checkpointed here and restored on another node keeps its pid; where nodes
/// are network namespaces of one machine it is still there for `kill`, in another node's
/// namespace, and its table here must go.)
fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks existence.
    let exists = pid > 0
        && (unsafe { libc::kill(pid as i32, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM));
    exists && on_this_node(pid)
}

/// False only when `pid` is known to be in another network namespace than this agent.
fn on_this_node(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    static OURS: std::sync::OnceLock<Option<(u64, u64)>> = std::sync::OnceLock::new();
    let ns = |p: &str| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    match (OURS.get_or_init(|| ns("/proc/self/ns/net")), ns(&format!("/proc/{pid}/ns/net"))) {
        (Some(ours), Some(theirs)) => *ours == theirs,
        // Not readable (another user's process, or no /proc): as before, by pid alone.
        _ => true,
    }
}

impl Procs {
    /// A process said hello.
    pub fn hello(&mut self, client: u64, pid: u32, name: String, fd: Option<OwnedFd>) {
        let table = fd.and_then(|fd| {
            let t = Table::map(&fd)?;
            // One mapping per table: a forked child shares its parent's.
            let known = self
                .live
                .values()
                .filter_map(|p| p.table.clone())
                .chain(self.orphans.iter().cloned())
                .find(|k| k.inode == t.inode);
            Some(known.unwrap_or_else(|| Arc::new(t)))
        });
        self.live.insert(client, Proc { pid, name, table });
    }

    /// The process behind local client `client`, once it said hello.
    pub fn pid_of(&self, client: u64) -> Option<u32> {
        self.live.get(&client).map(|p| p.pid)
    }

    /// The request sockets of process `pid`.
    pub fn clients_of(&self, pid: u32) -> Vec<u64> {
        self.live.iter().filter(|(_, p)| p.pid == pid).map(|(c, _)| *c).collect()
    }

    /// A local client went away.
    pub fn gone(&mut self, client: u64) {
        if let Some(p) = self.live.remove(&client) {
            if let Some(t) = p.table {
                self.orphans.push(t);
            }
        }
    }

    /// Distinct tables with their connections (dropping orphans nobody alive uses).
    pub fn tables(&mut self) -> Vec<Arc<Table>> {
        self.orphans.retain(|t| t.slots().iter().any(|s| alive(s.pid)));
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for t in self.live.values().filter_map(|p| p.table.clone()).chain(self.orphans.iter().cloned()) {
            if !seen.contains(&t.inode) {
                seen.push(t.inode);
                out.push(t);
            }
        }
        out
    }
}

#[derive(Serialize)]
struct ProcJson {
    pid: u32,
    name: String,
    connections: usize,
    /// The process's sandbox, from `/proc/PID/status`: "seccomp filter" (with how many),
    /// "seccomp strict", "no_new_privs"; empty for none.
    sandbox: String,
}

/// What `/proc/PID/status` says of a process's sandbox (see `ProcJson::sandbox`).
fn sandbox_of(pid: u32) -> String {
    let Ok(text) = std::fs::read(format!("/proc/{pid}/status")) else { return String::new() };
    let st = substrate::procfs::parse_status(&text);
    let mut parts = Vec::new();
    match st.seccomp {
        Some(1) => parts.push("seccomp strict".to_string()),
        Some(2) => parts.push(format!("seccomp filter x{}", st.seccomp_filters.unwrap_or(1))),
        _ => {}
    }
    if st.no_new_privs == Some(true) {
        parts.push("no_new_privs".to_string());
    }
    parts.join(", ")
}

#[derive(Serialize)]
struct ConnJson {
    gid: String,
    pid: u32,
    local: String,
    peer: String,
    substrate: &'static str,
    /// The chain of filters on each direction: `{"send": "double", "recv": ""}`.
    chain: serde_json::Value,
    direction: &'static str,
    bytes_sent: u64,
    bytes_received: u64,
    msgs_sent: u64,
    msgs_received: u64,
    unacked_bytes: u64,
    window: u64,
    age_ms: u64,
    error: u32,
    network: Option<String>,
    link_local: Option<String>,
    link_peer: Option<String>,
    failovers: u32,
    link: &'static str,
}

#[derive(Serialize)]
struct ListenerJson {
    addr: String,
}

#[derive(Serialize)]
struct Report {
    node: String,
    processes: Vec<ProcJson>,
    listeners: Vec<ListenerJson>,
    networks: Vec<crate::paths::NetJson>,
    paths: Vec<crate::paths::PathJson>,
    connections: Vec<ConnJson>,
    mesh: serde_json::Value,
    web: serde_json::Value,
    /// The cluster directory (`null`: none configured).
    directory: serde_json::Value,
    /// The node's sink plug-ins and what their probes said.
    sinks: Vec<crate::sinks::SinkInfo>,
    /// How connections are set up: the block of source ports, the listeners on other nodes
    /// this node announces its connections to one way, and the nodes that do so here.
    setup: serde_json::Value,
}

/// The other nodes this node's processes have connections with now, by name (from the
/// peers' and links' addresses and the nodes the agent probes; a node not heard from yet has
/// no name and is left out): what the cluster directory watches.
pub fn cared_nodes(agent: &Agent) -> Vec<String> {
    let mut ips = std::collections::HashSet::new();
    {
        let mut procs = agent.procs.lock().unwrap_or_else(|e| e.into_inner());
        for t in procs.tables() {
            for s in t.slots() {
                ips.insert(s.peer.ip());
                ips.extend(s.link_peer.map(|a| a.ip()));
            }
        }
    }
    if ips.is_empty() {
        return Vec::new();
    }
    (agent.health.nodes().into_iter())
        .filter(|n| n.name.parse::<std::net::IpAddr>().is_err() && n.addrs.iter().any(|a| ips.contains(a)))
        .map(|n| n.name)
        .collect()
}

/// The JSON status report; with `only`, the processes, connections and listeners of that
/// user alone (what a user who may not run the node sees).
pub fn report(agent: &Agent, only: Option<u32>) -> String {
    let mine = |pid: u32| only.is_none() || crate::local::owner_of(pid) == only;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let mut procs = agent.procs.lock().unwrap_or_else(|e| e.into_inner());
    let mut conns: Vec<ConnJson> = Vec::new();
    for t in procs.tables() {
        // A slot of a table whose process is alive is listed even if the process recorded in
        // it (a forked child that used it last) is gone; a slot of an orphan table only if its
        // process lives.
        let owner_alive =
            procs.live.values().any(|p| alive(p.pid) && p.table.as_ref().is_some_and(|x| x.inode == t.inode));
        for s in t.slots() {
            if (!owner_alive && !alive(s.pid)) || !mine(s.pid) {
                continue;
            }
            conns.push(ConnJson {
                gid: format!("{:032x}", s.gid),
                pid: s.pid,
                local: s.local.to_string(),
                peer: s.peer.to_string(),
                substrate: s.substrate,
                chain: serde_json::json!({
                    "send": s.send_chain,
                    "recv": s.recv_chain,
                    "send_since_ms": s.send_chain_ms,
                    "send_offered": s.send_offer,
                }),
                direction: if s.active { "out" } else { "in" },
                bytes_sent: s.bytes_sent,
                bytes_received: s.bytes_received,
                msgs_sent: s.msgs_sent,
                msgs_received: s.msgs_received,
                unacked_bytes: s.unacked,
                window: s.window,
                age_ms: now_ms.saturating_sub(s.created_ms),
                error: s.error,
                network: s
                    .link_local
                    .and_then(|a| agent.health.network_of(a.ip()))
                    .or_else(|| s.link_local.filter(|a| a.ip().is_loopback()).map(|_| "lo".to_string())),
                link_local: s.link_local.map(|a| a.to_string()),
                link_peer: s.link_peer.map(|a| a.to_string()),
                failovers: s.failovers,
                link: if s.error != 0 {
                    "failed"
                } else if s.relinking {
                    "relinking"
                } else {
                    "up"
                },
            });
        }
    }
    conns.sort_by(|a, b| (a.pid, &a.local).cmp(&(b.pid, &b.local)));
    let mut processes: Vec<ProcJson> = procs
        .live
        .values()
        .filter(|p| alive(p.pid) && mine(p.pid))
        .map(|p| ProcJson {
            pid: p.pid,
            name: p.name.clone(),
            connections: conns.iter().filter(|c| c.pid == p.pid).count(),
            sandbox: sandbox_of(p.pid),
        })
        .collect();
    processes.sort_by_key(|p| p.pid);
    processes.dedup_by_key(|p| p.pid);
    let listeners = agent
        .dir
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .listeners()
        .iter()
        .filter(|l| only.is_none() || procs.pid_of(l.owner).is_some_and(mine))
        .map(|l| ListenerJson { addr: l.addr.to_string() })
        .collect();
    drop(procs);
    serde_json::to_string(&Report {
        node: agent.node.clone(),
        processes,
        listeners,
        networks: agent.health.networks(),
        paths: agent.health.paths(),
        connections: conns,
        mesh: serde_json::json!({
            "key": agent.key.fingerprint,
            "cluster_id": format!("{:04x}", agent.key.cluster_id),
            "refused": agent.refusals.json(),
        }),
        web: agent.web.get().cloned().unwrap_or(serde_json::Value::Null),
        directory: crate::registry::status_json(),
        sinks: agent.sinks.all(),
        setup: agent.setup_json(),
    })
    .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}
