"""Fixtures: vLLM's real tiering manager over a real host region, with kvtier's tiers made by
vLLM's own SecondaryTierFactory from a config entry.

vLLM must import for most tests. Where it cannot, those tests fail with the import error when
KVTIER_REQUIRE_VLLM=1 (CI sets it) and are otherwise skipped with the reason, and the sentinel
test `test_vllm_is_importable` says "vLLM tests NOT RUN" and why.
"""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest

try:
    import vllm  # noqa: F401
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: F401

    VLLM_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure is reported, with its type
    VLLM_ERROR = f"{type(e).__name__}: {e}"


def need_vllm():
    if VLLM_ERROR is None:
        return
    why = f"vLLM does not import here ({VLLM_ERROR})"
    if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
        pytest.fail(why)
    pytest.skip(why)


CHUNK_BYTES = 16 * 1024  # one row of the primary buffer: 4 KiB aligned, as vLLM pages are
NUM_CHUNKS = 64


def chunk_bytes(key: bytes, n: int = CHUNK_BYTES) -> bytes:
    """What 'recompute' produces for a chunk: a deterministic function of its key."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.blake2b(key + counter.to_bytes(4, "little"), digest_size=64).digest()
        counter += 1
    return bytes(out[:n])


def prefix_keys(tag: str, n: int, group: int = 0) -> list[bytes]:
    """Keys of a prompt's n chunks: chained hashes, so equal prefixes share keys."""
    from vllm.v1.kv_offload.base import make_offload_key

    keys, h = [], b""
    for i in range(n):
        h = hashlib.sha256(h + f"{tag}:{i}".encode()).digest()
        keys.append(make_offload_key(h, group))
    return keys


class FakeSpec:
    """The parts of an OffloadingSpec a tier reads (vLLM's OffloadingConfig fields)."""

    class config:  # noqa: N801 - mirrors the attribute name vLLM uses
        class model:  # noqa: N801
            name = "test/kvtier-tiny"
            dtype = "bfloat16"

        class cache:  # noqa: N801
            tokens_per_hash = 16
            blocks_per_chunk = 1

        class parallel:  # noqa: N801
            tp_size = pp_size = pcp_size = dcp_size = 1
            is_parallelism_agnostic = False

        kv_cache_layout = "NHD"


class Engine:
    """vLLM's TieringOffloadingManager over a CPU primary tier and the given secondary tiers,
    driven the way vLLM's scheduler and workers drive it (the GPU copies are plain writes into
    the primary region)."""

    def __init__(self, tier_configs: list[dict], num_chunks: int = NUM_CHUNKS):
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        from vllm.v1.kv_offload.tiering.manager import (
            CPUPrimaryTierOffloadingManager,
            TieringOffloadingManager,
        )

        self.region = SharedOffloadRegion(
            engine_id=f"kvtier-test-{uuid.uuid4().hex[:8]}",
            num_chunks=num_chunks,
            rank=None,
            kv_bytes_per_chunk=CHUNK_BYTES,
            cpu_page_size=CHUNK_BYTES,
        )
        self.primary = CPUPrimaryTierOffloadingManager(
            num_chunks=num_chunks, mmap_region=self.region, enable_events=True
        )
        self.view = self.primary.get_kv_memoryview()
        import numpy as np

        self._np = np
        self.rows = np.asarray(self.view).view(np.uint8)  # the same memory, row-indexable
        self.tiers = [
            SecondaryTierFactory.create_secondary_tier(dict(c), self.view, FakeSpec())
            for c in tier_configs
        ]
        self.manager = TieringOffloadingManager(
            primary_tier=self.primary, secondary_tiers=self.tiers, tier_poll_interval_s=0
        )
        self.steps = 0

    def ctx(self, req_id: str):
        from vllm.v1.kv_offload.base import ReqContext

        c = ReqContext(req_id=req_id)
        with self.manager.lock:
            self.manager.on_new_request(c)
        return c

    def step(self, new=(), preempted=()):
        from vllm.v1.kv_offload.base import ScheduleEndContext

        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(list(new), list(preempted)))
        self.steps += 1

    def settle(self, limit: int = 2000):
        """Steps until no tier has work in flight (each step polls the tiers)."""
        import time

        for _ in range(limit):
            with self.manager.lock:
                busy = self.manager.has_pending_work()
            if not busy:
                return
            self.step()
            time.sleep(0.002)
        raise AssertionError("tiers still busy after %d steps" % limit)

    def store(self, c, keys: list[bytes], finish: bool = True, before_finish=None):
        """A request computed `keys`: GPU->CPU copies, then completion, as vLLM's worker
        reports it; optionally finishes the request."""
        with self.manager.lock:
            out = self.manager.prepare_store(keys, c)
        assert out is not None, "primary tier refused the store"
        ids = list(out.store_spec.block_ids)
        assert len(ids) == len(out.keys_to_store)
        for key, cid in zip(out.keys_to_store, ids):
            self.write_row(int(cid), chunk_bytes(key))  # the 'GPU copy'
        if before_finish is not None:
            before_finish()
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, c)
            if finish:
                self.manager.on_request_finished(c)
        return out

    def load_prefix(self, c, keys: list[bytes], steps: int = 3000) -> int:
        """vLLM's lookup loop: retried until every key answers HIT or one MISSes; then loads the
        hit prefix and checks every byte. Returns the number of chunks loaded."""
        from vllm.v1.kv_offload.base import LookupResult

        import time

        hits = 0
        for _ in range(steps):
            hits = 0
            waiting = False
            with self.manager.lock:
                for k in keys:
                    r = self.manager.lookup(k, c)
                    if r is LookupResult.HIT:
                        hits += 1
                        continue
                    waiting = r in (LookupResult.HIT_PENDING, LookupResult.RETRY)
                    break
            if not waiting:
                break
            self.step(new=[c.req_id])
            time.sleep(0.002)
        else:
            raise AssertionError("lookups never settled")
        if hits:
            with self.manager.lock:
                spec = self.manager.prepare_load(keys[:hits], c)
            for key, cid in zip(keys[:hits], spec.block_ids):
                got = self.rows[int(cid)].tobytes()
                assert got == chunk_bytes(key), f"chunk {key.hex()[:16]} differs from recompute"
            with self.manager.lock:
                self.manager.complete_load(keys[:hits], c)
        return hits

    def write_row(self, row: int, data: bytes) -> None:
        self.rows[row, :] = self._np.frombuffer(data, dtype=self._np.uint8)

    def finish(self, c):
        with self.manager.lock:
            self.manager.on_request_finished(c)

    def close(self):
        self.rows = None  # the test's own numpy view exports the buffer too
        self.manager.shutdown()


@pytest.fixture
def vllm_ok():
    need_vllm()


def closing_factory(cls):
    """A fixture's body: yields a factory of `cls` objects and closes every one it made."""
    made = []

    def make(*args, **kw):
        e = cls(*args, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        try:
            e.close()
        except Exception:  # noqa: BLE001 - a test that already closed it
            pass


def registry_metric_types():
    """A fresh prometheus_client registry and vLLM's metric classes bound to it (vLLM binds
    them to its own), as vLLM's Prometheus builders take them."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()

    def bound(cls):
        class Bound(cls):
            def __init__(self, *a, **kw):
                kw.pop("multiprocess_mode", None)
                super().__init__(*a, registry=reg, **kw)

        return Bound

    return reg, {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


@pytest.fixture
def engines():
    yield from closing_factory(Engine)


# vLLM's Multi-Tier Setup example (docs: features/kv_offloading_usage), verbatim. The tier tests
# point its fs entry at kvtier's tier (only "type", "module_path" and "root_dir" change); the
# connector test names kvtier's connector (only "kv_connector", "kv_connector_module_path" and
# "root_dir" change).
DOCUMENTED = """{
  "kv_connector": "OffloadingConnector",
  "kv_role": "kv_both",
  "kv_connector_extra_config": {
    "spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 10737418240,
    "block_size": 16,
    "eviction_policy": "lru",
    "secondary_tiers": [
      {
        "type": "fs",
        "root_dir": "/mnt/kv_cache",
        "n_read_threads": 32,
        "n_write_threads": 32
      }
    ]
  }
}"""
