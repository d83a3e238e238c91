"""A small engine that drives `KvtierConnector` through vLLM's call sequence, with vLLM's real
`Request` (and its block hasher), `SchedulerOutput`, `NewRequestData`, `CachedRequestData`,
`KVConnectorOutput`, `KVTransferConfig` and `KVCacheConfig`.

What is faked (vLLM's real scheduler and model runner need a model and a GPU): the block
allocator (a free list, no GPU prefix cache), the scheduling policy (whole prefills, one decode
token per step, every request admitted when blocks allow) and the model, whose KV for a token is
a hash of the token prefix up to it, written into KV cache tensors (on the CPU, or on a GPU with
`device="cuda"`) shaped like FlashAttention's (2, num_blocks, block_size, heads, head_size) per
layer. So every loaded engine
block can be compared with what recompute gives, byte for byte.

The call order per step follows vLLM 0.33's scheduler and `KVConnectorModelRunnerMixin`:
scheduler: get_num_new_matched_tokens / update_state_after_alloc while scheduling,
build_connector_meta; worker: handle_preemptions, bind_connector_metadata, start_load_kv,
(forward), wait_for_save, get_transfer_results, get_kv_connector_stats,
build_connector_worker_meta, clear_connector_metadata; scheduler: request_finished for requests
that finished in this step's output, then update_connector_output, then the finished
sends (blocks freed) and receives (request ready, or recomputed when failed).
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

BLOCK = 16  # tokens per engine block
LAYERS = 2
HEADS = 2
HEAD = 16
DTYPE = torch.float16
ROW_BYTES = HEADS * HEAD * 2  # one token's K (or V) of one layer


def _vllm():
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    return KVTransferConfig, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor


def kv_cache_config(num_blocks: int):
    _, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor = _vllm()
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    tensors = [KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=page * num_blocks,
                             block_stride=page) for n in names]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)])


def vllm_config(extra: dict, engine_id: str | None = None, backend="uni", world_size=1, rank=0):
    KVTransferConfig = _vllm()[0]
    ktc = KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        engine_id=engine_id or f"kvtier-test-{uuid.uuid4().hex[:8]}",
    )
    return SimpleNamespace(
        kv_transfer_config=ktc,
        model_config=SimpleNamespace(model="test/kvtier-tiny", dtype=DTYPE),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(
            world_size=world_size, distributed_executor_backend=backend,
            tensor_parallel_size=world_size, pipeline_parallel_size=1, nnodes=1, rank=rank),
        kv_events_config=SimpleNamespace(enable_kv_cache_events=True),
    )


def prompt(tag: str, n: int, shared: list[int] | None = None) -> list[int]:
    """`shared` then tokens that depend on `tag` (a different tag gives a different suffix)."""
    head = list(shared or [])
    seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:4], "little")
    return head + [(seed + 7919 * i) % 30000 + 1 for i in range(n - len(head))]


def token_rows(tokens: list[int]) -> list[bytes]:
    """The 'model': per token position, its K/V bytes for every layer (a chained hash, so a
    position's bytes depend on the whole prefix up to it)."""
    out, h = [], b""
    for t in tokens:
        h = hashlib.sha256(h + t.to_bytes(4, "little")).digest()
        out.append(h)
    return out


def row_bytes(digest: bytes, layer: int, kv: int, rank: int = 0) -> bytes:
    """One token's K or V of one layer in one tensor-parallel rank's shard."""
    d = hashlib.sha256(digest + bytes([layer, kv, rank])).digest()
    return (d * (ROW_BYTES // len(d) + 1))[:ROW_BYTES]


class Blocks:
    """What vLLM's KVCacheBlocks gives the connector: the block ids per group."""

    def __init__(self, ids: list[int]):
        self._ids = ids

    def get_block_ids(self):
        return (list(self._ids),)


@dataclass
class Req:
    req: object  # vllm.v1.request.Request
    max_tokens: int
    blocks: list[int] = field(default_factory=list)
    state: str = "new"  # new, loading, ready, running, finished, released
    loaded_tokens: int = 0
    load_failed: bool = False
    delayed_free: bool = False
    first_step: bool = True


class WorkerHost:
    """One worker (vLLM's model runner with its KV cache tensors and worker-side connector):
    rank `rank` of `world`, writing its own shard of every token's KV."""

    def __init__(self, cfg, num_blocks: int, rank: int = 0, device: str = "cpu"):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvtier.vllm.connector import KvtierConnector

        kcc = kv_cache_config(num_blocks)
        self.rank = rank
        self.layer_names = list(kcc.kv_cache_groups[0].layer_names)
        self.connector = KvtierConnector(cfg, KVConnectorRole.WORKER, kcc)
        self.kv = {n: torch.zeros((2, num_blocks, BLOCK, HEADS, HEAD), dtype=DTYPE,
                                  device=device)
                   for n in self.layer_names}
        self.bytes_view = {n: t.view(torch.uint8) for n, t in self.kv.items()}
        self.connector.register_kv_caches(self.kv)

    def run_step(self, meta, work, finished_ids):
        """vLLM's model-runner sequence for one step; `work` is `(req_id, tokens, blocks, start,
        n)` per scheduled request, its loaded prefix checked first when `start > 0` on the
        request's first step."""
        w = self.connector
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for rid, tokens, blocks, start, n, check in work:
            if check:
                self.check_prefix(rid, tokens[:start], blocks)
            rows = token_rows(tokens[: start + n])
            for pos in range(start, start + n):
                self._write(blocks[pos // BLOCK], pos % BLOCK, rows[pos])
        w.wait_for_save()
        results = w.get_transfer_results(finished_ids)
        stats = w.get_kv_connector_stats()
        wmeta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        return (set(results.finished_sending), set(results.finished_recving),
                set(results.failed_recving), wmeta, stats)

    def _write(self, block: int, slot: int, digest: bytes) -> None:
        for layer, name in enumerate(self.layer_names):
            view = self.bytes_view[name]
            for kv in (0, 1):
                view[kv, block, slot].view(-1).copy_(torch.frombuffer(
                    bytearray(row_bytes(digest, layer, kv, self.rank)), dtype=torch.uint8))

    def check_prefix(self, rid: str, tokens: list[int], blocks: list[int]) -> None:
        """The KV of `tokens` in `blocks` is exactly what recompute would write."""
        rows = token_rows(tokens)
        for pos in range(len(tokens)):
            block, slot = blocks[pos // BLOCK], pos % BLOCK
            for layer, name in enumerate(self.layer_names):
                for kv in (0, 1):
                    got = bytes(self.bytes_view[name][kv, block, slot].reshape(-1).tolist())
                    if got != row_bytes(rows[pos], layer, kv, self.rank):
                        raise AssertionError(
                            f"request {rid}: loaded KV at token {pos} (block {block}, layer "
                            f"{layer}, {'KV'[kv]}, rank {self.rank}) differs from recompute")

    def close(self) -> None:
        self.connector.shutdown()


def _worker_process(pipe, extra, engine_id, num_blocks, rank, world, device):
    """A worker process: a WorkerHost serving run_step calls from the pipe."""
    cfg = vllm_config(extra, engine_id, backend="mp", world_size=world, rank=rank)
    host = WorkerHost(cfg, num_blocks, rank, device)
    pipe.send("ready")
    while True:
        msg = pipe.recv()
        if msg[0] == "close":
            host.close()
            pipe.send("closed")
            return
        try:
            pipe.send(("ok", host.run_step(*msg[1:])))
        except Exception as e:  # noqa: BLE001 - reported to the test process
            pipe.send(("error", f"{type(e).__name__}: {e}"))


class RemoteWorker:
    """A WorkerHost in its own process (vLLM's multi-process executor)."""

    def __init__(self, extra, engine_id, num_blocks, rank, world, device="cpu"):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_process,
                                args=(child, extra, engine_id, num_blocks, rank, world, device))
        self.proc.start()
        if not self.pipe.poll(300):
            raise AssertionError(f"worker {rank} did not start")
        assert self.pipe.recv() == "ready"

    def run_step(self, meta, work, finished_ids):
        self.pipe.send(("step", meta, work, finished_ids))
        status, value = self.pipe.recv()
        if status != "ok":
            raise AssertionError(f"worker process: {value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            self.pipe.send(("close",))
            self.pipe.poll(60) and self.pipe.recv()
            self.proc.join(60)


class Engine:
    def __init__(self, extra: dict, num_blocks: int = 1024, engine_id: str | None = None,
                 processes: int = 0, device: str = "cpu"):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        from kvtier.vllm.connector import KvtierConnector

        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.num_blocks = num_blocks
        engine_id = engine_id or f"kvtier-test-{uuid.uuid4().hex[:8]}"
        # vLLM makes the worker side first (with the KV caches), then the scheduler side.
        if processes:
            self.cfg = vllm_config(extra, engine_id, backend="mp", world_size=processes)
            self.hosts = [RemoteWorker(extra, engine_id, num_blocks, r, processes, device)
                          for r in range(processes)]
            self.worker = None
        else:
            self.cfg = vllm_config(extra, engine_id)
            self.hosts = [WorkerHost(self.cfg, num_blocks, device=device)]
            self.worker = self.hosts[0].connector
        self.sched = KvtierConnector(self.cfg, KVConnectorRole.SCHEDULER,
                                     kv_cache_config(num_blocks))
        self._sending_count: dict[str, int] = {}
        self._recving_count: dict[str, int] = {}
        self.free = list(range(num_blocks))
        self.reqs: dict[str, Req] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.finishing_now: list[str] = []
        self.step_no = 0
        self.worker_stats = []
        self.sched_stats = []
        self.events = []
        self.finished_sending_seen: list[str] = []

    # -- requests ------------------------------------------------------------------------------------
    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> Req:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        r = Request(req_id, list(tokens), SamplingParams(max_tokens=max_tokens), None,
                    block_hasher=self.hasher)
        rec = Req(r, max_tokens)
        self.reqs[req_id] = rec
        self.waiting.append(req_id)
        self.sched.on_new_request(r)
        return rec

    def _alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def _free_blocks(self, rec: Req) -> None:
        self.free.extend(rec.blocks)
        rec.blocks = []

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> None:
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import RequestStatus

        self.step_no += 1
        new_reqs, num_sched = [], {}
        cached = CachedRequestData.make_empty()
        still_waiting = []
        for rid in self.waiting:
            rec = self.reqs[rid]
            r = rec.req
            if rec.state == "loading":
                still_waiting.append(rid)
                continue
            if rec.state == "new":
                ext, is_async = self.sched.get_num_new_matched_tokens(r, 0)
                if ext is None:
                    still_waiting.append(rid)
                    continue
                assert is_async == (ext > 0)
                need = -(-(r.num_prompt_tokens + rec.max_tokens) // BLOCK)
                ids = self._alloc(need)
                if ids is None:
                    still_waiting.append(rid)
                    continue
                rec.blocks = ids
                self.sched.update_state_after_alloc(r, Blocks(ids), ext)
                if ext > 0:
                    rec.state = "loading"
                    rec.loaded_tokens = ext
                    r.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    still_waiting.append(rid)
                    continue
                r.num_computed_tokens = 0
            else:  # "ready": its load finished (or failed: recompute from 0)
                r.num_computed_tokens = 0 if rec.load_failed else rec.loaded_tokens
                # vLLM calls update_state_after_alloc again once the load is done.
                self.sched.update_state_after_alloc(r, Blocks([]), 0)
            r.status = RequestStatus.RUNNING
            rec.state = "running"
            n = r.num_prompt_tokens - r.num_computed_tokens
            new_reqs.append(NewRequestData.from_request(r, (list(rec.blocks),)))
            num_sched[rid] = n
            self.running.append(rid)
        self.waiting = still_waiting
        for rid in self.running:
            if rid in num_sched:
                continue
            r = self.reqs[rid].req
            cached.req_ids.append(rid)
            cached.new_block_ids.append(None)
            cached.num_computed_tokens.append(r.num_computed_tokens)
            cached.num_output_tokens.append(r.num_output_tokens)
            cached.new_token_ids.append([])
            num_sched[rid] = 1
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched, total_num_scheduled_tokens=sum(num_sched.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(self.finishing_now), free_encoder_mm_hashes=[])
        self.finishing_now = []
        meta = self.sched.build_connector_meta(so)
        so.kv_connector_metadata = meta

        # -- the workers (vLLM's model runners), then vLLM's output aggregation: a request is
        # done sending or receiving once every worker said so; a failure of any is a failure --
        work = []
        for rid, n in num_sched.items():
            rec = self.reqs[rid]
            start = rec.req.num_computed_tokens
            work.append((rid, list(rec.req.all_token_ids)[: start + n], list(rec.blocks), start,
                         n, rec.first_step and start > 0))
            rec.first_step = False
        sending, recving, failed, wmeta = set(), set(), set(), None
        for host in self.hosts:
            s_, r_, f_, wm, stats = host.run_step(meta, work, so.finished_req_ids)
            if stats is not None:
                self.worker_stats.append(stats)
            if wm is not None:
                wmeta = wm if wmeta is None else wmeta.aggregate(wm)
            failed |= f_
            for rid in s_:
                self._sending_count[rid] = self._sending_count.get(rid, 0) + 1
            for rid in r_:
                self._recving_count[rid] = self._recving_count.get(rid, 0) + 1
        world = len(self.hosts)
        for counts, done in ((self._sending_count, sending), (self._recving_count, recving)):
            for rid in [r for r, c in counts.items() if c == world]:
                done.add(rid)
                del counts[rid]
        results = SimpleNamespace(finished_sending=sending, finished_recving=recving,
                                  failed_recving=failed & recving)
        self._failed_pending = getattr(self, "_failed_pending", set()) | (failed - recving)
        results.failed_recving |= self._failed_pending & recving
        self._failed_pending -= recving

        # -- the scheduler takes the output --
        finished = []
        for rid, n in num_sched.items():
            r = self.reqs[rid].req
            r.num_computed_tokens += n
            r.append_output_token_ids(int.from_bytes(
                hashlib.sha256(f"{rid}:{r.num_tokens}".encode()).digest()[:2], "little") + 1)
            if r.num_output_tokens >= self.reqs[rid].max_tokens:
                finished.append(rid)
        for rid in finished:
            rec = self.reqs[rid]
            rec.req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self.running.remove(rid)
            delay, _ = self.sched.request_finished(rec.req, list(rec.blocks))
            rec.delayed_free = delay
            rec.state = "finished"
            self.finishing_now.append(rid)
            if not delay:
                self._free_blocks(rec)
                rec.state = "released"
        out = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving, kv_connector_worker_meta=wmeta)
        self.sched.update_connector_output(out)
        for rid in results.finished_recving:
            rec = self.reqs[rid]
            assert rec.state == "loading", f"{rid} finished receiving in state {rec.state}"
            rec.state = "ready"
            rec.load_failed = rid in results.failed_recving
        for rid in results.finished_sending:
            rec = self.reqs[rid]
            assert rec.state == "finished" and rec.delayed_free, f"{rid}: {rec.state}"
            self._free_blocks(rec)
            rec.state = "released"
            self.finished_sending_seen.append(rid)
        sstats = self.sched.get_kv_connector_stats()
        if sstats is not None:
            self.sched_stats.append(sstats)
        self.events.extend(self.sched.take_events())

    def run(self, steps: int = 500, deadline_s: float = 120.0) -> None:
        """Steps until every request was released; fails once both `steps` steps and
        `deadline_s` seconds have passed. The workers' copies run on their own threads (in other
        processes with `processes`), which a busy machine may hold back for longer than `steps`
        quick steps take: past `steps`, each step first yields the CPU for a millisecond."""
        import time

        deadline = time.monotonic() + deadline_s
        done = 0
        while not all(rec.state == "released" for rec in self.reqs.values()):
            if done >= steps:
                if time.monotonic() > deadline:
                    states = {rid: rec.state for rid, rec in self.reqs.items()
                              if rec.state != "released"}
                    raise AssertionError(
                        f"requests not released after {done} steps and {deadline_s} s: {states}")
                time.sleep(0.001)
            self.step()
            done += 1

    def settle(self) -> None:
        """Every request released, every tier job reported, and one more step for what that
        released."""
        self.run()
        self.sched.native_scheduler.drain_tiers()
        self.step()

    def metrics(self) -> dict:
        import json

        return json.loads(self.sched.native_scheduler.metrics_json())

    def close(self) -> None:
        for host in self.hosts:
            host.close()
        self.sched.shutdown()
