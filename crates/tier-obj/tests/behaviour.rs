//! The object tier's own behaviour beyond the conformance suite: warm restart from a listing,
//! damaged objects (never served, deleted, reported through `take_evicted`), request and drain
//! deadlines, `Busy` and cancel of requests under way, multipart uploads, and the GCS and Azure
//! backends' configuration.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{
    FailedKey, SlotMemory, SubmitError, Tier, TierFailure, TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobId, SlotId};
use tier_obj::object_store::memory::InMemory;
use tier_obj::object_store::path::Path;
use tier_obj::object_store::throttle::{ThrottleConfig, ThrottledStore};
use tier_obj::object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use tier_obj::{AzureConfig, Backend, GcsConfig, ObjTier, ObjTierConfig};
use tier_testkit::VecSlotMemory;

use common::{block_on, flip_byte, job, wait, wait_all};

const SLOT_BYTES: usize = 16 * 1024;
/// How long a job may take here (the in-memory backend answers at once).
const WAIT: Duration = Duration::from_secs(10);

fn memory() -> Arc<VecSlotMemory> {
    Arc::new(VecSlotMemory::new(32, SLOT_BYTES))
}

fn key(i: u64) -> ChunkKey {
    ChunkKey::new(
        0xBEEF << 64 | u128::from(0x00C0_FFEE_0000 + i),
        (i % 3) as u32,
    )
}

/// Stores `key(0..n)` from slots `0..n` (6000 bytes each, filled from `seed + i`) as job 1, and
/// waits for it to succeed.
fn store_chunks(tier: &mut ObjTier, mem: &VecSlotMemory, n: u32, seed: u64) {
    let chunks: Vec<_> = (0..n)
        .map(|i| {
            mem.fill(SlotId(i), 6000, seed + u64::from(i));
            (key(u64::from(i)), SlotId(i), 6000)
        })
        .collect();
    tier.submit(job(1, TierOp::Store, chunks)).expect("submit");
    assert!(wait(tier, 1, WAIT).is_success());
}

/// `keys`, each failed for `kind`, as a completion lists them.
fn failed(keys: &[ChunkKey], kind: TierFailure) -> Vec<FailedKey> {
    keys.iter().map(|&k| FailedKey::new(k, kind)).collect()
}

#[test]
fn warm_restart_rebuilds_the_index_and_loads_byte_identical() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let backend = Backend::Local {
        root: dir.path().to_path_buf(),
    };
    let mem = memory();
    let lens = [SLOT_BYTES as u32, 1, 5000, SLOT_BYTES as u32 - 1];
    let chunks: Vec<_> = (0..4u32)
        .map(|i| {
            mem.fill(SlotId(i), lens[i as usize] as usize, 100 + u64::from(i));
            (key(u64::from(i)), SlotId(i), lens[i as usize])
        })
        .collect();
    {
        let store = backend.open().expect("store");
        let mut tier = common::tier(common::config(), store, mem.clone());
        tier.submit(job(1, TierOp::Store, chunks.clone()))
            .expect("submit");
        assert!(wait(&mut tier, 1, WAIT).is_success());
        assert!(
            tier.stats().multipart_uploads >= 1,
            "a full slot crosses the threshold"
        );
    }
    // Objects that are not chunks of this namespace are ignored by the listing.
    let store = backend.open().expect("store");
    block_on(async {
        let other = Path::from("kvtier-test/0000000000000001/00000000000000aa-0");
        store
            .put(&other, PutPayload::from_static(b"x"))
            .await
            .expect("put");
        let stray = Path::from("kvtier-test/notes.txt");
        store
            .put(&stray, PutPayload::from_static(b"x"))
            .await
            .expect("put");
    });
    let mut tier = common::tier(common::config(), store, mem.clone());
    let stray_name = tier.dir().clone().join("not-a-key");
    block_on(tier_obj_put(&backend, &stray_name));
    assert_eq!(tier.key_count(), 4);
    assert_eq!(tier.stats().keys_listed, 4);
    for &(k, _, _) in &chunks {
        assert_eq!(tier.lookup(k), TierLookup::Hit);
    }
    assert_eq!(tier.lookup(key(99)), TierLookup::Miss);
    let loads: Vec<_> = chunks
        .iter()
        .map(|&(k, slot, len)| {
            mem.fill(SlotId(slot.0 + 16), SLOT_BYTES, 7);
            (k, SlotId(slot.0 + 16), len)
        })
        .collect();
    tier.submit(job(2, TierOp::Load, loads)).expect("submit");
    assert!(wait(&mut tier, 2, WAIT).is_success());
    for (i, &len) in lens.iter().enumerate() {
        assert!(
            mem.matches(SlotId(16 + i as u32), len as usize, 100 + i as u64),
            "chunk {i} loaded after restart differs"
        );
    }
}

async fn tier_obj_put(backend: &Backend, path: &Path) {
    let store = backend.open().expect("store");
    store
        .put(path, PutPayload::from_static(b"junk"))
        .await
        .expect("put");
}

/// A chunk object of record format version 2 (64-bit keys, an older kvtier's), as it wrote it.
fn version_2_record(hash: u64, group: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; 4096 + payload.len().div_ceil(4096) * 4096];
    out[0..8].copy_from_slice(b"KVTIERFS");
    out[8..12].copy_from_slice(&2u32.to_le_bytes());
    out[12..16].copy_from_slice(&4096u32.to_le_bytes());
    out[16..24].copy_from_slice(&hash.to_le_bytes());
    out[24..28].copy_from_slice(&group.to_le_bytes());
    out[32..40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    out[40..48].copy_from_slice(&tier_obj::record::xxh3_64(payload).to_le_bytes());
    let own = tier_obj::record::xxh3_64(&out[0..48]);
    out[48..56].copy_from_slice(&own.to_le_bytes());
    out[4096..4096 + payload.len()].copy_from_slice(payload);
    out
}

/// Objects of record format version 2 are never served: one under its old name (16 hex digits)
/// is not listed (counted, warned), and a version 2 record under a current name fails its key
/// by its version and is deleted like any damaged object.
#[test]
fn version_2_objects_are_never_loaded() {
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let mem = memory();
    let dir = {
        let mut tier = common::tier(common::config(), store.clone(), mem.clone());
        mem.fill(SlotId(0), 6000, 300);
        tier.submit(job(1, TierOp::Store, vec![(key(0), SlotId(0), 6000)]))
            .expect("submit");
        assert!(wait(&mut tier, 1, WAIT).is_success());
        tier.dir().clone()
    };
    let (old, renamed) = (key(5), key(6));
    let payload = vec![0x55u8; 6000];
    let old_name = format!("{:016x}-{}", old.hash_low(), old.group);
    assert!(tier_obj::tier::is_version_2_object_name(&old_name));
    assert!(tier_obj::tier::parse_object_name(&old_name).is_none());
    let new_name = tier_obj::tier::object_name(renamed);
    assert!(!tier_obj::tier::is_version_2_object_name(&new_name));
    block_on(async {
        for (name, k) in [(&old_name, old), (&new_name, renamed)] {
            let record = version_2_record(k.hash_low(), k.group, &payload);
            let path = dir.clone().join(name.as_str());
            store.put(&path, PutPayload::from(record)).await.unwrap();
        }
    });
    let mut tier = common::tier(common::config(), store.clone(), mem.clone());
    assert_eq!(tier.stats().old_format_objects, 1);
    assert_eq!(tier.key_count(), 2, "key 0 and the current name");
    let low_only = ChunkKey::new(u128::from(old.hash_low()), old.group);
    assert_eq!(tier.lookup(old), TierLookup::Miss);
    assert_eq!(tier.lookup(low_only), TierLookup::Miss);
    mem.fill(SlotId(8), SLOT_BYTES, 9);
    mem.fill(SlotId(9), SLOT_BYTES, 9);
    let loads = vec![(renamed, SlotId(8), 6000), (key(0), SlotId(9), 6000)];
    tier.submit(job(2, TierOp::Load, loads)).expect("submit");
    let done = wait(&mut tier, 2, WAIT);
    assert_eq!(
        done.failed,
        vec![offload_core::tier::FailedKey::new(
            renamed,
            offload_core::tier::TierFailure::Corrupt
        )],
        "the version 2 record fails its key, as corrupt"
    );
    assert_ne!(
        mem.contents(SlotId(8))[..6000],
        payload[..],
        "old bytes not served"
    );
    assert!(mem.matches(SlotId(9), 6000, 300));
    assert_eq!(tier.lookup(renamed), TierLookup::Miss);
    assert_eq!(tier.stats().corrupt, 1);
}

#[test]
fn damaged_objects_fail_their_key_and_are_deleted() {
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let mem = memory();
    let mut tier = common::tier(common::config(), store.clone(), mem.clone());
    store_chunks(&mut tier, &mem, 4, 200);
    let path = |i: u64| tier.path_of(key(i));
    let (p0, p1, p2) = (path(0), path(1), path(2));
    block_on(async {
        // Key 0: one payload bit flipped. Key 1: truncated. Key 2: key 3's record under its name.
        let good = store.get(&p0).await.unwrap().bytes().await.unwrap();
        let mut flipped = good.to_vec();
        flipped[4096 + 1234] ^= 1;
        store.put(&p0, PutPayload::from(flipped)).await.unwrap();
        let one = store.get(&p1).await.unwrap().bytes().await.unwrap();
        store
            .put(&p1, PutPayload::from(one.slice(..5000)))
            .await
            .unwrap();
        let three = store.get(&path(3)).await.unwrap().bytes().await.unwrap();
        store.put(&p2, PutPayload::from(three)).await.unwrap();
    });
    for slot in 8..12 {
        mem.fill(SlotId(slot), SLOT_BYTES, 9);
    }
    let loads = (0..4u32)
        .map(|i| (key(u64::from(i)), SlotId(8 + i), 6000))
        .collect();
    tier.submit(job(2, TierOp::Load, loads)).expect("submit");
    let done = wait(&mut tier, 2, WAIT);
    assert_eq!(
        done.failed,
        failed(&[key(0), key(1), key(2)], TierFailure::Corrupt)
    );
    assert!(
        mem.matches(SlotId(11), 6000, 203),
        "the intact key still loads"
    );
    for i in 0..3 {
        assert!(
            !mem.matches(SlotId(8 + i as u32), 6000, 200 + i),
            "wrong bytes served"
        );
        assert_eq!(
            tier.lookup(key(i)),
            TierLookup::Miss,
            "damaged key {i} left the index"
        );
    }
    assert_eq!(tier.stats().corrupt, 3);
    block_on(async {
        for p in [&p0, &p1, &p2] {
            assert!(
                store.get(p).await.is_err(),
                "damaged object {p} was deleted"
            );
        }
    });
}

#[test]
fn a_stalled_store_fails_keys_at_the_deadline() {
    let throttle = ThrottleConfig {
        wait_put_per_call: Duration::from_secs(60),
        wait_get_per_call: Duration::from_secs(60),
        ..ThrottleConfig::default()
    };
    let store: Arc<dyn ObjectStore> = Arc::new(ThrottledStore::new(InMemory::new(), throttle));
    let mem = memory();
    let config = ObjTierConfig {
        request_deadline: Duration::from_millis(300),
        ..common::config()
    };
    let mut tier = common::tier(config, store, mem.clone());
    let started = Instant::now();
    tier.submit(job(
        1,
        TierOp::Store,
        vec![(key(0), SlotId(0), 100), (key(1), SlotId(1), 100)],
    ))
    .expect("submit");
    tier.submit(job(2, TierOp::Load, vec![(key(2), SlotId(2), 100)]))
        .expect("submit");
    let done = wait_all(&mut tier, &[1, 2], WAIT);
    assert_eq!(
        done[0].failed,
        failed(&[key(0), key(1)], TierFailure::Timeout)
    );
    assert_eq!(done[1].failed, failed(&[key(2)], TierFailure::Timeout));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(tier.stats().timeouts, 3);
    assert_eq!(tier.lookup(key(0)), TierLookup::Miss);
}

#[test]
fn busy_when_full_and_cancel_interrupts_requests_under_way() {
    let throttle = ThrottleConfig {
        wait_put_per_call: Duration::from_secs(60),
        ..ThrottleConfig::default()
    };
    let store: Arc<dyn ObjectStore> = Arc::new(ThrottledStore::new(InMemory::new(), throttle));
    let mem = memory();
    let config = ObjTierConfig {
        jobs_in_flight_max: 2,
        request_deadline: Duration::from_secs(30),
        ..common::config()
    };
    let mut tier = common::tier(config, store, mem.clone());
    tier.submit(job(1, TierOp::Store, vec![(key(0), SlotId(0), 100)]))
        .expect("first");
    tier.submit(job(2, TierOp::Store, vec![(key(1), SlotId(1), 100)]))
        .expect("second");
    let third = job(3, TierOp::Store, vec![(key(2), SlotId(2), 100)]);
    assert_eq!(
        tier.submit(third.clone()),
        Err(SubmitError::Busy { in_flight: 2 })
    );
    let started = Instant::now();
    tier.cancel(JobId(1));
    tier.cancel(JobId(2));
    let done = wait_all(&mut tier, &[1, 2], WAIT);
    assert_eq!(done[0].failed, failed(&[key(0)], TierFailure::Cancelled));
    assert_eq!(done[1].failed, failed(&[key(1)], TierFailure::Cancelled));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "cancel waited for the deadline"
    );
    assert_eq!(tier.stats().cancelled, 2);
    tier.submit(third)
        .expect("room again after the completions were polled");
    tier.cancel(JobId(3));
    assert_eq!(
        wait(&mut tier, 3, WAIT).failed,
        failed(&[key(2)], TierFailure::Cancelled)
    );
    // Dropping a tier with a job under way cancels and drains it.
    tier.submit(job(4, TierOp::Store, vec![(key(3), SlotId(3), 100)]))
        .expect("fourth");
    let started = Instant::now();
    drop(tier);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn bad_configuration_is_refused_by_name() {
    let mem: Arc<dyn SlotMemory> = memory();
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let config = ObjTierConfig {
        jobs_in_flight_max: 0,
        ..common::config()
    };
    let err = ObjTier::start(config, store, mem).err().expect("refused");
    assert!(err.to_string().contains("jobs_in_flight_max"), "{err}");
}

/// A key the tier drops by itself is reported once through `take_evicted`: a corrupt object
/// (deleted) and an object that vanished behind the tier's back (a `NotFound`); loading them
/// again reports nothing more, and neither does a load of a key never stored.
#[test]
fn keys_dropped_by_a_load_are_reported_evicted_once() {
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let mem = memory();
    let mut tier = common::tier(common::config(), store.clone(), mem.clone());
    store_chunks(&mut tier, &mem, 3, 400);
    let mut evicted = Vec::new();
    assert_eq!(tier.take_evicted(&mut evicted), 0);
    assert!(evicted.is_empty(), "stores drop nothing: {evicted:?}");
    let (p0, p1) = (tier.path_of(key(0)), tier.path_of(key(1)));
    flip_byte(store.as_ref(), &p0, 4096 + 7, 0x10);
    block_on(store.delete(&p1)).unwrap();
    let loads = vec![
        (key(0), SlotId(8), 6000),
        (key(1), SlotId(9), 6000),
        (key(2), SlotId(10), 6000),
        (key(7), SlotId(11), 6000),
    ];
    tier.submit(job(2, TierOp::Load, loads.clone()))
        .expect("submit");
    let done = wait(&mut tier, 2, WAIT);
    assert_eq!(
        done.failed,
        vec![
            FailedKey::new(key(0), TierFailure::Corrupt),
            FailedKey::new(key(1), TierFailure::Missing),
            FailedKey::new(key(7), TierFailure::Missing),
        ]
    );
    assert_eq!(
        tier.take_evicted(&mut evicted),
        0,
        "nothing dropped unreported"
    );
    evicted.sort_by_key(|k| k.hash);
    assert_eq!(
        evicted,
        vec![key(0), key(1)],
        "the corrupt and the vanished key, each once; never the key never stored"
    );
    evicted.clear();
    assert_eq!(tier.take_evicted(&mut evicted), 0);
    assert!(evicted.is_empty(), "reported once: {evicted:?}");
    tier.submit(job(3, TierOp::Load, loads)).expect("submit");
    assert_eq!(wait(&mut tier, 3, WAIT).failed.len(), 3);
    tier.take_evicted(&mut evicted);
    assert!(
        evicted.is_empty(),
        "a second load reports nothing again: {evicted:?}"
    );
    let stats = tier.stats();
    assert_eq!(
        (stats.evictions_reported, stats.evictions_unreported),
        (2, 0)
    );
    assert_eq!(tier.key_count(), 1);
}

/// A store that stops answering: `drain` returns at `drain_deadline` (not the request deadline),
/// counts it, and leaves the job in flight; a cancel then completes it, and a later drain with
/// nothing in flight returns at once without counting.
#[test]
fn drain_gives_up_at_its_deadline_when_the_store_stalls() {
    let throttle = ThrottleConfig {
        wait_put_per_call: Duration::from_secs(60),
        ..ThrottleConfig::default()
    };
    let store: Arc<dyn ObjectStore> = Arc::new(ThrottledStore::new(InMemory::new(), throttle));
    let mem = memory();
    let config = ObjTierConfig {
        request_deadline: Duration::from_secs(60),
        drain_deadline: Duration::from_millis(300),
        ..common::config()
    };
    let mut tier = common::tier(config, store, mem.clone());
    tier.submit(job(1, TierOp::Store, vec![(key(0), SlotId(0), 100)]))
        .expect("submit");
    let started = Instant::now();
    tier.drain();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
        "drain waited {waited:?}"
    );
    assert_eq!(tier.stats().drain_timeouts, 1);
    assert_eq!(tier.jobs_in_flight(), 1, "the job stays in flight");
    let mut out = Vec::new();
    tier.poll(&mut out);
    assert!(out.is_empty(), "nothing reported yet: {out:?}");
    tier.cancel(JobId(1));
    assert_eq!(
        wait(&mut tier, 1, WAIT).failed,
        failed(&[key(0)], TierFailure::Cancelled)
    );
    let started = Instant::now();
    tier.drain();
    assert!(started.elapsed() < Duration::from_millis(200));
    assert_eq!(
        tier.stats().drain_timeouts,
        1,
        "an empty drain does not count"
    );
    // A drain that sees its job complete in time returns true and queues the completion.
    tier.submit(job(2, TierOp::Store, vec![(key(1), SlotId(1), 100)]))
        .expect("submit");
    tier.cancel(JobId(2));
    assert!(tier.drain_until(std::time::Instant::now() + WAIT));
    tier.poll(&mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].id, JobId(2));
}

#[test]
fn a_zero_drain_deadline_is_refused_by_name() {
    let mem: Arc<dyn SlotMemory> = memory();
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let config = ObjTierConfig {
        drain_deadline: Duration::ZERO,
        ..common::config()
    };
    let err = ObjTier::start(config, store, mem).err().expect("refused");
    assert!(err.to_string().contains("drain_deadline"), "{err}");
}

/// The GCS and Azure clients build without a request; a missing bucket, container or account
/// (none in the environment either) is an error naming the backend and what is missing.
#[test]
fn gcs_and_azure_clients_build_and_name_what_is_missing() {
    let env_has = |name: &str| std::env::var_os(name).is_some();
    let gcs = Backend::Gcs(GcsConfig {
        bucket: Some("kvtier-bucket".to_owned()),
    });
    gcs.open().expect("a GCS client builds without a request");
    if !env_has("GOOGLE_BUCKET") && !env_has("GOOGLE_BUCKET_NAME") {
        let err = Backend::Gcs(GcsConfig::default())
            .open()
            .expect_err("no bucket");
        let msg = err.to_string();
        assert!(
            msg.contains("GCS client") && msg.contains("bucket"),
            "{msg}"
        );
    }
    let azure = |container: Option<&str>, endpoint: Option<&str>| {
        Backend::Azure(AzureConfig {
            container: container.map(str::to_owned),
            endpoint: endpoint.map(str::to_owned),
            allow_http: true,
        })
        .open()
    };
    if !env_has("AZURE_CONTAINER_NAME") {
        let msg = azure(None, None).expect_err("no container").to_string();
        assert!(
            msg.contains("Azure client") && msg.contains("ontainer"),
            "{msg}"
        );
    }
    if !env_has("AZURE_STORAGE_ACCOUNT_NAME") && !env_has("AZURE_STORAGE_USE_EMULATOR") {
        let msg = azure(Some("kv"), None).expect_err("no account").to_string();
        assert!(msg.contains("az://kv") && msg.contains("ccount"), "{msg}");
    }
}
