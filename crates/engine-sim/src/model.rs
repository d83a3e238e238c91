//! The deterministic "model": token streams, chained prefix hashes and the KV bytes of every token.
//!
//! A request's tokens are a prompt (an optional shared prefix, then tokens of its own) followed by
//! sampled tokens. Token `t` has a prefix hash `h(t) = mix(h(t-1), token t)`, so it names the whole
//! prefix through `t`; the hash of engine block `j` is the hash of its last token, which makes block
//! hashes chained exactly like vLLM's: `hash(block j) = fold(mix, hash(block j-1), tokens of j)`.
//! The KV bytes of token `t` (`block_bytes / tokens_per_block` of them) are a splitmix stream
//! seeded by `h(t)`, and a block's bytes are its tokens' bytes side by side. Equal prefixes
//! therefore give equal bytes (content addressing), and any misplaced byte is detectable.
//! Sampling is greedy and deterministic: the next token is a function of the prefix hash.

use crate::rng::{mix64, SplitMix64};

/// Hash of the empty prefix.
pub const ROOT_HASH: u64 = 0x6B76_7469_6572_0001;
/// Size of the vocabulary tokens are drawn from.
pub const VOCAB: u64 = 50_000;
const PREFIX_SALT: u64 = 0x5052_4546_4958_0000;
const UNIQUE_SALT: u64 = 0x554E_4951_5545_0000;
const SAMPLE_SALT: u64 = 0x5341_4D50_4C45_0000;
const WIDE_SALT: u64 = 0x5749_4445_4B45_5900;

/// The 128-bit engine block hash (a chunk key's hash) of a block whose last token has chain hash
/// `chain`: the chain hash in the low half, an independent mix of it in the high half. The
/// simulator's chain is 64-bit (it seeds the tokens' KV bytes); widening it fills every bit of
/// the keys, so all of kvtier's 128-bit paths carry distinct high halves.
pub const fn block_key_hash(chain: u64) -> u128 {
    ((mix64(chain ^ WIDE_SALT) as u128) << 64) | chain as u128
}

/// The prefix hash of a prefix with hash `prev` extended by `token`.
pub const fn mix_token(prev: u64, token: u32) -> u64 {
    mix64(prev.rotate_left(17) ^ (token as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// `len` tokens of the shared prefix `prefix_id` (the same for every request that names it).
pub fn prefix_tokens(prefix_id: u64, len: u32, out: &mut Vec<u32>) {
    draw_tokens(mix64(prefix_id ^ PREFIX_SALT), len, out);
}

/// `len` tokens of a request's own part, from its seed.
pub fn unique_tokens(seed: u64, len: u32, out: &mut Vec<u32>) {
    draw_tokens(mix64(seed ^ UNIQUE_SALT), len, out);
}

fn draw_tokens(seed: u64, len: u32, out: &mut Vec<u32>) {
    let mut rng = SplitMix64::new(seed);
    out.extend((0..len).map(|_| rng.below(VOCAB) as u32));
}

/// A request's tokens with the prefix hash of each one. Only grows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenChain {
    tokens: Vec<u32>,
    hashes: Vec<u64>,
}

impl TokenChain {
    /// A chain of `tokens`.
    pub fn new(tokens: &[u32]) -> Self {
        let mut chain = Self::default();
        for &t in tokens {
            chain.push(t);
        }
        chain
    }

    /// Appends a token.
    pub fn push(&mut self, token: u32) {
        let prev = self.hashes.last().copied().unwrap_or(ROOT_HASH);
        self.tokens.push(token);
        self.hashes.push(mix_token(prev, token));
    }

    /// Number of tokens.
    pub fn len(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Prefix hash through token `t`. Panics if `t` is out of range (a simulator bug).
    pub fn token_hash(&self, t: u32) -> u64 {
        self.hashes[t as usize]
    }

    /// Chained hash of engine block `j` (blocks of `tokens_per_block`), if the block is full
    /// within the first `known` tokens.
    pub fn block_hash(&self, j: u32, tokens_per_block: u32, known: u32) -> Option<u128> {
        let last = (j + 1).checked_mul(tokens_per_block)?;
        (last <= known.min(self.len())).then(|| block_key_hash(self.hashes[last as usize - 1]))
    }

    /// Hashes of the full blocks within the first `known` tokens, appended to `out` from block
    /// `out.len()` on (so a cached list can be extended as tokens become known).
    pub fn extend_block_hashes(&self, tokens_per_block: u32, known: u32, out: &mut Vec<u128>) {
        let full = known.min(self.len()) / tokens_per_block;
        for j in out.len() as u32..full {
            out.push(block_key_hash(
                self.hashes[((j + 1) * tokens_per_block - 1) as usize],
            ));
        }
    }

    /// The token greedy sampling appends after the current last token (a function of the prefix).
    pub fn next_token(&self) -> u32 {
        let last = self.hashes.last().copied().unwrap_or(ROOT_HASH);
        (mix64(last ^ SAMPLE_SALT) % VOCAB) as u32
    }
}

/// Byte geometry of the KV cache and the KV bytes of tokens and blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvModel {
    /// Tokens per engine block.
    pub tokens_per_block: u32,
    /// Bytes per engine block (a multiple of `tokens_per_block`).
    pub block_bytes: u32,
}

impl KvModel {
    /// Bytes of one token's KV.
    pub fn token_bytes(&self) -> usize {
        (self.block_bytes / self.tokens_per_block) as usize
    }

    /// Writes the KV bytes of the token with prefix hash `hash` into `out` (one token's bytes).
    pub fn token_kv(&self, hash: u64, out: &mut [u8]) {
        let mut rng = SplitMix64::new(hash);
        let mut words = out.chunks_exact_mut(8);
        for word in &mut words {
            word.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        let rest = words.into_remainder();
        if !rest.is_empty() {
            let word = rng.next_u64().to_le_bytes();
            rest.copy_from_slice(&word[..rest.len()]);
        }
    }

    /// Whether `got` (one token's bytes) holds the KV bytes of the token with prefix hash
    /// `hash`: [`KvModel::token_kv`] compared word by word, without a buffer.
    pub fn token_kv_matches(&self, hash: u64, got: &[u8]) -> bool {
        let mut rng = SplitMix64::new(hash);
        let mut words = got.chunks_exact(8);
        for word in &mut words {
            if word != rng.next_u64().to_le_bytes() {
                return false;
            }
        }
        let rest = words.remainder();
        rest.is_empty() || rest == &rng.next_u64().to_le_bytes()[..rest.len()]
    }

    /// Whether `got` (a whole block's bytes) holds the KV bytes of block `j` of `chain` within
    /// the byte range `range` of the block, for the tokens that exist. `scratch` is reused.
    pub fn block_kv_matches(
        &self,
        chain: &TokenChain,
        j: u32,
        got: &[u8],
        range: std::ops::Range<usize>,
        scratch: &mut Vec<u8>,
    ) -> bool {
        let first = j * self.tokens_per_block;
        let end = (first + self.tokens_per_block).min(chain.len());
        let width = self.token_bytes();
        for t in first..end {
            let at = self.offset_in_block(t);
            let (lo, hi) = (at.max(range.start), (at + width).min(range.end));
            if lo >= hi {
                continue;
            }
            let hash = chain.token_hash(t);
            if lo == at && hi == at + width {
                if !self.token_kv_matches(hash, &got[at..hi]) {
                    return false;
                }
                continue;
            }
            scratch.resize(width, 0);
            self.token_kv(hash, scratch);
            if got[lo..hi] != scratch[lo - at..hi - at] {
                return false;
            }
        }
        true
    }

    /// Byte offset of token `t` within its block.
    pub fn offset_in_block(&self, t: u32) -> usize {
        (t % self.tokens_per_block) as usize * self.token_bytes()
    }

    /// Writes the KV bytes of block `j` of `chain` into `out` (`block_bytes` long): the bytes of
    /// each of its tokens that exist; bytes of tokens beyond the chain are left untouched.
    pub fn block_kv(&self, chain: &TokenChain, j: u32, out: &mut [u8]) {
        let first = j * self.tokens_per_block;
        let end = (first + self.tokens_per_block).min(chain.len());
        let width = self.token_bytes();
        for t in first..end {
            let at = self.offset_in_block(t);
            self.token_kv(chain.token_hash(t), &mut out[at..at + width]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> KvModel {
        KvModel {
            tokens_per_block: 4,
            block_bytes: 64,
        }
    }

    #[test]
    fn tokens_are_deterministic_and_prefixes_shared() {
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        prefix_tokens(1, 10, &mut a);
        prefix_tokens(1, 10, &mut b);
        prefix_tokens(2, 10, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|&t| u64::from(t) < VOCAB));
        unique_tokens(5, 3, &mut a);
        unique_tokens(6, 3, &mut b);
        assert_eq!(a[..10], b[..10]);
        assert_ne!(a[10..], b[10..]);
    }

    #[test]
    fn block_hashes_are_chained() {
        let mut toks = Vec::new();
        prefix_tokens(9, 12, &mut toks);
        let chain = TokenChain::new(&toks);
        let h0 = chain.block_hash(0, 4, 12).unwrap();
        let h1 = chain.block_hash(1, 4, 12).unwrap();
        let manual = toks[4..8].iter().fold(h0 as u64, |h, &t| mix_token(h, t));
        assert_eq!(h1, block_key_hash(manual));
        assert_ne!(h1 >> 64, 0, "the high half is filled");
        assert_eq!(
            chain.block_hash(2, 4, 11),
            None,
            "block 2 is not full within 11 tokens"
        );
        // Same block tokens after a different prefix give a different hash.
        let mut other = toks.clone();
        other[0] ^= 1;
        let other = TokenChain::new(&other);
        assert_ne!(other.block_hash(1, 4, 12), Some(h1));
        let mut hashes = vec![h0];
        chain.extend_block_hashes(4, 12, &mut hashes);
        assert_eq!(hashes, vec![h0, h1, chain.block_hash(2, 4, 12).unwrap()]);
    }

    #[test]
    fn block_bytes_depend_on_prefix_only() {
        let m = model();
        let mut toks = Vec::new();
        prefix_tokens(3, 8, &mut toks);
        let a = TokenChain::new(&toks);
        toks.push(42);
        let b = TokenChain::new(&toks);
        let (mut x, mut y) = (vec![0u8; 64], vec![0u8; 64]);
        m.block_kv(&a, 1, &mut x);
        m.block_kv(&b, 1, &mut y);
        assert_eq!(x, y, "block 1 has the same prefix in both chains");
        assert!(x.iter().any(|&v| v != 0));
        m.block_kv(&a, 0, &mut y);
        assert_ne!(x, y);
    }

    #[test]
    fn partial_block_writes_only_existing_tokens() {
        let m = model();
        let chain = TokenChain::new(&[1, 2, 3, 4, 5, 6]);
        let mut out = vec![0xAAu8; 64];
        m.block_kv(&chain, 1, &mut out);
        assert!(out[32..].iter().all(|&v| v == 0xAA));
        let mut token = vec![0u8; 16];
        m.token_kv(chain.token_hash(5), &mut token);
        assert_eq!(out[16..32], token[..]);
    }

    #[test]
    fn matching_agrees_with_the_written_bytes() {
        // 20 bytes per token: the last word of each token is a partial one.
        let m = KvModel {
            tokens_per_block: 4,
            block_bytes: 80,
        };
        let chain = TokenChain::new(&[7, 8, 9, 10, 11]);
        let mut block = vec![0u8; 80];
        m.block_kv(&chain, 0, &mut block);
        let mut scratch = Vec::new();
        assert!(m.block_kv_matches(&chain, 0, &block, 0..80, &mut scratch));
        assert!(m.block_kv_matches(&chain, 0, &block, 30..50, &mut scratch));
        assert!(m.token_kv_matches(chain.token_hash(2), &block[40..60]));
        for at in [0, 19, 35, 79] {
            let mut bad = block.clone();
            bad[at] ^= 1;
            assert!(
                !m.block_kv_matches(&chain, 0, &bad, 0..80, &mut scratch),
                "byte {at}"
            );
            let token = at / 20;
            assert!(!m.token_kv_matches(
                chain.token_hash(token as u32),
                &bad[token * 20..token * 20 + 20]
            ));
        }
        // A flipped byte outside the range is not looked at.
        let mut bad = block.clone();
        bad[10] ^= 1;
        assert!(m.block_kv_matches(&chain, 0, &bad, 20..80, &mut scratch));
        assert!(!m.block_kv_matches(&chain, 0, &bad, 5..25, &mut scratch));
    }

    #[test]
    fn sampling_is_a_function_of_the_prefix() {
        let a = TokenChain::new(&[1, 2, 3]);
        let b = TokenChain::new(&[1, 2, 3]);
        let c = TokenChain::new(&[1, 2, 4]);
        assert_eq!(a.next_token(), b.next_token());
        assert_ne!(a.next_token(), c.next_token());
    }
}
