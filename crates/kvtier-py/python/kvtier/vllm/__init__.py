"""kvtier inside vLLM. `kvtier.vllm.tiers` holds the secondary tiers for vLLM's
TieringOffloadingSpec; importing it imports vLLM."""
