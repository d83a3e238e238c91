"""kvtier's tiers as vLLM secondary tiers (`SecondaryTierManager`, vllm/v1/kv_offload/tiering).

In `kv_connector_extra_config` of vLLM's OffloadingConnector with `"spec_name":
"TieringOffloadingSpec"`:

    "secondary_tiers": [
        {"type": "KvtierFsTier", "module_path": "kvtier.vllm.tiers",
         "root_dir": "/mnt/nvme/kv", "capacity_bytes": "200GiB"},
        {"type": "KvtierP2pTier", "module_path": "kvtier.vllm.tiers",
         "listen": "10.0.0.5:7470", "peers": ["10.0.0.6:7470"], "secret": "..."}
    ]

Every setting is in `kvtier.config`. The tiers read and write vLLM's primary KV buffer in place
(the memoryview vLLM hands them); a chunk is loaded only after its checksum verified, and a
failed or partial load reports the keys that did arrive (vLLM recomputes the rest).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    TIER_LABEL,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from .. import config as kvconfig
from .._kvtier import Tier, offload_key_to_chunk_key
from ..tiers import PrimaryBuffer, TierCore

__all__ = ["KvtierFsTier", "KvtierP2pTier"]

logger = logging.getLogger(__name__)

_LOOKUP = (LookupResult.MISS, LookupResult.HIT, LookupResult.RETRY)

# kvtier's own metrics, beside vLLM's per-tier read/write metrics (which vLLM fills from the
# transfer_time and transfer_bytes of each JobResult).
_COUNTERS = {
    "kvtier:store_bytes": ("store_bytes", "Bytes kvtier stored into the tier."),
    "kvtier:store_seconds": ("store_seconds", "Seconds kvtier store jobs took, summed."),
    "kvtier:load_bytes": ("load_bytes", "Bytes kvtier loaded and verified from the tier."),
    "kvtier:load_seconds": ("load_seconds", "Seconds kvtier load jobs took, summed."),
    "kvtier:load_chunks_failed": (
        "load_chunks_failed",
        "Chunks a load could not deliver (missing, evicted, corrupt): recomputed by vLLM.",
    ),
    "kvtier:store_chunks_failed": ("store_chunks_failed", "Chunks a store could not keep."),
    "kvtier:jobs_refused": ("jobs_refused", "Jobs failed at once because the queue was full."),
}


def _blocks_per_chunk(spec: Any) -> int:
    """Engine blocks per chunk (1 where the spec does not say)."""
    cache = getattr(getattr(spec, "config", None), "cache", None)
    return max(1, int(getattr(cache, "blocks_per_chunk", 1) or 1))


def _namespace(spec: Any, slot_bytes: int) -> dict[str, Any]:
    """What must match for two instances' chunks to be interchangeable."""
    cfg = getattr(spec, "config", None)
    model = getattr(cfg, "model", None)
    cache = getattr(cfg, "cache", None)
    par = getattr(cfg, "parallel", None)
    tokens = 0
    if cache is not None:
        tokens = int(cache.tokens_per_hash) * int(cache.blocks_per_chunk)
    layout = "unknown"
    if par is not None:
        layout = (
            f"tp{par.tp_size}-pp{par.pp_size}-pcp{par.pcp_size}-dcp{par.dcp_size}"
            f"-agnostic{int(bool(par.is_parallelism_agnostic))}"
        )
    kv_layout = getattr(cfg, "kv_cache_layout", None)
    return {
        "model": str(getattr(model, "name", "") or "unknown-model"),
        "dtype": str(getattr(model, "dtype", "") or "unknown-dtype"),
        "tokens_per_chunk": tokens or 1,
        "parallel_layout": f"{layout}-{kv_layout}-row{slot_bytes}",
    }


class _KvtierTier(SecondaryTierManager):
    """What both kvtier tiers share: job and request mapping, events, metrics."""

    _kind: ClassVar[str] = ""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        enable_kv_events: bool = False,
        **config: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        buffer = PrimaryBuffer.of(primary_kv_view)
        tier = self._start(config, offloading_spec, buffer)
        self._core = TierCore(tier, buffer)
        self._events_on = bool(enable_kv_events)
        self._events: list[OffloadingEvent] = []
        # With events on: the offload key of each chunk this instance stored, by chunk key, so an
        # eviction (reported by chunk key) can be published under vLLM's key. Chunks found on
        # disk at start were never announced by this instance, so their removal is not either.
        self._stored: dict[tuple[int, int], bytes] = {}

    def _start(self, config: dict[str, Any], spec: Any, buffer: PrimaryBuffer) -> Tier:
        """Checks the tier's settings and starts its native tier over `buffer`."""
        raise NotImplementedError

    # -- lookups and recency -----------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self._core.lookup(key)]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._core.tier.touch(list(keys))

    # -- jobs --------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._core.submit(
            job_metadata.job_id,
            "store",
            list(job_metadata.keys),
            job_metadata.chunk_ids.tolist(),
            job_metadata.req_context.req_id,
        )

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._core.submit(
            job_metadata.job_id,
            "load",
            list(job_metadata.keys),
            job_metadata.chunk_ids.tolist(),
            job_metadata.req_context.req_id,
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for f in self._core.poll():
            successful = f.arrived() if f.failed and f.is_load else None
            if not f.is_load and self._events_on:
                stored = f.arrived()
                for k in stored:
                    self._stored[offload_key_to_chunk_key(k)] = k
                if stored:
                    self._events.append(
                        OffloadingEvent(keys=stored, medium=self.medium, removed=False)
                    )
            results.append(
                JobResult(
                    job_id=f.job_id,
                    success=f.success,
                    successful_keys=successful,
                    transfer_time=f.seconds,
                    transfer_bytes=f.bytes,
                )
            )
        return results

    def has_pending_work(self) -> bool:
        return self._core.in_flight() > 0

    def drain_jobs(self) -> None:
        self._core.drain()

    # -- requests ------------------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._core.request_finished(req_context.req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events_on:
            gone, lost = self._core.tier.take_removed()
            removed = [k for k in (self._stored.pop(g, None) for g in gone) if k is not None]
            if removed:
                self._events.append(
                    OffloadingEvent(keys=removed, medium=self.medium, removed=True)
                )
            if lost:
                logger.warning("kvtier: %d chunk removals went unreported (too many waited)", lost)
        out, self._events = self._events, []
        return out

    def shutdown(self) -> None:
        self._core.shutdown()

    # -- metrics ---------------------------------------------------------------------------------
    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=(TIER_LABEL,))
            for name, (_, doc) in _COUNTERS.items()
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        counters = self._core.take_counters()
        if not counters:
            return None
        stats = OffloadingConnectorStats()
        types, values = stats.metric_sections()
        label = (f"kvtier-{self._kind}",)
        for name, (key, _) in _COUNTERS.items():
            if key in counters:
                types[name] = "counter"
                values[name] = {label: counters[key]}
        return stats

    def native_stats(self) -> dict[str, Any]:
        """The native tier's own counters (chunks, bytes, evictions, failures)."""
        return self._core.tier.stats()


class KvtierFsTier(_KvtierTier):
    """kvtier's disk tier (tier-fs: segment files, io_uring, O_DIRECT, verified loads)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    _kind = "fs"

    def _start(self, config: dict[str, Any], spec: Any, buffer: PrimaryBuffer) -> Tier:
        settings, warnings = kvconfig.fs_settings(config)
        for w in warnings:
            logger.warning("%s", w)
        settings.update(_namespace(spec, buffer.slot_bytes))
        tier = Tier.fs(buffer.owner, buffer.address, buffer.slot_bytes, buffer.slot_count, settings)
        logger.info(
            "kvtier fs tier in %s: %d slots of %d bytes, capacity %.1f GiB",
            tier.namespace_dir,
            buffer.slot_count,
            buffer.slot_bytes,
            settings["capacity_bytes"] / 2**30,
        )
        return tier


class KvtierP2pTier(_KvtierTier):
    """kvtier's peer tier (tier-p2p: chunks fetched from other instances, verified)."""

    medium: ClassVar[Medium] = Medium.CPU
    _kind = "p2p"

    def _start(self, config: dict[str, Any], spec: Any, buffer: PrimaryBuffer) -> Tier:
        settings, _ = kvconfig.p2p_settings(config)
        ns = _namespace(spec, buffer.slot_bytes)
        settings.update(ns)
        settings["block_bytes"] = buffer.slot_bytes // _blocks_per_chunk(spec)
        settings["hash_seed"] = 0
        tier = Tier.p2p(buffer.owner, buffer.address, buffer.slot_bytes, buffer.slot_count, settings)
        logger.info("kvtier p2p tier listening on %s, peers %s", tier.address, settings["peers"])
        return tier

    @property
    def address(self) -> str:
        """The address this instance serves peers on ("host:port")."""
        return self._core.tier.address
