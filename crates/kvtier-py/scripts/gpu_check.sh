#!/usr/bin/env bash
# The GPU check of kvtier's CUDA worker path (the vLLM connector with KV caches on a GPU), in two
# halves, because the GPU machine has no network and (as seen so far) no Rust toolchain:
#
#   bash crates/kvtier-py/scripts/gpu_check.sh prepare   # here: cargo, maturin (pip), no GPU
#   bash crates/kvtier-py/scripts/gpu_check.sh run       # there: a CUDA driver, python3 + torch
#
# `prepare` builds, into .gpu-check/ at the repository root (git-ignored; carry it to the GPU
# machine, it is about 20-40 MB):
#   - tier-gpu's CUDA test binary (tests/cuda.rs: the CUDA engine, StreamEvent),
#   - kvtier-worker's CUDA test binary (crates/kvtier-py/worker/tests/cuda.rs: the native worker
#     behind ConnectorWorker.cuda over cuMemAlloc'd KV caches and a compute stream),
#   both release builds, stripped; they need nothing but the driver (cudarc loads libcuda at run
#   time) and a glibc as new as this machine's;
#   - the kvtier wheel (abi3, CPython >= 3.10), for the Python-level GPU tests.
#
# `run` runs both binaries (each bounded by `timeout`), then installs the wheel with
# `pip install --no-index --no-deps --target` (no network) and runs
# crates/kvtier-py/tests/test_cuda_worker.py with KVTIER_REQUIRE_CUDA=1, so a missing GPU fails
# instead of skipping. What that needs on the GPU machine, none of it fetched: python3 with torch
# built for CUDA, pytest and prometheus-client (the 'cuda' image has all three). vLLM is not
# needed: the test through vLLM's call order says "NOT RUN" without it (its wheel is far over the
# 64 MiB a device call carries), the native tests drive the same worker as KvtierConnector.
# A sentinel's "NOT RUN" line means the GPU was not usable: `run` then fails.
#
# Where the GPU machine has cargo, `run` builds what .gpu-check/ lacks itself (slower).
# KVTIER_PYTHON=/path/to/python picks the interpreter (default python3) in both halves.
# Budget: about 1-2 minutes of device time after the machine started.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
out="$root/.gpu-check"
export CARGO_INCREMENTAL=0

die() { echo "gpu_check: $*" >&2; exit 1; }

# The path of the test binary named NAME that `cargo test ... --no-run` built (its JSON messages).
test_binary() {
    local name=$1; shift
    cargo test --release "$@" --no-run --message-format=json 2>/dev/null \
        | python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == name and m["target"]["kind"] == ["test"]:
        print(m["executable"])
' "$name" | tail -1
}

prepare() {
    command -v cargo >/dev/null || die "prepare needs cargo"
    mkdir -p "$out" && rm -f "$out"/*
    echo "==> building tier-gpu's CUDA test (release)"
    (cd "$root" && cargo test --release -p tier-gpu --features cuda --test cuda --no-run) \
        || die "tier-gpu's CUDA test did not build"
    bin=$(cd "$root" && test_binary cuda -p tier-gpu --features cuda --test cuda)
    [[ -x "$bin" ]] || die "tier-gpu's CUDA test binary not found"
    cp "$bin" "$out/tier-gpu-cuda"
    echo "==> building kvtier-worker's CUDA test (release)"
    (cd "$root" && cargo test --release --manifest-path crates/kvtier-py/worker/Cargo.toml \
        --test cuda --no-run) || die "kvtier-worker's CUDA test did not build"
    bin=$(cd "$root" && test_binary cuda --manifest-path crates/kvtier-py/worker/Cargo.toml \
        --test cuda)
    [[ -x "$bin" ]] || die "kvtier-worker's CUDA test binary not found"
    cp "$bin" "$out/kvtier-worker-cuda"
    strip --strip-debug "$out/tier-gpu-cuda" "$out/kvtier-worker-cuda" 2>/dev/null || true
    echo "==> building the kvtier wheel (pip wheel: maturin, release)"
    python="${KVTIER_PYTHON:-python3}"
    "$python" -m pip wheel -q --no-deps -w "$out" "$root/crates/kvtier-py" \
        || die "the wheel did not build (pip wheel ./crates/kvtier-py)"
    ls -la "$out"
    du -sh "$out"
    echo "gpu_check: prepared; on the GPU machine (carry .gpu-check):"
    echo "    bash crates/kvtier-py/scripts/gpu_check.sh run"
}

# Runs one step with a time limit; records its outcome and any NOT RUN line.
failures=()
not_run=()
step() {
    local name=$1 limit=$2; shift 2
    echo "==> $name"
    local log="$out/$name.log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    if [[ $rc -ne 0 ]]; then
        failures+=("$name (exit $rc)")
    fi
    while IFS= read -r line; do
        not_run+=("$name: $line")
    done < <(grep -E "^[A-Za-z].*NOT RUN" "$log")
}

run() {
    mkdir -p "$out"
    if [[ ! -x "$out/tier-gpu-cuda" || ! -x "$out/kvtier-worker-cuda" ]]; then
        command -v cargo >/dev/null \
            || die ".gpu-check/ lacks the test binaries and there is no cargo here: run \`prepare\` where cargo is and carry .gpu-check"
        prepare
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
        --format=csv,noheader
    step tier-gpu-cuda 120 "$out/tier-gpu-cuda" --nocapture
    step kvtier-worker-cuda 120 "$out/kvtier-worker-cuda" --nocapture
    local wheel
    wheel=$(ls "$out"/kvtier-*.whl 2>/dev/null | head -1)
    if [[ -z "$wheel" ]]; then
        failures+=("python (no kvtier wheel in .gpu-check)")
    else
        local site=/tmp/kvtier-gpu-check-site py="${KVTIER_PYTHON:-python3}"
        rm -rf "$site"
        "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" \
            || failures+=("python (the wheel did not install)")
        step python 240 env PYTHONPATH="$site" KVTIER_REQUIRE_CUDA=1 PYTHONUNBUFFERED=1 \
            "$py" -m pytest -q -rs -s -p no:cacheprovider \
            "$root/crates/kvtier-py/tests/test_cuda_worker.py"
    fi
    echo
    echo "==> gpu_check summary"
    for line in "${not_run[@]}"; do echo "NOT RUN  $line"; done
    for f in "${failures[@]}"; do echo "FAILED   $f"; done
    # Only the sentinels' lines mean a GPU was not usable; other NOT RUN lines (a sub-check this
    # driver cannot do, the test through vLLM's call order where vLLM is missing) are listed.
    local blocking=()
    for line in "${not_run[@]}"; do
        case "$line" in
            *"CUDA tests NOT RUN"* | *"CUDA worker tests NOT RUN"* | *"CUDA connector tests NOT RUN"*)
                blocking+=("$line") ;;
        esac
    done
    if [[ ${#failures[@]} -eq 0 && ${#blocking[@]} -eq 0 ]]; then
        echo "gpu_check: PASSED (every GPU check ran)"
        return 0
    fi
    echo "gpu_check: FAILED (${#failures[@]} failed step(s), ${#blocking[@]} GPU check(s) not run)"
    return 1
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) die "usage: gpu_check.sh prepare|run (see the comment at the top)" ;;
esac
