"""kvtier: KV-cache tiers for inference engines (a disk tier and a peer tier), written in Rust.

For vLLM, name a tier in `secondary_tiers` of the OffloadingConnector's TieringOffloadingSpec:

    {"type": "KvtierFsTier", "module_path": "kvtier.vllm.tiers", "root_dir": "/mnt/nvme/kv"}

Or run kvtier's own connector (host pool, tiering, scheduler state machine, copies) in vLLM's
place: `--kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_connector_module_path":
"kvtier.vllm.connector", ...}'` (see `kvtier.vllm.connector`).

`kvtier.config` lists every tier setting. `kvtier.tiers.TierCore` is the engine-neutral part that
the vLLM classes wrap.
"""

from ._kvtier import REPEAT_WINDOW_S, Tier, offload_key_to_chunk_key

__all__ = ["Tier", "offload_key_to_chunk_key", "REPEAT_WINDOW_S", "__version__"]
__version__ = "0.1.0"
