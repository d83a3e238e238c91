//! Peer fetch throughput against the machine's own loopback ceiling, measured in the same run:
//! for chunk sizes from 1 to 8 MiB, a raw loopback TCP stream (one chunk-sized `write` at a
//! time, read into a chunk-sized buffer), then the tier: instance A publishes the chunks, B loads
//! them over loopback (jobs of several chunks, two jobs in flight, every chunk verified by
//! checksum). B's host pool either exposes stable slot addresses (payloads are received straight
//! into the slots, as with a pinned pool) or not (payloads go through a scratch buffer and a
//! copy). Prints GiB/s and the tier/raw ratio.
//!
//! Usage: `cargo run --release -p tier-p2p --example p2p_bench -- [--total-mib N] [--rounds N]`

use std::cell::UnsafeCell;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{SlotMemory, Tier, TierCompletion, TierJob, TierOp};
use offload_core::{ChunkKey, JobId, SlotId};
use tier_p2p::{Namespace, P2pConfig, P2pTier};
use tier_testkit::VecSlotMemory;

const MIB: usize = 1024 * 1024;
const GIB: f64 = (1u64 << 30) as f64;
/// Host slots on the fetching side; two jobs of half of them each are in flight.
const SLOT_COUNT: u32 = 16;

/// A host pool in one prefaulted allocation with stable slot addresses (like a pinned pool).
struct FlatMemory {
    bytes: Box<[UnsafeCell<u8>]>,
    slot_bytes: usize,
    slot_count: u32,
}

// SAFETY: the `Tier` ownership rules give each in-flight job exclusive use of its slots, so no
// two threads touch the same bytes at once; the cells are only reached through those rules.
unsafe impl Sync for FlatMemory {}

impl FlatMemory {
    fn new(slot_count: u32, slot_bytes: usize) -> Self {
        // Zeroing writes every page: the pool is prefaulted before any measurement.
        let bytes = (0..slot_count as usize * slot_bytes)
            .map(|_| UnsafeCell::new(0))
            .collect();
        Self {
            bytes,
            slot_bytes,
            slot_count,
        }
    }

    fn base(&self, slot: SlotId, offset: usize, len: usize) -> *mut u8 {
        assert!(slot.0 < self.slot_count && offset + len <= self.slot_bytes);
        self.bytes[slot.0 as usize * self.slot_bytes + offset].get()
    }
}

impl SlotMemory for FlatMemory {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        self.slot_count
    }

    fn read_slot(&self, slot: SlotId, offset: usize, dst: &mut [u8]) {
        let src = self.base(slot, offset, dst.len());
        // SAFETY: the range is inside the allocation (checked in `base`), and the slot is owned
        // by the calling job, so nobody writes it meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
    }

    fn write_slot(&self, slot: SlotId, offset: usize, src: &[u8]) {
        let dst = self.base(slot, offset, src.len());
        // SAFETY: as in `read_slot`; the job owns the slot exclusively.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
    }

    fn slot_ptr(&self, slot: SlotId) -> Option<NonNull<u8>> {
        NonNull::new(self.base(slot, 0, 0))
    }
}

fn key(index: usize) -> ChunkKey {
    ChunkKey::new(0xBE4C_0000_0000 + index as u64, 0)
}

/// Raw loopback: `total` bytes in writes of `write_bytes`, read into a buffer of that size.
fn raw_loopback(write_bytes: usize, total: usize) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let writer = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        stream.set_nodelay(true).expect("nodelay");
        let buf = vec![0x5Au8; write_bytes];
        let mut sent = 0;
        while sent < total {
            stream.write_all(&buf).expect("write");
            sent += write_bytes;
        }
    });
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let mut buf = vec![0u8; write_bytes];
    let start = Instant::now();
    let mut received = 0;
    while received < total {
        stream.read_exact(&mut buf).expect("read");
        received += write_bytes;
    }
    let elapsed = start.elapsed();
    writer.join().expect("writer");
    total as f64 / GIB / elapsed.as_secs_f64()
}

fn wait(tier: &mut P2pTier, id: JobId, out: &mut Vec<TierCompletion>) {
    let start = Instant::now();
    loop {
        if let Some(i) = out.iter().position(|c| c.id == id) {
            let done = out.swap_remove(i);
            assert!(
                done.is_success(),
                "load {} failed keys {:?}",
                id.0,
                done.failed
            );
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "load {} timed out",
            id.0
        );
        tier.poll(out);
        // Sleep rather than spin: on a small machine a spinning poller takes a core from the
        // threads that move the bytes.
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// One pass loading chunks `0..count` through `fetcher`, two jobs in flight; returns GiB/s.
fn fetch_pass(fetcher: &mut P2pTier, next_id: &mut u64, count: usize, bytes: usize) -> f64 {
    let per_job = SLOT_COUNT as usize / 2;
    let mut out = Vec::new();
    let mut in_flight: Vec<JobId> = Vec::new();
    let start = Instant::now();
    for (job_index, first) in (0..count).step_by(per_job).enumerate() {
        let half = (job_index % 2) as u32 * per_job as u32;
        let chunks = (first..(first + per_job).min(count))
            .enumerate()
            .map(|(n, i)| (key(i), SlotId(half + n as u32), bytes as u32))
            .collect();
        if in_flight.len() == 2 {
            let oldest = in_flight.remove(0);
            wait(fetcher, oldest, &mut out);
        }
        let id = JobId(*next_id);
        *next_id += 1;
        let job = TierJob {
            id,
            request: None,
            op: TierOp::Load,
            chunks,
        };
        fetcher.submit(job).expect("load accepted");
        in_flight.push(id);
    }
    for id in in_flight {
        wait(fetcher, id, &mut out);
    }
    (count * bytes) as f64 / GIB / start.elapsed().as_secs_f64()
}

fn bench_config(bytes: usize, total: usize) -> P2pConfig {
    let mut config = P2pConfig::new(Namespace::new("bench", "flat", 1));
    config.published_bytes_max = total + bytes;
    config.frame_body_bytes_max = config.frame_body_bytes_max.max(bytes + 64);
    config.fetch_deadline = Duration::from_secs(30);
    config
}

/// Publishes `count` chunks of `bytes` on a fresh instance (all from one filled slot).
fn publisher(count: usize, bytes: usize, total: usize) -> P2pTier {
    let memory: Arc<dyn SlotMemory> = Arc::new(VecSlotMemory::new(1, bytes));
    tier_testkit::fill_slot(&*memory, SlotId(0), bytes, 7);
    let mut tier = P2pTier::new(bench_config(bytes, total), memory).expect("publisher");
    let chunks = (0..count)
        .map(|i| (key(i), SlotId(0), bytes as u32))
        .collect();
    let id = JobId(1);
    tier.submit(TierJob {
        id,
        request: None,
        op: TierOp::Store,
        chunks,
    })
    .expect("publish");
    let mut out = Vec::new();
    wait(&mut tier, id, &mut out);
    tier
}

fn fetcher(peer: std::net::SocketAddr, memory: Arc<dyn SlotMemory>, bytes: usize) -> P2pTier {
    let mut config = bench_config(bytes, bytes);
    config.peers = vec![peer];
    P2pTier::new(config, memory).expect("fetcher")
}

/// One warm-up pass (connects, warms the path).
fn warm_up(fetcher: &mut P2pTier, next_id: &mut u64, count: usize, bytes: usize) {
    fetch_pass(fetcher, next_id, count.min(SLOT_COUNT as usize), bytes);
}

fn main() {
    let mut total_mib = 512;
    let mut rounds = 5;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().and_then(|v| v.parse().ok());
        match (arg.as_str(), value) {
            ("--total-mib", Some(v)) => total_mib = v,
            ("--rounds", Some(v)) => rounds = v,
            _ => {
                eprintln!("usage: p2p_bench [--total-mib N] [--rounds N]");
                std::process::exit(2);
            }
        }
    }
    let total = total_mib * MIB;
    println!("peer fetch over loopback TCP, {total_mib} MiB per pass, best of {rounds} (GiB/s)");
    println!(
        "{:>6} {:>9} {:>13} {:>7} {:>13} {:>7}",
        "chunk", "raw tcp", "p2p in-place", "ratio", "p2p via copy", "ratio"
    );
    for mib in [1, 2, 4, 8] {
        let bytes = mib * MIB;
        let count = total / bytes;
        let a = publisher(count, bytes, total);
        let flat: Arc<dyn SlotMemory> = Arc::new(FlatMemory::new(SLOT_COUNT, bytes));
        let mut b = fetcher(a.local_addr(), flat, bytes);
        let vec: Arc<dyn SlotMemory> = Arc::new(VecSlotMemory::new(SLOT_COUNT, bytes));
        let mut c = fetcher(a.local_addr(), vec, bytes);
        let (mut b_id, mut c_id) = (1, 1);
        warm_up(&mut b, &mut b_id, count, bytes);
        warm_up(&mut c, &mut c_id, count, bytes);
        // Interleaved rounds, best of each, so that drift in the machine hits all alike.
        let (mut raw, mut in_place, mut via_copy) = (0.0f64, 0.0f64, 0.0f64);
        for _ in 0..rounds {
            raw = raw.max(raw_loopback(bytes, total));
            in_place = in_place.max(fetch_pass(&mut b, &mut b_id, count, bytes));
            via_copy = via_copy.max(fetch_pass(&mut c, &mut c_id, count, bytes));
        }
        drop((b, c, a));
        println!(
            "{:>4}Mi {raw:>9.2} {in_place:>13.2} {:>7.2} {via_copy:>13.2} {:>7.2}",
            mib,
            in_place / raw,
            via_copy / raw
        );
    }
}
