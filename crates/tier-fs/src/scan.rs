//! The start-up scan: rebuilds the index from the chunk files of a namespace (last access = file
//! modification time), sweeps stale temporary files, removes files that cannot be chunks, and
//! evicts down to the byte limit.

use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime};

use offload_core::ChunkKey;

use crate::error::FsError;
use crate::format::{ALIGN, HEADER_BYTES};
use crate::index::Index;
use crate::layout::{is_temp_name, parse_chunk_file_name, Layout};
use crate::stats::{add, StatsCell};

/// What the sweep removes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SweepPolicy {
    /// Other instances may be writing: remove only temporary files older than `stale_tmp_age`.
    pub(crate) shared: bool,
    /// The age of a stale temporary file in a shared directory.
    pub(crate) stale_tmp_age: Duration,
}

impl SweepPolicy {
    fn removes(&self, modified: Option<SystemTime>) -> bool {
        if !self.shared {
            return true;
        }
        let Some(modified) = modified else {
            return false;
        };
        SystemTime::now()
            .duration_since(modified)
            .is_ok_and(|age| age > self.stale_tmp_age)
    }
}

/// A chunk file found by the scan.
struct Found {
    modified: SystemTime,
    key: ChunkKey,
    bytes: u64,
}

/// Scans the namespace directory into `index`; counts what it found and removed in `stats`.
pub(crate) fn scan(
    layout: &Layout,
    policy: SweepPolicy,
    index: &mut Index,
    stats: &StatsCell,
) -> Result<(), FsError> {
    sweep_dir(layout.dir(), policy, stats, &mut Vec::new())?;
    let mut found = Vec::new();
    for dir in layout.fanout_dirs() {
        sweep_dir(&dir, policy, stats, &mut found)?;
    }
    // Oldest first, ties broken by key, so the order does not depend on directory order.
    found.sort_by_key(|f| (f.modified, f.key));
    add(&stats.chunks_found_at_start, found.len() as u64);
    for f in found {
        index.insert(f.key, f.bytes);
    }
    for (key, bytes) in index.evict_over_capacity() {
        let _ = fs::remove_file(layout.chunk_path(key));
        add(&stats.evictions, 1);
        add(&stats.evicted_bytes, bytes);
    }
    Ok(())
}

/// Reads one directory: removes stale temporary files and impossible chunk files, and collects
/// chunk files into `found`. A missing directory is empty.
fn sweep_dir(
    dir: &Path,
    policy: SweepPolicy,
    stats: &StatsCell,
    found: &mut Vec<Found>,
) -> Result<(), FsError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(FsError::io("read_dir", dir, 0, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| FsError::io("read_dir", dir, 0, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        // An entry that vanished meanwhile (another instance) is skipped.
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        if is_temp_name(name) {
            if policy.removes(meta.modified().ok()) && fs::remove_file(entry.path()).is_ok() {
                add(&stats.tmp_removed_at_start, 1);
            }
            continue;
        }
        let Some(key) = parse_chunk_file_name(name) else {
            continue;
        };
        let bytes = meta.len();
        if bytes < HEADER_BYTES as u64 || bytes % ALIGN as u64 != 0 {
            // Not a file this format writes (a rename publishes only whole files).
            if fs::remove_file(entry.path()).is_ok() {
                add(&stats.quarantined, 1);
            }
            continue;
        }
        found.push(Found {
            modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            key,
            bytes,
        });
    }
    Ok(())
}
