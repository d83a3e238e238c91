//! Mooncake-format request traces (JSONL: `timestamp` in ms, `input_length`, `output_length`,
//! `hash_ids`, one id per 512-token block, prefix-chained) and their conversion into a
//! [`Workload`] whose prompts share tokens exactly where the trace's hash ids are shared.
//!
//! Tokens come from the trace's blocks, not from the engine's: token `t` of a prompt is token
//! `t % 512` of the stream drawn for hash id `hash_ids[t / 512]` (a [`SharedPrefix`] segment per
//! hash id, the last one cut to the prompt's length). Two requests whose first `m` hash ids are
//! equal therefore have equal first `512 * m` tokens, whatever `tokens_per_block` the engine uses.
//! When `tokens_per_block` does not divide 512, an engine block that straddles the end of the
//! shared trace blocks holds tokens of the first differing hash id, so its chained hash differs, as
//! it must: a shared prefix of `512 * m` tokens gives `floor(512 * m / tokens_per_block)` equal
//! engine-block hashes, never more.

use std::fmt;
use std::io::BufRead;
use std::path::Path;

use serde_json::Value;

use crate::rng::mix64;
use crate::workload::{RequestSpec, SharedPrefix, Workload};

/// Tokens per trace block (one hash id each), fixed by the Mooncake format.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// Longest accepted prompt, in tokens (a bound on what one line may make us allocate).
pub const INPUT_LENGTH_MAX: u64 = 1 << 24;

/// Longest accepted output, in tokens.
pub const OUTPUT_LENGTH_MAX: u64 = 1 << 24;

/// Salt that separates trace segment ids from other shared-prefix ids.
const SEGMENT_SALT: u64 = 0x5452_4143_4531_0000;

/// One line of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRecord {
    /// Arrival time in milliseconds.
    pub timestamp_ms: f64,
    /// Prompt length in tokens (at least 1).
    pub input_length: u32,
    /// Output length in tokens.
    pub output_length: u32,
    /// One id per 512-token block of the prompt: `ceil(input_length / 512)` of them.
    pub hash_ids: Vec<u64>,
}

/// What went wrong reading a trace.
#[derive(Debug)]
pub enum TraceError {
    /// The file could not be opened or read.
    Io {
        /// What was being read.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A line is not a valid record.
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The trace has no record.
    Empty,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Io { path, source } => write!(f, "cannot read trace {path}: {source}"),
            TraceError::Line { line, reason } => write!(f, "trace line {line}: {reason}"),
            TraceError::Empty => write!(f, "trace has no request"),
        }
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TraceError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Parses one line (`line` is its 1-based number, for the error). Blank lines give `None`.
pub fn parse_line(text: &str, line: usize) -> Result<Option<TraceRecord>, TraceError> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let bad = |reason: String| TraceError::Line { line, reason };
    let value: Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
    let Value::Object(obj) = value else {
        return Err(bad("not a JSON object".into()));
    };
    let field = |name: &str| {
        obj.get(name)
            .ok_or_else(|| bad(format!("missing field `{name}`")))
    };
    let timestamp_ms = match field("timestamp")?.as_f64() {
        Some(t) if t.is_finite() && t >= 0.0 => t,
        _ => {
            return Err(bad(format!(
                "`timestamp` must be a non-negative number of milliseconds, got {}",
                field("timestamp")?
            )))
        }
    };
    let count = |name: &str, min: u64, max: u64| -> Result<u32, TraceError> {
        let v = field(name)?;
        match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Ok(n as u32),
            _ => Err(bad(format!(
                "`{name}` must be an integer from {min} to {max}, got {v}"
            ))),
        }
    };
    let input_length = count("input_length", 1, INPUT_LENGTH_MAX)?;
    let output_length = count("output_length", 0, OUTPUT_LENGTH_MAX)?;
    let Value::Array(ids) = field("hash_ids")? else {
        return Err(bad("`hash_ids` must be an array of integers".into()));
    };
    let needed = input_length.div_ceil(TRACE_BLOCK_TOKENS) as usize;
    if ids.len() != needed {
        return Err(bad(format!(
            "`hash_ids` has {} ids but input_length {input_length} needs {needed} \
             (one per {TRACE_BLOCK_TOKENS} tokens)",
            ids.len()
        )));
    }
    let mut hash_ids = Vec::with_capacity(ids.len());
    for (i, id) in ids.iter().enumerate() {
        let Some(id) = id.as_u64() else {
            return Err(bad(format!(
                "`hash_ids[{i}]` must be a non-negative integer, got {id}"
            )));
        };
        hash_ids.push(id);
    }
    Ok(Some(TraceRecord {
        timestamp_ms,
        input_length,
        output_length,
        hash_ids,
    }))
}

/// Reads every record of a trace; the first bad line is an error naming it.
pub fn read_trace(reader: impl BufRead) -> Result<Vec<TraceRecord>, TraceError> {
    read_trace_named(reader, "<input>", usize::MAX)
}

/// Reads the first `limit` records of the trace file at `path`.
pub fn read_trace_file(path: &Path, limit: usize) -> Result<Vec<TraceRecord>, TraceError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: name.clone(),
        source,
    })?;
    read_trace_named(std::io::BufReader::new(file), &name, limit)
}

fn read_trace_named(
    reader: impl BufRead,
    name: &str,
    limit: usize,
) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out = Vec::new();
    for (i, text) in reader.lines().enumerate() {
        if out.len() >= limit {
            break;
        }
        let text = text.map_err(|source| TraceError::Io {
            path: name.to_string(),
            source,
        })?;
        if let Some(record) = parse_line(&text, i + 1)? {
            out.push(record);
        }
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
}

/// How trace records become simulator requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TraceOptions {
    /// Simulated milliseconds per engine step: a request arrives at step
    /// `floor((timestamp - first timestamp) / ms_per_step)`. Must be positive.
    pub ms_per_step: f64,
    /// Seed of the requests' own `seed` fields (their tokens depend on hash ids only).
    pub seed: u64,
}

impl Default for TraceOptions {
    fn default() -> Self {
        Self {
            ms_per_step: 10.0,
            seed: 1,
        }
    }
}

/// The segment id of trace hash id `hash_id`.
pub fn segment_id(hash_id: u64) -> u64 {
    mix64(hash_id ^ SEGMENT_SALT)
}

/// The request a record becomes: one segment per hash id (the last one cut to the prompt's
/// length), no tokens of its own, `max(output_length, 1)` output tokens.
pub fn to_request(record: &TraceRecord, arrival_step: u64, seed: u64) -> RequestSpec {
    let mut left = record.input_length;
    let segments = record
        .hash_ids
        .iter()
        .map(|&h| {
            let tokens = left.min(TRACE_BLOCK_TOKENS);
            left -= tokens;
            SharedPrefix {
                id: segment_id(h),
                tokens,
            }
        })
        .collect();
    RequestSpec {
        arrival_step,
        prefix: None,
        segments,
        unique_tokens: 0,
        seed,
        max_tokens: record.output_length.max(1),
        abort_step: None,
        max_offload_tokens: None,
    }
}

/// The workload of `records`, in their order (request `i` is record `i`); the simulator lets them
/// arrive in timestamp order.
pub fn to_workload(records: &[TraceRecord], options: &TraceOptions) -> Workload {
    let ms_per_step = if options.ms_per_step > 0.0 {
        options.ms_per_step
    } else {
        1.0
    };
    let t0 = records
        .iter()
        .map(|r| r.timestamp_ms)
        .fold(f64::INFINITY, f64::min);
    let requests = records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let step = ((r.timestamp_ms - t0) / ms_per_step).floor() as u64;
            to_request(r, step, mix64(options.seed ^ i as u64))
        })
        .collect();
    Workload { requests }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TokenChain;

    fn line(ts: u64, input: u32, output: u32, ids: &[u64]) -> String {
        format!(
            r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": {output}, "hash_ids": {ids:?}}}"#
        )
    }

    #[test]
    fn parses_records_and_skips_blank_lines() {
        let text = format!(
            "{}\n\n{}\n",
            line(0, 1000, 3, &[1, 2]),
            line(5, 512, 0, &[7])
        );
        let records = read_trace(text.as_bytes()).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].hash_ids, vec![1, 2]);
        assert_eq!(records[0].input_length, 1000);
        assert_eq!(records[1].timestamp_ms, 5.0);
        assert_eq!(records[1].output_length, 0);
    }

    #[test]
    fn bad_lines_name_the_line_and_the_problem() {
        let cases = [
            ("not json", "not valid JSON"),
            ("[1,2]", "not a JSON object"),
            (
                r#"{"input_length": 1, "output_length": 1, "hash_ids": [1]}"#,
                "missing field `timestamp`",
            ),
            (
                r#"{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#,
                "`timestamp`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}"#,
                "`input_length`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}"#,
                "has 1 ids but input_length 600 needs 2",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}"#,
                "`hash_ids[0]`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10, "output_length": 1.5, "hash_ids": [3]}"#,
                "`output_length`",
            ),
        ];
        for (bad, expected) in cases {
            let text = format!("{}\n{bad}\n", line(0, 10, 1, &[1]));
            let err = read_trace(text.as_bytes()).unwrap_err().to_string();
            assert!(err.starts_with("trace line 2: "), "{err}");
            assert!(err.contains(expected), "{err} should contain {expected}");
        }
        assert!(matches!(read_trace(&b"\n\n"[..]), Err(TraceError::Empty)));
    }

    #[test]
    fn missing_file_is_named() {
        let err = read_trace_file(Path::new("/nonexistent/kvtier-trace.jsonl"), 10).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/kvtier-trace.jsonl"));
    }

    #[test]
    fn limit_stops_reading() {
        let text = format!(
            "{}\n{}\nbroken\n",
            line(0, 10, 1, &[1]),
            line(1, 10, 1, &[1])
        );
        let records = read_trace_named(text.as_bytes(), "t", 2).unwrap();
        assert_eq!(records.len(), 2);
    }

    fn prompt_of(ids: &[u64], input: u32) -> Vec<u32> {
        let record = TraceRecord {
            timestamp_ms: 0.0,
            input_length: input,
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        to_request(&record, 0, 0).prompt()
    }

    /// Length of the common prefix of two token lists.
    fn common(a: &[u32], b: &[u32]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn equal_hash_id_prefixes_give_equal_token_prefixes() {
        let a = prompt_of(&[1, 2, 3], 1500);
        let b = prompt_of(&[1, 2, 9, 10], 1800);
        let c = prompt_of(&[1, 2], 700);
        assert_eq!(a.len(), 1500);
        assert_eq!(b.len(), 1800);
        // Shared exactly through the two common blocks (a chance equal token after is allowed).
        let ab = common(&a, &b);
        assert!((1024..1030).contains(&ab), "{ab}");
        // A partial last block is a prefix of the full one.
        assert_eq!(c[..], a[..700]);
        // Different first ids share nothing meaningful.
        assert!(common(&a, &prompt_of(&[4, 2, 3], 1500)) < 8);
    }

    /// Block hashes of a prompt for an engine with `tpb` tokens per block.
    fn block_hashes(tokens: &[u32], tpb: u32) -> Vec<u128> {
        let chain = TokenChain::new(tokens);
        let mut out = Vec::new();
        chain.extend_block_hashes(tpb, chain.len(), &mut out);
        out
    }

    #[test]
    fn engine_block_hashes_match_exactly_over_the_shared_trace_blocks() {
        let a = prompt_of(&[10, 11, 12, 13], 2048);
        let b = prompt_of(&[10, 11, 12, 99], 2048);
        // 16 divides 512; 48 and 100 do not.
        for tpb in [16u32, 48, 100, 512, 1000] {
            let (ha, hb) = (block_hashes(&a, tpb), block_hashes(&b, tpb));
            let equal = ha.iter().zip(&hb).take_while(|(x, y)| x == y).count();
            assert_eq!(equal as u32, 3 * 512 / tpb, "tokens_per_block {tpb}");
        }
    }

    #[test]
    fn workload_arrivals_follow_timestamps() {
        let text = format!(
            "{}\n{}\n{}\n",
            line(100, 10, 2, &[1]),
            line(125, 10, 0, &[1]),
            line(160, 600, 1, &[1, 2])
        );
        let records = read_trace(text.as_bytes()).unwrap();
        let w = to_workload(
            &records,
            &TraceOptions {
                ms_per_step: 10.0,
                seed: 3,
            },
        );
        let steps: Vec<u64> = w.requests.iter().map(|r| r.arrival_step).collect();
        assert_eq!(steps, vec![0, 2, 6]);
        assert_eq!(
            w.requests[1].max_tokens, 1,
            "output 0 still samples one token"
        );
        assert_eq!(w.requests[2].prompt_len(), 600);
        assert_eq!(w.prompt_tokens(), 620);
    }
}
