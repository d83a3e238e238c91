#!/usr/bin/env bash
# Runs `kvtier bench manager --compare-vllm` for every capacity and policy of issue 14, ROUNDS
# times each (default 3), and prints one table: per cell, the median over the rounds of kvtier's
# and vLLM's block_ops/s (median passes, by the wall clock); then the pass ratios of all rounds
# pooled (each vLLM pass against the kvtier passes run just before and after it, see
# bench_manager.rs `compare_vllm`): their median ("paired"), lowest and highest, and the same
# median by thread CPU time; last, for comparison, the median of the rounds' ratio of median
# passes ("medpass"). Several rounds, because one vLLM pass takes about a second and the
# machine's speed moves within a minute.
#
# Usage: crates/kvtier/scripts/compare_manager.sh TRACE [PYTHON] [KVTIER_PASSES] [VLLM_PASSES]
#   PYTHON: a python with vllm installed (see bench_vllm_manager.py's doc); default python3.
#   KVTIER_PASSES (default 20) are spread over the gaps around the VLLM_PASSES (default 3).
#   CAPACITIES="1024 4096" POLICIES=arc narrow the sweep; ROUNDS=N sets the rounds per cell.
set -euo pipefail
trace=${1:?usage: compare_manager.sh TRACE [PYTHON] [KVTIER_PASSES] [VLLM_PASSES]}
python=${2:-python3}
passes=${3:-20}
vllm_passes=${4:-3}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cargo build --release -q -p kvtier --manifest-path "$root/Cargo.toml"
kvtier="$root/target/release/kvtier"
rounds=${ROUNDS:-3}
case $rounds in '' | *[!0-9]* | 0) echo "compare_manager.sh: ROUNDS must be a whole number of at least 1, not '$rounds'" >&2; exit 2 ;; esac
printf '%-8s %-4s %6s %11s %9s %7s %7s %7s %7s %7s\n' capacity pol rounds kvtier_M/s vllm_M/s paired min max cpu_pr medpass
for c in ${CAPACITIES:-1024 4096 16384 65536}; do
  for p in ${POLICIES:-lru arc}; do
    # One JSON line per round; each round is one same-run pair (kvtier's passes, then vLLM's).
    for _ in $(seq "$rounds"); do
      "$kvtier" --json bench manager --trace "$trace" --capacity-blocks "$c" --policy "$p" \
        --passes "$passes" --compare-vllm "$here/bench_vllm_manager.py" --python "$python" \
        --vllm-passes "$vllm_passes" | tr -d '\n'
      echo
    done |
      python3 -c '
import json, statistics, sys
rounds = [json.loads(line) for line in sys.stdin if line.strip()]
if not rounds:
    sys.exit("compare_manager.sh: no round produced a result")
med = lambda xs: statistics.median(xs)
k = rounds[0]["kvtier"]
ratios = [r for d in rounds for r in d["pass_ratios"]]
cpu = [r for d in rounds for r in [d.get("paired_cpu_ratio")] if r is not None]
print("%-8d %-4s %6d %11.2f %9.3f %7.1f %7.1f %7.1f %7.1f %7.1f" % (
    k["capacity_blocks"], k["policy"], len(rounds),
    med([d["kvtier"]["block_ops_per_s"] for d in rounds]) / 1e6,
    med([d["vllm"]["block_ops_per_s"] for d in rounds]) / 1e6,
    med(ratios), min(ratios), max(ratios),
    med(cpu) if cpu else 0.0,
    med([d["ratio"] for d in rounds])))'
  done
done
