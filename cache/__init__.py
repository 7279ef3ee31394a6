"""Per-node shard cache: RAM + SSD tiers over an fsspec origin, plan-aware
prefetch and eviction, Redis-coordinated single-flight fills. No torch here.

Clients import `CacheClient` from `loongforge.cache.client`; the daemon is
`loongforge cache serve` (cli.py -> daemon.py). Protocol: PROTOCOL.md.
"""
