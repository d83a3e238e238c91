//! The connector's clock, behind a trait so that a simulator can control time: [`MonotonicClock`]
//! reads the machine's monotonic clock, [`ManualClock`] moves only when told to (or when the
//! manager waits on it, see [`Clock::sleep_ns`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A source of monotonic time in nanoseconds (from an arbitrary origin).
pub trait Clock: Send + Sync {
    /// Nanoseconds since the clock's origin; never decreases.
    fn now_ns(&self) -> u64;

    /// Lets `ns` nanoseconds pass, where the caller already blocks (a reset waiting for tiers
    /// with a deadline). The default sleeps the thread; a simulated clock moves itself instead,
    /// so a wait against it ends in simulated time without real sleeping.
    fn sleep_ns(&self, ns: u64) {
        std::thread::sleep(std::time::Duration::from_nanos(ns));
    }
}

/// The machine's monotonic clock, with its origin at creation.
#[derive(Debug)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// A clock that moves only through [`ManualClock::advance`]; clones share the same time. For
/// simulators and tests (re-exported in [`crate::testing`], not at the crate root).
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `ns` nanoseconds.
    pub fn advance(&self, ns: u64) {
        self.now.fetch_add(ns, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.now.load(Ordering::Relaxed)
    }

    /// Waiting on a simulated clock moves it: nothing else would.
    fn sleep_ns(&self, ns: u64) {
        self.advance(ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced_and_clones_share_time() {
        let clock = ManualClock::new();
        let other = clock.clone();
        assert_eq!(clock.now_ns(), 0);
        other.advance(5);
        assert_eq!(clock.now_ns(), 5);
        other.sleep_ns(3);
        assert_eq!(clock.now_ns(), 8, "a wait on a manual clock moves it");
    }

    #[test]
    fn monotonic_clock_never_goes_back() {
        let clock = MonotonicClock::new();
        let a = clock.now_ns();
        let b = clock.now_ns();
        assert!(b >= a);
    }
}
