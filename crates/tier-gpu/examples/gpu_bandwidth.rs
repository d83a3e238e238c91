//! GPU bandwidth of [`CudaTransferEngine`] against the ceiling measured in the same run: for chunk
//! sizes 256 KiB to 16 MiB, device-to-host (stores), host-to-device (loads) and both at once, with
//! many chunks per job (64 MiB jobs), next to one plain `cuMemcpyDtoHAsync` / `cuMemcpyHtoDAsync`
//! of 1 GiB between a device buffer and the same pinned pool, and the ratio. Every copy method the
//! driver supports is measured. Without a usable GPU it prints why and exits 0.
//!
//! Usage: `cargo run --release -p tier-gpu --features cuda --example gpu_bandwidth
//! [-- --reps N]` (about 30 s on an H100/H200).

//!
//! Built without the `cuda` feature it only says so (the `[[example]]` stanza in Cargo.toml
//! requires the feature, so plain builds skip it).

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("gpu_bandwidth: NOT RUN: built without the `cuda` feature (add --features cuda)");
}

#[cfg(feature = "cuda")]
fn main() -> std::process::ExitCode {
    gpu::main()
}

/// The benchmark proper (feature `cuda`).
#[cfg(feature = "cuda")]
mod gpu {
    use std::process::ExitCode;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use cudarc::driver::sys;
    use offload_core::{BlockId, ChunkKey, Job, JobId, JobKind, RequestId, SlotId, Transfer};
    use tier_gpu::cuda::{
        self, CopyMethod, CudaEngineConfig, CudaTransferEngine, DeviceBuffer, PinnedHostPool,
        REGISTER_PIECE_BYTES_DEFAULT,
    };
    use tier_gpu::{HostPoolMemory, KvLayout, Region, TransferEngine, TransferError};

    const DEVICE: u32 = 0;
    const GIB: usize = 1 << 30;
    const MIB: usize = 1 << 20;
    /// Half of the device region and of the pool: stores read and fill the first half, loads read
    /// and fill the second, so both directions can run at once on disjoint memory.
    const HALF_BYTES: usize = GIB;
    const JOB_BYTES: usize = 64 * MIB;
    /// Bytes each measurement moves per direction.
    const PASS_BYTES: usize = 4 * GIB;
    const BLOCKS_PER_CHUNK: u32 = 16;
    const JOBS_IN_FLIGHT_MAX: usize = 16;
    const CHUNK_SIZES: [usize; 7] = [
        256 << 10,
        512 << 10,
        MIB,
        2 * MIB,
        4 * MIB,
        8 * MIB,
        16 * MIB,
    ];
    const MEASURE_DEADLINE: Duration = Duration::from_secs(20);
    /// Design targets (design.md section 7), for the printout.
    const TARGET_ONE_WAY_GBPS: f64 = 45.0;
    const TARGET_BOTH_GBPS: f64 = 80.0;

    pub fn main() -> ExitCode {
        if let Err(reason) = cuda::available() {
            println!("gpu_bandwidth: NOT RUN: {reason}");
            return ExitCode::SUCCESS;
        }
        match run() {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("gpu_bandwidth: FAILED: {err}");
                ExitCode::FAILURE
            }
        }
    }

    fn reps() -> Result<usize, String> {
        let args: Vec<String> = std::env::args().collect();
        match args.iter().position(|a| a == "--reps") {
            None => Ok(3),
            Some(i) => {
                let value = args.get(i + 1).ok_or("--reps needs a value")?;
                match value.parse() {
                    Ok(n) if n > 0 => Ok(n),
                    _ => Err(format!("--reps {value:?}: expected a positive integer")),
                }
            }
        }
    }

    fn run() -> Result<(), String> {
        let reps = reps()?;
        let started = Instant::now();
        let ctx =
            cudarc::driver::CudaContext::new(DEVICE as usize).map_err(|e| format!("{e:?}"))?;
        let name = ctx
            .name()
            .unwrap_or_else(|e| format!("(name unknown: {e:?})"));
        let device = DeviceBuffer::new(DEVICE, 2 * HALF_BYTES).map_err(|e| e.to_string())?;
        // The pool's geometry does not matter to the pinned memory: every chunk size below uses the
        // same 2 GiB as slots of its own size.
        let memory = Arc::new(
            HostPoolMemory::new(MIB, (2 * HALF_BYTES / MIB) as u32).map_err(|e| e.to_string())?,
        );
        let pool = Arc::new(
            PinnedHostPool::register(Arc::clone(&memory), DEVICE, REGISTER_PIECE_BYTES_DEFAULT)
                .map_err(|e| e.to_string())?,
        );
        println!(
            "gpu_bandwidth: device {DEVICE} ({name}); 2 GiB pinned pool (registered in {} MiB \
             pieces) and 2 GiB of device memory ready in {:.1}s; {} MiB jobs, {} GiB per \
             measurement and direction, best of {reps}; GB = 1e9 bytes",
            REGISTER_PIECE_BYTES_DEFAULT / MIB,
            started.elapsed().as_secs_f64(),
            JOB_BYTES / MIB,
            PASS_BYTES / GIB,
        );
        let ceiling = Ceiling::measure(&device, &pool, reps)?;
        println!(
            "ceiling (one {} GiB cuMemcpy*Async on its own stream): d2h {:.1} GB/s, h2d {:.1} GB/s, \
             both at once {:.1} GB/s",
            HALF_BYTES / GIB,
            ceiling.d2h,
            ceiling.h2d,
            ceiling.both
        );
        println!(
            "targets: >= {TARGET_ONE_WAY_GBPS} GB/s per direction, >= {TARGET_BOTH_GBPS} GB/s both \
             at once"
        );
        println!(
            "{:<7} {:>8} {:>9} {:>7} {:>9} {:>7} {:>9} {:>7}",
            "method", "chunk", "d2h GB/s", "x ceil", "h2d GB/s", "x ceil", "both", "x ceil"
        );
        let mut ids = 0u64;
        for requested in [CopyMethod::PerRun, CopyMethod::Batch] {
            for &chunk in &CHUNK_SIZES {
                let layout = layout_for(&device, chunk)?;
                let config = CudaEngineConfig {
                    device_ordinal: DEVICE,
                    jobs_in_flight_max: JOBS_IN_FLIGHT_MAX,
                    copy_method: requested,
                };
                // SAFETY: the layout's region is `device`, which outlives the engine; the jobs below
                // use disjoint blocks and slots per direction, and only this engine copies into
                // them until it is drained.
                let engine = unsafe { CudaTransferEngine::new(layout, Arc::clone(&pool), config) };
                let mut engine = match engine {
                    Ok(engine) => engine,
                    Err(err) if requested == CopyMethod::Batch => {
                        println!("{:<7} not measured: {err}", "Batch");
                        break;
                    }
                    Err(err) => return Err(err.to_string()),
                };
                let row = measure_chunk_size(&mut engine, chunk, reps, &mut ids)?;
                println!(
                    "{:<7} {:>8} {:>9.1} {:>7.2} {:>9.1} {:>7.2} {:>9.1} {:>7.2}",
                    format!("{requested:?}"),
                    human(chunk),
                    row.d2h,
                    row.d2h / ceiling.d2h,
                    row.h2d,
                    row.h2d / ceiling.h2d,
                    row.both,
                    row.both / ceiling.both
                );
            }
        }
        drop(pool);
        drop(ctx);
        println!(
            "gpu_bandwidth: done in {:.1}s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    fn human(bytes: usize) -> String {
        if bytes >= MIB {
            format!("{} MiB", bytes / MIB)
        } else {
            format!("{} KiB", bytes >> 10)
        }
    }

    /// One region over the whole device buffer, in blocks of `chunk / BLOCKS_PER_CHUNK`.
    fn layout_for(device: &DeviceBuffer, chunk: usize) -> Result<KvLayout, String> {
        let block = chunk / BLOCKS_PER_CHUNK as usize;
        let region = Region {
            base: device.ptr(),
            num_blocks: (device.len() / block) as u32,
            block_bytes: block as u64,
            block_stride: block as u64,
            group: 0,
        };
        KvLayout::new(
            vec![region],
            BLOCKS_PER_CHUNK,
            (device.len() / chunk) as u32,
        )
        .map_err(|e| e.to_string())
    }

    /// A fixed shuffle of `0..n`, so that consecutive chunks land in scattered slots and blocks (one
    /// run per chunk, as in a real cache) rather than coalescing into one huge copy.
    fn shuffle(n: u32, seed: u64) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        let mut x = seed | 1;
        for i in (1..v.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.swap(i, (x % (i as u64 + 1)) as usize);
        }
        v
    }

    /// The transfers of one direction's half, grouped into jobs of `JOB_BYTES`.
    fn job_transfers(chunk: usize, kind: JobKind) -> Vec<Vec<Transfer>> {
        let chunks = (HALF_BYTES / chunk) as u32;
        let (offset, seed) = match kind {
            JobKind::Store => (0, 1),
            JobKind::Load => (chunks, 2),
        };
        let slots = shuffle(chunks, seed);
        let groups = shuffle(chunks, seed + 10);
        let transfers: Vec<Transfer> = (0..chunks as usize)
            .map(|i| {
                let first = (offset + groups[i]) * BLOCKS_PER_CHUNK;
                Transfer {
                    key: ChunkKey::new(i as u128, 0),
                    slot: SlotId(offset + slots[i]),
                    first_block_in_chunk: 0,
                    gpu_blocks: (first..first + BLOCKS_PER_CHUNK).map(BlockId).collect(),
                }
            })
            .collect();
        transfers
            .chunks((JOB_BYTES / chunk).max(1))
            .map(<[Transfer]>::to_vec)
            .collect()
    }

    /// GB/s of one chunk size.
    struct Row {
        d2h: f64,
        h2d: f64,
        both: f64,
    }

    fn measure_chunk_size(
        engine: &mut CudaTransferEngine,
        chunk: usize,
        reps: usize,
        ids: &mut u64,
    ) -> Result<Row, String> {
        let stores = job_transfers(chunk, JobKind::Store);
        let loads = job_transfers(chunk, JobKind::Load);
        let passes = PASS_BYTES / HALF_BYTES;
        let plan = |kinds: &[JobKind]| -> Vec<(JobKind, &Vec<Transfer>)> {
            let mut plan = Vec::new();
            for _ in 0..passes {
                for i in 0..stores.len().max(loads.len()) {
                    for &kind in kinds {
                        let list = if kind == JobKind::Store {
                            &stores
                        } else {
                            &loads
                        };
                        if let Some(t) = list.get(i) {
                            plan.push((kind, t));
                        }
                    }
                }
            }
            plan
        };
        let one_way = (passes * HALF_BYTES) as f64;
        // Warm up (first use of the engine's streams and of the pages).
        run_jobs(engine, &plan(&[JobKind::Store, JobKind::Load]), ids)?;
        let d2h = one_way / best(reps, || run_jobs(engine, &plan(&[JobKind::Store]), ids))?;
        let h2d = one_way / best(reps, || run_jobs(engine, &plan(&[JobKind::Load]), ids))?;
        let both_plan = plan(&[JobKind::Store, JobKind::Load]);
        let both = 2.0 * one_way / best(reps, || run_jobs(engine, &both_plan, ids))?;
        Ok(Row {
            d2h: d2h / 1e9,
            h2d: h2d / 1e9,
            both: both / 1e9,
        })
    }

    fn best(reps: usize, mut f: impl FnMut() -> Result<f64, String>) -> Result<f64, String> {
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            best = best.min(f()?);
        }
        Ok(best)
    }

    /// Submits `plan` keeping the engine full, polls until every job completed; returns seconds.
    fn run_jobs(
        engine: &mut CudaTransferEngine,
        plan: &[(JobKind, &Vec<Transfer>)],
        ids: &mut u64,
    ) -> Result<f64, String> {
        let started = Instant::now();
        let mut next = 0;
        let mut done = 0;
        let mut out = Vec::new();
        while done < plan.len() {
            while let Some(&(kind, transfers)) = plan.get(next) {
                *ids += 1;
                let job = Job {
                    id: JobId(*ids),
                    request: RequestId(1),
                    kind,
                    transfers: transfers.clone(),
                };
                match engine.submit(&job) {
                    Ok(()) => next += 1,
                    Err(TransferError::Busy { .. }) => break,
                    Err(err) => return Err(err.to_string()),
                }
            }
            out.clear();
            engine.poll(&mut out);
            if let Some(failed) = out.iter().find(|d| !d.success) {
                return Err(format!("job {:?} failed", failed.job));
            }
            done += out.len();
            if out.is_empty() {
                if started.elapsed() > MEASURE_DEADLINE {
                    return Err(format!(
                        "{done} of {} jobs done after {MEASURE_DEADLINE:?}",
                        plan.len()
                    ));
                }
                std::hint::spin_loop();
            }
        }
        Ok(started.elapsed().as_secs_f64())
    }

    /// The plain-copy ceiling, GB/s.
    struct Ceiling {
        d2h: f64,
        h2d: f64,
        both: f64,
    }

    impl Ceiling {
        /// One large async copy per direction on its own non-blocking stream, timed with the host
        /// clock around enqueue and synchronise. Needs the device's primary context current (bound by
        /// the caller).
        fn measure(
            device: &DeviceBuffer,
            pool: &PinnedHostPool,
            reps: usize,
        ) -> Result<Self, String> {
            let streams = [Stream::new()?, Stream::new()?];
            let host = pool.as_ptr();
            let half = HALF_BYTES;
            // SAFETY (for the closures' copies): the device ranges are inside `device` (2 halves of
            // HALF_BYTES), the host ranges inside the registered pool (2 halves); nothing else
            // touches them, and every copy is synchronised before the closure returns.
            let d2h = |s: &Stream| unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.cast(), device.ptr(), half, s.0)
            };
            let h2d = |s: &Stream| unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    device.ptr() + half as u64,
                    host.add(half).cast_const().cast(),
                    half,
                    s.0,
                )
            };
            let one = |copy: &dyn Fn(&Stream) -> sys::CUresult| -> Result<f64, String> {
                best(reps, || {
                    let started = Instant::now();
                    ok(copy(&streams[0]), "plain copy")?;
                    streams[0].sync()?;
                    Ok(started.elapsed().as_secs_f64())
                })
            };
            // Warm up both directions once.
            one(&d2h)?;
            one(&h2d)?;
            let d2h_s = one(&d2h)?;
            let h2d_s = one(&h2d)?;
            let both_s = best(reps, || {
                let started = Instant::now();
                ok(d2h(&streams[0]), "plain d2h")?;
                ok(h2d(&streams[1]), "plain h2d")?;
                streams[0].sync()?;
                streams[1].sync()?;
                Ok(started.elapsed().as_secs_f64())
            })?;
            let gb = half as f64 / 1e9;
            Ok(Self {
                d2h: gb / d2h_s,
                h2d: gb / h2d_s,
                both: 2.0 * gb / both_s,
            })
        }
    }

    fn ok(code: sys::CUresult, what: &str) -> Result<(), String> {
        if code == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what}: {code:?}"))
        }
    }

    /// A non-blocking stream in the current context.
    struct Stream(sys::CUstream);

    impl Stream {
        fn new() -> Result<Self, String> {
            let mut stream = std::ptr::null_mut();
            // SAFETY: the primary context is current (bound by CudaContext::new in `run`); the call
            // writes the new handle into `stream`.
            let code = unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            };
            ok(code, "cuStreamCreate")?;
            Ok(Self(stream))
        }

        fn sync(&self) -> Result<(), String> {
            // SAFETY: a live stream of this value.
            ok(
                unsafe { sys::cuStreamSynchronize(self.0) },
                "cuStreamSynchronize",
            )
        }
    }

    impl Drop for Stream {
        fn drop(&mut self) {
            // SAFETY: a live stream of this value, idle after the synchronise, destroyed once.
            unsafe {
                sys::cuStreamSynchronize(self.0);
                sys::cuStreamDestroy_v2(self.0);
            }
        }
    }
}
