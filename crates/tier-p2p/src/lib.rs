//! kvtier's peer tier (TCP, and RDMA through NIXL). Placeholder until its issue lands.
