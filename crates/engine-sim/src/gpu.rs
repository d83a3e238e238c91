//! The simulated GPU KV cache: block memory, and a block pool in the manner of vLLM's
//! `BlockPool`: reference counts, a free queue in LRU order (`FreeKVCacheBlockQueue`) and a
//! prefix cache from block hash to block. A cached block whose count drops to zero stays cached
//! in the free queue until it is reallocated, which evicts it from the cache.

use std::collections::HashMap;

use offload_core::BlockId;

/// The engine's KV cache bytes: `block_count` blocks of `block_bytes` in one buffer.
#[derive(Clone, Debug)]
pub struct GpuMemory {
    block_bytes: usize,
    bytes: Vec<u8>,
}

impl GpuMemory {
    /// Zeroed memory for `block_count` blocks.
    pub fn new(block_count: u32, block_bytes: u32) -> Self {
        Self {
            block_bytes: block_bytes as usize,
            bytes: vec![0; block_count as usize * block_bytes as usize],
        }
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Number of blocks.
    pub fn block_count(&self) -> u32 {
        (self.bytes.len() / self.block_bytes) as u32
    }

    /// One block's bytes.
    pub fn block(&self, block: BlockId) -> &[u8] {
        let at = block.0 as usize * self.block_bytes;
        &self.bytes[at..at + self.block_bytes]
    }

    /// One block's bytes, writable.
    pub fn block_mut(&mut self, block: BlockId) -> &mut [u8] {
        let at = block.0 as usize * self.block_bytes;
        &mut self.bytes[at..at + self.block_bytes]
    }

    /// The whole buffer, writable (for copy engines).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
}

const NIL: u32 = u32::MAX;

/// A doubly linked queue of free blocks: allocation takes from the head (least recently freed),
/// freeing appends to the tail, and a prefix-cache hit removes a block from the middle in O(1).
#[derive(Clone, Debug)]
struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: u32,
}

impl FreeQueue {
    fn full(n: u32) -> Self {
        let mut q = Self {
            prev: vec![NIL; n as usize],
            next: vec![NIL; n as usize],
            queued: vec![false; n as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for b in 0..n {
            q.push_back(b);
        }
        q
    }

    fn push_back(&mut self, b: u32) {
        assert!(!self.queued[b as usize], "block {b} freed twice");
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        match self.tail {
            NIL => self.head = b,
            t => self.next[t as usize] = b,
        }
        self.tail = b;
        self.queued[b as usize] = true;
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        assert!(self.queued[b as usize], "block {b} is not free");
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.queued[b as usize] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }
}

/// Engine blocks: reference counts, the free queue and the GPU prefix cache.
#[derive(Clone, Debug)]
pub struct BlockPool {
    ref_count: Vec<u32>,
    hash_of: Vec<Option<u128>>,
    cached: HashMap<u128, u32>,
    free: FreeQueue,
}

impl BlockPool {
    /// A pool of `block_count` free, uncached blocks.
    pub fn new(block_count: u32) -> Self {
        Self {
            ref_count: vec![0; block_count as usize],
            hash_of: vec![None; block_count as usize],
            cached: HashMap::new(),
            free: FreeQueue::full(block_count),
        }
    }

    /// Number of blocks.
    pub fn block_count(&self) -> u32 {
        self.ref_count.len() as u32
    }

    /// Blocks in the free queue (cached or not): what an allocation may take.
    pub fn free_count(&self) -> u32 {
        self.free.len
    }

    /// A block's reference count.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_count[block.0 as usize]
    }

    /// The hash under which a block is in the prefix cache, if it is.
    pub fn cached_hash(&self, block: BlockId) -> Option<u128> {
        self.hash_of[block.0 as usize]
    }

    /// Number of blocks in the prefix cache.
    pub fn cached_count(&self) -> usize {
        self.cached.len()
    }

    /// The longest run of cached blocks for `hashes`, from the first (no references taken).
    pub fn find_cached_prefix(&self, hashes: &[u128], out: &mut Vec<BlockId>) {
        out.clear();
        for h in hashes {
            let Some(&b) = self.cached.get(h) else { break };
            out.push(BlockId(b));
        }
    }

    /// How many of `blocks` are free (taking them shrinks the free queue).
    pub fn free_among(&self, blocks: &[BlockId]) -> u32 {
        blocks.iter().filter(|b| self.ref_count(**b) == 0).count() as u32
    }

    /// Takes a reference on each block (prefix-cache hits), removing free ones from the queue.
    pub fn acquire(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            if self.ref_count[b.0 as usize] == 0 {
                self.free.remove(b.0);
            }
            self.ref_count[b.0 as usize] += 1;
        }
    }

    /// Allocates `n` blocks from the head of the free queue, evicting them from the prefix cache;
    /// appends them to `out`. All or nothing: returns false (and changes nothing) if fewer are free.
    pub fn allocate(&mut self, n: u32, out: &mut Vec<BlockId>) -> bool {
        if n > self.free.len {
            return false;
        }
        for _ in 0..n {
            let Some(b) = self.free.pop_front() else {
                unreachable!("free queue shorter than its length")
            };
            self.evict(b);
            self.ref_count[b as usize] = 1;
            out.push(BlockId(b));
        }
        true
    }

    fn evict(&mut self, b: u32) {
        if let Some(h) = self.hash_of[b as usize].take() {
            if self.cached.get(&h) == Some(&b) {
                self.cached.remove(&h);
            }
        }
    }

    /// Drops one reference on each block, last block first (so a request's tail blocks are
    /// reallocated before its prefix); blocks reaching zero join the tail of the free queue.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for b in blocks.iter().rev() {
            let rc = &mut self.ref_count[b.0 as usize];
            assert!(*rc > 0, "block {} released with no reference", b.0);
            *rc -= 1;
            if *rc == 0 {
                self.free.push_back(b.0);
            }
        }
    }

    /// Puts a full block into the prefix cache under `hash`, unless it is cached already or
    /// another block holds that hash.
    pub fn cache(&mut self, block: BlockId, hash: u128) {
        if self.hash_of[block.0 as usize].is_some() || self.cached.contains_key(&hash) {
            return;
        }
        self.cached.insert(hash, block.0);
        self.hash_of[block.0 as usize] = Some(hash);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&b| BlockId(b)).collect()
    }

    #[test]
    fn allocate_is_all_or_nothing_and_lru() {
        let mut pool = BlockPool::new(4);
        let mut out = Vec::new();
        assert!(!pool.allocate(5, &mut out));
        assert!(out.is_empty());
        assert!(pool.allocate(3, &mut out));
        assert_eq!(out, ids(&[0, 1, 2]));
        assert_eq!(pool.free_count(), 1);
        pool.release(&ids(&[0, 1]));
        // Released last block first: 1 then 0 join the tail after 3.
        let mut next = Vec::new();
        assert!(pool.allocate(3, &mut next));
        assert_eq!(next, ids(&[3, 1, 0]));
        assert_eq!(pool.free_count(), 0);
    }

    #[test]
    fn prefix_cache_hits_until_reallocated() {
        let mut pool = BlockPool::new(3);
        let mut blocks = Vec::new();
        assert!(pool.allocate(2, &mut blocks));
        pool.cache(blocks[0], 10);
        pool.cache(blocks[1], 11);
        pool.release(&blocks);
        let mut hit = Vec::new();
        pool.find_cached_prefix(&[10, 11, 12], &mut hit);
        assert_eq!(hit, blocks);
        assert_eq!(pool.free_among(&hit), 2);
        pool.acquire(&hit[..1]);
        assert_eq!(pool.ref_count(hit[0]), 1);
        assert_eq!(pool.free_count(), 2);
        // Free queue now: block 2, then block 1 (released first as the tail). Allocating two
        // evicts block 1 from the cache.
        let mut fresh = Vec::new();
        assert!(pool.allocate(2, &mut fresh));
        assert_eq!(fresh, ids(&[2, 1]));
        pool.find_cached_prefix(&[10, 11], &mut hit);
        assert_eq!(hit, ids(&[0]));
        assert_eq!(pool.cached_hash(BlockId(1)), None);
        assert_eq!(pool.cached_count(), 1);
    }

    #[test]
    fn shared_blocks_need_every_release() {
        let mut pool = BlockPool::new(2);
        let mut b = Vec::new();
        assert!(pool.allocate(1, &mut b));
        pool.acquire(&b);
        pool.release(&b);
        assert_eq!(pool.free_count(), 1);
        pool.release(&b);
        assert_eq!(pool.free_count(), 2);
    }

    #[test]
    fn duplicate_hash_keeps_first_block() {
        let mut pool = BlockPool::new(2);
        let mut b = Vec::new();
        assert!(pool.allocate(2, &mut b));
        pool.cache(b[0], 5);
        pool.cache(b[1], 5);
        assert_eq!(pool.cached_hash(b[1]), None);
        let mut hit = Vec::new();
        pool.find_cached_prefix(&[5], &mut hit);
        assert_eq!(hit, vec![b[0]]);
    }

    #[test]
    fn memory_blocks_are_disjoint() {
        let mut mem = GpuMemory::new(3, 8);
        mem.block_mut(BlockId(1)).fill(7);
        assert_eq!(mem.block(BlockId(0)), &[0; 8]);
        assert_eq!(mem.block(BlockId(1)), &[7; 8]);
        assert_eq!(mem.block(BlockId(2)), &[0; 8]);
        assert_eq!(mem.block_count(), 3);
    }
}
