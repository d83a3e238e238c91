//! kvtier's deterministic simulator (issue 8). One seed decides every choice of a run: the
//! manager (the host pool with a reference model in lockstep, or the connector's tiering manager
//! over one or two fault-injecting tiers), the engine's settings (sync or async scheduling, worker
//! count, GPU and host sizes), the arrivals (generated, or a window of a Mooncake trace), and a
//! random subset of event kinds with random weights (aborts, resets, worker failures and delays,
//! preemption pressure, host-pool pressure, and at the `Tier` boundary: store and load failures,
//! partial failures, corruption, torn slots, busy refusals, delayed and reordered completions,
//! stalls, a tier that dies).
//!
//! Checked after every step: engine-sim's own checks (every meta's structure, `CheckedManager`'s
//! lifecycle order on every manager call, every loaded block byte-identical to recompute, fences,
//! released blocks), the offload-core scheduler's and tiering manager's strict invariants, the
//! host pool's `check_invariants`, the reference model on every manager call ([`model`]), and the
//! fake tiers' caller-contract checks. At the end of a seed, after a convergence phase with every
//! fault off: every request finished or was aborted, every job acknowledged, no request state,
//! pin or prepared store left in the scheduler, tiering manager or model, and each tier's call log
//! shows every accepted job completed exactly once and each request's finish heard exactly once,
//! after its last job.
//!
//! - [`plan`]: what a seed decides. [`fault`]: the fault-injecting tier. [`model`]: the
//!   reference model. [`run`]: one seed's two phases and checks.

#![forbid(unsafe_code)]

pub mod fault;
pub mod model;
pub mod plan;
pub mod run;

pub use run::{replay_command, run_seed, run_seed_with, SeedFailure, SeedOutcome};
