"""The CPU prefetch path recycles its output buffers (no fresh float batch per step) and never
overwrites a batch its consumer still holds."""

import numpy as np
import torch

from loongforge.train.data.colorspace import nv12_to_input
from loongforge.train.data.prefetch import HostPool, Prefetcher

CONV = dict(matrix="bt601", color_range="limited", mean=0.5, std=0.25)


def _pull(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    batches = [{"frames.cam": rng.integers(0, 256, (2, 1, 12, 8), dtype=np.uint8),
                "state": rng.standard_normal((2, 3)).astype(np.float32)} for _ in range(n)]
    it = iter(batches)

    def pull():
        arrays = next(it)  # StopIteration ends the prefetcher
        return {"seq": 0}, arrays, lambda: None

    return pull, batches


def test_pool_reuses_a_buffer_only_when_nothing_outside_holds_it():
    pool = HostPool(per_key=3)
    a = pool.take((4, 5), torch.float32)
    b = pool.take((4, 5), torch.float32)
    assert a.data_ptr() != b.data_ptr()
    freed = a.data_ptr()
    del a
    c = pool.take((4, 5), torch.float32)
    assert c.data_ptr() == freed
    kept = c[1:]  # a view keeps the memory alive
    del c
    d = pool.take((4, 5), torch.float32)
    assert d.data_ptr() != kept.data_ptr() - 5 * 4
    assert pool.allocated == 3


def test_dropped_batches_are_recycled_and_kept_batches_stay_intact():
    pull, src = _pull(40)
    pf = Prefetcher(pull, device=torch.device("cpu"), rgb=True, depth=2, **CONV)
    kept = []
    try:
        for i, staged in enumerate(pf):
            if i % 10 == 0:
                kept.append((i, staged.tensors))  # a consumer that keeps some batches
    finally:
        pf.close()
    # 2 names; per name at most depth + 3 pooled buffers plus the 4 kept batches' own
    assert pf._host.allocated <= 2 * (2 + 3) + 2 * len(kept), pf._host.allocated
    for i, tensors in kept:
        want = nv12_to_input(torch.from_numpy(src[i]["frames.cam"]), **CONV)
        assert torch.equal(tensors["frames"]["cam"], want), f"batch {i} was overwritten"
        assert torch.equal(tensors["state"], torch.from_numpy(src[i]["state"]))


def test_out_buffer_matches_a_fresh_conversion():
    nv12 = torch.randint(0, 256, (3, 12, 8), dtype=torch.uint8)
    out = torch.full((3, 3, 8, 8), float("nan"))
    got = nv12_to_input(nv12, out=out, **CONV)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, nv12_to_input(nv12, **CONV))


def test_fields_of_one_shape_are_pooled_per_name():
    pool = HostPool(per_key=2)  # two batches in flight, each with two same-shaped cameras
    held = []
    for _ in range(10):
        held.append([pool.take((4, 5), torch.uint8, name) for name in ("front", "wrist")])
        if len(held) > 1:
            held.pop(0)
    assert pool.allocated == 4  # a pool keyed by shape alone would keep 2 buffers for 4 and allocate every time


def test_no_recycling_allocates_every_take():
    pool = HostPool(per_key=0)
    for _ in range(3):
        pool.take((4, 5), torch.float32, "x")
    assert pool.allocated == 3


def test_tensors_from_pull_pass_as_they_are_and_ring_views_are_copied():
    ring = {"frames.cam": np.arange(2 * 12 * 8, dtype=np.uint8).reshape(2, 1, 12, 8)}
    owned = {"state": torch.ones(2, 3)}

    def pull():
        return {"seq": 0}, {**ring, **owned}, lambda: None

    pf = Prefetcher(pull, device=torch.device("cpu"), rgb=False, depth=0, **CONV)
    staged = next(pf)
    assert staged.tensors["state"] is owned["state"]  # filled in place by the caller: no copy
    frames = staged.tensors["frames"]["cam"]
    assert frames.data_ptr() != ring["frames.cam"].ctypes.data  # a ring slot is reused once released
    assert torch.equal(frames, torch.from_numpy(ring["frames.cam"]))


def test_the_buffer_that_leaves_a_full_pool_is_the_longest_held_not_the_first_made():
    """A kept batch's buffer leaves the pool, not one that is back in a moment: bufs[0] must be the buffer
    handed out longest ago, whatever order they were made in (CI under load caught the first-made rule)."""
    pool = HostPool(per_key=2)
    first = pool.take((4,), torch.float32, "x")
    kept = pool.take((4,), torch.float32, "x")  # held from here on
    del first
    again = pool.take((4,), torch.float32, "x")  # the first buffer, handed out again: now the most recent
    extra = pool.take((4,), torch.float32, "x")  # both held: a new buffer; `kept`'s leaves the pool
    del again, extra
    for _ in range(3):  # two batches in flight at once: both pooled buffers are free, nothing is made
        a, b = pool.take((4,), torch.float32, "x"), pool.take((4,), torch.float32, "x")
        del a, b
    assert pool.allocated == 3 and kept.numel() == 4
