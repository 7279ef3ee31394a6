"""`loongforge cache serve | stats | stop` (and `python -m loongforge.cache ...`,
which imports nothing but the cache). Thin: parse flags, build the config,
hand over to daemon.py. Heavy imports (redis, prometheus) happen in handlers
so `loongforge --help` stays fast. Every command that talks to a daemon
connects through `access.connect`, the socket check the client library makes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from loongforge.cache.access import connect, denied_message
from loongforge.cache.config import DAEMON_USER_ENV, SOCKET_ENV, default_socket_path, format_bytes, load_config
from loongforge.shared.errors import CacheError, LoongForgeError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
HELP = "per-node shard cache daemon (RAM + SSD, Redis-coordinated)"


def register(subparsers) -> None:
    """Add `cache ACTION ...` to the `loongforge` command."""
    cache = subparsers.add_parser("cache", help=HELP)
    _add_actions(cache)
    cache.set_defaults(func=lambda args: cache.print_help() or 2)


def _add_actions(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION")

    serve = sub.add_parser("serve", help="run the cache daemon in the foreground")
    serve.add_argument("--origin", help="shard root: local path or fsspec URL (s3://, gs://, http(s)://)")
    serve.add_argument("--config", help="TOML file ([cache] table or top-level keys; flags override it)")
    _endpoint_flags(serve)
    serve.add_argument("--ram-dir", help="RAM tier directory (default /dev/shm/loongforge-cache)")
    serve.add_argument("--ram-budget", help="RAM tier size, e.g. 2GiB")
    serve.add_argument("--ssd-dir", help="SSD tier directory (default ~/.cache/loongforge/cache)")
    serve.add_argument("--ssd-budget", help="SSD tier size, e.g. 20GiB")
    serve.add_argument("--ssd-verify", choices=("size", "full"),
                       help="SSD catalog check at start: size (default; hashes are checked on every SSD->RAM fill) "
                            "or full (re-hash everything)")
    serve.add_argument("--redis-url", help="redis://[user:pass@]host:port/db or rediss://; omit for one node")
    serve.add_argument("--node-id", help="this node's name in Redis (default: hostname)")
    serve.add_argument("--peer-listen", help="HOST:PORT to serve shards to other nodes (port 0 = any)")
    serve.add_argument("--peer-advertise", help="HOST:PORT other nodes use to reach --peer-listen")
    serve.add_argument("--peer-secret-file", help="the deployment's shared peer-port secret (chmod 600, the same "
                                                  "file on every node); required with --peer-listen. Or set "
                                                  "LOONGFORGE_CACHE_PEER_SECRET")
    serve.add_argument("--prefetch-window", type=int, help="shards to prefetch ahead per announced plan")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (off by default)")
    serve.add_argument("--lease-s", type=float, help="seconds a reader's pin lasts without renewal")
    serve.add_argument("--lock-ttl-s", type=float, help="single-flight fill lock TTL in seconds")
    serve.add_argument("--heartbeat-s", type=float, help="seconds between Redis heartbeats")
    serve.add_argument("--node-ttl-s", type=float, help="a node missing heartbeats this long is dead")
    serve.set_defaults(func=cmd_serve)

    stats = sub.add_parser("stats", help="print the daemon's counters (a table, or --json)")
    _endpoint_flags(stats)
    _daemon_user_flag(stats)
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.add_argument("--timeout", type=float, default=5.0)
    stats.set_defaults(func=cmd_stats)

    stop = sub.add_parser("stop", help="shut the daemon down gracefully (SSD tier kept)")
    _endpoint_flags(stop)
    _daemon_user_flag(stop)
    stop.add_argument("--timeout", type=float, default=5.0)
    stop.set_defaults(func=cmd_stop)


def _endpoint_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--socket", help=f"unix socket path (default ${SOCKET_ENV} or a per-user path)")
    group.add_argument("--tcp", help="loopback HOST:PORT instead of the unix socket")


def _daemon_user_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--daemon-user", help=f"the user the daemon runs as (name or uid; default ${DAEMON_USER_ENV}, "
                                         "else the socket directory's owner): any other answering is refused")


def cmd_serve(args) -> int:
    from loongforge.cache.daemon import Daemon

    keys = ("origin", "socket", "tcp", "ram_dir", "ram_budget", "ssd_dir", "ssd_budget", "ssd_verify", "redis_url", "node_id",
            "peer_listen", "peer_advertise", "peer_secret_file", "prefetch_window", "metrics_port", "lease_s",
            "lock_ttl_s", "heartbeat_s", "node_ttl_s")
    cfg = load_config(args.config, **{k: getattr(args, k) for k in keys})
    daemon = Daemon(cfg)
    daemon.start()
    daemon.serve_forever()
    return 0


def _request(args, op: str, socket_path: str | None) -> dict:
    conn = connect(socket_path, args.tcp, args.timeout, args.daemon_user)
    try:
        return conn.request(op)
    finally:
        conn.close()


def _request_or_say_why(args, op: str) -> dict | None:
    """The daemon's reply, or None after one line on stderr: unreachable, refused (EACCES: the
    group and the fix), a socket or daemon the client library would not trust either, or a
    refusal from the daemon; each worded as the client library words it."""
    socket_path = None if args.tcp else (args.socket or default_socket_path())
    try:
        return _request(args, op, socket_path)
    except PermissionError as exc:
        print(f"loongforge cache {op}: {denied_message(socket_path) if socket_path else exc}", file=sys.stderr)
    except OSError as exc:
        print(f"loongforge cache {op}: daemon unreachable: {exc}", file=sys.stderr)
    except CacheError as exc:
        print(f"loongforge cache {op}: {exc}", file=sys.stderr)
    return None


def cmd_stats(args) -> int:
    reply = _request_or_say_why(args, "stats")
    if reply is None:
        return 1
    stats = reply.get("stats")
    if args.json:
        _print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    try:
        table = render_table(stats)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # Another version of the daemon, or something else answering on its socket: say so, not a traceback.
        missing = f"no {exc.args[0]!r}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        print(f"loongforge cache stats: the daemon's answer is not the stats this client reads ({missing}); is it a "
              f"loongforge cache daemon of this version? `loongforge cache stats --json` prints the answer as it is",
              file=sys.stderr)
        return 1
    _print(table)
    return 0


def _print(text: str) -> None:
    """Print, tolerating a reader that stops early (`loongforge cache stats | head -1`)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def render_table(stats: dict) -> str:
    c = stats["counters"]
    lines = [f"node {stats['node']}  endpoint {stats['endpoint']}  redis {stats['redis']['state']}  "
             f"uptime {stats['uptime_s']:.0f}s", f"origin {stats['origin']}", "",
             f"{'tier':<6} {'used':>10} {'budget':>10} {'shards':>7} {'hits':>8} {'misses':>8} {'evicted':>8} "
             f"{'corrupt':>8} {'served':>10}"]
    for tier in ("ram", "ssd"):
        t = stats["tiers"][tier]
        lines.append(f"{tier:<6} {format_bytes(t['used']):>10} {format_bytes(t['budget']):>10} {t['shards']:>7} "
                     f"{c['hits'].get(tier, 0):>8} {c['misses'].get(tier, 0):>8} {c['evictions'].get(tier, 0):>8} "
                     f"{c['corrupt'].get(tier, 0):>8} {format_bytes(c['bytes_served'].get(tier, 0)):>10}")
    fills = c["fills"]
    lead = c["prefetch_lead_s"]
    lines += ["", f"fills: origin {fills.get('origin', 0)}  peer {fills.get('peer', 0)}  ssd {fills.get('ssd', 0)}"
              f"   prefetched {sum(c['prefetches'].values())}  lead p50 "
              + (f"{lead['p50']:.3f}s" if lead["p50"] is not None else "-"),
              f"pinned {stats['pinned']}  in flight {stats['inflight']}  plans {len(stats['plans'])} ranks  "
              f"rejected {sum(c['rejected'].values())}  peer 401s {sum(c.get('peer_refused', {}).values())}  "
              f"redis errors {sum(c['redis_errors'].values())}"]
    if stats["redis"].get("last_error"):
        lines.append(f"last redis error: {stats['redis']['last_error']}")
    for tier in ("ram", "ssd"):
        if stats["tiers"][tier].get("disabled"):
            lines.append(f"{tier} tier takes no new shards: {stats['tiers'][tier].get('disabled_reason', '?')} "
                         "(re-checked with back-off)")
    return "\n".join(lines)


def cmd_stop(args) -> int:
    if _request_or_say_why(args, "stop") is None:
        return 1
    print("cache daemon stopping")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m loongforge.cache ACTION ...` == `loongforge cache ACTION ...`, without the
    top-level command: a cache node imports only the cache (it has neither torch nor beam)."""
    parser = argparse.ArgumentParser(prog="python -m loongforge.cache", description=HELP)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    _add_actions(parser)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    level = "DEBUG" if args.verbose else os.environ.get("LOONGFORGE_LOG_LEVEL", "INFO").upper()
    if level not in LOG_LEVELS:
        parser.error(f"LOONGFORGE_LOG_LEVEL={level!r}: use {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except LoongForgeError as exc:  # worded as `loongforge cache ...` words it
        print(f"loongforge cache: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("loongforge cache: interrupted", file=sys.stderr)
        return 130

