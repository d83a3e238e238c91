"""kvtier's CUDA worker path: `kvtier.kvcache` (regions and device of the KV cache tensors),
`ConnectorWorker.cuda` (tier-gpu's CUDA engine behind the native worker) and `KvtierConnector`
with KV caches on a GPU.

Without a GPU (here, and in CI): the regions of CUDA-like tensors (stand-ins with a device,
shape, strides and a device address), the refusal of mixed devices and of other devices, the
error naming the missing CUDA driver when a CUDA worker is made (the package itself imports
without one), and the native store-then-load round trip on the CPU path, the same code the GPU
variant runs.

With a GPU (`torch.cuda.is_available()`): the native round trip over torch CUDA tensors (store
after the "forward" wrote the blocks on torch's current stream, every GPU block zeroed, load,
bytes compared with the originals; ordered against a slow kernel on the compute stream), and
vLLM-style runs of `KvtierConnector` with CUDA KV caches (`connector_driver`, needs vLLM).

Without a GPU, those tests are skipped with the reason and the sentinel
`test_cuda_connector_tests_ran` prints "CUDA connector tests NOT RUN" and why
(`KVTIER_REQUIRE_CUDA=1` makes them fail instead, for a GPU session).
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import VLLM_ERROR, need_vllm
from kvtier._kvtier import (
    ConnectorScheduler,
    ConnectorWorker,
    HostPool,
    block_hashes_to_u128,
    cuda_unavailable_reason,
    resolve_connector_config,
)
from kvtier.kvcache import KvDevice, kv_cache_regions


def _cuda_error() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"torch does not import ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return (f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda}); kvtier's driver check: {cuda_unavailable_reason()}")
    reason = cuda_unavailable_reason()
    if reason is not None:
        return f"torch sees a GPU, but kvtier's driver check says: {reason}"
    return None


CUDA_ERROR = _cuda_error()


def need_cuda():
    if CUDA_ERROR is None:
        return
    why = f"no usable CUDA GPU here ({CUDA_ERROR})"
    if os.environ.get("KVTIER_REQUIRE_CUDA") == "1":
        pytest.fail(why)
    pytest.skip(why)


def test_cuda_connector_tests_ran():
    """The sentinel: says plainly whether the GPU tests of this file ran here (and, on a GPU
    without vLLM, that the one through vLLM's call order did not)."""
    if CUDA_ERROR is not None:
        print(f"CUDA connector tests NOT RUN: {CUDA_ERROR}")
    elif VLLM_ERROR is not None:
        print(f"CUDA connector test through vLLM's call order NOT RUN: {VLLM_ERROR}")
    need_cuda()


# -- stand-in tensors --------------------------------------------------------------------------


class FakeDevice:
    def __init__(self, type_: str, index: int | None = None):
        self.type, self.index = type_, index

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class FakeTensor:
    """What kv_cache_regions reads of a torch tensor: device, shape, strides, element size and
    address (a device address for a CUDA tensor)."""

    def __init__(self, shape, ptr, device, element_size=2, strides=None):
        self.shape = tuple(shape)
        if strides is None:
            strides, inner = [], 1
            for d in reversed(self.shape):
                strides.insert(0, inner)
                inner *= d
        self._strides = tuple(strides)
        self._ptr, self._size, self.device = ptr, element_size, device

    def stride(self):
        return self._strides

    def element_size(self):
        return self._size

    def data_ptr(self):
        return self._ptr


NB, BLOCK, HEADS, HEAD = 8, 16, 2, 16
HALF = BLOCK * HEADS * HEAD * 2  # one K (or V) half of one engine block, fp16
BASE = 0x7F00_0000_0000  # a device address, as data_ptr() gives it for a CUDA tensor


def _layers(device, n=2, shape=(2, NB, BLOCK, HEADS, HEAD)):
    size = 2
    for d in shape:
        size *= d
    return {f"layer.{i}": FakeTensor(shape, BASE + i * size, device) for i in range(n)}


def test_regions_of_cuda_tensors_are_device_addresses_from_strides():
    kv = _layers(FakeDevice("cuda", 1))
    regions, device = kv_cache_regions(kv, list(kv), NB)
    assert device == KvDevice("cuda", 1) and device.is_cuda and str(device) == "cuda:1"
    layer = 2 * NB * HALF
    assert regions == [
        (BASE, NB, HALF, HALF, 0),
        (BASE + NB * HALF, NB, HALF, HALF, 0),
        (BASE + layer, NB, HALF, HALF, 0),
        (BASE + layer + NB * HALF, NB, HALF, HALF, 0),
    ]
    # Blocks first, K and V inside a block (one region per layer), with padding between blocks.
    padded = FakeTensor((NB, 2, BLOCK, HEADS, HEAD), BASE, FakeDevice("cuda", 0),
                        strides=(2 * BLOCK * HEADS * HEAD + 64, BLOCK * HEADS * HEAD,
                                 HEADS * HEAD, HEAD, 1))
    regions, device = kv_cache_regions({"l": padded}, ["l"], NB)
    assert device == KvDevice("cuda", 0)
    assert regions == [(BASE, NB, 2 * HALF, 2 * HALF + 128, 0)]


def test_kv_caches_on_several_devices_are_refused_naming_both():
    kv = _layers(FakeDevice("cuda", 0))
    kv["layer.1"].device = FakeDevice("cuda", 1)
    with pytest.raises(ValueError, match=r"more than one device \(layer layer.0 on cuda:0, "
                                         r"layer layer.1 on cuda:1\)"):
        kv_cache_regions(kv, list(kv), NB)
    kv["layer.1"].device = FakeDevice("cpu")
    with pytest.raises(ValueError, match="layer layer.1 on cpu"):
        kv_cache_regions(kv, list(kv), NB)


def test_kv_caches_on_other_devices_are_refused_naming_the_device():
    kv = _layers(FakeDevice("xpu", 0))
    with pytest.raises(ValueError, match=r"layer.0's KV cache is on xpu:0; .*CUDA GPU"):
        kv_cache_regions(kv, list(kv), NB)


def test_cuda_worker_without_a_driver_is_an_error_naming_it():
    """The package imported (this module did) without a CUDA driver; only making a CUDA worker
    asks for one, and the error says which device needed it and what was missing."""
    reason = cuda_unavailable_reason()
    if reason is None:
        print("NOTE: a CUDA driver is usable here: the missing-driver error is NOT CHECKED")
        return
    assert "CUDA driver" in reason, reason
    kv = _layers(FakeDevice("cuda", 0))
    regions, device = kv_cache_regions(kv, list(kv), NB)
    pool = HostPool(2 * 2 * HALF, 4)  # one block per chunk, 2 layers x K/V
    with pytest.raises(RuntimeError, match=r"KV caches on CUDA device 0 need the CUDA driver, "
                                           r"which is not usable here: the CUDA driver library"):
        ConnectorWorker.cuda(pool, regions, 1, list(kv.values()), device.index)
    # A bad layout is still a ValueError, named before the driver is asked for.
    with pytest.raises(ValueError, match="bytes per chunk"):
        ConnectorWorker.cuda(pool, regions[:2], 1, [], 0)


def test_worker_side_makes_the_cuda_worker_and_passes_torchs_current_stream(monkeypatch):
    """The connector's worker side with CUDA KV caches (stand-ins on cuda:1): it makes the
    native worker with `ConnectorWorker.cuda` on device 1, and hands it the raw handle of torch's
    current stream on that device before and after the compute (a recording stand-in for the
    native worker and for torch's stream, so this runs without a GPU)."""
    need_vllm()
    import torch

    import kvtier.vllm.connector as c
    from connector_driver import kv_cache_config

    calls, made = [], {}

    class Native:
        is_cuda = True

        def bind(self, payload):
            calls.append(("bind", payload))

        def before_compute(self, stale, stream):
            calls.append(("before", stale, stream))

        def after_compute(self, stale, stream):
            calls.append(("after", stale, stream))

        def drain(self):
            return True

    class Worker:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the host worker was made for CUDA KV caches")

        @staticmethod
        def cuda(pool, regions, blocks_per_chunk, owners, device, rank=0, share_offset=None):
            made.update(device=device, regions=regions, owners=len(owners), rank=rank)
            return Native()

    monkeypatch.setattr(c, "ConnectorWorker", Worker)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: type("S", (), {"cuda_stream": 0xA000 + device})())
    kcc = kv_cache_config(NB)
    names = list(kcc.kv_cache_groups[0].layer_names)
    kv = _layers(FakeDevice("cuda", 1), n=len(names))
    kv = {n: t for n, t in zip(names, kv.values())}
    side = c._WorkerSide(HostPool(2 * 2 * HALF * len(names), 4), {"blocks_per_chunk": 1}, kcc)
    side.register(kv)
    assert made["device"] == 1 and made["owners"] == len(names), made
    assert made["regions"] == kv_cache_regions(kv, names, NB)[0]
    side.bind(c.KvtierConnectorMetadata(payload=b"meta"))
    side.before_compute()
    side.after_compute()
    assert calls == [("bind", b"meta"), ("before", False, 0xA001), ("after", False, 0xA001)], calls


# -- the native round trip, on the CPU here and on a GPU there ----------------------------------


def _torch_or_skip():
    try:
        import torch

        return torch
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torch does not import ({type(e).__name__}: {e})")


class Native:
    """kvtier's native scheduler side and a worker over torch KV cache tensors on `device`,
    driven in vLLM's order without vLLM (the device machine has torch but no vLLM)."""

    LAYERS = 2

    def __init__(self, device: str, slots: int = 16):
        torch = self.torch = _torch_or_skip()
        self.kv = {f"model.layers.{i}.attn": torch.zeros((2, NB, BLOCK, HEADS, HEAD),
                                                         dtype=torch.float16, device=device)
                   for i in range(self.LAYERS)}
        self.names = list(self.kv)
        page = 2 * HALF
        geometry = {"model": "test/kvtier-cuda", "dtype": "float16", "tokens_per_block": BLOCK,
                    "block_bytes": page * self.LAYERS, "parallel_layout": "tp1-pp1",
                    "hash_seed": 0}
        config = json.dumps({"cpu_bytes_to_use": slots * page * self.LAYERS,
                             "blocks_per_chunk": 1, "offload_prompt_only": False})
        resolved = resolve_connector_config(config, geometry)
        self.pool = HostPool(resolved["slot_bytes"], resolved["slot_count"])
        self.sched = ConnectorScheduler(config, geometry, self.pool, strict=True)
        regions, self.device = kv_cache_regions(self.kv, self.names, NB)
        owners = [self.kv[n] for n in self.names]
        if self.device.is_cuda:
            self.worker = ConnectorWorker.cuda(self.pool, regions, 1, owners, self.device.index)
        else:
            self.worker = ConnectorWorker(self.pool, regions, 1, owners)
        assert self.worker.is_cuda == self.device.is_cuda
        self.step_no = 0

    def stream(self):
        if not self.device.is_cuda:
            return None
        return self.torch.cuda.current_stream(self.device.index).cuda_stream

    def step(self, scheduled, forward=None):
        """One engine step: the metadata, the worker around the forward, the acknowledgements.
        Returns the worker's reports."""
        self.step_no += 1
        meta = self.sched.build_connector_meta(self.step_no, scheduled, [])
        self.worker.bind(meta)
        self.worker.before_compute(False, self.stream())
        if forward is not None:
            forward()
        self.worker.after_compute(False, self.stream())
        assert self.worker.drain(), "the worker drained within its deadline"
        out, done = self.worker.take_output()
        self.sched.update_connector_output([out])
        return done

    def block_bytes(self, block: int) -> bytes:
        return b"".join(bytes(self.kv[n][kv, block].reshape(-1).view(self.torch.uint8).cpu()
                              .tolist()) for n in self.names for kv in (0, 1))


def round_trip(device: str, slow_compute: bool = False):
    """Request 1 (4 full blocks) is computed and stored; every KV block is zeroed; request 2
    with the same prefix loads it into other blocks, which must hold the original bytes. With
    `slow_compute`, slow work on the compute stream writes garbage into the load's blocks just
    before the load is started: the load must land after it."""
    e = Native(device)
    torch = e.torch
    hashes = block_hashes_to_u128([f"block-{i}".encode() for i in range(4)])
    e.sched.on_new_request(1, 64, None)
    assert e.sched.get_num_new_matched_tokens(1, 64, hashes, 0) == 0
    e.sched.update_state_after_alloc(1, [0, 1, 2, 3], 0)
    gen = torch.Generator().manual_seed(7)
    original = {n: torch.randint(-100, 100, (2, 4, BLOCK, HEADS, HEAD), generator=gen)
                .to(torch.float16) for n in e.names}

    def forward():  # the model writes blocks 0-3 on the current stream
        for n in e.names:
            e.kv[n][:, 0:4].copy_(original[n].to(e.kv[n].device), non_blocking=True)

    done = e.step([(1, 0, 64, 64, [0, 1, 2, 3], True, hashes)], forward)
    assert done and all(ok and not is_load for _j, _r, is_load, ok, *_ in done), done
    computed = [e.block_bytes(b) for b in range(4)]
    assert not e.sched.request_finished(1, False, 65, 64, hashes), "every store acknowledged"
    for t in e.kv.values():
        t.zero_()
    # Request 2: the same 64 tokens and one more; its load goes into blocks 4-7.
    e.sched.on_new_request(2, 65, None)
    n = e.sched.get_num_new_matched_tokens(2, 65, hashes, 0)
    assert n == 64, n
    assert e.sched.update_state_after_alloc(2, [4, 5, 6, 7, 0], 64)
    if slow_compute:
        big = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        for _ in range(16):
            big.add_(1)  # ~ms of kernels on the compute stream
        for t in e.kv.values():
            t[:, 4:8].fill_(3.0)  # written last: the load must come after this
    done = e.step([])
    assert [(is_load, ok) for _j, _r, is_load, ok, *_ in done] == [(True, True)], done
    if device != "cpu":
        torch.cuda.current_stream(e.device.index).synchronize()
    for b in range(4):
        assert computed[b] == b"".join(
            bytes(original[n][kv, b].reshape(-1).view(torch.uint8).tolist())
            for n in e.names for kv in (0, 1)), f"the forward did not write block {b}"
        # Differs when the store read block b before the forward wrote it (zeros stored), or the
        # load landed before the compute's late write (3.0s), or bytes went astray.
        assert e.block_bytes(4 + b) == computed[b], f"block {4 + b} differs from block {b}"
    del e.worker  # drops the engine (synchronises) before the tensors


def test_native_round_trip_on_the_cpu_path():
    """The CPU path of the same round trip (so the flow the GPU variant runs is tested here)."""
    round_trip("cpu")


def test_native_round_trip_on_a_gpu():
    need_cuda()
    round_trip("cuda")


def test_native_load_waits_for_the_compute_stream_on_a_gpu():
    need_cuda()
    round_trip("cuda", slow_compute=True)


# -- KvtierConnector with CUDA KV caches, through vLLM's call order -----------------------------


def _config(tmp_path=None):
    cfg = {"cpu_bytes_to_use": 256 * 4096, "blocks_per_chunk": 1, "offload_prompt_only": False}
    if tmp_path is not None:
        cfg["secondary_tiers"] = [{"type": "fs", "root_dir": str(tmp_path),
                                   "capacity_bytes": 64 << 20, "engine": "sync"}]
    return cfg


def test_vllm_connector_with_cuda_kv_caches_loads_what_recompute_gives(tmp_path):
    """Requests sharing a prefix through KvtierConnector with CUDA KV caches: stores, a restart
    over the same disk directory, loads checked against recompute (connector_driver)."""
    need_cuda()
    need_vllm()
    from connector_driver import Engine, prompt

    a = Engine(_config(tmp_path), num_blocks=256, device="cuda")
    try:
        assert a.hosts[0].connector._worker.native.is_cuda
        a.add("r1", prompt("doc", 100), max_tokens=3)
        a.settle()
    finally:
        a.close()
    b = Engine(_config(tmp_path), num_blocks=256, device="cuda")
    try:
        rec = b.add("r2", prompt("doc", 100) + prompt("other", 20), max_tokens=2)
        b.run()
        assert rec.loaded_tokens == 96 and not rec.load_failed, (rec.loaded_tokens,
                                                                 rec.load_failed)
        shared = [b.add(f"s{i}", prompt("doc", 100) + prompt(f"x{i}", 30), max_tokens=2)
                  for i in range(8)]
        b.run()
        assert all(r.loaded_tokens >= 96 and not r.load_failed for r in shared)
    finally:
        b.close()
