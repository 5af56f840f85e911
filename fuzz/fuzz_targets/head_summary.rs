//! A cluster head takes each node's summary (JSON pushed through the cluster's channel):
//! any text is taken or refused without a panic, and what the head holds stays within its
//! bounds however many summaries arrive; reading its status and events back never panics.
//!
//! The input is split at NUL bytes into several summaries, taken one after the other. A
//! summary whose first byte is `{` is taken as it is; any other is built from its bytes into
//! a well-formed summary (node name, boot, events with their numbers, pids and owners, and
//! a piece of the input as one more value), so that the fuzzer reaches past the JSON parser.
#![no_main]
use agent::hier::{Store, HEAD_EVENTS_MAX, NODES_MAX};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};
use std::time::Instant;

fn num(b: &[u8]) -> u64 {
    b.iter().take(8).fold(0u64, |n, x| n << 8 | u64::from(*x))
}

fn build(part: &[u8]) -> String {
    let f: Vec<&[u8]> = part.splitn(8, |b| *b == b'|').collect();
    let get = |i: usize| f.get(i).copied().unwrap_or(&[]);
    let node = String::from_utf8_lossy(get(0)).into_owned();
    let raw: Value = serde_json::from_slice(get(6)).unwrap_or(Value::Null);
    let events: Vec<Value> = get(3)
        .chunks(3)
        .map(|c| {
            let seq = c.first().map_or(0, |x| u64::from(*x) % 8);
            let pid = c.get(1).map(|p| Value::from(u64::from(*p) % 4));
            let uid = c.get(2).map_or(Value::Null, |u| Value::from(u64::from(*u) % 3 * 500));
            json!({ "event": { "seq": seq, "kind": "x", "pid": pid }, "uid": uid })
        })
        .collect();
    let report_node = if get(2).first().is_some_and(|b| b % 5 == 0) { "other".into() } else { node.clone() };
    json!({
        "node": node,
        "boot": num(get(1)) % 4,
        "report": { "node": report_node, "connections": [raw.clone()], "processes": [] },
        "owners": { "1": num(get(4)) % 3, "x": raw.clone() },
        "lowners": raw,
        "addrs": [String::from_utf8_lossy(get(5))],
        "events": events,
        "connections_left_out": num(get(7)),
    })
    .to_string()
}

fuzz_target!(|data: &[u8]| {
    let mut s = Store::default();
    let t0 = Instant::now();
    for part in data.split(|b| *b == 0).take(64) {
        let text = if part.first() == Some(&b'{') {
            match std::str::from_utf8(part) {
                Ok(t) => t.to_string(),
                Err(_) => continue,
            }
        } else {
            build(part)
        };
        let _ = s.ingest(&text, t0);
        let (nodes, gone) = s.status(t0, Some(1000), &[], true);
        assert!(nodes.len() + gone.len() <= NODES_MAX);
        let _ = s.status(t0, None, &["a".into()], false);
        let _ = s.events(0, Some(1000));
        let _ = s.events(0, None);
        let (n, e) = s.held();
        assert!(n <= NODES_MAX && e <= HEAD_EVENTS_MAX, "{n} nodes, {e} events held");
    }
});
