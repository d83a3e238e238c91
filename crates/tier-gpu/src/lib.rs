//! kvtier's primary-tier worker side: moves chunks between the engine's KV cache and the host pool
//! (CUDA streams on a GPU, memcpy on a host). Placeholder until its issue lands.
