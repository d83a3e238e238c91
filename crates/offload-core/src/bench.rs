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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_divides_and_guards_zero() {
        let mut row = BenchRow {
            op: "store".into(),
            chunk_bytes: 1 << 20,
            gib_per_s: 3.0,
            ceiling_gib_per_s: 4.0,
        };
        assert!((row.ratio() - 0.75).abs() < 1e-12);
        row.ceiling_gib_per_s = 0.0;
        assert_eq!(row.ratio(), 0.0);
    }
}
