//! POLYVAL (RFC 8452, the universal hash of AES-GCM-SIV) over a chunk's bytes, under a hash key
//! that only holders of the shared secret know: the hash half of the keyed chunk tag (protocol
//! 6, see [`crate::auth::ChunkAuth`]), which is then keyed into the tag with BLAKE3.
//!
//! Why POLYVAL and not an unkeyed BLAKE3 digest (protocol 5): the receiver hashes every byte it
//! loads, and on this kind of machine the bytes a `recv` just wrote are re-read from outside the
//! core's caches, where POLYVAL with carry-less multiplication costs about what the xxh3 checksum
//! costs, and BLAKE3 about twice that (docs/perf.md). POLYVAL is a universal hash, not a
//! collision-resistant one: it is secure only while its key is secret, which it is (derived from
//! the shared secret and never sent), and its value is never sent either, only a keyed BLAKE3 of
//! it (hash-then-PRF, a standard MAC construction). Two different payloads of one length collide
//! for at most `blocks / 2^128` of keys; the length is bound by the tag separately.
//!
//! Field elements are `u128`s with bit `i` the coefficient of `x^i` (bytes little-endian, as in
//! RFC 8452). `dot(a, b) = a * b * x^-128` modulo `x^128 + x^127 + x^126 + x^121 + 1`; POLYVAL
//! of blocks `X_1..X_s` is `S_s` with `S_0 = 0`, `S_j = dot(S_{j-1} + X_j, H)`; a last partial
//! block is padded with zeros. x86_64 with AVX-512 and VPCLMULQDQ folds 16 blocks per reduction
//! (four per multiply) with the precomputed powers `H^1..H^16` (under `dot`), when built by Rust
//! 1.89 or newer (`build.rs`); with PCLMULQDQ, 8 blocks; elsewhere a portable carry-less multiply
//! does one block at a time (slow, correct: the same values, tested against each other and RFC
//! 8452).

/// Bytes of a POLYVAL block and of its value.
pub(crate) const BLOCK_BYTES: usize = 16;
/// Blocks folded per reduction on the CLMUL path.
const FOLD_BLOCKS: usize = 8;
/// Blocks folded per reduction on the VPCLMULQDQ path (four 4-block vectors).
const WIDE_BLOCKS: usize = 16;

/// A POLYVAL hash key with what the fast path precomputes from it.
#[derive(Clone)]
pub(crate) struct PolyvalKey {
    /// `powers[k]` is `H^(k + 1)` under `dot`; `powers[0]` is `H`. Shared: every chunk's
    /// hasher holds the key.
    powers: std::sync::Arc<[u128; WIDE_BLOCKS]>,
    /// Whether this CPU has PCLMULQDQ (checked once, when the key is made).
    clmul: bool,
    /// Whether this CPU has AVX-512F and VPCLMULQDQ, and this build the path for them.
    wide: bool,
}

impl std::fmt::Debug for PolyvalKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PolyvalKey(<redacted>)")
    }
}

impl PolyvalKey {
    /// The key `h` (16 bytes, little-endian), with its powers.
    pub(crate) fn new(h: [u8; BLOCK_BYTES]) -> Self {
        let h = u128::from_le_bytes(h);
        let mut powers = [h; WIDE_BLOCKS];
        for k in 1..WIDE_BLOCKS {
            powers[k] = dot_soft(powers[k - 1], h);
        }
        let clmul = clmul_available();
        Self {
            powers: std::sync::Arc::new(powers),
            clmul,
            wide: clmul && wide_available(),
        }
    }

    /// Uses the portable path even where CLMUL is available (tests compare the two).
    #[cfg(test)]
    pub(crate) fn force_portable(&mut self) {
        self.clmul = false;
        self.wide = false;
    }

    /// Uses at most the PCLMULQDQ path (tests compare it with the wider one).
    #[cfg(test)]
    fn force_narrow(&mut self) {
        self.wide = false;
    }

    /// Whether two keys are the same key.
    pub(crate) fn same_as(&self, other: &PolyvalKey) -> bool {
        self.powers[0] == other.powers[0]
    }

    /// POLYVAL of `bytes` (the last partial block zero-padded).
    pub(crate) fn hash(&self, bytes: &[u8]) -> [u8; BLOCK_BYTES] {
        let mut hasher = Polyval::new(self.clone());
        hasher.update(bytes);
        hasher.finish()
    }
}

#[cfg(target_arch = "x86_64")]
fn clmul_available() -> bool {
    std::arch::is_x86_feature_detected!("pclmulqdq")
        && std::arch::is_x86_feature_detected!("sse4.1")
}

#[cfg(not(target_arch = "x86_64"))]
fn clmul_available() -> bool {
    false
}

#[cfg(all(target_arch = "x86_64", kvtier_vpclmul))]
#[allow(clippy::incompatible_msrv)] // Built only by Rust 1.89 or newer (build.rs).
fn wide_available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("vpclmulqdq")
}

#[cfg(not(all(target_arch = "x86_64", kvtier_vpclmul)))]
fn wide_available() -> bool {
    false
}

/// POLYVAL fed piece by piece: pieces of any length give the value of their concatenation.
#[derive(Clone, Debug)]
pub(crate) struct Polyval {
    key: PolyvalKey,
    acc: u128,
    partial: [u8; BLOCK_BYTES],
    partial_len: usize,
}

impl Polyval {
    /// An empty hash under `key`.
    pub(crate) fn new(key: PolyvalKey) -> Self {
        Self {
            key,
            acc: 0,
            partial: [0; BLOCK_BYTES],
            partial_len: 0,
        }
    }

    /// Feeds the next bytes.
    pub(crate) fn update(&mut self, mut bytes: &[u8]) {
        if self.partial_len > 0 {
            let take = (BLOCK_BYTES - self.partial_len).min(bytes.len());
            self.partial[self.partial_len..self.partial_len + take].copy_from_slice(&bytes[..take]);
            self.partial_len += take;
            bytes = &bytes[take..];
            if self.partial_len < BLOCK_BYTES {
                return;
            }
            let block = self.partial;
            self.blocks(&block);
            self.partial_len = 0;
        }
        let whole = bytes.len() - bytes.len() % BLOCK_BYTES;
        self.blocks(&bytes[..whole]);
        let tail = &bytes[whole..];
        self.partial[..tail.len()].copy_from_slice(tail);
        self.partial_len = tail.len();
    }

    /// The value of all bytes fed, the last partial block zero-padded.
    pub(crate) fn finish(mut self) -> [u8; BLOCK_BYTES] {
        if self.partial_len > 0 {
            let mut block = [0u8; BLOCK_BYTES];
            block[..self.partial_len].copy_from_slice(&self.partial[..self.partial_len]);
            self.blocks(&block);
        }
        self.acc.to_le_bytes()
    }

    /// Folds whole blocks (`bytes.len()` a multiple of 16) into the accumulator.
    fn blocks(&mut self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len() % BLOCK_BYTES, 0);
        #[cfg(all(target_arch = "x86_64", kvtier_vpclmul))]
        if self.key.wide {
            // SAFETY: `wide` is true only where the CPU has AVX-512F, VPCLMULQDQ, PCLMULQDQ
            // and SSE4.1 (checked at run time when the key was made), the target features
            // `wide::blocks` and `clmul::blocks` enable.
            let (acc, rest) = unsafe { wide::blocks(&self.key.powers, self.acc, bytes) };
            self.acc = unsafe { clmul::blocks(&self.key.powers, acc, rest) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.key.clmul {
            // SAFETY: `clmul` is true only where the CPU has PCLMULQDQ and SSE4.1 (checked at
            // run time when the key was made), the target features `clmul::blocks` enables.
            self.acc = unsafe { clmul::blocks(&self.key.powers, self.acc, bytes) };
            return;
        }
        let h = self.key.powers[0];
        for block in bytes.chunks_exact(BLOCK_BYTES) {
            let mut x = [0u8; BLOCK_BYTES];
            x.copy_from_slice(block);
            self.acc = dot_soft(self.acc ^ u128::from_le_bytes(x), h);
        }
    }
}

/// The carry-less product of two 64-bit polynomials, in software (no branch on the operands).
fn clmul64_soft(a: u64, b: u64) -> u128 {
    let a = u128::from(a);
    let mut product = 0u128;
    for i in 0..64 {
        let bit = u128::from((b >> i) & 1);
        product ^= (a << i) & bit.wrapping_neg();
    }
    product
}

/// `dot(a, b)`: the 256-bit carry-less product, then the two-step Montgomery reduction by
/// `x^-128` of the AES-GCM-SIV reference code (the constant `0xc2 << 56` is `x^-128`'s low
/// folding term).
fn dot_soft(a: u128, b: u128) -> u128 {
    let (a0, a1) = (a as u64, (a >> 64) as u64);
    let (b0, b1) = (b as u64, (b >> 64) as u64);
    let lo = clmul64_soft(a0, b0);
    let hi = clmul64_soft(a1, b1);
    let mid = clmul64_soft(a0, b1) ^ clmul64_soft(a1, b0);
    let low = lo ^ (mid << 64);
    let high = hi ^ (mid >> 64);
    let fold = |t: u128| t.rotate_left(64) ^ clmul64_soft(t as u64, 0xc200_0000_0000_0000);
    high ^ fold(fold(low))
}

#[cfg(target_arch = "x86_64")]
mod clmul {
    //! The PCLMULQDQ path: 8 blocks per reduction.
    use std::arch::x86_64::{
        __m128i, _mm_clmulepi64_si128, _mm_loadu_si128, _mm_setr_epi32, _mm_shuffle_epi32,
        _mm_slli_si128, _mm_srli_si128, _mm_xor_si128,
    };

    use super::{BLOCK_BYTES, FOLD_BLOCKS, WIDE_BLOCKS};

    pub(super) fn to_m128(value: u128) -> __m128i {
        // SAFETY: both are 16 plain bytes, every bit pattern valid; on little-endian x86_64 the
        // vector's low lane is the u128's low half, as the loads of the message see it.
        unsafe { std::mem::transmute::<u128, __m128i>(value) }
    }

    pub(super) fn from_m128(value: __m128i) -> u128 {
        // SAFETY: as in `to_m128`.
        unsafe { std::mem::transmute::<__m128i, u128>(value) }
    }

    /// The three parts (low, middle, high) of the 256-bit carry-less product of `a` and `b`.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    // The block: the intrinsics are safe here from Rust 1.86 on, not before (rust-version).
    #[allow(unused_unsafe)]
    unsafe fn product(a: __m128i, b: __m128i) -> (__m128i, __m128i, __m128i) {
        // SAFETY: register operations only; the caller has the target features.
        unsafe {
            let lo = _mm_clmulepi64_si128(a, b, 0x00);
            let mid = _mm_xor_si128(
                _mm_clmulepi64_si128(a, b, 0x01),
                _mm_clmulepi64_si128(a, b, 0x10),
            );
            let hi = _mm_clmulepi64_si128(a, b, 0x11);
            (lo, mid, hi)
        }
    }

    /// The product (parts summed over several products) times `x^-128`, reduced: as
    /// `super::dot_soft`.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    #[allow(unused_unsafe)]
    pub(super) unsafe fn reduce(lo: __m128i, mid: __m128i, hi: __m128i) -> __m128i {
        // SAFETY: register operations only; the caller has the target features.
        unsafe {
            let poly = _mm_setr_epi32(1, 0, 0, 0xc200_0000_u32 as i32);
            let low = _mm_xor_si128(lo, _mm_slli_si128(mid, 8));
            let high = _mm_xor_si128(hi, _mm_srli_si128(mid, 8));
            let t = _mm_xor_si128(
                _mm_shuffle_epi32(low, 0x4e),
                _mm_clmulepi64_si128(low, poly, 0x10),
            );
            let t = _mm_xor_si128(
                _mm_shuffle_epi32(t, 0x4e),
                _mm_clmulepi64_si128(t, poly, 0x10),
            );
            _mm_xor_si128(high, t)
        }
    }

    /// Folds whole blocks into `acc`: per 8 blocks `X_1..X_8`, `acc' = dot(acc + X_1, H^8) +
    /// dot(X_2, H^7) + ... + dot(X_8, H)`, summed unreduced and reduced once.
    ///
    /// # Safety
    ///
    /// The CPU must have PCLMULQDQ and SSE4.1.
    #[target_feature(enable = "pclmulqdq,sse2,ssse3,sse4.1")]
    pub(super) unsafe fn blocks(powers: &[u128; WIDE_BLOCKS], acc: u128, bytes: &[u8]) -> u128 {
        let mut near = [to_m128(0); FOLD_BLOCKS];
        for (m, &p) in near.iter_mut().zip(powers) {
            *m = to_m128(p);
        }
        let powers = near;
        let mut s = to_m128(acc);
        let mut groups = bytes.chunks_exact(BLOCK_BYTES * FOLD_BLOCKS);
        for group in &mut groups {
            // SAFETY: the caller has the target features; every load reads 16 of the group's
            // FOLD_BLOCKS * 16 bytes (unaligned loads).
            s = unsafe {
                let at = group.as_ptr();
                let first = _mm_xor_si128(_mm_loadu_si128(at.cast()), s);
                let (mut lo, mut mid, mut hi) = product(first, powers[FOLD_BLOCKS - 1]);
                for j in 1..FOLD_BLOCKS {
                    let x = _mm_loadu_si128(at.add(j * BLOCK_BYTES).cast());
                    let (l, m, h) = product(x, powers[FOLD_BLOCKS - 1 - j]);
                    lo = _mm_xor_si128(lo, l);
                    mid = _mm_xor_si128(mid, m);
                    hi = _mm_xor_si128(hi, h);
                }
                reduce(lo, mid, hi)
            };
        }
        for block in groups.remainder().chunks_exact(BLOCK_BYTES) {
            // SAFETY: the caller has the target features; `block` is 16 bytes.
            s = unsafe {
                let x = _mm_xor_si128(_mm_loadu_si128(block.as_ptr().cast()), s);
                let (lo, mid, hi) = product(x, powers[0]);
                reduce(lo, mid, hi)
            };
        }
        from_m128(s)
    }
}

#[cfg(all(target_arch = "x86_64", kvtier_vpclmul))]
#[allow(clippy::incompatible_msrv)] // Built only by Rust 1.89 or newer (build.rs).
mod wide {
    //! The VPCLMULQDQ path: 16 blocks per reduction, four per carry-less multiply.
    use std::arch::x86_64::{
        __m128i, __m512i, _mm256_castsi256_si128, _mm256_extracti128_si256, _mm256_xor_si256,
        _mm512_castsi512_si256, _mm512_clmulepi64_epi128, _mm512_extracti64x4_epi64,
        _mm512_loadu_si512, _mm512_xor_si512, _mm512_zextsi128_si512,
    };

    use super::clmul::{from_m128, reduce, to_m128};
    use super::{BLOCK_BYTES, WIDE_BLOCKS};

    /// The sum of a vector's four 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    #[allow(unused_unsafe)]
    unsafe fn lanes_sum(v: __m512i) -> __m128i {
        // SAFETY: register operations only; the caller has the target features.
        unsafe {
            let half = _mm256_xor_si256(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
            std::arch::x86_64::_mm_xor_si128(
                _mm256_castsi256_si128(half),
                _mm256_extracti128_si256(half, 1),
            )
        }
    }

    /// Folds the whole groups of 16 blocks at the front of `bytes` into `acc`, as
    /// `super::clmul::blocks` does 8 at a time; returns the new value and the bytes left (fewer
    /// than 16 blocks).
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.1.
    #[target_feature(enable = "avx512f,avx2,vpclmulqdq,pclmulqdq,sse4.1")]
    pub(super) unsafe fn blocks<'a>(
        powers: &[u128; WIDE_BLOCKS],
        acc: u128,
        bytes: &'a [u8],
    ) -> (u128, &'a [u8]) {
        // Vector k multiplies blocks 4k+1..4k+4 of a group by H^(16-4k)..H^(13-4k): lane j of
        // vector k holds H^(16 - 4k - j).
        let mut h = [[0u128; 4]; 4];
        for (k, vector) in h.iter_mut().enumerate() {
            for (j, lane) in vector.iter_mut().enumerate() {
                *lane = powers[WIDE_BLOCKS - 1 - 4 * k - j];
            }
        }
        // SAFETY: each `[u128; 4]` is 64 readable bytes (unaligned load).
        let h = h.map(|v| unsafe { _mm512_loadu_si512(v.as_ptr().cast()) });
        let mut s: __m128i = to_m128(acc);
        let mut groups = bytes.chunks_exact(BLOCK_BYTES * WIDE_BLOCKS);
        for group in &mut groups {
            // SAFETY: the caller has the target features; each load reads 64 of the group's
            // 256 bytes (unaligned loads).
            s = unsafe {
                let at = group.as_ptr();
                let x = [0usize, 1, 2, 3].map(|k| _mm512_loadu_si512(at.add(64 * k).cast()));
                let first = _mm512_xor_si512(x[0], _mm512_zextsi128_si512(s));
                let mut lo = _mm512_clmulepi64_epi128(first, h[0], 0x00);
                let mut hi = _mm512_clmulepi64_epi128(first, h[0], 0x11);
                let mut mid = _mm512_xor_si512(
                    _mm512_clmulepi64_epi128(first, h[0], 0x01),
                    _mm512_clmulepi64_epi128(first, h[0], 0x10),
                );
                for k in 1..4 {
                    lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(x[k], h[k], 0x00));
                    hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(x[k], h[k], 0x11));
                    mid = _mm512_xor_si512(mid, _mm512_clmulepi64_epi128(x[k], h[k], 0x01));
                    mid = _mm512_xor_si512(mid, _mm512_clmulepi64_epi128(x[k], h[k], 0x10));
                }
                reduce(lanes_sum(lo), lanes_sum(mid), lanes_sum(hi))
            };
        }
        (from_m128(s), groups.remainder())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `a * b mod P`, bit by bit, from the definition.
    fn mul_reference(a: u128, b: u128) -> u128 {
        // P less x^128: x^127 + x^126 + x^121 + 1.
        const R: u128 = 0xc200_0000_0000_0000_0000_0000_0000_0001;
        let mut r = 0u128;
        for i in (0..128).rev() {
            let carry = r >> 127;
            r <<= 1;
            if carry == 1 {
                r ^= R;
            }
            if (b >> i) & 1 == 1 {
                r ^= a;
            }
        }
        r
    }

    /// `dot(a, b)` from the definition: the product divided by x 128 times.
    fn dot_reference(a: u128, b: u128) -> u128 {
        // (v + P) / x for odd v: x^127 + x^126 + x^125 + x^120 added to v >> 1.
        const HALF: u128 = 0xe1 << 120;
        let mut v = mul_reference(a, b);
        for _ in 0..128 {
            v = if v & 1 == 1 { (v >> 1) ^ HALF } else { v >> 1 };
        }
        v
    }

    fn hex16(s: &str) -> [u8; 16] {
        let mut out = [0u8; 16];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex");
        }
        out
    }

    /// Deterministic test bytes.
    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn rfc_8452_vector() {
        let h = hex16("25629347589242761d31f826ba4b757b");
        let mut message = hex16("4f4f95668c83dfb6401762bb2d01a262").to_vec();
        message.extend_from_slice(&hex16("d1a24ddd2721d006bbe45f20d3c9f362"));
        let expected = hex16("f7a3b47b846119fae5b7866cf5e5b77e");
        let key = PolyvalKey::new(h);
        assert_eq!(key.hash(&message), expected);
        let mut soft = key.clone();
        soft.force_portable();
        assert_eq!(soft.hash(&message), expected);
    }

    #[test]
    fn soft_dot_matches_the_definition() {
        let words = bytes(16 * 64, 7);
        for pair in words.chunks_exact(32) {
            let a = u128::from_le_bytes(pair[..16].try_into().expect("16"));
            let b = u128::from_le_bytes(pair[16..].try_into().expect("16"));
            assert_eq!(dot_soft(a, b), dot_reference(a, b), "{a:#x} {b:#x}");
        }
        assert_eq!(
            dot_soft(u128::MAX, u128::MAX),
            dot_reference(u128::MAX, u128::MAX)
        );
    }

    #[test]
    fn fast_path_and_pieces_match_the_portable_one() {
        let key = PolyvalKey::new(hex16("0123456789abcdeffedcba9876543210"));
        let mut soft = key.clone();
        soft.force_portable();
        let mut narrow = key.clone();
        narrow.force_narrow();
        eprintln!(
            "POLYVAL paths on this CPU: PCLMULQDQ {}, VPCLMULQDQ {}",
            key.clmul, key.wide
        );
        for len in [
            0, 1, 15, 16, 17, 127, 128, 129, 255, 256, 257, 383, 1000, 4096, 70_001,
        ] {
            let message = bytes(len, len as u64 + 3);
            let expected = soft.hash(&message);
            assert_eq!(key.hash(&message), expected, "length {len}");
            assert_eq!(
                narrow.hash(&message),
                expected,
                "length {len}, PCLMULQDQ path"
            );
            for piece in [1, 5, 16, 33, 128, 1000] {
                let mut streamed = Polyval::new(key.clone());
                for part in message.chunks(piece) {
                    streamed.update(part);
                }
                assert_eq!(
                    streamed.finish(),
                    expected,
                    "length {len} in pieces of {piece}"
                );
            }
        }
    }

    #[test]
    fn keys_and_bytes_change_the_value() {
        let a = PolyvalKey::new([1; 16]);
        let b = PolyvalKey::new([2; 16]);
        let message = bytes(5000, 9);
        assert_ne!(a.hash(&message), b.hash(&message));
        let mut flipped = message.clone();
        flipped[4321] ^= 0x40;
        assert_ne!(a.hash(&message), a.hash(&flipped));
        assert!(a.same_as(&a.clone()) && !a.same_as(&b));
    }
}
