//! The record format of one chunk object: offload-core's record format
//! ([`offload_core::record`]), the one tier-fs writes, so a chunk object and a tier-fs record are
//! the same bytes. Only chunk records are written here; skip and seal records (tier-fs's segment
//! bookkeeping) decode as other kinds, so such an object is refused, never misread.

pub use offload_core::record::*;
