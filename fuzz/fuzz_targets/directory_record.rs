//! The cluster directory reads records back from etcd, which other programs can write to:
//! any bytes are taken or refused as a node, place (a GID's end, a moved listener, the
//! `agent/ADDR` index) or listener record without a panic, and
//! the node cache stays within its bound however many records arrive, put one by one or
//! read whole.
//!
//! The input is split at NUL bytes into several records. A record whose first byte is `{`
//! is taken as it is; any other is built into a well-formed node record from its bytes (a
//! name, addresses, a network), so that the fuzzer reaches past the JSON parser.
#![no_main]
use agent::registry::record::{
    node_key, parse_listener, parse_node, parse_place, prefix, NodeCache, MAX_CACHED_NODES,
};
use libfuzzer_sys::fuzz_target;
use serde_json::json;

fn build(part: &[u8]) -> Vec<u8> {
    let f: Vec<&[u8]> = part.splitn(4, |b| *b == b'|').collect();
    let get = |i: usize| f.get(i).copied().unwrap_or(&[]);
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    json!({
        "node": text(get(0)),
        "agents": [text(get(1))],
        "networks": [{ "name": text(get(2)), "addr": "10.0.0.1", "mac": text(get(3)), "mtu": part.len() }],
        "version": "0",
    })
    .to_string()
    .into_bytes()
}

fuzz_target!(|data: &[u8]| {
    let p = prefix(u16::from(data.first().copied().unwrap_or(0)));
    let np = format!("{p}node/");
    let mut cache = NodeCache::default();
    let mut all = Vec::new();
    for part in data.split(|b| *b == 0).take(64) {
        let rec = if part.first() == Some(&b'{') { part.to_vec() } else { build(part) };
        let _ = parse_place(&rec);
        let _ = parse_listener(&rec);
        if let Ok(n) = parse_node(&rec) {
            let _ = cache.delete(&np, &node_key(&p, &n.node));
            // A node no longer watched is forgotten; the agent index names nodes by place.
            if part.len() % 3 == 0 {
                let _ = cache.forget(&n.node);
                assert!(!cache.contains(&n.node));
            }
        }
        let _ = cache.put(&rec);
        assert!(cache.len() <= MAX_CACHED_NODES);
        all.push(rec);
    }
    let _ = cache.replace_all(all.iter().map(|r| r.as_slice()));
    assert!(cache.len() <= MAX_CACHED_NODES);
});
