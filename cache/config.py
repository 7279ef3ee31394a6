"""Cache daemon configuration: one frozen dataclass, filled from (lowest to
highest precedence) defaults, a TOML file, LOONGFORGE_CACHE_* env vars, flags.

Defaults work on a single node: RAM tier in /dev/shm, SSD tier under
~/.cache, unix socket in the runtime dir, no Redis, no metrics port.
"""

from __future__ import annotations

import dataclasses
import os
import socket as _socket
import stat
import tomllib
from dataclasses import dataclass, fields

from loongforge.shared.units import format_size as format_bytes
from loongforge.shared.units import parse_size as parse_bytes
from loongforge.shared.errors import ConfigError
from loongforge.shared.index import ShardIndex

ENV_PREFIX = "LOONGFORGE_CACHE_"
SOCKET_ENV = "LOONGFORGE_CACHE_SOCKET"
DAEMON_USER_ENV = "LOONGFORGE_CACHE_DAEMON_USER"  # clients: the uid the daemon must run as (name or number)


def fallback_socket_dir() -> str:
    """Per-user socket directory when there is no XDG_RUNTIME_DIR: `$TMPDIR/loongforge-cache-<uid>`,
    created 0700 by the daemon and checked by both sides (`access.check_socket_dir`), so another user
    cannot plant a socket there (a bare /tmp/NAME.sock can be squatted before the daemon starts)."""
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", f"loongforge-cache-{os.geteuid()}")


def default_socket_path() -> str:
    """$LOONGFORGE_CACHE_SOCKET, else the per-user runtime dir, else a per-user 0700 dir under /tmp."""
    if os.environ.get(SOCKET_ENV):
        return os.environ[SOCKET_ENV]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "loongforge-cache.sock")
    return os.path.join(fallback_socket_dir(), "cache.sock")


def _default_ssd_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "loongforge", "cache")


def parse_hostport(value: str, field: str) -> tuple[str, int]:
    """HOST:PORT, with an IPv6 host as `[::1]:7700` or `::1:7700`; brackets are stripped."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{field}: expected HOST:PORT (e.g. 127.0.0.1:7700 or [::1]:7700), got {value!r}")
    return host.removeprefix("[").removesuffix("]") or "127.0.0.1", int(port)


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheConfig:
    origin: str  # shard root: local path or fsspec URL (read-only)
    socket: str = dataclasses.field(default_factory=default_socket_path)
    tcp: str | None = None  # "127.0.0.1:7700": loopback TCP instead of the unix socket
    ram_dir: str = "/dev/shm/loongforge-cache"
    ram_budget: int = 2 * 2**30
    ssd_dir: str = dataclasses.field(default_factory=_default_ssd_dir)
    ssd_budget: int = 20 * 2**30
    ssd_verify: str = "size"  # on start: "size" (fast; hashes checked on every SSD->RAM fill) or "full"
    redis_url: str | None = None  # redis://, rediss://, unix://; user/password may sit in the URL
    redis_username: str | None = None  # ACL user, if not in the URL
    # Prefer the env var LOONGFORGE_CACHE_REDIS_PASSWORD over a flag. Secrets stay out of the config's repr.
    redis_password: str | None = dataclasses.field(default=None, repr=False)
    redis_ca_certs: str | None = None  # CA bundle for rediss://
    redis_prefix: str = "loongforge:cache"
    node_id: str = dataclasses.field(default_factory=_socket.gethostname)
    peer_listen: str | None = None  # HOST:PORT for node-to-node shard transfer; port 0 = any
    peer_advertise: str | None = None  # address other nodes use; default: the listen address
    # The deployment's shared secret for the peer port (every node has the same one; peer.py signs and
    # checks each request with it): a key file readable only by the daemon's user (chmod 600), or the
    # env var LOONGFORGE_CACHE_PEER_SECRET. Required with peer_listen: without it anyone who reaches
    # the port (local users included) could read every shard.
    peer_secret_file: str | None = None
    peer_secret: str | None = dataclasses.field(default=None, repr=False)
    peer_auth_window_s: float = 30.0  # a signed request's timestamp may be this far from our clock
    prefetch_window: int = 4  # shards ahead per announced plan
    prefetch_threads: int = 2
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; off unless set
    metrics_host: str = "127.0.0.1"
    lease_s: float = 60.0  # a reader's pin expires after this without renewal
    # Every server (socket, peer port, metrics port): a request, once its first byte arrived, must arrive
    # whole within this, and a reply be taken; else the connection is dropped (and counted).
    read_timeout_s: float = 10.0
    lock_ttl_s: float = 30.0  # single-flight fill lock; refreshed while the holder is alive
    heartbeat_s: float = 2.0
    node_ttl_s: float = 10.0
    fill_timeout_s: float = 120.0  # one origin/peer fill, end to end
    redis_timeout_s: float = 1.0
    origin_delay_s: float = 0.0  # fault injection for tests: slow every origin read
    # A tier whose disk is full (ENOSPC/EDQUOT with nothing of ours left to evict) takes no writes; one
    # write re-checks it after this many seconds, doubling up to tier_recheck_max_s while it stays full.
    tier_recheck_s: float = 5.0
    tier_recheck_max_s: float = 300.0

    def __post_init__(self):
        if not self.origin:
            raise ConfigError("origin: required; pass --origin ROOT (a shard root path or fsspec URL)")
        for name in ("ram_budget", "ssd_budget"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}; use e.g. '2GiB'")
        if self.tcp:
            host, _ = parse_hostport(self.tcp, "tcp")
            if host not in ("127.0.0.1", "localhost", "::1"):
                raise ConfigError(f"tcp: {host!r} is not loopback; the protocol has no auth, bind 127.0.0.1 or [::1]")
        if self.peer_listen:
            parse_hostport(self.peer_listen, "peer_listen")
            if not (self.peer_secret_file or self.peer_secret):
                raise ConfigError(
                    f"peer_listen {self.peer_listen}: the peer port serves every shard to whoever reaches it, so it "
                    "needs the deployment's shared secret: set peer_secret_file (a key file, chmod 600, the same on "
                    "every node: `openssl rand -hex 32 > FILE`) or LOONGFORGE_CACHE_PEER_SECRET")
        if self.peer_secret_file and self.peer_secret:
            raise ConfigError("peer_secret_file and peer_secret are both set: keep one (the key file is preferred)")
        if self.ssd_verify not in ("size", "full"):
            raise ConfigError(f"ssd_verify: {self.ssd_verify!r} is not 'size' or 'full'")
        if self.prefetch_window < 0 or self.prefetch_threads < 1:
            raise ConfigError("prefetch_window must be >= 0 and prefetch_threads >= 1")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port: {self.metrics_port} is not a TCP port")
        for name in ("lease_s", "lock_ttl_s", "heartbeat_s", "node_ttl_s", "fill_timeout_s", "redis_timeout_s",
                     "tier_recheck_s", "peer_auth_window_s", "read_timeout_s"):
            if not getattr(self, name) > 0:  # NaN too
                raise ConfigError(f"{name}: must be > 0 seconds")
        if self.tier_recheck_max_s < self.tier_recheck_s:
            raise ConfigError("tier_recheck_max_s must be >= tier_recheck_s")
        if self.node_ttl_s <= self.heartbeat_s:
            raise ConfigError("node_ttl_s must exceed heartbeat_s, or live nodes expire between heartbeats")
        if os.path.realpath(self.ram_dir) == os.path.realpath(self.ssd_dir):
            raise ConfigError("ram_dir and ssd_dir must differ (RAM files are wiped on shutdown)")

    @property
    def endpoint(self) -> str:
        return f"tcp:{self.tcp}" if self.tcp else f"unix:{self.socket}"

    def check_index(self, index: ShardIndex, charges: dict | None = None) -> None:
        """A shard bigger than a tier can never be placed there: fail now, not deadlock later.
        `charges` maps a budget field to its tier's bytes -> pages-charged function (tiers.py)."""
        if not index.shards:
            return
        biggest = max(index.shards, key=lambda s: s.bytes)
        for name in ("ram_budget", "ssd_budget"):
            budget = getattr(self, name)
            need = (charges or {}).get(name, int)(biggest.bytes)
            if need > budget:
                raise ConfigError(
                    f"{name} {format_bytes(budget)} is smaller than shard {biggest.name} "
                    f"({format_bytes(need)} in whole pages); raise --{name.replace('_', '-')} to at least "
                    f"{format_bytes(need)} (a few shards' worth is sensible)")


_FIELDS = {f.name: f for f in fields(CacheConfig)}
_SIZES = {"ram_budget", "ssd_budget"}
_SECRET_HOMES = {"peer_secret": "peer_secret_file (chmod 600) or LOONGFORGE_CACHE_PEER_SECRET",
                 "redis_password": "LOONGFORGE_CACHE_REDIS_PASSWORD"}
_SECRETS = set(_SECRET_HOMES)


def _check_secrets_private(path: str, secrets: list[str]) -> None:
    """A config file that holds a secret must be as private as the peer key file: a file of the
    daemon's user or root that no one else may read (trainers are in the daemon's group, and the
    peer secret reads every shard of every node)."""
    if not secrets:
        return
    st = os.stat(path)
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o077:
        raise ConfigError(
            f"config file {path} ({stat.filemode(st.st_mode)}, owner uid {st.st_uid}) holds {' and '.join(secrets)} "
            f"but others may read or own it (the peer secret reads every node's shards, the Redis password rewrites "
            f"their directory). Move it to {' / '.join(_SECRET_HOMES[k] for k in secrets)}, or chown the file to "
            f"the daemon's user and chmod 600")


def _coerce(name: str, value):
    if value is None:
        return None
    if name in _SIZES:
        return parse_bytes(value, name)
    kind = _FIELDS[name].type
    try:
        if "int" in kind and "str" not in kind:
            return int(value)
        if "float" in kind:
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    return str(value)


def load_config(path: str | None = None, env: dict | None = None, **overrides) -> CacheConfig:
    """Merge TOML file < env vars < overrides (CLI flags; None = not given)."""
    values: dict = {}
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
        doc = doc.get("cache", doc)  # either a [cache] table or top-level keys
        unknown = sorted(set(doc) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"config file {path}: unknown keys {unknown}; valid keys: {sorted(_FIELDS)}")
        _check_secrets_private(path, sorted(_SECRETS & set(doc)))
        values.update(doc)
    env = os.environ if env is None else env
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if env.get(key):
            values[name] = env[key]
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown cache settings {unknown}")
    if not values.get("origin"):
        raise ConfigError("origin: required; pass --origin ROOT, set origin in the TOML file or "
                          f"{ENV_PREFIX}ORIGIN (a shard root path or fsspec URL)")
    return CacheConfig(**{k: _coerce(k, v) for k, v in values.items()})
