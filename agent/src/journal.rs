//! What happened on this node, as events `vmictl events [--follow]` shows: connections made
//! and closed, paths down and up, networks taken out of service, links rebuilt, substrate
//! moves, checkpoint phases, refused intrusions. The last [`KEEP`] are kept in memory;
//! followers are woken for each new one.

use serde_json::{json, Value};
use std::collections::VecDeque;
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

#[derive(Default)]
struct Log {
    events: VecDeque<Event>,
    next: u64,
    /// Events recorded since start-up, by kind (for metrics).
    counts: std::collections::BTreeMap<String, u64>,
}

/// The node's events.
#[derive(Default)]
pub struct Journal {
    log: Mutex<Log>,
    more: Condvar,
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
    pub fn record(&self, kind: &str, pid: Option<u32>, fields: Value) {
        let mut j = json!({ "kind": kind, "ms": now_ms() });
        if let (Some(o), Value::Object(f)) = (j.as_object_mut(), fields) {
            o.extend(f);
            if let Some(p) = pid {
                o.insert("pid".into(), p.into());
            }
        }
        let mut log = self.lock();
        *log.counts.entry(kind.to_string()).or_default() += 1;
        log.next += 1;
        let seq = log.next;
        if let Some(o) = j.as_object_mut() {
            o.insert("seq".into(), seq.into());
        }
        log.events.push_back(Event { seq, pid, json: j });
        while log.events.len() > KEEP {
            log.events.pop_front();
        }
        drop(log);
        self.more.notify_all();
    }

    /// Events after number `after` that `only` may see (`None`: every event), waiting up
    /// to `wait` for one if there is none yet; and the number of the latest event (seen or
    /// not), to ask from next time.
    pub fn since(&self, after: u64, only: Option<u32>, wait: Duration) -> (Vec<Event>, u64) {
        let visible = |e: &Event| match (only, e.pid) {
            (None, _) | (_, None) => true,
            (Some(u), Some(p)) => owner(p) == Some(u),
        };
        let mut log = self.lock();
        if log.next <= after && !wait.is_zero() {
            log = self.more.wait_timeout(log, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
        let newer: Vec<Event> = log.events.iter().filter(|e| e.seq > after).cloned().collect();
        let last = log.next.max(after);
        drop(log);
        // (Owners are looked up without the lock: recording must not wait for /proc.)
        (newer.into_iter().filter(visible).collect(), last)
    }

    /// How many events of each kind were recorded since start-up.
    pub fn counts(&self) -> Vec<(String, u64)> {
        self.lock().counts.iter().map(|(k, v)| (k.clone(), *v)).collect()
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
