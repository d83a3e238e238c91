//! kvtier's disk tier (io_uring, with a plain-syscall engine). Placeholder until its issue lands.
