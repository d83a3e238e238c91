"""kvtier.config: sizes, vLLM's key names, unknown keys, environment overrides, peer security.
These need no vLLM."""

from __future__ import annotations

import pytest

from kvtier import offload_key_to_chunk_key
from kvtier.config import ConfigError, fs_settings, p2p_settings, parse_size


@pytest.mark.parametrize(
    "text,bytes_",
    [
        (4096, 4096),
        ("4GiB", 4 << 30),
        ("512 MiB", 512 << 20),
        ("1.5TB", 1_500_000_000_000),
        ("1e9", 1_000_000_000),
        ("10737418240", 10737418240),
        ("64kib", 64 << 10),
    ],
)
def test_sizes(text, bytes_):
    assert parse_size(text) == bytes_


@pytest.mark.parametrize("bad", ["4 parsecs", "", "-1GiB", 0, True, "GiB", None])
def test_bad_sizes_name_the_key(bad):
    with pytest.raises(ConfigError, match="capacity_bytes"):
        parse_size(bad, "capacity_bytes")


def test_vllm_fs_keys_are_understood_and_spec_keys_ignored(tmp_path):
    entry = {
        "type": "fs",
        "module_path": "kvtier.vllm.tiers",
        "spec_name": "TieringOffloadingSpec",
        "spec_module_path": "x.y",
        "root_dir": str(tmp_path),
        "n_read_threads": 32,
        "n_write_threads": 32,
        "capacity_bytes": "8GiB",
        "store_threshold": 1,
    }
    s, warnings = fs_settings(entry, environ={})
    assert s == {"root_dir": str(tmp_path), "capacity_bytes": 8 << 30, "workers": 16}
    assert warnings == []


def test_capacity_default_is_half_the_free_space_and_says_so(tmp_path):
    s, warnings = fs_settings({"root_dir": str(tmp_path)}, environ={})
    assert s["capacity_bytes"] > 0
    assert len(warnings) == 1 and "capacity_bytes not set" in warnings[0]


def test_unknown_key_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="'root_dri'"):
        fs_settings({"root_dir": str(tmp_path), "root_dri": "/typo"}, environ={})


def test_missing_root_dir():
    with pytest.raises(ConfigError, match="root_dir is required"):
        fs_settings({}, environ={})


def test_store_threshold_above_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="store_threshold"):
        fs_settings({"root_dir": str(tmp_path), "store_threshold": 2}, environ={})


def test_workers_and_n_read_threads_are_one_setting(tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        fs_settings({"root_dir": str(tmp_path), "workers": 2, "n_read_threads": 4}, environ={})


def test_environment_overrides(tmp_path):
    env = {"KVTIER_CAPACITY_BYTES": "1GiB", "KVTIER_ROOT_DIR": str(tmp_path / "env")}
    s, _ = fs_settings({"root_dir": "/elsewhere", "capacity_bytes": 5}, environ=env)
    assert s["root_dir"] == str(tmp_path / "env")
    assert s["capacity_bytes"] == 1 << 30
    p, _ = p2p_settings({}, environ={"KVTIER_PEERS": "127.0.0.1:1, 127.0.0.1:2"})
    assert p["peers"] == ["127.0.0.1:1", "127.0.0.1:2"]


def test_bad_environment_value_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="capacity_bytes"):
        fs_settings({"root_dir": str(tmp_path)}, environ={"KVTIER_CAPACITY_BYTES": "lots"})


def test_peers_beyond_loopback_need_a_secret():
    with pytest.raises(ConfigError, match="10.0.0.6:7470 is beyond loopback"):
        p2p_settings({"peers": ["10.0.0.6:7470"]}, environ={})
    with pytest.raises(ConfigError, match="beyond loopback"):
        p2p_settings({"listen": "0.0.0.0:7470"}, environ={})
    s, _ = p2p_settings(
        {"listen": "0.0.0.0:7470", "peers": ["10.0.0.6:7470"], "secret": "s" * 32}, environ={}
    )
    assert s["secret"] == b"s" * 32
    with pytest.raises(ConfigError, match="at least 16"):
        p2p_settings({"secret": "short"}, environ={})


def test_offload_key_mapping():
    h = bytes(range(32))
    key = h + (3).to_bytes(4, "big")
    hash_, group = offload_key_to_chunk_key(key)
    assert group == 3
    assert offload_key_to_chunk_key(h + (4).to_bytes(4, "big")) == (hash_, 4)
    assert offload_key_to_chunk_key(bytes(32) + bytes(4))[0] != hash_
    with pytest.raises(ValueError, match="4-byte group"):
        offload_key_to_chunk_key(b"abc")


def test_offload_keys_are_128_bit_and_collision_free_on_a_sample():
    # vLLM's block hashes: 32 random bytes (sha256), and structured ones that a prefix of the
    # bytes would confuse: equal in their first 16 bytes, or in their first 8, and other lengths.
    import hashlib

    from kvtier._kvtier import block_hashes_to_u128

    hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(50_000)]
    hashes += [bytes(16) + i.to_bytes(16, "little") for i in range(1, 10_001)]
    hashes += [bytes(8) + i.to_bytes(8, "little") for i in range(1, 10_001)]
    hashes += [bytes(n) for n in range(1, 65)]
    assert len(set(hashes)) == len(hashes)
    keys = [offload_key_to_chunk_key(h + (0).to_bytes(4, "big"))[0] for h in hashes]
    assert len(set(keys)) == len(keys), "two distinct block hashes became one key"
    assert all(0 <= k < 1 << 128 for k in keys)
    # Half the keys have the top bit set: the high 64 bits are used, not zero.
    high = sum(k >> 127 for k in keys)
    assert abs(high - len(keys) / 2) < 0.02 * len(keys), high
    # The connector's scheduler side maps block hashes the same way.
    assert block_hashes_to_u128(hashes[:1000]) == keys[:1000]


# -- the connector's kv_connector_extra_config ------------------------------------------------------


def test_connector_settings_understand_vllms_offloading_keys(tmp_path):
    from kvtier.config import connector_settings

    extra = {
        "spec_name": "TieringOffloadingSpec",
        "spec_module_path": "vllm.v1.kv_offload.tiering.spec",
        "cpu_bytes_to_use": "10GiB",
        "block_size": 16,
        "eviction_policy": "lru",
        "store_threshold": 2,
        "enable_kv_events": True,
        "tier_poll_interval_s": 0.01,
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 32, "n_write_threads": 32},
            {"type": "KvtierP2pTier", "module_path": "kvtier.vllm.tiers",
             "listen": "127.0.0.1:7070", "peers": ["127.0.0.1:7071"],
             "published_bytes_max": "64MiB", "enable_kv_events": True},
        ],
    }
    out, warnings = connector_settings(extra, environ={})
    assert out["cpu_bytes_to_use"] == 10 << 30
    assert out["block_size"] == 16 and out["eviction_policy"] == "lru"
    assert out["reuse_threshold"] == 2 and "store_threshold" not in out
    assert not {"spec_name", "spec_module_path", "enable_kv_events", "tier_poll_interval_s"} & set(out)
    fs, p2p = out["secondary_tiers"]
    assert fs["type"] == "fs" and fs["root_dir"] == str(tmp_path)
    assert fs["workers"] == 16 and "n_read_threads" not in fs and "n_write_threads" not in fs
    assert fs["capacity_bytes"] > 0  # half the free space, with a warning
    assert p2p == {"type": "p2p", "listen": "127.0.0.1:7070", "peers": ["127.0.0.1:7071"],
                   "published_bytes_max": 64 << 20}
    assert any("capacity_bytes not set" in w for w in warnings), warnings
    assert any("tier_poll_interval_s" in w for w in warnings), warnings


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"cpu_bytes_to_use": 1 << 20, "cpu_bytes": 5}, "unknown setting 'cpu_bytes'"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1 << 20, "store_threshold": 2, "reuse_threshold": 2}, "not both"),
        ({"cpu_bytes_to_use": 1 << 20, "cache_policy_module_path": "my.policy"},
         "cache_policy_module_path"),
        ({"cpu_bytes_to_use": 1 << 20, "canonical_layout": True}, "canonical_layout"),
        ({"cpu_bytes_to_use": 1 << 20, "offload_prompt_only": "maybe"}, "offload_prompt_only"),
        ({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": {"type": "fs"}}, "not a list"),
        ({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"root_dir": "/x"}]},
         r"secondary_tiers\[0\]: 'type' is required"),
        ({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "fs", "root": "/x"}]},
         r"secondary_tiers\[0\]: fs tier: unknown setting"),
        ({"cpu_bytes_to_use": 1 << 20,
          "secondary_tiers": [{"type": "fs", "root_dir": "/x", "capacity_bytes": 1 << 30,
                               "jobs_in_flight_max": 8}]},
         "jobs_in_flight_max"),
        ({"cpu_bytes_to_use": 1 << 20,
          "secondary_tiers": [{"type": "p2p", "published_bytes_max": "much"}]},
         r"secondary_tiers\[0\].published_bytes_max"),
    ],
)
def test_connector_settings_refuse_what_they_cannot_honour_by_name(extra, match):
    from kvtier.config import connector_settings

    with pytest.raises(ConfigError, match=match):
        connector_settings(extra, environ={})


def test_connector_settings_take_environment_overrides(tmp_path):
    from kvtier.config import connector_settings

    extra = {"cpu_bytes_to_use": 1 << 30, "offload_prompt_only": True,
             "secondary_tiers": [{"type": "fs", "root_dir": "/nowhere", "capacity_bytes": "1GiB"},
                                 {"type": "p2p", "peers": ["127.0.0.1:1"]}]}
    env = {"KVTIER_CPU_BYTES_TO_USE": "16MiB", "KVTIER_OFFLOAD_PROMPT_ONLY": "false",
           "KVTIER_ROOT_DIR": str(tmp_path), "KVTIER_PEERS": "127.0.0.1:2, 127.0.0.1:3",
           "KVTIER_STORE_THRESHOLD": "3"}
    out, _ = connector_settings(extra, environ=env)
    assert out["cpu_bytes_to_use"] == 16 << 20
    assert out["offload_prompt_only"] is False
    assert out["reuse_threshold"] == 3
    assert out["secondary_tiers"][0]["root_dir"] == str(tmp_path)
    assert out["secondary_tiers"][0]["capacity_bytes"] == 1 << 30
    assert out["secondary_tiers"][1]["peers"] == ["127.0.0.1:2", "127.0.0.1:3"]
    # The caller's dict is left as it was.
    assert extra["cpu_bytes_to_use"] == 1 << 30 and "reuse_threshold" not in extra
