"""Configuration of kvtier's vLLM tiers: what a `secondary_tiers` entry may say, checked and
turned into the settings the native tiers take.

A tier entry pasted from vLLM's documentation works as it is: vLLM's own keys for its fs tier
(`root_dir`, `n_read_threads`, `n_write_threads`) are understood, keys that only mean something to
vLLM's spec (`spec_name`, `spec_module_path`, `type`, `module_path`) are accepted and ignored, and
an unknown key is an error that names it (a typo must not silently fall back to a default).

Sizes are ints (bytes) or strings with a unit: "4GiB", "512 MiB", "1.5TB", "1e9". Durations are
seconds (int or float).

Environment overrides: `KVTIER_<KEY>` (upper case, e.g. `KVTIER_CAPACITY_BYTES=8GiB`,
`KVTIER_ROOT_DIR=/mnt/nvme/kv`) replaces the entry's value for that key; for p2p,
`KVTIER_PEERS` is a comma-separated list.

fs tier keys:
  root_dir (required)       directory for the segment files (a namespace directory per model).
  capacity_bytes            most bytes kept on disk. Default: half of the free space of root_dir's
                            file system at start-up (a warning says how much that is).
  n_read_threads / workers  load worker threads (default 4; vLLM's default of 16 is capped at 16).
  n_write_threads           accepted for vLLM compatibility; kvtier writes each disk with one
                            sequential writer, so the value is only checked (1..=256).
  engine                    "auto" (io_uring when allowed, default), "uring" or "sync".
  direct_io                 O_DIRECT where the file system takes it (default true).
  shared_dir                other instances write the same directory (default false).
  fsync                     fdatasync stored chunks before they count (default false).
  jobs_in_flight_max        most jobs accepted and not yet finished (default 64).
  store_threshold           vLLM's key: only 0 or 1 (store on first sight) is supported, as in
                            vLLM's tiering spec; larger values are an error.
  enable_kv_events, locality, backpressure: handled by vLLM (accepted).

p2p tier keys:
  listen                    "host:port" to serve peers on (default "127.0.0.1:0").
  peers                     list of "host:port" of other instances.
  secret                    shared secret (string); required to listen or connect beyond loopback.
  published_bytes_max       bytes of chunks kept for peers (default 256MiB).
  lookup_deadline_s, fetch_deadline_s, nixl.

The connector (`KvtierConnector`) takes the connector crate's configuration as
`kv_connector_extra_config` (`connector_settings` below): the same keys as `kvtier run --config`
(README, "The configuration file"), with vLLM's OffloadingConnector keys understood too, so that
an extra config pasted from vLLM's documentation works with only `kv_connector` and
`kv_connector_module_path` changed:
  spec_name, spec_module_path   ignored (they pick vLLM's own spec).
  cpu_bytes_to_use              a size ("10GiB" or bytes).
  store_threshold               vLLM's name for reuse_threshold (same meaning: below 2 stores on
                                first sight); giving both is an error.
  enable_kv_events              publish BlockStored/BlockRemoved (as vLLM's kv_events_config).
  tier_poll_interval_s, backpressure, max_tracker_size, self_describing_kv_events,
  enable_telemetry, sync_load_budget_bytes
                                knobs of vLLM's own connector: accepted, no effect, a warning.
  cache_policy_module_path, canonical_layout=true
                                refused, naming the key (kvtier cannot honour them).
  secondary_tiers               entries of type "fs" take every fs key above (vLLM's
                                n_read_threads/n_write_threads, capacity_bytes optional, sizes,
                                `KVTIER_*` overrides); "KvtierFsTier"/"KvtierP2pTier" (with any
                                module_path) are read as "fs"/"p2p". Other entries ("p2p", "obj",
                                a type the embedding program registered) keep the connector's own
                                keys; their sizes may be strings.
Top-level keys take `KVTIER_<KEY>` overrides too (`KVTIER_CPU_BYTES_TO_USE=16GiB`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigError", "parse_size", "fs_settings", "p2p_settings", "connector_settings"]


class ConfigError(ValueError):
    """A tier entry is wrong; the message names the key and what was wrong with it."""


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

# Keys that belong to vLLM's spec or tier factory, not to the tier.
_IGNORED = {"spec_name", "spec_module_path", "type", "module_path"}
# Keys vLLM itself reads from a tier entry (and passes on): accepted, not used here.
_VLLM_HANDLED = {"enable_kv_events", "locality", "backpressure"}


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string such as "4GiB", "512 MiB", "1.5TB" or "1e9"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not a size")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{key}: {value!r} is not a size (examples: 4GiB, 512MiB, 1.5TB, 1000000)"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"{key}: {value!r} is not a size")
    if n <= 0:
        raise ConfigError(f"{key}: {value!r} must be more than 0 bytes")
    return n


def _int(value: Any, key: str, lo: int, hi: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: {value!r} is not an integer")
    if not lo <= value <= hi:
        raise ConfigError(f"{key}: {value} is outside {lo}..={hi}")
    return value


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{key}: {value!r} is not true or false")


def _seconds(value: Any, key: str) -> float:
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: {value!r} is not a number of seconds") from None
    if not s > 0:
        raise ConfigError(f"{key}: {value!r} must be more than 0 seconds")
    return s


def _with_env(entry: Mapping[str, Any], keys: set[str], environ: Mapping[str, str]) -> dict:
    """The entry with `KVTIER_<KEY>` environment overrides applied."""
    out = dict(entry)
    for key in keys:
        env = environ.get("KVTIER_" + key.upper())
        if env is not None:
            out[key] = env
    return out


def _entry(
    entry: Mapping[str, Any], known: set[str], tier: str, environ: Mapping[str, str] | None
) -> dict:
    """The entry with its `KVTIER_*` overrides, once every key in it is known."""
    entry = _with_env(entry, known, os.environ if environ is None else environ)
    unknown = sorted(set(entry) - known - _IGNORED - _VLLM_HANDLED)
    if unknown:
        raise ConfigError(
            f"{tier} tier: unknown setting(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
    return entry


_FS_KEYS = {
    "root_dir",
    "capacity_bytes",
    "n_read_threads",
    "n_write_threads",
    "workers",
    "engine",
    "direct_io",
    "shared_dir",
    "fsync",
    "jobs_in_flight_max",
    "store_threshold",
}


def fs_settings(
    entry: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The fs tier's settings from a `secondary_tiers` entry, and warnings to log."""
    entry = _entry(entry, _FS_KEYS, "fs", environ)
    warnings: list[str] = []
    root = entry.get("root_dir")
    if not root or not isinstance(root, (str, os.PathLike)):
        raise ConfigError("fs tier: root_dir is required (a directory for the KV files)")
    root = os.fspath(root)
    out: dict[str, Any] = {"root_dir": root}
    if entry.get("capacity_bytes") is not None:
        out["capacity_bytes"] = parse_size(entry["capacity_bytes"], "capacity_bytes")
    else:
        os.makedirs(root, exist_ok=True)
        free = shutil.disk_usage(root).free
        out["capacity_bytes"] = max(free // 2, 64 << 20)
        warnings.append(
            f"fs tier: capacity_bytes not set; using half of the free space of {root}: "
            f"{out['capacity_bytes'] / 2**30:.1f} GiB"
        )
    if "workers" in entry and "n_read_threads" in entry:
        raise ConfigError("fs tier: give workers or n_read_threads, not both (they are one setting)")
    readers = entry.get("workers", entry.get("n_read_threads"))
    if readers is not None:
        out["workers"] = min(_int(readers, "n_read_threads", 1, 256), 16)
    if entry.get("n_write_threads") is not None:
        _int(entry["n_write_threads"], "n_write_threads", 1, 256)
    if entry.get("engine") is not None:
        engine = str(entry["engine"])
        if engine not in ("auto", "uring", "io_uring", "sync"):
            raise ConfigError(f"engine: {engine!r}: expected auto, uring or sync")
        out["engine"] = engine
    for key in ("direct_io", "shared_dir", "fsync"):
        if entry.get(key) is not None:
            out[key] = _bool(entry[key], key)
    if entry.get("jobs_in_flight_max") is not None:
        out["jobs_in_flight_max"] = _int(entry["jobs_in_flight_max"], "jobs_in_flight_max", 1, 65536)
    if entry.get("store_threshold") is not None:
        t = _int(entry["store_threshold"], "store_threshold", 0, 1 << 30)
        if t >= 2:
            raise ConfigError(
                f"store_threshold: {t}: kvtier's tiers store on first sight (0 or 1), as vLLM's "
                "TieringOffloadingSpec requires"
            )
    return out, warnings


_P2P_KEYS = {
    "listen",
    "peers",
    "secret",
    "published_bytes_max",
    "lookup_deadline_s",
    "fetch_deadline_s",
    "nixl",
}


def _is_loopback(hostport: str) -> bool:
    host = hostport.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def p2p_settings(
    entry: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The p2p tier's settings from a `secondary_tiers` entry, and warnings to log."""
    entry = _entry(entry, _P2P_KEYS, "p2p", environ)
    out: dict[str, Any] = {}
    listen = str(entry.get("listen") or "127.0.0.1:0")
    if ":" not in listen:
        raise ConfigError(f"listen: {listen!r} is not host:port")
    out["listen"] = listen
    peers = entry.get("peers") or []
    if isinstance(peers, str):
        peers = [p.strip() for p in peers.split(",") if p.strip()]
    if not isinstance(peers, (list, tuple)) or not all(isinstance(p, str) and ":" in p for p in peers):
        raise ConfigError(f"peers: {peers!r} is not a list of host:port strings")
    out["peers"] = list(peers)
    secret = entry.get("secret")
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < 16:
            raise ConfigError("secret: must be a string of at least 16 characters")
        out["secret"] = secret.encode()
    remote = [a for a in [listen, *out["peers"]] if not _is_loopback(a)]
    if remote and secret is None:
        raise ConfigError(
            f"p2p tier: {', '.join(remote)} is beyond loopback; set a secret (or "
            "KVTIER_SECRET) so peers authenticate"
        )
    if entry.get("published_bytes_max") is not None:
        out["published_bytes_max"] = parse_size(entry["published_bytes_max"], "published_bytes_max")
    for key in ("lookup_deadline_s", "fetch_deadline_s"):
        if entry.get(key) is not None:
            out[key] = _seconds(entry[key], key)
    if entry.get("nixl") is not None:
        out["nixl"] = _bool(entry["nixl"], "nixl")
    return out, []


# -- the connector's configuration ------------------------------------------------------------------

# The connector crate's top-level keys (connector::config::ConnectorConfig), by kind of value.
_CONNECTOR_SIZES = {"cpu_bytes_to_use"}
_CONNECTOR_INTS = {
    "block_size",
    "blocks_per_chunk",
    "reuse_threshold",
    "promotion_deadline_ms",
    "cascade_deadline_ms",
    "reset_drain_deadline_ms",
}
_CONNECTOR_BOOLS = {"offload_prompt_only"}
_CONNECTOR_STRS = {"eviction_policy", "offload_policy"}
_CONNECTOR_KEYS = _CONNECTOR_SIZES | _CONNECTOR_INTS | _CONNECTOR_BOOLS | _CONNECTOR_STRS
# vLLM OffloadingConnector keys that only steer vLLM's own connector: accepted, no effect.
_VLLM_CONNECTOR_ONLY = {
    "tier_poll_interval_s",
    "backpressure",
    "max_tracker_size",
    "self_describing_kv_events",
    "enable_telemetry",
    "sync_load_budget_bytes",
}
# Tier types of kvtier.vllm.tiers, read as the connector's own.
_TIER_ALIASES = {"KvtierFsTier": "fs", "KvtierP2pTier": "p2p"}
# Size-valued keys of the connector's p2p and obj entries (strings like "256MiB" accepted).
_ENTRY_SIZES = {"published_bytes_max", "multipart_threshold_bytes", "part_bytes"}


def _typed(value: Any, key: str) -> Any:
    """A top-level connector value (from the file or a `KVTIER_*` string) as the connector takes
    it."""
    if key in _CONNECTOR_SIZES:
        return parse_size(value, key)
    if key in _CONNECTOR_INTS:
        return _int(value, key, 0, 1 << 62)
    if key in _CONNECTOR_BOOLS:
        return _bool(value, key)
    if not isinstance(value, str):
        raise ConfigError(f"{key}: {value!r} is not a string")
    return value


def _connector_tier(entry: Any, index: int, environ: Mapping[str, str]) -> tuple[dict, list[str]]:
    """One `secondary_tiers` entry as the connector takes it, and warnings to log."""
    where = f"secondary_tiers[{index}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: {entry!r} is not a table of settings")
    kind = entry.get("type")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"{where}: 'type' is required (fs, p2p, obj, or a registered type)")
    kind = _TIER_ALIASES.get(kind, kind)
    if kind == "fs":
        # KVTIER_STORE_THRESHOLD is the connector's reuse threshold here, not the fs entry's.
        fs_environ = {k: v for k, v in environ.items() if k != "KVTIER_STORE_THRESHOLD"}
        try:
            settings, warnings = fs_settings(entry, fs_environ)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if "jobs_in_flight_max" in settings:
            raise ConfigError(
                f"{where}: jobs_in_flight_max is a setting of kvtier.vllm.tiers' fs tier, "
                "not of the connector's"
            )
        if settings.get("engine") == "io_uring":
            settings["engine"] = "uring"
        return {"type": "fs", **settings}, warnings
    out = {"type": kind}
    for key, value in entry.items():
        if key in _IGNORED or key in _VLLM_HANDLED:
            continue
        env = environ.get("KVTIER_" + key.upper())
        if env is not None:
            value = env
            if key in ("peers", "etcd_endpoints"):
                value = [p.strip() for p in env.split(",") if p.strip()]
            elif key != "secret_file" and env.strip().isdigit():
                value = int(env)
        if key in _ENTRY_SIZES and value is not None:
            value = parse_size(value, f"{where}.{key}")
        out[key] = value
    return out, []


def connector_settings(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """`kv_connector_extra_config` as the connector crate's configuration (JSON-ready), and
    warnings to log. vLLM's OffloadingConnector keys are understood (see the module doc); a key
    neither kvtier nor vLLM knows is an error naming it."""
    environ = os.environ if environ is None else environ
    extra = dict(extra or {})
    for key in _CONNECTOR_KEYS | {"store_threshold"}:
        env = environ.get("KVTIER_" + key.upper())
        if env is not None:
            extra[key] = env
    warnings: list[str] = []
    out: dict[str, Any] = {}
    if "store_threshold" in extra:
        if "reuse_threshold" in extra:
            raise ConfigError("give store_threshold (vLLM's name) or reuse_threshold, not both")
        extra["reuse_threshold"] = extra.pop("store_threshold")
    if extra.get("cache_policy_module_path"):
        raise ConfigError(
            "cache_policy_module_path: kvtier's host pool has its own policies "
            "(eviction_policy = \"lru\" or \"arc\"); a Python cache policy cannot be used"
        )
    if extra.get("canonical_layout"):
        raise ConfigError(
            "canonical_layout: true is a layout of vLLM's own connector; kvtier keeps the "
            "engine's block layout (leave it unset or false)"
        )
    ignored = []
    for key, value in extra.items():
        if key in ("spec_name", "spec_module_path", "enable_kv_events", "cache_policy_module_path",
                   "canonical_layout"):
            continue
        if key in _VLLM_CONNECTOR_ONLY:
            ignored.append(key)
            continue
        if key == "secondary_tiers":
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"secondary_tiers: {value!r} is not a list of tier entries")
            tiers = []
            for i, entry in enumerate(value):
                tier, tier_warnings = _connector_tier(entry, i, environ)
                tiers.append(tier)
                warnings += tier_warnings
            out["secondary_tiers"] = tiers
            continue
        if key not in _CONNECTOR_KEYS:
            known = sorted(_CONNECTOR_KEYS | {"secondary_tiers", "store_threshold"})
            raise ConfigError(
                f"kvtier connector: unknown setting {key!r}; known: {', '.join(known)}"
            )
        out[key] = _typed(value, key)
    if ignored:
        warnings.append(
            f"kvtier connector: {', '.join(sorted(ignored))} steer(s) vLLM's own offloading "
            "connector and have no effect here"
        )
    return out, warnings
