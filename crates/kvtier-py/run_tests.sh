#!/usr/bin/env bash
# The Python package's checks, run by `cargo xtask ci` (step "python"): rustfmt and clippy of the
# extension crate and kvtier-worker, kvtier-worker's tests, then a venv with vLLM, the package
# built and installed with pip (maturin), and its pytest suite against vLLM's real classes.
#
# The venv lives in target/kvtier-py-venv and is reused; the first run installs vLLM (about 10 GB,
# 5-6 minutes here). KVTIER_PYTHON=/path/to/python uses an existing environment instead.
# KVTIER_SKIP_VLLM=1 skips installing vLLM: the vLLM tests then say "vLLM tests NOT RUN" and why
# (never in CI, where KVTIER_REQUIRE_VLLM=1 makes them fail instead).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
VLLM_VERSION=0.33.0

echo "==> kvtier-py: rustfmt and clippy (the extension and kvtier-worker)"
cargo fmt --manifest-path "$here/Cargo.toml" --all -- --check
cargo clippy --manifest-path "$here/Cargo.toml" --workspace --all-targets --locked -- -D warnings
echo "==> kvtier-worker: its tests (the CUDA one says \"CUDA worker tests NOT RUN\" without a GPU)"
cargo test --manifest-path "$here/worker/Cargo.toml" --locked

# CI (.ci/run sets KVTIER_FREE_RUST_BUILD=1): every Rust step of `cargo xtask ci` has run, and
# this step builds the extension in its own target directory, so the workspace's debug build
# (GBs) goes before vLLM's venv (about 10 GB) is installed on a disk that may be short.
if [[ "${KVTIER_FREE_RUST_BUILD:-0}" == 1 && -d "$root/target/debug" ]]; then
    echo "==> removing $root/target/debug ($(du -sh "$root/target/debug" 2>/dev/null | cut -f1)) to make room for vLLM (KVTIER_FREE_RUST_BUILD=1)"
    rm -rf "$root/target/debug"
fi

# Free space in KiB on the filesystem holding $1.
free_kib() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 { print $4 }'; }

if [[ -n "${KVTIER_PYTHON:-}" ]]; then
    py=$KVTIER_PYTHON
else
    venv="$root/target/kvtier-py-venv"
    if [[ ! -x "$venv/bin/python" ]]; then
        echo "==> creating $venv"
        python3 -m venv "$venv" || {
            echo "ERROR: python3 -m venv failed; install python3-venv (Debian) or set KVTIER_PYTHON" >&2
            exit 1
        }
    fi
    py="$venv/bin/python"
fi
"$py" -m pip --version >/dev/null || { echo "ERROR: $py has no pip" >&2; exit 1; }

# pip install with retries: a download of several GB from the package index can be cut by the
# network (CI once lost a vLLM install to a read error mid-wheel); each try resumes from pip's
# cache, and the last failure names what could not be installed.
pip_install() {
    local try
    for try in 1 2 3; do
        if "$py" -m pip install -q --retries 10 --timeout 120 "$@"; then
            return 0
        fi
        echo "==> pip install $* failed (try $try of 3)" >&2
        sleep $((try * 10))
    done
    echo "ERROR: pip could not install $* after 3 tries (network, package index or disk; free space follows)" >&2
    df -h "$root" "${TMPDIR:-/tmp}" >&2 || true
    return 1
}

if [[ "${KVTIER_SKIP_VLLM:-0}" != 1 ]] && ! "$py" -c "import vllm" 2>/dev/null; then
    echo "==> installing vllm==$VLLM_VERSION into $py (first run only: about 10 GB)"
    for dir in "$(dirname "$py")" "${TMPDIR:-/tmp}"; do
        have=$(free_kib "$dir")
        if [[ -n "$have" ]] && ((have < 12 * 1024 * 1024)); then
            echo "WARNING: only $((have / 1024)) MiB free under $dir; vLLM's install needs about 10 GB there (and pip unpacks wheels under TMPDIR)" >&2
        fi
    done
    pip_install "vllm==$VLLM_VERSION"
fi
echo "==> building and installing kvtier (pip install ./crates/kvtier-py)"
pip_install "$here[test]"

if [[ "${CI:-}" == true ]]; then
    export KVTIER_REQUIRE_VLLM=1
fi
echo "==> pytest"
cd "$here"
"$py" -m pytest -q -p no:cacheprovider tests
