"""`KvtierConnector`: kvtier as a vLLM KV connector (`KVConnectorBase_V1`).

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {
                               "cpu_bytes_to_use": 8589934592, "block_size": 64,
                               "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/nvme/kv",
                                                    "capacity_bytes": 214748364800}]}}'

`kv_connector_extra_config` is kvtier's connector configuration (the connector crate's keys:
`cpu_bytes_to_use`, `block_size` or `blocks_per_chunk`, `eviction_policy`,
`offload_prompt_only`, `offload_policy`, `reuse_threshold`, the deadlines, `secondary_tiers` with
`fs`, `p2p` and `obj` entries). vLLM's OffloadingConnector keys are understood too, so an extra
config pasted from vLLM's documentation works with only `kv_connector` and
`kv_connector_module_path` changed: `spec_name` is ignored, `store_threshold` is
`reuse_threshold`, an fs entry takes vLLM's `n_read_threads`/`n_write_threads` and may leave out
`capacity_bytes`, sizes may be strings ("10GiB"), and `KVTIER_*` variables override keys
(`kvtier.config.connector_settings` lists them all). A key neither kvtier nor vLLM knows is
refused by name.

What runs where: the scheduler side is offload-core's request state machine over kvtier's tiering
manager (host pool plus secondary tiers), native; the worker side copies between vLLM's KV cache
tensors and the host pool, native, reading the tensors in place (`data_ptr`), never through
Python: with kvtier's memcpy threads (tier-gpu's host path) for KV caches in host memory, with
tier-gpu's CUDA engine for KV caches on a CUDA GPU (all layers on one device; the host pool is
page-locked once per process; a missing CUDA driver is an error naming it at
`register_kv_caches`, not at import). On a GPU the copies are ordered against vLLM's forward
through events on torch's current stream: `start_load_kv` records one before the forward is
enqueued and the loads wait on it; `wait_for_save` records one after it and the stores wait on
it; a load is reported in `finished_recving` only when its copies are done, and vLLM schedules
no forward over a loading request before that (so `wait_for_layer_load` has nothing to wait
for). The CUDA path is written and tested on the CPU (layouts, refusals, the missing driver, the
host path of the same round trip); its GPU checks (`crates/kvtier-py/scripts/gpu_check.sh`) have
NOT yet run on a GPU.

vLLM's `str` request ids become numbers and
its `bytes` block hashes the xxh3-128 of their bytes (as `kvtier.vllm.tiers` keys chunks); the
per-step metadata and the workers' acknowledgements cross as bytes (offload-core's JSON).

Lifecycle, as offload-core's contract says: a request with stores still to build or in flight
when it finishes is kept (`request_finished` returns True) until every store was acknowledged;
its blocks are then released through the worker's `finished_sending`. Loads are asynchronous
(`WAITING_FOR_REMOTE_KVS`); a load that fails is reported in `failed_recving`, and vLLM
recomputes. A reused engine block whose store is still in flight is flushed before the compute.

Layouts: with vLLM's single-process executor (`distributed_executor_backend="uni"`, one worker)
the host pool is memory of the process. With its multi-process executor (`"mp"`) on one node,
tensor parallel only, the host pool is a file in `/dev/shm` (`$KVTIER_SHM_DIR`) named by the
engine id, mapped by the scheduler process and every worker process; each slot holds every
rank's shard of the chunk, rank after rank, and every job completes at its last rank's
acknowledgement; `reset_cache` works there as in one process, since the core holds the host slot
of every job in flight until every rank acknowledged it. Other
layouts (pipeline parallel, several nodes, Ray) are refused at start, naming the setting, and so
are KV caches spread over several devices or on a device other than the CPU or a CUDA GPU.

Metrics: kvtier's counters (`kvtier:*`, per tier) and vLLM's offload metric names
(`vllm:kv_offload_{load,store}_{bytes,time,size}`, and the deprecated
`vllm:kv_offload_total_bytes` / `vllm:kv_offload_total_time` / `vllm:kv_offload_size` with
`transfer_type`) go through vLLM's `KVConnectorStats` / `KVConnectorPromMetrics` path, so
they appear on vLLM's own `/metrics`. KV events come out of `take_events` as vLLM
`BlockStored` / `BlockRemoved`, which vLLM's publisher carries.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

from .._kvtier import (
    ConnectorScheduler,
    ConnectorWorker,
    HostPool,
    block_hashes_to_u128,
    resolve_connector_config,
)
from ..config import connector_settings
from ..kvcache import KvDevice, kv_cache_regions

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "KvtierConnector",
    "KvtierConnectorMetadata",
    "KvtierWorkerMetadata",
    "KvtierPromMetrics",
    "METRIC_DEFINITIONS",
]

logger = logging.getLogger(__name__)

# -- metrics ---------------------------------------------------------------------------------

# vLLM's flat offload metric names (worker side: GPU <-> host pool transfers, per job).
LOAD_BYTES = "vllm:kv_offload_load_bytes"
LOAD_TIME = "vllm:kv_offload_load_time"
LOAD_SIZE = "vllm:kv_offload_load_size"
STORE_BYTES = "vllm:kv_offload_store_bytes"
STORE_TIME = "vllm:kv_offload_store_time"
STORE_SIZE = "vllm:kv_offload_store_size"
# The deprecated names, with a transfer_type label, fed from the flat ones.
DEPRECATED_BYTES = "vllm:kv_offload_total_bytes"
DEPRECATED_TIME = "vllm:kv_offload_total_time"
DEPRECATED_SIZE = "vllm:kv_offload_size"
_TRANSFER_TYPE = {LOAD_BYTES: "CPU_to_GPU", LOAD_TIME: "CPU_to_GPU", LOAD_SIZE: "CPU_to_GPU",
                  STORE_BYTES: "GPU_to_CPU", STORE_TIME: "GPU_to_CPU", STORE_SIZE: "GPU_to_CPU"}
_DEPRECATED_OF = {LOAD_BYTES: DEPRECATED_BYTES, STORE_BYTES: DEPRECATED_BYTES,
                  LOAD_TIME: DEPRECATED_TIME, STORE_TIME: DEPRECATED_TIME,
                  LOAD_SIZE: DEPRECATED_SIZE, STORE_SIZE: DEPRECATED_SIZE}
# vLLM's buckets for transfer sizes, in bytes.
SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


@dataclass(frozen=True)
class MetricDef:
    """One Prometheus metric kvtier's connector exposes."""

    kind: str  # "counter", "gauge" or "histogram"
    documentation: str
    labelnames: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


METRIC_DEFINITIONS: dict[str, MetricDef] = {
    LOAD_BYTES: MetricDef("counter", "Total bytes loaded from offload storage to GPU."),
    LOAD_TIME: MetricDef("counter", "Total load time from offload storage to GPU, in seconds."),
    LOAD_SIZE: MetricDef("histogram", "Histogram of KV offload load operation size, in bytes.",
                         buckets=SIZE_BUCKETS),
    STORE_BYTES: MetricDef("counter", "Total bytes stored from GPU to offload storage."),
    STORE_TIME: MetricDef("counter", "Total store time from GPU to offload storage, in seconds."),
    STORE_SIZE: MetricDef("histogram", "Histogram of KV offload store operation size, in bytes.",
                          buckets=SIZE_BUCKETS),
    DEPRECATED_BYTES: MetricDef("counter", "Number of bytes offloaded by KV connector",
                                ("transfer_type",)),
    DEPRECATED_TIME: MetricDef("counter", "Total time measured by all KV offloading operations",
                               ("transfer_type",)),
    DEPRECATED_SIZE: MetricDef("histogram", "Histogram of KV offload transfer size, in bytes.",
                               ("transfer_type",), SIZE_BUCKETS),
    "kvtier:lookups": MetricDef("counter", "Keys kvtier looked up, per tier (cpu: host pool).",
                                ("tier",)),
    "kvtier:lookup_hits": MetricDef("counter", "Lookups that found the key, per tier.", ("tier",)),
    "kvtier:transfer_bytes": MetricDef(
        "counter", "Bytes kvtier moved into (store) or out of (load) each tier.",
        ("tier", "direction")),
    "kvtier:transfer_seconds": MetricDef(
        "counter", "Seconds kvtier's jobs took, per tier and direction, summed.",
        ("tier", "direction")),
    "kvtier:chunks_failed": MetricDef(
        "counter", "Chunks a store or load failed, per tier (loads are recomputed).",
        ("tier", "direction")),
    "kvtier:chunk_failures": MetricDef(
        "counter", "Chunks a secondary tier failed (stores and promotions), per tier and kind "
        "(missing, corrupt, cancelled, tier_down, timeout, io, other); loads are recomputed.",
        ("tier", "kind")),
    "kvtier:requests_disabled": MetricDef(
        "counter", "Requests whose offload was dropped after a broken bookkeeping invariant."),
    "kvtier:invariant_failures": MetricDef(
        "counter", "Broken bookkeeping invariants counted (scheduler, host pool and tiering "
        "manager together, as kvtier_invariant_failures_total)."),
    "kvtier:pool_slots_used": MetricDef("gauge", "Host-pool slots holding a chunk."),
    "kvtier:pool_slots_total": MetricDef("gauge", "Host-pool slots."),
}


def _kvtier_counters(metrics: dict[str, Any]) -> dict[tuple[str, tuple[str, ...]], float]:
    """kvtier's cumulative counters, flattened to (metric name, label values) -> value."""
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    host, tiering, sched = metrics["host"], metrics["tiering"], metrics["scheduler"]
    out[("kvtier:lookups", ("cpu",))] = host["lookups"]
    out[("kvtier:lookup_hits", ("cpu",))] = host["lookup_hits"]
    out[("kvtier:transfer_bytes", ("cpu", "store"))] = tiering["host_bytes_stored"]
    out[("kvtier:transfer_bytes", ("cpu", "load"))] = tiering["host_bytes_loaded"]
    out[("kvtier:transfer_seconds", ("cpu", "store"))] = tiering["host_store_ns"] / 1e9
    out[("kvtier:transfer_seconds", ("cpu", "load"))] = tiering["host_load_ns"] / 1e9
    out[("kvtier:chunks_failed", ("cpu", "store"))] = sched["store_failures"]
    out[("kvtier:chunks_failed", ("cpu", "load"))] = sched["load_failures"]
    for name, c in metrics["tiers"]:
        out[("kvtier:lookups", (name,))] = c["lookups"]
        out[("kvtier:lookup_hits", (name,))] = c["hits"]
        out[("kvtier:transfer_bytes", (name, "store"))] = c["bytes_stored"]
        out[("kvtier:transfer_bytes", (name, "load"))] = c["bytes_loaded"]
        out[("kvtier:transfer_seconds", (name, "store"))] = c["store_ns"] / 1e9
        out[("kvtier:transfer_seconds", (name, "load"))] = c["load_ns"] / 1e9
        out[("kvtier:chunks_failed", (name, "store"))] = c["store_chunks_failed"]
        out[("kvtier:chunks_failed", (name, "load"))] = c["load_chunks_failed"]
        for kind, count in c["failures"].items():
            out[("kvtier:chunk_failures", (name, kind))] = count
    out[("kvtier:requests_disabled", ())] = sched["requests_disabled"]
    out[("kvtier:invariant_failures", ())] = (
        sched["invariant_failures"] + host["invariant_failures"] + tiering["invariant_failures"])
    return out


class KvtierPromMetrics(KVConnectorPromMetrics):
    """Registers every metric of `METRIC_DEFINITIONS` with vLLM's metric classes (so they land
    in vLLM's registry and on its `/metrics`) and records the stats payloads into them."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        self._bound: dict[tuple[str, int, tuple[str, ...]], Any] = {}
        for name, d in METRIC_DEFINITIONS.items():
            kwargs: dict[str, Any] = {
                "name": name,
                "documentation": d.documentation,
                "labelnames": list(labelnames) + list(d.labelnames),
            }
            if d.kind == "counter":
                cls = self._counter_cls
            elif d.kind == "gauge":
                cls = self._gauge_cls
                kwargs["multiprocess_mode"] = "mostrecent"
            else:
                cls = self._histogram_cls
                kwargs["buckets"] = d.buckets
            self._metrics[name] = cls(**kwargs)
        self._unknown_logged: set[str] = set()

    def _bound_metric(self, name: str, engine_idx: int, labelvalues: tuple[str, ...]):
        key = (name, engine_idx, labelvalues)
        m = self._bound.get(key)
        if m is None:
            engine_labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
            m = self._metrics[name].labels(*engine_labels, *labelvalues)
            self._bound[key] = m
        return m

    def _record(self, name: str, kind: str, value: Any, labels: tuple[str, ...], engine_idx: int):
        m = self._bound_metric(name, engine_idx, labels)
        if kind == "counter":
            m.inc(value)
        elif kind == "gauge":
            m.set(value)
        else:
            for v in value:
                m.observe(v)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        types = transfer_stats_data.get("types", {})
        for name, by_labels in transfer_stats_data.get("data", {}).items():
            d = METRIC_DEFINITIONS.get(name)
            if d is None or types.get(name) != d.kind:
                if name not in self._unknown_logged:
                    self._unknown_logged.add(name)
                    logger.warning("kvtier: stats name %r (%s) is not one of kvtier's metrics",
                                   name, types.get(name))
                continue
            for labels, value in by_labels.items():
                labels = tuple(str(v) for v in labels)
                self._record(name, d.kind, value, labels, engine_idx)
                deprecated = _DEPRECATED_OF.get(name)
                if deprecated is not None and not labels:
                    self._record(deprecated, d.kind, value, (_TRANSFER_TYPE[name],), engine_idx)


# -- metadata crossing from the scheduler to the worker and back -----------------------------------


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """One step's metadata: offload-core's `ConnectorMeta` as JSON bytes, plus what only the
    Python half knows (vLLM's request ids)."""

    payload: bytes
    # Request numbers -> vLLM ids, for the loads built since the last step.
    names: dict[int, str] = field(default_factory=dict)
    # Finished requests whose every store was acknowledged: their blocks may be freed now (the
    # worker reports them in finished_sending).
    released: tuple[str, ...] = ()
    # Requests told to load whose load job could not be built: the worker reports them as
    # received and failed, and vLLM recomputes.
    failed_loads: tuple[str, ...] = ()
    # How many resets the scheduler side had made when it built this: a worker that runs it
    # after a later reset fails its loads and stores instead of copying (single process only).
    epoch: int = 0


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """The workers' acknowledgements of one step (offload-core's `WorkerOutput`, JSON bytes)."""

    outputs: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        return KvtierWorkerMetadata(self.outputs + other.outputs)


# -- the host pool both sides share ------------------------------------------------------------------

_POOLS: dict[str, HostPool] = {}
# The worker sides of each engine (one in this layout), so that a reset can wait for their copies.
_WORKERS: dict[str, weakref.WeakSet] = {}
_POOLS_LOCK = threading.Lock()


class _Epoch:
    """Resets of one engine, shared by its scheduler side and its worker side in this process.
    A worker starts copies only under `lock` and only for metadata of the current `value`; a
    reset takes `lock`, moves `value` on and waits for the copies, so no copy of metadata built
    before it can start after it (vLLM's async scheduling builds the next step's metadata while
    the worker runs the previous one)."""

    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()


_EPOCHS: dict[str, _Epoch] = {}


def _epoch(engine_id: str) -> _Epoch:
    with _POOLS_LOCK:
        return _EPOCHS.setdefault(engine_id, _Epoch())


def pool_path(engine_id: str) -> str:
    """The file that holds engine `engine_id`'s host pool when its workers are other processes:
    in `$KVTIER_SHM_DIR` (default `/dev/shm`, which is host memory)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in engine_id)
    return os.path.join(os.environ.get("KVTIER_SHM_DIR", "/dev/shm"), f"kvtier-{safe}.pool")


def _shared_pool(engine_id: str, slot_bytes: int, slot_count: int, in_file: bool) -> HostPool:
    """The host pool of engine `engine_id`, made by whichever side comes first (in this
    process, or, `in_file`, in the file every process of the engine opens)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(engine_id)
        if pool is None:
            if in_file:
                pool = HostPool.open_shared(pool_path(engine_id), slot_bytes, slot_count)
            else:
                pool = HostPool(slot_bytes, slot_count)
            _POOLS[engine_id] = pool
        elif (pool.slot_bytes, pool.slot_count) != (slot_bytes, slot_count):
            raise ValueError(
                f"kvtier connector: engine {engine_id} already has a host pool of "
                f"{pool.slot_count} slots of {pool.slot_bytes} bytes, not {slot_count} of "
                f"{slot_bytes}"
            )
        return pool


@dataclass(frozen=True)
class _Layout:
    workers: int  # tensor-parallel ranks, each acknowledging every job
    in_file: bool  # the workers are other processes: the host pool is a shared file


def _check_layout(vllm_config: Any) -> _Layout:
    """The layouts kvtier runs in: vLLM's single-process executor (`uni`, one worker; the host
    pool is memory of the process), or its multi-process executor (`mp`) on one node with
    tensor parallelism only (the host pool is a file in /dev/shm that every process maps).
    Anything else is refused, naming the setting."""
    par = vllm_config.parallel_config
    backend = getattr(par, "distributed_executor_backend", None)
    name = backend if isinstance(backend, str) or backend is None else getattr(
        backend, "__name__", str(backend))
    world = int(getattr(par, "world_size", 1))
    pp = int(getattr(par, "pipeline_parallel_size", 1))
    nodes = int(getattr(par, "nnodes", 1))
    if name in (None, "uni") and world == 1:
        return _Layout(1, False)
    if name == "mp" and pp == 1 and nodes == 1:
        return _Layout(world, True)
    raise ValueError(
        "kvtier connector: its host pool is host memory of one node, shared by the scheduler "
        "and the workers, so it runs with distributed_executor_backend='uni' (one worker) or "
        "'mp' on one node with tensor parallelism only; this engine has "
        f"distributed_executor_backend={name!r}, world_size={world}, "
        f"pipeline_parallel_size={pp}, nnodes={nodes}"
    )


def _tp_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank (vLLM's parallel state, else the config's rank)."""
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            model_parallel_is_initialized,
        )

        if model_parallel_is_initialized():
            return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no parallel state: a single process or a test
        pass
    return int(getattr(vllm_config.parallel_config, "rank", 0))


def _engine_geometry(vllm_config: Any, kv_cache_config: Any, workers: int) -> dict[str, Any]:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"kvtier connector: the model has {len(groups)} KV cache groups; kvtier offloads "
            "models with one (hybrid models are not supported)"
        )
    spec = groups[0].kv_cache_spec
    model = vllm_config.model_config
    par = vllm_config.parallel_config
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    dtype = str(model.dtype) if cache_dtype in (None, "auto") else str(cache_dtype)
    return {
        "model": str(model.model),
        "dtype": dtype.removeprefix("torch."),
        "tokens_per_block": int(spec.block_size),
        "block_bytes": int(spec.page_size_bytes) * len(groups[0].layer_names) * workers,
        "worker_count": workers,
        "parallel_layout": f"tp{par.tensor_parallel_size}-pp{par.pipeline_parallel_size}",
        "hash_seed": 0,
    }


def _engine_id(vllm_config: Any) -> str:
    return str(vllm_config.kv_transfer_config.engine_id)


# Most vLLM block hashes remembered (for KV events: kvtier reports its chunk keys by number).
HASH_NAMES_MAX = 1 << 20


class KvtierConnector(KVConnectorBase_V1):
    """kvtier's connector for vLLM (`kv_connector_module_path: "kvtier.vllm.connector"`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._layout = _check_layout(vllm_config)
        if kv_cache_config is None:
            raise ValueError("kvtier connector: vLLM gave no kv_cache_config")
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        # vLLM's OffloadingConnector keys understood, sizes parsed, KVTIER_* overrides applied.
        settings, warnings = connector_settings(extra)
        if role == KVConnectorRole.SCHEDULER:
            for warning in warnings:
                logger.warning("%s", warning)
        self._config_json = json.dumps(settings)
        self._geometry = _engine_geometry(vllm_config, kv_cache_config, self._layout.workers)
        self._resolved = resolve_connector_config(self._config_json, self._geometry)
        self._engine_id = _engine_id(vllm_config)
        self._pool = _shared_pool(
            self._engine_id, self._resolved["slot_bytes"], self._resolved["slot_count"],
            self._layout.in_file)
        self._kv_cache_config = kv_cache_config
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            events = getattr(vllm_config, "kv_events_config", None)
            self._sched = _SchedulerSide(
                ConnectorScheduler(self._config_json, self._geometry, self._pool),
                self._resolved,
                events_on=bool(getattr(events, "enable_kv_cache_events", False))
                or bool(extra.get("enable_kv_events", False)),
                epoch=_epoch(self._engine_id),
            )
        else:
            rank = _tp_rank(vllm_config) if self._layout.workers > 1 else 0
            self._worker = _WorkerSide(self._pool, self._resolved, kv_cache_config, rank,
                                       self._layout.workers, _epoch(self._engine_id))
            with _POOLS_LOCK:
                _WORKERS.setdefault(self._engine_id, weakref.WeakSet()).add(self._worker)

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache, like vLLM's OffloadingConnector: a dropped store is a later miss.
        return False

    # -- scheduler side ---------------------------------------------------------------------------
    @property
    def native_scheduler(self) -> ConnectorScheduler:
        assert self._sched is not None, "not the scheduler-side connector"
        return self._sched.native

    def on_new_request(self, request: Request) -> None:
        assert self._sched is not None
        self._sched.number(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int):
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput):
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]):
        assert self._sched is not None
        return self._sched.request_finished(request), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        assert self._sched is not None
        return self._sched.take_events()

    def reset_cache(self) -> bool | None:
        assert self._sched is not None
        if self._layout.in_file:
            # The workers are other processes, whose copies cannot be waited for here. None is
            # needed: offload-core's reset holds the host slot of every job in flight (built,
            # sent or running) until every worker acknowledged that job, so no promotion or new
            # store takes a slot a worker copy may still read or write; the next step's metadata
            # carries the reset, and each worker ends its older jobs before touching a slot; a
            # load older than the reset is reported failed (vLLM recomputes), its request holding
            # the blocks the load writes until every rank acknowledged it.
            self._sched.reset_cache()
            return True
        # The workers are in this process: wait for their copies first, so no copy of metadata
        # built before the reset starts after it (defence in depth beside the slot holds above;
        # their completions are still reported, and loads older than the reset fail).
        with _POOLS_LOCK:
            workers = list(_WORKERS.get(self._engine_id, ()))
        epoch = _epoch(self._engine_id)
        with epoch.lock:
            epoch.value += 1
            for w in workers:
                w.drain()
        self._sched.reset_cache()
        return True

    # -- worker side ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        assert self._worker is not None
        self._worker.bind(kv_connector_metadata)
        self._worker.before_compute()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.before_compute()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs) -> None:
        return None

    def wait_for_save(self):
        assert self._worker is not None
        self._worker.after_compute()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.transfer_results()

    def get_finished(self, finished_req_ids: set[str]):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        if self._worker is None:
            return None
        return self._worker.take_worker_meta()

    # -- both ------------------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._sched is not None:
            return self._sched.stats()
        if self._worker is not None:
            return self._worker.stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return OffloadingConnectorStats(data=data) if data is not None else OffloadingConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.native.shutdown()
        with _POOLS_LOCK:
            if _POOLS.get(self._engine_id) is self._pool:
                del _POOLS[self._engine_id]
                if self._layout.in_file and self._sched is not None:
                    # The scheduler side outlives its workers; mappings stay valid after unlink.
                    try:
                        os.unlink(pool_path(self._engine_id))
                    except FileNotFoundError:
                        pass
            if self._worker is not None and self._engine_id in _WORKERS:
                _WORKERS[self._engine_id].discard(self._worker)
            if self._sched is not None:
                _EPOCHS.pop(self._engine_id, None)


class _SchedulerSide:
    """The scheduler half: vLLM's request objects and ids in, native calls out."""

    def __init__(self, native: ConnectorScheduler, resolved: dict[str, Any], events_on: bool,
                 epoch: _Epoch):
        self.native = native
        self.epoch = epoch
        self.tokens_per_chunk = resolved["tokens_per_block"] * resolved["blocks_per_chunk"]
        self.events_on = events_on
        self._numbers: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._requests: dict[str, Request] = {}
        self._hashes: dict[str, list[int]] = {}
        self._next = 1
        self._step = 0
        self._new_loads: dict[int, str] = {}
        self._failed_loads: list[str] = []
        self._released: list[str] = []
        self._hash_names: dict[int, bytes] = {}
        self._last_counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self.events_unnamed = 0

    # -- ids and hashes --------------------------------------------------------------------------
    def number(self, request: Request) -> int:
        n = self._numbers.get(request.request_id)
        if n is None:
            n = self._next
            self._next += 1
            self._numbers[request.request_id] = n
            self._names[n] = request.request_id
            self._requests[request.request_id] = request
            self.native.on_new_request(n, int(request.num_prompt_tokens), None)
        return n

    def hashes(self, request: Request) -> list[int]:
        """The request's block hashes as kvtier's numbers (converted once each)."""
        done = self._hashes.setdefault(request.request_id, [])
        raw = request.block_hashes
        if len(raw) > len(done):
            new = list(raw[len(done):])
            nums = block_hashes_to_u128(new)
            done.extend(nums)
            if self.events_on:
                for h, b in zip(nums, new):
                    self._hash_names[h] = bytes(b)
                while len(self._hash_names) > HASH_NAMES_MAX:
                    self._hash_names.pop(next(iter(self._hash_names)))
        return done

    def forget(self, req_id: str) -> None:
        n = self._numbers.pop(req_id, None)
        if n is not None:
            self._names.pop(n, None)
        self._requests.pop(req_id, None)
        self._hashes.pop(req_id, None)

    # -- vLLM's scheduler calls ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        n = self.number(request)
        got = self.native.get_num_new_matched_tokens(
            n, int(request.num_tokens), self.hashes(request), int(num_computed_tokens))
        if got is None:
            return None, False
        return got, got > 0

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        n = self.number(request)
        groups = blocks.get_block_ids()
        block_ids = list(groups[0]) if groups else []
        built = self.native.update_state_after_alloc(n, block_ids, int(num_external_tokens))
        if num_external_tokens > 0:
            if built:
                self._new_loads[n] = request.request_id
            else:
                logger.warning("kvtier: load of %d tokens for request %s could not be prepared; "
                               "vLLM recomputes them", num_external_tokens, request.request_id)
                self._failed_loads.append(request.request_id)

    def build_connector_meta(self, so: SchedulerOutput) -> KvtierConnectorMetadata:
        scheduled = []
        for nd in so.scheduled_new_reqs:
            req = self._requests.get(nd.req_id)
            if req is None:
                continue
            scheduled.append((
                self._numbers[nd.req_id], int(nd.num_computed_tokens),
                int(so.num_scheduled_tokens.get(nd.req_id, 0)), int(req.num_tokens),
                list(nd.block_ids[0]) if nd.block_ids else [], True, self.hashes(req)))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._requests.get(req_id)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            scheduled.append((
                self._numbers[req_id], int(cached.num_computed_tokens[i]),
                int(so.num_scheduled_tokens.get(req_id, 0)), int(req.num_tokens),
                list(new_ids[0]) if new_ids else [], req_id in cached.resumed_req_ids,
                self.hashes(req)))
        preempted = [self._numbers[r] for r in (so.preempted_req_ids or ()) if r in self._numbers]
        self._step += 1
        payload = self.native.build_connector_meta(self._step, scheduled, preempted)
        self._collect_released()
        meta = KvtierConnectorMetadata(
            payload=payload, names=self._new_loads, released=tuple(self._released),
            failed_loads=tuple(self._failed_loads), epoch=self.epoch.value)
        self._new_loads, self._released, self._failed_loads = {}, [], []
        return meta

    def _collect_released(self) -> None:
        for n in self.native.take_released():
            name = self._names.get(n)
            if name is not None:
                self._released.append(name)
                self.forget(name)

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        wm = out.kv_connector_worker_meta
        outputs = wm.outputs if isinstance(wm, KvtierWorkerMetadata) else []
        for n, ok in self.native.update_connector_output(outputs):
            if not ok:
                logger.debug("kvtier: load for request %s failed", self._names.get(n, n))
        self._collect_released()

    def request_finished(self, request: Request) -> bool:
        from vllm.v1.request import RequestStatus

        n = self._numbers.get(request.request_id)
        if n is None:
            return False
        keep = self.native.request_finished(
            n, request.status == RequestStatus.FINISHED_ABORTED, int(request.num_tokens),
            int(request.num_computed_tokens), self.hashes(request))
        if not keep:
            self.forget(request.request_id)
        return keep

    def reset_cache(self) -> None:
        self.native.reset_cache()
        self._collect_released()

    def take_events(self) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for stored, medium, _tier, h, _group in self.native.take_events():
            name = self._hash_names.get(h)
            if name is None:
                self.events_unnamed += 1
                continue
            if stored:
                out.append(BlockStored(block_hashes=[name], parent_block_hash=None, token_ids=[],
                                       block_size=self.tokens_per_chunk, lora_id=None,
                                       medium=medium, lora_name=None))
            else:
                out.append(BlockRemoved(block_hashes=[name], medium=medium))
        return out

    def stats(self) -> OffloadingConnectorStats | None:
        metrics = json.loads(self.native.metrics_json())
        now = _kvtier_counters(metrics)
        stats = OffloadingConnectorStats()
        for (name, labels), value in now.items():
            delta = value - self._last_counters.get((name, labels), 0)
            if delta > 0:
                stats.increase_counter(name, delta, labels)
        self._last_counters = now
        pool = metrics["pool"]
        stats.set_gauge("kvtier:pool_slots_used", pool["slots_used"])
        stats.set_gauge("kvtier:pool_slots_total", pool["slots_total"])
        return stats


class _WorkerSide:
    """The worker half: binds each step's metadata and reports vLLM's transfer results."""

    def __init__(self, pool: HostPool, resolved: dict[str, Any], kv_cache_config: Any,
                 rank: int = 0, workers: int = 1, epoch: _Epoch | None = None):
        self.pool = pool
        self.epoch = epoch or _Epoch()
        self.rank = rank
        self.workers = workers
        self.blocks_per_chunk = int(resolved["blocks_per_chunk"])
        self.kv_cache_config = kv_cache_config
        self.native: ConnectorWorker | None = None
        self.device = KvDevice("cpu")
        self._bound: KvtierConnectorMetadata | None = None
        self._names: dict[int, str] = {}
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._outputs: list[bytes] = []
        self._stats = OffloadingConnectorStats()

    def register(self, kv_caches: dict[str, Any]) -> None:
        group = self.kv_cache_config.kv_cache_groups[0]
        regions, device = kv_cache_regions(kv_caches, list(group.layer_names),
                                           int(self.kv_cache_config.num_blocks))
        owners = [kv_caches[n] for n in group.layer_names]
        share = None
        if self.workers > 1:
            share_bytes = self.pool.slot_bytes // self.workers
            share = self.rank * share_bytes
        if device.is_cuda:
            # tier-gpu's CUDA engine; raises naming the CUDA driver where none is usable.
            self.native = ConnectorWorker.cuda(self.pool, regions, self.blocks_per_chunk, owners,
                                               device.index, rank=self.rank, share_offset=share)
        else:
            self.native = ConnectorWorker(self.pool, regions, self.blocks_per_chunk, owners,
                                          rank=self.rank, share_offset=share)
        self.device = device

    def bind(self, meta: KVConnectorMetadata) -> None:
        if meta is self._bound:
            return
        if not isinstance(meta, KvtierConnectorMetadata):
            raise TypeError(f"kvtier connector: metadata of type {type(meta).__name__}")
        if self.native is None:
            raise RuntimeError("kvtier connector: metadata before register_kv_caches")
        self.native.bind(meta.payload)
        self._bound = meta
        self._names.update(meta.names)
        self._sending.update(meta.released)
        self._recving.update(meta.failed_loads)
        self._failed.update(meta.failed_loads)

    def clear(self) -> None:
        self._bound = None
        if self.native is not None:
            self.native.clear()

    def _stream(self) -> int | None:
        """The compute stream's raw handle on a GPU (torch's current stream on the KV caches'
        device, where vLLM's forward runs), else None."""
        if not self.device.is_cuda:
            return None
        import torch

        return int(torch.cuda.current_stream(self.device.index).cuda_stream)

    def before_compute(self) -> None:
        if self.native is not None and self._bound is not None:
            # Before the forward is enqueued: the loads wait for what the stream holds so far.
            stream = self._stream()
            with self.epoch.lock:
                self.native.before_compute(self._bound.epoch < self.epoch.value, stream)

    def after_compute(self) -> None:
        if self.native is not None and self._bound is not None:
            # After the forward was enqueued: the stores wait for it to write their blocks.
            stream = self._stream()
            with self.epoch.lock:
                self.native.after_compute(self._bound.epoch < self.epoch.value, stream)

    def _reap(self) -> None:
        if self.native is None:
            return
        output, done = self.native.take_output()
        if done:
            self._outputs.append(output)
        for _job, request, is_load, ok, nbytes, seconds, _blocks in done:
            if is_load:
                name = self._names.pop(request, None)
                if name is not None:
                    self._recving.add(name)
                    if not ok:
                        self._failed.add(name)
            if not ok:
                continue
            s = self._stats
            s.increase_counter(LOAD_BYTES if is_load else STORE_BYTES, nbytes)
            s.increase_counter(LOAD_TIME if is_load else STORE_TIME, seconds)
            s.observe_histogram(LOAD_SIZE if is_load else STORE_SIZE, nbytes)

    def transfer_results(self) -> KVConnectorTransferResults:
        self._reap()
        out = KVConnectorTransferResults(
            finished_sending=self._sending, finished_recving=self._recving,
            failed_recving=self._failed)
        self._sending, self._recving, self._failed = set(), set(), set()
        return out

    def take_worker_meta(self) -> KvtierWorkerMetadata | None:
        if not self._outputs:
            self._reap()
        outputs, self._outputs = self._outputs, []
        return KvtierWorkerMetadata(outputs) if outputs else None

    def stats(self) -> OffloadingConnectorStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, OffloadingConnectorStats()
        return out

    def drain(self) -> None:
        """Waits until every copy given to this worker is done (reported at the next reap)."""
        if self.native is not None:
            self.native.drain()

    def shutdown(self) -> None:
        self.drain()
