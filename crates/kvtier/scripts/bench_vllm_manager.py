#!/usr/bin/env python3
"""Replays a Mooncake-format trace at vLLM's own CPUOffloadingManager, with the semantics of
`kvtier bench manager` (crates/kvtier/src/bench_manager.rs), and prints block operations per
second as one JSON object. `kvtier bench manager --compare-vllm THIS_SCRIPT` runs it in the same
run as the Rust manager, in its --serve mode (one pass per request, so that the Rust side runs
its passes between vLLM's), and prints the ratios.

Per request with keys k[0..n): lookup k[0], k[1], ... until the first key that is not a hit (h
hits); if h > 0, prepare_load(k[:h]) then complete_load(k[:h]); touch(k); if h < n,
prepare_store(k[h:]) and, if it returned keys, complete_store(those keys). block_ops counts the
keys handed to each call (lookups including the first miss), exactly as the Rust side does.
Every pass runs on a fresh manager made before its timer starts; events are off, the store
threshold is 1 (no reuse tracker), as in the Rust benchmark. Each request gets its own
ReqContext; on_new_request/on_request_finished are not called (the Rust side has no counterpart
to them in this benchmark) unless --request-lifecycle is given (their time is then included, and
they count no block operation).

vLLM is imported, never copied: the manager and policy classes, ReqContext, LookupResult and
make_offload_key come from an installed vllm (0.33 or a compatible version). vLLM's package
imports torch at its top and its manager module imports the connector's metrics (which pull in
vllm.config, transformers and more), none of which the manager's lookup/load/touch/store paths
use. When torch is not importable, the script loads vllm without running package __init__ files
(other than the two small ones the manager needs), with two stand-ins: a `torch` module that
only names `torch.Tensor` (used in one dataclass annotation of vllm.v1.kv_offload.base), and the
metrics module reduced to the `OffloadingConnectorStats` name (used only by get_stats, which is
never called). The JSON says which import was used ("import": "full" or "light").

Setup that needs neither torch nor vLLM's other dependencies:
    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install --no-deps vllm==0.33.0
    /tmp/vllm-venv/bin/pip install numpy msgspec typing_extensions
"""

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types

# vllm packages whose __init__ must run in the light import (the rest only hold submodules).
_LIGHT_RUN_INIT = {"vllm.v1.kv_hints", "vllm.logging_utils"}
_METRICS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics"


class _BarePackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports vllm's packages without running their __init__ (they pull in torch)."""

    def __init__(self, site):
        self.site = site

    def find_spec(self, name, path, target=None):
        if not (name == "vllm" or name.startswith("vllm.")) or name in _LIGHT_RUN_INIT:
            return None
        directory = os.path.join(self.site, *name.split("."))
        if not os.path.isdir(directory):
            return None
        spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
        spec.submodule_search_locations = [directory]
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


def _light_import():
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("bench_vllm_manager: vllm is not installed for " + sys.executable)
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    sys.meta_path.insert(0, _BarePackages(site))

    class Tensor:
        """Stand-in for torch.Tensor, which vllm's base module names in an annotation."""

    torch = types.ModuleType("torch")
    torch.Tensor = Tensor
    sys.modules["torch"] = torch

    class OffloadingConnectorStats:
        """Stand-in: only CPUOffloadingManager.get_stats uses it, and it is never called."""

    metrics = types.ModuleType(_METRICS_MODULE)
    metrics.OffloadingConnectorStats = OffloadingConnectorStats
    sys.modules[_METRICS_MODULE] = metrics


def import_vllm(mode):
    """Returns (namespace of the vLLM names used, import mode, vllm version)."""
    if mode == "auto":
        mode = "full" if importlib.util.find_spec("torch") is not None else "light"
    if mode == "light":
        _light_import()
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    version = "unknown"
    try:
        from vllm.version import __version__ as version
    except Exception:  # noqa: BLE001 - the version is informative only
        pass
    names = types.SimpleNamespace(
        LookupResult=LookupResult,
        ReqContext=ReqContext,
        make_offload_key=make_offload_key,
        CPUOffloadingManager=CPUOffloadingManager,
    )
    return names, mode, version


def read_trace(path, limit):
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if len(requests) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                ids = json.loads(line)["hash_ids"]
            except (ValueError, KeyError) as e:
                sys.exit(f"bench_vllm_manager: {path}:{number}: bad trace line ({e})")
            requests.append(ids)
    return requests


def replay(v, manager, requests, lifecycle):
    """One pass; returns (hit_blocks, block_ops, store_failures)."""
    hit = v.LookupResult.HIT
    ReqContext = v.ReqContext
    lookup = manager.lookup
    hit_blocks = block_ops = store_failures = 0
    for i, k in enumerate(requests):
        ctx = ReqContext(req_id=str(i))
        if lifecycle:
            manager.on_new_request(ctx)
        n = len(k)
        h = 0
        while h < n and lookup(k[h], ctx) == hit:
            h += 1
        block_ops += h + (1 if h < n else 0)
        hit_blocks += h
        if h > 0:
            hits = k[:h]
            manager.prepare_load(hits, ctx)
            manager.complete_load(hits, ctx)
            block_ops += 2 * h
        manager.touch(k, ctx)
        block_ops += n
        if h < n:
            block_ops += n - h
            out = manager.prepare_store(k[h:], ctx)
            if out is None:
                store_failures += 1
            elif out.keys_to_store:
                manager.complete_store(out.keys_to_store, ctx, True)
                block_ops += len(out.keys_to_store)
        if lifecycle:
            manager.on_request_finished(ctx)
    return hit_blocks, block_ops, store_failures


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--capacity-blocks", type=int, required=True)
    p.add_argument("--policy", choices=["lru", "arc"], default="lru")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--limit", type=int, default=sys.maxsize)
    p.add_argument("--import", dest="import_mode", choices=["auto", "full", "light"],
                   default="auto")
    p.add_argument("--request-lifecycle", action="store_true",
                   help="also call on_new_request/on_request_finished per request")
    p.add_argument("--serve", action="store_true",
                   help="print a greeting line, then run one pass per 'pass' line read from "
                        "stdin and print one JSON line for it (elapsed_s, cpu_s and the "
                        "counts), until stdin closes; kvtier bench manager --compare-vllm "
                        "uses this to interleave its passes with vLLM's")
    args = p.parse_args()
    if args.capacity_blocks < 1 or args.passes < 1:
        sys.exit("bench_vllm_manager: --capacity-blocks and --passes must be at least 1")

    v, mode, version = import_vllm(args.import_mode)
    ids = read_trace(args.trace, args.limit)
    # Keys are built once, before any timer: an 8-byte block hash per hash id, KV group 0.
    requests = [[v.make_offload_key(h.to_bytes(8, "big"), 0) for h in r] for r in ids]

    def one_pass():
        """A pass on a fresh manager made before its timer starts: (wall s, CPU s, counts)."""
        manager = v.CPUOffloadingManager(
            num_chunks=args.capacity_blocks,
            cache_policy=args.policy,
            enable_events=False,
            store_threshold=1,
        )
        cpu_start = time.thread_time()
        start = time.perf_counter()
        counts = replay(v, manager, requests, args.request_lifecycle)
        return time.perf_counter() - start, time.thread_time() - cpu_start, counts

    if args.serve:
        print(json.dumps({"vllm_version": version, "import": mode,
                          "requests": len(requests)}), flush=True)
        for line in sys.stdin:
            if line.strip() != "pass":
                sys.exit(f"bench_vllm_manager: --serve reads 'pass' lines, not {line!r}")
            elapsed, cpu, (hit_blocks, block_ops, store_failures) = one_pass()
            print(json.dumps({"elapsed_s": elapsed, "cpu_s": cpu, "hit_blocks": hit_blocks,
                              "block_ops": block_ops, "store_failures": store_failures}),
                  flush=True)
        return

    times = []
    cpu_times = []
    first = None
    for _ in range(args.passes):
        elapsed, cpu, counts = one_pass()
        times.append(elapsed)
        cpu_times.append(cpu)
        if first is None:
            first = counts
        elif counts != first:
            sys.exit(f"bench_vllm_manager: pass counted {counts}, the first {first}")
    hit_blocks, block_ops, store_failures = first
    # The same pick as the Rust side: the upper median for an even count.
    median = sorted(times)[len(times) // 2]
    cpu_median = sorted(cpu_times)[len(cpu_times) // 2]
    print(json.dumps({
        "implementation": "vllm CPUOffloadingManager",
        "vllm_version": version,
        "import": mode,
        "request_lifecycle": args.request_lifecycle,
        "policy": args.policy,
        "capacity_blocks": args.capacity_blocks,
        "requests": len(requests),
        "total_blocks": sum(len(r) for r in requests),
        "hit_blocks": hit_blocks,
        "block_ops": block_ops,
        "store_failures": store_failures,
        "elapsed_s": median,
        "block_ops_per_s": block_ops / median if median > 0 else 0.0,
        "best_block_ops_per_s": block_ops / min(times) if min(times) > 0 else 0.0,
        "passes": args.passes,
        "pass_elapsed_s": times,
        # By the thread's CPU time (time other processes held the core not counted).
        "cpu_block_ops_per_s": block_ops / cpu_median if cpu_median > 0 else 0.0,
        "best_cpu_block_ops_per_s": block_ops / min(cpu_times) if min(cpu_times) > 0 else 0.0,
        "pass_cpu_s": cpu_times,
    }))


if __name__ == "__main__":
    main()
