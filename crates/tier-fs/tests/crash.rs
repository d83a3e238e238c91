//! Crash safety: a child process storing chunks in a loop is killed with SIGKILL many times, at
//! varying moments; afterwards a fresh instance must serve no torn or corrupt chunk (every
//! indexed key loads and verifies), leave no temporary file, and leave every segment sealed (a
//! second restart has nothing to recover).
//!
//! The child is this test binary itself, re-run with `CHILD_ENV` set so that the
//! `crash_child_entry` test becomes the storing loop.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use offload_core::tier::{SlotMemory, Tier, TierChunk, TierJob, TierLookup, TierOp};
use offload_core::{ChunkKey, JobId, SlotId};
use tier_fs::{EngineChoice, FsTier, FsTierConfig};
use tier_testkit::VecSlotMemory;

/// The directory the child stores into; set only in the child.
const CHILD_ENV: &str = "KVTIER_FS_CRASH_CHILD_DIR";
/// The round number, which seeds the child's keys and chooses its engine.
const ROUND_ENV: &str = "KVTIER_FS_CRASH_ROUND";
/// What the child prints once its tier has started.
const READY: &str = "kvtier-fs-crash-child-ready";
/// The longest a child lives (it is normally killed within ~100 ms).
const CHILD_LIFETIME_MAX: Duration = Duration::from_secs(15);
/// Kill rounds.
const ROUNDS: u64 = 20;
/// Bytes per slot in the child.
const CHILD_SLOT_BYTES: usize = 256 * 1024;
/// The child's byte limit: small enough that eviction runs while it is killed.
const CHILD_CAPACITY: u64 = 48 * (CHILD_SLOT_BYTES as u64 + 4096);

/// The payload length of a key (1 byte to a full slot), derived from its hash.
fn len_of(key: ChunkKey) -> u32 {
    1 + (key.hash_low() % CHILD_SLOT_BYTES as u64) as u32
}

fn child_key(round: u64, n: u64) -> ChunkKey {
    let mixed = (round << 40 | n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ChunkKey::new(
        u128::from(mixed.rotate_left(17)) << 64 | u128::from(mixed),
        0,
    )
}

fn child_config(dir: &Path, round: u64) -> FsTierConfig {
    let engine = if round % 2 == 0 && uring_available() {
        EngineChoice::Uring
    } else {
        EngineChoice::Sync
    };
    FsTierConfig {
        capacity_bytes: CHILD_CAPACITY,
        engine,
        ..config(dir, engine)
    }
}

/// The child: stores jobs of four chunks in a loop until killed. A no-op in a normal test run.
#[test]
fn crash_child_entry() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let round: u64 = std::env::var(ROUND_ENV)
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    // A watchdog: a child whose parent is gone must not store forever.
    std::thread::spawn(|| {
        std::thread::sleep(CHILD_LIFETIME_MAX);
        std::process::exit(3);
    });
    let memory = Arc::new(VecSlotMemory::new(8, CHILD_SLOT_BYTES));
    let mut tier = FsTier::start(
        child_config(Path::new(&dir), round),
        memory.clone() as Arc<dyn SlotMemory>,
    )
    .unwrap_or_else(|e| panic!("child tier start: {e}"));
    println!("{READY}");
    let mut out = Vec::new();
    for n in 0u64.. {
        let mut chunks = Vec::new();
        for i in 0..4u64 {
            let key = child_key(round, n * 4 + i);
            let slot = SlotId(i as u32);
            memory.fill(slot, len_of(key) as usize, key.hash_low());
            chunks.push(TierChunk::new(key, slot, len_of(key)));
        }
        let id = JobId(n + 1);
        let job = TierJob {
            id,
            request: None,
            op: TierOp::Store,
            chunks,
        };
        tier.submit(job)
            .unwrap_or_else(|e| panic!("child submit: {e}"));
        while !out
            .iter()
            .any(|c: &offload_core::tier::TierCompletion| c.id == id)
        {
            tier.poll(&mut out);
            std::thread::yield_now();
        }
        out.clear();
    }
}

#[test]
fn sigkill_during_stores_leaves_no_torn_chunk() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    for round in 0..ROUNDS {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash_child_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, dir.path())
            .env(ROUND_ENV, round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let ready = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains(READY));
        assert!(ready, "round {round}: the child exited before it was ready");
        // Kill at a different moment each round, within ~100 ms of storing.
        std::thread::sleep(Duration::from_millis(3 + (round * 37) % 97));
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success(), "round {round}: the child was not killed");
    }
    let temps_before = files_with_suffix(dir.path(), ".tmp").len();
    // Load every indexed key into a pool of the children's slot size.
    let memory = Arc::new(VecSlotMemory::new(4, CHILD_SLOT_BYTES));
    let mut tier = FsTier::start(
        FsTierConfig {
            capacity_bytes: CHILD_CAPACITY,
            ..config(dir.path(), EngineChoice::Sync)
        },
        memory.clone() as Arc<dyn SlotMemory>,
    )
    .unwrap();
    assert!(
        files_with_suffix(dir.path(), ".tmp").is_empty(),
        "temporary files left after the restart"
    );
    let start_stats = tier.stats();
    assert!(start_stats.tmp_removed_at_start >= temps_before as u64);
    let keys = tier.keys();
    assert!(!keys.is_empty(), "the children stored nothing");
    assert!(tier.used_bytes() <= CHILD_CAPACITY);
    let mut loaded = 0;
    let mut failed = 0;
    let mut out = Vec::new();
    for (n, &key) in keys.iter().enumerate() {
        memory.fill(SlotId(0), CHILD_SLOT_BYTES, 0xBAD);
        let id = JobId(n as u64 + 1);
        let job = TierJob {
            id,
            request: None,
            op: TierOp::Load,
            chunks: vec![TierChunk::new(key, SlotId(0), len_of(key))],
        };
        tier.submit(job).unwrap();
        let start = std::time::Instant::now();
        let done = loop {
            tier.poll(&mut out);
            if let Some(done) = out.pop() {
                break done;
            }
            assert!(start.elapsed() < DEADLINE, "load did not complete");
            std::thread::yield_now();
        };
        if done.is_success() {
            assert!(
                memory.matches(SlotId(0), len_of(key) as usize, key.hash_low()),
                "key {key:?} loaded with wrong bytes"
            );
            loaded += 1;
        } else {
            assert_eq!(
                tier.lookup(key),
                TierLookup::Miss,
                "failed key still indexed"
            );
            failed += 1;
        }
    }
    eprintln!(
        "crash test: after {ROUNDS} kills, {temps_before} temporary files swept, {} unsealed \
         segments recovered ({} torn records cut), {} chunks indexed: {loaded} verified, \
         {failed} removed",
        start_stats.open_segments_recovered,
        start_stats.torn_records_dropped,
        keys.len()
    );
    // A record enters the index only after its write completed, and the scan verified every
    // record of the unsealed segments, so none should even need removing.
    assert_eq!(failed, 0);
    drop(tier);
    // The restart sealed what it recovered, and its own shutdown sealed its segments.
    let tier = FsTier::start(
        FsTierConfig {
            capacity_bytes: CHILD_CAPACITY,
            ..config(dir.path(), EngineChoice::Sync)
        },
        memory as Arc<dyn SlotMemory>,
    )
    .unwrap();
    assert_eq!(tier.stats().open_segments_recovered, 0);
    assert_eq!(tier.chunk_count(), keys.len());
}
