//! Cascade: after a successful host store, the chunks are pinned and one Store job per secondary
//! tier is submitted; a busy tier's cascades are queued, retried every step, and dropped past the
//! cascade deadline.

use std::collections::BTreeSet;

use offload_core::tier::{SubmitError, TierChunk, TierJob, TierOp};
use offload_core::{ChunkKey, KvEvent, OffloadManager, RequestId};

use super::{InFlight, QueuedCascade, TieringManager};

impl TieringManager {
    /// Pins the ready chunks among `keys` and submits one Store job per tier.
    pub(super) fn cascade(&mut self, request: RequestId, keys: &[ChunkKey]) {
        if self.tiers.is_empty() || keys.is_empty() {
            return;
        }
        let len = self.options.slot_bytes;
        for tier in 0..self.tiers.len() {
            let mut slots = Vec::with_capacity(keys.len());
            if self.host.prepare_load(keys, request, &mut slots).is_err() {
                self.broken(format_args!(
                    "cascade of request {}: a just-stored chunk is not ready",
                    request.0
                ));
                return;
            }
            let chunks: Vec<TierChunk> = keys
                .iter()
                .zip(&slots)
                .map(|(&k, &s)| TierChunk::new(k, s, len))
                .collect();
            if !self.tiers[tier].cascades.is_empty() {
                // Keep submission order: older cascades of this tier go first.
                self.queue_cascade(tier, request, chunks);
                continue;
            }
            if let Some(chunks) = self.submit_cascade(tier, request, chunks) {
                self.queue_cascade(tier, request, chunks);
            }
        }
    }

    fn queue_cascade(&mut self, tier: usize, request: RequestId, chunks: Vec<TierChunk>) {
        let queued_ns = self.now();
        self.tiers[tier].cascades.push_back(QueuedCascade {
            request,
            chunks,
            queued_ns,
        });
        self.state(request).cascades_queued += 1;
    }

    /// Submits a cascade; returns the chunks back if the tier was busy. A job refused for good
    /// is dropped (its pins released).
    fn submit_cascade(
        &mut self,
        tier: usize,
        request: RequestId,
        chunks: Vec<TierChunk>,
    ) -> Option<Vec<TierChunk>> {
        let id = self.allocate_job();
        let job = TierJob {
            id,
            request: Some(request),
            op: TierOp::Store,
            chunks,
        };
        let now = self.now();
        let entry = &mut self.tiers[tier];
        match entry.tier.submit(job.clone()) {
            Ok(()) => {
                entry.counters.store_jobs += 1;
                self.in_flight.insert(
                    id,
                    InFlight {
                        tier,
                        request,
                        op: TierOp::Store,
                        chunks: job.chunks,
                        submitted_ns: now,
                        cancelled: false,
                        held: false,
                    },
                );
                None
            }
            Err(SubmitError::Busy { .. }) => {
                entry.counters.submits_busy += 1;
                Some(job.chunks)
            }
            Err(_) => {
                entry.counters.jobs_dropped += 1;
                let keys: Vec<ChunkKey> = job.chunks.iter().map(|c| c.key).collect();
                self.host.complete_load(&keys);
                None
            }
        }
    }

    pub(super) fn retry_cascades(&mut self) {
        for tier in 0..self.tiers.len() {
            while let Some(cascade) = self.tiers[tier].cascades.pop_front() {
                let QueuedCascade {
                    request,
                    chunks,
                    queued_ns,
                } = cascade;
                if let Some(chunks) = self.submit_cascade(tier, request, chunks) {
                    self.tiers[tier].cascades.push_front(QueuedCascade {
                        request,
                        chunks,
                        queued_ns,
                    });
                    break;
                }
                if let Some(r) = self.requests.get_mut(&request) {
                    r.cascades_queued -= 1;
                }
            }
        }
    }

    /// Drops queued cascades (their pins released), for a reset.
    pub(super) fn drop_queued_cascades(&mut self) {
        for tier in 0..self.tiers.len() {
            let queued: Vec<QueuedCascade> = self.tiers[tier].cascades.drain(..).collect();
            for cascade in queued {
                self.tiers[tier].counters.jobs_dropped += 1;
                self.unqueue_cascade(&cascade);
            }
        }
    }

    /// Releases a queued cascade's host pins (it will not be submitted).
    fn unqueue_cascade(&mut self, cascade: &QueuedCascade) {
        let keys: Vec<ChunkKey> = cascade.chunks.iter().map(|c| c.key).collect();
        self.host.complete_load(&keys);
        if let Some(r) = self.requests.get_mut(&cascade.request) {
            r.cascades_queued -= 1;
        }
    }

    /// Drops cascades queued behind a busy tier for longer than the cascade deadline, so a tier
    /// that stays busy does not keep host slots pinned: their pins are released and the chunks
    /// stay in the host pool only. The queue is in queueing order, so the oldest go first.
    pub(super) fn expire_queued_cascades(&mut self) {
        let now = self.now();
        let deadline = self.options.cascade_deadline_ns;
        for tier in 0..self.tiers.len() {
            while self.tiers[tier]
                .cascades
                .front()
                .is_some_and(|c| now.saturating_sub(c.queued_ns) > deadline)
            {
                let Some(cascade) = self.tiers[tier].cascades.pop_front() else {
                    break;
                };
                self.tiers[tier].counters.cascades_expired += 1;
                self.unqueue_cascade(&cascade);
            }
        }
    }

    pub(super) fn cascade_done(
        &mut self,
        tier: usize,
        job: &InFlight,
        failed: &BTreeSet<ChunkKey>,
        elapsed: u64,
    ) {
        let keys: Vec<ChunkKey> = job.chunks.iter().map(|c| c.key).collect();
        self.host.complete_load(&keys);
        let medium = self.tiers[tier].medium;
        let counters = &mut self.tiers[tier].counters;
        counters.store_ns += elapsed;
        let mut stored = Vec::new();
        for &TierChunk { key, len, .. } in &job.chunks {
            if failed.contains(&key) {
                counters.store_chunks_failed += 1;
            } else {
                counters.chunks_stored += 1;
                counters.bytes_stored += u64::from(len);
                stored.push(key);
            }
        }
        for key in stored {
            self.push_tier_event(tier, KvEvent::Stored { key, medium });
        }
    }
}
