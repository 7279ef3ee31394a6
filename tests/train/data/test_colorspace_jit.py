"""The numba NV12 kernel's life cycle: compiled once, kept in the on-disk cache across processes,
and degrading to the torch ops (never failing) when numba is missing or cannot cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from loongforge.train.data import colorspace, colorspace_jit

_PROBE = """
import json, time
t0 = time.perf_counter()
from loongforge.train.data import colorspace_jit
took = colorspace_jit.warm_up()
k = colorspace_jit._kernel()
print(json.dumps({"took": took, "misses": sum(k.stats.cache_misses.values()),
                  "hits": sum(k.stats.cache_hits.values()), "total": time.perf_counter() - t0}))
"""


def _probe(cache_dir) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kernel_is_compiled_once_then_loaded_from_the_disk_cache(tmp_path):
    pytest.importorskip("numba")
    first, second = _probe(tmp_path), _probe(tmp_path)
    assert first["misses"] == 1 and first["hits"] == 0, first  # compiled, and written to tmp_path
    assert any(p.suffix == ".nbc" for p in tmp_path.rglob("*")), list(tmp_path.rglob("*"))
    assert second["misses"] == 0 and second["hits"] == 1, second  # the next process only loads it


def test_without_a_writable_cache_the_kernel_compiles_in_memory(monkeypatch, caplog):
    # A read-only install with no NUMBA_CACHE_DIR: numba finds no cache locator and refuses cache=True.
    numba_caching = pytest.importorskip("numba.core.caching")
    monkeypatch.setattr(numba_caching.CacheImpl, "_locator_classes", [])
    colorspace_jit._kernel.cache_clear()
    try:
        kern = colorspace_jit._kernel()
        assert isinstance(kern._cache, numba_caching.NullCache)
        assert "cannot cache" in caplog.text and "NUMBA_CACHE_DIR" in caplog.text
    finally:
        colorspace_jit._kernel.cache_clear()


def test_without_numba_the_torch_ops_convert(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    colorspace_jit._kernel.cache_clear()
    colorspace_jit.warm_up.cache_clear()
    try:
        assert colorspace_jit.warm_up() is None and not colorspace_jit.available()
        nv12 = torch.from_numpy(np.random.default_rng(3).integers(0, 256, size=(2, 24, 16), dtype=np.uint8))
        kw = dict(mean=0.5, std=0.25)
        got = colorspace.nv12_to_input(nv12, "bt601", "limited", **kw)
        assert torch.equal(got, colorspace.nv12_to_input_ops(nv12, "bt601", "limited", **kw))
    finally:
        colorspace_jit._kernel.cache_clear()
        colorspace_jit.warm_up.cache_clear()


def test_kernel_releases_the_gil_and_has_one_specialization():
    pytest.importorskip("numba")
    assert colorspace_jit.available()
    nv12 = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size=(3, 2, 48, 32), dtype=np.uint8))
    colorspace.nv12_to_input(nv12[:, 1], "bt709", "full", mean=0.4, std=0.3)  # a strided view
    colorspace.nv12_to_input(nv12, "bt601", "limited", mean=0.5, std=0.25, dtype=torch.bfloat16)
    kern = colorspace_jit._kernel()
    assert kern.targetoptions["nogil"] is True  # the prefetch thread converts while the model's thread runs
    assert len(kern.signatures) == 1, kern.signatures  # no recompile in the hot path for another layout
