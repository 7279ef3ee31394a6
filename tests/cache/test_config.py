"""Config sources and validation (pure; the daemon-level budget check is in test_daemon)."""

from __future__ import annotations

import pytest

from loongforge.cache.config import default_socket_path, load_config, parse_bytes
from loongforge.shared.errors import ConfigError


def test_parse_bytes_units():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1.5KiB") == 1536
    assert parse_bytes("4096") == parse_bytes(4096) == 4096
    for bad in ("2 GiBs", "lots", "-1GiB", True):
        with pytest.raises(ConfigError):
            parse_bytes(bad, "ram_budget")


def test_precedence_toml_env_flags(tmp_path):
    toml = tmp_path / "cache.toml"
    toml.write_text('[cache]\norigin = "/data/shards"\nram_budget = "1GiB"\nssd_budget = "10GiB"\n'
                    'prefetch_window = 3\n')
    env = {"LOONGFORGE_CACHE_RAM_BUDGET": "3GiB", "LOONGFORGE_CACHE_PREFETCH_WINDOW": "5"}
    cfg = load_config(str(toml), env=env, prefetch_window=7, ssd_budget=None)
    assert cfg.origin == "/data/shards" and cfg.ssd_budget == 10 * 2**30
    assert cfg.ram_budget == 3 * 2**30 and cfg.prefetch_window == 7
    assert cfg.redis_url is None and cfg.metrics_port is None  # single-node defaults


def test_invalid_settings_name_the_field(tmp_path):
    toml = tmp_path / "cache.toml"
    toml.write_text('origin = "/x"\nram_bugdet = "1GiB"\n')
    with pytest.raises(ConfigError, match="ram_bugdet"):
        load_config(str(toml), env={})
    with pytest.raises(ConfigError, match="tcp"):
        load_config(None, env={}, origin="/x", tcp="0.0.0.0:7700")
    with pytest.raises(ConfigError, match="origin"):
        load_config(None, env={})
    with pytest.raises(ConfigError, match="node_ttl_s"):
        load_config(None, env={}, origin="/x", heartbeat_s=5, node_ttl_s=2)


def test_socket_env(monkeypatch):
    monkeypatch.setenv("LOONGFORGE_CACHE_SOCKET", "/run/x.sock")
    assert default_socket_path() == "/run/x.sock"
