//! `kvtier run`: the main job. A built-in workload (multi-turn conversations that share system
//! prompts and documents) runs on two simulated engine instances, each with a host pool, a disk
//! tier in a temporary directory and the other instance as its peer over loopback TCP; every
//! loaded block is compared with recompute. KV sizes are a real model's ([`DEFAULT_MODEL`]
//! unless `--model` or `--kv-bytes-per-token` says otherwise).

use std::net::TcpListener;
use std::path::{Path, PathBuf};

use connector::config::ConnectorConfig;
use engine_sim::rng::mix64;
use engine_sim::{RequestSpec, SharedPrefix, Workload};
use serde_json::Value;

use crate::instance::{self, EngineShape, InstanceSim, RunReport};
use crate::model::{self, ModelChoice, ModelPreset};

/// The model the main job simulates unless `--model` or `--kv-bytes-per-token` says otherwise.
pub const DEFAULT_MODEL: &str = "llama-3-8b";

/// Shape of the built-in workload (per instance).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunSpec {
    /// Conversations per instance.
    pub conversations: u32,
    /// Turns per conversation; turn `t`'s prompt is turn `t - 1`'s plus a new user message.
    pub turns: u32,
    /// System prompts shared by all conversations (512 tokens each).
    pub system_prompts: u32,
    /// Documents shared by two thirds of the conversations (1024 tokens each).
    pub documents: u32,
    /// Seed of every choice.
    pub seed: u64,
    /// The model: its KV size is what every chunk moves.
    pub model: ModelChoice,
}

/// The default model's preset.
pub fn default_model() -> ModelPreset {
    model::PRESETS
        .iter()
        .copied()
        .find(|m| m.name == DEFAULT_MODEL)
        .unwrap_or(model::PRESETS[0])
}

impl Default for RunSpec {
    /// 12 conversations of 4 turns per instance (96 requests on two instances), 4 system
    /// prompts, 6 documents, on the default model (whose 8 MiB chunks keep this to a few GiB of
    /// memory and well under a minute on two cores).
    fn default() -> Self {
        Self {
            conversations: 12,
            turns: 4,
            system_prompts: 4,
            documents: 6,
            seed: 1,
            model: ModelChoice::preset(default_model()),
        }
    }
}

const SYSTEM_TOKENS: u32 = 512;
const DOCUMENT_TOKENS: u32 = 1024;
const USER_TOKENS_MIN: u32 = 96;
const USER_TOKENS_JITTER: u64 = 64;
const OUTPUT_TOKENS: u32 = 8;
/// Steps between two conversations' starts on one instance.
const CONVERSATION_GAP_STEPS: u64 = 6;
/// Steps between two turns of a conversation (other traffic evicts it from the GPU meanwhile).
const TURN_GAP_STEPS: u64 = 120;
/// The second instance starts this much later, so the first one has stored the shared parts.
const SECOND_INSTANCE_DELAY_STEPS: u64 = 400;

/// The simulated engine of the main job, moving `kv_bytes_per_token` per token.
pub fn engine_shape(seed: u64, kv_bytes_per_token: u32) -> EngineShape {
    EngineShape {
        tokens_per_block: 16,
        kv_bytes_per_token,
        workers: 2,
        gpu_blocks: 320,
        max_num_batched_tokens: 2048,
        max_num_seqs: 16,
        async_scheduling: true,
        verify_requests: true,
        seed,
    }
}

/// The requests of instance `instance` (0 or 1). Conversation `c` has system prompt
/// `c % system_prompts` and, unless `c % 3 == 0`, document `c % documents`, on both instances
/// (so the second instance finds them at its peer); its user messages are its own (global
/// conversation `instance + 2 c`).
pub fn workload(spec: &RunSpec, instance: u32) -> Workload {
    let seg = |tag: u64, a: u64, b: u64, tokens: u32| SharedPrefix {
        id: mix64(spec.seed ^ mix64(tag ^ mix64(a ^ mix64(b)))),
        tokens,
    };
    let start = u64::from(instance) * SECOND_INSTANCE_DELAY_STEPS;
    let mut requests = Vec::new();
    for c in 0..u64::from(spec.conversations) {
        let g = u64::from(instance) + 2 * c;
        let mut segments = vec![seg(
            1,
            c % u64::from(spec.system_prompts.max(1)),
            0,
            SYSTEM_TOKENS,
        )];
        if c % 3 != 0 {
            segments.push(seg(
                2,
                c % u64::from(spec.documents.max(1)),
                0,
                DOCUMENT_TOKENS,
            ));
        }
        for t in 0..u64::from(spec.turns) {
            let user = USER_TOKENS_MIN
                + (mix64(spec.seed ^ g ^ (t << 32)) % (USER_TOKENS_JITTER + 1)) as u32;
            segments.push(seg(3, g, t, user));
            requests.push(RequestSpec {
                arrival_step: start + c * CONVERSATION_GAP_STEPS + t * TURN_GAP_STEPS,
                prefix: None,
                segments: segments.clone(),
                unique_tokens: 0,
                seed: mix64(g ^ (t << 40)),
                max_tokens: OUTPUT_TOKENS,
                abort_step: None,
                max_offload_tokens: None,
            });
        }
    }
    Workload { requests }
}

/// Host-pool chunks of the built-in configuration.
pub const HOST_CHUNKS: u64 = 128;
/// Disk-tier chunks of the built-in configuration (per instance).
pub const DISK_CHUNKS: u64 = 512;
/// Chunks each instance's peer tier keeps published for the other one.
pub const PUBLISHED_CHUNKS: u64 = 64;

/// The built-in connector configuration (TOML, the connector's format): a host pool of
/// [`HOST_CHUNKS`] chunks, a disk tier of [`DISK_CHUNKS`] under `fs_dir`, and a peer tier that
/// publishes [`PUBLISHED_CHUNKS`], whose ports [`config_for_instance`] fills.
pub fn default_config(fs_dir: &Path, chunk_bytes: u64) -> String {
    format!(
        "cpu_bytes_to_use = {}\nblock_size = 64\neviction_policy = \"lru\"\n\
         offload_prompt_only = false\nsecondary_tiers = [\n  \
         {{ type = \"fs\", root_dir = {:?}, capacity_bytes = {} }},\n  \
         {{ type = \"p2p\", published_bytes_max = {} }},\n]\n",
        HOST_CHUNKS * chunk_bytes,
        fs_dir.display().to_string(),
        DISK_CHUNKS * chunk_bytes,
        PUBLISHED_CHUNKS * chunk_bytes,
    )
}

/// A temporary directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new empty directory under the system's temporary directory.
    pub fn new(label: &str) -> Result<Self, String> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path =
            std::env::temp_dir().join(format!("kvtier-{label}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A loopback port that was free a moment ago.
fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("cannot bind loopback: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("cannot read loopback address: {e}"))
}

/// Instance `i`'s configuration from a user's file: each disk tier gets its own subdirectory
/// (`<root_dir>/instance-<i>`), and a peer tier without `listen` or `peers` gets the loopback
/// ports chosen here (the other instance as its peer).
pub fn config_for_instance(base: &ConnectorConfig, i: usize, ports: [u16; 2]) -> ConnectorConfig {
    let mut config = base.clone();
    // The entries are the file's tables; a value of the wrong type is left as written, for
    // `resolve` to name.
    for tier in &mut config.secondary_tiers {
        let settings = &mut tier.settings;
        match tier.type_name.as_str() {
            "fs" => {
                if let Some(Value::String(dir)) = settings.get_mut("root_dir") {
                    *dir = Path::new(dir.as_str())
                        .join(format!("instance-{i}"))
                        .display()
                        .to_string();
                }
            }
            "p2p" => {
                let listen = settings.get("listen").and_then(Value::as_str);
                let peers = settings.get("peers").and_then(Value::as_array);
                match (listen, peers.map(Vec::as_slice)) {
                    // One engine's view of a pair (it listens here, its peer there): instance
                    // 0 takes it as written, instance 1 its mirror image.
                    (Some(listen), Some([Value::String(peer)])) => {
                        if i == 1 {
                            let (listen, peer) = (listen.to_owned(), peer.clone());
                            settings.insert("listen".into(), Value::String(peer));
                            settings.insert("peers".into(), Value::from(vec![listen]));
                        }
                    }
                    _ => {
                        let peers_empty = match settings.get("peers") {
                            None => true,
                            Some(peers) => peers.as_array().is_some_and(Vec::is_empty),
                        };
                        if !settings.contains_key("listen") {
                            let own = format!("127.0.0.1:{}", ports[i]);
                            settings.insert("listen".into(), Value::String(own));
                        }
                        // A directory (DNS or etcd) finds the peers itself.
                        let directory = settings.contains_key("peers_dns")
                            || settings.contains_key("etcd_endpoints");
                        if peers_empty && !directory {
                            let other = format!("127.0.0.1:{}", ports[1 - i]);
                            settings.insert("peers".into(), Value::from(vec![other]));
                        }
                    }
                }
            }
            // Both instances share an object store: content-addressed objects, no lock.
            _ => {}
        }
    }
    config
}

/// Runs the main job: two instances, their configuration from `config_file` or the built-in one.
pub fn run(
    spec: &RunSpec,
    config_file: Option<&Path>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RunReport, String> {
    let started = std::time::Instant::now();
    let cost = spec.model.cost(default_model().kv_bytes_per_token())?;
    let shape = engine_shape(spec.seed, cost.kv_bytes_per_token);
    let dir = TempDir::new("run")?;
    let ports = [free_port()?, free_port()?];
    let chunk_bytes = 64 * u64::from(shape.kv_bytes_per_token);
    let base = match config_file {
        Some(path) => ConnectorConfig::from_path(path).map_err(|e| format!("--config: {e}"))?,
        None => ConnectorConfig::from_toml_str(&default_config(&dir.0, chunk_bytes))
            .map_err(|e| format!("built-in config: {e}"))?,
    };
    let mut sims: Vec<InstanceSim> = Vec::with_capacity(2);
    let mut both = Workload::default();
    for i in 0..2 {
        let config = config_for_instance(&base, i, ports);
        let w = workload(spec, i as u32);
        both.append(w.clone(), 0);
        let sim = instance::build(&config, &shape, w).map_err(|e| format!("instance {i}: {e}"))?;
        sims.push(sim);
    }
    let reports = instance::drive(&mut sims, 200_000, progress)?;
    let parts: Vec<_> = sims.iter().zip(&reports).collect();
    let mut report = instance::summarize(&parts, started.elapsed().as_secs_f64(), cost);
    // The instances are each other's peers, so a request may reuse what the other one computed:
    // the bound is the two workloads' reuse taken together (their steps run in lockstep).
    report.prompt_tokens_reusable =
        engine_sim::reuse::reusable_tokens(&both, shape.tokens_per_block)
            .iter()
            .map(|&n| u64::from(n))
            .sum();
    drop(sims);
    drop(dir);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversations_grow_turn_by_turn_and_share_system_prompts() {
        let spec = RunSpec {
            conversations: 6,
            turns: 3,
            ..RunSpec::default()
        };
        let (a, b) = (workload(&spec, 0), workload(&spec, 1));
        assert_eq!(a.requests.len(), 18);
        let p: Vec<Vec<u32>> = a.requests.iter().map(RequestSpec::prompt).collect();
        // Turn 1 of conversation 0 extends turn 0.
        assert_eq!(p[1][..p[0].len()], p[0][..]);
        assert!(p[1].len() > p[0].len());
        // Conversations 0 and 4 share system prompt 0, conversation 1 has prompt 1; the other
        // instance's conversation 0 has the same system prompt but its own user messages.
        assert_eq!(p[0][..512], a.requests[12].prompt()[..512]);
        assert_ne!(p[0][..512], p[3][..512]);
        let q = b.requests[0].prompt();
        assert_eq!(q[..512], p[0][..512]);
        assert_ne!(q[512..600], p[0][512..600]);
        // Arrivals: the second instance starts later.
        assert!(b.requests[0].arrival_step > a.requests[0].arrival_step);
    }

    #[test]
    fn user_config_gets_per_instance_dirs_and_ports() {
        let base = ConnectorConfig::from_toml_str(
            "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [\
             { type = \"fs\", root_dir = \"/x\", capacity_bytes = 1048576 }, { type = \"p2p\" }]\n",
        )
        .unwrap();
        let c = config_for_instance(&base, 1, [10, 20]);
        let (fs, p2p) = (
            &c.secondary_tiers[0].settings,
            &c.secondary_tiers[1].settings,
        );
        assert_eq!(fs["root_dir"], "/x/instance-1");
        assert_eq!(p2p["listen"], "127.0.0.1:20");
        assert_eq!(p2p["peers"], serde_json::json!(["127.0.0.1:10"]));
    }

    #[test]
    fn one_engines_view_of_a_pair_is_mirrored_for_the_second_instance() {
        let base = ConnectorConfig::from_toml_str(
            "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{ type = \"p2p\", \
             listen = \"127.0.0.1:7070\", peers = [\"127.0.0.1:7071\"] }]\n",
        )
        .unwrap();
        let p2p = |i| {
            let c = config_for_instance(&base, i, [10, 20]);
            let settings = &c.secondary_tiers[0].settings;
            let peers: Vec<String> = serde_json::from_value(settings["peers"].clone()).unwrap();
            (settings["listen"].as_str().unwrap().to_owned(), peers)
        };
        assert_eq!(
            p2p(0),
            ("127.0.0.1:7070".into(), vec!["127.0.0.1:7071".into()])
        );
        assert_eq!(
            p2p(1),
            ("127.0.0.1:7071".into(), vec!["127.0.0.1:7070".into()])
        );
    }

    /// The README's sample configuration parses and resolves as printed there.
    #[test]
    fn the_readme_sample_config_resolves_as_printed() {
        let readme = include_str!("../../../README.md");
        let start = readme
            .find("    cpu_bytes_to_use = 1073741824")
            .expect("the README's sample config");
        let end = start + readme[start..].find("\n    ]\n").expect("its end") + 7;
        let text: String = readme[start..end]
            .lines()
            .map(|l| l.strip_prefix("    ").unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n");
        let config = ConnectorConfig::from_toml_str(&text).expect("the sample parses");
        assert_eq!(config.secondary_tiers.len(), 2);
        for i in 0..2 {
            let engine = connector::config::EngineGeometry::new("m", 16, 1 << 20);
            config_for_instance(&config, i, [10, 20])
                .resolve(&engine)
                .unwrap_or_else(|e| panic!("instance {i}: {e}"));
        }
    }
}
