//! Configuration from a TOML or JSON file, with the reference's keys (`cpu_bytes_to_use`,
//! `block_size` or `blocks_per_chunk`, `eviction_policy`, `offload_prompt_only`,
//! `secondary_tiers`), checked against the engine's geometry ([`EngineGeometry`]) into a
//! [`ResolvedConfig`], from which [`ResolvedConfig::build_scheduler`] builds the scheduler
//! handle over the tiering manager and its tiers in one call ([`ResolvedConfig::build_manager`]
//! builds only the manager).
//!
//! A `secondary_tiers` entry names its tier type with `type`; the type's factory, found in a
//! [`TierRegistry`], checks the rest of the entry and starts the
//! tier. [`ConnectorConfig::resolve`] knows the built-in types (`fs`, [`FsTierSpec`]; `p2p`,
//! [`P2pTierSpec`]); [`ConnectorConfig::resolve_with`] takes a registry with the embedding
//! program's own types as well.
//!
//! Unknown keys are refused (by serde, naming the key); contradictory keys and impossible sizes
//! are refused by [`ConnectorConfig::resolve`] with a [`ConfigError`] that names the key.
//!
//! ```
//! use connector::config::{ConnectorConfig, EngineGeometry};
//!
//! let config = ConnectorConfig::from_toml_str(r#"
//!     cpu_bytes_to_use = 1073741824
//!     block_size = 64
//!     eviction_policy = "arc"
//!     offload_prompt_only = false
//!     secondary_tiers = [{ type = "fs", root_dir = "/tmp/kv", capacity_bytes = 4294967296 }]
//! "#).unwrap();
//! let engine = EngineGeometry::new("my-model", 16, 1 << 16);
//! let resolved = config.resolve(&engine).unwrap();
//! assert_eq!(resolved.scheduler.blocks_per_chunk, 4);
//! assert_eq!(resolved.pool.slot_count, 4096);
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use offload_core::pool::SLOT_COUNT_MAX;
use offload_core::tier::Tier;
use offload_core::{
    EvictionPolicy, HostPool, OffloadPolicy, PoolConfig, SchedulerConfig, SlotMemory,
};
use serde::Deserialize;

use crate::clock::{Clock, MonotonicClock};
use crate::handle::SchedulerHandle;
use crate::registry::{TierEntry, TierFactory, TierRegistry, TierSettings};
use crate::tiering::{TieringManager, TieringOptions, TIERS_MAX};

/// A configuration problem, naming the key (or the file) that was wrong.
///
/// Non-exhaustive: new checks may need new variants.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The text is not valid TOML or JSON for this schema (an unknown key, a wrong type, a
    /// missing key); the message names the key and, for TOML, its line.
    #[error("invalid {format} config: {message}")]
    Parse {
        /// `"TOML"` or `"JSON"`.
        format: &'static str,
        /// The parser's message.
        message: String,
    },
    /// A value is out of range or contradicts another.
    #[error("invalid config `{key}`: {reason}")]
    Invalid {
        /// The key (with its position for tier entries, like `secondary_tiers[1].root_dir`).
        key: String,
        /// Why.
        reason: String,
    },
    /// A tier could not be started.
    #[error("cannot start `{key}`: {reason}")]
    Tier {
        /// The tier's entry, like `secondary_tiers[0]`.
        key: String,
        /// Why.
        reason: String,
    },
    /// A tier entry's `type` is not registered.
    #[error("invalid config `{key}`: unknown tier type {type_name:?}; registered: {registered}")]
    UnknownTierType {
        /// The entry's `type` key, like `secondary_tiers[0].type`.
        key: String,
        /// The type it named.
        type_name: String,
        /// The registered types, comma-separated.
        registered: String,
    },
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// Which eviction policy the host pool uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvictionName {
    /// Least recently used.
    #[default]
    Lru,
    /// Adaptive replacement cache.
    Arc,
}

/// When a request's chunks are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadPolicyName {
    /// Each chunk as soon as its KV is written.
    #[default]
    Block,
    /// All chunks when the request finishes.
    Request,
}

/// A disk tier entry (`type = "fs"`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsTierSpec {
    /// The directory the tier keeps its files under.
    pub root_dir: PathBuf,
    /// Most bytes of chunk files it keeps.
    pub capacity_bytes: u64,
    /// fsync each stored chunk (default false).
    #[serde(default)]
    pub fsync: bool,
    /// Use O_DIRECT where the file system takes it (default true).
    #[serde(default = "yes")]
    pub direct_io: bool,
    /// Other instances write the same directory (default false).
    #[serde(default)]
    pub shared_dir: bool,
    /// Worker threads (default 4).
    #[serde(default)]
    pub workers: Option<usize>,
    /// `"auto"` (default), `"uring"` or `"sync"`.
    #[serde(default)]
    pub engine: Option<String>,
}

/// A peer tier entry (`type = "p2p"`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct P2pTierSpec {
    /// Where to serve published chunks (default `127.0.0.1:0`).
    #[serde(default)]
    pub listen: Option<String>,
    /// The peers, as `host:port` (an IP literal, `[v6]:port`, or a DNS name resolved at every
    /// connect). This instance's own address may be listed.
    #[serde(default)]
    pub peers: Vec<String>,
    /// Instead of `peers`: a `name:port` whose every address is a peer, re-resolved every
    /// `dns_refresh_ms` (default 5000).
    #[serde(default)]
    pub peers_dns: Option<String>,
    /// How often `peers_dns` is resolved again, in milliseconds.
    #[serde(default)]
    pub dns_refresh_ms: Option<u64>,
    /// Instead of `peers` and `peers_dns`: etcd client URLs (`http://host:2379`); the members
    /// are those registered under `etcd_prefix`, this instance included (as `advertise`, else
    /// `listen`, which then needs a fixed port). Needs the connector's `etcd` feature.
    #[serde(default)]
    pub etcd_endpoints: Vec<String>,
    /// The etcd key prefix of this group's members (default `/kvtier/p2p/members/`).
    #[serde(default)]
    pub etcd_prefix: Option<String>,
    /// The registration's lease time to live in milliseconds (default 10000, at least 1000).
    #[serde(default)]
    pub etcd_lease_ttl_ms: Option<u64>,
    /// How peers name this instance, as `host:port`, when that is not `listen`.
    #[serde(default)]
    pub advertise: Option<String>,
    /// How many peers own each key (1 to 3, default 2): lookups ask only a key's owners.
    #[serde(default)]
    pub owners: Option<usize>,
    /// A file holding the shared secret (at least 16 bytes); required beyond loopback.
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// Bytes of published chunks kept to serve (default 256 MiB).
    #[serde(default)]
    pub published_bytes_max: Option<usize>,
    /// How long a lookup may answer "retry" (default 500 ms).
    #[serde(default)]
    pub lookup_deadline_ms: Option<u64>,
    /// Deadline of one fetch (default 5000 ms).
    #[serde(default)]
    pub fetch_deadline_ms: Option<u64>,
}

/// An object-store tier entry (`type = "obj"`). Credentials are not part of the file: S3, GCS
/// and Azure read them (and anything left unset here) from their usual environment variables
/// (`AWS_*`, `GOOGLE_*`, `AZURE_*`; Azure's account name too).
///
/// There is no capacity key: the object tier does not evict (a bucket's own lifecycle rules
/// bound its size).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjTierSpec {
    /// Where the objects live: `s3://bucket`, `gs://bucket` (Google Cloud Storage),
    /// `az://container` (Azure Blob Storage), `file:///absolute/dir` (object_store's local
    /// file-system backend) or `memory:` (this process only; for tests).
    pub url: String,
    /// The key prefix under which this tier's namespaces live (default: none).
    #[serde(default)]
    pub prefix: String,
    /// For S3-compatible servers (MinIO, ...) and Azure emulators or private endpoints (Azurite:
    /// `http://127.0.0.1:10000/devstoreaccount1`): their endpoint URL. `s3://` and `az://` only.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The S3 region (default: `AWS_REGION`, else `us-east-1`).
    #[serde(default)]
    pub region: Option<String>,
    /// Allow a plain `http://` endpoint (default false: HTTPS only). `s3://` and `az://` only.
    #[serde(default)]
    pub allow_http: bool,
    /// Object requests in flight at once (default 16).
    #[serde(default)]
    pub requests_in_flight_max: Option<usize>,
    /// Jobs accepted at once (default 64).
    #[serde(default)]
    pub jobs_in_flight_max: Option<usize>,
    /// Deadline of one object request, in milliseconds (default 30000).
    #[serde(default)]
    pub request_deadline_ms: Option<u64>,
    /// Deadline of the start-up listing, in milliseconds (default 60000).
    #[serde(default)]
    pub list_deadline_ms: Option<u64>,
    /// How long a drain waits for the tier's jobs, in milliseconds (default 30000); past it the
    /// jobs stay in flight and are reported when they complete.
    #[serde(default)]
    pub drain_deadline_ms: Option<u64>,
    /// Records larger than this go up in parts (default 8 MiB).
    #[serde(default)]
    pub multipart_threshold_bytes: Option<usize>,
    /// Bytes per part (default 8 MiB; S3 needs at least 5 MiB).
    #[serde(default)]
    pub part_bytes: Option<usize>,
}

/// Where an [`ObjTierSpec`]'s `url` points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ObjLocation {
    /// `s3://bucket`.
    S3 {
        /// The bucket.
        bucket: String,
    },
    /// `gs://bucket`.
    Gcs {
        /// The bucket.
        bucket: String,
    },
    /// `az://container`.
    Azure {
        /// The container.
        container: String,
    },
    /// `file:///dir`.
    Local {
        /// The directory.
        root: PathBuf,
    },
    /// `memory:`.
    Memory,
}

impl ObjTierSpec {
    /// Parses `url`; the error says what is wrong with it.
    pub fn location(&self) -> Result<ObjLocation, String> {
        let url = self.url.as_str();
        if url == "memory:" || url == "memory://" {
            return Ok(ObjLocation::Memory);
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let bucket = rest.strip_suffix('/').unwrap_or(rest);
            let ok = (3..=63).contains(&bucket.len())
                && bucket
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b));
            if !ok {
                return Err(format!(
                    "{url:?}: the bucket must be 3-63 lower-case letters, digits, '-' or '.', \
                     with nothing after it"
                ));
            }
            return Ok(ObjLocation::S3 {
                bucket: bucket.to_owned(),
            });
        }
        if let Some(rest) = url.strip_prefix("gs://") {
            let bucket = rest.strip_suffix('/').unwrap_or(rest);
            let edge_ok =
                |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
            let ok = (3..=63).contains(&bucket.len())
                && bucket
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b))
                && edge_ok(bucket.bytes().next())
                && edge_ok(bucket.bytes().last());
            if !ok {
                return Err(format!(
                    "{url:?}: the GCS bucket must be 3-63 lower-case letters, digits, '-', '_' or \
                     '.', beginning and ending with a letter or digit, with nothing after it"
                ));
            }
            return Ok(ObjLocation::Gcs {
                bucket: bucket.to_owned(),
            });
        }
        if let Some(rest) = url.strip_prefix("az://") {
            let container = rest.strip_suffix('/').unwrap_or(rest);
            let ok = (3..=63).contains(&container.len())
                && container
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !container.starts_with('-')
                && !container.ends_with('-')
                && !container.contains("--");
            if !ok {
                return Err(format!(
                    "{url:?}: the Azure container must be 3-63 lower-case letters, digits or \
                     single '-' between them, with nothing after it (the account comes from \
                     AZURE_STORAGE_ACCOUNT_NAME)"
                ));
            }
            return Ok(ObjLocation::Azure {
                container: container.to_owned(),
            });
        }
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') || path.len() < 2 {
                return Err(format!(
                    "{url:?}: a file URL needs an absolute directory (file:///dir)"
                ));
            }
            return Ok(ObjLocation::Local {
                root: PathBuf::from(path),
            });
        }
        Err(format!(
            "{url:?}: expected s3://bucket, gs://bucket, az://container, file:///dir or memory:"
        ))
    }
}

/// A built-in `secondary_tiers` entry, typed (the registry hands every entry to its factory as a
/// [`TierEntry`]; the built-in factory reads it as a `TierSpec`).
///
/// Non-exhaustive: a new built-in tier type adds a variant, so code outside this crate that
/// matches it keeps a `_` arm:
///
/// ```
/// use connector::config::TierSpec;
///
/// fn kind(spec: &TierSpec) -> &'static str {
///     match spec {
///         TierSpec::Fs(_) => "disk",
///         TierSpec::P2p(_) => "peers",
///         TierSpec::Obj(_) => "object store",
///         _ => "another built-in tier",
///     }
/// }
/// # let _ = kind;
/// ```
///
/// ```compile_fail
/// // Without the `_` arm it does not compile outside connector:
/// fn kind(spec: &connector::config::TierSpec) -> &'static str {
///     match spec {
///         connector::config::TierSpec::Fs(_) => "disk",
///         connector::config::TierSpec::P2p(_) => "peers",
///         connector::config::TierSpec::Obj(_) => "object store",
///     }
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(tag = "type")]
#[non_exhaustive]
pub enum TierSpec {
    /// The disk tier.
    #[serde(rename = "fs")]
    Fs(FsTierSpec),
    /// The peer tier.
    #[serde(rename = "p2p")]
    P2p(P2pTierSpec),
    /// The object-store tier.
    #[serde(rename = "obj")]
    Obj(ObjTierSpec),
}

fn yes() -> bool {
    true
}

/// The tier types [`TierRegistry::new`] registers: one [`TierSpec`] variant each.
pub(crate) const BUILTIN_TIER_TYPES: [&str; 3] = ["fs", "obj", "p2p"];

/// The factory of the built-in tier types: the entry read as a [`TierSpec`] (its `type` put
/// back), checked by `check_tier` and started by `ResolvedConfig::start_tier`.
pub(crate) struct BuiltinTier;

impl BuiltinTier {
    fn spec(settings: &TierSettings) -> Result<TierSpec, ConfigError> {
        let mut table = settings.entry.settings.clone();
        table.insert(
            "type".to_owned(),
            serde_json::Value::String(settings.entry.type_name.clone()),
        );
        serde_json::from_value(serde_json::Value::Object(table))
            .map_err(|e| invalid(settings.key(), e.to_string()))
    }
}

impl TierFactory for BuiltinTier {
    fn check(&self, settings: &TierSettings, config: &ResolvedConfig) -> Result<(), ConfigError> {
        check_tier(
            settings.index,
            &Self::spec(settings)?,
            u64::from(config.slot_bytes),
        )
    }

    fn start(
        &self,
        settings: &TierSettings,
        config: &ResolvedConfig,
        memory: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError> {
        config.start_tier(settings.index, &Self::spec(settings)?, memory)
    }
}

/// The file's contents, as parsed (not yet checked against the engine).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectorConfig {
    /// Bytes of host memory for the host pool (rounded down to whole slots).
    pub cpu_bytes_to_use: u64,
    /// Tokens per chunk (a multiple of the engine's block size). Exclusive with
    /// `blocks_per_chunk`.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Engine blocks per chunk. Exclusive with `block_size`.
    #[serde(default)]
    pub blocks_per_chunk: Option<u32>,
    /// `"lru"` (default) or `"arc"`.
    #[serde(default)]
    pub eviction_policy: EvictionName,
    /// Offload only the prompt's KV (default true, as in vLLM's offloading connector: a decode's
    /// KV is rarely a later request's prefix; set false to offload it too).
    #[serde(default = "yes")]
    pub offload_prompt_only: bool,
    /// `"block"` (default) or `"request"`.
    #[serde(default)]
    pub offload_policy: OffloadPolicyName,
    /// Store a chunk only once it was looked up this many times (default 0: always).
    #[serde(default)]
    pub reuse_threshold: u32,
    /// A promotion in flight longer than this is cancelled (default 10000 ms).
    #[serde(default)]
    pub promotion_deadline_ms: Option<u64>,
    /// A cascade (host pool to a secondary tier) queued behind a busy tier longer than this is
    /// dropped and its host pins released; one in flight longer is cancelled (default 30000 ms).
    #[serde(default)]
    pub cascade_deadline_ms: Option<u64>,
    /// How long a reset (and a drain at shutdown) waits for the secondary tiers' jobs before it
    /// cancels them; the host slots of jobs still in flight then stay out of use until their
    /// tier reports them (default 5000 ms).
    #[serde(default)]
    pub reset_drain_deadline_ms: Option<u64>,
    /// Secondary tiers, tried in this order on a host-pool miss; each entry's `type` names a
    /// registered tier type ([`TierRegistry`]).
    #[serde(default)]
    pub secondary_tiers: Vec<TierEntry>,
}

/// What the engine knows and the file does not: its model, KV geometry and parallel layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineGeometry {
    /// The model's name (keeps different models' chunks apart on disk and between peers).
    pub model: String,
    /// The KV element type (for example `"bfloat16"`).
    pub dtype: String,
    /// Tokens per engine block.
    pub tokens_per_block: u32,
    /// Bytes of one engine block in the host pool (every layer, every worker's shard).
    pub block_bytes: u64,
    /// Workers (tensor-parallel ranks) that acknowledge every job.
    pub worker_count: u32,
    /// The parallel layout (for example `"tp4"`).
    pub parallel_layout: String,
    /// Seed of the engine's prefix hash (peers must share it).
    pub hash_seed: u64,
}

impl EngineGeometry {
    /// One worker, `bfloat16`, layout `"tp1"`, hash seed 0.
    pub fn new(model: &str, tokens_per_block: u32, block_bytes: u64) -> Self {
        Self {
            model: model.to_owned(),
            dtype: "bfloat16".to_owned(),
            tokens_per_block,
            block_bytes,
            worker_count: 1,
            parallel_layout: "tp1".to_owned(),
            hash_seed: 0,
        }
    }
}

/// A checked configuration: everything needed to build the scheduler, the host pool and the
/// tiers.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedConfig {
    /// The scheduler's settings.
    pub scheduler: SchedulerConfig,
    /// The host pool's settings.
    pub pool: PoolConfig,
    /// Bytes per host slot (one chunk).
    pub slot_bytes: u32,
    /// The promotion deadline in nanoseconds.
    pub promotion_deadline_ns: u64,
    /// The cascade deadline in nanoseconds.
    pub cascade_deadline_ns: u64,
    /// The reset (and drain) deadline in nanoseconds.
    pub reset_drain_deadline_ns: u64,
    /// The secondary tiers, checked, in order.
    pub tiers: Vec<ResolvedTier>,
    /// The engine's geometry.
    pub engine: EngineGeometry,
}

/// A checked `secondary_tiers` entry and the factory of its type, which starts it.
#[derive(Clone)]
pub struct ResolvedTier {
    /// The entry.
    pub settings: TierSettings,
    factory: Arc<dyn TierFactory>,
}

impl ResolvedTier {
    /// The entry's `type`.
    pub fn type_name(&self) -> &str {
        self.settings.type_name()
    }

    /// The entry read as a built-in tier's typed settings; `None` for a type registered by the
    /// embedding program (or an entry that does not read as its built-in type).
    pub fn builtin(&self) -> Option<TierSpec> {
        if !BUILTIN_TIER_TYPES.contains(&self.type_name()) {
            return None;
        }
        BuiltinTier::spec(&self.settings).ok()
    }
}

impl std::fmt::Debug for ResolvedTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.settings.fmt(f)
    }
}

/// Equal entries (the factories are not compared).
impl PartialEq for ResolvedTier {
    fn eq(&self, other: &Self) -> bool {
        self.settings == other.settings
    }
}

impl ConnectorConfig {
    /// Parses TOML.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            format: "TOML",
            message: e.to_string(),
        })
    }

    /// Parses JSON.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        serde_json::from_str(text).map_err(|e| ConfigError::Parse {
            format: "JSON",
            message: e.to_string(),
        })
    }

    /// Reads a `.toml` or `.json` file (by its extension).
    pub fn from_path(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        match path.extension().and_then(|e| e.to_str()) {
            Some("toml") => Self::from_toml_str(&text),
            Some("json") => Self::from_json_str(&text),
            _ => Err(invalid(
                path.display().to_string(),
                "the config file must end in .toml or .json",
            )),
        }
    }

    /// Checks the configuration against the engine, with the built-in tier types only
    /// ([`TierRegistry::new`]); the error names the first wrong key.
    pub fn resolve(&self, engine: &EngineGeometry) -> Result<ResolvedConfig, ConfigError> {
        self.resolve_with(engine, &TierRegistry::new())
    }

    /// Checks the configuration against the engine, each `secondary_tiers` entry by the factory
    /// `registry` holds for its `type` (an unregistered type is
    /// [`ConfigError::UnknownTierType`], which lists the registered ones); the error names the
    /// first wrong key.
    pub fn resolve_with(
        &self,
        engine: &EngineGeometry,
        registry: &TierRegistry,
    ) -> Result<ResolvedConfig, ConfigError> {
        let tpb = engine.tokens_per_block;
        if tpb == 0 {
            return Err(invalid("tokens_per_block", "the engine's block size is 0"));
        }
        let blocks_per_chunk = match (self.block_size, self.blocks_per_chunk) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "block_size",
                    "give `block_size` (tokens per chunk) or `blocks_per_chunk`, not both",
                ))
            }
            (None, None) => {
                return Err(invalid(
                    "block_size",
                    "one of `block_size` (tokens per chunk) or `blocks_per_chunk` is required",
                ))
            }
            (Some(tokens), None) => {
                if tokens == 0 || tokens % tpb != 0 {
                    return Err(invalid(
                        "block_size",
                        format!(
                            "{tokens} tokens is not a positive multiple of the engine's block \
                             size ({tpb} tokens)"
                        ),
                    ));
                }
                tokens / tpb
            }
            (None, Some(0)) => return Err(invalid("blocks_per_chunk", "must be at least 1")),
            (None, Some(n)) => n,
        };
        let slot_bytes = u64::from(blocks_per_chunk)
            .checked_mul(engine.block_bytes)
            .filter(|&b| b > 0 && b <= u64::from(u32::MAX))
            .ok_or_else(|| {
                invalid(
                    if self.block_size.is_some() {
                        "block_size"
                    } else {
                        "blocks_per_chunk"
                    },
                    format!(
                        "a chunk of {blocks_per_chunk} blocks of {} bytes must be between 1 byte \
                         and 4 GiB",
                        engine.block_bytes
                    ),
                )
            })?;
        let slot_count = self.cpu_bytes_to_use / slot_bytes;
        if slot_count == 0 {
            return Err(invalid(
                "cpu_bytes_to_use",
                format!(
                    "{} bytes is less than one chunk ({slot_bytes} bytes)",
                    self.cpu_bytes_to_use
                ),
            ));
        }
        if slot_count > u64::from(SLOT_COUNT_MAX) {
            return Err(invalid(
                "cpu_bytes_to_use",
                format!("{slot_count} chunks, more than the pool's {SLOT_COUNT_MAX}"),
            ));
        }
        if self.reuse_threshold > offload_core::pool::REUSE_THRESHOLD_MAX {
            return Err(invalid(
                "reuse_threshold",
                format!("at most {}", offload_core::pool::REUSE_THRESHOLD_MAX),
            ));
        }
        let promotion_deadline_ns =
            deadline_ns("promotion_deadline_ms", self.promotion_deadline_ms, 10_000)?;
        let cascade_deadline_ns =
            deadline_ns("cascade_deadline_ms", self.cascade_deadline_ms, 30_000)?;
        let reset_drain_deadline_ns = deadline_ns(
            "reset_drain_deadline_ms",
            self.reset_drain_deadline_ms,
            5_000,
        )?;
        if self.secondary_tiers.len() > TIERS_MAX {
            return Err(invalid(
                "secondary_tiers",
                format!("{} tiers, at most {TIERS_MAX}", self.secondary_tiers.len()),
            ));
        }
        let scheduler = SchedulerConfig {
            tokens_per_block: tpb,
            blocks_per_chunk,
            offload_prompt_only: self.offload_prompt_only,
            policy: match self.offload_policy {
                OffloadPolicyName::Block => OffloadPolicy::Block,
                OffloadPolicyName::Request => OffloadPolicy::Request,
            },
            worker_count: engine.worker_count,
            ..SchedulerConfig::default()
        };
        if engine.worker_count == 0 || engine.worker_count > 64 {
            return Err(invalid(
                "worker_count",
                "the engine must have 1 to 64 workers",
            ));
        }
        let pool = PoolConfig {
            slot_count: slot_count as u32,
            policy: match self.eviction_policy {
                EvictionName::Lru => EvictionPolicy::Lru,
                EvictionName::Arc => EvictionPolicy::Arc,
            },
            reuse_threshold: self.reuse_threshold,
            events: true,
        };
        let mut resolved = ResolvedConfig {
            scheduler,
            pool,
            slot_bytes: slot_bytes as u32,
            promotion_deadline_ns,
            cascade_deadline_ns,
            reset_drain_deadline_ns,
            tiers: Vec::with_capacity(self.secondary_tiers.len()),
            engine: engine.clone(),
        };
        for (index, entry) in self.secondary_tiers.iter().enumerate() {
            let settings = TierSettings {
                index,
                entry: entry.clone(),
            };
            let factory = registry.factory(&settings)?;
            factory.check(&settings, &resolved)?;
            resolved.tiers.push(ResolvedTier { settings, factory });
        }
        Ok(resolved)
    }
}

/// Most milliseconds a deadline key takes (one day): a larger one is a mistake, not a wait.
pub const DEADLINE_MS_MAX: u64 = 86_400_000;

/// A deadline key's value (`default_ms` when absent) in nanoseconds; 0 or more than
/// [`DEADLINE_MS_MAX`] is an error naming `key`.
fn deadline_ns(key: &str, value: Option<u64>, default_ms: u64) -> Result<u64, ConfigError> {
    let ms = value.unwrap_or(default_ms);
    if ms == 0 {
        return Err(invalid(key, "must be at least 1"));
    }
    if ms > DEADLINE_MS_MAX {
        return Err(invalid(
            key,
            format!("{ms} ms is more than a day ({DEADLINE_MS_MAX} ms)"),
        ));
    }
    Ok(ms * 1_000_000)
}

fn check_tier(i: usize, tier: &TierSpec, slot_bytes: u64) -> Result<(), ConfigError> {
    let key = |field: &str| format!("secondary_tiers[{i}].{field}");
    match tier {
        TierSpec::Fs(fs) => {
            if fs.root_dir.as_os_str().is_empty() {
                return Err(invalid(key("root_dir"), "must not be empty"));
            }
            if fs.capacity_bytes < slot_bytes {
                return Err(invalid(
                    key("capacity_bytes"),
                    format!(
                        "{} bytes is less than one chunk ({slot_bytes} bytes)",
                        fs.capacity_bytes
                    ),
                ));
            }
            if fs.workers == Some(0) {
                return Err(invalid(key("workers"), "must be at least 1"));
            }
            if let Some(engine) = &fs.engine {
                if !matches!(engine.as_str(), "auto" | "uring" | "sync") {
                    return Err(invalid(
                        key("engine"),
                        format!("{engine:?}; expected \"auto\", \"uring\" or \"sync\""),
                    ));
                }
            }
        }
        TierSpec::P2p(p2p) => {
            if let Some(listen) = &p2p.listen {
                listen.parse::<SocketAddr>().map_err(|e| {
                    invalid(key("listen"), format!("{listen:?} is not host:port ({e})"))
                })?;
            }
            for (j, peer) in p2p.peers.iter().enumerate() {
                host_port(peer).map_err(|e| invalid(key(&format!("peers[{j}]")), e))?;
            }
            for (field, value) in [("peers_dns", &p2p.peers_dns), ("advertise", &p2p.advertise)] {
                if let Some(value) = value {
                    host_port(value).map_err(|e| invalid(key(field), e))?;
                }
            }
            if p2p.peers_dns.is_some() && !p2p.peers.is_empty() {
                return Err(invalid(
                    key("peers_dns"),
                    "set together with `peers`; pick one",
                ));
            }
            if !p2p.etcd_endpoints.is_empty() && (p2p.peers_dns.is_some() || !p2p.peers.is_empty())
            {
                return Err(invalid(
                    key("etcd_endpoints"),
                    "set together with `peers` or `peers_dns`; pick one",
                ));
            }
            for (j, url) in p2p.etcd_endpoints.iter().enumerate() {
                let rest = url
                    .strip_prefix("http://")
                    .or_else(|| url.strip_prefix("https://"));
                if rest.is_none_or(|r| host_port(r.trim_end_matches('/')).is_err()) {
                    return Err(invalid(
                        key(&format!("etcd_endpoints[{j}]")),
                        format!("{url:?} is not http://host:port or https://host:port"),
                    ));
                }
            }
            if p2p.etcd_prefix.as_deref() == Some("") {
                return Err(invalid(key("etcd_prefix"), "must not be empty"));
            }
            if p2p.etcd_lease_ttl_ms.is_some_and(|ms| ms < 1000) {
                return Err(invalid(key("etcd_lease_ttl_ms"), "must be at least 1000"));
            }
            if let Some(owners) = p2p.owners.filter(|o| !(1..=3).contains(o)) {
                return Err(invalid(key("owners"), format!("{owners} outside 1..=3")));
            }
            for (field, v) in [
                ("lookup_deadline_ms", p2p.lookup_deadline_ms),
                ("fetch_deadline_ms", p2p.fetch_deadline_ms),
                ("dns_refresh_ms", p2p.dns_refresh_ms),
            ] {
                if v == Some(0) {
                    return Err(invalid(key(field), "must be at least 1"));
                }
            }
            if p2p
                .published_bytes_max
                .is_some_and(|b| (b as u64) < slot_bytes)
            {
                return Err(invalid(
                    key("published_bytes_max"),
                    format!("less than one chunk ({slot_bytes} bytes)"),
                ));
            }
        }
        TierSpec::Obj(obj) => check_obj(&key, obj)?,
    }
    Ok(())
}

fn check_obj(key: &dyn Fn(&str) -> String, obj: &ObjTierSpec) -> Result<(), ConfigError> {
    let location = obj.location().map_err(|e| invalid(key("url"), e))?;
    let s3 = matches!(location, ObjLocation::S3 { .. });
    let azure = matches!(location, ObjLocation::Azure { .. });
    if !s3 && obj.region.is_some() {
        return Err(invalid(key("region"), "applies only to an s3:// url"));
    }
    if !s3 && !azure {
        for (field, set) in [
            ("endpoint", obj.endpoint.is_some()),
            ("allow_http", obj.allow_http),
        ] {
            if set {
                return Err(invalid(key(field), "applies only to an s3:// or az:// url"));
            }
        }
    }
    if let Some(endpoint) = &obj.endpoint {
        let http = endpoint.starts_with("http://");
        if !http && !endpoint.starts_with("https://") {
            return Err(invalid(
                key("endpoint"),
                format!("{endpoint:?} is not an http:// or https:// URL"),
            ));
        }
        if http && !obj.allow_http {
            return Err(invalid(
                key("endpoint"),
                format!("{endpoint:?} is plain HTTP; set allow_http = true to use it"),
            ));
        }
    }
    if obj.prefix.starts_with('/') || obj.prefix.split('/').any(|p| p == "..") {
        return Err(invalid(
            key("prefix"),
            format!("{:?} must be relative, without '..'", obj.prefix),
        ));
    }
    for (field, v) in [
        ("requests_in_flight_max", obj.requests_in_flight_max),
        ("jobs_in_flight_max", obj.jobs_in_flight_max),
        ("part_bytes", obj.part_bytes),
    ] {
        if v == Some(0) {
            return Err(invalid(key(field), "must be at least 1"));
        }
    }
    for (field, v) in [
        ("request_deadline_ms", obj.request_deadline_ms),
        ("list_deadline_ms", obj.list_deadline_ms),
        ("drain_deadline_ms", obj.drain_deadline_ms),
    ] {
        if let Some(ms) = v {
            // The same range as the top-level deadline keys (`deadline_ns`).
            deadline_ns(&key(field), Some(ms), 1)?;
        }
    }
    Ok(())
}

impl ResolvedConfig {
    /// Builds everything the engine's scheduler side needs in one call: starts every secondary
    /// tier over the host pool's bytes `memory` (which must have `pool.slot_count` slots of
    /// `slot_bytes`), builds the tiering manager and the [`SchedulerHandle`] over it. `strict`
    /// is the one strictness of all three (scheduler, host pool, tiering manager): `true` panics
    /// on a broken bookkeeping invariant (tests, simulators), `false` counts it and drops the
    /// request's offload (production; see `offload_core::invariant`).
    pub fn build_scheduler(
        &self,
        memory: Arc<dyn SlotMemory>,
        strict: bool,
    ) -> Result<SchedulerHandle, ConfigError> {
        self.build_scheduler_with_clock(memory, strict, Arc::new(MonotonicClock::new()))
    }

    /// Like [`ResolvedConfig::build_scheduler`], with the manager's time read from `clock`.
    pub fn build_scheduler_with_clock(
        &self,
        memory: Arc<dyn SlotMemory>,
        strict: bool,
        clock: Arc<dyn Clock>,
    ) -> Result<SchedulerHandle, ConfigError> {
        let manager = self.build_manager_with_clock(memory, strict, clock)?;
        let scheduler = SchedulerConfig {
            strict,
            ..self.scheduler
        };
        SchedulerHandle::new(scheduler, manager).map_err(|e| invalid("scheduler", e.to_string()))
    }

    /// Starts every secondary tier over the host pool's bytes `memory` and builds the tiering
    /// manager (strict: panic on a broken bookkeeping invariant). A tier whose Cargo feature is
    /// not compiled in is an error naming its entry.
    pub fn build_manager(
        &self,
        memory: Arc<dyn SlotMemory>,
        strict: bool,
    ) -> Result<TieringManager, ConfigError> {
        self.build_manager_with_clock(memory, strict, Arc::new(MonotonicClock::new()))
    }

    /// Like [`ResolvedConfig::build_manager`], with the manager's time (metrics, promotion
    /// deadline) read from `clock` (a simulator's [`crate::testing::ManualClock`]).
    pub fn build_manager_with_clock(
        &self,
        memory: Arc<dyn SlotMemory>,
        strict: bool,
        clock: Arc<dyn Clock>,
    ) -> Result<TieringManager, ConfigError> {
        if memory.slot_bytes() != self.slot_bytes as usize
            || memory.slot_count() != self.pool.slot_count
        {
            return Err(invalid(
                "cpu_bytes_to_use",
                format!(
                    "the host memory has {} slots of {} bytes, the config {} of {}",
                    memory.slot_count(),
                    memory.slot_bytes(),
                    self.pool.slot_count,
                    self.slot_bytes
                ),
            ));
        }
        let mut tiers = Vec::with_capacity(self.tiers.len());
        for tier in &self.tiers {
            let started = tier
                .factory
                .start(&tier.settings, self, Arc::clone(&memory))?;
            tiers.push(started);
        }
        let pool = HostPool::with_strictness(self.pool, strict)
            .map_err(|e| invalid("pool", e.to_string()))?;
        let options = TieringOptions {
            strict,
            promotion_deadline_ns: self.promotion_deadline_ns,
            cascade_deadline_ns: self.cascade_deadline_ns,
            reset_drain_deadline_ns: self.reset_drain_deadline_ns,
            clock,
            ..TieringOptions::new(self.slot_bytes)
        };
        TieringManager::new(pool, tiers, options)
            .map_err(|e| invalid("secondary_tiers", e.to_string()))
    }

    pub(crate) fn start_tier(
        &self,
        i: usize,
        spec: &TierSpec,
        memory: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError> {
        let key = format!("secondary_tiers[{i}]");
        match spec {
            TierSpec::Fs(fs) => self.start_fs(key, fs, memory),
            TierSpec::P2p(p2p) => self.start_p2p(key, p2p, memory),
            TierSpec::Obj(obj) => self.start_obj(key, obj, memory),
        }
    }

    #[cfg(feature = "obj")]
    fn start_obj(
        &self,
        key: String,
        spec: &ObjTierSpec,
        memory: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError> {
        use std::time::Duration;
        use tier_obj::{AzureConfig, Backend, GcsConfig, NamespaceId, ObjTierConfig, S3Config};
        let bad = |field: &str, reason: String| invalid(format!("{key}.{field}"), reason);
        let backend = match spec.location().map_err(|e| bad("url", e))? {
            ObjLocation::Memory => Backend::Memory,
            ObjLocation::Local { root } => Backend::Local { root },
            ObjLocation::S3 { bucket } => Backend::S3(S3Config {
                bucket: Some(bucket),
                endpoint: spec.endpoint.clone(),
                region: spec.region.clone(),
                allow_http: spec.allow_http,
                ..S3Config::default()
            }),
            ObjLocation::Gcs { bucket } => Backend::Gcs(GcsConfig {
                bucket: Some(bucket),
            }),
            ObjLocation::Azure { container } => Backend::Azure(AzureConfig {
                container: Some(container),
                endpoint: spec.endpoint.clone(),
                allow_http: spec.allow_http,
            }),
        };
        let e = &self.engine;
        let namespace = NamespaceId {
            model: e.model.clone(),
            dtype: e.dtype.clone(),
            tokens_per_chunk: self.scheduler.tokens_per_block * self.scheduler.blocks_per_chunk,
            parallel_layout: e.parallel_layout.clone(),
        };
        let defaults = ObjTierConfig::new(spec.prefix.clone(), namespace);
        let ms = |v: Option<u64>, d: Duration| v.map_or(d, Duration::from_millis);
        let config = ObjTierConfig {
            requests_in_flight_max: spec
                .requests_in_flight_max
                .unwrap_or(defaults.requests_in_flight_max),
            jobs_in_flight_max: spec
                .jobs_in_flight_max
                .unwrap_or(defaults.jobs_in_flight_max),
            request_deadline: ms(spec.request_deadline_ms, defaults.request_deadline),
            list_deadline: ms(spec.list_deadline_ms, defaults.list_deadline),
            drain_deadline: ms(spec.drain_deadline_ms, defaults.drain_deadline),
            multipart_threshold_bytes: spec
                .multipart_threshold_bytes
                .unwrap_or(defaults.multipart_threshold_bytes),
            part_bytes: spec.part_bytes.unwrap_or(defaults.part_bytes),
            ..defaults
        };
        let failed = |e: tier_obj::ObjError| ConfigError::Tier {
            key: key.clone(),
            reason: e.to_string(),
        };
        let store = backend.open().map_err(failed)?;
        let tier = tier_obj::ObjTier::start(config, store, memory).map_err(failed)?;
        Ok(Box::new(tier))
    }

    #[cfg(not(feature = "obj"))]
    fn start_obj(
        &self,
        key: String,
        _: &ObjTierSpec,
        _: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError> {
        Err(ConfigError::Tier {
            key,
            reason: "this build has no object tier (enable the connector's `obj` feature)"
                .to_owned(),
        })
    }

    #[cfg(feature = "fs")]
    fn start_fs(
        &self,
        key: String,
        spec: &FsTierSpec,
        memory: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError> {
        use tier_fs::{Durability, EngineChoice, FsTierConfig, NamespaceId};
        let e = &self.engine;
        let namespace = NamespaceId {
            model: e.model.clone(),
            dtype: e.dtype.clone(),
            tokens_per_chunk: self.scheduler.tokens_per_block * self.scheduler.blocks_per_chunk,
            parallel_layout: e.parallel_layout.clone(),
        };
        let defaults = FsTierConfig::new(&spec.root_dir, namespace, spec.capacity_bytes);
        let config = FsTierConfig {
            durability: if spec.fsync {
                Durability::Fsync
            } else {
                Durability::None
            },
            direct_io: spec.direct_io,
            shared_dir: spec.shared_dir,
            workers: spec.workers.unwrap_or(defaults.workers),
            engine: match spec.engine.as_deref() {
                Some("uring") => EngineChoice::Uring,
                Some("sync") => EngineChoice::Sync,
                _ => EngineChoice::Auto,
            },
            ..defaults
        };
        let tier = tier_fs::FsTier::start(config, memory).map_err(|e| ConfigError::Tier {
            key,
            reason: e.to_string(),
        })?;
        Ok(Box::new(tier))
    }

    #[cfg(not(feature = "fs"))]
    fn start_fs(
        &self,
        key: String,
        _: &FsTierSpec,
        _: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError> {
        Err(ConfigError::Tier {
            key,
            reason: "this build has no disk tier (enable the connector's `fs` feature)".to_owned(),
        })
    }

    #[cfg(feature = "p2p")]
    fn start_p2p(
        &self,
        key: String,
        spec: &P2pTierSpec,
        memory: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError> {
        use std::time::Duration;
        use tier_p2p::{Namespace, NamespaceId, P2pConfig};
        let e = &self.engine;
        let namespace = NamespaceId {
            model: e.model.clone(),
            dtype: e.dtype.clone(),
            tokens_per_chunk: self.scheduler.tokens_per_block * self.scheduler.blocks_per_chunk,
            parallel_layout: e.parallel_layout.clone(),
        };
        let namespace = Namespace::new(&namespace, e.block_bytes, e.hash_seed);
        let defaults = P2pConfig::new(namespace);
        let bad = |field: &str, reason: String| invalid(format!("{key}.{field}"), reason);
        let listen = match &spec.listen {
            Some(l) => l
                .parse()
                .map_err(|err| bad("listen", format!("{l:?}: {err}")))?,
            None => defaults.listen,
        };
        let mut peers = Vec::with_capacity(spec.peers.len());
        for (j, p) in spec.peers.iter().enumerate() {
            peers.push(
                p.parse()
                    .map_err(|err| bad(&format!("peers[{j}]"), format!("{err}")))?,
            );
        }
        let name = |field: &str, value: &Option<String>| match value {
            Some(v) => v
                .parse::<tier_p2p::PeerAddr>()
                .map(Some)
                .map_err(|err| bad(field, format!("{err}"))),
            None => Ok(None),
        };
        let peers_dns = name("peers_dns", &spec.peers_dns)?;
        let advertise = name("advertise", &spec.advertise)?;
        let secret = match &spec.secret_file {
            Some(path) => Some(std::fs::read(path).map_err(|err| {
                bad(
                    "secret_file",
                    format!("cannot read {}: {err}", path.display()),
                )
            })?),
            None => None,
        };
        let ms = |v: Option<u64>, d: Duration| v.map_or(d, Duration::from_millis);
        let config = P2pConfig {
            listen,
            peers,
            peers_dns,
            dns_refresh: ms(spec.dns_refresh_ms, defaults.dns_refresh),
            etcd_endpoints: spec.etcd_endpoints.clone(),
            etcd_prefix: spec
                .etcd_prefix
                .clone()
                .unwrap_or_else(|| defaults.etcd_prefix.clone()),
            etcd_lease_ttl: ms(spec.etcd_lease_ttl_ms, defaults.etcd_lease_ttl),
            advertise,
            owners: spec.owners.unwrap_or(defaults.owners),
            secret,
            published_bytes_max: spec
                .published_bytes_max
                .unwrap_or(defaults.published_bytes_max),
            lookup_deadline: ms(spec.lookup_deadline_ms, defaults.lookup_deadline),
            fetch_deadline: ms(spec.fetch_deadline_ms, defaults.fetch_deadline),
            ..defaults
        };
        let tier = tier_p2p::P2pTier::new(config, memory).map_err(|e| ConfigError::Tier {
            key,
            reason: e.to_string(),
        })?;
        Ok(Box::new(tier))
    }

    #[cfg(not(feature = "p2p"))]
    fn start_p2p(
        &self,
        key: String,
        _: &P2pTierSpec,
        _: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError> {
        Err(ConfigError::Tier {
            key,
            reason: "this build has no peer tier (enable the connector's `p2p` feature)".to_owned(),
        })
    }
}

/// Checks that `value` has the shape `host:port` (an IPv4 literal, `[v6]:port`, or a DNS name);
/// the peer tier parses it again and resolves names only when it connects. The message names
/// the value.
fn host_port(value: &str) -> Result<(), String> {
    if value.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let bad = |why: &str| Err(format!("{value:?} is not host:port ({why})"));
    let Some((host, port)) = value.rsplit_once(':') else {
        return bad("no `:port`");
    };
    if port.parse::<u16>().is_err() {
        return bad("port is not 0..=65535");
    }
    if host.starts_with('[') || host.contains(':') {
        return bad("not an IPv6 literal; write [address]:port");
    }
    let host = host.strip_suffix('.').unwrap_or(host);
    let label_ok = |label: &str| {
        (1..=63).contains(&label.len())
            && !label.starts_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
        return bad("host is neither an IP address nor a DNS name");
    }
    Ok(())
}
