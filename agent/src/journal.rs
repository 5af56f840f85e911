//! What happened on this node, as events `vmictl events [--follow]` shows: connections made
//! and closed, paths down and up, networks taken out of service, links rebuilt, substrate
//! moves, checkpoint phases, refused intrusions. The last [`KEEP`] are kept in memory;
//! followers are woken for each new one.

use serde_json::{json, Value};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Events kept for `vmictl events`.
pub const KEEP: usize = 4096;

/// One event.
#[derive(Clone, Debug)]
pub struct Event {
    /// Its number on this node (from 1).
    pub seq: u64,
    /// The process it concerns (`None`: the node's own, seen by everyone); its owner is
    /// looked up when a user other than root reads the journal, not on the connection's
    /// path (a process gone by then is seen by root only).
    pub pid: Option<u32>,
    /// The event as `vmictl events --json` prints it.
    pub json: Value,
}

/// What an event says, as it was recorded. The events every connection makes (made,
/// closed) keep their few fields as they are and become JSON only when someone reads them:
/// the agent records them on the set-up path, where building JSON (maps, strings, the GID
/// in hex) cost about a fifth of its work per connection.
#[derive(Clone, Debug)]
enum Body {
    Fields(Value),
    Connection { gid: u128, side: &'static str, local: Option<SocketAddr>, peer: SocketAddr },
    Closed { gid: u128, reason: Option<&'static str> },
}

#[derive(Clone, Debug)]
struct Stored {
    seq: u64,
    pid: Option<u32>,
    kind: &'static str,
    ms: u64,
    body: Body,
}

impl Stored {
    fn event(&self) -> Event {
        let mut j = json!({ "kind": self.kind, "ms": self.ms, "seq": self.seq });
        if let Some(o) = j.as_object_mut() {
            match &self.body {
                Body::Fields(Value::Object(f)) => o.extend(f.clone()),
                Body::Fields(_) => {}
                Body::Connection { gid, side, local, peer } => {
                    o.insert("gid".into(), format!("{gid:032x}").into());
                    o.insert("side".into(), (*side).into());
                    if let Some(l) = local {
                        o.insert("local".into(), l.to_string().into());
                    }
                    o.insert("peer".into(), peer.to_string().into());
                }
                Body::Closed { gid, reason } => {
                    o.insert("gid".into(), format!("{gid:032x}").into());
                    if let Some(r) = reason {
                        o.insert("reason".into(), (*r).into());
                    }
                }
            }
            if let Some(p) = self.pid {
                o.insert("pid".into(), p.into());
            }
        }
        Event { seq: self.seq, pid: self.pid, json: j }
    }
}

#[derive(Default)]
struct Log {
    events: VecDeque<Stored>,
    next: u64,
    /// Events recorded since start-up, by kind (for metrics).
    counts: std::collections::BTreeMap<&'static str, u64>,
}

/// The node's events.
#[derive(Default)]
pub struct Journal {
    log: Mutex<Log>,
    more: Condvar,
    /// Followers waiting for a new event (woken only when there are some: a wake with
    /// nobody waiting is a system call all the same).
    waiting: AtomicUsize,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The owner of process `pid`, if it still exists.
pub fn owner(pid: u32) -> Option<u32> {
    crate::local::owner_of(pid)
}

impl Journal {
    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records an event of kind `kind` with the fields of `fields` (an object), concerning
    /// process `pid` if given (then only its owner and whoever may run the node see it).
    pub fn record(&self, kind: &'static str, pid: Option<u32>, fields: Value) {
        self.keep(kind, pid, Body::Fields(fields));
    }

    /// Records that process `pid` holds connection `gid` from now on, on side `side`
    /// (`"out"`: it connected, to `peer`; `"in"`: it accepted, at `local`, from `peer`).
    pub fn record_connection(
        &self,
        pid: u32,
        gid: u128,
        side: &'static str,
        local: Option<SocketAddr>,
        peer: SocketAddr,
    ) {
        self.keep("connection", Some(pid), Body::Connection { gid, side, local, peer });
    }

    /// Records that process `pid` let go of connection `gid` (`reason` when it did not
    /// say so itself).
    pub fn record_closed(&self, pid: u32, gid: u128, reason: Option<&'static str>) {
        self.keep("closed", Some(pid), Body::Closed { gid, reason });
    }

    fn keep(&self, kind: &'static str, pid: Option<u32>, body: Body) {
        let ms = now_ms();
        let mut log = self.lock();
        *log.counts.entry(kind).or_default() += 1;
        log.next += 1;
        let seq = log.next;
        if log.events.len() >= KEEP {
            log.events.pop_front();
        }
        log.events.push_back(Stored { seq, pid, kind, ms, body });
        drop(log);
        if self.waiting.load(SeqCst) > 0 {
            self.more.notify_all();
        }
    }

    /// Events after number `after` that `only` may see (`None`: every event), waiting up
    /// to `wait` for one if there is none yet; and the number of the latest event (seen or
    /// not), to ask from next time.
    pub fn since(&self, after: u64, only: Option<u32>, wait: Duration) -> (Vec<Event>, u64) {
        let visible = |e: &Stored| match (only, e.pid) {
            (None, _) | (_, None) => true,
            (Some(u), Some(p)) => owner(p) == Some(u),
        };
        let mut log = self.lock();
        if log.next <= after && !wait.is_zero() {
            // (Counted while the lock is held: an event recorded after this sees it.)
            self.waiting.fetch_add(1, SeqCst);
            log = self.more.wait_timeout(log, wait).unwrap_or_else(|e| e.into_inner()).0;
            self.waiting.fetch_sub(1, SeqCst);
        }
        let newer: Vec<Stored> = log.events.iter().filter(|e| e.seq > after).cloned().collect();
        let last = log.next.max(after);
        drop(log);
        // (Owners are looked up and JSON made without the lock: recording must not wait
        // for /proc.)
        (newer.iter().filter(|e| visible(e)).map(Stored::event).collect(), last)
    }

    /// How many events of each kind were recorded since start-up.
    pub fn counts(&self) -> Vec<(String, u64)> {
        self.lock().counts.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    /// The number of the latest event.
    pub fn last(&self) -> u64 {
        self.lock().next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn events_are_numbered_kept_bounded_and_filtered_by_owner() {
        let j = Journal::default();
        j.record("path", None, json!({"up": false}));
        // A process that does not exist belongs to nobody who could ask.
        j.record("connection", Some(u32::MAX - 1), json!({"gid": "ab"}));
        let (all, last) = j.since(0, None, Duration::ZERO);
        assert_eq!(last, 2);
        assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(all[1].json["gid"], "ab");
        assert_eq!(all[1].json["kind"], "connection");
        let (other, last) = j.since(0, Some(1000), Duration::ZERO);
        assert_eq!(other.len(), 1, "another user sees the node's events only");
        assert_eq!(last, 2, "and asks from after the ones it may not see next time");
        for i in 0..KEEP + 10 {
            j.record("x", None, json!({ "i": i }));
        }
        let (kept, _) = j.since(0, None, Duration::ZERO);
        assert_eq!(kept.len(), KEEP);
        assert_eq!(kept.last().unwrap().seq, j.last());
    }

    #[test]
    fn connection_events_read_as_json_with_their_fields() {
        let j = Journal::default();
        let (l, p): (SocketAddr, SocketAddr) =
            ("10.0.0.1:80".parse().unwrap(), "10.0.0.2:59001".parse().unwrap());
        j.record_connection(7, 0xab, "in", Some(l), p);
        j.record_connection(7, 0xcd, "out", None, l);
        j.record_closed(7, 0xab, None);
        j.record_closed(7, 0xcd, Some("its process ended"));
        let (all, _) = j.since(0, None, Duration::ZERO);
        let js: Vec<&Value> = all.iter().map(|e| &e.json).collect();
        assert_eq!(js[0]["kind"], "connection");
        assert_eq!(js[0]["gid"], format!("{:032x}", 0xab));
        assert_eq!(js[0]["side"], "in");
        assert_eq!(js[0]["local"], "10.0.0.1:80");
        assert_eq!(js[0]["peer"], "10.0.0.2:59001");
        assert_eq!(js[0]["pid"], 7);
        assert_eq!(js[0]["seq"], 1);
        assert!(js[1].get("local").is_none());
        assert_eq!(js[2]["kind"], "closed");
        assert!(js[2].get("reason").is_none());
        assert_eq!(js[3]["reason"], "its process ended");
        assert_eq!(j.counts(), vec![("closed".to_string(), 2), ("connection".to_string(), 2)]);
    }

    #[test]
    fn a_follower_wakes_for_a_new_event() {
        let j = Arc::new(Journal::default());
        let j2 = j.clone();
        let t = std::thread::spawn(move || j2.since(0, None, Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(100));
        j.record("path", None, json!({}));
        let (got, _) = t.join().unwrap();
        assert_eq!(got.len(), 1);
    }
}
