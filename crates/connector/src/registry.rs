//! The tier registry: which tier types a configuration file may name in `secondary_tiers`, and
//! the factory that checks and starts each.
//!
//! Every entry of `secondary_tiers` is a table whose `type` names a registered tier type; the
//! rest of the table ([`TierEntry::settings`]) is handed to that type's [`TierFactory`]. The
//! built-in types (`fs`, `p2p`) are registered by [`TierRegistry::new`] through the same
//! interface; an embedding program registers its own (a Redis tier, an in-memory tier) before it
//! resolves the configuration:
//!
//! ```
//! use std::sync::Arc;
//! use connector::config::{ConfigError, ConnectorConfig, EngineGeometry, ResolvedConfig};
//! use connector::registry::{TierFactory, TierRegistry, TierSettings};
//! use offload_core::tier::{SlotMemory, Tier};
//!
//! struct RedisFactory;
//!
//! #[derive(serde::Deserialize)]
//! #[serde(deny_unknown_fields)]
//! struct RedisSettings {
//!     url: String,
//! }
//!
//! impl TierFactory for RedisFactory {
//!     fn check(&self, settings: &TierSettings, _: &ResolvedConfig) -> Result<(), ConfigError> {
//!         let redis: RedisSettings = settings.parse()?;
//!         if !redis.url.starts_with("redis://") {
//!             return Err(settings.invalid("url", format!("{:?} is not redis://...", redis.url)));
//!         }
//!         Ok(())
//!     }
//!
//!     fn start(
//!         &self,
//!         settings: &TierSettings,
//!         _: &ResolvedConfig,
//!         _: Arc<dyn SlotMemory>,
//!     ) -> Result<Box<dyn Tier>, ConfigError> {
//!         Err(settings.cannot_start("this example connects to no Redis"))
//!     }
//! }
//!
//! let mut registry = TierRegistry::new();
//! registry.register("redis", RedisFactory)?;
//! let config = ConnectorConfig::from_toml_str(r#"
//!     cpu_bytes_to_use = 1048576
//!     block_size = 64
//!     [[secondary_tiers]]
//!     type = "redis"
//!     url = "http://localhost"
//! "#)?;
//! let engine = EngineGeometry::new("my-model", 16, 4096);
//! let error = config.resolve_with(&engine, &registry).unwrap_err().to_string();
//! assert!(error.contains("secondary_tiers[0].url"), "{error}");
//! // Without the registration the type is unknown, and the error lists the known ones.
//! let error = config.resolve(&engine).unwrap_err().to_string();
//! assert!(error.contains("\"redis\"") && error.contains("fs, obj, p2p"), "{error}");
//! # Ok::<(), ConfigError>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use offload_core::tier::{SlotMemory, Tier};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

use crate::config::{ConfigError, ResolvedConfig};

/// Tier types at most in one registry (the names are listed in error messages).
pub const TIER_TYPES_MAX: usize = 64;

/// Longest tier type name.
pub const TIER_TYPE_NAME_BYTES_MAX: usize = 32;

/// One `secondary_tiers` entry as written: its `type` and the rest of its table.
#[derive(Clone, Debug, PartialEq)]
pub struct TierEntry {
    /// The entry's `type`: a registered tier type.
    pub type_name: String,
    /// Every other key of the entry, for the type's factory to read
    /// ([`TierSettings::parse`]).
    pub settings: serde_json::Map<String, serde_json::Value>,
}

impl<'de> Deserialize<'de> for TierEntry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut settings = serde_json::Map::<String, serde_json::Value>::deserialize(deserializer)?;
        match settings.remove("type") {
            Some(serde_json::Value::String(type_name)) => Ok(Self {
                type_name,
                settings,
            }),
            Some(other) => Err(D::Error::custom(format!(
                "a tier entry's `type` must be a string naming its tier type, not {other}"
            ))),
            None => Err(D::Error::custom(
                "a tier entry needs `type`, the name of its tier type (like \"fs\")",
            )),
        }
    }
}

/// A `secondary_tiers` entry handed to its [`TierFactory`]: the entry and its place in the file,
/// with helpers for errors that name the key.
#[derive(Clone, Debug, PartialEq)]
pub struct TierSettings {
    /// The entry's position in `secondary_tiers` (also its position in the tiering manager).
    pub index: usize,
    /// The entry.
    pub entry: TierEntry,
}

impl TierSettings {
    /// The entry's key, like `secondary_tiers[1]`.
    pub fn key(&self) -> String {
        format!("secondary_tiers[{}]", self.index)
    }

    /// The entry's `type`.
    pub fn type_name(&self) -> &str {
        &self.entry.type_name
    }

    /// The entry's settings (every key but `type`) as `T`, typically a `serde::Deserialize`
    /// struct with `#[serde(deny_unknown_fields)]`; the error names the entry and the key serde
    /// found wrong.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, ConfigError> {
        let table = serde_json::Value::Object(self.entry.settings.clone());
        serde_json::from_value(table).map_err(|e| ConfigError::Invalid {
            key: self.key(),
            reason: format!("{} tier: {e}", self.entry.type_name),
        })
    }

    /// An [`ConfigError::Invalid`] naming `field` of this entry, like `secondary_tiers[1].url`.
    pub fn invalid(&self, field: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            key: format!("{}.{field}", self.key()),
            reason: reason.into(),
        }
    }

    /// A [`ConfigError::Tier`]: this entry's tier could not be started.
    pub fn cannot_start(&self, reason: impl Into<String>) -> ConfigError {
        ConfigError::Tier {
            key: self.key(),
            reason: reason.into(),
        }
    }
}

/// Checks and starts the tiers of one type. Registered in a [`TierRegistry`] under the name a
/// config file's `type` gives it.
pub trait TierFactory: Send + Sync {
    /// Checks an entry's settings against the rest of the configuration (the engine's geometry,
    /// the slot size), without starting anything; called by
    /// [`ConnectorConfig::resolve_with`](crate::config::ConnectorConfig::resolve_with). The
    /// error names the key ([`TierSettings::invalid`]). `config.tiers` is not filled in yet.
    fn check(&self, settings: &TierSettings, config: &ResolvedConfig) -> Result<(), ConfigError>;

    /// Starts the tier over the host pool's bytes `memory` (every job names slots of it); called
    /// by [`ResolvedConfig::build_manager`] for an entry `check` accepted.
    fn start(
        &self,
        settings: &TierSettings,
        config: &ResolvedConfig,
        memory: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError>;
}

/// Tier types by name: what `type` in a `secondary_tiers` entry may say.
#[derive(Clone)]
pub struct TierRegistry {
    factories: BTreeMap<String, Arc<dyn TierFactory>>,
}

impl Default for TierRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for TierRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierRegistry")
            .field("types", &self.type_names())
            .finish()
    }
}

impl TierRegistry {
    /// The built-in tier types: `fs` (the disk tier) and `p2p` (the peer tier). Both are
    /// registered whatever the Cargo features; one whose feature is off fails to start with an
    /// error naming the feature.
    pub fn new() -> Self {
        let mut registry = Self::empty();
        for name in crate::config::BUILTIN_TIER_TYPES {
            registry
                .register(name, crate::config::BuiltinTier)
                .expect("the built-in tier types have distinct, valid names");
        }
        registry
    }

    /// A registry without any tier type, not even the built-in ones.
    pub fn empty() -> Self {
        Self {
            factories: BTreeMap::new(),
        }
    }

    /// Registers `factory` for entries whose `type` is `type_name` (1 to 32 bytes of lower-case
    /// ASCII letters, digits, `-` and `_`). Refuses a name already registered (a built-in one
    /// included) and more than [`TIER_TYPES_MAX`] types.
    pub fn register(
        &mut self,
        type_name: &str,
        factory: impl TierFactory + 'static,
    ) -> Result<(), ConfigError> {
        self.register_arc(type_name, Arc::new(factory))
    }

    /// [`TierRegistry::register`] for a factory already shared.
    pub fn register_arc(
        &mut self,
        type_name: &str,
        factory: Arc<dyn TierFactory>,
    ) -> Result<(), ConfigError> {
        let refuse = |reason: String| ConfigError::Invalid {
            key: format!("tier type {type_name:?}"),
            reason,
        };
        let valid = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_';
        if type_name.is_empty()
            || type_name.len() > TIER_TYPE_NAME_BYTES_MAX
            || !type_name.bytes().all(valid)
        {
            return Err(refuse(format!(
                "a tier type name is 1 to {TIER_TYPE_NAME_BYTES_MAX} bytes of a-z, 0-9, `-` and `_`"
            )));
        }
        if self.factories.contains_key(type_name) {
            return Err(refuse("already registered".to_owned()));
        }
        if self.factories.len() >= TIER_TYPES_MAX {
            return Err(refuse(format!("more than {TIER_TYPES_MAX} tier types")));
        }
        self.factories.insert(type_name.to_owned(), factory);
        Ok(())
    }

    /// The registered type names, sorted.
    pub fn type_names(&self) -> Vec<&str> {
        self.factories.keys().map(String::as_str).collect()
    }

    /// The factory for `settings`' type, or [`ConfigError::UnknownTierType`] naming the entry,
    /// the type and every registered type.
    pub fn factory(&self, settings: &TierSettings) -> Result<Arc<dyn TierFactory>, ConfigError> {
        match self.factories.get(settings.type_name()) {
            Some(factory) => Ok(Arc::clone(factory)),
            None => Err(ConfigError::UnknownTierType {
                key: format!("{}.type", settings.key()),
                type_name: settings.type_name().to_owned(),
                registered: self.type_names().join(", "),
            }),
        }
    }
}
