//! [`NamespaceId`]: what must match for two stores of chunks to be interchangeable.

/// The identity of the KV layout whose chunks a namespace holds. Chunks of different models,
/// dtypes, chunk sizes or parallel layouts never share a namespace: tiers keep each namespace
/// apart (tier-fs in its own directory, tier-obj under its own object prefix), named by
/// [`NamespaceId::hash_with`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NamespaceId {
    /// The model's name (for example `"meta-llama/Llama-3.1-8B"`).
    pub model: String,
    /// The KV cache's element type (for example `"bfloat16"`).
    pub dtype: String,
    /// Tokens per chunk (engine block size times blocks per chunk).
    pub tokens_per_chunk: u32,
    /// The parallel layout (for example `"tp4-rank0"`, or `"tp1"`).
    pub parallel_layout: String,
}

impl NamespaceId {
    /// A stable hash (across builds and machines) of the namespace in a tier's `domain` (for
    /// example `"kvtier-fs"`) at its format `version`: xxh3-64 of
    /// `"{domain}/v{version}\0{model}\0{dtype}\0{tokens_per_chunk}\0{parallel_layout}"`.
    pub fn hash_with(&self, domain: &str, version: u32) -> u64 {
        let text = format!(
            "{domain}/v{version}\0{}\0{}\0{}\0{}",
            self.model, self.dtype, self.tokens_per_chunk, self.parallel_layout
        );
        crate::record::xxh3_64(text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable_and_separates_every_field_and_domain() {
        let ns = NamespaceId {
            model: "m".into(),
            dtype: "bf16".into(),
            tokens_per_chunk: 64,
            parallel_layout: "tp1".into(),
        };
        let h = ns.hash_with("kvtier-fs", 2);
        assert_eq!(
            h,
            crate::record::xxh3_64(b"kvtier-fs/v2\x00m\x00bf16\x0064\x00tp1")
        );
        assert_ne!(h, ns.hash_with("kvtier-obj", 2));
        assert_ne!(h, ns.hash_with("kvtier-fs", 3));
        let other = NamespaceId {
            tokens_per_chunk: 32,
            ..ns.clone()
        };
        assert_ne!(h, other.hash_with("kvtier-fs", 2));
    }
}
