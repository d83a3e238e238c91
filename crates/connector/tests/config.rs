//! Configuration files: the reference's keys parse from TOML and JSON alike; unknown keys,
//! contradictory keys and impossible sizes are errors that name the key.

use connector::config::{ConfigError, ConnectorConfig, EngineGeometry, TierSpec};
use offload_core::EvictionPolicy;

fn engine() -> EngineGeometry {
    EngineGeometry::new("m", 16, 4096)
}

const GOOD: &str = r#"
cpu_bytes_to_use = 1048576
block_size = 64
eviction_policy = "arc"
offload_prompt_only = true
secondary_tiers = [
  { type = "fs", root_dir = "/tmp/x", capacity_bytes = 1048576 },
  { type = "p2p", peers = ["127.0.0.1:7000"] },
]
"#;

/// The message of a parse or resolve error.
fn error(text: &str) -> String {
    match ConnectorConfig::from_toml_str(text).and_then(|c| c.resolve(&engine())) {
        Ok(r) => panic!("accepted: {r:?}"),
        Err(e) => e.to_string(),
    }
}

fn invalid_key(text: &str) -> String {
    match ConnectorConfig::from_toml_str(text).and_then(|c| c.resolve(&engine())) {
        Err(ConfigError::Invalid { key, .. }) => key,
        other => panic!("expected an invalid key, got {other:?}"),
    }
}

#[test]
fn the_reference_keys_resolve() {
    let r = ConnectorConfig::from_toml_str(GOOD)
        .and_then(|c| c.resolve(&engine()))
        .expect("valid");
    assert_eq!(r.scheduler.blocks_per_chunk, 4);
    assert!(r.scheduler.offload_prompt_only);
    assert_eq!(r.slot_bytes, 4 * 4096);
    assert_eq!(r.pool.slot_count, 1048576 / (4 * 4096));
    assert_eq!(r.pool.policy, EvictionPolicy::Arc);
    assert_eq!(r.tiers[0].type_name(), "fs");
    assert_eq!(r.tiers[1].type_name(), "p2p");
}

#[test]
fn json_and_toml_give_the_same_config() {
    let json = r#"{"cpu_bytes_to_use": 1048576, "block_size": 64, "eviction_policy": "arc",
        "offload_prompt_only": true, "secondary_tiers": [
        {"type": "fs", "root_dir": "/tmp/x", "capacity_bytes": 1048576},
        {"type": "p2p", "peers": ["127.0.0.1:7000"]}]}"#;
    assert_eq!(
        ConnectorConfig::from_json_str(json).expect("json"),
        ConnectorConfig::from_toml_str(GOOD).expect("toml")
    );
}

#[test]
fn unknown_keys_are_named() {
    let msg = error("cpu_bytes_to_use = 1048576\nblock_size = 64\ncpu_bytes = 5\n");
    assert!(msg.contains("unknown field `cpu_bytes`"), "{msg}");
    let msg = error(
        "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{ type = \"fs\", \
         root_dir = \"/x\", capacity_bytes = 1048576, rootdir = \"/y\" }]\n",
    );
    assert!(msg.contains("rootdir"), "{msg}");
    let json = ConnectorConfig::from_json_str(r#"{"cpu_bytes_to_use": 1, "colour": 2}"#);
    let msg = json.map(|_| ()).expect_err("unknown key").to_string();
    assert!(msg.contains("unknown field `colour`"), "{msg}");
}

#[test]
fn unknown_tier_types_and_policies_are_named() {
    let msg = error(
        "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{ type = \"s3\" }]\n",
    );
    assert!(msg.contains("s3"), "{msg}");
    let msg = error("cpu_bytes_to_use = 1048576\nblock_size = 64\neviction_policy = \"fifo\"\n");
    assert!(msg.contains("fifo") && msg.contains("lru"), "{msg}");
}

#[test]
fn block_size_and_blocks_per_chunk_are_exclusive_and_one_is_required() {
    assert_eq!(
        invalid_key("cpu_bytes_to_use = 1048576\nblock_size = 64\nblocks_per_chunk = 4\n"),
        "block_size"
    );
    assert_eq!(invalid_key("cpu_bytes_to_use = 1048576\n"), "block_size");
    let r = ConnectorConfig::from_toml_str("cpu_bytes_to_use = 1048576\nblocks_per_chunk = 2\n")
        .and_then(|c| c.resolve(&engine()))
        .expect("valid");
    assert_eq!(r.scheduler.blocks_per_chunk, 2);
}

#[test]
fn impossible_sizes_are_named() {
    // Not a multiple of the engine's 16-token blocks.
    assert_eq!(
        invalid_key("cpu_bytes_to_use = 1048576\nblock_size = 40\n"),
        "block_size"
    );
    assert_eq!(
        invalid_key("cpu_bytes_to_use = 1048576\nblock_size = 0\n"),
        "block_size"
    );
    assert_eq!(
        invalid_key("cpu_bytes_to_use = 1048576\nblocks_per_chunk = 0\n"),
        "blocks_per_chunk"
    );
    // Less than one chunk of host memory.
    assert_eq!(
        invalid_key("cpu_bytes_to_use = 100\nblock_size = 64\n"),
        "cpu_bytes_to_use"
    );
    // More slots than the pool can index.
    assert_eq!(
        invalid_key("cpu_bytes_to_use = 9223372036854775807\nblocks_per_chunk = 1\n"),
        "cpu_bytes_to_use"
    );
    assert_eq!(
        invalid_key(
            "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{ type = \"fs\", \
             root_dir = \"/x\", capacity_bytes = 10 }]\n"
        ),
        "secondary_tiers[0].capacity_bytes"
    );
}

#[test]
fn bad_tier_values_are_named_with_their_position() {
    assert_eq!(
        invalid_key(
            "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{ type = \"fs\", \
             root_dir = \"/x\", capacity_bytes = 1048576 }, { type = \"p2p\", peers = [\"nope\"] }]\n"
        ),
        "secondary_tiers[1].peers[0]"
    );
    assert_eq!(
        invalid_key(
            "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{ type = \"fs\", \
             root_dir = \"\", capacity_bytes = 1048576 }]\n"
        ),
        "secondary_tiers[0].root_dir"
    );
    assert_eq!(
        invalid_key(
            "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{ type = \"p2p\", \
             fetch_deadline_ms = 0 }]\n"
        ),
        "secondary_tiers[0].fetch_deadline_ms"
    );
}

#[test]
fn files_are_read_by_extension() {
    let dir = tempfile::tempdir().expect("temp dir");
    let toml_path = dir.path().join("kv.toml");
    std::fs::write(&toml_path, GOOD).expect("write");
    assert!(ConnectorConfig::from_path(&toml_path).is_ok());
    let other = dir.path().join("kv.yaml");
    std::fs::write(&other, GOOD).expect("write");
    let msg = ConnectorConfig::from_path(&other)
        .map(|_| ())
        .expect_err("wrong extension")
        .to_string();
    assert!(msg.contains(".toml or .json"), "{msg}");
    let missing = ConnectorConfig::from_path(&dir.path().join("none.toml"));
    assert!(matches!(missing, Err(ConfigError::Read { .. })));
}

#[cfg(feature = "fs")]
#[test]
fn a_resolved_config_starts_its_disk_tier() {
    use std::sync::Arc;
    let dir = tempfile::tempdir().expect("temp dir");
    let text = format!(
        "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{{ type = \"fs\", \
         root_dir = {:?}, capacity_bytes = 1048576 }}]\n",
        dir.path().display().to_string()
    );
    let resolved = ConnectorConfig::from_toml_str(&text)
        .and_then(|c| c.resolve(&engine()))
        .expect("valid");
    let memory = Arc::new(tier_testkit::VecSlotMemory::new(
        resolved.pool.slot_count,
        resolved.slot_bytes as usize,
    ));
    let manager = resolved.build_manager(memory, true).expect("starts");
    assert_eq!(manager.tier_count(), 1);
    assert_eq!(manager.tier_name(0), Some("fs"));
    // The wrong memory is refused, naming the key.
    let small = Arc::new(tier_testkit::VecSlotMemory::new(1, 16));
    assert!(matches!(
        resolved.build_manager(small, true),
        Err(ConfigError::Invalid { key, .. }) if key == "cpu_bytes_to_use"
    ));
}

#[test]
fn offload_prompt_only_defaults_to_vllms_true() {
    let parse = |extra: &str| {
        ConnectorConfig::from_toml_str(&format!(
            "cpu_bytes_to_use = 1048576\nblock_size = 64\n{extra}"
        ))
        .and_then(|c| c.resolve(&engine()))
        .expect("valid")
        .scheduler
        .offload_prompt_only
    };
    assert!(parse(""));
    assert!(!parse("offload_prompt_only = false"));
}

#[test]
fn p2p_peers_may_be_names_and_bad_ones_are_named_with_their_value() {
    let tiers = |peers: &str, extra: &str| {
        format!(
            "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{{ type = \"p2p\", \
             peers = [{peers}]{extra} }}]\n"
        )
    };
    let good = tiers(
        "\"localhost:7071\", \"node-3.example:7071\", \"10.0.0.1:7071\", \"[::1]:7071\"",
        ", owners = 3, advertise = \"node-1.example:7071\"",
    );
    let resolved = ConnectorConfig::from_toml_str(&good)
        .and_then(|c| c.resolve(&engine()))
        .expect("names are host:port");
    assert_eq!(resolved.tiers.len(), 1);
    let message = error(&tiers("\"localhost:7071\", \"node 3:7071\"", ""));
    assert!(message.contains("secondary_tiers[0].peers[1]"), "{message}");
    assert!(message.contains("\"node 3:7071\""), "{message}");
    assert_eq!(
        invalid_key(&tiers("\"localhost\"", "")),
        "secondary_tiers[0].peers[0]"
    );
    assert_eq!(
        invalid_key(&tiers("", ", owners = 4")),
        "secondary_tiers[0].owners"
    );
    assert_eq!(
        invalid_key(&tiers("\"a:1\"", ", peers_dns = \"peers.svc:7071\"")),
        "secondary_tiers[0].peers_dns"
    );
}

/// One `type = "obj"` entry with `fields` after its url.
fn obj_config(url: &str, fields: &str) -> String {
    format!(
        "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{{ type = \"obj\", \
         url = {url:?}{fields} }}]\n"
    )
}

#[test]
fn an_object_tier_entry_resolves_with_its_settings() {
    let text = obj_config(
        "s3://kv-cache.bucket",
        ", prefix = \"kv/a\", endpoint = \"http://127.0.0.1:9000\", allow_http = true, \
         region = \"eu-west-1\", requests_in_flight_max = 8, jobs_in_flight_max = 32, \
         request_deadline_ms = 5000, list_deadline_ms = 9000, drain_deadline_ms = 7000, \
         multipart_threshold_bytes = 16777216, part_bytes = 8388608",
    );
    let r = ConnectorConfig::from_toml_str(&text)
        .and_then(|c| c.resolve(&engine()))
        .expect("valid");
    let Some(TierSpec::Obj(obj)) = r.tiers[0].builtin() else {
        panic!("expected an obj tier, got {:?}", r.tiers[0]);
    };
    assert_eq!(
        obj.location(),
        Ok(connector::config::ObjLocation::S3 {
            bucket: "kv-cache.bucket".to_owned()
        })
    );
    assert_eq!(obj.prefix, "kv/a");
    assert_eq!(obj.requests_in_flight_max, Some(8));
    assert_eq!(obj.request_deadline_ms, Some(5000));
    assert_eq!(obj.drain_deadline_ms, Some(7000));
    for url in ["file:///var/kv", "memory:"] {
        assert!(ConnectorConfig::from_toml_str(&obj_config(url, ""))
            .and_then(|c| c.resolve(&engine()))
            .is_ok());
    }
}

/// `gs://bucket` and `az://container` parse to their locations; an Azure entry takes an
/// endpoint (an emulator's, plain HTTP with allow_http), a GCS entry neither endpoint nor
/// allow_http, and neither takes a region.
#[test]
fn gcs_and_azure_object_tier_urls_parse() {
    let location = |url: &str, fields: &str| {
        let r = ConnectorConfig::from_toml_str(&obj_config(url, fields))
            .and_then(|c| c.resolve(&engine()))
            .expect("valid");
        let Some(TierSpec::Obj(obj)) = r.tiers[0].builtin() else {
            panic!("expected an obj tier, got {:?}", r.tiers[0]);
        };
        obj.location()
    };
    use connector::config::ObjLocation;
    for (url, bucket) in [("gs://kv-cache_1.b", "kv-cache_1.b"), ("gs://abc/", "abc")] {
        assert_eq!(
            location(url, ""),
            Ok(ObjLocation::Gcs {
                bucket: bucket.to_owned()
            })
        );
    }
    assert_eq!(
        location(
            "az://kv-cache-01",
            ", endpoint = \"http://127.0.0.1:10000/devstoreaccount1\", allow_http = true"
        ),
        Ok(ObjLocation::Azure {
            container: "kv-cache-01".to_owned()
        })
    );
    assert_eq!(
        location(
            "az://abc/",
            ", endpoint = \"https://acct.blob.core.windows.net\""
        ),
        Ok(ObjLocation::Azure {
            container: "abc".to_owned()
        })
    );
    let key = |url: &str, fields: &str| invalid_key(&obj_config(url, fields));
    for url in [
        "gs://",
        "gs://ab",
        "gs://Upper",
        "gs://-abc",
        "gs://abc-",
        "gs://bucket/path",
        "az://",
        "az://ab",
        "az://Upper",
        "az://kv_cache",
        "az://-abc",
        "az://abc-",
        "az://a--b",
        "az://container/path",
        "az://container@account",
    ] {
        assert_eq!(key(url, ""), "secondary_tiers[0].url", "url {url:?}");
        let msg = error(&obj_config(url, ""));
        assert!(msg.contains(url), "the error names the url: {msg}");
    }
    let msg = error(&obj_config("ftp://x", ""));
    assert!(
        msg.contains("gs://bucket") && msg.contains("az://container"),
        "{msg}"
    );
    assert_eq!(
        key("gs://bucket", ", endpoint = \"https://x\""),
        "secondary_tiers[0].endpoint"
    );
    assert_eq!(
        key("gs://bucket", ", allow_http = true"),
        "secondary_tiers[0].allow_http"
    );
    for url in ["gs://bucket", "az://container"] {
        assert_eq!(
            key(url, ", region = \"eu-west-1\""),
            "secondary_tiers[0].region"
        );
    }
    assert_eq!(
        key(
            "az://container",
            ", endpoint = \"http://127.0.0.1:10000/a\""
        ),
        "secondary_tiers[0].endpoint",
        "plain HTTP needs allow_http"
    );
    assert_eq!(
        key("az://container", ", endpoint = \"127.0.0.1:10000\""),
        "secondary_tiers[0].endpoint"
    );
}

#[test]
fn bad_object_tier_values_are_named() {
    let key = |url: &str, fields: &str| invalid_key(&obj_config(url, fields));
    for url in [
        "ftp://x",
        "s3://",
        "s3://Upper",
        "s3://bucket/path",
        "file://relative",
        "",
    ] {
        assert_eq!(key(url, ""), "secondary_tiers[0].url", "url {url:?}");
    }
    let msg = error(&obj_config("ftp://x", ""));
    assert!(
        msg.contains("ftp://x") && msg.contains("s3://bucket"),
        "{msg}"
    );
    assert_eq!(
        key("s3://bucket", ", endpoint = \"http://127.0.0.1:9000\""),
        "secondary_tiers[0].endpoint",
        "plain HTTP needs allow_http"
    );
    assert_eq!(
        key("s3://bucket", ", endpoint = \"127.0.0.1:9000\""),
        "secondary_tiers[0].endpoint"
    );
    assert_eq!(
        key("file:///kv", ", endpoint = \"https://x\""),
        "secondary_tiers[0].endpoint"
    );
    assert_eq!(
        key("memory:", ", allow_http = true"),
        "secondary_tiers[0].allow_http"
    );
    assert_eq!(
        key("s3://bucket", ", prefix = \"/abs\""),
        "secondary_tiers[0].prefix"
    );
    assert_eq!(
        key("s3://bucket", ", prefix = \"a/../b\""),
        "secondary_tiers[0].prefix"
    );
    for field in [
        "requests_in_flight_max",
        "jobs_in_flight_max",
        "part_bytes",
        "request_deadline_ms",
        "list_deadline_ms",
        "drain_deadline_ms",
    ] {
        assert_eq!(
            key("s3://bucket", &format!(", {field} = 0")),
            format!("secondary_tiers[0].{field}")
        );
    }
    // Deadlines share the top-level keys' range: at most a day, the error naming the key.
    for field in [
        "request_deadline_ms",
        "list_deadline_ms",
        "drain_deadline_ms",
    ] {
        let text = obj_config("s3://bucket", &format!(", {field} = 86400001"));
        assert_eq!(invalid_key(&text), format!("secondary_tiers[0].{field}"));
        assert!(error(&text).contains("more than a day"), "{}", error(&text));
    }
    // No capacity key: the object tier does not evict.
    let msg = error(&obj_config("s3://bucket", ", capacity_bytes = 1048576"));
    assert!(msg.contains("capacity_bytes"), "{msg}");
}

#[cfg(feature = "obj")]
#[test]
fn a_resolved_config_starts_its_object_tier() {
    use std::sync::Arc;
    let dir = tempfile::tempdir().expect("temp dir");
    for url in [
        format!("file://{}", dir.path().display()),
        "memory:".to_owned(),
    ] {
        let resolved = ConnectorConfig::from_toml_str(&obj_config(&url, ", prefix = \"kv\""))
            .and_then(|c| c.resolve(&engine()))
            .expect("valid");
        let memory = Arc::new(tier_testkit::VecSlotMemory::new(
            resolved.pool.slot_count,
            resolved.slot_bytes as usize,
        ));
        let manager = resolved.build_manager(memory, true).expect("starts");
        assert_eq!(manager.tier_count(), 1);
        assert_eq!(manager.tier_name(0), Some("obj"), "{url}");
    }
}

#[cfg(not(feature = "obj"))]
#[test]
fn without_the_obj_feature_an_object_tier_is_an_error_naming_its_entry() {
    use std::sync::Arc;
    let resolved = ConnectorConfig::from_toml_str(&obj_config("memory:", ""))
        .and_then(|c| c.resolve(&engine()))
        .expect("valid");
    let memory = Arc::new(tier_testkit::VecSlotMemory::new(
        resolved.pool.slot_count,
        resolved.slot_bytes as usize,
    ));
    match resolved.build_manager(memory, true) {
        Err(ConfigError::Tier { key, reason }) => {
            assert_eq!(key, "secondary_tiers[0]");
            assert!(reason.contains("`obj` feature"), "{reason}");
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("an object tier started without the feature"),
    }
}

#[test]
fn the_tier_wait_deadlines_have_keys_with_defaults_and_limits() {
    let r = ConnectorConfig::from_toml_str("cpu_bytes_to_use = 1048576\nblock_size = 64\n")
        .and_then(|c| c.resolve(&engine()))
        .expect("valid");
    assert_eq!(r.promotion_deadline_ns, 10_000_000_000);
    assert_eq!(r.cascade_deadline_ns, 30_000_000_000);
    assert_eq!(r.reset_drain_deadline_ns, 5_000_000_000);
    let toml = "cpu_bytes_to_use = 1048576\nblock_size = 64\ncascade_deadline_ms = 250\n\
                reset_drain_deadline_ms = 40\n";
    let json = r#"{"cpu_bytes_to_use": 1048576, "block_size": 64,
        "cascade_deadline_ms": 250, "reset_drain_deadline_ms": 40}"#;
    for parsed in [
        ConnectorConfig::from_toml_str(toml),
        ConnectorConfig::from_json_str(json),
    ] {
        let r = parsed.and_then(|c| c.resolve(&engine())).expect("valid");
        assert_eq!(r.cascade_deadline_ns, 250_000_000);
        assert_eq!(r.reset_drain_deadline_ns, 40_000_000);
    }
    for key in [
        "promotion_deadline_ms",
        "cascade_deadline_ms",
        "reset_drain_deadline_ms",
    ] {
        for bad in ["0", "86400001"] {
            let text = format!("cpu_bytes_to_use = 1048576\nblock_size = 64\n{key} = {bad}\n");
            assert_eq!(invalid_key(&text), key, "{key} = {bad}");
        }
        let text = format!("cpu_bytes_to_use = 1048576\nblock_size = 64\n{key} = -1\n");
        assert!(error(&text).contains(key), "{}", error(&text));
    }
}

#[test]
fn p2p_etcd_settings_resolve_and_bad_ones_are_named() {
    let p2p = |fields: &str| {
        format!(
            "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{{ type = \"p2p\", \
             listen = \"127.0.0.1:7071\"{fields} }}]\n"
        )
    };
    let good = p2p(
        ", etcd_endpoints = [\"http://10.0.0.5:2379\", \"https://etcd.local:2379/\"], \
         etcd_prefix = \"/kv/a/\", etcd_lease_ttl_ms = 5000",
    );
    let r = ConnectorConfig::from_toml_str(&good)
        .and_then(|c| c.resolve(&engine()))
        .expect("valid");
    let Some(TierSpec::P2p(spec)) = r.tiers[0].builtin() else {
        panic!("expected a p2p tier");
    };
    assert_eq!(spec.etcd_endpoints.len(), 2);
    assert_eq!(spec.etcd_prefix.as_deref(), Some("/kv/a/"));
    assert_eq!(
        invalid_key(&p2p(", etcd_endpoints = [\"10.0.0.5:2379\"]")),
        "secondary_tiers[0].etcd_endpoints[0]"
    );
    assert_eq!(
        invalid_key(&p2p(", etcd_endpoints = [\"http://\"]")),
        "secondary_tiers[0].etcd_endpoints[0]"
    );
    assert_eq!(
        invalid_key(&p2p(
            ", etcd_endpoints = [\"http://e:2379\"], peers = [\"127.0.0.1:7000\"]"
        )),
        "secondary_tiers[0].etcd_endpoints"
    );
    assert_eq!(
        invalid_key(&p2p(
            ", etcd_endpoints = [\"http://e:2379\"], etcd_prefix = \"\""
        )),
        "secondary_tiers[0].etcd_prefix"
    );
    assert_eq!(
        invalid_key(&p2p(
            ", etcd_endpoints = [\"http://e:2379\"], etcd_lease_ttl_ms = 999"
        )),
        "secondary_tiers[0].etcd_lease_ttl_ms"
    );
}

#[test]
fn the_manager_gets_the_configured_deadlines() {
    use std::sync::Arc;
    let r = ConnectorConfig::from_toml_str(
        "cpu_bytes_to_use = 1048576\nblock_size = 64\ncascade_deadline_ms = 7\n\
         reset_drain_deadline_ms = 9\npromotion_deadline_ms = 11\n",
    )
    .and_then(|c| c.resolve(&engine()))
    .expect("valid");
    let memory: Arc<dyn offload_core::SlotMemory> = Arc::new(tier_testkit::VecSlotMemory::new(
        r.pool.slot_count,
        r.slot_bytes as usize,
    ));
    let manager = r.build_manager(memory, true).expect("manager");
    let options = manager.options();
    assert_eq!(
        (
            options.promotion_deadline_ns,
            options.cascade_deadline_ns,
            options.reset_drain_deadline_ns
        ),
        (11_000_000, 7_000_000, 9_000_000)
    );
}

#[test]
fn tier_entries_may_be_toml_tables_and_a_type_is_required() {
    let text = "cpu_bytes_to_use = 1048576\nblock_size = 64\n[[secondary_tiers]]\ntype = \"fs\"\n\
                root_dir = \"/tmp/x\"\ncapacity_bytes = 1048576\n";
    let r = ConnectorConfig::from_toml_str(text)
        .and_then(|c| c.resolve(&engine()))
        .expect("valid");
    assert_eq!(r.tiers[0].type_name(), "fs");
    assert_eq!(r.tiers[0].settings.entry.settings["root_dir"], "/tmp/x");
    let msg = error(
        "cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{ root_dir = \"/x\" }]\n",
    );
    assert!(msg.contains("needs `type`"), "{msg}");
    let msg =
        error("cpu_bytes_to_use = 1048576\nblock_size = 64\nsecondary_tiers = [{ type = 3 }]\n");
    assert!(msg.contains("`type` must be a string"), "{msg}");
}

#[test]
fn a_tier_type_is_registered_once_with_a_plain_name() {
    use connector::registry::TierRegistry;
    let mut registry = TierRegistry::new();
    assert_eq!(registry.type_names(), ["fs", "obj", "p2p"]);
    let again = TierRegistry::new();
    let fs = again
        .factory(&connector::TierSettings {
            index: 0,
            entry: connector::registry::TierEntry {
                type_name: "fs".into(),
                settings: Default::default(),
            },
        })
        .expect("built in");
    let refused = registry.register_arc("fs", fs.clone()).expect_err("taken");
    assert!(
        refused.to_string().contains("already registered"),
        "{refused}"
    );
    for bad in ["", "Redis", "a b", &"x".repeat(33)] {
        assert!(registry.register_arc(bad, fs.clone()).is_err(), "{bad:?}");
    }
    registry.register_arc("fs-2", fs).expect("a new plain name");
    assert_eq!(registry.type_names(), ["fs", "fs-2", "obj", "p2p"]);
    assert!(TierRegistry::empty().type_names().is_empty());
}

/// `build_scheduler`'s one `strict` reaches the scheduler too: not strict, an acknowledgement
/// of a job nobody submitted is counted instead of panicking (tests run with debug assertions,
/// where the scheduler's own default is strict).
#[test]
fn build_scheduler_sets_one_strictness_for_scheduler_pool_and_manager() {
    use offload_core::{JobAck, JobId, WorkerOutput};
    let resolved = ConnectorConfig::from_toml_str("cpu_bytes_to_use = 1048576\nblock_size = 64\n")
        .and_then(|c| c.resolve(&engine()))
        .expect("valid");
    let memory = std::sync::Arc::new(tier_testkit::VecSlotMemory::new(
        resolved.pool.slot_count,
        resolved.slot_bytes as usize,
    ));
    let mut scheduler = resolved.build_scheduler(memory, false).expect("builds");
    assert!(!scheduler.tiering().options().strict);
    scheduler.update_connector_output(&[WorkerOutput {
        worker: 0,
        acks: vec![JobAck {
            job: JobId(77),
            success: true,
        }],
    }]);
    assert_eq!(scheduler.metrics().scheduler.invariant_failures, 1);
}
