//! [`Metrics`]: one snapshot of every counter of the scheduler, the host pool and each secondary
//! tier, rendered in the Prometheus text exposition format by [`Metrics::to_prometheus`].

use std::fmt::Write;

use offload_core::{SchedulerStats, Stats};
use serde::Serialize;

use crate::tiering::{TierCounters, TieringCounters, TieringManager, HOST_TIER_NAME};

/// The host pool's occupancy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolUsage {
    /// Slots in the pool.
    pub slots_total: u32,
    /// Slots holding a chunk (ready or being written).
    pub slots_used: u32,
    /// Slots holding an idle (evictable) chunk.
    pub slots_idle: u32,
    /// Slots held since a reset for a transfer that was in flight then (neither used nor free
    /// until it is over); counted in neither `slots_used` nor the free slots.
    pub slots_held: u32,
    /// Bytes per slot.
    pub slot_bytes: u32,
}

/// A snapshot of every counter.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Metrics {
    /// Scheduler-side counters (jobs built, flushes, finish signals, ...).
    pub scheduler: SchedulerStats,
    /// The host pool's counters (lookups, hits, evictions, allocation failures, ...).
    pub host: Stats,
    /// The tiering manager's counters (host bytes and time per direction, ...).
    pub tiering: TieringCounters,
    /// Each secondary tier's name and counters, in configuration order.
    pub tiers: Vec<(String, TierCounters)>,
    /// The host pool's occupancy.
    pub pool: PoolUsage,
}

impl Metrics {
    /// Gathers the counters of `scheduler` (its stats) and `manager`.
    pub fn gather(scheduler: SchedulerStats, manager: &TieringManager) -> Self {
        let host = manager.host();
        let tiers = (0..manager.tier_count())
            .filter_map(|i| Some((manager.tier_name(i)?.to_owned(), manager.tier_counters(i)?)))
            .collect();
        Self {
            scheduler,
            host: host.stats(),
            tiering: manager.counters(),
            tiers,
            pool: PoolUsage {
                slots_total: host.slot_count(),
                slots_used: host.len() as u32,
                slots_idle: host.idle_count(),
                slots_held: host.held_slot_count() as u32,
                slot_bytes: manager.options().slot_bytes,
            },
        }
    }

    /// The Prometheus text format (version 0.0.4): one `# HELP` and `# TYPE` line per metric
    /// family, samples labelled by `tier` (`cpu` is the host pool) and `direction` (`store`:
    /// toward slower tiers, `load`: toward the GPU).
    pub fn to_prometheus(&self) -> String {
        let mut out = String::new();
        let host = HOST_TIER_NAME;
        let t = &self.tiering;
        let mut lookups = vec![(host.to_owned(), self.host.lookups)];
        let mut hits = vec![(host.to_owned(), self.host.lookup_hits)];
        let mut bytes = vec![
            (host.to_owned(), "store", t.host_bytes_stored),
            (host.to_owned(), "load", t.host_bytes_loaded),
        ];
        let mut seconds = vec![
            (host.to_owned(), "store", t.host_store_ns),
            (host.to_owned(), "load", t.host_load_ns),
        ];
        let mut chunks = vec![
            (host.to_owned(), "store", "ok", t.host_chunks_stored),
            (
                host.to_owned(),
                "store",
                "failed",
                self.scheduler.store_failures,
            ),
            (host.to_owned(), "load", "ok", t.host_chunks_loaded),
            (
                host.to_owned(),
                "load",
                "failed",
                self.scheduler.load_failures,
            ),
        ];
        for (name, c) in &self.tiers {
            lookups.push((name.clone(), c.lookups));
            hits.push((name.clone(), c.hits));
            bytes.push((name.clone(), "store", c.bytes_stored));
            bytes.push((name.clone(), "load", c.bytes_loaded));
            seconds.push((name.clone(), "store", c.store_ns));
            seconds.push((name.clone(), "load", c.load_ns));
            chunks.push((name.clone(), "store", "ok", c.chunks_stored));
            chunks.push((name.clone(), "store", "failed", c.store_chunks_failed));
            chunks.push((name.clone(), "load", "ok", c.chunks_loaded));
            chunks.push((name.clone(), "load", "failed", c.load_chunks_failed));
        }
        family(
            &mut out,
            "kvtier_lookups_total",
            "counter",
            "Keys looked up, per tier.",
        );
        for (tier, v) in &lookups {
            let _ = writeln!(out, "kvtier_lookups_total{{tier=\"{tier}\"}} {v}");
        }
        family(
            &mut out,
            "kvtier_lookup_hits_total",
            "counter",
            "Lookups that found the key (pending included), per tier.",
        );
        for (tier, v) in &hits {
            let _ = writeln!(out, "kvtier_lookup_hits_total{{tier=\"{tier}\"}} {v}");
        }
        family(
            &mut out,
            "kvtier_transfer_bytes_total",
            "counter",
            "Bytes moved successfully, per tier and direction.",
        );
        for (tier, dir, v) in &bytes {
            let _ = writeln!(
                out,
                "kvtier_transfer_bytes_total{{tier=\"{tier}\",direction=\"{dir}\"}} {v}"
            );
        }
        family(
            &mut out,
            "kvtier_transfer_seconds_total",
            "counter",
            "Seconds from submit to completion summed over jobs, per tier and direction.",
        );
        for (tier, dir, ns) in &seconds {
            let _ = writeln!(
                out,
                "kvtier_transfer_seconds_total{{tier=\"{tier}\",direction=\"{dir}\"}} {}",
                seconds_text(*ns)
            );
        }
        family(
            &mut out,
            "kvtier_chunks_total",
            "counter",
            "Chunks transferred (host failures count jobs), per tier, direction and result.",
        );
        for (tier, dir, result, v) in &chunks {
            let _ = writeln!(
                out,
                "kvtier_chunks_total{{tier=\"{tier}\",direction=\"{dir}\",result=\"{result}\"}} {v}"
            );
        }
        family(
            &mut out,
            "kvtier_chunk_failures_total",
            "counter",
            "Chunks a secondary tier failed (stores and loads), per tier and the kind it \
             reported: missing, corrupt, cancelled, tier_down, timeout, io, other.",
        );
        for (tier, c) in &self.tiers {
            for (kind, v) in c.failures.labelled() {
                let _ = writeln!(
                    out,
                    "kvtier_chunk_failures_total{{tier=\"{tier}\",kind=\"{kind}\"}} {v}"
                );
            }
        }
        family(
            &mut out,
            "kvtier_deadline_expired_total",
            "counter",
            "Tier waits that passed their deadline, per tier and wait: cascade_queued (dropped, \
             pins released), cascade_in_flight and promotion (cancelled), reset_drain (cancelled \
             by a reset).",
        );
        for (tier, c) in &self.tiers {
            for (wait, v) in [
                ("cascade_queued", c.cascades_expired),
                ("cascade_in_flight", c.cascades_timed_out),
                ("promotion", c.promotions_timed_out),
                ("reset_drain", c.reset_jobs_cancelled),
            ] {
                let _ = writeln!(
                    out,
                    "kvtier_deadline_expired_total{{tier=\"{tier}\",wait=\"{wait}\"}} {v}"
                );
            }
        }
        let singles: [(&str, &str, &str, u64); 14] = [
            (
                "kvtier_allocation_failures_total",
                "counter",
                "Host-pool store preparations that failed for lack of room.",
                self.host.allocation_failures,
            ),
            (
                "kvtier_evictions_total",
                "counter",
                "Chunks evicted from the host pool.",
                self.host.evictions,
            ),
            (
                "kvtier_flushes_total",
                "counter",
                "Store jobs flushed by a fence or a preemption.",
                self.scheduler.flushes,
            ),
            (
                "kvtier_invariant_failures_total",
                "counter",
                "Broken bookkeeping invariants (counted outside strict mode).",
                self.scheduler.invariant_failures
                    + self.host.invariant_failures
                    + self.tiering.invariant_failures,
            ),
            (
                "kvtier_requests_disabled_total",
                "counter",
                "Requests whose offload was switched off after a broken invariant about them.",
                self.scheduler.requests_disabled,
            ),
            (
                "kvtier_requests_finalized_total",
                "counter",
                "Requests whose finish reached every tier.",
                self.tiering.requests_finalized,
            ),
            (
                "kvtier_promotion_pins_expired_total",
                "counter",
                "Promoted chunks unpinned at the promotion deadline, never loaded by their request.",
                self.tiering.promotion_pins_expired,
            ),
            (
                "kvtier_reset_drain_timeouts_total",
                "counter",
                "Resets whose wait for tier jobs passed the reset drain deadline.",
                self.tiering.reset_drain_timeouts,
            ),
            (
                "kvtier_drain_timeouts_total",
                "counter",
                "Drains (shutdown, tests) whose wait for tier jobs passed the drain deadline.",
                self.tiering.drain_timeouts,
            ),
            (
                "kvtier_pool_slots_held",
                "gauge",
                "Host-pool slots held since a reset for a transfer still in flight then.",
                u64::from(self.pool.slots_held),
            ),
            (
                "kvtier_pool_slots",
                "gauge",
                "Slots in the host pool.",
                u64::from(self.pool.slots_total),
            ),
            (
                "kvtier_pool_slots_used",
                "gauge",
                "Host-pool slots holding a chunk.",
                u64::from(self.pool.slots_used),
            ),
            (
                "kvtier_pool_slots_idle",
                "gauge",
                "Host-pool slots holding an evictable chunk.",
                u64::from(self.pool.slots_idle),
            ),
            (
                "kvtier_pool_bytes_used",
                "gauge",
                "Bytes of host-pool slots holding a chunk.",
                u64::from(self.pool.slots_used) * u64::from(self.pool.slot_bytes),
            ),
        ];
        for (name, kind, help, v) in singles {
            family(&mut out, name, kind, help);
            let _ = writeln!(out, "{name} {v}");
        }
        out
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Nanoseconds as decimal seconds, exactly (no float rounding).
fn seconds_text(ns: u64) -> String {
    format!("{}.{:09}", ns / 1_000_000_000, ns % 1_000_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_exact_decimals() {
        assert_eq!(seconds_text(0), "0.000000000");
        assert_eq!(seconds_text(1_500_000_001), "1.500000001");
    }

    #[test]
    fn every_sample_line_belongs_to_a_declared_family() {
        let metrics = Metrics {
            tiers: vec![("fs".to_owned(), TierCounters::default())],
            ..Metrics::default()
        };
        let text = metrics.to_prometheus();
        let declared: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(declared.contains(&name), "undeclared sample {line}");
            let value = line.rsplit(' ').next().unwrap_or_default();
            assert!(value.parse::<f64>().is_ok(), "bad value in {line}");
        }
        assert!(text.contains("kvtier_lookups_total{tier=\"fs\"} 0"));
    }

    #[test]
    fn failures_are_exported_by_kind() {
        let mut failures = crate::tiering::FailureCounts::default();
        failures.add(offload_core::tier::TierFailure::Corrupt);
        failures.add(offload_core::tier::TierFailure::Corrupt);
        failures.add(offload_core::tier::TierFailure::TierDown);
        let metrics = Metrics {
            tiers: vec![(
                "fs".to_owned(),
                TierCounters {
                    failures,
                    ..TierCounters::default()
                },
            )],
            ..Metrics::default()
        };
        let text = metrics.to_prometheus();
        for (kind, v) in [
            ("corrupt", 2),
            ("tier_down", 1),
            ("missing", 0),
            ("other", 0),
        ] {
            let line = format!("kvtier_chunk_failures_total{{tier=\"fs\",kind=\"{kind}\"}} {v}");
            assert!(text.lines().any(|l| l == line), "no line {line} in\n{text}");
        }
    }

    #[test]
    fn deadline_counters_are_exported() {
        let metrics = Metrics {
            tiers: vec![(
                "fs".to_owned(),
                TierCounters {
                    cascades_expired: 2,
                    cascades_timed_out: 3,
                    promotions_timed_out: 4,
                    reset_jobs_cancelled: 5,
                    ..TierCounters::default()
                },
            )],
            tiering: TieringCounters {
                reset_drain_timeouts: 6,
                drain_timeouts: 7,
                ..TieringCounters::default()
            },
            pool: PoolUsage {
                slots_held: 8,
                ..PoolUsage::default()
            },
            ..Metrics::default()
        };
        let text = metrics.to_prometheus();
        for line in [
            "kvtier_deadline_expired_total{tier=\"fs\",wait=\"cascade_queued\"} 2",
            "kvtier_deadline_expired_total{tier=\"fs\",wait=\"cascade_in_flight\"} 3",
            "kvtier_deadline_expired_total{tier=\"fs\",wait=\"promotion\"} 4",
            "kvtier_deadline_expired_total{tier=\"fs\",wait=\"reset_drain\"} 5",
            "kvtier_reset_drain_timeouts_total 6",
            "kvtier_drain_timeouts_total 7",
            "kvtier_pool_slots_held 8",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
        }
    }
}
