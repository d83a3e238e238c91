//! The host path end to end: the copier against a plain reference copy, the job-level engine
//! (submission order, wait, drain, bounds, busy), and the host pool as the memory under the tier
//! conformance suite.

use std::sync::Arc;

use offload_core::{BlockId, ChunkKey, Job, JobId, JobKind, SlotId, SlotMemory, Transfer};
use tier_gpu::host::Direction;
use tier_gpu::{
    CopyRun, HostCopier, HostPoolMemory, HostTransferEngine, KvLayout, Region, TransferDone,
    TransferEngine, TransferError,
};
use tier_testkit::conformance::SuiteConfig;
use tier_testkit::fake::{FakeTier, FakeTierConfig};

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn copier_matches_a_plain_copy_for_small_and_split_runs() {
    let copier = HostCopier::new(3).expect("threads");
    let mut engine = pattern(1, 8 << 20);
    let mut host = vec![0u8; 8 << 20];
    // One large run (split across threads), a few small scattered ones.
    let runs = [
        CopyRun {
            engine_addr: 4096,
            host_offset: 0,
            len: 3 << 20,
        },
        CopyRun {
            engine_addr: 7 << 20,
            host_offset: 4 << 20,
            len: 1000,
        },
        CopyRun {
            engine_addr: 17,
            host_offset: 5 << 20,
            len: 1,
        },
    ];
    copier
        .copy(Direction::ToHost, &mut engine, &mut host, &runs)
        .expect("copies");
    for r in &runs {
        let (e, h, n) = (
            r.engine_addr as usize,
            r.host_offset as usize,
            r.len as usize,
        );
        assert_eq!(host[h..h + n], engine[e..e + n], "run {r:?}");
    }
    let mut back = vec![0u8; 8 << 20];
    copier
        .copy(Direction::ToEngine, &mut back, &mut host, &runs)
        .expect("copies back");
    for r in &runs {
        let (e, n) = (r.engine_addr as usize, r.len as usize);
        assert_eq!(back[e..e + n], engine[e..e + n]);
    }
    assert!(
        back[5 << 20..(5 << 20) + 4096].iter().all(|&b| b == 0),
        "bytes outside runs untouched"
    );
}

#[test]
fn copier_refuses_out_of_bounds_and_overlapping_runs_without_copying() {
    let copier = HostCopier::new(2).expect("threads");
    let mut engine = vec![1u8; 1024];
    let mut host = vec![0u8; 1024];
    let past = [CopyRun {
        engine_addr: 1000,
        host_offset: 0,
        len: 100,
    }];
    assert!(copier
        .copy(Direction::ToHost, &mut engine, &mut host, &past)
        .is_err());
    let overlap = [
        CopyRun {
            engine_addr: 0,
            host_offset: 0,
            len: 100,
        },
        CopyRun {
            engine_addr: 200,
            host_offset: 50,
            len: 100,
        },
    ];
    let err = copier
        .copy(Direction::ToHost, &mut engine, &mut host, &overlap)
        .unwrap_err();
    assert!(err.contains("overlap"), "{err}");
    assert!(host.iter().all(|&b| b == 0), "nothing copied on error");
}

/// An engine KV cache in host memory: `blocks` blocks of `block_bytes`, filled with a pattern.
struct Setup {
    engine_mem: Vec<u8>,
    pool: Arc<HostPoolMemory>,
    engine: HostTransferEngine,
}

fn setup(block_bytes: u64, blocks: u32, bpc: u32, slots: u32, in_flight_max: usize) -> Setup {
    let mut engine_mem = pattern(7, (block_bytes * u64::from(blocks)) as usize);
    let base = engine_mem.as_mut_ptr() as u64;
    let region = Region {
        base,
        num_blocks: blocks,
        block_bytes,
        block_stride: block_bytes,
        group: 0,
    };
    let layout = KvLayout::new(vec![region], bpc, slots).expect("layout");
    let pool = Arc::new(HostPoolMemory::new(layout.slot_bytes() as usize, slots).expect("pool"));
    let copier = Arc::new(HostCopier::new(2).expect("threads"));
    // SAFETY: `engine_mem` is moved into the returned Setup next to the engine, never reallocated,
    // and dropped after it (field order); each test hands blocks and slots to one job at a time.
    let engine = unsafe { HostTransferEngine::new(layout, pool.clone(), copier, in_flight_max) }
        .expect("engine");
    Setup {
        engine_mem,
        pool,
        engine,
    }
}

fn job(id: u64, kind: JobKind, chunks: &[(u32, u32, &[u32])]) -> Job {
    Job {
        id: JobId(id),
        request: offload_core::RequestId(1),
        kind,
        transfers: chunks
            .iter()
            .map(|&(slot, first, blocks)| Transfer {
                key: ChunkKey::new(u128::from(slot) + 100, 0),
                slot: SlotId(slot),
                first_block_in_chunk: first,
                gpu_blocks: blocks.iter().map(|&b| BlockId(b)).collect(),
            })
            .collect(),
    }
}

fn poll_all(engine: &mut HostTransferEngine, expect: usize) -> Vec<TransferDone> {
    engine.drain();
    let mut out = Vec::new();
    engine.poll(&mut out);
    assert_eq!(out.len(), expect, "{out:?}");
    out
}

#[test]
fn store_then_load_into_other_blocks_is_byte_identical_including_mid_chunk() {
    let bb = 64 * 1024u64;
    let mut s = setup(bb, 64, 4, 8, 16);
    s.engine
        .submit(&job(
            1,
            JobKind::Store,
            &[(0, 0, &[0, 1, 2, 3]), (5, 0, &[9, 8, 7, 6])],
        ))
        .expect("submit");
    let done = poll_all(&mut s.engine, 1);
    assert!(done[0].success);
    let mut slot = vec![0u8; (4 * bb) as usize];
    s.pool.read_slot(SlotId(5), 0, &mut slot);
    let block = |b: usize| s.engine_mem[b * bb as usize..(b + 1) * bb as usize].to_vec();
    assert_eq!(
        slot[..bb as usize],
        block(9)[..],
        "block order within the chunk is kept"
    );
    // Load chunk in slot 5 into blocks 40.., skipping its first (already cached) block.
    s.engine
        .submit(&job(2, JobKind::Load, &[(5, 1, &[41, 42, 43])]))
        .expect("submit");
    assert!(poll_all(&mut s.engine, 1)[0].success);
    assert_eq!(block(41), block(8));
    assert_eq!(block(43), block(6));
    assert_ne!(block(40), block(9), "the skipped block was not written");
}

#[test]
fn completions_come_in_submission_order_per_direction_and_wait_flushes() {
    let mut s = setup(4096, 256, 2, 64, 64);
    for id in 1..=20u64 {
        let b = (id as u32 * 2) % 200;
        s.engine
            .submit(&job(id, JobKind::Store, &[(id as u32, 0, &[b, b + 1])]))
            .expect("submit");
    }
    s.engine.wait(JobId(10));
    let mut out = Vec::new();
    s.engine.poll(&mut out);
    assert!(out.len() >= 10, "wait(10) completes jobs 1..=10");
    let ids: Vec<u64> = out.iter().map(|d| d.job.0).collect();
    assert_eq!(
        ids,
        (1..=out.len() as u64).collect::<Vec<_>>(),
        "submission order"
    );
    let rest = poll_all(&mut s.engine, 20 - out.len());
    assert!(rest.iter().all(|d| d.success && d.kind == JobKind::Store));
}

#[test]
fn bad_jobs_and_full_queues_are_refused_without_effect() {
    let mut s = setup(4096, 16, 2, 4, 2);
    let err = s
        .engine
        .submit(&job(1, JobKind::Store, &[(9, 0, &[0, 1])]))
        .unwrap_err();
    assert!(matches!(err, TransferError::Plan { .. }), "{err}");
    let err = s
        .engine
        .submit(&job(2, JobKind::Store, &[(0, 0, &[99])]))
        .unwrap_err();
    assert!(err.to_string().contains("outside region"), "{err}");
    s.engine
        .submit(&job(3, JobKind::Store, &[(0, 0, &[0, 1])]))
        .expect("submit");
    s.engine
        .submit(&job(4, JobKind::Store, &[(1, 0, &[2, 3])]))
        .expect("submit");
    let err = s
        .engine
        .submit(&job(5, JobKind::Store, &[(2, 0, &[4, 5])]))
        .unwrap_err();
    assert_eq!(err, TransferError::Busy { in_flight: 2 });
    // The bound is per direction: a burst of stores does not hold back a load.
    s.engine
        .submit(&job(6, JobKind::Load, &[(3, 0, &[6, 7])]))
        .expect("a load is accepted while stores are at their bound");
    let done = poll_all(&mut s.engine, 3);
    let ids: Vec<u64> = done.iter().map(|d| d.job.0).collect();
    assert_eq!(ids, vec![3, 4, 6]);
}

#[test]
fn a_pool_that_does_not_match_the_layout_is_refused() {
    let region = Region {
        base: 0x1000,
        num_blocks: 8,
        block_bytes: 64,
        block_stride: 64,
        group: 0,
    };
    let layout = KvLayout::new(vec![region], 2, 4).expect("layout");
    // Same total bytes (4 x 128), different slot size: tiers would read the wrong bytes.
    let pool = Arc::new(HostPoolMemory::new(256, 2).expect("pool"));
    let copier = Arc::new(HostCopier::new(1).expect("threads"));
    // SAFETY: construction is refused before any memory is touched.
    let made = unsafe { HostTransferEngine::new(layout, pool, copier, 4) };
    let err = made.err().expect("refused");
    assert!(err.contains("slots of 128 bytes"), "{err}");
}

#[test]
fn host_pool_is_exactly_sized_and_prefaulted_zero() {
    let pool = HostPoolMemory::new(3 * 4096 + 1, 5).expect("pool");
    assert_eq!(
        pool.len(),
        5 * (3 * 4096 + 1),
        "no rounding of the requested size"
    );
    let mut buf = vec![1u8; 3 * 4096 + 1];
    pool.read_slot(SlotId(4), 0, &mut buf);
    assert!(buf.iter().all(|&b| b == 0));
    assert!(
        HostPoolMemory::new(0, 5).is_err(),
        "a zero-sized pool is an error"
    );
}

#[test]
fn a_shared_host_pool_file_is_one_pool_for_every_mapping_and_keeps_its_size() {
    let path = std::env::temp_dir().join(format!("kvtier-shared-pool-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let a = HostPoolMemory::open_shared(&path, 3 * 4096 + 1, 4).expect("creates");
    let b = HostPoolMemory::open_shared(&path, 3 * 4096 + 1, 4).expect("opens");
    let data = pattern(7, 3 * 4096 + 1);
    a.write_slot(SlotId(3), 0, &data);
    let mut got = vec![0u8; data.len()];
    b.read_slot(SlotId(3), 0, &mut got);
    assert!(
        got == data,
        "a write through one mapping is read through the other"
    );
    b.write_slot(SlotId(0), 10, &data[..100]);
    let mut again = vec![0u8; 100];
    let c = HostPoolMemory::open_shared(&path, 3 * 4096 + 1, 4).expect("reopens");
    c.read_slot(SlotId(0), 10, &mut again);
    assert!(again == data[..100], "opening again keeps the bytes");
    let err = HostPoolMemory::open_shared(&path, 4096, 4)
        .err()
        .expect("another size is refused");
    assert!(
        err.to_string().contains(&path.display().to_string())
            && err.to_string().contains("not the 16384"),
        "{err}"
    );
    drop((a, b, c));
    std::fs::remove_file(&path).expect("removed");
}

fn pool_memory(slots: u32, slot_bytes: usize) -> Arc<dyn SlotMemory> {
    Arc::new(HostPoolMemory::new(slot_bytes, slots).expect("pool"))
}

fn fake_over_host_pool(memory: Arc<dyn SlotMemory>) -> Box<dyn offload_core::Tier> {
    Box::new(FakeTier::new(memory, FakeTierConfig::default()))
}

#[test]
fn host_pool_serves_as_slot_memory_under_the_tier_conformance_suite() {
    let config = SuiteConfig {
        new_memory: pool_memory,
        ..SuiteConfig::default()
    };
    tier_testkit::conformance::run_all_with(&config, fake_over_host_pool);
}
