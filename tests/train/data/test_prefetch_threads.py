"""The CPU prefetch thread converts frames with serial torch ops, and only that
thread: an intra-op pool there waits on OpenMP barriers for cores the decode
workers hold (measured: 2.5 -> 35 samples/s, 2 workers, RGB out, busy 2-core box)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from loongforge.train.data.colorspace import serial_cpu_ops_in_this_thread
from loongforge.train.data.prefetch import Prefetcher

needs_pool = pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs with one intra-op thread here")


def _pull_recording(seen: list):
    def pull():
        if len(seen) >= 2:
            raise StopIteration
        seen.append(torch.get_num_threads())  # pull runs in the prefetch thread
        frames = np.random.default_rng(len(seen)).integers(0, 256, size=(2, 1, 24, 16), dtype=np.uint8)
        return {"seq": len(seen)}, {"frames.cam": frames}, lambda: None
    return pull


@needs_pool
@pytest.mark.parametrize("rgb, serial", [(True, True), (False, False)])
def test_cpu_prefetch_thread_runs_serial_ops_only_when_it_converts(rgb, serial):
    main_threads = torch.get_num_threads()
    seen: list[int] = []
    pf = Prefetcher(_pull_recording(seen), device=torch.device("cpu"), matrix="bt601", color_range="limited",
                    mean=0.5, std=0.25, rgb=rgb, depth=2)
    try:
        batches = list(pf)
    finally:
        pf.close()
    assert len(batches) == 2 and seen
    assert all(n == (1 if serial else main_threads) for n in seen), seen
    assert torch.get_num_threads() == main_threads  # the main thread (the model) keeps its pool
    if rgb:
        assert batches[0].tensors["frames"]["cam"].shape == (2, 1, 3, 16, 16)


@needs_pool
def test_serial_ops_are_per_thread_and_results_unchanged():
    x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size=(4, 2, 96, 64), dtype=np.uint8))
    from loongforge.train.data.colorspace import nv12_to_input

    want = nv12_to_input(x, "bt709", "limited", mean=0.5, std=0.25)
    got, counts = {}, {}

    def worker():
        counts["serial"] = serial_cpu_ops_in_this_thread()
        counts["threads"] = torch.get_num_threads()
        got["x"] = nv12_to_input(x, "bt709", "limited", mean=0.5, std=0.25)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert counts == {"serial": True, "threads": 1} and torch.get_num_threads() >= 2
    assert torch.equal(got["x"], want)


def test_cpu_prefetch_thread_compiles_the_conversion_kernel_before_the_first_batch(monkeypatch):
    # The numba kernel's compile (seconds) belongs to loader start, in the prefetch thread, not to a batch.
    from loongforge.train.data import colorspace_jit

    events: list = []
    real = colorspace_jit.warm_up

    def recording_warm_up():
        events.append(("warm_up", threading.current_thread().name))
        return real()

    monkeypatch.setattr(colorspace_jit, "warm_up", recording_warm_up)
    seen: list[int] = []
    pull = _pull_recording(seen)

    def pull_logged():
        events.append(("pull",))
        return pull()

    pf = Prefetcher(pull_logged, device=torch.device("cpu"), matrix="bt601", color_range="limited",
                    mean=0.5, std=0.25, rgb=True, depth=2)
    try:
        assert len(list(pf)) == 2
    finally:
        pf.close()
    assert events[0] == ("warm_up", "loongforge-prefetch"), events
