"""Counters of the cache daemon, kept twice on purpose: as plain ints for the
`stats` op (exact, cheap, JSON) and as Prometheus series for scraping. One
`inc` call updates both, so they cannot drift apart.
"""

from __future__ import annotations

import socket
import threading
from collections import defaultdict
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from loongforge.cache.serving import BoundedServer, TimeoutHandler

_P = "loongforge_cache_"
_COUNTERS = {
    # name: (help, label)
    "hits": ("Reads served from a tier without filling it", "tier"),
    "misses": ("Reads that did not find the shard in a tier", "tier"),
    "bytes_served": ("Shard bytes handed to readers, by the tier they were mapped from", "tier"),
    "fills": ("Shards copied into this node, by source (ssd, peer, origin)", "source"),
    "evictions": ("Shards evicted from a tier", "tier"),
    "corrupt": ("Entries that failed hash verification and were dropped", "tier"),
    "enospc": ("Writes that hit a full disk", "tier"),
    "rejected": ("Requests rejected", "reason"),
    "prefetches": ("Shards filled ahead of the read by the prefetcher", "tier"),
    "redis_errors": ("Redis operations that failed (the daemon kept serving)", "op"),
    "reports": ("Tier files a client refused and reported, by the daemon's verdict: replaced (its own check "
                "failed too: dropped and filled again) or intact", "outcome"),
    "peer_refused": ("Peer-port requests refused with 401, by reason (unsigned, malformed, bad_signature, stale, "
                     "replayed, flooded): anything but 0 is a node with the wrong secret or someone probing the port",
                     "reason"),
    "connections_dropped": ("Connections a server dropped, by server and reason: <server>_reset (the peer reset it), "
                            "_timeout (a request not whole within the read timeout), _over_limit (the peer already "
                            "held the most connections one may), _error (a bug)", "reason"),
    "origin_reads": ("Origin reads, by why coordination allowed one (lock, no_live_holder, peer_failed, "
                     "uncoordinated)", "reason"),
}


class Metrics:
    def __init__(self, node_id: str):
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._prom = {name: Counter(_P + name, help_, [label], registry=self.registry)
                      for name, (help_, label) in _COUNTERS.items()}
        buckets = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.fill_seconds = Histogram(_P + "fill_seconds", "Time to fill one shard, by source", ["source"],
                                      buckets=buckets, registry=self.registry)
        self.prefetch_lead = Histogram(_P + "prefetch_lead_seconds",
                                       "Time between a prefetch completing and the first read of the shard",
                                       buckets=buckets + (300, 900), registry=self.registry)
        self.tier_bytes = Gauge(_P + "tier_bytes", "Bytes held per tier", ["tier"], registry=self.registry)
        self.tier_budget = Gauge(_P + "tier_budget_bytes", "Byte budget per tier", ["tier"], registry=self.registry)
        self.tier_disabled = Gauge(_P + "tier_disabled", "1 while a tier takes no new shards (its disk is full; "
                                   "re-checked with back-off), else 0", ["tier"], registry=self.registry)
        self.redis_up = Gauge(_P + "redis_up", "1 while Redis coordination works, 0 when degraded",
                              registry=self.registry)
        self.info = Gauge(_P + "node_info", "Constant 1, labelled with the node id", ["node"], registry=self.registry)
        self.info.labels(node_id).set(1)
        self._lead: list[float] = []

    def inc(self, name: str, label: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name][label] += n
        self._prom[name].labels(label).inc(n)

    def observe_fill(self, source: str, seconds: float) -> None:
        self.fill_seconds.labels(source).observe(seconds)

    def observe_lead(self, seconds: float) -> None:
        self.prefetch_lead.observe(seconds)
        with self._lock:
            self._lead.append(seconds)
            del self._lead[:-1000]

    def snapshot(self) -> dict:
        with self._lock:
            counts = {name: dict(sorted(v.items())) for name, v in self._counts.items()}
            lead = sorted(self._lead)
        for name in _COUNTERS:
            counts.setdefault(name, {})
        counts["prefetch_lead_s"] = {"count": len(lead), "p50": lead[len(lead) // 2] if lead else None,
                                     "min": lead[0] if lead else None}
        return counts


class _MetricsServer(BoundedServer, WSGIServer):
    name = "metrics port"
    max_per_peer = 16  # a scraper or two; the port has no authentication


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


class _QuietHandler(TimeoutHandler, WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - wsgiref's signature
        pass


def serve_metrics(metrics: Metrics, host: str, port: int, read_timeout_s: float) -> WSGIServer:
    """Prometheus /metrics on host:port in a thread of its own (prometheus_client's start_http_server has
    a listen backlog of 5, no read timeout and no bound per client); stop it with shutdown()."""
    server_class = _MetricsServer6 if ":" in host else _MetricsServer
    server = make_server(host, port, make_wsgi_app(metrics.registry), server_class, _QuietHandler)
    server.metrics, server.read_timeout_s = metrics, read_timeout_s
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-server").start()
    return server
