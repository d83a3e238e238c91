//! The lookup table: which keys are being asked about, what the peers answered and when. Pure
//! bookkeeping over instants passed in, so it is tested without sockets or clocks.
//!
//! A key not known yet is queued and answers `Retry`; queued keys go to the peers in one batch
//! per `poll`. An answer is reused for `lookup_cache_ttl`, and always returned at least once
//! (so a TTL of 0 still settles). A key still unanswered after `lookup_deadline` is a miss.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use offload_core::ChunkKey;

/// What [`LookupTable::lookup`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// A peer holds it.
    Hit,
    /// The peers answered that none holds it.
    Miss,
    /// The peers did not answer within the deadline (a miss).
    TimedOut,
    /// The table is full of keys in flight; not asked (a miss).
    Full,
    /// Asked, no answer yet.
    Retry,
}

#[derive(Clone, Copy, Debug)]
enum Entry {
    Pending {
        since: Instant,
    },
    Known {
        holder: Option<u16>,
        at: Instant,
        read: bool,
    },
}

/// Pending and answered lookups, bounded by `entries_max`.
#[derive(Debug)]
pub(crate) struct LookupTable {
    entries: HashMap<ChunkKey, Entry>,
    queued: Vec<ChunkKey>,
    deadline: Duration,
    ttl: Duration,
    entries_max: usize,
}

impl LookupTable {
    /// An empty table.
    pub(crate) fn new(deadline: Duration, ttl: Duration, entries_max: usize) -> Self {
        Self {
            entries: HashMap::new(),
            queued: Vec::new(),
            deadline,
            ttl,
            entries_max,
        }
    }

    /// The answer for `key` at `now`, queueing a question to the peers if there is none.
    pub(crate) fn lookup(&mut self, key: ChunkKey, now: Instant) -> Found {
        match self.entries.get_mut(&key) {
            Some(Entry::Known { holder, at, read }) => {
                if !*read || now.saturating_duration_since(*at) <= self.ttl {
                    *read = true;
                    return if holder.is_some() {
                        Found::Hit
                    } else {
                        Found::Miss
                    };
                }
                self.entries.remove(&key);
            }
            Some(Entry::Pending { since }) => {
                if now.saturating_duration_since(*since) <= self.deadline {
                    return Found::Retry;
                }
                let timed_out = Entry::Known {
                    holder: None,
                    at: now,
                    read: true,
                };
                self.entries.insert(key, timed_out);
                return Found::TimedOut;
            }
            None => {}
        }
        if self.entries.len() >= self.entries_max {
            self.prune(now);
            if self.entries.len() >= self.entries_max {
                return Found::Full;
            }
        }
        self.entries.insert(key, Entry::Pending { since: now });
        self.queued.push(key);
        Found::Retry
    }

    /// Drops answers already read and expired, and questions past their deadline.
    fn prune(&mut self, now: Instant) {
        let (ttl, deadline) = (self.ttl, self.deadline);
        self.entries.retain(|_, entry| match *entry {
            Entry::Known { at, read, .. } => !read || now.saturating_duration_since(at) <= ttl,
            Entry::Pending { since } => now.saturating_duration_since(since) <= deadline,
        });
    }

    /// Records the peers' answer for `keys` (for each, the first peer holding it).
    pub(crate) fn record(&mut self, keys: &[ChunkKey], holders: &[Option<u16>], now: Instant) {
        for (&key, &holder) in keys.iter().zip(holders) {
            if let Some(entry) = self.entries.get_mut(&key) {
                *entry = Entry::Known {
                    holder,
                    at: now,
                    read: false,
                };
            }
        }
    }

    /// Takes the keys queued since the last call.
    pub(crate) fn take_queued(&mut self) -> Vec<ChunkKey> {
        std::mem::take(&mut self.queued)
    }

    /// Puts back keys that could not be sent (they stay pending until their deadline).
    pub(crate) fn requeue(&mut self, mut keys: Vec<ChunkKey>) {
        keys.append(&mut self.queued);
        self.queued = keys;
    }

    /// Keys queued now.
    pub(crate) fn queued_len(&self) -> usize {
        self.queued.len()
    }

    /// The peer a recorded answer named for `key`.
    pub(crate) fn holder(&self, key: ChunkKey) -> Option<u16> {
        match self.entries.get(&key) {
            Some(Entry::Known { holder, .. }) => *holder,
            _ => None,
        }
    }

    /// Forgets the answer for `key` (a load of it failed, so the answer is stale).
    pub(crate) fn forget(&mut self, key: ChunkKey) {
        if let Some(Entry::Known { .. }) = self.entries.get(&key) {
            self.entries.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn key(i: u64) -> ChunkKey {
        ChunkKey::new(u128::from(i), 0)
    }

    #[test]
    fn retry_until_answered_then_cached_for_the_ttl() {
        let t0 = Instant::now();
        let mut table = LookupTable::new(100 * MS, 50 * MS, 16);
        assert_eq!(table.lookup(key(1), t0), Found::Retry);
        assert_eq!(table.lookup(key(1), t0 + MS), Found::Retry);
        assert_eq!(table.take_queued(), vec![key(1)]);
        table.record(&[key(1)], &[Some(0)], t0 + 2 * MS);
        assert_eq!(table.holder(key(1)), Some(0));
        assert_eq!(table.lookup(key(1), t0 + 3 * MS), Found::Hit);
        assert_eq!(table.lookup(key(1), t0 + 40 * MS), Found::Hit);
        assert_eq!(
            table.lookup(key(1), t0 + 60 * MS),
            Found::Retry,
            "expired: asked again"
        );
        assert_eq!(table.take_queued(), vec![key(1)]);
    }

    #[test]
    fn zero_ttl_returns_each_answer_once() {
        let t0 = Instant::now();
        let mut table = LookupTable::new(100 * MS, Duration::ZERO, 16);
        assert_eq!(table.lookup(key(1), t0), Found::Retry);
        table.record(&[key(1)], &[None], t0 + MS);
        assert_eq!(table.lookup(key(1), t0 + 5 * MS), Found::Miss);
        assert_eq!(table.lookup(key(1), t0 + 6 * MS), Found::Retry);
    }

    #[test]
    fn unanswered_keys_time_out_and_full_table_misses() {
        let t0 = Instant::now();
        let mut table = LookupTable::new(10 * MS, 10 * MS, 2);
        assert_eq!(table.lookup(key(1), t0), Found::Retry);
        assert_eq!(table.lookup(key(2), t0), Found::Retry);
        assert_eq!(table.lookup(key(3), t0 + MS), Found::Full);
        assert_eq!(table.lookup(key(1), t0 + 11 * MS), Found::TimedOut);
        assert_eq!(table.lookup(key(1), t0 + 12 * MS), Found::Miss);
        // Key 2's question expired: pruned to make room.
        assert_eq!(table.lookup(key(3), t0 + 30 * MS), Found::Retry);
        table.forget(key(3));
        assert_eq!(table.lookup(key(3), t0 + 31 * MS), Found::Retry);
    }
}
