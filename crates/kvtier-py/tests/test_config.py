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
