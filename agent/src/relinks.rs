//! Failovers as the processes of this node felt them, and its migrations: each rebuilt link is reported by the
//! layer (`Msg::Relinked`: how long the connection stood still, what it sent again) and kept
//! here for the metrics, beside the event in the journal.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

fn outcome_label(o: &str) -> Labels {
    vec![("outcome".to_string(), o.to_string())]
}

fn side(dialer: bool) -> Labels {
    vec![("side".to_string(), if dialer { "dialer" } else { "holder" }.to_string())]
}

/// The node's failovers since the agent started.
pub struct Relinks {
    /// Seconds from a link's failure (as its process saw it) to the rebuilt link, by which
    /// side dialed.
    stall: Family<Labels, Histogram>,
    /// Bytes sent again on rebuilt links.
    replayed: Family<Labels, Counter>,
    /// Checkpoints of this node's processes, by outcome (moved away, or stayed here).
    migrations: Family<Labels, Counter>,
}

impl Default for Relinks {
    fn default() -> Relinks {
        let r = Relinks {
            // 1 ms to about 65 s, doubling.
            stall: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 17))),
            replayed: Family::default(),
            migrations: Family::default(),
        };
        // Both sides shown from the start, at zero (a scrape before the first failover
        // still finds the series).
        for dialer in [true, false] {
            drop(r.stall.get_or_create(&side(dialer)));
            drop(r.replayed.get_or_create(&side(dialer)));
        }
        for outcome in ["moved_away", "stayed"] {
            drop(r.migrations.get_or_create(&outcome_label(outcome)));
        }
        r
    }
}

impl Relinks {
    /// A link rebuilt after `stall_ms`, with `replayed` bytes sent again by this side.
    pub fn note(&self, dialer: bool, stall_ms: u32, replayed: u64) {
        self.stall.get_or_create(&side(dialer)).observe(f64::from(stall_ms) / 1000.0);
        self.replayed.get_or_create(&side(dialer)).inc_by(replayed);
    }

    /// A process of this node was checkpointed: `moved` away, or it stayed here (the
    /// checkpoint or the restore failed).
    pub fn migrated(&self, moved: bool) {
        self.migrations.get_or_create(&outcome_label(if moved { "moved_away" } else { "stayed" })).inc();
    }

    /// Adds the histogram and the counters to `reg`.
    pub fn register(&self, reg: &mut Registry) {
        reg.register(
            "relink_seconds",
            "Time from a link's failure, as its process saw it, to the rebuilt link, by the side that dialed",
            self.stall.clone(),
        );
        reg.register(
            "migrations",
            "Processes of this node checkpointed for a migration, by outcome (moved_away, stayed)",
            self.migrations.clone(),
        );
        reg.register(
            "replayed_bytes",
            "Bytes sent again on rebuilt links (the peer had not delivered them), by side",
            self.replayed.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stalls_fall_in_their_buckets() {
        let r = Relinks::default();
        r.note(true, 3, 10);
        r.note(true, 900, 5);
        r.note(false, 1, 0);
        let mut reg = Registry::with_prefix("vmi");
        r.register(&mut reg);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(out.contains("vmi_relink_seconds_count{side=\"dialer\"} 2"), "{out}");
        assert!(out.contains("vmi_relink_seconds_bucket{le=\"0.004\",side=\"dialer\"} 1"), "{out}");
        assert!(out.contains("vmi_relink_seconds_bucket{le=\"1.024\",side=\"dialer\"} 2"), "{out}");
        assert!(out.contains("vmi_replayed_bytes_total{side=\"dialer\"} 15"), "{out}");
        assert!(out.contains("vmi_relink_seconds_count{side=\"holder\"} 1"), "{out}");
        r.migrated(true);
        let mut reg = Registry::with_prefix("vmi");
        r.register(&mut reg);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(out.contains("vmi_migrations_total{outcome=\"moved_away\"} 1"), "{out}");
        assert!(out.contains("vmi_migrations_total{outcome=\"stayed\"} 0"), "{out}");
    }
}
