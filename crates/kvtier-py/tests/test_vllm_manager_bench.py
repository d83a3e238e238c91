"""The vLLM side of `kvtier bench manager --compare-vllm`: crates/kvtier/scripts/
bench_vllm_manager.py against vLLM's real CPUOffloadingManager, in both of its modes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import need_vllm

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "crates" / "kvtier" / "scripts" / "bench_vllm_manager.py"


def write_trace(path: pathlib.Path) -> None:
    """Requests that share prefixes (hash ids 0..7 then their own), so some lookups hit."""
    lines = []
    for r in range(40):
        ids = list(range(8)) + [1000 + 10 * r + j for j in range(r % 5 + 1)]
        lines.append(json.dumps({"timestamp": r, "input_length": 512 * len(ids),
                                 "output_length": 1, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")


def args(trace, policy):
    return [sys.executable, str(SCRIPT), "--trace", str(trace), "--capacity-blocks", "16",
            "--policy", policy]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_serve_mode_passes_count_as_the_one_shot_run(tmp_path, policy):
    need_vllm()
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    whole = subprocess.run(args(trace, policy) + ["--passes", "2"], capture_output=True,
                           text=True, check=True)
    report = json.loads(whole.stdout.strip().splitlines()[-1])
    assert report["hit_blocks"] > 0 and report["block_ops"] > report["total_blocks"]

    served = subprocess.run(args(trace, policy) + ["--serve"], input="pass\npass\npass\n",
                            capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in served.stdout.splitlines() if line.startswith("{")]
    hello, passes = lines[0], lines[1:]
    assert hello["vllm_version"] == report["vllm_version"]
    assert hello["import"] == report["import"] and hello["requests"] == 40
    assert len(passes) == 3
    for p in passes:
        assert (p["hit_blocks"], p["block_ops"], p["store_failures"]) == (
            report["hit_blocks"], report["block_ops"], report["store_failures"])
        assert p["elapsed_s"] > 0 and p["cpu_s"] > 0


def test_serve_mode_refuses_other_commands(tmp_path):
    need_vllm()
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    served = subprocess.run(args(trace, "lru") + ["--serve"], input="go\n",
                            capture_output=True, text=True)
    assert served.returncode != 0
    assert "--serve reads 'pass' lines" in served.stderr
