"""kvtier.tiers.TierCore over a real native fs tier and a plain bytearray buffer, without vLLM:
jobs finish exactly once, bytes come back as stored, a missing key fails only itself, and bad
input is refused with its reason."""

from __future__ import annotations

import hashlib
import time

import pytest

from kvtier import Tier
from kvtier.tiers import PrimaryBuffer, TierCore

SLOT = 8192
SLOTS = 16


def make_core(tmp_path):
    buf = bytearray(SLOT * SLOTS)
    view = memoryview(buf).cast("B", (SLOTS, SLOT))
    pb = PrimaryBuffer.of(view)
    settings = {
        "root_dir": str(tmp_path),
        "capacity_bytes": 32 << 20,
        "model": "m",
        "dtype": "bf16",
        "tokens_per_chunk": 16,
        "parallel_layout": "tp1",
    }
    tier = Tier.fs(pb.owner, pb.address, pb.slot_bytes, pb.slot_count, settings)
    return TierCore(tier, pb), buf


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() + (0).to_bytes(4, "big")


def content(i: int) -> bytes:
    return hashlib.sha256(b"c%d" % i).digest() * (SLOT // 32)


def wait(core: TierCore, n: int):
    got = []
    deadline = time.monotonic() + 30
    while len(got) < n:
        got += core.poll()
        assert time.monotonic() < deadline, "jobs did not finish"
        time.sleep(0.001)
    return got


def test_store_then_load_moves_the_exact_bytes(tmp_path):
    core, buf = make_core(tmp_path)
    for s in range(4):
        buf[s * SLOT : (s + 1) * SLOT] = content(s)
    core.submit(1, "store", [key(s) for s in range(4)], [0, 1, 2, 3], "r")
    (done,) = wait(core, 1)
    assert done.job_id == 1 and done.success and done.bytes == 4 * SLOT
    assert all(core.lookup(key(s)) == 1 for s in range(4))
    assert core.lookup(key(99)) == 0
    buf[:] = bytes(len(buf))
    # Load key 2 and a missing key into other slots: the missing one fails alone.
    core.submit(2, "load", [key(2), key(99)], [10, 11], "r")
    (done,) = wait(core, 1)
    assert done.is_load and done.failed == (1,)
    assert bytes(buf[10 * SLOT : 11 * SLOT]) == content(2)
    assert core.poll() == []  # exactly once
    core.request_finished("r")
    core.shutdown()


def test_bad_jobs_are_refused_with_the_reason(tmp_path):
    core, _ = make_core(tmp_path)
    with pytest.raises(ValueError, match="outside the primary buffer"):
        core.submit(1, "store", [key(0)], [SLOTS], None)
    with pytest.raises(ValueError, match="2 keys but 1 slots"):
        core.submit(2, "store", [key(0), key(1)], [0], None)
    with pytest.raises(ValueError, match="expected \"store\" or \"load\""):
        core.tier.submit(3, "copy", [key(0)], [0], None)
    core.submit(4, "store", [key(0)], [0], None)
    with pytest.raises(ValueError, match="already in flight"):
        core.submit(4, "store", [key(1)], [1], None)
    wait(core, 1)
    core.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        core.tier.submit(5, "store", [key(0)], [0], None)


def test_buffer_checks():
    with pytest.raises(ValueError, match="read-only"):
        PrimaryBuffer.of(memoryview(bytes(4096)))
    view = memoryview(bytearray(4 * 4096)).cast("B", (4, 4096))
    pb = PrimaryBuffer.of(view)
    assert (pb.slot_count, pb.slot_bytes) == (4, 4096)


def test_rust_warnings_reach_python_logging_once_per_window(caplog):
    """tier-p2p logs a warning through `tracing` when a peer cannot be reached; kvtier hands it
    to Python's logging (logger kvtier.tier_p2p), and identical repeats within the window are
    dropped."""
    import logging
    import socket

    # A port nothing listens on.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    caplog.set_level(logging.DEBUG)
    buf = bytearray(4096 * 4)
    pb = PrimaryBuffer.of(memoryview(buf).cast("B", (4, 4096)))
    tier = Tier.p2p(
        pb.owner, pb.address, pb.slot_bytes, pb.slot_count,
        {"model": "m", "dtype": "u8", "tokens_per_chunk": 1, "parallel_layout": "tp1",
         "block_bytes": 4096, "hash_seed": 0, "peers": [dead],
         "lookup_deadline_s": 0.05},
    )
    core = TierCore(tier, pb)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for i in range(8):
            core.lookup(key(i))
        core.poll()  # the peer worker asks its peers at each poll
        if any(r.name.startswith("kvtier.tier_p2p") for r in caplog.records):
            break
        time.sleep(0.02)
    core.shutdown()
    rust = [r for r in caplog.records if r.name.startswith("kvtier.tier_p2p")]
    assert rust, [(r.name, r.getMessage()) for r in caplog.records]
    assert all(r.levelno == logging.WARNING for r in rust)
    assert any("marked down" in r.getMessage() and dead in r.getMessage() for r in rust)
    texts = [r.getMessage() for r in rust]
    assert len(texts) == len(set(texts)), f"repeats were not suppressed: {texts}"


class _HungDrain:
    """The real native tier, except that `drain` answers as one whose deadline passed with jobs
    still in flight (a disk that stops answering)."""

    def __init__(self, tier):
        self._tier = tier
        self.drains = 0

    def drain(self):
        self.drains += 1
        return False

    def __getattr__(self, name):
        return getattr(self._tier, name)


def test_drain_is_bounded_and_says_when_the_tier_gave_up(tmp_path, caplog):
    # Issue 18 item 5: TierCore.drain waited on an unbounded native drain and returned nothing.
    # The native drain now stops at the tier's deadline and says so; TierCore.drain returns
    # False, counts it, logs once, and the job is still reported by a later poll.
    core, buf = make_core(tmp_path)
    assert core.drain() is True, "nothing in flight: a drain completes"
    buf[0:SLOT] = content(0)
    core.submit(1, "store", [key(0)], [0], "r")
    hung = _HungDrain(core.tier)
    core.tier = hung
    with caplog.at_level("WARNING", logger="kvtier.tiers"):
        assert core.drain() is False
        assert core.drain() is False
    assert hung.drains == 2, "one bounded native wait per drain, no retry loop"
    assert core.take_counters().get("drain_timeouts") == 2
    warned = [r for r in caplog.records if "drain gave up" in r.getMessage()]
    assert len(warned) == 1, warned
    core.tier = hung._tier
    (done,) = wait(core, 1)
    assert done.job_id == 1 and done.success
    assert core.tier.stats()["drain_timeouts"] == 0
