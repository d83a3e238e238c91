"""kvtier's tiers inside vLLM's real TieringOffloadingManager: stores cascade from vLLM's CPU
primary tier into kvtier, loads promote back, and every loaded byte is compared with what
recompute gives."""

from __future__ import annotations

import json
import os

import pytest

from conftest import (
    DOCUMENTED,
    VLLM_ERROR,
    chunk_bytes,
    need_vllm,
    prefix_keys,
    registry_metric_types,
)

pytestmark = pytest.mark.usefixtures("vllm_ok")


def fs_entry(root, **kw):
    return {"type": "KvtierFsTier", "module_path": "kvtier.vllm.tiers", "root_dir": str(root),
            "capacity_bytes": "64MiB", **kw}


def test_vllm_is_importable():
    """The sentinel: says plainly whether the vLLM tests ran here."""
    if VLLM_ERROR is not None:
        print(f"vLLM tests NOT RUN: {VLLM_ERROR}")
    need_vllm()
    import vllm

    assert vllm.__version__


def test_classes_implement_vllms_abstract_base():
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    from kvtier.vllm.tiers import KvtierFsTier, KvtierP2pTier

    for cls in (KvtierFsTier, KvtierP2pTier):
        assert issubclass(cls, SecondaryTierManager)
        assert not cls.__abstractmethods__, f"{cls.__name__} leaves {cls.__abstractmethods__}"


def test_factory_loads_the_tier_from_module_path():
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from kvtier.vllm.tiers import KvtierFsTier, KvtierP2pTier

    assert SecondaryTierFactory.get_tier_class(fs_entry("/x")) is KvtierFsTier
    assert (
        SecondaryTierFactory.get_tier_class({"type": "KvtierP2pTier", "module_path": "kvtier.vllm.tiers"})
        is KvtierP2pTier
    )


def test_store_restart_load_gives_the_same_bytes(engines, tmp_path):
    keys = prefix_keys("restart", 8)
    a = engines([fs_entry(tmp_path)])
    c = a.ctx("r1")
    a.store(c, keys)
    a.settle()
    stats = a.tiers[0].native_stats()
    assert stats["chunks_stored"] == 8, stats
    a.close()

    b = engines([fs_entry(tmp_path)])
    assert b.tiers[0].native_stats()["chunks_found_at_start"] == 8
    c2 = b.ctx("r2")
    assert b.load_prefix(c2, keys + prefix_keys("other", 2)) == 8
    b.finish(c2)
    stats = b.tiers[0].native_stats()
    assert stats["chunks_loaded"] == 8
    # The I/O edge's checks (record, buffer and slot bounds) held for every operation.
    assert stats["invariant_failures"] == 0, stats


def test_seed_scenario_final_store_prepared_before_request_finished(engines, tmp_path):
    """vLLM prepares a request's last store, then finishes the request, and only then does the
    worker report the store: the tier must still get (and keep) those chunks."""
    keys = prefix_keys("seed", 6)
    a = engines([fs_entry(tmp_path)])
    c = a.ctx("seed")
    a.store(c, keys[:4], finish=False)
    with a.manager.lock:
        out = a.manager.prepare_store(keys[4:], c)
        a.manager.on_request_finished(c)
    for key, cid in zip(out.keys_to_store, out.store_spec.block_ids):
        a.write_row(int(cid), chunk_bytes(key))
    with a.manager.lock:
        a.manager.complete_store(out.keys_to_store, c)
    a.settle()
    assert a.tiers[0].native_stats()["chunks_stored"] == 6
    a.close()

    b = engines([fs_entry(tmp_path)])
    c2 = b.ctx("after")
    assert b.load_prefix(c2, keys) == 6
    b.finish(c2)


@pytest.mark.parametrize("requests", [16, 100])
def test_same_prefix_requests_through_a_small_primary(engines, tmp_path, requests):
    """Many requests share an 8-chunk prefix. The CPU tier holds 16 chunks, and between two
    requests a 16-chunk flood of other work evicts everything from it, so every later request
    gets the prefix back from kvtier's disk tier, byte for byte."""
    shared = prefix_keys("system-prompt", 8)
    e = engines([fs_entry(tmp_path, capacity_bytes="256MiB")], num_chunks=16)
    first = e.ctx("req-0")
    e.store(first, shared)
    e.settle()
    for i in range(1, requests):
        for half in range(2):
            flood = e.ctx(f"flood-{i}-{half}")
            e.store(flood, prefix_keys(f"flood-{i}-{half}", 8))
            e.settle()
        c = e.ctx(f"req-{i}")
        hits = e.load_prefix(c, shared + prefix_keys(f"user-{i}", 2))
        assert hits == 8, f"request {i}: {hits} of the 8 shared chunks"
        e.finish(c)
        e.settle()
    assert e.tiers[0].native_stats()["chunks_loaded"] == 8 * (requests - 1)


def test_reset_cache_with_jobs_in_flight_then_go_on(engines, tmp_path):
    keys = prefix_keys("reset", 8)
    e = engines([fs_entry(tmp_path)])
    c = e.ctx("before-reset")
    e.store(c, keys)
    # Cascades may be in flight now; vLLM drains the tiers in reset_cache.
    with e.manager.lock:
        e.manager.reset_cache()
        e.manager.on_reset_flushed()
    e.settle()
    c2 = e.ctx("after-reset")
    # The CPU tier forgot everything; the disk tier kept what it finished storing.
    hits = e.load_prefix(c2, keys)
    e.finish(c2)
    stored = e.tiers[0].native_stats()["chunks_stored"]
    assert hits == stored or hits == 8, (hits, stored)
    more = prefix_keys("after", 4)
    c3 = e.ctx("new")
    e.store(c3, more)
    e.settle()
    c4 = e.ctx("check")
    assert e.load_prefix(c4, more) == 4


def test_peer_pair_serves_each_other(engines):
    keys = prefix_keys("peer", 6)
    a = engines([{"type": "KvtierP2pTier", "module_path": "kvtier.vllm.tiers"}])
    addr = a.tiers[0].address
    b = engines([{"type": "KvtierP2pTier", "module_path": "kvtier.vllm.tiers", "peers": [addr]}])
    c = a.ctx("publisher")
    a.store(c, keys)
    a.settle()
    assert a.tiers[0].native_stats()["published_chunks"] == 6
    c2 = b.ctx("fetcher")
    assert b.load_prefix(c2, keys) == 6
    b.finish(c2)
    stats = b.tiers[0].native_stats()
    assert stats["chunks_fetched"] == 6
    assert stats["invariant_failures"] == stats["mac_failures"] == stats["frames_rejected"] == 0


def test_stats_reach_vllms_stats_payload(engines, tmp_path):
    keys = prefix_keys("metrics", 4)
    e = engines([fs_entry(tmp_path, enable_kv_events=True)])
    c = e.ctx("m")
    e.store(c, keys)
    e.settle()
    with e.manager.lock:
        stats = e.manager.get_stats()
        events = list(e.manager.take_events())
    assert stats is not None
    reduced = stats.reduce()
    stored = [v for k, v in reduced.items() if k.startswith("kvtier:store_bytes")]
    assert stored == [4 * e.tiers[0].block_size_bytes], reduced
    # vLLM's own per-tier write metric, filled from our JobResult.transfer_bytes.
    assert any(k.startswith("vllm:kv_offload_tiering_write_bytes") for k in reduced), reduced
    stored_keys = [k for ev in events if not ev.removed and ev.ownership for k in ev.keys]
    fs_events = [ev for ev in events if not ev.removed and ev.medium.name == "STORAGE"]
    assert sorted(k for ev in fs_events for k in ev.keys) == sorted(keys), (events, stored_keys)



def test_tier_metrics_reach_prometheus_through_vllms_tiering_spec(engines, tmp_path):
    """vLLM's own OffloadPromMetrics, built for a TieringOffloadingSpec naming kvtier's fs tier,
    registers kvtier's per-tier counters (from the tier's build_metric_definitions) beside
    vLLM's, in a real prometheus_client registry, and records a real store and load."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics

    reg, types = registry_metric_types()
    entry = fs_entry(tmp_path)
    keys = prefix_keys("prom", 4)
    e = engines([entry])
    c = e.ctx("p")
    e.store(c, keys)
    e.settle()
    c2 = e.ctx("p2")
    assert e.load_prefix(c2, keys) == 4
    e.finish(c2)
    with e.manager.lock:
        stats = e.manager.get_stats()
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [entry]}
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    prom = OffloadPromMetrics(cfg, types, ["engine"], {0: ["0"]})
    prom.observe(stats.to_dict(), engine_idx=0)
    row = e.tiers[0].block_size_bytes
    got = reg.get_sample_value("kvtier:store_bytes_total", {"engine": "0", "tier": "kvtier-fs"})
    assert got == 4 * row, got
    # vLLM's own per-tier write counter, filled from our JobResult.transfer_bytes.
    names = {m.name for m in reg.collect()}
    assert "vllm:kv_offload_tiering_write_bytes" in names, sorted(names)


def test_documented_config_works_with_kvtier(engines, tmp_path):
    cfg = json.loads(DOCUMENTED)
    entry = cfg["kv_connector_extra_config"]["secondary_tiers"][0]
    entry.update(type="KvtierFsTier", module_path="kvtier.vllm.tiers", root_dir=str(tmp_path))
    e = engines([entry])
    keys = prefix_keys("documented", 3)
    c = e.ctx("d")
    e.store(c, keys)
    e.settle()
    assert e.tiers[0].native_stats()["chunks_stored"] == 3


def test_environment_overrides_the_entry(engines, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_ROOT_DIR", str(tmp_path / "from-env"))
    e = engines([fs_entry(tmp_path / "from-config")])
    assert str(tmp_path / "from-env") in e.tiers[0]._core.tier.namespace_dir
    assert not (tmp_path / "from-config").exists()


def test_fs_evictions_are_published_as_removed_events(engines, tmp_path):
    """A small disk tier evicts; every chunk it evicted comes out of vLLM's event stream as a
    Removed event of the STORAGE medium, and no chunk it still holds does."""
    e = engines([fs_entry(tmp_path, capacity_bytes="512KiB", enable_kv_events=True)])
    stored = []
    for r in range(6):
        keys = prefix_keys(f"evict-{r}", 10)
        c = e.ctx(f"e{r}")
        e.store(c, keys)
        e.settle()
        stored += keys
    with e.manager.lock:
        events = list(e.manager.take_events())
    removed = [k for ev in events if ev.removed and ev.medium.name == "STORAGE" for k in ev.keys]
    stats = e.tiers[0].native_stats()
    assert stats["evictions"] > 0, stats
    assert len(removed) == stats["evictions"] == len(set(removed))
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(req_id="probe")
    gone = {k for k in stored if e.tiers[0].lookup(k, ctx) is LookupResult.MISS}
    assert set(removed) == gone
