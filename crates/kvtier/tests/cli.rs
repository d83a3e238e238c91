//! Runs the `kvtier` binary on tiny inputs: bad flags and bad trace lines are one-line errors
//! naming them; `bench manager --json` reports consistent fields.

use std::path::PathBuf;
use std::process::{Command, Output};

fn kvtier(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .output()
        .expect("the kvtier binary runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The one JSON object a successful `--json` run printed.
fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// A file under the target's temporary directory, unique to this test.
fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("{}-{name}", std::process::id()));
    std::fs::write(&path, text).expect("write test input");
    path
}

/// A small prefix-chained trace: request `i` shares its first `i % 4` blocks with the others.
fn small_trace(requests: u64) -> String {
    let mut text = String::new();
    for i in 0..requests {
        let shared = i % 4;
        let mut ids: Vec<u64> = (0..shared).collect();
        ids.extend((0..3).map(|b| 1000 + i * 10 + b));
        text.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 2, \"hash_ids\": {:?}}}\n",
            i * 10,
            ids.len() * 512,
            ids
        ));
    }
    text
}

/// The report's token counts check against each other: the prompt split sums, the compute
/// total is its parts, hits stay within the workload's own reuse, and the host pool's line says
/// what kvtier loaded.
fn assert_split_sums(v: &serde_json::Value) {
    let n = |k: &str| {
        v[k].as_u64()
            .unwrap_or_else(|| panic!("field {k} missing: {v}"))
    };
    assert_eq!(
        n("prompt_tokens"),
        n("prompt_tokens_gpu_cached")
            + n("prompt_tokens_loaded")
            + n("prompt_tokens_computed")
            + n("prompt_tokens_unserved"),
        "{v}"
    );
    assert_eq!(
        n("tokens_computed"),
        n("prompt_tokens_computed") + n("decode_tokens_computed") + n("tokens_recomputed"),
        "{v}"
    );
    assert!(
        n("prompt_tokens_gpu_cached") + n("prompt_tokens_loaded") <= n("prompt_tokens_reusable"),
        "{v}"
    );
    assert_eq!(v["tiers"][0]["name"], "cpu");
    assert_eq!(
        v["tiers"][0]["tokens_served"].as_u64(),
        Some(n("tokens_loaded"))
    );
    // The host pool's hits are the chunks load jobs took from it: at least the chunks loaded.
    let cpu = |k: &str| v["tiers"][0][k].as_u64().expect("cpu tier field");
    assert!(cpu("hits") >= cpu("loads"), "{v}");
    assert_eq!(
        v["savings"]["prefill_tokens_saved"].as_u64(),
        Some(n("tokens_loaded"))
    );
}

#[test]
fn replay_with_a_model_turns_loads_into_time_under_the_stated_costs() {
    let path = temp_file("replay-model.jsonl", &small_trace(24));
    let out = kvtier(&[
        "replay",
        "--json",
        "--trace",
        path.to_str().unwrap(),
        "--tiers",
        "cpu",
        "--model",
        "qwen3-32b",
        "--no-data",
        "--gpu-blocks",
        "300",
        "--prefill-tflops",
        "500",
        "--load-gb-per-s",
        "50",
    ]);
    let v = json_of(&out);
    assert_split_sums(&v);
    // qwen3-32b: 2 x 64 layers x 8 KV heads x 128 dims x 2 bytes.
    assert_eq!(v["cost"]["kv_bytes_per_token"], 262_144);
    assert_eq!(v["cost"]["model"]["name"], "qwen3-32b");
    let loaded = v["tokens_loaded"].as_f64().expect("tokens_loaded");
    assert!(loaded > 0.0, "the GPU is small, so kvtier loads: {v}");
    let s = &v["savings"];
    let f = |k: &str| s[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {s}"));
    // 2 x 32.8e9 FLOPs per token at 500e12 FLOP/s; 262144 bytes per token at 50e9 B/s.
    let compute = loaded * 2.0 * 32.8e9 / 500e12;
    let load = loaded * 262_144.0 / 50e9;
    assert!(
        (f("prefill_s_saved") - compute).abs() < 1e-9 * compute.max(1.0),
        "{s}"
    );
    assert!((f("load_s") - load).abs() < 1e-9 * load.max(1.0), "{s}");
    let per_request = (compute - load) * 1e3 / 24.0;
    assert!(
        (f("ttft_saved_ms_per_request") - per_request).abs() < 1e-6,
        "{s}"
    );
}

#[test]
fn unknown_model_is_named_with_the_known_ones() {
    let out = kvtier(&["run", "--model", "gpt-9"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("gpt-9") && err.contains("llama-3-8b"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn bad_flag_is_one_line_naming_it() {
    let out = kvtier(&["bench", "manager", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("--no-such-flag"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");

    let out = kvtier(&[
        "bench",
        "manager",
        "--trace",
        "x",
        "--capacity-blocks",
        "lots",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("--capacity-blocks"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn missing_required_flag_is_one_line_naming_it() {
    let out = kvtier(&["bench", "manager", "--trace", "x"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("--capacity-blocks"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn bad_trace_line_is_named() {
    let mut text = small_trace(3);
    text.push_str("{\"timestamp\": 5, \"input_length\": 100, \"output_length\": 1}\n");
    let path = temp_file("bad.jsonl", &text);
    let out = kvtier(&[
        "bench",
        "manager",
        "--trace",
        path.to_str().unwrap(),
        "--capacity-blocks",
        "16",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("trace line 4") && err.contains("hash_ids"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn compare_vllm_script_that_cannot_run_is_one_line() {
    let path = temp_file("cmp.jsonl", &small_trace(5));
    let out = kvtier(&[
        "bench",
        "manager",
        "--trace",
        path.to_str().unwrap(),
        "--capacity-blocks",
        "16",
        "--compare-vllm",
        "/nonexistent/bench_vllm_manager.py",
        "--python",
        "/nonexistent/python",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("--compare-vllm") && err.contains("/nonexistent/python"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn missing_trace_file_is_named() {
    let out = kvtier(&[
        "bench",
        "manager",
        "--trace",
        "/nonexistent/kvtier.jsonl",
        "--capacity-blocks",
        "16",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("/nonexistent/kvtier.jsonl"));
}

#[test]
fn bench_manager_json_fields_are_present_and_consistent() {
    let path = temp_file("small.jsonl", &small_trace(40));
    for policy in ["lru", "arc"] {
        let out = kvtier(&[
            "--json",
            "bench",
            "manager",
            "--trace",
            path.to_str().unwrap(),
            "--capacity-blocks",
            "1000",
            "--policy",
            policy,
            "--passes",
            "2",
        ]);
        let v = json_of(&out);
        let n = |k: &str| {
            v[k].as_f64()
                .unwrap_or_else(|| panic!("field {k} missing: {v}"))
        };
        assert_eq!(n("requests"), 40.0);
        // 40 requests of 3 own blocks plus 0,1,2,3 shared ones in turn: 120 + 60.
        assert_eq!(n("total_blocks"), 180.0);
        // Unbounded for this trace: every shared block but the first sight of each hits, and
        // request i's shared blocks are a prefix. Block 0 first seen at i=1, block 1 at i=2, ...
        // Hits: i%4==1 -> 1 (except i=1), ==2 -> 2 (except i=2: 1), ==3 -> 3 (except i=3: 2).
        assert_eq!(n("hit_blocks"), 9.0 + 19.0 + 29.0);
        assert!(n("block_ops") >= 2.0 * n("total_blocks"));
        assert!(n("elapsed_s") >= 0.0);
        assert!(n("block_ops_per_s") >= 0.0);
        assert_eq!(v["policy"], policy);
    }
}

#[test]
fn bench_host_json_rows_have_path_ceiling_and_ratio() {
    let out = kvtier(&[
        "bench",
        "host",
        "--json",
        "--chunk-kib",
        "64,256",
        "--total-mib",
        "1",
        "--reps",
        "1",
    ]);
    let v = json_of(&out);
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 4, "a store and a load row per chunk size: {v}");
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {r}"));
        assert!(f("gib_per_s") > 0.0 && f("ceiling_gib_per_s") > 0.0);
        assert!((f("ratio") - f("gib_per_s") / f("ceiling_gib_per_s")).abs() < 1e-9);
    }
    assert_eq!(rows[2]["chunk_bytes"], 256 * 1024);
}

#[test]
fn run_small_workload_reports_every_tier_and_no_failure() {
    // A small KV size keeps the test quick; the default model's size is the same code path.
    let out = kvtier(&[
        "run",
        "--json",
        "--conversations",
        "4",
        "--kv-bytes-per-token",
        "256",
    ]);
    let v = json_of(&out);
    let n = |k: &str| {
        v[k].as_u64()
            .unwrap_or_else(|| panic!("field {k} missing: {v}"))
    };
    // Two instances, 4 conversations of 4 turns each.
    assert_eq!(n("requests_total"), 32);
    assert_eq!(n("requests_finished"), 32);
    assert_eq!(n("integrity_failures"), 0);
    assert_eq!(n("invariant_failures"), 0);
    assert_split_sums(&v);
    // Later turns extend earlier ones and conversations share system prompts: both caches hit.
    assert!(
        n("prompt_tokens_loaded") > 0 && n("prompt_tokens_gpu_cached") > 0,
        "{v}"
    );
    assert_eq!(v["cost"]["kv_bytes_per_token"], 256);
    assert!(v["cost"]["model"].is_null(), "{v}");
    assert!(v["elapsed_s"].as_f64().is_some());
    let tiers = v["tiers"].as_array().expect("tiers");
    let names: Vec<&str> = tiers.iter().filter_map(|t| t["name"].as_str()).collect();
    assert_eq!(names, ["cpu", "fs", "p2p"]);
    for t in tiers {
        for f in ["hits", "stores", "loads", "bytes_stored", "bytes_loaded"] {
            assert!(t[f].as_u64().is_some(), "{f} missing in {t}");
        }
    }
    // Later turns extend earlier prompts, so the host pool stored chunks.
    assert!(tiers[0]["stores"].as_u64() > Some(0));
    // No load failed (no reset, no fault): every chunk a load took from the host pool arrived,
    // so its hits are its loads, however often a waiting request was looked up again (the
    // host pool's own lookup counter was several times that here).
    assert_eq!(tiers[0]["hits"], tiers[0]["loads"], "{v}");
}

#[test]
fn run_with_a_bad_config_file_names_the_key() {
    let path = temp_file("bad.toml", "cpu_bytes_to_use = 1048576\nno_such_key = 3\n");
    let out = kvtier(&["run", "--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("no_such_key"), "{err}");
}

#[test]
fn replay_small_trace_reuses_shared_prefixes_with_odd_block_sizes() {
    let path = temp_file("replay.jsonl", &small_trace(24));
    for tpb in ["16", "48"] {
        let out = kvtier(&[
            "replay",
            "--json",
            "--trace",
            path.to_str().unwrap(),
            "--tiers",
            "cpu,fs",
            "--tokens-per-block",
            tpb,
            "--kv-bytes-per-token",
            "8",
            "--gpu-blocks",
            "400",
            "--async-scheduling",
            "--offload-prompt-only",
            "true",
        ]);
        let v = json_of(&out);
        let n = |k: &str| {
            v[k].as_u64()
                .unwrap_or_else(|| panic!("field {k} missing: {v}"))
        };
        assert_eq!(n("requests_total"), 24);
        assert_eq!(n("requests_finished"), 24);
        assert_eq!(n("integrity_failures"), 0);
        assert_eq!(n("invariant_failures"), 0);
        // 24 requests of 3..6 blocks of 512 tokens.
        assert_eq!(n("prompt_tokens"), 512 * (24 * 3 + 6 * (1 + 2 + 3)));
        // Shared prefixes are found again, on the GPU or in the offload tiers, never more
        // than the trace shares.
        assert_split_sums(&v);
        assert!(
            n("prompt_tokens_gpu_cached") + n("prompt_tokens_loaded") > 0,
            "{v}"
        );
        let tiers: Vec<&str> = v["tiers"]
            .as_array()
            .expect("tiers")
            .iter()
            .filter_map(|t| t["name"].as_str())
            .collect();
        assert_eq!(tiers, ["cpu", "fs"]);
    }
}

#[test]
fn replay_bad_input_is_named() {
    let mut text = small_trace(2);
    text.push_str(
        "{\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [\"x\"]}\n",
    );
    let path = temp_file("replay-bad.jsonl", &text);
    let out = kvtier(&["replay", "--trace", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("trace line 3") && err.contains("hash_ids[0]"),
        "{err}"
    );

    let good = temp_file("replay-good.jsonl", &small_trace(2));
    let out = kvtier(&[
        "replay",
        "--trace",
        good.to_str().unwrap(),
        "--tiers",
        "cpu,tape",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--tiers"), "{}", stderr(&out));

    let out = kvtier(&["replay", "--trace", "x", "--offload-prompt-only", "maybe"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--offload-prompt-only"),
        "{}",
        stderr(&out)
    );
}
