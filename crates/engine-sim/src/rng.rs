//! A tiny deterministic PRNG (splitmix64). Every random choice of the simulator comes from one of
//! these, seeded from `SimConfig::seed`, so a seed replays a run exactly.

/// The splitmix64 output function: a strong 64-bit mixer, also used for hashing.
pub const fn mix64(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The splitmix64 generator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// An independent generator for sub-stream `stream` of `seed` (a worker, the abort stream).
    pub const fn stream(seed: u64, stream: u64) -> Self {
        Self::new(mix64(seed ^ mix64(stream.wrapping_add(0x5EED))))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.state)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        self.next_u64() % n
    }

    /// True with probability `ppm` / 1,000,000.
    pub fn chance_ppm(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.below(1_000_000) < u64::from(ppm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut c = SplitMix64::new(8);
        assert_ne!(SplitMix64::new(7).next_u64(), c.next_u64());
    }

    #[test]
    fn below_and_chance_bounds() {
        let mut r = SplitMix64::new(1);
        assert_eq!(r.below(0), 0);
        for _ in 0..1000 {
            assert!(r.below(10) < 10);
        }
        assert!(!r.chance_ppm(0));
        assert!(r.chance_ppm(1_000_000));
        let hits = (0..10_000).filter(|_| r.chance_ppm(500_000)).count();
        assert!((4_000..6_000).contains(&hits), "hits {hits}");
    }

    #[test]
    fn streams_differ() {
        let a = SplitMix64::stream(3, 0).next_u64();
        let b = SplitMix64::stream(3, 1).next_u64();
        assert_ne!(a, b);
    }
}
