//! The start-up scan: rebuilds the index from the segment files of a namespace (oldest segment
//! first by modification time, records in file order), recovers unsealed segments left by a killed
//! writer (their records are verified, a torn tail is cut, the segment is sealed), sweeps stale
//! temporary files and segments without a single good record, and evicts down to the byte limit.
//!
//! In a shared directory an unsealed segment may belong to a live instance that is still
//! appending: it is indexed from its headers only (loads verify every record) and never modified.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::error::FsError;
use crate::index::{Index, SegmentId, SegmentState};
use crate::layout::{is_temp_name, parse_segment_file_name, Layout};
use crate::segment::{recover, walk, Walk};
use crate::stats::{add, StatsCell};

/// What the sweep may touch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SweepPolicy {
    /// Other instances may be writing: remove only temporary files older than `stale_tmp_age`,
    /// and never modify an unsealed segment.
    pub(crate) shared: bool,
    /// The age of a stale temporary file in a shared directory.
    pub(crate) stale_tmp_age: Duration,
}

impl SweepPolicy {
    fn removes_tmp(&self, modified: Option<SystemTime>) -> bool {
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

/// A segment the scan indexed, for the shared-directory prober (which walks unsealed ones on).
#[derive(Clone, Debug)]
pub(crate) struct Scanned {
    pub(crate) name: String,
    pub(crate) id: SegmentId,
    pub(crate) walked_to: u64,
    pub(crate) sealed: bool,
}

/// Scans the namespace directory into `index`; counts what it found and removed in `stats`.
pub(crate) fn scan(
    layout: &Layout,
    policy: SweepPolicy,
    index: &mut Index,
    stats: &StatsCell,
) -> Result<Vec<Scanned>, FsError> {
    let dir = layout.dir();
    let entries = fs::read_dir(dir).map_err(|e| FsError::io("read_dir", dir, 0, e))?;
    let mut segments: Vec<(SystemTime, String, PathBuf)> = Vec::new();
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
            if policy.removes_tmp(meta.modified().ok()) && fs::remove_file(entry.path()).is_ok() {
                add(&stats.tmp_removed_at_start, 1);
            }
            continue;
        }
        if parse_segment_file_name(name).is_some() {
            let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            segments.push((modified, name.to_owned(), entry.path()));
        }
    }
    // Oldest first, ties broken by name, so the order does not depend on directory order.
    segments.sort();
    let mut scanned = Vec::with_capacity(segments.len());
    for (_, name, path) in segments {
        if let Some(found) = scan_segment(&path, &name, policy, index, stats)? {
            scanned.push(found);
        }
    }
    for victim in index.evict_over_capacity() {
        if victim.delete {
            let _ = fs::remove_file(&*victim.path);
        }
        add(&stats.evictions, victim.chunks);
        add(&stats.evicted_bytes, victim.bytes);
    }
    Ok(scanned)
}

/// Indexes one segment (recovering it first when it is unsealed and ours to repair).
fn scan_segment(
    path: &Path,
    name: &str,
    policy: SweepPolicy,
    index: &mut Index,
    stats: &StatsCell,
) -> Result<Option<Scanned>, FsError> {
    let read = |path: &Path| -> std::io::Result<Walk> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        walk(&file, 0, len, false)
    };
    let mut found = match read(path) {
        Ok(found) => found,
        // Gone meanwhile (another instance evicted it).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(FsError::io("read", path, 0, e)),
    };
    if let (Some(version), 0) = (found.other_version, found.end) {
        // A segment another kvtier version wrote (version 2 keys are 64-bit: none of them can
        // name a chunk this version asks for). Never indexed or loaded, and never recovered,
        // cut or removed: its bytes are not ours to change.
        add(&stats.old_format_segments, 1);
        add(&stats.warnings, 1);
        tracing::warn!(
            path = %path.display(),
            version,
            expected = crate::format::FORMAT_VERSION,
            "tier-fs: segment of record format version {version} (this kvtier reads only \
             version {}; version 2 has 64-bit keys) ignored: not loaded, left as it is; \
             delete it to free its space",
            crate::format::FORMAT_VERSION
        );
        return Ok(None);
    }
    let mut state = SegmentState::Sealed;
    if !found.sealed {
        if policy.shared {
            state = SegmentState::Foreign;
        } else {
            let headers = found.chunks.len() as u64;
            found = recover(path).map_err(|e| FsError::io("recover", path, 0, e))?;
            add(&stats.open_segments_recovered, 1);
            add(
                &stats.torn_records_dropped,
                headers.saturating_sub(found.chunks.len() as u64),
            );
        }
    }
    if found.chunks.is_empty() && state == SegmentState::Sealed {
        // Not one chunk: a segment created just before its writer died, or only dead space.
        if fs::remove_file(path).is_ok() {
            add(&stats.tmp_removed_at_start, 1);
        }
        return Ok(None);
    }
    let id = index.add_segment(path, found.end, state);
    add(&stats.chunks_found_at_start, found.chunks.len() as u64);
    for chunk in &found.chunks {
        index.insert(chunk.key, id, chunk.offset, chunk.bytes);
    }
    Ok(Some(Scanned {
        name: name.to_owned(),
        id,
        walked_to: found.end,
        sealed: found.sealed,
    }))
}
