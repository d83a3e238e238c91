//! Execution shared by loads and stores: running a group of jobs batch by batch, and submitting
//! a batch's operations to the I/O engine and reaping them to completion.

use super::*;

impl Worker {
    /// Runs a group of jobs of one kind (stores, or a single load) and returns their completions.
    pub(super) fn run_group(&mut self, group: &[TierJob]) -> Vec<TierCompletion> {
        let mut failed = Failed::new(group.len());
        match group[0].op {
            TierOp::Store => {
                // Alone: started, then run until it finished.
                for job in group {
                    self.start_store(job);
                }
                while !self.active.is_empty() {
                    self.store_step();
                }
                let finished = std::mem::take(&mut self.finished);
                let mut cancelled = self.shared.cancelled();
                for job in group {
                    cancelled.remove(&job.id);
                }
                return finished;
            }
            TierOp::Load => {
                debug_assert_eq!(group.len(), 1, "loads run one job at a time");
                self.load(&group[0], &mut failed);
            }
        }
        self.completions(group, failed)
    }

    /// Splits `chunks` into batches of at most `batch_bytes_max` record bytes (at least one
    /// chunk) and [`BATCH_OPS_MAX`] chunks; returns the end of the batch starting at `start`.
    pub(super) fn batch_end(&self, chunks: &[JobChunk], start: usize) -> usize {
        let mut bytes = 0u64;
        let mut end = start;
        while end < chunks.len() && end - start < BATCH_OPS_MAX {
            let next = file_bytes(u64::from(chunks[end].1.len));
            if end > start && bytes + next > self.settings.batch_bytes_max as u64 {
                break;
            }
            bytes += next;
            end += 1;
        }
        end
    }

    /// Runs `chunks` (of the jobs `ids`) batch by batch with `each`, failing what remains of a
    /// job once it is cancelled.
    pub(super) fn batches(
        &mut self,
        ids: &[JobId],
        mut chunks: Vec<JobChunk>,
        failed: &mut Failed,
        each: BatchFn,
    ) {
        while !chunks.is_empty() {
            let cancelled: Vec<bool> = ids.iter().map(|&id| self.is_cancelled(id)).collect();
            if cancelled.iter().any(|&c| c) {
                let stats = &self.shared.stats;
                chunks.retain(|&(j, TierChunk { key, .. })| {
                    if cancelled[j] {
                        failed.add(stats, j, key, FailureKind::Cancelled);
                    }
                    !cancelled[j]
                });
                continue;
            }
            let end = self.batch_end(&chunks, 0);
            each(self, &chunks[..end], failed);
            chunks.drain(..end);
        }
    }

    /// Executes `items`, handing each result to `done` as it arrives, and executes again whatever
    /// `done` asks to retry (a buffered retry after EINVAL), until nothing is left.
    pub(super) fn run_to_completion(
        &mut self,
        mut items: Vec<(Pending, Ready)>,
        done: CompletionHandler,
        failed: &mut Failed,
    ) {
        while !items.is_empty() {
            items = self.execute(items, done, failed);
        }
    }

    /// Submits the ready operations and reaps them all, handing each result to `done` as soon as
    /// it is reaped (so a load verifies and copies one record while later ones are still read);
    /// injected errors complete at once. Store records still to be filled are filled just before
    /// their submission, so that the disk writes the first records of a batch while the next ones
    /// are copied and checksummed (ops are submitted in groups of at least [`SUBMIT_BYTES_MIN`]
    /// bytes). Returns the operations `done` asked to retry.
    pub(super) fn execute(
        &mut self,
        items: Vec<(Pending, Ready)>,
        done: CompletionHandler,
        failed: &mut Failed,
    ) -> Vec<(Pending, Ready)> {
        let mut results = Vec::new();
        let mut retries = Vec::new();
        let mut waiting: HashMap<u64, Pending> = HashMap::new();
        let submitted = self.fill_and_submit(items, &mut waiting, &mut results);
        let mut handle = |worker: &mut Worker, results: &mut Vec<_>| {
            for (pending, result, buf) in results.drain(..) {
                done(worker, pending, result, buf, failed, &mut retries);
            }
        };
        handle(self, &mut results);
        let mut reaped = 0;
        let mut errors = 0;
        let mut batch = Vec::new();
        while reaped < submitted && self.engine.in_flight() > 0 {
            if self.engine.reap(&mut batch, 1).is_err() {
                errors += 1;
                // An operation into or from a slot owns it until reaped: never give up on those.
                if errors > REAP_ERRORS_MAX && !waiting.values().any(|p| p.zero_copy) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            for completion in batch.drain(..) {
                reaped += 1;
                match waiting.remove(&completion.tag) {
                    Some(pending) => results.push((pending, completion.result, completion.buf)),
                    None => self.unknown_tag(completion.tag, "operation"),
                }
            }
            handle(self, &mut results);
        }
        for (_, pending) in waiting {
            // The engine still owns the operation and its buffer: leak a reference to the
            // descriptor so that its number is not reused while the engine may still use it, and
            // fail the chunk.
            std::mem::forget(Arc::clone(&pending.file));
            let error = io::Error::other("the I/O engine lost the operation");
            results.push((pending, Err(error), AlignedBuf::with_capacity(0)));
        }
        handle(self, &mut results);
        retries
    }

    /// Fills the store records of `items` that are still to be filled and gives the reads that
    /// carry no buffer yet theirs, just before their submission, and submits the operations in
    /// groups of at least [`SUBMIT_BYTES_MIN`] bytes, each one's `Pending` in `waiting` under its
    /// tag (so the disk writes the first records while later ones are copied and checksummed).
    /// Injected errors, unfilled records, buffers that cannot be had and refused submissions go
    /// to `results`. Returns how many operations the engine took.
    pub(super) fn fill_and_submit(
        &mut self,
        items: Vec<(Pending, Ready)>,
        waiting: &mut HashMap<u64, Pending>,
        results: &mut Vec<(Pending, io::Result<usize>, AlignedBuf)>,
    ) -> usize {
        let mut ops = Vec::new();
        let mut ops_bytes = 0;
        let mut submitted = 0;
        let total = items.len();
        for (n, (pending, ready)) in items.into_iter().enumerate() {
            let (pending, ready) = match ready {
                Ready::Fill(buf) => self.fill_record(pending, buf),
                Ready::Take(op) => (pending, self.take_buffer(op)),
                other => (pending, other),
            };
            match ready {
                Ready::Injected(error, buf) => results.push((pending, Err(error), buf)),
                Ready::Fill(buf) => {
                    results.push((pending, Err(io::Error::other("record left unfilled")), buf))
                }
                Ready::Take(op) => results.push((
                    pending,
                    Err(io::Error::other("read left without a buffer")),
                    op.buf,
                )),
                Ready::Op(op) => {
                    ops_bytes += op.len;
                    waiting.insert(op.tag, pending);
                    ops.push(op);
                }
            }
            if !ops.is_empty() && (ops_bytes >= SUBMIT_BYTES_MIN || n + 1 == total) {
                submitted += self.submit(std::mem::take(&mut ops), waiting, results);
                ops_bytes = 0;
            }
        }
        submitted
    }

    /// `op` with the buffer it was checked for, from the pool (an allocation failure stands as
    /// its completion).
    fn take_buffer(&mut self, mut op: IoOp) -> Ready {
        match self.pool.get(op.buf_len()) {
            Ok(buf) => {
                op.buf = buf;
                Ready::Op(op)
            }
            Err(error) => Ready::Injected(error, op.buf),
        }
    }

    /// Submits `ops`; returns how many the engine took (a refused group fails its items).
    pub(super) fn submit(
        &mut self,
        ops: Vec<IoOp>,
        waiting: &mut HashMap<u64, Pending>,
        results: &mut Vec<(Pending, io::Result<usize>, AlignedBuf)>,
    ) -> usize {
        let count = ops.len();
        match self.engine.submit(ops) {
            Ok(()) => count,
            Err((error, ops)) => {
                for op in ops {
                    if let Some(pending) = waiting.remove(&op.tag) {
                        let error = io::Error::new(error.kind(), format!("submit: {error}"));
                        results.push((pending, Err(error), op.buf));
                    }
                }
                0
            }
        }
    }
}
