//! Property test: the GPU block pool against a plain reference model (a `VecDeque` free queue,
//! reference counts, and a hash map prefix cache) under random allocate, share, cache and release
//! sequences.

use std::collections::{HashMap, VecDeque};

use engine_sim::gpu::BlockPool;
use offload_core::BlockId;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// A new holder allocates this many blocks.
    Allocate(u32),
    /// Holder (index modulo holders) releases everything.
    Release(usize),
    /// Holder caches its blocks under hashes derived from this salt.
    Cache(usize, u64),
    /// A new holder takes the cached prefix of holder's hashes.
    Share(usize),
}

#[derive(Default)]
struct Model {
    refs: Vec<u32>,
    free: VecDeque<u32>,
    cached: HashMap<u128, u32>,
    hash_of: Vec<Option<u128>>,
}

impl Model {
    fn new(n: u32) -> Self {
        Self {
            refs: vec![0; n as usize],
            free: (0..n).collect(),
            cached: HashMap::new(),
            hash_of: vec![None; n as usize],
        }
    }
    fn allocate(&mut self, n: u32) -> Option<Vec<u32>> {
        if n as usize > self.free.len() {
            return None;
        }
        let out: Vec<u32> = self.free.drain(..n as usize).collect();
        for &b in &out {
            if let Some(h) = self.hash_of[b as usize].take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                }
            }
            self.refs[b as usize] = 1;
        }
        Some(out)
    }
    fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.free.push_back(b);
            }
        }
    }
    fn acquire(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if self.refs[b as usize] == 0 {
                self.free.retain(|&x| x != b);
            }
            self.refs[b as usize] += 1;
        }
    }
    fn cache(&mut self, b: u32, h: u128) {
        if self.hash_of[b as usize].is_some() || self.cached.contains_key(&h) {
            return;
        }
        self.cached.insert(h, b);
        self.hash_of[b as usize] = Some(h);
    }
    fn prefix(&self, hashes: &[u128]) -> Vec<u32> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u32..12).prop_map(Op::Allocate),
        (0usize..64).prop_map(Op::Release),
        ((0usize..64), (0u64..4)).prop_map(|(i, s)| Op::Cache(i, s)),
        (0usize..64).prop_map(Op::Share),
    ]
}

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|&b| BlockId(b)).collect()
}

fn hashes(salt: u64, len: usize) -> Vec<u128> {
    (0..len as u128)
        .map(|j| u128::from(salt) * 1000 + j)
        .collect()
}

proptest! {
    #[test]
    fn pool_matches_reference(ops in proptest::collection::vec(op(), 1..200)) {
        const N: u32 = 24;
        let mut pool = BlockPool::new(N);
        let mut model = Model::new(N);
        // Each holder: its blocks and the salt of the hashes it cached them under.
        let mut holders: Vec<(Vec<u32>, Option<u64>)> = Vec::new();
        for op in ops {
            match op {
                Op::Allocate(n) => {
                    let mut got = Vec::new();
                    let ok = pool.allocate(n, &mut got);
                    let want = model.allocate(n);
                    prop_assert_eq!(ok, want.is_some());
                    if let Some(w) = want {
                        prop_assert_eq!(&got, &ids(&w));
                        holders.push((w, None));
                    }
                }
                Op::Release(i) if !holders.is_empty() => {
                    let (blocks, _) = holders.swap_remove(i % holders.len());
                    pool.release(&ids(&blocks));
                    model.release(&blocks);
                }
                Op::Cache(i, salt) if !holders.is_empty() => {
                    let k = i % holders.len();
                    let hs = hashes(salt, holders[k].0.len());
                    for (b, h) in holders[k].0.iter().zip(&hs) {
                        pool.cache(BlockId(*b), *h);
                        model.cache(*b, *h);
                    }
                    holders[k].1 = Some(salt);
                }
                Op::Share(i) if !holders.is_empty() => {
                    let k = i % holders.len();
                    let Some(salt) = holders[k].1 else { continue };
                    let hs = hashes(salt, holders[k].0.len());
                    let mut hit = Vec::new();
                    pool.find_cached_prefix(&hs, &mut hit);
                    let want = model.prefix(&hs);
                    prop_assert_eq!(&hit, &ids(&want));
                    pool.acquire(&hit);
                    model.acquire(&want);
                    holders.push((want, Some(salt)));
                }
                _ => {}
            }
            prop_assert_eq!(pool.free_count() as usize, model.free.len());
            for b in 0..N {
                prop_assert_eq!(pool.ref_count(BlockId(b)), model.refs[b as usize]);
            }
        }
    }
}
