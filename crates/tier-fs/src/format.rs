//! The on-disk record format: offload-core's record format ([`offload_core::record`]), shared
//! with tier-obj. A segment file is a sequence of such records. Record kinds: a chunk (the body
//! is the payload), a skip record (the body is dead space left by a failed write or a
//! quarantined chunk; readers step over it), and the seal (no body; written once every earlier
//! record of the segment is complete, so a segment without one may have a torn tail).

pub use offload_core::record::*;

// The I/O buffers' alignment is the record format's.
const _: () = assert!(crate::io::buf::ALIGN == ALIGN);
