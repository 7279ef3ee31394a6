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
    pool = HostPool(per_shape=3)
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
