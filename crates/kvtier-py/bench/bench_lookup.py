#!/usr/bin/env python3
"""Per-chunk lookup cost from Python, kvtier against vLLM's own Python paths, in one run.

    python crates/kvtier-py/bench/bench_lookup.py [--chunks 4096] [--rounds 7]

Rows (median of rounds, microseconds per chunk; hits: every key present, misses: none):
  floor      a Python dict membership test plus a method call: what any Python-side lookup costs
  vllm-cpu   vLLM's CPUOffloadingManager.lookup (its primary tier)
  vllm-ex    vLLM's ExampleSecondaryTierManager.lookup (a dict behind vLLM's tier interface)
  kvtier     KvtierFsTier.lookup through vLLM's tier interface (Rust index, one call per key)
  kvtier-raw the native Tier.lookup alone
  kvtier-many Tier.lookup_many (one call for all keys), per key
  kvtier-conn KvtierConnector.get_num_new_matched_tokens for a request whose every chunk is
             in the host pool (hits) or none is (misses: the lookup stops at the first), per
             chunk of the request: vLLM's block hashes mapped to kvtier's keys, the
             scheduler's prefix lookup, and the answer (one chunk = one 16-token engine block)
The last line says whether every kvtier row meets the goal of issue 15: under 2 us per chunk.
Needs vLLM installed (the venv `cargo xtask ci` makes: target/kvtier-py-venv).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
import uuid


def keys_for(n: int, tag: str) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]


def per_key(fn, keys, rounds):
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn(keys)
        times.append((time.perf_counter() - t) / len(keys) * 1e6)
    return statistics.median(times)


GOAL_US = 2.0


def connector_lookups(n: int):
    """Two functions that each time one `get_num_new_matched_tokens` of a fresh request of `n`
    chunks (all in the host pool, or none) and return microseconds per chunk, and a close."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from connector_driver import BLOCK, Engine, prompt

    from vllm import SamplingParams
    from vllm.v1.request import Request

    e = Engine({"cpu_bytes_to_use": (n + 64) * 4096, "blocks_per_chunk": 1,
                "offload_prompt_only": False}, num_blocks=n + 64)
    shared = prompt("bench-conn", n * BLOCK)
    e.add("fill", shared + [7], max_tokens=1)
    e.run()
    count = [0]

    def timed(tokens):
        def once() -> float:
            count[0] += 1
            r = Request(f"q{count[0]}", tokens, SamplingParams(max_tokens=1), None,
                        block_hasher=e.hasher)
            e.sched.on_new_request(r)
            t = time.perf_counter()
            e.sched.get_num_new_matched_tokens(r, 0)
            return (time.perf_counter() - t) / n * 1e6
        return once

    hit_tokens = shared + [7]
    miss_tokens = prompt("bench-miss", n * BLOCK) + [7]
    return timed(hit_tokens), timed(miss_tokens), e.close


def median_per_chunk(once, rounds):
    return statistics.median(once() for _ in range(rounds))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    import numpy as np  # noqa: F401
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

    import sys, os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import FakeSpec

    n = args.chunks
    hits, misses = keys_for(n, "hit"), keys_for(n, "miss")
    ctx = ReqContext(req_id="bench")
    row_bytes = 4096

    region = SharedOffloadRegion(
        engine_id=f"kvtier-bench-{uuid.uuid4().hex[:8]}", num_chunks=n, rank=None,
        kv_bytes_per_chunk=row_bytes, cpu_page_size=row_bytes,
    )
    primary = CPUPrimaryTierOffloadingManager(num_chunks=n, mmap_region=region)
    view = primary.get_kv_memoryview()
    root = tempfile.mkdtemp(prefix="kvtier-bench-")
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvtierFsTier", "module_path": "kvtier.vllm.tiers", "root_dir": root,
         "capacity_bytes": "1GiB"}, view, FakeSpec())
    # Fill: vLLM's CPU manager and kvtier hold every `hits` key.
    out = primary.prepare_store(hits, ctx)
    primary.complete_store(out.keys_to_store, ctx)
    import numpy

    tier.submit_store(type("J", (), {
        "job_id": 1, "keys": hits, "chunk_ids": numpy.arange(n), "req_context": ctx})())
    while not list(tier.get_finished_jobs()):
        time.sleep(0.01)
    example = ExampleSecondaryTierManager(FakeSpec(), view, "example")
    for k in hits:
        example.chunks[k] = True
    floor = set(hits)
    raw = tier._core.tier

    conn_hits, conn_misses, conn_close = connector_lookups(n)

    rows = []
    for name, fn in [
        ("floor", lambda ks: [floor.__contains__(k) for k in ks]),
        ("vllm-cpu", lambda ks: [primary.lookup(k, ctx) for k in ks]),
        ("vllm-ex", lambda ks: [example.lookup(k, ctx) for k in ks]),
        ("kvtier", lambda ks: [tier.lookup(k, ctx) for k in ks]),
        ("kvtier-raw", lambda ks: [raw.lookup(k) for k in ks]),
        ("kvtier-many", lambda ks: raw.lookup_many(ks)),
    ]:
        rows.append((name, per_key(fn, hits, args.rounds), per_key(fn, misses, args.rounds)))
    rows.append(("kvtier-conn", median_per_chunk(conn_hits, args.rounds),
                 median_per_chunk(conn_misses, args.rounds)))
    conn_close()
    base = rows[0]
    print(f"{'path':<12} {'hit_us':>8} {'miss_us':>8} {'hit/floor':>10} {'miss/floor':>11}")
    for name, h, m in rows:
        print(f"{name:<12} {h:8.3f} {m:8.3f} {h / base[1]:10.2f} {m / base[2]:11.2f}")
    worst = max(max(h, m) for name, h, m in rows if name.startswith("kvtier"))
    print(f"goal: under {GOAL_US} us per chunk lookup from Python: "
          f"{'met' if worst < GOAL_US else 'NOT met'} (slowest kvtier row {worst:.3f} us)")
    assert all(tier.lookup(k, ctx).name == "HIT" for k in hits[:16])
    tier.shutdown()
    view.release()
    primary.shutdown()


if __name__ == "__main__":
    main()
