//! What the cluster directory holds in etcd, without I/O: the key layout under the
//! cluster's prefix, the JSON records and their checked parsing (records are read back from
//! a store other programs can write to, so nothing in them is trusted: sizes are bounded
//! and a bad record is an error, never a panic), and the bounded cache of nodes.
//!
//! ```text
//! /vmi/CCCC/node/NODE                 NodeRec   under the node's lease
//! /vmi/CCCC/agent/ADDR                PlaceRec  the node whose agent is at ADDR (one per
//!                                               agent address), under the node's lease
//! /vmi/CCCC/listener/NODE/ADDR        ListenRec under the node's lease
//! /vmi/CCCC/gid/GID/out|in            PlaceRec  under the lease of the node that holds that end
//! /vmi/CCCC/moved/NODE/ADDR           PlaceRec  where the listener at ADDR went when its
//!                                               process moved away from NODE, under NODE's
//!                                               lease (followed node to node by lookups)
//! ```
//! `CCCC` is the cluster id (four hex digits, the first 16 bits of every GID it issues),
//! `GID` 32 hex digits.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

/// Largest record read back (bytes).
pub const MAX_RECORD: usize = 16 * 1024;
/// Most agent addresses or networks in one record.
pub const MAX_ADDRS: usize = 64;
/// Longest node or network name.
pub const MAX_NAME: usize = 255;
/// Most nodes the cache holds, and most nodes one agent watches (beyond it, nodes are
/// counted, not kept): an agent watches the nodes it has connections with, not the cluster.
pub const MAX_CACHED_NODES: usize = 4096;

/// The key prefix of cluster `cluster_id`.
pub fn prefix(cluster_id: u16) -> String {
    format!("/vmi/{cluster_id:04x}/")
}

/// A node name as a key component (a `/` would make a new level).
pub fn key_name(node: &str) -> String {
    node.replace('/', "_")
}

/// The key of node `node`.
pub fn node_key(prefix: &str, node: &str) -> String {
    format!("{prefix}node/{}", key_name(node))
}

/// The key naming the node whose agent is at `addr` (the value is a [`PlaceRec`]).
pub fn agent_key(prefix: &str, addr: SocketAddr) -> String {
    format!("{prefix}agent/{addr}")
}

/// The key of listener `addr` of node `node`.
pub fn listener_key(prefix: &str, node: &str, addr: SocketAddr) -> String {
    format!("{prefix}listener/{}/{addr}", key_name(node))
}

/// The key of one end of connection `gid` (`active`: the side that connected).
pub fn gid_key(prefix: &str, gid: u128, active: bool) -> String {
    format!("{prefix}gid/{gid:032x}/{}", if active { "out" } else { "in" })
}

/// The prefix of both ends of connection `gid`.
pub fn gid_prefix(prefix: &str, gid: u128) -> String {
    format!("{prefix}gid/{gid:032x}/")
}

/// The key saying where the listener at `addr` of node `node` went when its process moved
/// away from that node.
pub fn moved_key(prefix: &str, node: &str, addr: SocketAddr) -> String {
    format!("{prefix}moved/{}/{addr}", key_name(node))
}

/// One network of a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetRec {
    /// Interface name.
    pub name: String,
    /// Its address.
    pub addr: IpAddr,
    /// Its MAC address (`aa:bb:..`), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Its MTU, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
}

/// A node: who it is and where its agent is reached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRec {
    /// The node's name.
    pub node: String,
    /// Its agent's addresses (one per network in service).
    pub agents: Vec<SocketAddr>,
    /// Its networks.
    pub networks: Vec<NetRec>,
    /// The agent's version.
    pub version: String,
}

/// A listener under the layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenRec {
    /// The node it is on.
    pub node: String,
    /// The address it listens on.
    pub addr: SocketAddr,
}

/// Where something lives now: a node and its agent's addresses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlaceRec {
    /// The node.
    pub node: String,
    /// Its agent's addresses.
    pub agents: Vec<SocketAddr>,
    /// The process holding it, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

/// A record read back that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordError {
    /// Larger than [`MAX_RECORD`].
    TooLarge(usize),
    /// Not the JSON of the record.
    Malformed(String),
    /// A name or a list beyond its bound.
    OutOfBounds(&'static str),
}

impl std::fmt::Display for RecordError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordError::TooLarge(n) => write!(f, "a record of {n} bytes (at most {MAX_RECORD})"),
            RecordError::Malformed(e) => write!(f, "not a record: {e}"),
            RecordError::OutOfBounds(what) => write!(f, "{what} beyond its bound"),
        }
    }
}

fn parse<T: for<'de> Deserialize<'de>>(b: &[u8]) -> Result<T, RecordError> {
    if b.len() > MAX_RECORD {
        return Err(RecordError::TooLarge(b.len()));
    }
    serde_json::from_slice(b).map_err(|e| RecordError::Malformed(e.to_string()))
}

fn name_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_NAME && !s.chars().any(char::is_control)
}

/// Reads a node record.
pub fn parse_node(b: &[u8]) -> Result<NodeRec, RecordError> {
    let r: NodeRec = parse(b)?;
    if !name_ok(&r.node) {
        return Err(RecordError::OutOfBounds("node name"));
    }
    if r.agents.len() > MAX_ADDRS || r.networks.len() > MAX_ADDRS {
        return Err(RecordError::OutOfBounds("agent addresses or networks"));
    }
    if r.networks.iter().any(|n| !name_ok(&n.name) || n.mac.as_ref().is_some_and(|m| m.len() > 17)) {
        return Err(RecordError::OutOfBounds("network name or MAC"));
    }
    if r.version.len() > 64 {
        return Err(RecordError::OutOfBounds("version"));
    }
    Ok(r)
}

/// Reads a place record (a GID's end, a moved listener).
pub fn parse_place(b: &[u8]) -> Result<PlaceRec, RecordError> {
    let r: PlaceRec = parse(b)?;
    if !name_ok(&r.node) {
        return Err(RecordError::OutOfBounds("node name"));
    }
    if r.agents.len() > MAX_ADDRS {
        return Err(RecordError::OutOfBounds("agent addresses"));
    }
    Ok(r)
}

/// Reads a listener record.
pub fn parse_listener(b: &[u8]) -> Result<ListenRec, RecordError> {
    let r: ListenRec = parse(b)?;
    if !name_ok(&r.node) {
        return Err(RecordError::OutOfBounds("node name"));
    }
    Ok(r)
}

/// A MAC address as text.
pub fn mac_text(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// What a change of the node prefix means for the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeChange {
    /// A node not known before.
    Joined(String),
    /// A known node's record changed (re-registered, new addresses).
    Updated(String),
    /// A node's record went away (its lease ended or its agent stopped).
    Left(String),
    /// Nothing the cache holds.
    None,
}

/// The nodes this agent watches in the directory (those it has connections with or looked
/// up lately): name → agent addresses, at most [`MAX_CACHED_NODES`].
#[derive(Default, Debug)]
pub struct NodeCache {
    nodes: HashMap<String, Vec<SocketAddr>>,
    /// Nodes seen but not kept (the cache was full).
    pub overflow: u64,
}

impl NodeCache {
    /// A node record was put at `key` (its value `value`).
    pub fn put(&mut self, value: &[u8]) -> Result<NodeChange, RecordError> {
        let r = parse_node(value)?;
        if let Some(a) = self.nodes.get_mut(&r.node) {
            *a = r.agents;
            return Ok(NodeChange::Updated(r.node));
        }
        if self.nodes.len() >= MAX_CACHED_NODES {
            self.overflow += 1;
            return Ok(NodeChange::None);
        }
        self.nodes.insert(r.node.clone(), r.agents);
        Ok(NodeChange::Joined(r.node))
    }

    /// The node record at `key` was deleted (`prefix`: the node prefix).
    pub fn delete(&mut self, node_prefix: &str, key: &str) -> NodeChange {
        let Some(name) = key.strip_prefix(node_prefix) else { return NodeChange::None };
        let found = self.nodes.keys().find(|n| key_name(n) == name).cloned();
        match found {
            Some(n) => {
                self.nodes.remove(&n);
                NodeChange::Left(n)
            }
            None => NodeChange::None,
        }
    }

    /// The nodes registered now, read whole (`values`: their records), after a time in
    /// which changes may have been missed: what joined and what left meanwhile.
    pub fn replace_all<'a>(&mut self, values: impl IntoIterator<Item = &'a [u8]>) -> Vec<NodeChange> {
        let old = std::mem::take(&mut self.nodes);
        self.overflow = 0;
        let mut changes = Vec::new();
        for v in values {
            if let Ok(NodeChange::Joined(n)) = self.put(v) {
                if !old.contains_key(&n) {
                    changes.push(NodeChange::Joined(n));
                }
            }
        }
        for n in old.into_keys() {
            if !self.nodes.contains_key(&n) {
                changes.push(NodeChange::Left(n));
            }
        }
        changes
    }

    /// Forgets node `name` (no longer watched); true if it was known.
    pub fn forget(&mut self, name: &str) -> bool {
        self.nodes.remove(name).is_some()
    }

    /// True if node `name` is known.
    pub fn contains(&self, name: &str) -> bool {
        self.nodes.contains_key(name)
    }

    /// Nodes known.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True if no node is known.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node one of whose agent addresses is among `agents`.
    pub fn node_at(&self, agents: &[SocketAddr]) -> Option<&str> {
        self.nodes.iter().find(|(_, a)| a.iter().any(|x| agents.contains(x))).map(|(n, _)| n.as_str())
    }

    /// A node's agent addresses.
    pub fn agents_of(&self, node: &str) -> Option<&[SocketAddr]> {
        self.nodes.get(node).map(|v| v.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> Vec<u8> {
        serde_json::to_vec(&NodeRec {
            node: name.into(),
            agents: vec!["10.0.0.1:7787".parse().unwrap()],
            networks: vec![NetRec {
                name: "eth0".into(),
                addr: "10.0.0.1".parse().unwrap(),
                mac: Some(mac_text([2, 0, 0, 0, 0, 1])),
                mtu: Some(1500),
            }],
            version: "0.1.0".into(),
        })
        .unwrap()
    }

    #[test]
    fn keys_sit_under_the_cluster_prefix() {
        let p = prefix(0xbeef);
        assert_eq!(p, "/vmi/beef/");
        assert_eq!(node_key(&p, "a/b"), "/vmi/beef/node/a_b");
        assert_eq!(gid_key(&p, 1, true), format!("/vmi/beef/gid/{:032x}/out", 1));
        assert!(gid_key(&p, 7, false).starts_with(&gid_prefix(&p, 7)));
        assert_eq!(listener_key(&p, "n", "0.0.0.0:80".parse().unwrap()), "/vmi/beef/listener/n/0.0.0.0:80");
        assert_eq!(moved_key(&p, "n", "10.0.0.1:80".parse().unwrap()), "/vmi/beef/moved/n/10.0.0.1:80");
    }

    #[test]
    fn records_read_back_and_bad_ones_are_refused() {
        let r = parse_node(&node("h1")).unwrap();
        assert_eq!(r.networks[0].mac.as_deref(), Some("02:00:00:00:00:01"));
        assert!(matches!(parse_node(b"{}"), Err(RecordError::Malformed(_))));
        assert!(matches!(parse_node(&vec![b' '; MAX_RECORD + 1]), Err(RecordError::TooLarge(_))));
        let long = String::from_utf8(node(&"x".repeat(MAX_NAME + 1))).unwrap();
        assert!(matches!(parse_node(long.as_bytes()), Err(RecordError::OutOfBounds(_))));
        let p = PlaceRec { node: "h2".into(), agents: vec![], pid: Some(4) };
        assert_eq!(parse_place(&serde_json::to_vec(&p).unwrap()).unwrap(), p);
        assert!(parse_place(br#"{"node":"","agents":[]}"#).is_err());
        assert!(parse_listener(br#"{"node":"h","addr":"0.0.0.0:80"}"#).is_ok());
    }

    #[test]
    fn the_cache_tells_joins_updates_and_departures() {
        let p = prefix(1);
        let np = format!("{p}node/");
        let mut c = NodeCache::default();
        assert_eq!(c.put(&node("h1")).unwrap(), NodeChange::Joined("h1".into()));
        assert_eq!(c.put(&node("h1")).unwrap(), NodeChange::Updated("h1".into()));
        assert_eq!(c.put(&node("a/b")).unwrap(), NodeChange::Joined("a/b".into()));
        assert_eq!(c.len(), 2);
        assert_eq!(c.delete(&np, &node_key(&p, "a/b")), NodeChange::Left("a/b".into()));
        assert_eq!(c.delete(&np, &node_key(&p, "zz")), NodeChange::None);
        assert_eq!(c.agents_of("h1").map(|a| a.len()), Some(1));
        assert_eq!(c.node_at(&["10.0.0.1:7787".parse().unwrap()]), Some("h1"));
        assert_eq!(c.node_at(&["10.0.0.9:7787".parse().unwrap()]), None);
        assert_eq!(agent_key(&p, "10.0.0.1:7787".parse().unwrap()), "/vmi/0001/agent/10.0.0.1:7787");
        // Read whole after a gap: h1 left, h2 joined meanwhile.
        let n2 = node("h2");
        let changes = c.replace_all([n2.as_slice(), b"junk".as_slice()]);
        assert_eq!(changes, vec![NodeChange::Joined("h2".into()), NodeChange::Left("h1".into())]);
        assert_eq!(c.len(), 1);
        assert!(c.contains("h2") && c.forget("h2") && !c.forget("h2") && c.is_empty());
    }
}
