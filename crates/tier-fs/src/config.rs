//! [`FsTierConfig`]: where the disk tier keeps its files, how much it may use, which I/O engine it
//! runs, and the namespace identity ([`NamespaceId`]) that keeps different models' chunks apart.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::FsError;
use crate::fault::FaultPlan;

/// The identity of the KV layout whose chunks a namespace holds (offload-core's): a namespace
/// directory's name is its hash, and a small config file inside records its fields (checked at
/// start).
pub use offload_core::NamespaceId;

/// Whether stores are made durable against power loss.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// No fsync (the default). A killed process never leaves a torn chunk that is served: a
    /// record enters the index only after its write completed, a segment is sealed only after
    /// every write into it completed, and the next start verifies the records of an unsealed
    /// segment and cuts a torn tail. After a power loss a record may hold missing or stale blocks;
    /// loads then fail its checksum, report the key as failed and drop the record, so such a chunk
    /// costs a recompute, never wrong KV.
    #[default]
    None,
    /// fdatasync the segment after each batch of record writes, before the chunks enter the index
    /// (and the directory after a segment is created), so a stored chunk survives power loss.
    /// Costs one disk flush per batch.
    Fsync,
}

/// Which I/O engine the tier runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EngineChoice {
    /// io_uring when the kernel allows it (probed at start), else the plain-syscall engine.
    #[default]
    Auto,
    /// io_uring only; start fails when it is unavailable or forbidden.
    Uring,
    /// The plain `pread`/`pwrite` engine on a small thread pool.
    Sync,
}

/// The disk tier's configuration. Build it with [`FsTierConfig::new`] and struct-update syntax.
#[derive(Clone, Debug)]
pub struct FsTierConfig {
    /// The directory under which the namespace directory is created.
    pub root_dir: PathBuf,
    /// The KV layout identity; decides the namespace directory.
    pub namespace: NamespaceId,
    /// The most bytes of segment files (headers, padding, dead space and seals included) the
    /// tier keeps; the segments accessed least recently are evicted to stay under it.
    pub capacity_bytes: u64,
    /// fdatasync each batch of stored records, or not (the default).
    pub durability: Durability,
    /// io_uring, the plain-syscall engine, or the first that works.
    pub engine: EngineChoice,
    /// Load worker threads, each with its own I/O engine. Each runs the load jobs it takes as a
    /// pipeline (every queued job while their record bytes stay under `batch_bytes_max`, each
    /// finished as soon as its reads completed). The tier sends a load job to the first of them
    /// whose jobs in flight leave room for it under eight times `batch_bytes_max` (the jobs
    /// beyond its pipeline wait in its channel), so one thread usually keeps the disk busy and
    /// the others get jobs only when it has its fill; more workers than
    /// the load needs stay idle instead of competing for the cores. Stores do not use them: one writer thread
    /// (with its own engine) runs every store job, appending to one open segment, so the root
    /// gets one sequential append stream.
    pub workers: usize,
    /// Threads of each worker's plain-syscall engine.
    pub threads: usize,
    /// Submission queue entries of the io_uring engine.
    pub uring_entries: u32,
    /// Use O_DIRECT where the file system takes it (probed at start). `false` forces buffered I/O.
    pub direct_io: bool,
    /// The most jobs accepted and not yet returned by `poll`; beyond it, submit answers `Busy`.
    pub jobs_in_flight_max: usize,
    /// The most bytes of one segment file (records are appended to the writer's open segment
    /// until the next would pass this; a single larger record goes alone). The tier also keeps
    /// segments under `capacity_bytes / (4 * workers)`, so that the segments being appended stay a
    /// small part of the limit and eviction, which removes whole segments, stays fine-grained.
    pub segment_bytes_max: u64,
    /// Per worker: the most buffer bytes one submission to the I/O engine may hold (a job larger
    /// than this is split into several submissions; a single larger chunk goes alone), and the
    /// most bytes of buffers kept for reuse. The writer also takes store jobs queued behind the
    /// one it starts until their records reach this many bytes. The tier's buffers stay under
    /// `2 * (workers + 1) * batch_bytes_max` (plus one chunk per worker).
    pub batch_bytes_max: usize,
    /// Other tier instances write this directory too: a lookup of a key missing from the index
    /// starts an asynchronous probe (a walk over the segments new or grown since the last one),
    /// answering `Retry` until it completes or `probe_deadline` passes; the start-up sweep removes
    /// only temporary files older than `stale_tmp_age` and never modifies an unsealed segment
    /// (it may belong to a live instance); only this instance's segments are ever written.
    pub shared_dir: bool,
    /// How long a lookup may answer `Retry` while its probe runs; also how long a negative probe
    /// result is remembered.
    pub probe_deadline: Duration,
    /// The most probes queued or running at once (beyond it, a lookup of an unknown key misses).
    pub probes_in_flight_max: usize,
    /// In a shared directory, the age beyond which a temporary file is stale.
    pub stale_tmp_age: Duration,
    /// Warnings (engine detection, the switch to buffered I/O) are printed to stderr unless set.
    pub quiet: bool,
    /// Injected faults, for tests. Empty by default.
    pub faults: FaultPlan,
    /// Loads read payloads straight into host slots (and verify them there) where a store would
    /// write straight from them (O_DIRECT, slots with a stable 4 KiB-aligned address, payload
    /// lengths in multiples of 4 KiB), instead of through a bounce buffer. Off by default: on the
    /// disk measured, loads through bounce buffers were faster (1-8 MiB chunks, interleaved
    /// runs), while stores straight from the slots were as fast as through bounce buffers with
    /// half the CPU, so stores always take that path.
    pub zero_copy_loads: bool,
    /// How long a shutdown (and so a drop) waits for the jobs in flight, and then as long again
    /// for the worker threads to end (default 30 s). Past it the jobs stay unreported and the threads run on detached, each keeping the host
    /// memory (its `Arc`) and, for the writer, the directory lock, so nothing they may still
    /// touch is freed or taken by another instance.
    pub shutdown_deadline: Duration,
    /// How long [`Tier::drain`](offload_core::tier::Tier::drain) waits for the jobs in flight
    /// (default 30 s). Past it the drain returns, counted in `FsStats::drain_timeouts` and warned
    /// about once per tier: the jobs not reported yet stay in flight, their slots theirs, and
    /// `poll` or the shutdown reports them later. [`crate::FsTier::drain_until`] says which.
    pub drain_deadline: Duration,
}

impl FsTierConfig {
    /// A configuration with defaults for everything but the directory, namespace and byte limit.
    pub fn new(root_dir: impl Into<PathBuf>, namespace: NamespaceId, capacity_bytes: u64) -> Self {
        Self {
            root_dir: root_dir.into(),
            namespace,
            capacity_bytes,
            durability: Durability::None,
            engine: EngineChoice::Auto,
            workers: 4,
            threads: 2,
            uring_entries: 256,
            direct_io: true,
            jobs_in_flight_max: 64,
            batch_bytes_max: 32 << 20,
            segment_bytes_max: 64 << 20,
            shared_dir: false,
            probe_deadline: Duration::from_secs(1),
            probes_in_flight_max: 256,
            stale_tmp_age: Duration::from_secs(600),
            quiet: false,
            faults: FaultPlan::default(),
            zero_copy_loads: false,
            shutdown_deadline: Duration::from_secs(30),
            drain_deadline: Duration::from_secs(30),
        }
    }

    /// Checks every setting; the error names the first field that is wrong.
    pub fn validate(&self) -> Result<(), FsError> {
        let fail = |field: &'static str, reason: &str| {
            Err(FsError::Config {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.root_dir.as_os_str().is_empty() {
            return fail("root_dir", "must not be empty");
        }
        if self.namespace.model.is_empty() {
            return fail("namespace.model", "must not be empty");
        }
        if self.namespace.dtype.is_empty() {
            return fail("namespace.dtype", "must not be empty");
        }
        if self.namespace.tokens_per_chunk == 0 {
            return fail("namespace.tokens_per_chunk", "must be at least 1");
        }
        if self.namespace.parallel_layout.is_empty() {
            return fail("namespace.parallel_layout", "must not be empty");
        }
        if self.capacity_bytes == 0 {
            return fail("capacity_bytes", "must be at least 1");
        }
        if self.workers == 0 || self.workers > 64 {
            return fail("workers", "must be between 1 and 64");
        }
        if self.threads == 0 || self.threads > crate::io::sync::THREADS_MAX {
            return fail("threads", "must be between 1 and 64");
        }
        if self.uring_entries == 0 || self.uring_entries > 32768 {
            return fail("uring_entries", "must be between 1 and 32768");
        }
        if self.jobs_in_flight_max == 0 || self.jobs_in_flight_max > 1 << 16 {
            return fail("jobs_in_flight_max", "must be between 1 and 65536");
        }
        if self.segment_bytes_max < crate::format::ALIGN as u64 {
            return fail("segment_bytes_max", "must be at least 4096");
        }
        if self.batch_bytes_max < crate::format::HEADER_BYTES {
            return fail("batch_bytes_max", "must be at least 4096");
        }
        if self.shutdown_deadline.is_zero() {
            return fail("shutdown_deadline", "must be positive");
        }
        if self.drain_deadline.is_zero() {
            return fail("drain_deadline", "must be positive");
        }
        if self.shared_dir && self.probe_deadline.is_zero() {
            return fail("probe_deadline", "must be positive when shared_dir is set");
        }
        if self.shared_dir && self.probes_in_flight_max == 0 {
            return fail(
                "probes_in_flight_max",
                "must be at least 1 when shared_dir is set",
            );
        }
        if let Err(reason) = self.faults.check() {
            return fail("faults", &reason);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespace() -> NamespaceId {
        NamespaceId {
            model: "m".into(),
            dtype: "bf16".into(),
            tokens_per_chunk: 256,
            parallel_layout: "tp1".into(),
        }
    }

    fn field_of(config: &FsTierConfig) -> &'static str {
        match config.validate() {
            Err(FsError::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_validate() {
        let config = FsTierConfig::new("/tmp/x", namespace(), 1 << 30);
        assert!(config.validate().is_ok());
        assert_eq!(config.durability, Durability::None);
    }

    #[test]
    fn errors_name_the_field() {
        let base = FsTierConfig::new("/tmp/x", namespace(), 1 << 30);
        let mut c = base.clone();
        c.capacity_bytes = 0;
        assert_eq!(field_of(&c), "capacity_bytes");
        let mut c = base.clone();
        c.namespace.model.clear();
        assert_eq!(field_of(&c), "namespace.model");
        let mut c = base.clone();
        c.namespace.tokens_per_chunk = 0;
        assert_eq!(field_of(&c), "namespace.tokens_per_chunk");
        let mut c = base.clone();
        c.threads = 0;
        assert_eq!(field_of(&c), "threads");
        let mut c = base.clone();
        c.jobs_in_flight_max = 0;
        assert_eq!(field_of(&c), "jobs_in_flight_max");
        let mut c = base.clone();
        c.root_dir = PathBuf::new();
        assert_eq!(field_of(&c), "root_dir");
        let mut c = base;
        c.batch_bytes_max = 1;
        assert_eq!(field_of(&c), "batch_bytes_max");
    }
}
