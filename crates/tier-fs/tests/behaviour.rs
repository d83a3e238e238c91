//! Behaviour of the disk tier, each test body run against both I/O engines: round trips (full
//! and partial chunks), warm restarts, the start-up sweep, capacity eviction, and one test per
//! injected fault (EINVAL, ENOSPC, EIO, short write, short read, corruption).

mod common;

use std::fs;
use std::sync::Arc;

use common::*;
use offload_core::tier::{FailedKey, SlotMemory, Tier, TierFailure, TierLookup};
use offload_core::ChunkKey;
use tier_fs::{
    EngineChoice, FailureKind, Fault, FaultPlan, FaultRule, FaultSite, FsError, FsTier,
    FsTierConfig,
};
use tier_testkit::fill_slot;

const FULL: u32 = SLOT_BYTES as u32;

/// Four chunks: a full slot, a slot less one byte, one byte, and an unaligned middle length.
fn four_chunks() -> Vec<(offload_core::ChunkKey, u32, u32, u64)> {
    vec![
        (key(1), 0, FULL, 101),
        (key(2), 1, FULL - 1, 102),
        (key(3), 2, 1, 103),
        (key(4), 3, 5000, 104),
    ]
}

/// Loads the chunks into slots 8.. and checks their bytes.
fn load_and_check(rig: &mut Rig, chunks: &[(offload_core::ChunkKey, u32, u32, u64)]) {
    let loads: Vec<_> = chunks
        .iter()
        .map(|&(k, slot, len, _)| (k, slot + 8, len))
        .collect();
    let done = rig.load(&loads);
    assert!(done.is_success(), "load failed keys {:?}", done.failed);
    for &(_, slot, len, seed) in chunks {
        assert!(
            rig.slot_is(slot + 8, len, seed),
            "slot {} differs",
            slot + 8
        );
    }
}

fn round_trip(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::start(config(dir.path(), engine));
    let stats = rig.tier.stats();
    let expected_engine = if engine == EngineChoice::Uring {
        "io_uring"
    } else {
        "sync"
    };
    assert_eq!(stats.engine, expected_engine);
    assert_eq!(rig.tier.medium(), offload_core::Medium::Disk);
    let chunks = four_chunks();
    assert_eq!(rig.lookup(key(1)), TierLookup::Miss);
    let done = rig.store(&chunks);
    assert!(done.is_success(), "store failed keys {:?}", done.failed);
    for &(k, ..) in &chunks {
        assert_eq!(rig.lookup(k), TierLookup::Hit);
    }
    load_and_check(&mut rig, &chunks);
    // One segment holds the four records, padded to 4 KiB; no temporary left.
    let root = dir.path();
    assert_eq!(rig.tier.chunk_count(), 4);
    assert_eq!(files_with_suffix(root, ".seg").len(), 1);
    assert_eq!(rig.tier.segment_count(), 1);
    assert!(files_with_suffix(root, ".tmp").is_empty());
    assert_eq!(chunk_file_bytes(root), rig.tier.used_bytes());
    assert_eq!(chunk_file_bytes(root) % 4096, 0);
    // The open segment was allocated whole before the first writes went out (and counts).
    assert_eq!(rig.tier.stats().bytes_preallocated, chunk_file_bytes(root));
    // A second store of the same keys is not rewritten.
    let done = rig.store(&chunks);
    assert!(done.is_success());
    let stats = rig.tier.stats();
    assert_eq!(stats.chunks_stored, 4);
    assert_eq!(stats.stores_skipped, 4);
    assert_eq!(stats.chunks_loaded, 4);
    // A load asking for another length fails that key only and keeps the file.
    let done = rig.load(&[(key(4), 9, 4999), (key(1), 10, FULL)]);
    assert_eq!(
        done.failed,
        vec![FailedKey::new(key(4), TierFailure::Corrupt)]
    );
    assert!(rig.slot_is(10, FULL, 101));
    assert_eq!(rig.lookup(key(4)), TierLookup::Hit);
    assert_eq!(rig.tier.stats().failures_of(FailureKind::LengthMismatch), 1);
    // Sealing trims the allocated tail: the file holds the four records and the seal.
    let records = rig.tier.used_bytes();
    drop(rig);
    let sealed = chunk_file_bytes(root);
    assert!(sealed < records, "{sealed} >= {records}");
    let mut rig = Rig::start(config(dir.path(), engine));
    assert_eq!(rig.tier.used_bytes(), sealed);
    assert_eq!(rig.lookup(key(1)), TierLookup::Hit);
}

fn restart_is_warm(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let chunks = four_chunks();
    {
        let mut rig = Rig::start(config(dir.path(), engine));
        assert!(rig.store(&chunks).is_success());
    }
    let mut rig = Rig::start(config(dir.path(), engine));
    assert_eq!(rig.tier.stats().chunks_found_at_start, 4);
    assert_eq!(rig.tier.chunk_count(), 4);
    for &(k, ..) in &chunks {
        assert_eq!(rig.lookup(k), TierLookup::Hit);
    }
    load_and_check(&mut rig, &chunks);
    let namespace_dir = rig.tier.namespace_dir().to_owned();
    drop(rig);
    // Another layout identity lives in another directory and sees nothing.
    let mut other = config(dir.path(), engine);
    other.namespace.tokens_per_chunk = 512;
    let mut rig = Rig::start(other);
    assert_ne!(rig.tier.namespace_dir(), namespace_dir);
    assert_eq!(rig.lookup(key(1)), TierLookup::Miss);
    drop(rig);
    // A namespace file that names another model is refused, naming the field.
    let file = namespace_dir.join("namespace.json");
    let text = fs::read_to_string(&file).unwrap();
    fs::write(&file, text.replace("test-model", "other-model")).unwrap();
    let memory = std::sync::Arc::new(tier_testkit::VecSlotMemory::new(4, 4096));
    match FsTier::start(config(dir.path(), engine), memory) {
        Err(FsError::NamespaceMismatch { field, .. }) => assert_eq!(field, "model"),
        other => panic!("expected a namespace mismatch, got {other:?}"),
    }
}

fn stale_temp_files_are_swept(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let namespace_dir;
    {
        let mut rig = Rig::start(config(dir.path(), engine));
        assert!(rig.store(&[(key(1), 0, FULL, 1)]).is_success());
        namespace_dir = rig.tier.namespace_dir().to_owned();
    }
    let stale = [
        namespace_dir.join("namespace.json.999-3.tmp"),
        namespace_dir.join("direct-probe.999-4.tmp"),
    ];
    for path in &stale {
        fs::write(path, b"half a file").unwrap();
    }
    // A file named like a segment without a single record in it is removed too.
    let junk = namespace_dir.join("00000000000000aa-00000000.seg");
    fs::write(&junk, b"junk").unwrap();
    // In a shared directory, fresh temporary files and unsealed segments may belong to a live
    // instance: kept.
    {
        let shared = FsTierConfig {
            shared_dir: true,
            ..config(dir.path(), engine)
        };
        let rig = Rig::start(shared);
        assert_eq!(rig.tier.stats().tmp_removed_at_start, 0);
        assert_eq!(files_with_suffix(dir.path(), ".tmp").len(), 2);
        assert!(junk.exists());
    }
    let mut rig = Rig::start(config(dir.path(), engine));
    let stats = rig.tier.stats();
    assert_eq!(stats.tmp_removed_at_start, 3);
    assert!(files_with_suffix(dir.path(), ".tmp").is_empty());
    assert!(!junk.exists());
    assert_eq!(rig.tier.chunk_count(), 1);
    assert!(rig.load(&[(key(1), 8, FULL)]).is_success());
    assert!(rig.slot_is(8, FULL, 1));
}

/// A record header of format version 2 (64-bit keys), as kvtier wrote it before 128-bit keys:
/// magic, version, header length, u64 hash, u32 group, u32 kind, u64 payload length, xxh3-64 of
/// the payload, xxh3-64 of the 48 bytes before it; then the payload padded to 4 KiB.
fn version_2_record(hash: u64, group: u32, kind: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; 4096 + payload.len().div_ceil(4096) * 4096];
    out[0..8].copy_from_slice(b"KVTIERFS");
    out[8..12].copy_from_slice(&2u32.to_le_bytes());
    out[12..16].copy_from_slice(&4096u32.to_le_bytes());
    out[16..24].copy_from_slice(&hash.to_le_bytes());
    out[24..28].copy_from_slice(&group.to_le_bytes());
    out[28..32].copy_from_slice(&kind.to_le_bytes());
    out[32..40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let sum = tier_fs::format::xxh3_64(payload);
    out[40..48].copy_from_slice(&sum.to_le_bytes());
    let own = tier_fs::format::xxh3_64(&out[0..48]);
    out[48..56].copy_from_slice(&own.to_le_bytes());
    out[4096..4096 + payload.len()].copy_from_slice(payload);
    out
}

/// A sealed segment of format version 2 (an older kvtier's, 64-bit keys) is never indexed or
/// loaded, under any key with its hash in the low 64 bits, and is left as it is, in a private
/// directory (which recovers and sweeps its own segments) and in a shared one.
#[test]
fn version_2_segments_are_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let old_key = key(7);
    let namespace_dir = {
        let mut rig = Rig::start(config(dir.path(), EngineChoice::Sync));
        assert!(rig.store(&[(key(1), 0, FULL, 1)]).is_success());
        rig.tier.namespace_dir().to_owned()
    };
    let payload = bytes_of(7, FULL as usize);
    let mut image = version_2_record(old_key.hash_low(), old_key.group, 0, &payload);
    image.extend(version_2_record(0, 0, 2, &[]));
    let old = namespace_dir.join("00000000000000bb-00000000.seg");
    fs::write(&old, &image).unwrap();
    for shared_dir in [false, true] {
        let mut rig = Rig::start(FsTierConfig {
            shared_dir,
            ..config(dir.path(), EngineChoice::Sync)
        });
        let stats = rig.tier.stats();
        assert_eq!(stats.old_format_segments, 1, "shared {shared_dir}");
        assert_eq!(rig.tier.chunk_count(), 1, "only the chunk of this version");
        let low_only = ChunkKey::new(u128::from(old_key.hash_low()), old_key.group);
        for k in [old_key, low_only] {
            assert_eq!(rig.lookup(k), TierLookup::Miss, "{k:?}");
            let done = rig.load(&[(k, 8, FULL)]);
            assert_eq!(done.failed, vec![FailedKey::new(k, TierFailure::Missing)]);
        }
        assert!(rig.load(&[(key(1), 9, FULL)]).is_success());
        assert!(rig.slot_is(9, FULL, 1));
        drop(rig);
        assert_eq!(
            fs::read(&old).unwrap(),
            image,
            "the old segment is left as it was"
        );
    }
}

fn capacity_evicts_least_recently_used(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    // Segments are kept under capacity / (4 * workers), smaller than a chunk here: each chunk
    // lands in its own segment (its record and a seal), so eviction is per chunk.
    let capacity = 5 * (FULL_FILE_BYTES + SEAL_BYTES);
    let mut rig = Rig::start(FsTierConfig {
        capacity_bytes: capacity,
        ..config(dir.path(), engine)
    });
    for n in 0..5 {
        assert!(rig.store(&[(key(n), 0, FULL, n)]).is_success());
    }
    // key(0) becomes the most recently used; the next store evicts key(1).
    rig.tier.touch(&[key(0)]);
    assert!(rig.store(&[(key(5), 0, FULL, 5)]).is_success());
    assert_eq!(rig.lookup(key(1)), TierLookup::Miss);
    assert_eq!(rig.lookup(key(0)), TierLookup::Hit);
    for n in 6..14 {
        assert!(rig.store(&[(key(n), 0, FULL, n)]).is_success());
        assert!(rig.tier.used_bytes() <= capacity);
        assert!(chunk_file_bytes(dir.path()) <= capacity);
    }
    assert_eq!(rig.tier.chunk_count(), 5);
    assert_eq!(rig.tier.stats().evictions, 9);
    for n in 9..14 {
        assert_eq!(rig.lookup(key(n)), TierLookup::Hit, "key {n}");
    }
    // Every evicted key is reported once, oldest first: key(1) first, then 2..=4, 0, 5..=8.
    let mut removed = Vec::new();
    assert_eq!(rig.tier.take_removed(&mut removed), 0);
    let expected: Vec<_> = [1, 2, 3, 4, 0, 5, 6, 7, 8].map(key).to_vec();
    assert_eq!(removed, expected);
    for k in &removed {
        assert_eq!(rig.lookup(*k), TierLookup::Miss);
    }
    removed.clear();
    assert_eq!(rig.tier.take_removed(&mut removed), 0);
    assert!(removed.is_empty(), "reported twice: {removed:?}");
    // A multi-chunk job larger than the limit keeps what fits and fails the rest.
    let big: Vec<_> = (20..27)
        .map(|n| (key(n), (n - 20) as u32, FULL, n))
        .collect();
    let done = rig.store(&big);
    assert_eq!(done.failed.len(), 2, "failed {:?}", done.failed);
    assert!(rig.tier.used_bytes() <= capacity);
    assert_eq!(chunk_file_bytes(dir.path()), rig.tier.used_bytes());
    assert_eq!(rig.tier.stats().failures_of(FailureKind::Capacity), 2);
}

fn faulty(engine: EngineChoice, dir: &std::path::Path, rules: Vec<FaultRule>) -> Rig {
    Rig::start(FsTierConfig {
        faults: FaultPlan::new(rules),
        ..config(dir, engine)
    })
}

fn einval_falls_back_to_buffered(engine: EngineChoice) {
    for site in [FaultSite::Open, FaultSite::Write, FaultSite::Read] {
        let dir = tempfile::tempdir().unwrap();
        let rules = vec![FaultRule::on_key(site, Fault::Einval, key(2))];
        let mut rig = faulty(engine, dir.path(), rules);
        assert!(
            rig.tier.stats().direct_io,
            "{site:?}: O_DIRECT not in use at start"
        );
        let chunks = four_chunks();
        let done = rig.store(&chunks);
        assert!(
            done.is_success(),
            "{site:?}: store failed {:?}",
            done.failed
        );
        load_and_check(&mut rig, &chunks);
        let stats = rig.tier.stats();
        assert!(!stats.direct_io, "{site:?}: still O_DIRECT");
        assert_eq!(stats.direct_fallbacks, 1, "{site:?}");
        assert_eq!(stats.warnings, 1, "{site:?}");
        assert_eq!(stats.failures_total(), 0, "{site:?}");
        assert!(files_with_suffix(dir.path(), ".tmp").is_empty());
        // Later stores and loads run buffered.
        let more = [(key(9), 5, FULL, 9)];
        assert!(rig.store(&more).is_success());
        load_and_check(&mut rig, &more);
    }
}

fn enospc_fails_cleanly(engine: EngineChoice) {
    for site in [FaultSite::Open, FaultSite::Write] {
        let dir = tempfile::tempdir().unwrap();
        let rules = vec![FaultRule::on_key(site, Fault::Enospc, key(2)).times(1)];
        let mut rig = faulty(engine, dir.path(), rules);
        let chunks = four_chunks();
        let done = rig.store(&chunks);
        assert_eq!(
            done.failed,
            vec![FailedKey::new(key(2), TierFailure::Io)],
            "{site:?}"
        );
        assert!(files_with_suffix(dir.path(), ".tmp").is_empty(), "{site:?}");
        assert_eq!(rig.tier.chunk_count(), 3, "{site:?}");
        assert_eq!(rig.lookup(key(2)), TierLookup::Miss);
        assert_eq!(rig.tier.used_bytes(), chunk_file_bytes(dir.path()));
        assert_eq!(rig.tier.stats().failures_of(FailureKind::NoSpace), 1);
        // The failed record's space is skipped: a restart still finds the records after it.
        drop(rig);
        let mut rig = faulty(engine, dir.path(), Vec::new());
        assert_eq!(rig.tier.chunk_count(), 3, "{site:?}: after a restart");
        assert_eq!(rig.tier.stats().open_segments_recovered, 0, "{site:?}");
        // The tier still works: the same key stores and everything loads.
        assert!(rig.store(&chunks).is_success());
        load_and_check(&mut rig, &chunks);
    }
}

fn eio_fails_the_key(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let rules = vec![
        FaultRule::on_key(FaultSite::Write, Fault::Eio, key(2)).times(1),
        FaultRule::on_key(FaultSite::Read, Fault::Eio, key(3)).times(1),
    ];
    let mut rig = faulty(engine, dir.path(), rules);
    let chunks = four_chunks();
    assert_eq!(
        rig.store(&chunks).failed,
        vec![FailedKey::new(key(2), TierFailure::Io)]
    );
    assert!(files_with_suffix(dir.path(), ".tmp").is_empty());
    assert_eq!(rig.lookup(key(2)), TierLookup::Miss);
    assert!(rig.store(&chunks).is_success());
    let loads: Vec<_> = chunks.iter().map(|&(k, s, l, _)| (k, s + 8, l)).collect();
    assert_eq!(
        rig.load(&loads).failed,
        vec![FailedKey::new(key(3), TierFailure::Io)]
    );
    assert!(rig.slot_is(8, FULL, 101));
    // A read error may be transient: the file stays and loads next time.
    assert_eq!(rig.lookup(key(3)), TierLookup::Hit);
    load_and_check(&mut rig, &chunks);
    assert_eq!(rig.tier.stats().failures_of(FailureKind::Io), 2);
}

fn short_write_fails_the_key(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let rules = vec![FaultRule::on_key(FaultSite::Write, Fault::Short, key(1)).times(1)];
    let mut rig = faulty(engine, dir.path(), rules);
    let chunks = four_chunks();
    assert_eq!(
        rig.store(&chunks).failed,
        vec![FailedKey::new(key(1), TierFailure::Io)]
    );
    assert!(files_with_suffix(dir.path(), ".tmp").is_empty());
    assert_eq!(rig.tier.chunk_count(), 3);
    assert_eq!(rig.tier.used_bytes(), chunk_file_bytes(dir.path()));
    assert_eq!(rig.lookup(key(1)), TierLookup::Miss);
    assert_eq!(rig.tier.stats().failures_of(FailureKind::ShortWrite), 1);
    assert!(rig.store(&chunks).is_success());
    load_and_check(&mut rig, &chunks);
}

fn short_read_removes_the_file(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let rules = vec![FaultRule::on_key(FaultSite::Read, Fault::Short, key(2))];
    let mut rig = faulty(engine, dir.path(), rules);
    let chunks = four_chunks();
    assert!(rig.store(&chunks).is_success());
    let loads: Vec<_> = chunks.iter().map(|&(k, s, l, _)| (k, s + 8, l)).collect();
    assert_eq!(
        rig.load(&loads).failed,
        vec![FailedKey::new(key(2), TierFailure::Corrupt)]
    );
    for &(_, slot, len, seed) in [chunks[0], chunks[2], chunks[3]].iter() {
        assert!(rig.slot_is(slot + 8, len, seed));
    }
    assert_eq!(rig.lookup(key(2)), TierLookup::Miss);
    assert_eq!(rig.tier.chunk_count(), 3);
    let stats = rig.tier.stats();
    assert_eq!(stats.failures_of(FailureKind::ShortRead), 1);
    assert_eq!(stats.quarantined, 1);
    assert_eq!(rig.tier.used_bytes(), chunk_file_bytes(dir.path()));
}

fn corruption_is_detected_and_quarantined(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let rules = vec![
        FaultRule::on_key(FaultSite::Write, Fault::Corrupt, key(1)),
        FaultRule::on_key(FaultSite::Read, Fault::Corrupt, key(3)),
    ];
    let mut rig = faulty(engine, dir.path(), rules);
    let chunks = four_chunks();
    assert!(rig.store(&chunks).is_success());
    // Damage key(4)'s record on disk behind the tier's back.
    let (path, offset) = rig.tier.chunk_location(key(4)).unwrap();
    let mut bytes = fs::read(&path).unwrap();
    bytes[offset as usize + 4096 + 10] ^= 0xFF;
    fs::write(&path, bytes).unwrap();
    let loads: Vec<_> = chunks.iter().map(|&(k, s, l, _)| (k, s + 8, l)).collect();
    let mut failed = rig.load(&loads).failed_keys().collect::<Vec<_>>();
    failed.sort();
    let mut expected = vec![key(1), key(3), key(4)];
    expected.sort();
    assert_eq!(failed, expected);
    assert!(rig.slot_is(9, FULL - 1, 102));
    for k in [key(1), key(3), key(4)] {
        assert_eq!(rig.lookup(k), TierLookup::Miss);
    }
    assert_eq!(rig.tier.chunk_count(), 1);
    let stats = rig.tier.stats();
    assert_eq!(stats.failures_of(FailureKind::Corrupt), 3);
    assert_eq!(stats.quarantined, 3);
    // The quarantined records are covered by skip records: a restart does not index them again.
    drop(rig);
    let mut rig = Rig::start(config(dir.path(), engine));
    assert_eq!(rig.tier.chunk_count(), 1);
    assert!(rig.load(&[(key(2), 9, FULL - 1)]).is_success());
    assert!(rig.slot_is(9, FULL - 1, 102));
}

fn every_nth_rule_and_durable_stores(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::start(FsTierConfig {
        durability: tier_fs::Durability::Fsync,
        faults: FaultPlan::new(vec![FaultRule::every_nth(FaultSite::Write, Fault::Eio, 3)]),
        ..config(dir.path(), engine)
    });
    let chunks: Vec<_> = (0..6).map(|n| (key(n), n as u32, FULL, n)).collect();
    let done = rig.store(&chunks);
    assert_eq!(done.failed.len(), 2, "failed {:?}", done.failed);
    let kept: Vec<_> = chunks
        .iter()
        .copied()
        .filter(|c| done.failure_of(c.0).is_none())
        .collect();
    load_and_check(&mut rig, &kept);
}

/// Full-slot chunks (4 KiB multiples) in aligned host memory move without bounce buffers, in both
/// directions (and through bounce buffers in memory without a stable address), and the injected
/// faults on them are still caught: a corrupted write (which goes
/// through a bounce buffer, since a store never modifies its slot), a corrupted read (detected
/// in the slot), a short write and a short read.
fn zero_copy_faults_are_caught(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let rules = vec![
        FaultRule::on_key(FaultSite::Write, Fault::Corrupt, key(1)).times(1),
        FaultRule::on_key(FaultSite::Write, Fault::Short, key(2)).times(1),
        FaultRule::on_key(FaultSite::Read, Fault::Corrupt, key(3)).times(1),
        FaultRule::on_key(FaultSite::Read, Fault::Short, key(4)).times(1),
    ];
    let mut rig = faulty(engine, dir.path(), rules);
    let stats = rig.tier.stats();
    if !stats.direct_io {
        eprintln!(
            "NOTE zero_copy_faults_are_caught: no O_DIRECT here; the zero-copy path is not taken"
        );
        return;
    }
    let aligned = rig.memory.slot_ptr(offload_core::SlotId(0)).is_some();
    let chunks: Vec<_> = (1..=5).map(|n| (key(n), n as u32, FULL, 200 + n)).collect();
    assert_eq!(
        rig.store(&chunks).failed,
        vec![FailedKey::new(key(2), TierFailure::Io)]
    );
    // Four zero-copy writes (key(2)'s short one included); key(1)'s corrupted one bounced.
    let expected_ops = if aligned { 4 } else { 0 };
    assert_eq!(rig.tier.stats().zero_copy_ops, expected_ops);
    // key(1) was stored corrupted (and still indexed): its load must fail.
    let loads: Vec<_> = chunks.iter().map(|&(k, s, l, _)| (k, s + 8, l)).collect();
    let mut failed = rig.load(&loads[..1]).failed_keys().collect::<Vec<_>>();
    failed.extend(rig.load(&loads[2..]).failed_keys());
    failed.sort();
    let mut expected = vec![key(1), key(3), key(4)];
    expected.sort();
    assert_eq!(failed, expected);
    assert!(rig.slot_is(13, FULL, 205), "the good chunk's slot differs");
    let stats = rig.tier.stats();
    assert_eq!(stats.failures_of(FailureKind::Corrupt), 2, "{stats:?}");
    assert_eq!(stats.failures_of(FailureKind::ShortRead), 1, "{stats:?}");
    assert_eq!(stats.failures_of(FailureKind::ShortWrite), 1, "{stats:?}");
    // Stored again (the faults are spent), everything loads and verifies.
    assert!(rig.store(&chunks).is_success());
    let before = rig.tier.stats().zero_copy_ops;
    load_and_check(&mut rig, &chunks);
    let expected_ops = if aligned { 5 } else { 0 };
    assert_eq!(rig.tier.stats().zero_copy_ops, before + expected_ops);
}

fn neighbouring_records_are_read_at_once(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::start(config(dir.path(), engine));
    let chunks: Vec<_> = (1..=4).map(|n| (key(n), n as u32, FULL, 300 + n)).collect();
    assert!(rig.store(&chunks).is_success());
    let zero_copy_loads = rig.tier.stats().direct_io
        && rig.memory.slot_ptr(offload_core::SlotId(0)).is_some()
        && config(dir.path(), engine).zero_copy_loads;
    load_and_check(&mut rig, &chunks);
    // The four records lie one after another: one read (bounce-buffered loads only).
    let merged = if zero_copy_loads { 0 } else { 4 };
    assert_eq!(rig.tier.stats().reads_merged, merged);
    // Cut the segment inside the third record: a merged read comes back short, the records it
    // read whole still load, and the torn ones fail as short reads (each read again alone).
    let (path, third) = rig.tier.chunk_location(key(3)).unwrap();
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(third + 4096)
        .unwrap();
    let loads: Vec<_> = chunks.iter().map(|&(k, s, l, _)| (k, s + 8, l)).collect();
    let mut failed = rig.load(&loads).failed_keys().collect::<Vec<_>>();
    failed.sort();
    let mut expected = vec![key(3), key(4)];
    expected.sort();
    assert_eq!(failed, expected);
    assert!(rig.slot_is(9, FULL, 301) && rig.slot_is(10, FULL, 302));
    let stats = rig.tier.stats();
    // The torn records fail as short reads, or (when the pipelined loader reads one alone after
    // the segment was cut under it, as seen on a busy CI machine) as a record that no longer
    // verifies; never as a load.
    assert!(stats.failures_of(FailureKind::ShortRead) >= 1, "{stats:?}");
    assert_eq!(stats.failures_total(), 2, "{stats:?}");
}

/// A record damaged on disk in the middle of neighbouring records: the load reads all of them at
/// once (one merged read) and fails only the damaged one; the others land in their slots intact,
/// and the damaged record is quarantined (a later load of it misses).
fn corrupt_record_inside_a_merged_read_fails_alone(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::start(config(dir.path(), engine));
    let chunks: Vec<_> = (1..=4).map(|n| (key(n), n as u32, FULL, 400 + n)).collect();
    assert!(rig.store(&chunks).is_success());
    let zero_copy_loads = rig.tier.stats().direct_io
        && rig.memory.slot_ptr(offload_core::SlotId(0)).is_some()
        && config(dir.path(), engine).zero_copy_loads;
    let (path, second) = rig.tier.chunk_location(key(2)).unwrap();
    let mut bytes = fs::read(&path).unwrap();
    bytes[second as usize + 4096 + 100] ^= 0xFF;
    fs::write(&path, bytes).unwrap();
    let loads: Vec<_> = chunks.iter().map(|&(k, s, l, _)| (k, s + 8, l)).collect();
    assert_eq!(
        rig.load(&loads).failed,
        vec![FailedKey::new(key(2), TierFailure::Corrupt)]
    );
    // The four records were read at once (bounce-buffered loads only).
    let merged = if zero_copy_loads { 0 } else { 4 };
    assert_eq!(rig.tier.stats().reads_merged, merged);
    for (n, slot) in [(401, 9), (403, 11), (404, 12)] {
        assert!(rig.slot_is(slot, FULL, n), "slot {slot} differs");
    }
    let stats = rig.tier.stats();
    assert_eq!(stats.failures_of(FailureKind::Corrupt), 1, "{stats:?}");
    assert_eq!(stats.failures_total(), 1, "{stats:?}");
    assert_eq!(stats.quarantined, 1, "{stats:?}");
    assert_eq!(rig.lookup(key(2)), TierLookup::Miss);
    assert!(rig.load(&loads[2..]).is_success());
}

fn store_jobs_share_one_append_stream(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::start(config(dir.path(), engine));
    // Eight store jobs of two chunks each, all submitted before any completes.
    let mut ids = Vec::new();
    for j in 0..8u64 {
        let chunks: Vec<_> = (0..2u64)
            .map(|c| {
                let n = 100 + 2 * j + c;
                let slot = (2 * j + c) as u32;
                fill_slot(&*rig.memory, offload_core::SlotId(slot), FULL as usize, n);
                offload_core::TierChunk::new(key(n), offload_core::SlotId(slot), FULL)
            })
            .collect();
        let job = offload_core::tier::TierJob {
            id: offload_core::JobId(1000 + j),
            request: None,
            op: offload_core::tier::TierOp::Store,
            chunks,
        };
        rig.tier.submit(job).expect("store accepted");
        ids.push(offload_core::JobId(1000 + j));
    }
    // Exactly one completion per job.
    let mut done = Vec::new();
    let start = std::time::Instant::now();
    while done.len() < ids.len() {
        assert!(start.elapsed() < DEADLINE, "stores not complete: {done:?}");
        rig.tier.poll(&mut done);
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    rig.tier.drain();
    rig.tier.poll(&mut done);
    let mut completed: Vec<_> = done.iter().map(|c| c.id).collect();
    completed.sort();
    assert_eq!(completed, ids);
    assert!(done.iter().all(|c| c.is_success()), "{done:?}");
    // One writer: the sixteen records lie one after another in one segment.
    assert_eq!(files_with_suffix(dir.path(), ".seg").len(), 1);
    let mut offsets: Vec<u64> = (100..116)
        .map(|n| rig.tier.chunk_location(key(n)).unwrap().1)
        .collect();
    offsets.sort_unstable();
    for pair in offsets.windows(2) {
        assert_eq!(pair[1] - pair[0], FULL_FILE_BYTES);
    }
    let check: Vec<_> = (0..8u64)
        .map(|n| (key(100 + n), n as u32, FULL, 100 + n))
        .collect();
    load_and_check(&mut rig, &check);
}

/// Chunks of one size: a fresh segment is allocated for as many records as it takes and the seal,
/// so sealing trims nothing and each sealed file is exactly its records and its seal.
fn uniform_records_fill_their_segments(engine: EngineChoice) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // Three full records fit a segment (a fourth would pass the limit).
    let fitted = 3 * FULL_FILE_BYTES + SEAL_BYTES;
    let cfg = || FsTierConfig {
        segment_bytes_max: 3 * FULL_FILE_BYTES + 1000,
        workers: 1,
        ..config(root, engine)
    };
    let chunks: Vec<_> = (0..6u64)
        .map(|n| (key(300 + n), n as u32, FULL, 300 + n))
        .collect();
    {
        let mut rig = Rig::start(cfg());
        assert!(rig.store(&chunks[..3]).is_success());
        assert!(rig.store(&chunks[3..]).is_success());
        assert_eq!(rig.tier.segment_count(), 2);
        assert_eq!(rig.tier.stats().bytes_preallocated, 2 * fitted);
        // The second segment was made ahead while the first filled (an unnamed file until the
        // writer took it); the one made for a third is never seen on disk.
        assert_eq!(rig.tier.stats().segments_prepared, 1);
        assert_eq!(files_with_suffix(root, ".seg").len(), 2);
        assert_eq!(chunk_file_bytes(root), rig.tier.used_bytes());
    }
    let segments = files_with_suffix(root, ".seg");
    assert_eq!(segments.len(), 2);
    for seg in &segments {
        assert_eq!(std::fs::metadata(seg).unwrap().len(), fitted, "{seg:?}");
    }
    let mut rig = Rig::start(cfg());
    // Both seals (written on the writer's housekeeping thread) were on disk at shutdown.
    assert_eq!(rig.tier.stats().open_segments_recovered, 0);
    assert_eq!(rig.tier.used_bytes(), 2 * fitted);
    assert_eq!(rig.tier.chunk_count(), 6);
    load_and_check(&mut rig, &chunks);
}

macro_rules! engine_tests {
    ($engine:expr, $aligned:expr, $($name:ident)*) => {
        $(
            #[test]
            fn $name() {
                if let Some(engine) = engine_or_skip($engine, stringify!($name)) {
                    use_aligned_memory($aligned);
                    super::$name(engine);
                }
            }
        )*
    };
}

macro_rules! all_engine_tests {
    ($engine:expr, $aligned:expr) => {
        use super::*;
        engine_tests!(
            $engine,
            $aligned,
            round_trip
            restart_is_warm
            stale_temp_files_are_swept
            capacity_evicts_least_recently_used
            einval_falls_back_to_buffered
            enospc_fails_cleanly
            eio_fails_the_key
            short_write_fails_the_key
            short_read_removes_the_file
            corruption_is_detected_and_quarantined
            every_nth_rule_and_durable_stores
            zero_copy_faults_are_caught
            neighbouring_records_are_read_at_once
            corrupt_record_inside_a_merged_read_fails_alone
            store_jobs_share_one_append_stream
            uniform_records_fill_their_segments
        );
    };
}

mod sync_engine {
    all_engine_tests!(EngineChoice::Sync, false);
}

mod uring_engine {
    all_engine_tests!(EngineChoice::Uring, false);
}

/// The same tests over aligned host memory: full-slot chunks take the zero-copy path.
mod sync_engine_aligned {
    all_engine_tests!(EngineChoice::Sync, true);
}

mod uring_engine_aligned {
    all_engine_tests!(EngineChoice::Uring, true);
}

/// Says loudly when the io_uring variants above did not run.
#[test]
fn uring_tests_ran() {
    if !uring_available() {
        eprintln!("WARNING: io_uring is unavailable here; the uring_engine tests were skipped");
    }
}

#[test]
fn bad_config_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let memory = std::sync::Arc::new(tier_testkit::VecSlotMemory::new(4, 4096));
    let bad = FsTierConfig {
        jobs_in_flight_max: 0,
        ..config(dir.path(), EngineChoice::Sync)
    };
    match FsTier::start(bad, memory) {
        Err(FsError::Config { field, .. }) => assert_eq!(field, "jobs_in_flight_max"),
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn shared_directory_probe_finds_chunks_of_another_instance() {
    let dir = tempfile::tempdir().unwrap();
    let shared = || FsTierConfig {
        shared_dir: true,
        ..config(dir.path(), EngineChoice::Sync)
    };
    let mut writer = Rig::start(shared());
    let mut reader = Rig::start(shared());
    let chunks = [(key(1), 0, FULL, 7), (key(2), 1, 100, 8)];
    assert!(writer.store(&chunks).is_success());
    // The reader's index does not know the keys: the first lookup starts a probe.
    assert_eq!(reader.tier.lookup(key(1)), TierLookup::Retry);
    assert_eq!(reader.lookup(key(1)), TierLookup::Hit);
    assert_eq!(reader.lookup(key(2)), TierLookup::Hit);
    assert_eq!(reader.lookup(key(99)), TierLookup::Miss);
    load_and_check(&mut reader, &chunks);
    let stats = reader.tier.stats();
    // The first probe's walk over the writer's segment found both keys.
    assert_eq!(stats.probe_hits, 1);
    assert_eq!(stats.probes, 2);
    // The reader never writes into the writer's segment.
    drop(reader);
    assert!(writer.store(&[(key(3), 2, FULL, 9)]).is_success());
    load_and_check(&mut writer, &[(key(3), 2, FULL, 9), chunks[0], chunks[1]]);
    // A segment that other instances read while it grows is never preallocated (a probe could
    // see a record's header before its payload).
    assert_eq!(writer.tier.stats().bytes_preallocated, 0);
}

/// KV bytes can reveal prompts: the namespace directory is the owner's alone (0700, files 0600),
/// and two tiers never run over one private directory (the second is refused with a reason until
/// the first shuts down); shared tiers share it, but not with a private one.
#[test]
fn namespace_directory_is_private_and_locked() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let mut first = Rig::start(config(dir.path(), EngineChoice::Sync));
    assert!(first.store(&four_chunks()).is_success());
    let ns = first.tier.namespace_dir().to_path_buf();
    let mode = |p: &std::path::Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&ns), 0o700, "namespace directory");
    let files: Vec<_> = fs::read_dir(&ns)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(files
        .iter()
        .any(|p| p.extension().is_some_and(|e| e == "seg")));
    for f in &files {
        assert_eq!(mode(f), 0o600, "{f:?}");
    }
    let memory: Arc<dyn SlotMemory> = Arc::new(tier_testkit::VecSlotMemory::new(4, SLOT_BYTES));
    let refused = |shared: bool| {
        let c = FsTierConfig {
            shared_dir: shared,
            ..config(dir.path(), EngineChoice::Sync)
        };
        match FsTier::start(c, Arc::clone(&memory)) {
            Ok(_) => panic!("a second tier started over a locked directory (shared {shared})"),
            Err(e) => e.to_string(),
        }
    };
    let why = refused(false);
    assert!(why.contains("root_dir") && why.contains("in use"), "{why}");
    refused(true);
    first.tier.shutdown();
    // Shut down: the directory is free; shared tiers then run side by side, a private one not.
    let shared = |d: &std::path::Path| FsTierConfig {
        shared_dir: true,
        ..config(d, EngineChoice::Sync)
    };
    let a = FsTier::start(shared(dir.path()), Arc::clone(&memory)).expect("first shared tier");
    let b = FsTier::start(shared(dir.path()), Arc::clone(&memory)).expect("second shared tier");
    assert!(refused(false).contains("in use"));
    drop((a, b));
    let mut again = Rig::start(config(dir.path(), EngineChoice::Sync));
    assert_eq!(again.tier.chunk_count(), 4);
    again.tier.shutdown();
}

#[test]
fn shutdown_returns_at_its_deadline_when_the_disk_hangs_and_keeps_memory_and_directory() {
    // Issue 18 item 5: a writer stuck in I/O held shutdown (and every drop) forever. Now the
    // shutdown gives up at its deadline, counts it, leaves the job unreported, and the stuck
    // thread keeps the host memory and the directory lock until it really ends.
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::start(FsTierConfig {
        faults: FaultPlan::new(vec![FaultRule::on_key(
            FaultSite::Open,
            Fault::Stall,
            key(1),
        )]),
        shutdown_deadline: std::time::Duration::from_millis(500),
        ..config(dir.path(), EngineChoice::Sync)
    });
    let job = offload_core::tier::TierJob {
        id: offload_core::JobId(1),
        request: None,
        op: offload_core::tier::TierOp::Store,
        chunks: vec![offload_core::TierChunk::new(
            key(1),
            offload_core::SlotId(0),
            FULL,
        )],
    };
    rig.tier.submit(job).expect("accepted");
    let start = std::time::Instant::now();
    while rig.tier.stats().stalls == 0 {
        assert!(
            start.elapsed() < DEADLINE,
            "the writer never reached the stall"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let memory = Arc::clone(&rig.memory);
    rig.tier.shutdown();
    let stats = rig.tier.stats();
    assert_eq!((stats.shutdown_timeouts, stats.threads_detached), (1, 1));
    let mut out = Vec::new();
    rig.tier.poll(&mut out);
    assert!(
        out.is_empty(),
        "a job that may still run is never reported: {out:?}"
    );
    // The stuck writer still holds the host memory (ours, the rig's, its own).
    assert_eq!(Arc::strong_count(&memory), 3);
    // And the directory: another tier over it is refused while the writer may write it.
    let other: Arc<dyn SlotMemory> = Arc::new(tier_testkit::VecSlotMemory::new(4, SLOT_BYTES));
    assert!(
        FsTier::start(config(dir.path(), EngineChoice::Sync), other).is_err(),
        "the directory was handed on while its writer may still write it"
    );
    // Once the disk answers, the writer ends and lets the memory go.
    rig.tier.release_stalls();
    let start = std::time::Instant::now();
    while Arc::strong_count(&memory) > 2 {
        assert!(start.elapsed() < DEADLINE, "the writer never ended");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn drain_returns_at_its_deadline_when_the_disk_hangs_and_the_job_is_reported_later() {
    // Issue 18 item 5: `Tier::drain` waited forever behind a hung disk. Now it returns at
    // `drain_deadline`, counted and warned once; the job stays in flight and is reported once,
    // when the disk answers.
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::start(FsTierConfig {
        faults: FaultPlan::new(vec![FaultRule::on_key(
            FaultSite::Open,
            Fault::Stall,
            key(1),
        )]),
        drain_deadline: std::time::Duration::from_millis(300),
        ..config(dir.path(), EngineChoice::Sync)
    });
    let job = offload_core::tier::TierJob {
        id: offload_core::JobId(1),
        request: None,
        op: offload_core::tier::TierOp::Store,
        chunks: vec![offload_core::TierChunk::new(
            key(1),
            offload_core::SlotId(0),
            FULL,
        )],
    };
    rig.tier.submit(job).expect("accepted");
    let start = std::time::Instant::now();
    while rig.tier.stats().stalls == 0 {
        assert!(
            start.elapsed() < DEADLINE,
            "the writer never reached the stall"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    rig.tier.drain();
    let warnings = rig.tier.stats().warnings;
    rig.tier.drain();
    let stats = rig.tier.stats();
    assert_eq!(
        stats.drain_timeouts, 2,
        "each drain past its deadline counts"
    );
    assert_eq!(stats.warnings, warnings, "warned once, not per drain");
    let mut out = Vec::new();
    rig.tier.poll(&mut out);
    assert!(
        out.is_empty(),
        "the stalled job is still in flight: {out:?}"
    );
    rig.tier.release_stalls();
    let start = std::time::Instant::now();
    while out.is_empty() {
        assert!(start.elapsed() < DEADLINE, "the job was never reported");
        rig.tier.poll(&mut out);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(out.len(), 1, "reported once: {out:?}");
    assert_eq!(out[0].id, offload_core::JobId(1));
    // A drain with nothing in flight returns at once and counts nothing.
    rig.tier.drain();
    assert_eq!(rig.tier.stats().drain_timeouts, 2);
}

#[test]
fn shutdown_detaches_a_probe_thread_stuck_on_a_hung_shared_directory() {
    // Issue 18 item 5: stopping the probe thread joined it with no deadline, so a shutdown
    // waited as long as the directory listing hung. Now it waits `shutdown_deadline`, then
    // detaches the thread and counts it.
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::start(FsTierConfig {
        shared_dir: true,
        faults: FaultPlan::new(vec![FaultRule::on_key(
            FaultSite::Probe,
            Fault::Stall,
            key(1),
        )]),
        shutdown_deadline: std::time::Duration::from_millis(300),
        ..config(dir.path(), EngineChoice::Sync)
    });
    assert_eq!(rig.tier.lookup(key(1)), TierLookup::Retry);
    let start = std::time::Instant::now();
    while rig.tier.stats().stalls == 0 {
        assert!(
            start.elapsed() < DEADLINE,
            "the probe never reached the stall"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    rig.tier.shutdown();
    let stats = rig.tier.stats();
    assert_eq!((stats.shutdown_timeouts, stats.threads_detached), (0, 1));
    // The workers ended and the probe thread only reads: the directory is free again.
    let other: Arc<dyn SlotMemory> = Arc::new(tier_testkit::VecSlotMemory::new(4, SLOT_BYTES));
    assert!(FsTier::start(config(dir.path(), EngineChoice::Sync), other).is_ok());
    rig.tier.release_stalls();
}
