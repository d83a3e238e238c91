//! Probes of a shared directory: when other instances write the namespace too, a lookup of a key
//! missing from the index asks a background thread to look for its file (reading and checking its
//! header), and answers `Retry` until the probe completes or its deadline passes (then `Miss`).
//! A found chunk is added to the index; a negative answer is remembered for the deadline.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use offload_core::tier::TierLookup;
use offload_core::ChunkKey;

use crate::error::FsError;
use crate::format::{file_bytes, Header, HEADER_BYTES};
use crate::layout::Layout;
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
    /// Starts the probe thread.
    pub(crate) fn start(
        layout: Layout,
        shared: Arc<Shared>,
        deadline: Duration,
        in_flight_max: usize,
    ) -> Result<Self, FsError> {
        let (requests, inbox) = crossbeam_channel::bounded::<ChunkKey>(in_flight_max);
        let (outbox, answers) = crossbeam_channel::bounded(in_flight_max);
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("kvtier-fs-probe".into())
            .spawn(move || {
                for key in inbox {
                    if thread_stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let found = probe_file(&layout, key);
                    if let Some(bytes) = found {
                        shared.index().insert(key, bytes);
                        add(&shared.stats.probe_hits, 1);
                    }
                    // A full answer queue only drops the answer: the lookup then times out.
                    let _ = outbox.try_send((key, found.is_some()));
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

    /// Stops the thread (queued probes are skipped) and joins it.
    pub(crate) fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.requests = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The file size of `key`'s chunk file if it exists and its header names `key` with a length
/// that fits the file.
fn probe_file(layout: &Layout, key: ChunkKey) -> Option<u64> {
    let file = File::open(layout.chunk_path(key)).ok()?;
    let bytes = file.metadata().ok()?.len();
    let mut head = vec![0u8; HEADER_BYTES];
    file.read_exact_at(&mut head, 0).ok()?;
    let header = Header::decode(&head).ok()?;
    (header.key == key && file_bytes(header.payload_len) == bytes).then_some(bytes)
}
