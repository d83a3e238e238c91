//! Real models' KV sizes (`--model`) and the cost model behind "prefill saved": what a loaded
//! token would have cost to compute, and what loading it costs, both under stated assumptions.
//!
//! A preset's KV bytes per token are `2 (K and V) x layers x KV heads x head dim x dtype bytes`,
//! from the model's published configuration. Prefill compute is `2 x parameters` FLOPs per token
//! (the dense matmuls; attention's share is left out, so long prompts cost more than this says).

use serde::Serialize;

/// A model's shape, as far as its KV cache and its prefill cost go.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ModelPreset {
    /// The name `--model` takes.
    pub name: &'static str,
    /// Decoder layers.
    pub layers: u32,
    /// KV heads (grouped-query attention).
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Bytes per KV element (2 for bf16 and fp16).
    pub dtype_bytes: u32,
    /// Parameters, for the prefill cost (`2 x parameters` FLOPs per token).
    pub params: f64,
}

impl ModelPreset {
    /// KV bytes per token over all layers (K and V), before tensor-parallel sharding.
    pub const fn kv_bytes_per_token(&self) -> u32 {
        2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes
    }
}

/// The presets `--model` knows, from each model's `config.json` (bf16 KV cache).
pub const PRESETS: [ModelPreset; 6] = [
    ModelPreset {
        name: "llama-3.2-1b",
        layers: 16,
        kv_heads: 8,
        head_dim: 64,
        dtype_bytes: 2,
        params: 1.24e9,
    },
    ModelPreset {
        name: "llama-3-8b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        params: 8.03e9,
    },
    ModelPreset {
        name: "llama-3-70b",
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        params: 70.6e9,
    },
    ModelPreset {
        name: "qwen3-8b",
        layers: 36,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        params: 8.19e9,
    },
    ModelPreset {
        name: "qwen3-32b",
        layers: 64,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        params: 32.8e9,
    },
    ModelPreset {
        name: "mistral-7b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        params: 7.25e9,
    },
];

/// The preset named `name`; the error lists the known names.
pub fn preset(name: &str) -> Result<ModelPreset, String> {
    PRESETS
        .iter()
        .find(|m| m.name.eq_ignore_ascii_case(name))
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = PRESETS.iter().map(|m| m.name).collect();
            format!(
                "--model: unknown model {name:?}; known: {}",
                names.join(", ")
            )
        })
}

/// Effective prefill throughput assumed by default, FLOP/s: 400 TFLOP/s, about 40% of an
/// H100 SXM's dense bf16 peak (989 TFLOP/s).
pub const PREFILL_FLOPS_DEFAULT: f64 = 400e12;

/// Host-to-GPU bandwidth assumed by default for loads, bytes/s: 25 GB/s, a conservative PCIe
/// Gen5 x16 figure (`cargo xtask gpu` measures a real one).
pub const LOAD_BYTES_PER_S_DEFAULT: f64 = 25e9;

/// The model a run simulates: a preset, or a bare KV size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelChoice {
    /// `--model`.
    pub preset: Option<ModelPreset>,
    /// `--kv-bytes-per-token`: overrides the preset's KV size (what the simulator moves and
    /// what the load time is computed for).
    pub kv_bytes_per_token: Option<u32>,
    /// Effective prefill FLOP/s (`--prefill-tflops`).
    pub prefill_flops: f64,
    /// Host-to-GPU bytes per second (`--load-gb-per-s`).
    pub load_bytes_per_s: f64,
}

impl Default for ModelChoice {
    /// No model, no size: the caller's fallback size, with the default assumptions.
    fn default() -> Self {
        Self {
            preset: None,
            kv_bytes_per_token: None,
            prefill_flops: PREFILL_FLOPS_DEFAULT,
            load_bytes_per_s: LOAD_BYTES_PER_S_DEFAULT,
        }
    }
}

impl ModelChoice {
    /// A preset with the default assumptions.
    pub fn preset(preset: ModelPreset) -> Self {
        Self {
            preset: Some(preset),
            ..Self::default()
        }
    }

    /// The cost model, with `fallback` KV bytes per token when neither a preset nor a size was
    /// given. Errors name the flag.
    pub fn cost(&self, fallback: u32) -> Result<CostModel, String> {
        if !(self.prefill_flops.is_finite() && self.prefill_flops > 0.0) {
            return Err("--prefill-tflops: must be a positive number".into());
        }
        if !(self.load_bytes_per_s.is_finite() && self.load_bytes_per_s > 0.0) {
            return Err("--load-gb-per-s: must be a positive number".into());
        }
        let kv_bytes_per_token = self
            .kv_bytes_per_token
            .or(self.preset.map(|m| m.kv_bytes_per_token()))
            .unwrap_or(fallback);
        if kv_bytes_per_token == 0 {
            return Err("--kv-bytes-per-token: must be at least 1".into());
        }
        Ok(CostModel {
            model: self.preset,
            kv_bytes_per_token,
            prefill_flops: self.prefill_flops,
            load_bytes_per_s: self.load_bytes_per_s,
        })
    }
}

/// The stated assumptions that turn token counts into seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CostModel {
    /// The model, or `None` when only `--kv-bytes-per-token` was given (then no prefill cost
    /// is known and no time is reported).
    pub model: Option<ModelPreset>,
    /// KV bytes per token the run moved (all workers).
    pub kv_bytes_per_token: u32,
    /// Effective prefill FLOP/s.
    pub prefill_flops: f64,
    /// Host-to-GPU bytes per second of a load.
    pub load_bytes_per_s: f64,
}

impl CostModel {
    /// Microseconds of GPU compute one prefill token costs (`2 x params / prefill_flops`).
    pub fn prefill_us_per_token(&self) -> Option<f64> {
        self.model
            .map(|m| 2.0 * m.params / self.prefill_flops * 1e6)
    }

    /// Microseconds one token's KV takes to load into the GPU.
    pub fn load_us_per_token(&self) -> f64 {
        f64::from(self.kv_bytes_per_token) / self.load_bytes_per_s * 1e6
    }
}

/// What kvtier's loads saved, under a [`CostModel`].
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Savings {
    /// Tokens kvtier loaded into the GPU (each one a prefill token not computed).
    pub prefill_tokens_saved: u64,
    /// Their compute time under the cost model, seconds (`None` without a model).
    pub prefill_s_saved: Option<f64>,
    /// Their load time at the assumed host-to-GPU bandwidth, seconds.
    pub load_s: f64,
    /// Compute saved minus load time, per finished request, milliseconds: the mean
    /// time-to-first-token saved if each request's prefill ran alone at the assumed throughput.
    pub ttft_saved_ms_per_request: Option<f64>,
}

impl Savings {
    /// The savings of `tokens_loaded` tokens over `requests` finished requests.
    pub fn of(cost: &CostModel, tokens_loaded: u64, requests: u64) -> Self {
        let tokens = tokens_loaded as f64;
        let load_s = tokens * cost.load_us_per_token() / 1e6;
        let prefill_s_saved = cost.prefill_us_per_token().map(|us| tokens * us / 1e6);
        let ttft_saved_ms_per_request = prefill_s_saved
            .filter(|_| requests > 0)
            .map(|saved| (saved - load_s) * 1e3 / requests as f64);
        Self {
            prefill_tokens_saved: tokens_loaded,
            prefill_s_saved,
            load_s,
            ttft_saved_ms_per_request,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_sizes_match_the_published_shapes() {
        // 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes: 128 KiB per token.
        assert_eq!(preset("llama-3-8b").unwrap().kv_bytes_per_token(), 131_072);
        assert_eq!(preset("llama-3-70b").unwrap().kv_bytes_per_token(), 327_680);
        assert_eq!(preset("qwen3-32b").unwrap().kv_bytes_per_token(), 262_144);
        assert_eq!(preset("llama-3.2-1b").unwrap().kv_bytes_per_token(), 32_768);
        assert_eq!(preset("LLAMA-3-8B").unwrap().name, "llama-3-8b");
        let err = preset("gpt-5").unwrap_err();
        assert!(err.contains("gpt-5") && err.contains("qwen3-32b"), "{err}");
    }

    #[test]
    fn savings_follow_from_the_stated_assumptions() {
        let cost = CostModel {
            model: Some(preset("llama-3-8b").unwrap()),
            kv_bytes_per_token: 131_072,
            prefill_flops: 400e12,
            load_bytes_per_s: 25e9,
        };
        // 2 x 8.03e9 FLOPs at 400e12 FLOP/s: 40.15 us per token.
        let us = cost.prefill_us_per_token().unwrap();
        assert!((us - 40.15).abs() < 1e-9, "{us}");
        // 131072 bytes at 25e9 B/s: 5.24288 us per token.
        assert!((cost.load_us_per_token() - 5.24288).abs() < 1e-9);
        let s = Savings::of(&cost, 1_000_000, 10);
        assert_eq!(s.prefill_tokens_saved, 1_000_000);
        assert!((s.prefill_s_saved.unwrap() - 40.15).abs() < 1e-9);
        assert!((s.load_s - 5.24288).abs() < 1e-9);
        let ttft = s.ttft_saved_ms_per_request.unwrap();
        assert!((ttft - (40.15 - 5.24288) * 100.0).abs() < 1e-6, "{ttft}");

        let bare = CostModel {
            model: None,
            ..cost
        };
        let s = Savings::of(&bare, 1000, 1);
        assert_eq!(s.prefill_s_saved, None);
        assert_eq!(s.ttft_saved_ms_per_request, None);
    }
}
