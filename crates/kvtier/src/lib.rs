//! The `kvtier` command's library: each subcommand's work as a function returning a report that
//! serializes (`--json`) and renders as a table, so tests can call them without the binary.
//!
//! - [`bench_manager`]: `kvtier bench manager`, the host-pool manager alone on a trace.
//! - [`bench_data`]: `kvtier bench host|fs|p2p`, each data path against the machine's ceiling.
//! - [`instance`]: one simulated engine on the connector (config, tiers, report).
//! - [`model`]: real models' KV sizes (`--model`) and the stated cost model of "prefill saved".
//! - [`run`]: `kvtier run`, the main job on two instances that are each other's peer.
//! - [`replay`]: `kvtier replay`, a Mooncake trace through one instance.
//! - [`progress`]: the progress line on stderr.

pub mod bench_data;
pub mod bench_manager;
pub mod instance;
pub mod model;
pub mod progress;
pub mod replay;
pub mod run;
