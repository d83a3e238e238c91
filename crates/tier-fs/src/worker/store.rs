//! The writer: the loop that takes store jobs and runs them as a pipeline, and the store path
//! itself: capacity reservation and eviction, segment creation and preallocation, record
//! placement, bounced or zero-copy writes, indexing of completed records, skip records over
//! failed ones, and sealing.

use super::*;

impl Worker {
    /// The writer's loop: runs store jobs as one pipeline of appends to its open segment. It
    /// starts every queued job (while the record bytes of the jobs it runs stay under
    /// `batch_bytes_max`), reaps writes as they complete, and finishes each job as soon as all
    /// of its writes completed, so the disk always has the next jobs' writes queued. Waits for a
    /// job only when nothing is in flight. Returns after `Stop` (or the front end is gone) and
    /// every job it took finished, sealing its segments.
    pub(crate) fn run_writer(mut self, jobs: Receiver<Msg>, done: Sender<TierCompletion>) {
        self.housekeeper = housekeep::Housekeeper::start(&self.shared, self.durable());
        let mut open = true;
        loop {
            let step = catch_unwind(AssertUnwindSafe(|| {
                if open {
                    open = self.take_stores(&jobs);
                }
                self.store_step();
            }));
            if step.is_err() {
                self.writer_panicked();
            }
            let finished = std::mem::take(&mut self.finished);
            if finished.into_iter().any(|c| done.send(c).is_err()) {
                break;
            }
            if !open && self.active.is_empty() {
                break;
            }
        }
        self.seal_all();
        // Waits for the queued seals, and deletes a prepared segment not taken.
        drop(self.housekeeper.take());
    }

    /// Starts queued jobs: waits for one if the writer has nothing to do, else takes those
    /// already queued while the running jobs' record bytes stay under `batch_bytes_max`.
    /// Returns false once the channel says stop.
    pub(super) fn take_stores(&mut self, jobs: &Receiver<Msg>) -> bool {
        loop {
            let idle = self.active.is_empty() && self.finished.is_empty();
            if !idle && self.active_bytes >= self.settings.batch_bytes_max as u64 {
                return true;
            }
            let Some(msg) = next_msg(jobs, idle) else {
                return true;
            };
            match msg {
                Some(Msg::Job(job)) if job.op == TierOp::Store => self.start_store(&job),
                Some(Msg::Job(job)) => {
                    // A load shares the engine: the stores' writes are reaped first.
                    while !self.active.is_empty() {
                        self.store_step();
                    }
                    let completions = self.run_group(&[job]);
                    self.finished.extend(completions);
                }
                Some(Msg::Stop) | None => return false,
            }
        }
    }

    /// The completions of a group of jobs whose run panicked: every key failed. Operations
    /// still in flight are reaped first, since some may move bytes into or from the jobs' slots.
    pub(super) fn panicked(&mut self, group: &[TierJob]) -> Vec<TierCompletion> {
        let mut reaped = Vec::new();
        while self.engine.in_flight() > 0 {
            if self.engine.reap(&mut reaped, 1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            // Only the memory matters here; the records are given up below.
            reaped.clear();
        }
        let mut failed = Failed::new(group.len());
        for (j, job) in group.iter().enumerate() {
            for &TierChunk { key, .. } in &job.chunks {
                failed.add(self.stats(), j, key, FailureKind::Io);
            }
        }
        // Whatever the batch wrote is not indexed, and writes may still be in flight: its
        // segments are given up unsealed (evictable; the next start verifies and seals them).
        let shared = Arc::clone(&self.shared);
        give_up_segments(&mut self.written, &mut self.segments, &mut shared.index());
        self.completions(group, failed)
    }

    // ---------------------------------------------------------------- store

    /// Starts store job `job`: its chunks not yet on disk are placed one after another in the
    /// open segment, the range is preallocated, and their writes go out (filled and submitted in
    /// groups of [`SUBMIT_BYTES_MIN`] bytes, so the first are on their way while the next are
    /// checksummed). A job with nothing to write finishes at once.
    pub(super) fn start_store(&mut self, job: &TierJob) {
        let number = self.next_active;
        self.next_active += 1;
        let mut active = Active {
            id: job.id,
            keys: job.chunks.iter().map(|c| c.key).collect(),
            failed: Failed::new(1),
            records: 0,
            written: Vec::new(),
            bytes: 0,
        };
        let mut todo = Vec::new();
        if self.is_cancelled(job.id) {
            for &TierChunk { key, .. } in &job.chunks {
                active
                    .failed
                    .add(self.stats(), 0, key, FailureKind::Cancelled);
            }
        } else {
            let mut seen = HashSet::new();
            let mut index = self.shared.index();
            for &TierChunk { key, slot, len } in &job.chunks {
                if !seen.insert(key) {
                    continue;
                }
                if index.contains(key) {
                    // Already on disk: not rewritten (equal keys mean equal bytes).
                    index.touch(key);
                    add(&self.shared.stats.stores_skipped, 1);
                    continue;
                }
                todo.push((key, slot, len));
            }
        }
        // Active from here on, so that a panic still completes it (`writer_panicked`).
        self.active.insert(number, active);
        let mut items = Vec::with_capacity(todo.len());
        let mut failures = Vec::new();
        for (key, slot, len) in todo {
            match self.place(number, key, slot, len) {
                Ok(item) => items.push(item),
                Err(kind) => failures.push((key, kind)),
            }
        }
        let bytes: u64 = items.iter().map(|(p, _)| p.bytes).sum();
        if let Some(active) = self.active.get_mut(&number) {
            for (key, kind) in failures {
                active.failed.add(&self.shared.stats, 0, key, kind);
            }
            active.records = items.len();
            active.bytes = bytes;
        }
        self.active_bytes += bytes;
        self.preallocate();
        self.submit_stores(items);
        self.hand_over_written();
    }

    /// Fills and submits store records (or retries), handing results that need no I/O (an
    /// injected error, a refused submission) to `store_done` at once.
    pub(super) fn submit_stores(&mut self, mut items: Vec<(Pending, Ready)>) {
        while !items.is_empty() {
            let mut results = Vec::new();
            let mut waiting = std::mem::take(&mut self.store_ops);
            self.fill_and_submit(std::mem::take(&mut items), &mut waiting, &mut results);
            self.store_ops = waiting;
            let mut failed = Failed::new(0);
            for (pending, result, buf) in results {
                self.store_done(pending, result, buf, &mut failed, &mut items);
            }
        }
    }

    /// Reaps at least one store write (if any is in flight) and finishes the jobs whose writes
    /// all completed. Writes the engine lost (or that never completed after many reap errors,
    /// none of them reading a slot) fail their records.
    pub(super) fn store_step(&mut self) {
        let mut reaped = Vec::new();
        let mut errors = 0;
        while self.engine.in_flight() > 0 && reaped.is_empty() {
            if self.engine.reap(&mut reaped, 1).is_err() {
                errors += 1;
                // A write from a slot owns it until reaped: never give up on those.
                if errors > REAP_ERRORS_MAX && !self.store_ops.values().any(|p| p.zero_copy) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let mut retries = Vec::new();
        let mut failed = Failed::new(0);
        for completion in reaped {
            let Some(pending) = self.store_ops.remove(&completion.tag) else {
                self.unknown_tag(completion.tag, "write");
                continue;
            };
            let result = completion.result;
            self.store_done(pending, result, completion.buf, &mut failed, &mut retries);
        }
        let gave_up = errors > REAP_ERRORS_MAX;
        if (self.engine.in_flight() == 0 || gave_up) && retries.is_empty() {
            for (_, pending) in std::mem::take(&mut self.store_ops) {
                // The engine still owns the operation and its buffer: leak a reference to the
                // descriptor so that its number is not reused while the engine may still use
                // it, and fail the record.
                std::mem::forget(Arc::clone(&pending.file));
                let error = io::Error::other("the I/O engine lost the operation");
                let buf = AlignedBuf::with_capacity(0);
                self.store_done(pending, Err(error), buf, &mut failed, &mut retries);
            }
        }
        self.submit_stores(retries);
        self.hand_over_written();
    }

    /// Hands completed record writes to their jobs, and finishes every job whose writes all
    /// completed.
    pub(super) fn hand_over_written(&mut self) {
        for w in std::mem::take(&mut self.written) {
            if let Some(active) = self.active.get_mut(&w.job) {
                active.written.push(w);
            }
        }
        let done: Vec<usize> = self
            .active
            .iter()
            .filter(|(_, a)| a.written.len() >= a.records)
            .map(|(&n, _)| n)
            .collect();
        for number in done {
            if let Some(active) = self.active.remove(&number) {
                // Until its completion is pushed, a panic must still complete it.
                self.finishing = Some((active.id, active.keys.clone()));
                self.finish_store(active);
                self.finishing = None;
            }
        }
        self.seal_finished();
    }

    /// Allocates each open segment's blocks up to its cursor (a fresh segment: whole; `fallocate`,
    /// which also sets the file size) before the job's writes go out. Appending O_DIRECT writes
    /// that extend a file or fill a hole take the inode's lock exclusively (ext4, xfs), so the
    /// kernel runs them one at a time, and io_uring hands them to blocking worker threads; writes
    /// into allocated blocks below the file size run concurrently and asynchronously. Best effort:
    /// where it fails (a file system without `fallocate`, no space), the writes go out as they are
    /// and meet the same condition themselves. Not in a shared directory: there another instance's
    /// probe reads segments while they are appended, and a record inside the file size could be
    /// seen with its header written before its payload.
    pub(super) fn preallocate(&mut self) {
        if !self.preallocate {
            return;
        }
        let segment_bytes = self.settings.segment_bytes;
        for seg in self.segments.iter_mut().filter(|s| s.allocated < s.cursor) {
            // A fresh segment is allocated whole: `fallocate` waits for every direct I/O in
            // flight on the file (ext4's `inode_dio_wait`), so growing it job by job would drain
            // the writer's queue at every job. Whole means as many records of its first
            // record's size as it takes, and the seal: chunks of one model are one size, so the
            // seal then lands on the allocated end and no tail is trimmed (an `ftruncate`, which
            // frees blocks in the journal, on the writer's thread). Later calls only cover a
            // rewound range or a record larger than a segment.
            let end = if seg.allocated == 0 {
                seg.cursor
                    .max(fitted_bytes(segment_bytes, seg.first_record))
            } else {
                seg.cursor
            };
            let (offset, len) = (seg.allocated, end - seg.allocated);
            match crate::direct::allocate(&seg.file, offset, len) {
                Ok(()) => {
                    seg.allocated = end;
                    add(&self.shared.stats.bytes_preallocated, len);
                    // The allocated space is the segment's (and counts against the capacity).
                    self.shared.index().grow_segment(seg.id, end);
                }
                Err(e) if crate::direct::is_unsupported(&e) => {
                    self.preallocate = false;
                    return;
                }
                Err(_) => {}
            }
        }
    }

    /// Deletes (or forgets) evicted segments.
    pub(super) fn evict(&mut self, victims: Vec<Victim>) {
        for victim in victims {
            if victim.delete {
                // A file already gone is as good as deleted.
                let _ = std::fs::remove_file(&*victim.path);
            }
            add(&self.stats().evictions, victim.chunks);
            add(&self.stats().evicted_bytes, victim.bytes);
        }
    }

    /// Reserves room for a record, places it in the open segment (creating one when needed) and
    /// fills its buffer. A failure has released what it reserved.
    pub(super) fn place(
        &mut self,
        job: usize,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
    ) -> Result<(Pending, Ready), FailureKind> {
        let bytes = file_bytes(u64::from(len));
        let need_new = match self.segments.last() {
            None => true,
            Some(seg) => {
                seg.closed || (seg.cursor > 0 && seg.cursor + bytes > self.settings.segment_bytes)
            }
        };
        let reserve = bytes + if need_new { SEAL_BYTES } else { 0 };
        let victims = self
            .shared
            .index()
            .reserve(reserve)
            .ok_or(FailureKind::Capacity)?;
        self.evict(victims);
        if need_new {
            if let Some(last) = self.segments.last_mut() {
                last.closed = true;
            }
            if let Err(kind) = self.open_segment() {
                self.shared.index().release(reserve);
                return Err(kind);
            }
        }
        let at = self.segments.len() - 1;
        if let Err(kind) = self.prepare_segment(at, key) {
            self.shared.index().release(bytes);
            return Err(kind);
        }
        let zero_copy = self.segments[at].direct && self.slot_payload(slot, len).is_some();
        let buf_bytes = if zero_copy {
            HEADER_BYTES
        } else {
            bytes as usize
        };
        let buf = match self.pool.get(buf_bytes) {
            Ok(buf) => buf,
            Err(e) => {
                self.shared.index().release(bytes);
                return Err(failure_of(&e));
            }
        };
        let seg = &mut self.segments[at];
        let offset = seg.cursor;
        if offset == 0 {
            seg.first_record = bytes;
        }
        seg.cursor += bytes;
        seg.records_open += 1;
        let segment = seg.id;
        let file = Arc::clone(&seg.file);
        let direct = seg.direct;
        if offset == 0 {
            self.prepare_next_segment(bytes);
        }
        let pending = Pending {
            job,
            key,
            slot,
            len,
            bytes,
            offset,
            segment,
            location: None,
            file,
            direct,
            retried: false,
            corrupt_after_read: false,
            zero_copy,
            members: Vec::new(),
        };
        Ok((pending, Ready::Fill(buf)))
    }

    /// Fills a placed record's buffer (header, the slot's payload, padding) and prepares its
    /// write, with the write faults applied.
    pub(super) fn fill_record(
        &mut self,
        pending: Pending,
        mut buf: AlignedBuf,
    ) -> (Pending, Ready) {
        if pending.zero_copy {
            if let Some(payload) = self.slot_payload(pending.slot, pending.len) {
                // SAFETY: the slot belongs to this job until its completion is sent (the Tier
                // contract: the caller neither writes nor frees it meanwhile), the range is
                // inside it (`slot_payload`), and nothing in this worker writes it during a
                // store; the shared slice ends before the write is submitted.
                let bytes =
                    unsafe { std::slice::from_raw_parts(payload.ptr.as_ptr(), payload.len) };
                Header::for_payload(pending.key, bytes).encode(buf.as_full_mut_slice());
                return self.write_item(pending, buf);
            }
        }
        let memory = &self.memory;
        let (total, _) = encode_into(
            buf.as_full_mut_slice(),
            pending.key,
            pending.len as usize,
            |dst| memory.read_slot(pending.slot, 0, dst),
        );
        debug_assert_eq!(total as u64, pending.bytes);
        self.write_item(pending, buf)
    }

    /// Makes segment `at` ready for `key`'s record: buffered if the root switched, with the
    /// injected open faults (the open site stands for preparing the file for this record).
    pub(super) fn prepare_segment(&mut self, at: usize, key: ChunkKey) -> Result<(), FailureKind> {
        if self.segments[at].direct && !self.direct() {
            self.reopen_buffered(at).map_err(|e| failure_of(&e))?;
        }
        let direct = self.segments[at].direct;
        match self.shared.fault(FaultSite::Open, key, direct) {
            Some(Fault::Stall) => {
                add(&self.stats().stalls, 1);
                let start = std::time::Instant::now();
                while !self.shared.stalls_released.load(Ordering::Acquire)
                    && start.elapsed() < STALL_MAX
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Ok(())
            }
            Some(Fault::Einval) => {
                let path = Arc::clone(&self.segments[at].path);
                self.fall_back(&format!("open {path:?} with O_DIRECT: injected EINVAL"));
                add(&self.stats().buffered_retries, 1);
                self.reopen_buffered(at).map_err(|e| failure_of(&e))
            }
            Some(fault) => Err(failure_of(&fault_error(fault))),
            None => Ok(()),
        }
    }

    /// Creates a new segment file (O_EXCL; EINVAL from O_DIRECT falls back to buffered) and
    /// makes it the open segment.
    pub(super) fn open_segment(&mut self) -> Result<(), FailureKind> {
        let sequence = self.shared.next_sequence.fetch_add(1, Ordering::Relaxed);
        let path = self
            .settings
            .layout
            .segment_path(self.shared.instance, sequence);
        if let Some(prepared) = self.housekeeper.as_mut().and_then(|h| h.take()) {
            if crate::direct::link_unnamed(&prepared.file, &path).is_ok() {
                self.open_prepared(path, prepared);
                return Ok(());
            }
            // Named files only from here on (the prepared one goes with its descriptor).
            if let Some(housekeeper) = self.housekeeper.as_mut() {
                housekeeper.stop_preparing();
            }
        }
        let direct = self.direct();
        let (file, direct) = match create_for_write(&path, direct) {
            Ok(file) => (file, direct),
            Err(e) if is_einval(&e) && direct => {
                self.fall_back(&format!("open {path:?} with O_DIRECT: {e}"));
                // EINVAL may come after the file was created; the name is ours alone.
                let _ = std::fs::remove_file(&path);
                match create_for_write(&path, false) {
                    Ok(file) => (file, false),
                    Err(e) => return Err(self.discard(&path, &e)),
                }
            }
            Err(e) => return Err(self.discard(&path, &e)),
        };
        if self.durable() {
            let synced = path
                .parent()
                .map(|dir| File::open(dir).and_then(|d| d.sync_all()));
            if let Some(Err(e)) = synced {
                drop(file);
                return Err(self.discard(&path, &e));
            }
        }
        self.push_segment(path, file, direct, 0);
        Ok(())
    }

    /// Makes a fresh segment file, whose blocks are allocated up to `allocated`, the open segment
    /// (the allocated space is the segment's, and counts against the capacity).
    fn push_segment(&mut self, path: PathBuf, file: File, direct: bool, allocated: u64) {
        let id = self
            .shared
            .index()
            .add_segment(&path, allocated, SegmentState::Writing);
        self.segments.push(OpenSegment {
            id,
            path: Arc::new(path),
            file: Arc::new(file),
            direct,
            cursor: 0,
            allocated,
            first_record: 0,
            closed: false,
            records_open: 0,
        });
    }

    /// Makes a segment the housekeeper created (and allocated), named `path`, the open segment.
    fn open_prepared(&mut self, path: PathBuf, prepared: housekeep::Prepared) {
        add(&self.stats().segments_prepared, 1);
        if prepared.unsupported {
            self.preallocate = false;
        }
        add(&self.stats().bytes_preallocated, prepared.allocated);
        self.push_segment(path, prepared.file, prepared.direct, prepared.allocated);
    }

    /// Asks the housekeeper to prepare the segment after the open one, allocated for records of
    /// `record` bytes (the open segment's first), so that it is ready when the open one fills.
    /// Its bytes are reserved now (evicting as a record would), so that the files on disk stay
    /// within the capacity; where they do not fit, the writer creates the next segment itself.
    /// Only in a tier of at least [`SPARE_CAPACITY_SEGMENTS_MIN`] segments, where holding one
    /// segment's space early changes what stays cached by little.
    fn prepare_next_segment(&mut self, record: u64) {
        if !self.preallocate || !self.housekeeper.as_ref().is_some_and(|h| h.can_prepare()) {
            return;
        }
        let bytes = fitted_bytes(self.settings.segment_bytes, record);
        let capacity = self.shared.index().capacity_bytes();
        if bytes.saturating_mul(SPARE_CAPACITY_SEGMENTS_MIN) > capacity {
            return;
        }
        let Some(victims) = self.shared.index().reserve(bytes) else {
            return;
        };
        self.evict(victims);
        let task = housekeep::Prepare {
            dir: self.settings.layout.dir().to_path_buf(),
            direct: self.direct(),
            bytes,
        };
        if let Some(housekeeper) = self.housekeeper.as_mut() {
            housekeeper.request(task, bytes);
        }
    }

    pub(super) fn discard(&self, path: &std::path::Path, error: &io::Error) -> FailureKind {
        let _ = std::fs::remove_file(path);
        failure_of(error)
    }

    /// Reopens segment `at` without O_DIRECT (after EINVAL, or once the root switched).
    pub(super) fn reopen_buffered(&mut self, at: usize) -> io::Result<()> {
        let seg = &mut self.segments[at];
        let file = reopen_buffered_for_write(&seg.path)?;
        seg.file = Arc::new(file);
        seg.direct = false;
        Ok(())
    }

    /// The write of a placed record, with the write faults applied.
    pub(super) fn write_item(
        &mut self,
        mut pending: Pending,
        mut buf: AlignedBuf,
    ) -> (Pending, Ready) {
        let mut len = pending.bytes as usize;
        match self
            .shared
            .fault(FaultSite::Write, pending.key, pending.direct)
        {
            Some(Fault::Short) => len = short_len(len),
            Some(Fault::Corrupt) if pending.zero_copy => {
                // The slot is the caller's and is never modified by a store: the corrupted
                // record goes through a bounce buffer.
                match self.bounce_record(&pending, &buf) {
                    Ok(image) => {
                        self.pool.put(std::mem::replace(&mut buf, image));
                        pending.zero_copy = false;
                        flip_payload_byte(buf.as_full_mut_slice(), pending.len);
                    }
                    Err(e) => return (pending, Ready::Injected(e, buf)),
                }
            }
            Some(Fault::Corrupt) => flip_payload_byte(buf.as_full_mut_slice(), pending.len),
            Some(fault) => return (pending, Ready::Injected(fault_error(fault), buf)),
            None => {}
        }
        let span = match self.span_for(&pending, len) {
            Ok(span) => span,
            Err(e) => return (pending, Ready::Injected(e, buf)),
        };
        buf.set_len(if span.is_some() {
            HEADER_BYTES
        } else {
            pending.bytes as usize
        });
        let ready = self.op_for(OpKind::Write, &pending, len, buf, span);
        (pending, ready)
    }

    /// The operation of `kind` on `pending`'s record: `len` bytes through `buf`, then `span`.
    /// Checks what holds by construction (see [`Worker::edge_broken`]); an operation that breaks
    /// it is never submitted and stands as a failed one.
    pub(super) fn op_for(
        &mut self,
        kind: OpKind,
        pending: &Pending,
        len: usize,
        buf: AlignedBuf,
        span: Option<SlotSpan>,
    ) -> Ready {
        let capacity = buf.capacity();
        match self.checked_op(kind, pending, len, buf, capacity, span) {
            Ok(op) => Ready::Op(op),
            Err((error, buf)) => Ready::Injected(error, buf),
        }
    }

    /// Like [`Worker::op_for`] for a read whose buffer (`len` less the span's length) is taken
    /// from the pool just before its submission ([`Ready::Take`]): reads queued behind those in
    /// flight hold no memory, and the pool's buffers go round instead of new ones being
    /// allocated (and their pages faulted in) for every prepared read.
    pub(super) fn read_op_for(
        &mut self,
        pending: &Pending,
        len: usize,
        span: Option<SlotSpan>,
    ) -> Ready {
        let capacity = len.saturating_sub(span.as_ref().map_or(0, SlotSpan::len));
        let none = AlignedBuf::with_capacity(0);
        match self.checked_op(OpKind::Read, pending, len, none, capacity, span) {
            Ok(op) => Ready::Take(op),
            Err((error, buf)) => Ready::Injected(error, buf),
        }
    }

    /// The operation of [`Worker::op_for`], checked as if its buffer held `capacity` bytes.
    fn checked_op(
        &mut self,
        kind: OpKind,
        pending: &Pending,
        len: usize,
        buf: AlignedBuf,
        capacity: usize,
        span: Option<SlotSpan>,
    ) -> Result<IoOp, (io::Error, AlignedBuf)> {
        if let Some(what) = self.edge_broken(pending, len, capacity, span.as_ref()) {
            self.broken(format_args!(
                "{kind:?} of {:#x}/{} at offset {}: {what}",
                pending.key.hash, pending.key.group, pending.offset
            ));
            let error = io::Error::other(format!("broken invariant: {what}"));
            return Err((error, buf));
        }
        Ok(IoOp {
            tag: self.tag(),
            kind,
            fd: std::os::fd::AsRawFd::as_raw_fd(&*pending.file),
            offset: pending.offset,
            len,
            buf,
            span,
        })
    }

    /// What is wrong with an operation of `len` bytes through a buffer of `capacity` bytes then
    /// `span` on `pending`'s record(s), if anything: it moves more than the record length it was
    /// planned with (`pending.bytes`; an injected short transfer moves less), more than its
    /// buffer holds, a zero-copy span leaves its slot, or, with O_DIRECT, its offset or its full
    /// length is not a multiple of [`ALIGN`].
    pub(super) fn edge_broken(
        &self,
        pending: &Pending,
        len: usize,
        capacity: usize,
        span: Option<&SlotSpan>,
    ) -> Option<String> {
        let span_len = span.map_or(0, SlotSpan::len);
        if len as u64 > pending.bytes {
            return Some(format!("{len} bytes for a record of {}", pending.bytes));
        }
        if len.saturating_sub(span_len) > capacity || span_len > len {
            return Some(format!(
                "{len} bytes ({span_len} through the slot) over a buffer of {capacity}"
            ));
        }
        if pending.direct
            && (pending.offset % ALIGN as u64 != 0
                || (len as u64 == pending.bytes && len % ALIGN != 0))
        {
            return Some(format!(
                "O_DIRECT offset or length {len} not a multiple of {ALIGN}"
            ));
        }
        let span = span?;
        let inside = self.memory.slot_ptr(pending.slot).is_some_and(|slot| {
            let start = slot.as_ptr() as usize;
            let at = span.as_ptr() as usize;
            at >= start && at + span.len() <= start + self.memory.slot_bytes()
        });
        (!inside).then(|| {
            format!(
                "a zero-copy span of {span_len} bytes outside slot {}",
                pending.slot.0
            )
        })
    }

    /// The payload of `slot` for `len` bytes, when it can move straight between the slot and an
    /// O_DIRECT file: the memory has a stable address, and the slot's start and `len` are
    /// multiples of [`ALIGN`] (so the record needs no padding) and `len` fits the slot.
    pub(super) fn slot_payload(&self, slot: SlotId, len: u32) -> Option<SlotSpanInfo> {
        let len = len as usize;
        if len == 0 || len % ALIGN != 0 || len > self.memory.slot_bytes() {
            return None;
        }
        if slot.0 >= self.memory.slot_count() {
            return None;
        }
        let ptr = self.memory.slot_ptr(slot)?;
        (ptr.as_ptr() as usize % ALIGN == 0).then_some(SlotSpanInfo { ptr, len })
    }

    /// The slot span of a zero-copy operation (`None` for a bounce-buffer one), shortened by the
    /// bytes an injected short transfer leaves out (`len` less than the record).
    pub(super) fn span_for(&self, pending: &Pending, len: usize) -> io::Result<Option<SlotSpan>> {
        if !pending.zero_copy {
            return Ok(None);
        }
        let keep = len.saturating_sub(HEADER_BYTES);
        let Some(payload) = self.slot_payload(pending.slot, pending.len) else {
            return Err(io::Error::other(
                "the slot lost its stable aligned address between two operations",
            ));
        };
        add(&self.stats().zero_copy_ops, 1);
        // SAFETY: the slot belongs to this job until its completion is sent (the Tier
        // contract), the range is inside it (`slot_payload`), and this worker does not touch it
        // while the operation is in flight: `execute` reaps every operation it submitted before
        // the job completes (it keeps waiting, without a limit on errors, while zero-copy
        // operations are out), a panicking job first drains the engine (`panicked`), and the
        // engine, dropped before the memory (field order of `Worker`), waits for its operations.
        Ok(Some(unsafe {
            SlotSpan::new(payload.ptr, payload.len.min(keep))
        }))
    }

    /// A full record image of a zero-copy record (header from `header`, payload copied from the
    /// slot, no padding needed).
    pub(super) fn bounce_record(
        &mut self,
        pending: &Pending,
        header: &AlignedBuf,
    ) -> io::Result<AlignedBuf> {
        let mut image = self.pool.get(pending.bytes as usize)?;
        let full = image.as_full_mut_slice();
        full[..HEADER_BYTES].copy_from_slice(&header.as_full_slice()[..HEADER_BYTES]);
        let end = HEADER_BYTES + pending.len as usize;
        self.memory
            .read_slot(pending.slot, 0, &mut full[HEADER_BYTES..end]);
        Ok(image)
    }

    /// Handles a record write's completion; returns the operation to retry buffered after EINVAL.
    pub(super) fn store_done(
        &mut self,
        mut pending: Pending,
        result: io::Result<usize>,
        buf: AlignedBuf,
        _failed: &mut Failed,
        retries: &mut Vec<(Pending, Ready)>,
    ) {
        let failure = match result {
            Ok(n) if n as u64 == pending.bytes => None,
            Ok(_) => Some(FailureKind::ShortWrite),
            Err(e) if is_einval(&e) && pending.direct && !pending.retried => 'retry: {
                let Some(at) = self.position(pending.segment) else {
                    break 'retry Some(failure_of(&e));
                };
                self.fall_back(&format!(
                    "write {:?} at offset {}: {e}",
                    self.segments[at].path, pending.offset
                ));
                let reopened = if self.segments[at].direct {
                    self.reopen_buffered(at)
                } else {
                    Ok(())
                };
                match reopened {
                    Ok(()) => {
                        add(&self.stats().buffered_retries, 1);
                        pending.file = Arc::clone(&self.segments[at].file);
                        pending.direct = false;
                        pending.retried = true;
                        retries.push(self.write_item(pending, buf));
                        return;
                    }
                    Err(e) => Some(failure_of(&e)),
                }
            }
            Err(e) => Some(failure_of(&e)),
        };
        self.pool.put(buf);
        self.written.push(Written {
            job: pending.job,
            key: pending.key,
            len: pending.len,
            segment: pending.segment,
            offset: pending.offset,
            bytes: pending.bytes,
            failure,
        });
    }

    /// Finishes a store job whose writes all completed: flushes its segments (with
    /// `Durability::Fsync`), indexes its written records, and gives back the space of its failed
    /// ones: a failed record at the end of the open segment's records rewinds the segment (the
    /// next record goes there); one with records after it is covered by a skip record, so that
    /// later records stay reachable.
    pub(super) fn finish_store(&mut self, mut active: Active) {
        self.active_bytes -= active.bytes;
        let mut records = std::mem::take(&mut active.written);
        records.sort_by_key(|w| (w.segment, w.offset));
        if self.durable() {
            self.flush_records(&mut records);
        }
        // From the last record back, so that a failed tail rewinds as a whole.
        for w in records.iter().rev() {
            let at = self.position(w.segment);
            if let Some(at) = at {
                self.segments[at].records_open -= 1;
            }
            let Some(kind) = w.failure else {
                let mut index = self.shared.index();
                index.release(w.bytes);
                index.grow_segment(w.segment, w.offset + w.bytes);
                index.insert(w.key, w.segment, w.offset, w.bytes);
                drop(index);
                add(&self.stats().chunks_stored, 1);
                add(&self.stats().bytes_stored, u64::from(w.len));
                continue;
            };
            active.failed.add(self.stats(), 0, w.key, kind);
            self.shared.index().release(w.bytes);
            let Some(at) = at else {
                continue;
            };
            let seg = &mut self.segments[at];
            if seg.cursor == w.offset + w.bytes {
                // The failed tail is given back: the next record (or the seal) goes there.
                seg.cursor = w.offset;
                seg.allocated = seg.allocated.min(w.offset);
                if seg.file.set_len(w.offset).is_ok() {
                    self.shared.index().set_segment_bytes(w.segment, w.offset);
                }
                continue;
            }
            // Dead space before other records: a skip record keeps later records reachable by
            // the start-up scan (if it cannot be written, the scan cuts the segment there,
            // which only loses chunks).
            if write_skip(&seg.file, w.offset, w.bytes).is_err() {
                seg.closed = true;
            }
            self.shared
                .index()
                .grow_segment(w.segment, w.offset + w.bytes);
        }
        let failed = active.failed.into_keys().next().unwrap_or_default();
        self.shared.cancelled().remove(&active.id);
        self.finished.push(TierCompletion {
            id: active.id,
            failed,
        });
    }

    /// Flushes the segments of `records` that hold a written one; a failed flush fails those
    /// records and closes the segment.
    pub(super) fn flush_records(&mut self, records: &mut [Written]) {
        let mut ids: Vec<SegmentId> = records
            .iter()
            .filter(|w| w.failure.is_none())
            .map(|w| w.segment)
            .collect();
        ids.dedup();
        for id in ids {
            let Some(at) = self.position(id) else {
                continue;
            };
            if let Err(e) = self.segments[at].file.sync_data() {
                for w in records.iter_mut().filter(|w| w.segment == id) {
                    w.failure = w.failure.or(Some(failure_of(&e)));
                }
                self.segments[at].closed = true;
            }
        }
    }

    /// Seals the segments that take no further record (closed, full, or not the last one) and
    /// have no record of an unfinished job.
    pub(super) fn seal_finished(&mut self) {
        let segment_bytes = self.settings.segment_bytes;
        let last = self.segments.len().saturating_sub(1);
        let mut sealing = Vec::new();
        let mut keep = Vec::new();
        for (at, seg) in std::mem::take(&mut self.segments).into_iter().enumerate() {
            let no_more = seg.closed || at < last || seg.cursor >= segment_bytes;
            if no_more && seg.records_open == 0 {
                sealing.push(seg);
            } else {
                keep.push(seg);
            }
        }
        self.segments = keep;
        for seg in sealing {
            self.seal(seg);
        }
    }

    /// Where segment `id` is in `segments`.
    pub(super) fn position(&self, id: SegmentId) -> Option<usize> {
        self.segments.iter().position(|s| s.id == id)
    }

    /// After a panic in the writer: every operation in flight is reaped (some read slots), every
    /// running job fails as a whole, and its segments are given up unsealed (evictable; the next
    /// start verifies and seals them).
    pub(super) fn writer_panicked(&mut self) {
        let mut reaped = Vec::new();
        while self.engine.in_flight() > 0 {
            if self.engine.reap(&mut reaped, 1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            reaped.clear();
        }
        let mut index = self.shared.index();
        for (_, pending) in self.store_ops.drain() {
            index.release(pending.bytes);
        }
        give_up_segments(&mut self.written, &mut self.segments, &mut index);
        drop(index);
        let mut given_up: Vec<(JobId, Vec<ChunkKey>)> = self.finishing.take().into_iter().collect();
        for (_, active) in self.active.drain() {
            for w in &active.written {
                self.shared.index().release(w.bytes);
            }
            given_up.push((active.id, active.keys));
        }
        given_up.sort_by_key(|(id, _)| *id);
        for (id, keys) in given_up {
            let mut failed = Failed::new(1);
            for key in keys {
                failed.add(&self.shared.stats, 0, key, FailureKind::Io);
            }
            self.shared.cancelled().remove(&id);
            self.finished.push(TierCompletion {
                id,
                failed: failed.into_keys().next().unwrap_or_default(),
            });
        }
        self.active_bytes = 0;
    }

    /// Seals a segment that takes no further record (or removes it if it holds none): the
    /// index here (`housekeep::account_seal`), the file on the housekeeper's thread, or here if
    /// there is none or its queue is full.
    pub(super) fn seal(&mut self, seg: OpenSegment) {
        if !housekeep::account_seal(&self.shared, &seg) {
            return;
        }
        let seg = match &self.housekeeper {
            Some(housekeeper) => match housekeeper.seal(seg) {
                Ok(()) => return,
                Err(seg) => seg,
            },
            None => seg,
        };
        housekeep::write_seal_of(&self.shared, self.durable(), &seg);
    }

    /// Seals every segment this worker appends to (at shutdown).
    pub(super) fn seal_all(&mut self) {
        let sealing: Vec<OpenSegment> = self.segments.drain(..).collect();
        for seg in sealing {
            self.seal(seg);
        }
    }
}

/// The writer prepares its next segment ahead (`Worker::prepare_next_segment`) only in a tier
/// whose capacity holds at least this many segments.
const SPARE_CAPACITY_SEGMENTS_MIN: u64 = 64;

/// The bytes a fresh segment is allocated: as many records of `record` bytes as a segment of
/// `segment_bytes` takes (at least one), and the seal.
fn fitted_bytes(segment_bytes: u64, record: u64) -> u64 {
    let records = (segment_bytes / record.max(1)).max(1);
    records * record + SEAL_BYTES
}
