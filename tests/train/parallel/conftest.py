"""8-process layouts and ZeRO-2 x TP x SP run only in `make parallel-full` (LOONGFORGE_PARALLEL_FULL=1):
the CI box has 2 cores and `make test` keeps to at most 4 processes."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LOONGFORGE_PARALLEL_FULL") == "1":
        return
    skip = pytest.mark.skip(reason="8-process layout: run `make parallel-full`")
    for item in items:
        if "parallel_full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="package", autouse=True)
def _rank_pool():
    """The pooled gloo ranks (dist_helpers.run_ranks) live while this folder's tests run, not the session."""
    yield
    from tests.train.parallel.dist_helpers import _POOL

    _POOL.close()
