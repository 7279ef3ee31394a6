"""Which `ShardSource` the trainer reads through: the cache daemon's client when
a cache socket (or TCP address) is configured, else the shard root directly.

Kept as a picklable `SourceSpec` plus a factory because every decode worker
builds its own source (mmaps and sockets do not cross process boundaries).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from loongforge.shared.index import ShardIndex
from loongforge.shared.source import OriginSource, ShardSource

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceSpec:
    root: str
    cache_socket: str | None = None
    cache_tcp: str | None = None
    cache_timeout_s: float = 5.0

    @property
    def wants_cache(self) -> bool:
        return bool(self.cache_socket or self.cache_tcp)


def make_source(spec: SourceSpec, index: ShardIndex) -> ShardSource:
    if not spec.wants_cache:
        return OriginSource(spec.root, index)
    try:
        from loongforge.cache.client import CacheClient  # lazy: the cache service is optional
    except ImportError as exc:
        # Reading the origin is slower but correct; never fail a run over a missing accelerator.
        msg = f"cache requested but loongforge.cache.client is not importable ({exc}); reading the origin"
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        log.warning(msg)
        return OriginSource(spec.root, index)
    return CacheClient(spec.root, index, socket_path=spec.cache_socket, tcp=spec.cache_tcp, fallback=True,
                       timeout=spec.cache_timeout_s)


def close_source(source: ShardSource) -> None:
    close = getattr(source, "close", None)
    if callable(close):
        close()
