//! Counters of the disk tier: a lock-free cell the worker updates, and the [`FsStats`] snapshot
//! callers read.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use offload_core::tier::TierFailure;

/// Why a chunk of a job failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// Load of a key the tier does not hold (or whose file vanished).
    Missing,
    /// The job was cancelled before the chunk was transferred.
    Cancelled,
    /// The chunk is larger than the whole byte limit (or everything else is pinned).
    Capacity,
    /// The file system is full (ENOSPC, EDQUOT).
    NoSpace,
    /// Another I/O error (EIO, permissions, a refused submission).
    Io,
    /// A write moved fewer bytes than the file needs.
    ShortWrite,
    /// A read returned fewer bytes than the file needs (a torn file).
    ShortRead,
    /// The header or checksum did not verify; the file was removed.
    Corrupt,
    /// The stored payload length differs from the requested one.
    LengthMismatch,
    /// The tier's worker is gone (shut down or died).
    Unavailable,
}

impl FailureKind {
    /// Every kind, in the order of [`FsStats::failures`].
    pub const ALL: [FailureKind; 10] = [
        FailureKind::Missing,
        FailureKind::Cancelled,
        FailureKind::Capacity,
        FailureKind::NoSpace,
        FailureKind::Io,
        FailureKind::ShortWrite,
        FailureKind::ShortRead,
        FailureKind::Corrupt,
        FailureKind::LengthMismatch,
        FailureKind::Unavailable,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// The kind a [`TierCompletion`](offload_core::tier::TierCompletion) reports for it: a torn
    /// or mislabelled record is corrupt, a full disk or refused write an I/O failure, a dead
    /// worker the tier down.
    pub fn tier_failure(self) -> TierFailure {
        match self {
            FailureKind::Missing => TierFailure::Missing,
            FailureKind::Cancelled => TierFailure::Cancelled,
            FailureKind::Capacity
            | FailureKind::NoSpace
            | FailureKind::Io
            | FailureKind::ShortWrite => TierFailure::Io,
            FailureKind::ShortRead | FailureKind::Corrupt | FailureKind::LengthMismatch => {
                TierFailure::Corrupt
            }
            FailureKind::Unavailable => TierFailure::TierDown,
        }
    }
}

/// A snapshot of the tier's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FsStats {
    /// The I/O engine in use (`"io_uring"` or `"sync"`).
    pub engine: &'static str,
    /// Whether segment files are opened with O_DIRECT now.
    pub direct_io: bool,
    /// Chunks written to disk.
    pub chunks_stored: u64,
    /// Payload bytes written.
    pub bytes_stored: u64,
    /// Stores of chunks already on disk (not rewritten).
    pub stores_skipped: u64,
    /// Chunks loaded and verified.
    pub chunks_loaded: u64,
    /// Payload bytes loaded.
    pub bytes_loaded: u64,
    /// Chunks evicted to stay under the byte limit (with their segments).
    pub evictions: u64,
    /// Segment bytes evicted.
    pub evicted_bytes: u64,
    /// Switches from O_DIRECT to buffered I/O (at most one per root; the start-up probe counts).
    pub direct_fallbacks: u64,
    /// Operations retried buffered after EINVAL.
    pub buffered_retries: u64,
    /// Record writes and reads whose payload moved straight between the host slot and the file
    /// (no bounce buffer: O_DIRECT, a slot with a stable 4 KiB-aligned address, a payload length
    /// that is a multiple of 4 KiB).
    pub zero_copy_ops: u64,
    /// Records loaded by a merged read (one read of neighbouring records of a segment).
    pub reads_merged: u64,
    /// Load jobs a load worker started while another of its load jobs was running, so that
    /// their reads were in flight together (the load pipeline; see `FsTierConfig::workers`).
    pub loads_overlapped: u64,
    /// Segment bytes allocated (`fallocate`) ahead of the store writes that fill them.
    pub bytes_preallocated: u64,
    /// Warnings issued (engine detection, fallbacks).
    pub warnings: u64,
    /// Chunk records dropped because they did not verify.
    pub quarantined: u64,
    /// Chunk records found by the start-up scan.
    pub chunks_found_at_start: u64,
    /// Temporary files (and segments without a single chunk) removed by the start-up sweep.
    pub tmp_removed_at_start: u64,
    /// Unsealed segments of a killed writer that the start-up scan verified, cut and sealed.
    pub open_segments_recovered: u64,
    /// Records dropped by that recovery (a torn tail).
    pub torn_records_dropped: u64,
    /// Segments of another record format version (version 2: 64-bit keys, an older kvtier)
    /// that the start-up scan found and left alone: not indexed, never loaded, never modified.
    pub old_format_segments: u64,
    /// Segments this instance sealed.
    pub segments_sealed: u64,
    /// Segments the writer took ready-made (created and allocated ahead on its housekeeping
    /// thread) instead of creating them itself.
    pub segments_prepared: u64,
    /// Probes of a shared directory started.
    pub probes: u64,
    /// Probes that found a chunk written by another instance.
    pub probe_hits: u64,
    /// Shutdowns whose wait for the jobs in flight passed `shutdown_deadline` (those jobs are
    /// never reported; the memory and directory they may still use stay theirs).
    pub shutdown_timeouts: u64,
    /// Worker threads (and probe threads, which hold only the index) a shutdown left running
    /// past its deadline (detached; a worker holds the host
    /// memory and, for the writer, the directory lock until the process ends).
    pub threads_detached: u64,
    /// Drains that returned at `drain_deadline` with jobs still in flight (reported later).
    pub drain_timeouts: u64,
    /// Completions from the workers that the job book refused (a second one for a job, a stray
    /// failed key): never handed out; a broken invariant (debug builds panic).
    pub invariant_failures: u64,
    /// Injected stalls entered (tests).
    pub stalls: u64,
    /// Failed chunks by kind, indexed like [`FailureKind::ALL`].
    pub failures: [u64; 10],
}

impl FsStats {
    /// Failed chunks of one kind.
    pub fn failures_of(&self, kind: FailureKind) -> u64 {
        self.failures[kind.index()]
    }

    /// Failed chunks of every kind.
    pub fn failures_total(&self) -> u64 {
        self.failures.iter().sum()
    }
}

/// The counters, updated without locks.
#[derive(Debug, Default)]
pub(crate) struct StatsCell {
    pub(crate) direct_io: AtomicBool,
    pub(crate) chunks_stored: AtomicU64,
    pub(crate) bytes_stored: AtomicU64,
    pub(crate) stores_skipped: AtomicU64,
    pub(crate) chunks_loaded: AtomicU64,
    pub(crate) bytes_loaded: AtomicU64,
    pub(crate) evictions: AtomicU64,
    pub(crate) evicted_bytes: AtomicU64,
    pub(crate) direct_fallbacks: AtomicU64,
    pub(crate) buffered_retries: AtomicU64,
    pub(crate) zero_copy_ops: AtomicU64,
    pub(crate) reads_merged: AtomicU64,
    pub(crate) loads_overlapped: AtomicU64,
    pub(crate) bytes_preallocated: AtomicU64,
    pub(crate) warnings: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    pub(crate) chunks_found_at_start: AtomicU64,
    pub(crate) tmp_removed_at_start: AtomicU64,
    pub(crate) open_segments_recovered: AtomicU64,
    pub(crate) torn_records_dropped: AtomicU64,
    pub(crate) old_format_segments: AtomicU64,
    pub(crate) segments_sealed: AtomicU64,
    pub(crate) segments_prepared: AtomicU64,
    pub(crate) probes: AtomicU64,
    pub(crate) probe_hits: AtomicU64,
    pub(crate) shutdown_timeouts: AtomicU64,
    pub(crate) threads_detached: AtomicU64,
    pub(crate) drain_timeouts: AtomicU64,
    pub(crate) invariant_failures: AtomicU64,
    pub(crate) stalls: AtomicU64,
    failures: [AtomicU64; 10],
}

/// Adds `n` to a counter.
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl StatsCell {
    pub(crate) fn fail(&self, kind: FailureKind) {
        add(&self.failures[kind.index()], 1);
    }

    pub(crate) fn snapshot(&self, engine: &'static str) -> FsStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut failures = [0; 10];
        for (out, cell) in failures.iter_mut().zip(&self.failures) {
            *out = get(cell);
        }
        FsStats {
            engine,
            direct_io: self.direct_io.load(Ordering::Relaxed),
            chunks_stored: get(&self.chunks_stored),
            bytes_stored: get(&self.bytes_stored),
            stores_skipped: get(&self.stores_skipped),
            chunks_loaded: get(&self.chunks_loaded),
            bytes_loaded: get(&self.bytes_loaded),
            evictions: get(&self.evictions),
            evicted_bytes: get(&self.evicted_bytes),
            direct_fallbacks: get(&self.direct_fallbacks),
            buffered_retries: get(&self.buffered_retries),
            zero_copy_ops: get(&self.zero_copy_ops),
            reads_merged: get(&self.reads_merged),
            loads_overlapped: get(&self.loads_overlapped),
            bytes_preallocated: get(&self.bytes_preallocated),
            warnings: get(&self.warnings),
            quarantined: get(&self.quarantined),
            chunks_found_at_start: get(&self.chunks_found_at_start),
            tmp_removed_at_start: get(&self.tmp_removed_at_start),
            open_segments_recovered: get(&self.open_segments_recovered),
            torn_records_dropped: get(&self.torn_records_dropped),
            old_format_segments: get(&self.old_format_segments),
            segments_sealed: get(&self.segments_sealed),
            segments_prepared: get(&self.segments_prepared),
            probes: get(&self.probes),
            probe_hits: get(&self.probe_hits),
            shutdown_timeouts: get(&self.shutdown_timeouts),
            threads_detached: get(&self.threads_detached),
            drain_timeouts: get(&self.drain_timeouts),
            invariant_failures: get(&self.invariant_failures),
            stalls: get(&self.stalls),
            failures,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_counted_by_kind() {
        let cell = StatsCell::default();
        cell.fail(FailureKind::Corrupt);
        cell.fail(FailureKind::Corrupt);
        cell.fail(FailureKind::Unavailable);
        let stats = cell.snapshot("sync");
        assert_eq!(stats.failures_of(FailureKind::Corrupt), 2);
        assert_eq!(stats.failures_of(FailureKind::Unavailable), 1);
        assert_eq!(stats.failures_total(), 3);
        for (i, kind) in FailureKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }
}
