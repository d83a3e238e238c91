//! The plain-data shape every data-path benchmark reports (host copies, disk tier, peer tier):
//! the path's throughput and the machine's own ceiling, measured in the same run.

use serde::{Deserialize, Serialize};

/// One measured line of a data-path benchmark: a direction at one chunk size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchRow {
    /// What was measured, e.g. `"store"`, `"load"`, `"fetch"`.
    pub op: String,
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    /// The path's throughput, GiB/s.
    pub gib_per_s: f64,
    /// The ceiling's throughput (memcpy, raw O_DIRECT, raw socket), GiB/s, same run.
    pub ceiling_gib_per_s: f64,
    /// The median of each round's own path/ceiling ratio, where the benchmark alternates
    /// rounds of the two (`None` where it does not). On a machine whose throughput swings
    /// between passes this is the steadier number: one lucky pass moves the best-of
    /// [`BenchRow::ratio`], not this.
    #[serde(default)]
    pub round_ratio_median: Option<f64>,
}

impl BenchRow {
    /// The path's throughput over the ceiling's (0 when the ceiling measured nothing).
    pub fn ratio(&self) -> f64 {
        if self.ceiling_gib_per_s > 0.0 {
            self.gib_per_s / self.ceiling_gib_per_s
        } else {
            0.0
        }
    }
}

/// The middle value of `values` (the upper one of an even count; 0 for none), sorting them. The
/// benchmarks report the median of each round's own path/ceiling ratio beside the best-of
/// ratio: one lucky pass moves a best-of, not a median.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_takes_the_middle_or_upper_middle() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
        assert_eq!(median(&mut [0.5]), 0.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn ratio_divides_and_guards_zero() {
        let mut row = BenchRow {
            op: "store".into(),
            chunk_bytes: 1 << 20,
            gib_per_s: 3.0,
            ceiling_gib_per_s: 4.0,
            round_ratio_median: None,
        };
        assert!((row.ratio() - 0.75).abs() < 1e-12);
        row.ceiling_gib_per_s = 0.0;
        assert_eq!(row.ratio(), 0.0);
    }
}
