"""The engine's KV cache tensors as kvtier's regions, and the device they are on.

Plain Python over the tensor interface (`device`, `shape`, `stride()`, `element_size()`,
`data_ptr()`), without importing vLLM or torch, so it can be checked with stand-in tensors and
used wherever the native worker is made (`kvtier.vllm.connector`, the GPU checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KvDevice", "kv_cache_regions"]


@dataclass(frozen=True)
class KvDevice:
    """Where the KV caches are: `type` is "cpu" or "cuda"; `index` is the CUDA device ordinal
    (None for "cpu")."""

    type: str
    index: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def _device_of(name: str, t: Any) -> KvDevice:
    dev = t.device
    if dev.type == "cpu":
        return KvDevice("cpu")
    if dev.type == "cuda":
        index = dev.index
        if index is None:  # "cuda" alone: the current device
            import torch

            index = torch.cuda.current_device()
        return KvDevice("cuda", int(index))
    raise ValueError(
        f"kvtier connector: layer {name}'s KV cache is on {dev}; kvtier copies KV caches in host "
        "memory (cpu) or on a CUDA GPU (cuda) only"
    )


def kv_cache_regions(kv_caches: dict[str, Any], layer_names: list[str],
                     num_blocks: int) -> tuple[list[tuple[int, int, int, int, int]], KvDevice]:
    """The KV cache tensors as regions `(base, num_blocks, block_bytes, block_stride, 0)`, in the
    order of `layer_names` (every instance lays out a slot the same way), and the one device they
    are all on. A tensor's engine-block dimension is its first (or its second, after a K/V
    dimension); everything after it must be contiguous. Addresses are `data_ptr()`: host
    addresses on the CPU, device addresses (unified addressing) on a GPU. Tensors on different
    devices, or on a device that is neither the CPU nor a CUDA GPU, are refused naming them."""
    regions = []
    device: KvDevice | None = None
    first = None
    for name in layer_names:
        t = kv_caches.get(name)
        if t is None:
            raise ValueError(f"kvtier connector: no KV cache tensor registered for layer {name}")
        here = _device_of(name, t)
        if device is None:
            device, first = here, name
        elif here != device:
            raise ValueError(
                f"kvtier connector: the KV caches are on more than one device (layer {first} on "
                f"{device}, layer {name} on {here}); kvtier's worker copies for one device"
            )
        shape, strides, size = list(t.shape), list(t.stride()), t.element_size()
        if shape and shape[0] == num_blocks:
            dim = 0
        elif len(shape) > 1 and shape[1] == num_blocks:
            dim = 1
        else:
            raise ValueError(
                f"kvtier connector: layer {name}'s KV cache has shape {tuple(shape)}; expected "
                f"{num_blocks} engine blocks in dimension 0 or 1"
            )
        inner = 1
        for d in range(len(shape) - 1, dim, -1):
            if shape[d] != 1 and strides[d] != inner:
                raise ValueError(
                    f"kvtier connector: layer {name}'s KV cache is not contiguous within a block "
                    f"(shape {tuple(shape)}, strides {tuple(strides)})"
                )
            inner *= shape[d]
        block_bytes = inner * size
        block_stride = strides[dim] * size
        outer = [0] if dim == 0 else [i * strides[0] * size for i in range(shape[0])]
        for off in outer:
            regions.append((t.data_ptr() + off, num_blocks, block_bytes, block_stride, 0))
    if device is None:
        raise ValueError("kvtier connector: no KV cache layers to register")
    return regions, device
