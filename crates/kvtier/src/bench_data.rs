//! `kvtier bench host|fs|p2p`: each data path and the machine's ceiling, measured in the same
//! run by the tier crate's own benchmark (`tier_gpu::bench`, `tier_fs::bench`, `tier_p2p::bench`),
//! printed side by side with their ratio per chunk size.

use offload_core::bench::BenchRow;
use serde::Serialize;

/// One row of the output: [`BenchRow`] with its ratio.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RatioRow {
    /// What was measured (`store`, `load`, `fetch`).
    pub op: String,
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    /// The path's throughput, GiB/s.
    pub gib_per_s: f64,
    /// The ceiling's throughput, GiB/s, same run.
    pub ceiling_gib_per_s: f64,
    /// `gib_per_s / ceiling_gib_per_s` (each the best of its rounds).
    pub ratio: f64,
    /// The median of each round's own path/ceiling ratio, where the bench pairs its rounds
    /// (`fs`, `p2p`); `null` where it does not (`host`).
    pub ratio_median: Option<f64>,
    /// CPU-seconds the process spent per GiB on the path and on the ceiling, over all their
    /// passes (`p2p`); `null` where the bench does not measure it.
    pub cpu_s_per_gib: Option<CpuRow>,
}

/// CPU-seconds per GiB of the path and of its ceiling, same run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CpuRow {
    /// The path's CPU-seconds per GiB.
    pub path: f64,
    /// The ceiling's CPU-seconds per GiB.
    pub ceiling: f64,
}

/// The result of one `kvtier bench host|fs|p2p` (its `--json` output).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DataBenchReport {
    /// `host`, `fs` or `p2p`.
    pub bench: String,
    /// What the ceiling is.
    pub ceiling: String,
    /// One row per direction and chunk size.
    pub rows: Vec<RatioRow>,
}

impl DataBenchReport {
    /// The report of `rows` from bench `bench` against `ceiling`.
    pub fn new(bench: &str, ceiling: &str, rows: &[BenchRow]) -> Self {
        Self::with_cpu(bench, ceiling, rows, &[])
    }

    /// [`DataBenchReport::new`], with `cpu[i]` the CPU per GiB of `rows[i]` (rows past the end
    /// of `cpu` have none).
    pub fn with_cpu(bench: &str, ceiling: &str, rows: &[BenchRow], cpu: &[CpuRow]) -> Self {
        Self {
            bench: bench.into(),
            ceiling: ceiling.into(),
            rows: rows
                .iter()
                .enumerate()
                .map(|(i, r)| RatioRow {
                    op: r.op.clone(),
                    chunk_bytes: r.chunk_bytes,
                    gib_per_s: r.gib_per_s,
                    ceiling_gib_per_s: r.ceiling_gib_per_s,
                    ratio: r.ratio(),
                    ratio_median: r.round_ratio_median,
                    cpu_s_per_gib: cpu.get(i).copied(),
                })
                .collect(),
        }
    }
}

/// Chunk size for people: `64 KiB`, `1 MiB`, or bytes.
fn size(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes % (1 << 10) == 0 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// The report as a table for people.
pub fn render(report: &DataBenchReport) -> String {
    let mut out = format!(
        "bench {}: path vs {} (same run)\n{:>10} {:>11} {:>11} {:>14} {:>7} {:>7}\n",
        report.bench,
        report.ceiling,
        "chunk",
        "op",
        "path GiB/s",
        "ceiling GiB/s",
        "ratio",
        "median"
    );
    for r in &report.rows {
        let median = r.ratio_median.map_or("-".to_owned(), |m| format!("{m:.2}"));
        out.push_str(&format!(
            "{:>10} {:>11} {:>11.2} {:>14.2} {:>7.2} {median:>7}\n",
            size(r.chunk_bytes),
            r.op,
            r.gib_per_s,
            r.ceiling_gib_per_s,
            r.ratio
        ));
    }
    out.push_str(
        "ratio: best path pass over best ceiling pass; median: of each round's own ratio\n",
    );
    for r in &report.rows {
        if let Some(cpu) = r.cpu_s_per_gib {
            out.push_str(&format!(
                "{:>10} {:>11} CPU s/GiB: path {:.3}, ceiling {:.3} ({:.2}x)\n",
                size(r.chunk_bytes),
                r.op,
                cpu.path,
                cpu.ceiling,
                cpu.path / cpu.ceiling
            ));
        }
    }
    out
}

/// Parses a comma-separated list of sizes in KiB (`64,1024`) into bytes; the error names `flag`.
pub fn parse_kib_list(list: &str, flag: &str) -> Result<Vec<usize>, String> {
    list.split(',')
        .map(|s| {
            let s = s.trim();
            match s.parse::<usize>() {
                Ok(k) if k > 0 && k <= (4 << 20) => Ok(k << 10),
                _ => Err(format!(
                    "{flag}: {s:?} is not a size in KiB from 1 to 4194304"
                )),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_carry_their_ratio_and_render() {
        let rows = [
            BenchRow {
                op: "load".into(),
                chunk_bytes: 1 << 20,
                gib_per_s: 3.0,
                ceiling_gib_per_s: 4.0,
                round_ratio_median: Some(0.625),
            },
            BenchRow {
                op: "store".into(),
                chunk_bytes: 2 << 20,
                gib_per_s: 1.0,
                ceiling_gib_per_s: 4.0,
                round_ratio_median: None,
            },
        ];
        let report = DataBenchReport::new("fs", "raw O_DIRECT", &rows);
        assert!((report.rows[0].ratio - 0.75).abs() < 1e-12);
        assert_eq!(report.rows[0].ratio_median, Some(0.625));
        let text = render(&report);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].ends_with("median"), "{text}");
        assert!(
            lines[2].contains("1 MiB") && lines[2].contains("0.75"),
            "{text}"
        );
        assert!(
            lines[2].ends_with("0.62") || lines[2].ends_with("0.63"),
            "{text}"
        );
        assert!(
            lines[3].contains("2 MiB") && lines[3].ends_with('-'),
            "{text}"
        );
        let json = serde_json::to_value(&report).unwrap();
        for field in [
            "chunk_bytes",
            "gib_per_s",
            "ceiling_gib_per_s",
            "ratio",
            "ratio_median",
        ] {
            assert!(json["rows"][0].get(field).is_some(), "{field}");
        }
        assert!(json["rows"][1]["ratio_median"].is_null());
        assert!(json["rows"][0]["cpu_s_per_gib"].is_null());
        assert!(!text.contains("CPU"), "{text}");

        let cpu = [CpuRow {
            path: 0.5,
            ceiling: 0.25,
        }];
        let report = DataBenchReport::with_cpu("p2p", "raw loopback", &rows, &cpu);
        let text = render(&report);
        let cpu_lines: Vec<&str> = text.lines().filter(|l| l.contains("CPU")).collect();
        assert_eq!(cpu_lines.len(), 1, "{text}");
        assert!(
            cpu_lines[0].contains("1 MiB")
                && cpu_lines[0].contains("path 0.500, ceiling 0.250 (2.00x)"),
            "{text}"
        );
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["rows"][0]["cpu_s_per_gib"]["path"], 0.5);
        assert_eq!(json["rows"][0]["cpu_s_per_gib"]["ceiling"], 0.25);
        assert!(json["rows"][1]["cpu_s_per_gib"].is_null());
    }

    #[test]
    fn kib_lists_parse_and_bad_items_are_named() {
        assert_eq!(
            parse_kib_list("64, 1024", "--chunk-kib").unwrap(),
            [64 << 10, 1 << 20]
        );
        let err = parse_kib_list("64,x", "--chunk-kib").unwrap_err();
        assert!(
            err.contains("--chunk-kib") && err.contains("\"x\""),
            "{err}"
        );
    }
}
