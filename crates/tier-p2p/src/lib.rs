//! kvtier's peer tier: engine instances share KV-cache chunks over TCP, so that a prefix
//! computed once anywhere in a group of instances is fetched instead of recomputed.
//!
//! [`P2pTier`] implements [`offload_core::Tier`]. Every instance serves the chunks it published
//! (its `Store` jobs) to its peers, asks its peers which keys they hold (batched `HAVE` requests;
//! lookups answer `Retry` until the replies arrive, `Miss` after a deadline), and loads chunks
//! from them (`GET` with several chunks per request, payloads read straight into the host slots
//! and verified by checksum before they count).
//!
//! The protocol ([`frame`]) is versioned, length-prefixed and bounded; the handshake checks the
//! version and the namespace (model, layout, hash seed), and with a shared secret authenticates
//! both sides with HMAC-SHA256 ([`auth`]). Without a secret the server listens on loopback only.
//!
//! Threads, all bounded: one accept thread, one handler per served connection (at most
//! `connections_max`), one local worker (publishing, local loads) and one client worker that
//! owns one connection per peer (at most two requests in flight on it: GETs are pipelined one
//! ahead). No async runtime in the data path; the etcd directory (feature `etcd`) runs a
//! single-threaded tokio runtime on its own thread, since its client is async.
//!
//! With the `nixl` feature, a GET's bytes can move by NIXL READ (RDMA or another UCX
//! transport) while the TCP connection carries the control messages and checksums (module
//! `nixl`); without the NIXL library at run time, or with a peer that does not offer it, the TCP
//! stream is used.
//!
//! Not here (yet): a pre-faulted arena for published chunks (each publish allocates its copy).

pub mod auth;
#[cfg(feature = "bench")]
pub mod bench;
mod client;
pub mod config;
mod conn;
mod directory;
pub mod error;
#[cfg(feature = "etcd")]
mod etcd;
pub mod frame;
mod handshake;
mod lookup;
#[cfg(feature = "nixl")]
pub mod nixl;
mod peer;
mod polyval;
mod server;
mod settle;
mod shared;
pub mod stats;
mod store;
mod tier;
mod worker;

pub use config::{Namespace, P2pConfig};
pub use directory::{member_id, owners, DnsPeers, PeerDirectory, StaticPeers};
pub use error::{P2pError, P2pErrorKind};
#[cfg(feature = "etcd")]
pub use etcd::{EtcdPeers, EtcdPeersConfig};
pub use offload_core::NamespaceId;
pub use peer::{ParsePeerAddrError, PeerAddr};
pub use stats::{P2pStats, PeerStatus};
pub use store::checksum;
pub use tier::P2pTier;
