//! The plain-data messages between the scheduler side and the workers. They serialize, because
//! workers may live in other processes.

use serde::{Deserialize, Serialize};

use crate::key::{BlockId, ChunkKey, JobId, RequestId, SlotId};

/// Which way a job moves chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobKind {
    /// GPU to host pool.
    Store,
    /// Host pool to GPU.
    Load,
}

/// One chunk of a job: which slot, and which engine blocks map to which blocks of the slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    /// The chunk.
    pub key: ChunkKey,
    /// Its host-pool slot.
    pub slot: SlotId,
    /// Index, within the chunk, of the block that `gpu_blocks[0]` holds. A load whose first chunk
    /// starts mid-chunk (the GPU prefix cache already holds its first blocks) skips those blocks.
    pub first_block_in_chunk: u32,
    /// Engine blocks, consecutive within the chunk starting at `first_block_in_chunk`.
    pub gpu_blocks: Vec<BlockId>,
}

/// One asynchronous transfer of a set of chunks for one request. Completes exactly once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    /// The job's id (only grows).
    pub id: JobId,
    /// The request it serves.
    pub request: RequestId,
    /// Direction.
    pub kind: JobKind,
    /// The chunks, in prefix order.
    pub transfers: Vec<Transfer>,
}

/// What the scheduler side tells every worker for one engine step.
///
/// Workers handle it in this order: `reset` (finish every older job before touching any slot),
/// `flush` (finish those stores before this step's compute), `loads` (start now), then `stores`
/// (start once this step's compute has written their source blocks).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorMeta {
    /// The engine step this belongs to.
    pub step: u64,
    /// `reset_cache` was called since the last step: complete (or cancel) every job older than
    /// this id before anything else. Completions of those jobs are ignored.
    pub reset_before: Option<JobId>,
    /// Store jobs, issued earlier, that must finish before this step's compute (a source block
    /// was reallocated, or its request was preempted).
    pub flush: Vec<JobId>,
    /// Load jobs to start at once.
    pub loads: Vec<Job>,
    /// Store jobs to start after this step's compute.
    pub stores: Vec<Job>,
    /// Requests whose finish was signalled this step (after this step's stores were built).
    pub finished: Vec<RequestId>,
}

/// One worker's acknowledgement of one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobAck {
    /// The job.
    pub job: JobId,
    /// Whether this worker's part succeeded.
    pub success: bool,
}

/// What one worker reports after a step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerOutput {
    /// The worker's index (its tensor-parallel rank).
    pub worker: u32,
    /// Jobs this worker completed since its last report, each exactly once.
    pub acks: Vec<JobAck>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{BlockId, ChunkKey, JobId, RequestId, SlotId};

    #[test]
    fn metadata_round_trips_through_json() {
        let meta = ConnectorMeta {
            step: 7,
            reset_before: Some(JobId(3)),
            flush: vec![JobId(4)],
            loads: vec![Job {
                id: JobId(5),
                request: RequestId(9),
                kind: JobKind::Load,
                transfers: vec![Transfer {
                    key: ChunkKey::new(u128::MAX, 1),
                    slot: SlotId(2),
                    first_block_in_chunk: 1,
                    gpu_blocks: vec![BlockId(10), BlockId(11)],
                }],
            }],
            stores: Vec::new(),
            finished: vec![RequestId(8)],
        };
        let text = serde_json::to_string(&meta).expect("serializes");
        let back: ConnectorMeta = serde_json::from_str(&text).expect("deserializes");
        assert_eq!(back, meta);
        let output = WorkerOutput {
            worker: 2,
            acks: vec![JobAck {
                job: JobId(5),
                success: false,
            }],
        };
        let text = serde_json::to_string(&output).expect("serializes");
        assert_eq!(
            serde_json::from_str::<WorkerOutput>(&text).expect("deserializes"),
            output
        );
    }
}
