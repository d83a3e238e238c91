"""kvtier inside vLLM. `kvtier.vllm.tiers` holds the secondary tiers for vLLM's
TieringOffloadingSpec; `kvtier.vllm.connector` holds `KvtierConnector`, kvtier's whole connector
as a vLLM KV connector. Importing either imports vLLM."""
