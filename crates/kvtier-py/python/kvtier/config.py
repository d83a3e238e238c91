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
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigError", "parse_size", "fs_settings", "p2p_settings"]


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
