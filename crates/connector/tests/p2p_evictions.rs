//! The tiering manager with a real peer tier (feature `p2p`): chunks the peer tier drops from its
//! published store by itself (capacity) become `Removed` events with its medium, each after the
//! `Stored` event of the same key.

#[cfg(feature = "p2p")]
mod with_p2p {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use connector::{TierEvent, TieringManager, TieringOptions};
    use offload_core::tier::Tier;
    use offload_core::{
        ChunkKey, EvictionPolicy, HostPool, KvEvent, Medium, OffloadManager, PoolConfig,
        PreparedStore, RequestId, SlotMemory,
    };
    use tier_p2p::{Namespace, NamespaceId, P2pConfig, P2pTier};
    use tier_testkit::{fill_slot, VecSlotMemory};

    const SLOT_BYTES: usize = 4096;
    const WAIT: Duration = Duration::from_secs(10);

    fn key(n: u64) -> ChunkKey {
        ChunkKey::new(u128::from(n), 0)
    }

    struct Fixture {
        memory: Arc<VecSlotMemory>,
        manager: TieringManager,
        medium: Medium,
        events: Vec<TierEvent>,
    }

    /// A host pool of 8 slots over one peer tier (no peers) that keeps 2 published chunks.
    fn fixture() -> Fixture {
        let memory = Arc::new(VecSlotMemory::new(8, SLOT_BYTES));
        let id = NamespaceId {
            model: "m".into(),
            dtype: "u8".into(),
            tokens_per_chunk: 1,
            parallel_layout: "tp1".into(),
        };
        let config = P2pConfig {
            published_bytes_max: 2 * SLOT_BYTES,
            ..P2pConfig::new(Namespace::new(&id, SLOT_BYTES as u64, 1))
        };
        let dyn_memory: Arc<dyn SlotMemory> = memory.clone();
        let tier = P2pTier::new(config, dyn_memory).unwrap_or_else(|e| panic!("peer tier: {e}"));
        let medium = Tier::medium(&tier);
        let host = HostPool::new(PoolConfig {
            slot_count: 8,
            policy: EvictionPolicy::Lru,
            reuse_threshold: 0,
            events: true,
        })
        .expect("pool config");
        let options = TieringOptions {
            strict: true,
            ..TieringOptions::new(SLOT_BYTES as u32)
        };
        let manager = TieringManager::new(host, vec![Box::new(tier)], options).expect("manager");
        Fixture {
            memory,
            manager,
            medium,
            events: Vec::new(),
        }
    }

    fn store(f: &mut Fixture, request: RequestId, keys: &[ChunkKey]) {
        let mut prepared = PreparedStore::default();
        f.manager
            .prepare_store(keys, request, &mut prepared)
            .expect("room");
        for (k, s) in prepared.keys.iter().zip(&prepared.slots) {
            fill_slot(f.memory.as_ref(), *s, SLOT_BYTES, k.hash_low());
        }
        f.manager.complete_store(&prepared.keys, true);
        f.manager.on_request_finished(request);
    }

    /// Steps the manager until the peer tier's events include `want` (in any order), keeping
    /// every event of the peer tier seen so far.
    fn step_until(f: &mut Fixture, want: &[KvEvent]) {
        let deadline = Instant::now() + WAIT;
        loop {
            f.manager.begin_step();
            f.manager.end_step();
            let mut events = Vec::new();
            f.manager.take_tier_events(&mut events);
            f.events
                .extend(events.into_iter().filter(|e| e.tier == "p2p"));
            let seen: Vec<&KvEvent> = f.events.iter().map(|e| &e.event).collect();
            if want.iter().all(|w| seen.contains(&w)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "peer tier events {seen:?} lack some of {want:?} after {WAIT:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn position(f: &Fixture, event: &KvEvent) -> usize {
        f.events
            .iter()
            .position(|e| &e.event == event)
            .unwrap_or_else(|| panic!("no {event:?} in {:?}", f.events))
    }

    #[test]
    fn chunks_the_peer_tier_evicts_become_removed_events_with_its_medium() {
        let mut f = fixture();
        let medium = f.medium;
        let stored = |k| KvEvent::Stored {
            key: key(k),
            medium,
        };
        let removed = |k| KvEvent::Removed {
            key: key(k),
            medium,
        };
        // Published and announced first, evicted later by the publishes of 3 and 4.
        store(&mut f, RequestId(1), &[key(1), key(2)]);
        step_until(&mut f, &[stored(1), stored(2)]);
        assert!(
            !f.events
                .iter()
                .any(|e| matches!(e.event, KvEvent::Removed { .. })),
            "nothing evicted yet: {:?}",
            f.events
        );
        store(&mut f, RequestId(2), &[key(3), key(4)]);
        step_until(&mut f, &[stored(3), stored(4), removed(1), removed(2)]);
        // 5, 6 and 7 in one job: 7's publish evicts 5 before the job's completion (and its
        // `Stored` events) is handed out; 5's `Removed` still comes after its `Stored`.
        store(&mut f, RequestId(3), &[key(5), key(6), key(7)]);
        step_until(
            &mut f,
            &[
                stored(5),
                stored(6),
                stored(7),
                removed(3),
                removed(4),
                removed(5),
            ],
        );
        for k in 1..=5 {
            assert!(
                position(&f, &stored(k)) < position(&f, &removed(k)),
                "Removed before Stored for key {k}: {:?}",
                f.events
            );
        }
        for k in [6, 7] {
            assert!(
                !f.events.iter().any(|e| e.event == removed(k)),
                "key {k} is still published: {:?}",
                f.events
            );
        }
        let removed_count = f
            .events
            .iter()
            .filter(|e| matches!(e.event, KvEvent::Removed { .. }))
            .count();
        assert_eq!(removed_count, 5, "each eviction once: {:?}", f.events);
        let c = f.manager.tier_counters(0).expect("tier 0");
        assert_eq!((c.evictions_reported, c.evictions_unreported), (5, 0));
    }
}

#[cfg(not(feature = "p2p"))]
#[test]
fn p2p_evictions_not_run() {
    eprintln!("p2p_evictions NOT RUN: needs the connector's `p2p` feature");
}
