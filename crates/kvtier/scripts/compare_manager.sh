#!/usr/bin/env bash
# Runs `kvtier bench manager --compare-vllm` for every capacity and policy of issue 14 and prints
# one table: kvtier's and vLLM's block_ops/s (median and fastest pass, by the wall clock) and their
# ratios, then the median passes by thread CPU time and their ratio; each pair measured in the
# same run.
#
# Usage: crates/kvtier/scripts/compare_manager.sh TRACE [PYTHON] [KVTIER_PASSES] [VLLM_PASSES]
#   PYTHON: a python with vllm installed (see bench_vllm_manager.py's doc); default python3.
#   CAPACITIES="1024 4096" POLICIES=arc narrow the sweep.
set -euo pipefail
trace=${1:?usage: compare_manager.sh TRACE [PYTHON] [KVTIER_PASSES] [VLLM_PASSES]}
python=${2:-python3}
passes=${3:-20}
vllm_passes=${4:-3}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cargo build --release -q -p kvtier --manifest-path "$root/Cargo.toml"
kvtier="$root/target/release/kvtier"
printf '%-8s %-4s %11s %11s %9s %9s %7s %7s %11s %9s %7s\n' capacity pol kvtier_M/s kv_best_M/s vllm_M/s vl_best_M/s ratio best cpu_kv_M/s cpu_vl_M/s cpu_rt
for c in ${CAPACITIES:-1024 4096 16384 65536}; do
  for p in ${POLICIES:-lru arc}; do
    "$kvtier" --json bench manager --trace "$trace" --capacity-blocks "$c" --policy "$p" \
      --passes "$passes" --compare-vllm "$here/bench_vllm_manager.py" --python "$python" \
      --vllm-passes "$vllm_passes" |
      python3 -c '
import json, sys
d = json.load(sys.stdin)
k, v = d["kvtier"], d["vllm"]
cpu = lambda x: (x or 0.0) / 1e6
print("%-8d %-4s %11.2f %11.2f %9.3f %9.3f %7.1f %7.1f %11.2f %9.3f %7.1f" % (
    k["capacity_blocks"], k["policy"], k["block_ops_per_s"] / 1e6,
    k["best_block_ops_per_s"] / 1e6, v["block_ops_per_s"] / 1e6,
    v["best_block_ops_per_s"] / 1e6, d["ratio"], d["best_ratio"],
    cpu(k.get("cpu_block_ops_per_s")), cpu(v.get("cpu_block_ops_per_s")),
    d.get("cpu_ratio") or 0.0))'
  done
done
