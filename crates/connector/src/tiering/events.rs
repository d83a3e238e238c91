//! KV events with the tier they happened in ([`TierEvent`]): the host pool's, named
//! [`HOST_TIER_NAME`], and the secondary tiers' (chunks a cascade stored).

use offload_core::{KvEvent, OffloadManager};
use serde::Serialize;

use super::{TieringManager, HOST_TIER_NAME};

/// A KV event with the tier it happened in ([`HOST_TIER_NAME`] for the host pool, else the
/// secondary tier's [`Tier::name`]), in the shape cache-aware routers read.
///
/// [`Tier::name`]: offload_core::Tier::name
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TierEvent {
    /// The tier's name.
    pub tier: String,
    /// What happened (its medium is the tier's medium).
    pub event: KvEvent,
}

impl TieringManager {
    /// Moves the tier-attributed events gathered since the last call into `out` (host-pool events
    /// included, named [`HOST_TIER_NAME`]). [`OffloadManager::take_events`] gives the same events
    /// without the tier names; use one or the other.
    pub fn take_tier_events(&mut self, out: &mut Vec<TierEvent>) {
        self.pull_host_events();
        out.append(&mut self.events);
    }

    pub(super) fn pull_host_events(&mut self) {
        if !self.options.events {
            self.host_events.clear();
            return;
        }
        self.host.take_events(&mut self.host_events);
        for event in self.host_events.drain(..) {
            self.events.push(TierEvent {
                tier: HOST_TIER_NAME.to_owned(),
                event,
            });
        }
    }

    pub(super) fn push_tier_event(&mut self, tier: usize, event: KvEvent) {
        if self.options.events {
            // Keep the order: host events gathered so far come first.
            self.pull_host_events();
            let name = self.tiers[tier].name.clone();
            self.events.push(TierEvent { tier: name, event });
        }
    }
}
