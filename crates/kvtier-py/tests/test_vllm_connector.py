"""`kvtier.vllm.connector.KvtierConnector` driven through vLLM's call sequence (see
`connector_driver.py` for what is real and what is faked): stores, finishes, a restart over the
same disk directory, loads, every loaded byte compared with recompute; the seed scenario; 16 and
100 requests sharing a prefix; reset; a peer pair; metrics on a real prometheus_client registry.
"""

from __future__ import annotations

import socket

import pytest

from conftest import VLLM_ERROR, closing_factory, need_vllm, registry_metric_types

pytestmark = pytest.mark.usefixtures("vllm_ok")


def config(tmp_path=None, slots=256, **kw):
    cfg = {"cpu_bytes_to_use": slots * 4 * 16 * 2 * 2 * 2 * 16 // 16, "blocks_per_chunk": 1,
           "offload_prompt_only": False}
    # One chunk = one engine block: 2 layers x K/V x 16 tokens x 2 heads x 16 x 2 bytes = 4 KiB.
    cfg["cpu_bytes_to_use"] = slots * 4096
    if tmp_path is not None:
        cfg["secondary_tiers"] = [{"type": "fs", "root_dir": str(tmp_path),
                                   "capacity_bytes": 64 << 20, "engine": "sync"}]
    cfg.update(kw)
    return cfg


@pytest.fixture
def engines():
    from connector_driver import Engine

    yield from closing_factory(Engine)


def test_vllm_connector_tests_ran():
    """The sentinel: says plainly whether these tests ran here."""
    if VLLM_ERROR is not None:
        print(f"vLLM tests NOT RUN: {VLLM_ERROR}")
    need_vllm()


def test_kv_caches_on_other_devices_are_refused_naming_the_device():
    """KV caches on a device that is neither the CPU nor a CUDA GPU (a 'meta' tensor here) are
    refused at register_kv_caches, naming the layer and the device. (CUDA KV caches are
    accepted: test_cuda_worker.py.)"""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector_driver import BLOCK, DTYPE, HEAD, HEADS, kv_cache_config, vllm_config
    from kvtier.vllm.connector import KvtierConnector

    kcc = kv_cache_config(64)
    w = KvtierConnector(vllm_config(config()), KVConnectorRole.WORKER, kcc)
    try:
        caches = {n: torch.empty((2, 64, BLOCK, HEADS, HEAD), dtype=DTYPE, device="meta")
                  for n in kcc.kv_cache_groups[0].layer_names}
        with pytest.raises(ValueError, match=r"KV cache is on meta; .* \(cpu\) or on a CUDA GPU"):
            w.register_kv_caches(caches)
    finally:
        w.shutdown()


def test_connector_is_a_complete_vllm_connector_loaded_by_module_path():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from connector_driver import vllm_config
    from kvtier.vllm.connector import KvtierConnector

    assert issubclass(KvtierConnector, KVConnectorBase_V1)
    assert not KvtierConnector.__abstractmethods__, KvtierConnector.__abstractmethods__
    cfg = vllm_config(config())
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is KvtierConnector


def test_store_finish_restart_load_gives_the_same_bytes(engines, tmp_path):
    from connector_driver import prompt

    a = engines(config(tmp_path))
    a.add("r1", prompt("doc", 100), max_tokens=3)
    a.settle()
    m = a.metrics()
    fs = dict(m["tiers"])["fs"]
    assert m["tiering"]["host_chunks_stored"] >= 6, m["tiering"]
    assert fs["chunks_stored"] == m["tiering"]["host_chunks_stored"], fs
    a.close()

    b = engines(config(tmp_path))
    rec = b.add("r2", prompt("doc", 100) + prompt("other", 20), max_tokens=2)
    b.run()
    # Six full blocks of the shared 100 tokens (the 101st token differs): 96 tokens, loaded from
    # disk through the host pool, and compared with recompute in Engine._forward.
    assert rec.loaded_tokens == 96, rec.loaded_tokens
    assert not rec.load_failed
    fs = dict(b.metrics()["tiers"])["fs"]
    assert fs["chunks_loaded"] == 6, fs


def test_seed_scenario_final_store_prepared_before_request_finished(engines):
    """vLLM finishes a request (request_finished) in the same step whose stores were just
    prepared and submitted, before the workers acknowledge them; the partial-block tail is
    stored after. The connector keeps the blocks (delay-free) until every store was
    acknowledged, releases them through finished_sending, and the final chunk is loadable."""
    from connector_driver import prompt

    e = engines(config())
    p = prompt("seed", 40)
    rec = e.add("seed", p, max_tokens=9)
    e.run()
    assert rec.delayed_free, "request_finished freed blocks that stores still read"
    assert "seed" in e.finished_sending_seen
    # 40 prompt tokens + 9 outputs: the KV of 48 tokens was written (the last sampled token's
    # never is), so 3 full blocks, the third completed by the last decode step.
    follow = e.add("follow", list(rec.req.all_token_ids)[:48] + prompt("x", 10), max_tokens=1)
    e.run()
    assert follow.loaded_tokens == 48, follow.loaded_tokens


@pytest.mark.parametrize("n", [16, 100])
def test_same_prefix_requests(engines, n):
    from connector_driver import prompt

    e = engines(config(slots=512), num_blocks=2048)
    shared = prompt("system", 64)
    e.add("first", shared + prompt("q0", 8), max_tokens=1)
    e.run()
    recs = [e.add(f"r{i}", prompt(f"q{i + 1}", 80, shared), max_tokens=2) for i in range(n)]
    e.run()
    loaded = [r.loaded_tokens for r in recs]
    assert loaded == [64] * n, loaded
    assert not any(r.load_failed for r in recs)
    assert e.metrics()["scheduler"]["invariant_failures"] == 0


def reset_once_its_load_is_built(e, rec, then=lambda: None) -> list:
    """Makes the next step that builds `rec`'s load reset the cache right after building the
    metadata, before the workers run it (vLLM's async scheduling builds a step while the workers
    run the previous one). Returns a list that gets `(reset_cache's answer, then())` once it
    happened."""
    real_build = e.sched.build_connector_meta
    fired = []

    def build_then_reset(so):
        meta = real_build(so)
        if rec.state == "loading":
            fired.append((e.sched.reset_cache(), then()))
            e.sched.build_connector_meta = real_build
        return meta

    e.sched.build_connector_meta = build_then_reset
    return fired


def test_reset_keeps_disk_and_in_flight_loads_are_safe(engines, tmp_path):
    from connector_driver import prompt

    e = engines(config(tmp_path))
    e.add("a", prompt("reset", 64), max_tokens=1)
    e.settle()
    assert e.metrics()["pool"]["slots_used"] >= 4
    assert e.sched.reset_cache() is True
    e.step()
    assert e.metrics()["pool"]["slots_used"] == 0
    # The host pool is empty: the prefix comes back from disk (promotion), bytes compared.
    b = e.add("b", prompt("reset", 64) + prompt("b", 8), max_tokens=1)
    e.run()
    assert b.loaded_tokens == 64 and not b.load_failed
    assert dict(e.metrics()["tiers"])["fs"]["chunks_loaded"] == 4

    # A reset between the step that built a load and the worker running it (vLLM's async
    # scheduling builds a step while the worker runs the previous one): the worker must not copy
    # from slots the reset freed, so the load fails and vLLM recomputes.
    c = e.add("c", prompt("reset", 64) + prompt("c", 8), max_tokens=1)
    fired = reset_once_its_load_is_built(e, c)
    e.run()
    assert fired, "the load was never built"
    assert c.state == "released"
    assert c.loaded_tokens == 64 and c.load_failed, c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_peer_pair(engines):
    """Two engines, each with a p2p tier naming the other: what one computed, the other loads."""
    from connector_driver import prompt

    pa, pb = _free_port(), _free_port()

    def p2p(listen, peer):
        return config(secondary_tiers=[{"type": "p2p", "listen": f"127.0.0.1:{listen}",
                                        "peers": [f"127.0.0.1:{peer}"]}])

    a = engines(p2p(pa, pb))
    b = engines(p2p(pb, pa))
    a.add("a1", prompt("peer", 80), max_tokens=1)
    a.settle()
    rec = b.add("b1", prompt("peer", 80) + prompt("b", 8), max_tokens=1)
    b.run()
    assert rec.loaded_tokens == 80, rec.loaded_tokens
    p2p_b = dict(b.metrics()["tiers"])["p2p"]
    assert p2p_b["chunks_loaded"] == 5, p2p_b


def test_layouts_beyond_one_node_are_refused():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector_driver import kv_cache_config, vllm_config
    from kvtier.vllm.connector import KvtierConnector

    cfg = vllm_config(config(), backend="ray", world_size=2)
    with pytest.raises(ValueError, match="distributed_executor_backend='ray'"):
        KvtierConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(64))
    cfg = vllm_config(config(), backend="mp", world_size=2)
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        KvtierConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(64))


def test_two_worker_processes_share_the_host_pool_file(engines):
    """vLLM's multi-process executor with two tensor-parallel ranks, each worker in its own
    process writing its own shard of every block: both map the host pool file the scheduler
    side maps, each fills its share of every slot, and each checks its loaded shard against
    recompute."""
    import os

    from connector_driver import prompt
    from kvtier.vllm.connector import pool_path

    e = engines(config(), processes=2)
    path = pool_path(str(e.cfg.kv_transfer_config.engine_id))
    assert os.path.exists(path)
    assert e.sched.native_scheduler.slot_bytes == 2 * 4096
    e.add("a", prompt("tp", 64), max_tokens=1)
    e.run()
    rec = e.add("b", prompt("tp", 64) + prompt("b", 8), max_tokens=1)
    e.run()
    assert rec.loaded_tokens == 64 and not rec.load_failed, rec
    e.close()
    assert not os.path.exists(path), "the scheduler side removes the pool file at shutdown"


def test_reset_with_worker_processes(engines):
    """reset_cache with two tensor-parallel worker processes (the host pool a shared file): the
    scheduler side cannot wait for their copies, and need not, since the core holds the slot of
    every job in flight until both ranks acknowledged it. A reset between building a load and the
    workers running it: the workers (other processes) learn of the reset only from the next
    step's metadata, so the load either completes first (it read slots the reset held, intact)
    or is failed at the reset (vLLM recomputes), depending on how fast the copy runs; either
    way every block a worker loads is compared with recompute, shard by shard, and the holds end
    once both ranks acknowledged it."""
    from connector_driver import prompt

    e = engines(config(), processes=2)
    e.add("a", prompt("tp-reset", 64), max_tokens=1)
    e.run()
    assert e.metrics()["pool"]["slots_used"] >= 4
    assert e.sched.reset_cache() is True
    e.step()
    assert e.metrics()["pool"]["slots_used"] == 0
    # Nothing left in the host pool: b computes its prompt, and stores it again.
    b = e.add("b", prompt("tp-reset", 64) + prompt("b", 8), max_tokens=1)
    e.run()
    assert b.loaded_tokens == 0 and not b.load_failed, b

    c = e.add("c", prompt("tp-reset", 64) + prompt("c", 8), max_tokens=1)
    fired = reset_once_its_load_is_built(e, c)
    e.run()
    assert [answer for answer, _ in fired] == [True], "the load was never built"
    assert c.state == "released" and c.loaded_tokens == 64, c
    # Stored again by c's recompute: d loads it, both shards checked against recompute.
    d = e.add("d", prompt("tp-reset", 64) + prompt("d", 8), max_tokens=1)
    e.run()
    assert d.loaded_tokens == 64 and not d.load_failed, d
    m = e.metrics()
    assert m["scheduler"]["invariant_failures"] == 0, m["scheduler"]
    assert m["pool"]["slots_held"] == 0, m["pool"]


def test_documented_vllm_config_works_with_the_connector(engines, tmp_path, monkeypatch, caplog):
    """vLLM's documented multi-tier extra config, verbatim but for the connector's name and the
    disk directory: vLLM's spec keys are ignored, its fs keys understood, `capacity_bytes` left out
    (half the free space, with a warning). Its 10 GiB host pool is cut by the documented
    environment override so the test fits in memory. Stored chunks go to disk; after a reset a
    request loads its prefix back from there, bytes compared."""
    import json
    import logging

    from vllm.config import KVTransferConfig

    from conftest import DOCUMENTED
    from connector_driver import prompt

    text = json.loads(DOCUMENTED)
    text.update(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm.connector")
    text["kv_connector_extra_config"]["secondary_tiers"][0]["root_dir"] = str(tmp_path)
    ktc = KVTransferConfig(**text)
    monkeypatch.setenv("KVTIER_CPU_BYTES_TO_USE", "1MiB")
    with caplog.at_level(logging.WARNING):
        e = engines(dict(ktc.kv_connector_extra_config))
    assert any("capacity_bytes not set" in r.getMessage() for r in caplog.records), caplog.text
    assert e.sched.native_scheduler.slot_bytes == 4096  # block_size 16 = one engine block
    e.add("a", prompt("documented", 64), max_tokens=1)
    e.settle()
    assert e.sched.reset_cache() is True
    b = e.add("b", prompt("documented", 64) + prompt("b", 8), max_tokens=1)
    e.run()
    assert b.loaded_tokens == 64 and not b.load_failed, b
    assert dict(e.metrics()["tiers"])["fs"]["chunks_loaded"] == 4


def test_disk_evictions_are_vllm_block_removed_events(engines, tmp_path):
    """A disk tier too small for what is stored evicts: each chunk it drops comes out of the
    connector's events as a vLLM BlockRemoved on the disk's medium, after its BlockStored there."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from connector_driver import prompt

    e = engines(config(secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path),
                                         "capacity_bytes": 32 * 4096, "engine": "sync"}]))
    for r in range(6):
        e.add(f"r{r}", prompt(f"evict-{r}", 128), max_tokens=1)
        e.settle()
    fs = dict(e.metrics()["tiers"])["fs"]
    disk_removed = [h for ev in e.events if isinstance(ev, BlockRemoved) and ev.medium == "DISK"
                    for h in ev.block_hashes]
    assert fs["evictions_reported"] > 0 and fs["evictions_unreported"] == 0, fs
    assert len(disk_removed) == len(set(disk_removed)) == fs["evictions_reported"], fs
    stored_on_disk = [h for ev in e.events if isinstance(ev, BlockStored) and ev.medium == "DISK"
                      for h in ev.block_hashes]
    assert set(disk_removed) < set(stored_on_disk), "a removed chunk never stored, or all removed"
    first = {}
    for i, ev in enumerate(e.events):
        if ev.medium == "DISK":
            for h in ev.block_hashes:
                first.setdefault(h, (i, type(ev).__name__))
    assert all(first[h][1] == "BlockStored" for h in disk_removed), "removed before stored"


def test_unknown_setting_is_refused_by_name():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector_driver import kv_cache_config, vllm_config
    from kvtier.vllm.connector import KvtierConnector

    cfg = vllm_config(config(cpu_bytez=1))
    with pytest.raises(ValueError, match="cpu_bytez"):
        KvtierConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(64))


def test_metrics_reach_prometheus_under_vllms_names(engines):
    from connector_driver import prompt
    from kvtier.vllm.connector import KvtierConnector

    e = engines(config())
    e.add("m1", prompt("metrics", 64), max_tokens=1)
    e.settle()
    e.add("m2", prompt("metrics", 64) + prompt("m2", 8), max_tokens=1)
    e.run()

    # What vLLM does with the payloads: the worker's and the scheduler's stats aggregated with
    # the connector class's build_kv_connector_stats, then observed by its prom metrics.
    total = KvtierConnector.build_kv_connector_stats()
    for s in e.worker_stats + e.sched_stats:
        total = total.aggregate(KvtierConnector.build_kv_connector_stats(data=s.to_dict()))
    reg, types = registry_metric_types()
    prom = KvtierConnector.build_prom_metrics(e.cfg, types, ["model_name", "engine"],
                                              {0: ["tiny", "0"]})
    prom.observe(total.to_dict(), engine_idx=0)

    def value(name, **labels):
        v = reg.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})
        assert v is not None, f"{name} {labels} not in the registry"
        return v

    chunk = 4096
    m = e.metrics()
    stored = m["tiering"]["host_chunks_stored"]
    # m1's 4 blocks (m2 only adds a partial block, which has no hash and is not stored).
    assert stored == 4, m["tiering"]
    assert value("vllm:kv_offload_store_bytes_total") == stored * chunk
    assert value("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == stored * chunk
    assert value("vllm:kv_offload_load_bytes_total") == 4 * chunk
    assert value("vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == 4 * chunk
    assert value("vllm:kv_offload_load_size_count") == 1
    assert value("vllm:kv_offload_size_count", transfer_type="CPU_to_GPU") == 1
    assert value("vllm:kv_offload_size_sum", transfer_type="CPU_to_GPU") == 4 * chunk
    assert value("vllm:kv_offload_store_time_total") > 0
    assert value("vllm:kv_offload_total_time_total", transfer_type="GPU_to_CPU") == value(
        "vllm:kv_offload_store_time_total")
    # kvtier's own, per tier.
    assert value("kvtier:transfer_bytes_total", tier="cpu", direction="store") == stored * chunk
    assert value("kvtier:lookup_hits_total", tier="cpu") == m["host"]["lookup_hits"]
    assert value("kvtier:pool_slots_total") == m["pool"]["slots_total"]


def test_a_corrupt_disk_chunk_is_recomputed_and_counted_by_kind_on_prometheus(engines, tmp_path):
    """Chunks stored to disk, the host pool reset, every record on disk damaged: the promotion
    from disk fails as `corrupt` before vLLM is promised any token, so the request computes its
    whole prompt (bytes compared in Engine._forward), and the failure reaches vLLM's registry as
    kvtier:chunk_failures{tier="fs",kind="corrupt"}."""
    from connector_driver import prompt
    from kvtier.vllm.connector import KvtierConnector

    e = engines(config(tmp_path))
    e.add("a", prompt("damaged", 64), max_tokens=1)
    e.settle()
    assert dict(e.metrics()["tiers"])["fs"]["chunks_stored"] == 4
    assert e.sched.reset_cache() is True
    e.step()
    damaged = 0
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.stat().st_size > 4096:
            data = bytearray(path.read_bytes())
            # One byte in every 4 KiB: each 4 KiB payload and each header is hit.
            for at in range(2048, len(data), 4096):
                data[at] ^= 0x5A
            path.write_bytes(bytes(data))
            damaged += 1
    assert damaged > 0, sorted(tmp_path.rglob("*"))

    b = e.add("b", prompt("damaged", 64) + prompt("b", 8), max_tokens=1)
    e.run()
    assert b.state == "released"
    assert b.loaded_tokens == 0 and not b.load_failed, b
    fs = dict(e.metrics()["tiers"])["fs"]
    assert fs["failures"]["corrupt"] > 0, fs
    assert fs["chunks_loaded"] == 0, fs

    total = KvtierConnector.build_kv_connector_stats()
    for s in e.worker_stats + e.sched_stats:
        total = total.aggregate(KvtierConnector.build_kv_connector_stats(data=s.to_dict()))
    reg, types = registry_metric_types()
    prom = KvtierConnector.build_prom_metrics(e.cfg, types, ["model_name", "engine"],
                                              {0: ["tiny", "0"]})
    prom.observe(total.to_dict(), engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0", "tier": "fs"}
    # A counter that never moved has no sample yet.
    for kind, count in fs["failures"].items():
        got = reg.get_sample_value("kvtier:chunk_failures_total", {**labels, "kind": kind})
        assert (got or 0) == count, (kind, got, count)
    assert reg.get_sample_value("kvtier:chunk_failures_total", {**labels, "kind": "corrupt"}) > 0

    # Invariant failures sum the scheduler's, the host pool's and the tiering manager's, as
    # kvtier_invariant_failures_total does (none broke here, so distinct stand-in counts).
    from kvtier.vllm.connector import _kvtier_counters

    m = e.metrics()
    assert m["host"]["invariant_failures"] == m["tiering"]["invariant_failures"] == 0
    m["scheduler"]["invariant_failures"] = 1
    m["host"]["invariant_failures"] = 10
    m["tiering"]["invariant_failures"] = 100
    counters = _kvtier_counters(m)
    assert counters[("kvtier:invariant_failures", ())] == 111
    assert counters[("kvtier:chunk_failures", ("fs", "corrupt"))] == fs["failures"]["corrupt"]


def test_events_are_vllm_block_events(engines):
    from vllm.distributed.kv_events import BlockStored

    from connector_driver import prompt

    e = engines(config())
    rec = e.add("ev", prompt("events", 48), max_tokens=1)
    e.settle()
    stored = [ev for ev in e.events if isinstance(ev, BlockStored)]
    hashes = [h for ev in stored for h in ev.block_hashes]
    assert hashes == [bytes(h) for h in rec.req.block_hashes[:3]], hashes
    assert all(ev.medium == "CPU" for ev in stored)


def test_load_that_cannot_be_prepared_is_reported_failed_and_recomputed(engines):
    """A lookup promised tokens, then a reset dropped them before vLLM allocated the blocks: no
    load job can be built, so the worker reports the request as received and failed, and vLLM
    recomputes it (no request waits forever for a load that does not exist)."""
    from connector_driver import prompt

    e = engines(config())
    e.add("a", prompt("gone", 64), max_tokens=1)
    e.run()
    rec = e.add("b", prompt("gone", 64) + prompt("b", 8), max_tokens=1)
    real = e.sched.update_state_after_alloc

    def reset_first(request, blocks, num_external_tokens):
        if request.request_id == "b" and num_external_tokens > 0:
            e.sched.reset_cache()
        return real(request, blocks, num_external_tokens)

    e.sched.update_state_after_alloc = reset_first
    e.run()
    assert rec.loaded_tokens == 64 and rec.load_failed, rec


def test_readme_example_config_resolves_as_printed():
    """README.md's KvtierConnector example: the JSON parses, vLLM's KVTransferConfig takes it,
    the factory finds the class, and kvtier resolves its extra config against an engine."""
    import json
    import pathlib

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier._kvtier import resolve_connector_config
    from kvtier.vllm.connector import KvtierConnector

    readme = (pathlib.Path(__file__).resolve().parents[3] / "README.md").read_text()
    at = readme.index('"kv_connector": "KvtierConnector"')
    start = readme.rindex("'{", 0, at) + 1
    end = readme.index("}'", at) + 1
    text = json.loads(readme[start:end])
    ktc = KVTransferConfig(**text)
    assert KVConnectorFactory.get_connector_class(ktc) is KvtierConnector
    geometry = {"model": "m", "dtype": "bfloat16", "tokens_per_block": 16,
                "block_bytes": 1 << 17, "parallel_layout": "tp1-pp1", "hash_seed": 0}
    r = resolve_connector_config(json.dumps(ktc.kv_connector_extra_config), geometry)
    assert r["blocks_per_chunk"] == 4 and r["slot_count"] == 10737418240 // (4 << 17), r


class _Spy:
    """Forwards every call to `inner` and logs `(tag, method)` first."""

    def __init__(self, inner, log, tag):
        self._inner, self._log, self._tag = inner, log, tag

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*a, **kw):
            self._log.append((self._tag, name))
            return attr(*a, **kw)

        return call


def test_reset_waits_for_the_workers_copies_before_freeing_slots(engines):
    """reset_cache frees every host slot, which a promotion may take at once: the worker's
    copies (in this process) must be finished first, or one could tear a reused slot."""
    from connector_driver import prompt

    e = engines(config())
    e.add("a", prompt("drain", 64), max_tokens=1)
    e.run()
    log = []
    e.worker._worker.native = _Spy(e.worker._worker.native, log, "worker")
    e.sched._sched.native = _Spy(e.sched._sched.native, log, "scheduler")
    e.sched.reset_cache()
    assert ("worker", "drain") in log and ("scheduler", "reset_cache") in log, log
    assert log.index(("worker", "drain")) < log.index(("scheduler", "reset_cache")), log


def test_metadata_built_before_a_reset_starts_no_copy(engines):
    """vLLM's async scheduling builds a step's metadata while the worker still runs the previous
    one, so a reset can fall between building a load and the worker starting it. The slots that
    load names were freed by the reset: the worker must start no copy for it (it fails, and vLLM
    recomputes)."""
    from connector_driver import prompt

    e = engines(config())
    e.add("a", prompt("epoch", 64), max_tokens=1)
    e.run()
    c = e.add("c", prompt("epoch", 64) + prompt("c", 8), max_tokens=1)
    native = e.worker._worker.native
    fired = reset_once_its_load_is_built(e, c, then=lambda: native.counters()["jobs_submitted"])
    e.step()  # builds c's load, resets, then the worker runs the step
    assert fired, "the load was not built in the first step"
    assert native.counters()["jobs_submitted"] == fired[0][1], native.counters()
    e.run()
    assert c.load_failed and c.state == "released", c
