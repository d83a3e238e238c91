//! Workloads: request specifications (arrival step, prompt made of an optional shared prefix and
//! tokens of its own, output length, optional abort) and generators for common shapes.

use serde::{Deserialize, Serialize};

use crate::model;
use crate::rng::{mix64, SplitMix64};

/// A prefix shared by several requests (a system prompt or a document): every request naming the
/// same id starts with the same tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedPrefix {
    /// Which prefix.
    pub id: u64,
    /// Its length in tokens.
    pub tokens: u32,
}

/// One request of a workload. Its id is its index in [`Workload::requests`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestSpec {
    /// Step at which it arrives.
    pub arrival_step: u64,
    /// Shared prefix at the start of its prompt, if any.
    pub prefix: Option<SharedPrefix>,
    /// Shared segments after the prefix, in order, each drawn like a prefix (a replayed trace's
    /// 512-token blocks, one per hash id): equal segment lists give equal tokens.
    #[serde(default)]
    pub segments: Vec<SharedPrefix>,
    /// Prompt tokens of its own, after the prefix.
    pub unique_tokens: u32,
    /// Seed of its own tokens.
    pub seed: u64,
    /// It finishes after sampling this many tokens (at least 1).
    pub max_tokens: u32,
    /// It is aborted at the start of this step, if still unfinished.
    pub abort_step: Option<u64>,
    /// kvtier's per-request offload cap.
    pub max_offload_tokens: Option<u32>,
}

impl RequestSpec {
    /// Prompt length in tokens.
    pub fn prompt_len(&self) -> u32 {
        self.prefix.map_or(0, |p| p.tokens)
            + self.segments.iter().map(|s| s.tokens).sum::<u32>()
            + self.unique_tokens
    }

    /// The prompt's tokens.
    pub fn prompt(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.prompt_len() as usize);
        if let Some(p) = self.prefix {
            model::prefix_tokens(p.id, p.tokens, &mut out);
        }
        for s in &self.segments {
            model::prefix_tokens(s.id, s.tokens, &mut out);
        }
        model::unique_tokens(self.seed, self.unique_tokens, &mut out);
        out
    }
}

/// The requests a simulation runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// Requests; request `i` has id `RequestId(i)`.
    pub requests: Vec<RequestSpec>,
}

/// Shape of [`Workload::shared_prefix`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedPrefixSpec {
    /// Number of requests.
    pub requests: u32,
    /// Shared prefix length in tokens.
    pub prefix_tokens: u32,
    /// Tokens of each request's own part (at least).
    pub unique_tokens: u32,
    /// Each request's own part is up to this many tokens longer (seeded).
    pub unique_jitter: u32,
    /// Output tokens per request.
    pub max_tokens: u32,
    /// Request `i` arrives at step `i * arrival_gap_steps` (0: all at once, concurrent).
    pub arrival_gap_steps: u64,
    /// Unrelated requests (no shared prefix) arriving after each shared one, spread over the gap:
    /// background traffic that evicts the prefix from the GPU cache, so later requests load it.
    pub background_per_request: u32,
    /// Prompt tokens of each background request.
    pub background_tokens: u32,
    /// Output tokens of each background request.
    pub background_max_tokens: u32,
    /// Seed of the request tokens and jitter.
    pub seed: u64,
}

impl Default for SharedPrefixSpec {
    fn default() -> Self {
        Self {
            requests: 16,
            prefix_tokens: 512,
            unique_tokens: 256,
            unique_jitter: 64,
            max_tokens: 32,
            arrival_gap_steps: 0,
            background_per_request: 0,
            background_tokens: 2048,
            background_max_tokens: 4,
            seed: 1,
        }
    }
}

impl Workload {
    /// `spec.requests` requests that share one prefix, then differ, each followed by
    /// `spec.background_per_request` unrelated requests (ids in that order).
    pub fn shared_prefix(spec: &SharedPrefixSpec) -> Self {
        let mut rng = SplitMix64::stream(spec.seed, 0x5052);
        let prefix = SharedPrefix {
            id: mix64(spec.seed),
            tokens: spec.prefix_tokens,
        };
        let mut requests = Vec::new();
        let per = u64::from(spec.background_per_request);
        for i in 0..u64::from(spec.requests) {
            let arrival = i * spec.arrival_gap_steps;
            requests.push(RequestSpec {
                arrival_step: arrival,
                prefix: (spec.prefix_tokens > 0).then_some(prefix),
                segments: Vec::new(),
                unique_tokens: spec.unique_tokens
                    + rng.below(u64::from(spec.unique_jitter) + 1) as u32,
                seed: rng.next_u64(),
                max_tokens: spec.max_tokens,
                abort_step: None,
                max_offload_tokens: None,
            });
            for k in 0..per {
                requests.push(RequestSpec {
                    arrival_step: arrival + (k + 1) * spec.arrival_gap_steps / (per + 1),
                    prefix: None,
                    segments: Vec::new(),
                    unique_tokens: spec.background_tokens,
                    seed: rng.next_u64(),
                    max_tokens: spec.background_max_tokens,
                    abort_step: None,
                    max_offload_tokens: None,
                });
            }
        }
        Self { requests }
    }

    /// Appends the requests of `other`, shifted to arrive `step_offset` steps later.
    pub fn append(&mut self, other: Workload, step_offset: u64) {
        self.requests
            .extend(other.requests.into_iter().map(|mut r| {
                r.arrival_step += step_offset;
                r.abort_step = r.abort_step.map(|s| s + step_offset);
                r
            }));
    }

    /// Total prompt tokens.
    pub fn prompt_tokens(&self) -> u64 {
        self.requests
            .iter()
            .map(|r| u64::from(r.prompt_len()))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_requests_share_exactly_the_prefix() {
        let spec = SharedPrefixSpec {
            requests: 4,
            prefix_tokens: 40,
            unique_tokens: 10,
            unique_jitter: 5,
            arrival_gap_steps: 3,
            ..SharedPrefixSpec::default()
        };
        let w = Workload::shared_prefix(&spec);
        assert_eq!(w, Workload::shared_prefix(&spec), "deterministic");
        let prompts: Vec<Vec<u32>> = w.requests.iter().map(RequestSpec::prompt).collect();
        for (i, (r, p)) in w.requests.iter().zip(&prompts).enumerate() {
            assert_eq!(r.arrival_step, 3 * i as u64);
            assert_eq!(p.len() as u32, r.prompt_len());
            assert!((50..=55).contains(&r.prompt_len()));
            assert_eq!(p[..40], prompts[0][..40]);
        }
        assert_ne!(prompts[0][40..45], prompts[1][40..45]);
    }

    #[test]
    fn background_requests_follow_each_shared_one() {
        let spec = SharedPrefixSpec {
            requests: 2,
            arrival_gap_steps: 9,
            background_per_request: 2,
            background_tokens: 7,
            ..SharedPrefixSpec::default()
        };
        let w = Workload::shared_prefix(&spec);
        let arrivals: Vec<u64> = w.requests.iter().map(|r| r.arrival_step).collect();
        assert_eq!(arrivals, vec![0, 3, 6, 9, 12, 15]);
        assert!(w.requests[1].prefix.is_none() && w.requests[1].prompt_len() == 7);
        assert!(w.requests[3].prefix.is_some());
    }

    #[test]
    fn append_shifts_arrivals() {
        let mut w = Workload::shared_prefix(&SharedPrefixSpec {
            requests: 1,
            ..SharedPrefixSpec::default()
        });
        let mut other = w.clone();
        other.requests[0].abort_step = Some(2);
        w.append(other, 10);
        assert_eq!(w.requests[1].arrival_step, 10);
        assert_eq!(w.requests[1].abort_step, Some(12));
        assert_eq!(w.prompt_tokens(), 2 * u64::from(w.requests[0].prompt_len()));
    }
}
