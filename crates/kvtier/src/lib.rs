//! The `kvtier` command's library: each subcommand's work as a function returning a report that
//! serializes (`--json`) and renders as a table, so tests can call them without the binary.
//!
//! - [`bench_manager`]: `kvtier bench manager`, the host-pool manager alone on a trace.
//! - [`progress`]: the progress line on stderr.

pub mod bench_manager;
pub mod progress;
