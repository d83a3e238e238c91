//! The workload's own prefix reuse: how many prompt tokens could come from a cache at best, if
//! every earlier request's KV were kept forever. A request can reuse the longest run of its
//! leading full prompt blocks that an earlier-arriving request also had (its prompt, or the
//! output tokens it will sample), never its last token. Hits above this, in sum, mean the
//! accounting is wrong, not that the cache is good.

use std::collections::HashSet;

use crate::model::TokenChain;
use crate::workload::Workload;

/// Per request of `workload` (by index), the prompt tokens it could reuse at best, with
/// requests arriving in the simulator's order (arrival step, then index) and engine blocks of
/// `tokens_per_block` tokens. For several engine instances that share a cache (peers), pass
/// their workloads as one.
pub fn reusable_tokens(workload: &Workload, tokens_per_block: u32) -> Vec<u32> {
    let requests = &workload.requests;
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| (requests[i].arrival_step, i));
    let mut seen: HashSet<u128> = HashSet::new();
    let mut out = vec![0; requests.len()];
    let mut hashes = Vec::new();
    for i in order {
        let spec = &requests[i];
        let mut chain = TokenChain::new(&spec.prompt());
        let prompt_len = chain.len();
        hashes.clear();
        chain.extend_block_hashes(tokens_per_block, prompt_len, &mut hashes);
        let cap = (prompt_len.saturating_sub(1) / tokens_per_block) as usize;
        let shared = hashes
            .iter()
            .take(cap)
            .take_while(|h| seen.contains(h))
            .count();
        out[i] = shared as u32 * tokens_per_block;
        // The blocks this request will have: its prompt's and its sampled tokens' (the last
        // sampled token's KV is never written).
        for _ in 1..spec.max_tokens {
            chain.push(chain.next_token());
        }
        chain.extend_block_hashes(tokens_per_block, chain.len(), &mut hashes);
        seen.extend(hashes.iter().copied());
    }
    out
}
