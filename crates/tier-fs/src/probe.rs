//! Probes of a shared directory: when other instances write the namespace too, a lookup of a key
//! missing from the index asks a background thread to look for it, and answers `Retry` until the
//! probe completes or its deadline passes (then `Miss`). The thread takes every queued probe at
//! once, lists the namespace directory, and walks the record headers of other instances' segments
//! that are new or have grown since its last walk, adding what it finds to the index (loads verify
//! every record, so a record still being written by its owner fails its checksum and is dropped,
//! never served). A negative answer is remembered for the deadline.

use std::collections::HashMap;
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use offload_core::tier::TierLookup;
use offload_core::ChunkKey;

use crate::error::FsError;
use crate::fault::{Fault, FaultSite};
use crate::index::{SegmentId, SegmentState};
use crate::layout::{parse_segment_file_name, Layout};
use crate::scan::Scanned;
use crate::segment::walk;
use crate::stats::add;
use crate::worker::Shared;

/// The front end's side of the prober.
pub(crate) struct Prober {
    requests: Option<Sender<ChunkKey>>,
    answers: Receiver<(ChunkKey, bool)>,
    /// Probes sent and not answered, with their start.
    pending: HashMap<ChunkKey, Instant>,
    /// Recent negative answers, with their time.
    negative: HashMap<ChunkKey, Instant>,
    deadline: Duration,
    in_flight_max: usize,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Prober {
    /// Starts the probe thread; `scanned` is what the start-up scan indexed.
    pub(crate) fn start(
        layout: Layout,
        shared: Arc<Shared>,
        deadline: Duration,
        in_flight_max: usize,
        scanned: Vec<Scanned>,
    ) -> Result<Self, FsError> {
        let (requests, inbox) = crossbeam_channel::bounded::<ChunkKey>(in_flight_max);
        let (outbox, answers) = crossbeam_channel::bounded(in_flight_max);
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = Arc::clone(&stop);
        let mut known: HashMap<String, Known> = scanned
            .into_iter()
            .map(|s| {
                let known = Known {
                    id: s.id,
                    walked_to: s.walked_to,
                    sealed: s.sealed,
                };
                (s.name, known)
            })
            .collect();
        let thread = std::thread::Builder::new()
            .name("kvtier-fs-probe".into())
            .spawn(move || {
                while let Ok(first) = inbox.recv() {
                    if thread_stop.load(Ordering::Relaxed) {
                        break;
                    }
                    if shared.fault(FaultSite::Probe, first, false) == Some(Fault::Stall) {
                        stall(&shared);
                    }
                    let mut keys = vec![first];
                    keys.extend(inbox.try_iter());
                    refresh(&layout, &shared, &mut known);
                    for key in keys {
                        let found = shared.index().contains(key);
                        if found {
                            add(&shared.stats.probe_hits, 1);
                        }
                        // A full answer queue only drops the answer: the lookup then times out.
                        let _ = outbox.try_send((key, found));
                    }
                }
            })
            .map_err(|e| FsError::Worker(format!("spawning the probe thread: {e}")))?;
        Ok(Self {
            requests: Some(requests),
            answers,
            pending: HashMap::new(),
            negative: HashMap::new(),
            deadline,
            in_flight_max,
            stop,
            thread: Some(thread),
        })
    }

    /// Answers for a key that is not in the index.
    pub(crate) fn lookup(&mut self, key: ChunkKey, shared: &Shared) -> TierLookup {
        let now = Instant::now();
        for (answered, found) in self.answers.try_iter() {
            self.pending.remove(&answered);
            if !found {
                self.negative.insert(answered, now);
            }
        }
        if shared.index().contains(key) {
            return TierLookup::Hit;
        }
        if let Some(&at) = self.negative.get(&key) {
            if now.duration_since(at) < self.deadline {
                return TierLookup::Miss;
            }
            self.negative.remove(&key);
        }
        if let Some(&started) = self.pending.get(&key) {
            if now.duration_since(started) < self.deadline {
                return TierLookup::Retry;
            }
            self.pending.remove(&key);
            self.negative.insert(key, now);
            return TierLookup::Miss;
        }
        self.forget_old(now);
        if self.pending.len() >= self.in_flight_max {
            return TierLookup::Miss;
        }
        let Some(requests) = &self.requests else {
            return TierLookup::Miss;
        };
        match requests.try_send(key) {
            Ok(()) => {
                add(&shared.stats.probes, 1);
                self.pending.insert(key, now);
                TierLookup::Retry
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => TierLookup::Miss,
        }
    }

    /// Bounds the negative cache and drops probes past their deadline.
    fn forget_old(&mut self, now: Instant) {
        let deadline = self.deadline;
        if self.negative.len() > 4 * self.in_flight_max {
            self.negative
                .retain(|_, at| now.duration_since(*at) < deadline);
        }
        if self.pending.len() >= self.in_flight_max {
            self.pending
                .retain(|_, started| now.duration_since(*started) < deadline);
        }
    }

    /// Stops the thread (queued probes are skipped) and joins it if it ends by `deadline`
    /// (polling: a thread stuck listing a hung directory cannot be interrupted); past it the
    /// thread is detached (it holds only its own `Arc`s), counted in `threads_detached` and
    /// `false` is returned. Idempotent.
    pub(crate) fn stop(&mut self, deadline: Instant, shared: &Shared) -> bool {
        self.stop.store(true, Ordering::Relaxed);
        self.requests = None;
        let Some(thread) = self.thread.take() else {
            return true;
        };
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(STOP_POLL_INTERVAL);
        }
        if thread.is_finished() {
            let _ = thread.join();
            return true;
        }
        // Dropping the handle detaches the thread.
        add(&shared.stats.threads_detached, 1);
        false
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        // Without the tier's state: the thread is asked to stop and detached if still running
        // (the tier stops it with its deadline before; this covers an early error in start).
        self.stop.store(true, Ordering::Relaxed);
        self.requests = None;
        if let Some(thread) = self.thread.take() {
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
    }
}

/// How often `stop` looks whether the thread ended.
const STOP_POLL_INTERVAL: Duration = Duration::from_millis(1);

/// An injected stall of the probe thread (tests): until `release_stalls`, at most 10 s.
fn stall(shared: &Shared) {
    add(&shared.stats.stalls, 1);
    let start = Instant::now();
    while !shared.stalls_released.load(Ordering::Acquire) && start.elapsed() < STALL_MAX {
        std::thread::sleep(STOP_POLL_INTERVAL);
    }
}

/// The longest an injected stall lasts.
const STALL_MAX: Duration = Duration::from_secs(10);

/// A segment of another instance the prober has walked.
struct Known {
    id: SegmentId,
    /// Where the next walk starts (the end of the last good record).
    walked_to: u64,
    sealed: bool,
}

/// Walks the segments of other instances that are new or have grown, adding their chunks to the
/// index. Errors (a segment deleted meanwhile, an unreadable file) only skip that segment.
fn refresh(layout: &Layout, shared: &Shared, known: &mut HashMap<String, Known>) {
    let Ok(entries) = std::fs::read_dir(layout.dir()) else {
        return;
    };
    let own = format!("{:016x}-", shared.instance);
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        if name.starts_with(&own) || parse_segment_file_name(name).is_none() {
            continue;
        }
        if known.get(name).is_some_and(|k| k.sealed) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = File::open(&path) else {
            continue;
        };
        let Ok(len) = file.metadata().map(|m| m.len()) else {
            continue;
        };
        let from = known.get(name).map_or(0, |k| k.walked_to);
        if len <= from {
            continue;
        }
        let Ok(found) = walk(&file, from, len, false) else {
            continue;
        };
        let mut index = shared.index();
        let id = match known.get(name) {
            Some(k) => k.id,
            None => index.add_segment(&path, 0, SegmentState::Foreign),
        };
        if index.segment_path(id).is_none() {
            // Evicted (forgotten) since: not indexed again.
            continue;
        }
        index.grow_segment(id, found.end);
        for chunk in &found.chunks {
            index.insert(chunk.key, id, chunk.offset, chunk.bytes);
        }
        if found.sealed {
            index.set_state(id, SegmentState::Sealed);
        }
        drop(index);
        known.insert(
            name.to_owned(),
            Known {
                id,
                walked_to: found.end,
                sealed: found.sealed,
            },
        );
    }
}
