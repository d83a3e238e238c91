"""The engine-neutral half of kvtier's Python tiers: a native tier over an engine's host KV
buffer, with job bookkeeping, a bounded retry queue for jobs the tier could not take yet, and
counters. `kvtier.vllm.tiers` wraps it in vLLM's `SecondaryTierManager` interface.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._kvtier import Tier

__all__ = ["PrimaryBuffer", "Finished", "TierCore", "PENDING_JOBS_MAX"]

logger = logging.getLogger(__name__)

# Jobs refused as busy by the native tier wait here and are submitted again at the next poll;
# beyond this many, a new job fails at once (the engine recomputes or keeps the chunk in host
# memory) instead of growing a queue without bound.
PENDING_JOBS_MAX = 4096


@dataclass(frozen=True)
class PrimaryBuffer:
    """An engine's host KV buffer as the native tiers take it: rows (slots) of `slot_bytes`."""

    owner: memoryview
    address: int
    slot_bytes: int
    slot_count: int

    @classmethod
    def of(cls, view: memoryview) -> "PrimaryBuffer":
        """The buffer behind vLLM's `primary_kv_view` (shape (num_chunks, row_bytes), C order,
        writable). No byte is copied: the tiers read and write it in place."""
        if not isinstance(view, memoryview):
            view = memoryview(view)
        if view.readonly:
            raise ValueError("primary KV view is read-only; loads must write into it")
        if not view.c_contiguous:
            raise ValueError("primary KV view is not C-contiguous")
        if view.ndim < 1 or view.shape[0] == 0:
            raise ValueError(f"primary KV view has shape {view.shape}: expected (slots, bytes)")
        slot_count = view.shape[0]
        slot_bytes = view.strides[0]
        flat = view.cast("B") if (view.ndim != 1 or view.format != "B") else view
        if flat.nbytes < slot_count * slot_bytes:
            raise ValueError(
                f"primary KV view holds {flat.nbytes} bytes, less than {slot_count} slots of "
                f"{slot_bytes}"
            )
        address = ctypes.addressof(ctypes.c_char.from_buffer(flat))
        return cls(owner=flat, address=address, slot_bytes=slot_bytes, slot_count=slot_count)


@dataclass(frozen=True)
class Finished:
    """One finished job: which keys failed, and what it moved."""

    job_id: int
    is_load: bool
    failed: tuple[int, ...]  # positions in the job's key list
    keys: tuple[bytes, ...]
    seconds: float
    bytes: int

    @property
    def success(self) -> bool:
        return not self.failed

    def arrived(self) -> list[bytes]:
        """The keys that transferred (all of them on success)."""
        if not self.failed:
            return list(self.keys)
        failed = set(self.failed)
        return [k for i, k in enumerate(self.keys) if i not in failed]


@dataclass
class _Job:
    op: str
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    request: int | None
    submitted: float = field(default_factory=time.monotonic)


class TierCore:
    """A native tier plus the bookkeeping every engine binding needs."""

    def __init__(self, tier: Tier, buffer: PrimaryBuffer):
        self.tier = tier
        self.buffer = buffer
        self._jobs: dict[int, _Job] = {}
        self._pending: deque[int] = deque()
        self._failed_now: list[Finished] = []
        self._request_ids: dict[str, int] = {}
        self._next_request = 1
        # Counters since the last `take_counters`.
        self.counters: dict[str, float] = {}
        self._drain_timeout_logged = False

    # -- requests -----------------------------------------------------------------------
    def request_number(self, req_id: str) -> int:
        """A stable number for an engine's string request id (until `request_finished`)."""
        n = self._request_ids.get(req_id)
        if n is None:
            n = self._next_request
            self._next_request += 1
            self._request_ids[req_id] = n
        return n

    def request_finished(self, req_id: str) -> None:
        n = self._request_ids.pop(req_id, None)
        if n is not None:
            self.tier.on_request_finished(n)

    # -- lookups --------------------------------------------------------------------------
    def lookup(self, key: bytes) -> int:
        """0 miss, 1 hit, 2 retry."""
        return self.tier.lookup(key)

    # -- jobs -------------------------------------------------------------------------------
    def submit(
        self,
        job_id: int,
        op: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        req_id: str | None = None,
    ) -> None:
        """Takes a job; it finishes exactly once, in a later `poll`."""
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")
        if len(keys) != len(slots):
            raise ValueError(f"job {job_id}: {len(keys)} keys but {len(slots)} slots")
        job = _Job(
            op=op,
            keys=tuple(keys),
            slots=tuple(int(s) for s in slots),
            request=self.request_number(req_id) if req_id is not None else None,
        )
        for s in job.slots:
            if not 0 <= s < self.buffer.slot_count:
                raise ValueError(
                    f"job {job_id}: slot {s} outside the primary buffer's {self.buffer.slot_count}"
                )
        self._jobs[job_id] = job
        if self._pending or not self._try_submit(job_id, job):
            if len(self._pending) >= PENDING_JOBS_MAX:
                self._fail_now(job_id, "pending queue full")
            else:
                self._pending.append(job_id)

    def _try_submit(self, job_id: int, job: _Job) -> bool:
        return self.tier.submit(job_id, job.op, list(job.keys), list(job.slots), job.request)

    def _fail_now(self, job_id: int, why: str) -> None:
        job = self._jobs.pop(job_id)
        self._count("jobs_refused", 1)
        self._failed_now.append(
            Finished(job_id, job.op == "load", tuple(range(len(job.keys))), job.keys, 0.0, 0)
        )

    def poll(self) -> list[Finished]:
        """Jobs finished since the last call (never blocks); retries jobs that waited."""
        while self._pending:
            job_id = self._pending[0]
            if not self._try_submit(job_id, self._jobs[job_id]):
                break
            self._pending.popleft()
        out, self._failed_now = self._failed_now, []
        now = time.monotonic()
        for job_id, failed in self.tier.poll():
            job = self._jobs.pop(job_id, None)
            if job is None:
                continue
            moved = (len(job.keys) - len(failed)) * self.buffer.slot_bytes
            seconds = now - job.submitted
            direction = "load" if job.op == "load" else "store"
            self._count(f"{direction}_jobs", 1)
            self._count(f"{direction}_bytes", moved)
            self._count(f"{direction}_seconds", seconds)
            self._count(f"{direction}_chunks_failed", len(failed))
            out.append(Finished(job_id, job.op == "load", tuple(failed), job.keys, seconds, moved))
        return out

    def in_flight(self) -> int:
        return len(self._jobs)

    def drain(self) -> bool:
        """Waits until every job taken has finished (results wait for `poll`); each wait on the
        native tier is bounded by its drain deadline. Returns False when the tier gave up with
        jobs still in flight (a disk that stops answering): they stay taken and a later `poll`
        reports them (jobs still waiting here are submitted then). Counted in `drain_timeouts`,
        logged once."""
        while self._pending:
            if not self.tier.drain():
                return self._drain_timed_out()
            while self._pending and self._try_submit(self._pending[0], self._jobs[self._pending[0]]):
                self._pending.popleft()
        if not self.tier.drain():
            return self._drain_timed_out()
        return True

    def _drain_timed_out(self) -> bool:
        self._count("drain_timeouts", 1)
        if not self._drain_timeout_logged:
            self._drain_timeout_logged = True
            logger.warning(
                "kvtier: drain gave up at the tier's deadline with %d jobs in flight and %d "
                "waiting; they finish later (logged once, counted in drain_timeouts)",
                len(self._jobs) - len(self._pending),
                len(self._pending),
            )
        return False

    def shutdown(self) -> None:
        # Jobs still waiting were never handed to the tier: they fail.
        while self._pending:
            self._fail_now(self._pending.popleft(), "shut down")
        self.tier.shutdown()
        # The tier's threads are gone: give the engine its buffer back (vLLM unmaps it next).
        self.buffer.owner.release()

    def _count(self, name: str, value: float) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    def take_counters(self) -> dict[str, float]:
        out, self.counters = self.counters, {}
        return out
