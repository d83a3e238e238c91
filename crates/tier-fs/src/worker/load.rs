//! The load workers: the loop that takes load jobs and runs them as a pipeline (starting queued
//! jobs while their record bytes fit `batch_bytes_max`, finishing each when its reads completed),
//! and the reads themselves: merged reads of neighbouring records, verification of each record's
//! header and checksum, the copy into the slot, and the quarantine of a record that does not
//! verify.

use super::*;

impl Worker {
    /// A load worker's loop: runs load jobs as a pipeline. It starts every queued load job
    /// while the record bytes of the jobs it runs stay under `batch_bytes_max` (their reads go
    /// out at once, merged where records lie one after another), reaps reads as they complete
    /// (verifying each record and copying it into its slot), and finishes each job as soon as
    /// all of its reads completed. So one worker keeps the disk busy with several jobs' reads;
    /// the tier sends jobs to the other load workers only when this one has its fill (each
    /// worker has its own channel), so no more threads are busy than the load needs. Waits for
    /// a job only when nothing is in flight. A
    /// job too large to run beside others (over `batch_bytes_max`, or [`BATCH_OPS_MAX`]
    /// records) runs alone, batch by batch, after the jobs in flight finished; so does a store
    /// job (which the tier sends to the writer). Returns after `Stop` (or the front end is
    /// gone) and every job it took finished.
    pub(crate) fn run(mut self, jobs: Receiver<Msg>, done: Sender<TierCompletion>) {
        let mut open = true;
        loop {
            let step = catch_unwind(AssertUnwindSafe(|| {
                if open {
                    open = self.take_loads(&jobs);
                }
                // Completions ready go out before the worker waits for more reads.
                if self.finished.is_empty() && self.loads_running() > 0 {
                    self.load_step();
                }
            }));
            if step.is_err() {
                self.loader_panicked();
            }
            let finished = std::mem::take(&mut self.finished);
            if finished.into_iter().any(|c| done.send(c).is_err()) {
                break;
            }
            if !open && self.loads_running() == 0 {
                break;
            }
        }
        self.seal_all();
    }

    /// Starts queued load jobs: waits for one if the worker has nothing to do, else takes those
    /// already queued while the running jobs' record bytes stay under `batch_bytes_max` and
    /// their reads in flight under what the engine runs at once (a sync engine's threads: the
    /// jobs beyond wait in this worker's channel), returning early when completions are
    /// ready to send. Returns false once the channel says stop.
    pub(super) fn take_loads(&mut self, jobs: &Receiver<Msg>) -> bool {
        loop {
            let idle = self.loads_running() == 0 && self.finished.is_empty();
            let full = self.load_bytes >= self.settings.batch_bytes_max as u64
                || self.load_reads() >= self.engine.parallel_max();
            if !idle && (full || !self.finished.is_empty()) {
                return true;
            }
            let Some(msg) = next_msg(jobs, idle) else {
                return true;
            };
            match msg {
                Some(Msg::Job(job)) => self.start_load(job),
                Some(Msg::Stop) | None => return false,
            }
        }
    }

    /// Number of load jobs the worker runs.
    pub(super) fn loads_running(&self) -> usize {
        self.loads.iter().filter(|l| l.is_some()).count()
    }

    /// Starts load job `job` beside the running ones: its reads are prepared, merged and
    /// submitted (after enough running jobs finished to keep the record bytes under
    /// `batch_bytes_max` and the reads under [`BATCH_OPS_MAX`]). A job too large for that, or
    /// a store job, runs alone once nothing else is in flight.
    pub(super) fn start_load(&mut self, job: TierJob) {
        let bytes: u64 = job
            .chunks
            .iter()
            .map(|&TierChunk { len, .. }| file_bytes(u64::from(len)))
            .fold(0, u64::saturating_add);
        let budget = self.settings.batch_bytes_max as u64;
        if job.op != TierOp::Load || bytes > budget || job.chunks.len() > BATCH_OPS_MAX {
            while self.loads_running() > 0 {
                self.load_step();
            }
            self.run_alone(job);
            return;
        }
        while self.loads_running() > 0
            && (self.load_bytes + bytes > budget
                || self.load_reads() + job.chunks.len() > BATCH_OPS_MAX)
        {
            self.load_step();
        }
        if self.loads_running() > 0 {
            add(&self.stats().loads_overlapped, 1);
        }
        let n = match self.loads.iter().position(Option::is_none) {
            Some(n) => n,
            None => {
                self.loads.push(None);
                self.loads.len() - 1
            }
        };
        self.loads[n] = Some(ActiveLoad {
            id: job.id,
            keys: job
                .chunks
                .iter()
                .map(|&TierChunk { key, .. }| key)
                .collect(),
            bytes,
        });
        self.load_failed.reset(n);
        self.load_bytes += bytes;
        if self.is_cancelled(job.id) {
            for &TierChunk { key, .. } in &job.chunks {
                self.load_failed
                    .add(&self.shared.stats, n, key, FailureKind::Cancelled);
            }
        } else {
            self.prune_readers();
            let mut items = Vec::with_capacity(job.chunks.len());
            for &TierChunk { key, slot, len } in &job.chunks {
                match self.prepare_load(n, key, slot, len) {
                    Ok(item) => items.push(item),
                    Err(kind) => self.load_failed.add(&self.shared.stats, n, key, kind),
                }
            }
            let items = self.merge_reads(items);
            self.submit_loads(items);
        }
        self.finish_loads();
    }

    /// Runs `job` alone (loads batch by batch) and queues its completion; a panic fails its keys.
    pub(super) fn run_alone(&mut self, job: TierJob) {
        let group = [job];
        let completions = catch_unwind(AssertUnwindSafe(|| self.run_group(&group)))
            .unwrap_or_else(|_| self.panicked(&group));
        self.finished.extend(completions);
    }

    /// Reads of the running load jobs in flight or queued.
    pub(super) fn load_reads(&self) -> usize {
        self.load_ops.len() + self.load_queue.len()
    }

    /// Queues reads of the running load jobs and submits what the in-flight budget allows.
    pub(super) fn submit_loads(&mut self, items: Vec<(Pending, Ready)>) {
        self.load_queue.extend(items);
        self.submit_queued_loads();
    }

    /// Submits queued reads while the reads in flight stay under
    /// [`LOAD_READ_BYTES_IN_FLIGHT_MAX`] (one always goes when none is in flight); handles at
    /// once those that complete without the engine (injected errors, refused submissions).
    pub(super) fn submit_queued_loads(&mut self) {
        loop {
            let mut batch = Vec::new();
            let mut bytes = self.load_ops_bytes;
            while let Some((pending, _)) = self.load_queue.front() {
                let next = bytes.saturating_add(pending.bytes);
                let in_flight = !self.load_ops.is_empty() || !batch.is_empty();
                if in_flight && next > LOAD_READ_BYTES_IN_FLIGHT_MAX {
                    break;
                }
                bytes = next;
                batch.extend(self.load_queue.pop_front());
            }
            if batch.is_empty() {
                return;
            }
            let batch_bytes = bytes - self.load_ops_bytes;
            let mut results = Vec::new();
            let mut waiting = std::mem::take(&mut self.load_ops);
            self.fill_and_submit(batch, &mut waiting, &mut results);
            self.load_ops = waiting;
            let not_sent: u64 = results.iter().map(|(p, _, _)| p.bytes).sum();
            self.load_ops_bytes += batch_bytes - not_sent;
            // Retries these ask for join the queue (and may be submitted from within); the
            // loop ends once nothing is queued or the budget is full.
            self.loads_done(results);
        }
    }

    /// Hands completed reads of the running load jobs to `load_done` (verify, copy into the
    /// slot) and submits the reads it asks to retry.
    pub(super) fn loads_done(&mut self, results: Vec<(Pending, io::Result<usize>, AlignedBuf)>) {
        let mut failed = std::mem::take(&mut self.load_failed);
        let mut retries = Vec::new();
        for (pending, result, buf) in results {
            self.load_done(pending, result, buf, &mut failed, &mut retries);
        }
        self.load_failed = failed;
        self.submit_loads(retries);
    }

    /// Reaps at least one read of the running load jobs (waiting for it), handles what was
    /// reaped, and finishes the jobs whose reads all completed.
    pub(super) fn load_step(&mut self) {
        let mut reaped = Vec::new();
        if self.engine.in_flight() > 0 {
            if self.engine.reap(&mut reaped, 1).is_err() {
                self.load_reap_errors += 1;
                // A read into a slot owns it until reaped: never give up on those.
                let into_slot = self.load_ops.values().any(|p| p.zero_copy);
                if self.load_reap_errors <= REAP_ERRORS_MAX || into_slot {
                    std::thread::sleep(Duration::from_millis(1));
                } else {
                    self.give_up_load_ops();
                }
            } else {
                self.load_reap_errors = 0;
            }
        } else {
            // Nothing in flight, yet reads are waiting: the engine lost them.
            self.give_up_load_ops();
        }
        let mut results = Vec::with_capacity(reaped.len());
        for c in reaped {
            match self.load_ops.remove(&c.tag) {
                Some(pending) => {
                    self.load_ops_bytes -= pending.bytes;
                    results.push((pending, c.result, c.buf));
                }
                None => self.unknown_tag(c.tag, "read"),
            }
        }
        // The next reads go to the disk before this worker checks and copies those that
        // completed, so that the disk is not idle meanwhile.
        self.submit_queued_loads();
        self.loads_done(results);
        self.finish_loads();
    }

    /// Fails the reads of the running load jobs that the engine still holds (or lost), and
    /// those queued behind them (their jobs fail anyway; an engine that loses reads gets no
    /// more). The engine may still use the descriptors of those it held: a reference to each is
    /// leaked so that its number is not reused.
    pub(super) fn give_up_load_ops(&mut self) {
        let lost: Vec<_> = self.load_ops.drain().map(|(_, p)| p).collect();
        self.load_ops_bytes = 0;
        let queued: Vec<_> = self.load_queue.drain(..).map(|(p, _)| p).collect();
        let stats = &self.shared.stats;
        for pending in &lost {
            std::mem::forget(Arc::clone(&pending.file));
        }
        for pending in lost.into_iter().chain(queued) {
            let members = if pending.members.is_empty() {
                vec![(pending.job, pending.key)]
            } else {
                pending.members.iter().map(|m| (m.job, m.key)).collect()
            };
            for (job, key) in members {
                self.load_failed.add(stats, job, key, FailureKind::Io);
            }
        }
    }

    /// Finishes the running load jobs none of whose reads is in flight: their completions
    /// are queued and their bytes leave the budget.
    pub(super) fn finish_loads(&mut self) {
        for n in 0..self.loads.len() {
            if self.loads[n].is_none()
                || self.load_ops.values().any(|p| p.job == n)
                || self.load_queue.iter().any(|(p, _)| p.job == n)
            {
                continue;
            }
            let Some(load) = self.loads[n].take() else {
                continue;
            };
            self.load_bytes -= load.bytes;
            let failed = self.load_failed.take(n);
            self.shared.cancelled().remove(&load.id);
            self.finished.push(TierCompletion {
                id: load.id,
                failed,
            });
        }
    }

    /// After a panic in the load pipeline: reaps every read in flight (some may move bytes
    /// into slots), then fails every key of the running load jobs.
    pub(super) fn loader_panicked(&mut self) {
        let mut reaped = Vec::new();
        while self.engine.in_flight() > 0 {
            if self.engine.reap(&mut reaped, 1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            reaped.clear();
        }
        self.load_ops.clear();
        self.load_ops_bytes = 0;
        // Never submitted: no kernel or engine thread uses their buffers or slots.
        self.load_queue.clear();
        for n in 0..self.loads.len() {
            let Some(load) = self.loads[n].take() else {
                continue;
            };
            let mut failed = Failed::new(1);
            for &key in &load.keys {
                failed.add(&self.shared.stats, 0, key, FailureKind::Io);
            }
            self.shared.cancelled().remove(&load.id);
            self.finished.push(TierCompletion {
                id: load.id,
                failed: failed.take(0),
            });
        }
        self.load_bytes = 0;
    }

    // ---------------------------------------------------------------- load

    pub(super) fn load(&mut self, job: &TierJob, failed: &mut Failed) {
        self.prune_readers();
        let chunks = job.chunks.iter().map(|&chunk| (0, chunk)).collect();
        self.batches(&[job.id], chunks, failed, Self::load_batch);
    }

    /// Closes cached descriptors of segments that left the index (so their space is freed).
    pub(super) fn prune_readers(&mut self) {
        if self.readers.is_empty() {
            return;
        }
        let index = self.shared.index();
        self.readers
            .retain(|id, _| index.segment_path(*id).is_some());
    }

    pub(super) fn load_batch(&mut self, chunks: &[JobChunk], failed: &mut Failed) {
        let mut items = Vec::with_capacity(chunks.len());
        for &(j, TierChunk { key, slot, len }) in chunks {
            match self.prepare_load(j, key, slot, len) {
                Ok(item) => items.push(item),
                Err(kind) => failed.add(self.stats(), j, key, kind),
            }
        }
        let items = self.merge_reads(items);
        self.run_to_completion(items, Self::load_done, failed);
    }

    /// Merges the reads of records that lie one after another in the same segment (read through
    /// the same descriptor, bounce-buffered, without an injected fault that changes the
    /// operation) into one read each, of at most [`READ_MERGE_BYTES_MAX`]; the others are
    /// returned as they are.
    pub(super) fn merge_reads(&mut self, items: Vec<(Pending, Ready)>) -> Vec<(Pending, Ready)> {
        let mergeable = |(pending, ready): &(Pending, Ready)| match ready {
            Ready::Take(op) => {
                op.span.is_none()
                    && op.len as u64 == pending.bytes
                    && !pending.zero_copy
                    && pending.location.is_some()
            }
            _ => false,
        };
        let (mut reads, mut out): (Vec<_>, Vec<_>) = items.into_iter().partition(mergeable);
        let place = |p: &Pending| {
            let segment = p.location.as_ref().map(|l| l.segment);
            (segment, p.offset)
        };
        reads.sort_by_key(|(p, _)| place(p));
        let mut run: Vec<(Pending, Ready)> = Vec::new();
        for item in reads {
            let follows = run.last().is_some_and(|(last, _)| {
                let run_bytes: u64 = run.iter().map(|(p, _)| p.bytes).sum();
                Arc::ptr_eq(&last.file, &item.0.file)
                    && place(last).0 == place(&item.0).0
                    && last.offset + last.bytes == item.0.offset
                    && run_bytes + item.0.bytes <= READ_MERGE_BYTES_MAX
            });
            if !follows {
                self.flush_run(&mut run, &mut out);
            }
            run.push(item);
        }
        self.flush_run(&mut run, &mut out);
        out
    }

    /// Moves `run` (reads of neighbouring records) into `out`: as it is if it is a single read,
    /// else as one merged read.
    pub(super) fn flush_run(
        &mut self,
        run: &mut Vec<(Pending, Ready)>,
        out: &mut Vec<(Pending, Ready)>,
    ) {
        if run.len() < 2 {
            out.append(run);
            return;
        }
        let bytes: u64 = run.iter().map(|(p, _)| p.bytes).sum();
        let members: Vec<Pending> = run.drain(..).map(|(pending, _)| pending).collect();
        let first = &members[0];
        let head = Pending {
            job: first.job,
            key: first.key,
            slot: first.slot,
            len: 0,
            bytes,
            offset: first.offset,
            segment: SegmentId(0),
            location: first.location.clone(),
            file: Arc::clone(&first.file),
            direct: first.direct,
            retried: false,
            corrupt_after_read: false,
            zero_copy: false,
            members,
        };
        add(&self.stats().reads_merged, head.members.len() as u64);
        let ready = self.read_op_for(&head, bytes as usize, None);
        out.push((head, ready));
    }

    /// A read descriptor of `location`'s segment (cached), with or without O_DIRECT.
    pub(super) fn reader(
        &mut self,
        location: &Location,
        direct: bool,
    ) -> io::Result<(Arc<File>, bool)> {
        if let Some((file, cached_direct)) = self.readers.get(&location.segment) {
            if *cached_direct == direct {
                return Ok((Arc::clone(file), direct));
            }
        }
        let file = Arc::new(open_for_read(&location.path, direct)?);
        if self.readers.len() >= READERS_MAX {
            // Operations in flight hold their own reference; nothing they use is closed.
            self.readers.clear();
        }
        self.readers
            .insert(location.segment, (Arc::clone(&file), direct));
        Ok((file, direct))
    }

    pub(super) fn prepare_load(
        &mut self,
        job: usize,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
    ) -> Result<(Pending, Ready), FailureKind> {
        let bytes = file_bytes(u64::from(len));
        let location = {
            let mut index = self.shared.index();
            let location = index.location(key);
            index.touch(key);
            location
        };
        let Some(location) = location else {
            return Err(FailureKind::Missing);
        };
        if location.bytes != bytes {
            return Err(FailureKind::LengthMismatch);
        }
        let direct = self.direct();
        let opened = match self.shared.fault(FaultSite::Open, key, direct) {
            Some(fault) => Err(fault_error(fault)),
            None => self.reader(&location, direct),
        };
        let (file, direct) = match opened {
            Ok(opened) => opened,
            Err(e) if is_einval(&e) && direct => {
                self.fall_back(&format!("open {:?} with O_DIRECT: {e}", location.path));
                add(&self.stats().buffered_retries, 1);
                match self.reader(&location, false) {
                    Ok(opened) => opened,
                    Err(e) => return Err(self.open_failed(&location, &e)),
                }
            }
            Err(e) => return Err(self.open_failed(&location, &e)),
        };
        let zero_copy =
            self.settings.zero_copy_loads && direct && self.slot_payload(slot, len).is_some();
        let pending = Pending {
            job,
            key,
            slot,
            len,
            bytes,
            offset: location.offset,
            segment: SegmentId(0),
            location: Some(location),
            file,
            direct,
            retried: false,
            corrupt_after_read: false,
            zero_copy,
            members: Vec::new(),
        };
        Ok(self.read_item(pending))
    }

    pub(super) fn open_failed(&self, location: &Location, error: &io::Error) -> FailureKind {
        if error.kind() == io::ErrorKind::NotFound {
            // Gone (evicted by another instance sharing the directory): drop it from the index.
            self.shared.index().remove_segment(location.segment);
            return FailureKind::Missing;
        }
        failure_of(error)
    }

    /// The read of a prepared load, with the read faults applied; its buffer is taken when it is
    /// submitted.
    pub(super) fn read_item(&mut self, mut pending: Pending) -> (Pending, Ready) {
        let none = || AlignedBuf::with_capacity(0);
        let mut len = pending.bytes as usize;
        match self
            .shared
            .fault(FaultSite::Read, pending.key, pending.direct)
        {
            Some(Fault::Short) => len = short_len(len),
            Some(Fault::Corrupt) => pending.corrupt_after_read = true,
            Some(fault) => return (pending, Ready::Injected(fault_error(fault), none())),
            None => {}
        }
        let span = match self.span_for(&pending, len) {
            Ok(span) => span,
            Err(e) => return (pending, Ready::Injected(e, none())),
        };
        let ready = self.read_op_for(&pending, len, span);
        (pending, ready)
    }

    /// Handles a load's completion; pushes the operation to retry buffered after EINVAL.
    pub(super) fn load_done(
        &mut self,
        mut pending: Pending,
        result: io::Result<usize>,
        buf: AlignedBuf,
        failed: &mut Failed,
        retries: &mut Vec<(Pending, Ready)>,
    ) {
        if !pending.members.is_empty() {
            self.merged_done(pending, result, buf, failed, retries);
            return;
        }
        match result {
            Ok(n) => {
                self.verify_and_copy(&pending, n, &buf, failed);
                self.pool.put(buf);
            }
            Err(e) if is_einval(&e) && pending.direct && !pending.retried => {
                let Some(location) = pending.location.clone() else {
                    self.pool.put(buf);
                    failed.add(self.stats(), pending.job, pending.key, failure_of(&e));
                    return;
                };
                self.fall_back(&format!(
                    "read {:?} at offset {}: {e}",
                    location.path, location.offset
                ));
                match self.reader(&location, false) {
                    Ok((file, _)) => {
                        add(&self.stats().buffered_retries, 1);
                        pending.file = file;
                        pending.direct = false;
                        pending.retried = true;
                        self.pool.put(buf);
                        retries.push(self.read_item(pending));
                    }
                    Err(e) => {
                        self.pool.put(buf);
                        let kind = self.open_failed(&location, &e);
                        failed.add(self.stats(), pending.job, pending.key, kind);
                    }
                }
            }
            Err(e) => {
                // EIO and the like may be transient: the key fails, the record stays.
                self.pool.put(buf);
                failed.add(self.stats(), pending.job, pending.key, failure_of(&e));
            }
        }
    }

    /// Handles the completion of a merged read: each record it read whole is verified and
    /// copied like a single read; a record it did not read whole (a short read) and, after
    /// EINVAL, every record is read again on its own (where a short read means a torn record).
    pub(super) fn merged_done(
        &mut self,
        mut head: Pending,
        result: io::Result<usize>,
        buf: AlignedBuf,
        failed: &mut Failed,
        retries: &mut Vec<(Pending, Ready)>,
    ) {
        let members = std::mem::take(&mut head.members);
        let n = match result {
            Ok(n) => n,
            Err(e) if is_einval(&e) && head.direct => {
                self.fall_back(&format!(
                    "read {:?} at offset {}: {e}",
                    head.location.as_ref().map(|l| &l.path),
                    head.offset
                ));
                // Each record alone, through a descriptor of the segment now without O_DIRECT.
                0
            }
            Err(e) => {
                self.pool.put(buf);
                for m in members {
                    failed.add(self.stats(), m.job, m.key, failure_of(&e));
                }
                return;
            }
        };
        let image = buf.as_full_slice();
        let mut again = Vec::new();
        for m in members {
            let at = (m.offset - head.offset) as usize;
            let end = at + m.bytes as usize;
            if n < end {
                again.push(m);
                continue;
            }
            self.verify_image(&m, &image[at..end], failed);
        }
        self.pool.put(buf);
        for mut m in again {
            if !self.direct() && m.direct {
                let Some(location) = m.location.clone() else {
                    failed.add(self.stats(), m.job, m.key, FailureKind::Io);
                    continue;
                };
                match self.reader(&location, false) {
                    Ok((file, _)) => {
                        add(&self.stats().buffered_retries, 1);
                        m.file = file;
                        m.direct = false;
                        m.retried = true;
                    }
                    Err(e) => {
                        let kind = self.open_failed(&location, &e);
                        failed.add(self.stats(), m.job, m.key, kind);
                        continue;
                    }
                }
            }
            retries.push(self.read_item(m));
        }
    }

    /// Verifies `n` bytes read for `pending` and copies the payload into its slot; a short or
    /// corrupt record is quarantined.
    pub(super) fn verify_and_copy(
        &mut self,
        pending: &Pending,
        n: usize,
        buf: &AlignedBuf,
        failed: &mut Failed,
    ) {
        let key = pending.key;
        if (n as u64) < pending.bytes {
            self.quarantine(key, pending.location.as_ref());
            failed.add(self.stats(), pending.job, key, FailureKind::ShortRead);
            return;
        }
        if pending.zero_copy {
            self.verify_in_slot(pending, buf, failed);
            return;
        }
        self.verify_image(
            pending,
            &buf.as_full_slice()[..pending.bytes as usize],
            failed,
        );
    }

    /// Fails `pending`'s chunk whose record did not verify: a length mismatch as such, anything
    /// else as corrupt, after quarantining the record.
    fn verify_failed(
        &mut self,
        pending: &Pending,
        error: &offload_core::record::FormatError,
        failed: &mut Failed,
    ) {
        let key = pending.key;
        if error.is_corruption() {
            self.quarantine(key, pending.location.as_ref());
            failed.add(self.stats(), pending.job, key, FailureKind::Corrupt);
        } else {
            failed.add(self.stats(), pending.job, key, FailureKind::LengthMismatch);
        }
    }

    /// Verifies the record image `read` (header, payload, padding) for `pending` and copies its
    /// payload into the slot; a corrupt record is quarantined.
    pub(super) fn verify_image(&mut self, pending: &Pending, read: &[u8], failed: &mut Failed) {
        let key = pending.key;
        let corrupted;
        let image = if pending.corrupt_after_read {
            let mut copy = read.to_vec();
            flip_payload_byte(&mut copy, pending.len);
            corrupted = copy;
            &corrupted[..]
        } else {
            read
        };
        match verify(image, key, u64::from(pending.len)) {
            Ok(payload) => {
                if !self.verified_fits(pending, image, payload.len()) {
                    failed.add(self.stats(), pending.job, key, FailureKind::Io);
                    return;
                }
                self.memory.write_slot(pending.slot, 0, payload);
                add(&self.stats().chunks_loaded, 1);
                add(&self.stats().bytes_loaded, u64::from(pending.len));
            }
            Err(e) => self.verify_failed(pending, &e, failed),
        }
    }

    /// Checks, before a verified payload is copied into its slot, that the record's header
    /// names the key and length the job asked for and that the copy stays inside the slot
    /// (`len <= slot_bytes`); a record that fails this passed verification while it should
    /// not have: a broken invariant (see [`Worker::broken`]), and the chunk fails uncopied.
    pub(super) fn verified_fits(&self, pending: &Pending, image: &[u8], copy_len: usize) -> bool {
        let header = Header::decode(&image[..HEADER_BYTES.min(image.len())]).ok();
        let (key, len) = (pending.key, pending.len);
        if header.map(|h| (h.key, h.payload_len)) != Some((key, u64::from(len))) {
            self.broken(format_args!(
                "verified record of {:#x}/{} has header {header:?}, not the requested key and \
                 length {len}",
                key.hash, key.group
            ));
            return false;
        }
        let slot_bytes = self.memory.slot_bytes();
        if copy_len != len as usize
            || copy_len > slot_bytes
            || pending.slot.0 >= self.memory.slot_count()
        {
            self.broken(format_args!(
                "load copy of {:#x}/{}: {copy_len} bytes (requested {len}) into slot {} of \
                 {slot_bytes} bytes (slot_count {})",
                key.hash,
                key.group,
                pending.slot.0,
                self.memory.slot_count()
            ));
            return false;
        }
        true
    }

    /// Verifies a record read straight into its slot (header in `buf`, payload in the slot) in
    /// place. A record that does not verify leaves garbage in the slot, which the Tier contract
    /// allows: a failed key is never served.
    pub(super) fn verify_in_slot(
        &mut self,
        pending: &Pending,
        buf: &AlignedBuf,
        failed: &mut Failed,
    ) {
        let key = pending.key;
        let Some(payload) = self.slot_payload(pending.slot, pending.len) else {
            failed.add(self.stats(), pending.job, key, FailureKind::Io);
            return;
        };
        // SAFETY: the read into the slot was reaped (this runs on its completion), the slot
        // belongs to this job until its completion is sent, and the range is inside it; this
        // is the only reference to it while it lives.
        let body = unsafe { std::slice::from_raw_parts_mut(payload.ptr.as_ptr(), payload.len) };
        if pending.corrupt_after_read {
            body[body.len() / 2] ^= 0x5A;
        }
        let header = &buf.as_full_slice()[..HEADER_BYTES];
        match verify_parts(header, body, key, u64::from(pending.len)) {
            Ok(_) => {
                add(&self.stats().chunks_loaded, 1);
                add(&self.stats().bytes_loaded, u64::from(pending.len));
            }
            Err(e) => self.verify_failed(pending, &e, failed),
        }
    }

    /// Drops a record that does not verify from the index and, in a segment this instance may
    /// modify, covers it with a skip record so that no later start indexes it again.
    pub(super) fn quarantine(&self, key: ChunkKey, location: Option<&Location>) {
        add(&self.stats().quarantined, 1);
        let Some(location) = location else {
            return;
        };
        {
            let mut index = self.shared.index();
            let same = index
                .location(key)
                .is_some_and(|l| l.segment == location.segment && l.offset == location.offset);
            if same {
                index.remove(key);
            }
        }
        if self.may_modify(&location.path) {
            if let Ok(file) = open_for_repair(&location.path) {
                let _ = write_skip(&file, location.offset, location.bytes);
            }
        }
    }
}
