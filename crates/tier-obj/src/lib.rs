//! kvtier's object-store tier: a secondary [`Tier`](offload_core::Tier) that keeps one object
//! per chunk in an S3-compatible store (AWS S3, MinIO, GCS and Azure through the `object_store`
//! crate; its local-file-system and in-memory backends for tests).
//!
//! Objects live at `<prefix>/<namespace hash>/<key>`, each a checksummed record in tier-fs's
//! format ([`record`]): a load verifies it and fails the key on any mismatch, never serving wrong
//! bytes. Records above `multipart_threshold_bytes` are uploaded in parts. The tier runs its own
//! small tokio runtime; `lookup`, `submit` and `poll` only touch memory (an index of present
//! keys, bounded job and completion tables), a bounded number of requests run at once, each with
//! a deadline. At start, a listing of the namespace prefix rebuilds the index (warm restart).
//!
//! Lookups answer from the index only: an object stored by another instance after this one
//! started is not seen until a restart (no probes yet). `touch` does nothing: the store's own
//! lifecycle rules bound its size. KV events name the medium `DISK` (offload-core has no object
//! medium yet).

pub mod config;
pub mod error;
pub mod record;
pub mod tier;

pub use config::{AzureConfig, Backend, GcsConfig, NamespaceId, ObjTierConfig, S3Config};
pub use error::{ObjError, ObjErrorKind};
pub use object_store;
pub use tier::{ObjStats, ObjTier, EVICTED_KEPT_MAX};
