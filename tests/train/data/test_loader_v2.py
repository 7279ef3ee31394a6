"""BlockLoader over real format-2 roots written by shared/writer_v2 (train/data/loader.py)."""

import numpy as np
import pytest
import torch

from loongforge.shared.dataset import open_root
from loongforge.shared.errors import CheckpointError, DataWorkerError
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.data.loader import BlockLoader
from loongforge.train.data.samples import DeltaSpec

LENGTHS = (9, 5, 12, 3, 7, 10)
TASKS = ("pick up the red cube", "open the drawer")


@pytest.fixture(scope="module")
def v2_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("v2root"))
    written = make_synthetic_root(root, lengths=LENGTHS, height=8, width=8, block_size=4, shard_size=4096)
    return root, written


def _loader(root, **kw):
    kw.setdefault("batch_size", 4)
    return BlockLoader(root, rgb=False, **kw)


def _locate(gid):
    ends = np.cumsum(LENGTHS)
    e = int(np.searchsorted(ends, gid, side="right"))
    return e, gid - int(ends[e] - LENGTHS[e])


def _check_batch(batch, written, spec):
    for row, gid in enumerate(batch["sample_ids"].tolist()):
        e, t = _locate(gid)
        n = LENGTHS[e]
        frames, arrays = written[e]
        shown = np.clip(t + np.asarray(spec.video), 0, n - 1)  # video clamped into the episode
        for slot in ("front", "wrist"):
            np.testing.assert_array_equal(batch["frames"][slot][row].numpy(), frames[slot][shown])
        np.testing.assert_allclose(batch["state"][row].numpy(), arrays["state"][shown])  # stats: mean 0, std 1
        rows = np.minimum(t + np.arange(spec.action_horizon), n - 1)  # past the end: the last row, masked
        np.testing.assert_allclose(batch["action"][row].numpy(), arrays["action"][rows])
        assert batch["action_valid"][row].tolist() == (t + np.arange(spec.action_horizon) < n).tolist()
        text = bytes(v for v in batch["task_tokens"][row].tolist() if v < 256).decode()
        assert text == TASKS[e % 2]
    assert batch["frame_mask"].all() and batch["sample_valid"].all()


def test_batches_hold_the_gr00t_sample_semantics(v2_root):
    root, written = v2_root
    spec = DeltaSpec(video=(-3, 0), action_horizon=4)
    with _loader(root, deltas=spec, max_steps=11) as loader:
        ids = []
        for batch in loader:
            assert batch["frames"]["front"].shape == (4, 2, 12, 8)
            _check_batch(batch, written, spec)
            ids += batch["sample_ids"].tolist()
    assert len(ids) == len(set(ids)) == 44  # one epoch (46 samples, tail of 2 dropped), each once


@pytest.mark.slow
def test_real_workers_match_inline_and_count_cache_hits(v2_root):
    root, written = v2_root
    spec = DeltaSpec(video=(0,), action_horizon=3)
    runs, counters = [], []
    for workers in (0, 2):
        with _loader(root, deltas=spec, num_workers=workers, max_steps=10, rank=1, world=2,
                     block_run=2, block_window=16) as loader:
            it = iter(loader)
            got = [next(it)]
            # The bench opens its timed window here: every worker past start-up, and it is told how
            # many batches may already sit decoded ahead (ring slots + prefetch queue) to skip.
            assert loader.wait_ready(60) == (2 * workers + 1 + 2 if workers else 2)
            assert workers == 0 or loader._pool.workers_ready == workers
            got += [next(it) for _ in range(9)]  # not list(it): iter() would restart the pipeline
            with pytest.raises(StopIteration):
                next(it)
            runs.append([(b["sample_ids"].clone(), b["frames"]["front"].clone(), b["action"].clone())
                         for b in got])
            counters.append(loader.cache_counters())
    for (ia, fa, aa), (ib, fb, ab) in zip(*runs):
        assert torch.equal(ia, ib) and torch.equal(fa, fb) and torch.equal(aa, ab)
    for c in counters:
        assert c["hits"] > 0 and c["misses"] > 0 and c["samples"] == 20


@pytest.mark.slow
def test_wait_ready_raises_when_a_worker_cannot_start(tmp_path):
    root = str(tmp_path / "r")
    make_synthetic_root(root, lengths=(6, 6), height=8, width=8, block_size=4)
    loader = _loader(root, num_workers=1, max_steps=2)
    import shutil

    shutil.rmtree(f"{root}/index")  # the worker opens the tables itself: its start-up fails
    try:
        iter(loader)
        with pytest.raises(DataWorkerError, match="died|failed to start"):
            loader.wait_ready(60)  # never a hang, never a silent partial pool
    finally:
        loader.close()


def _flip_block_byte(root, episode, camera, block):
    ds = open_root(root)
    name, off, length, _, _ = ds.block_entry(episode, camera, block)
    path = f"{root}/{name}"
    data = bytearray(open(path, "rb").read())
    data[off + length // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_corrupt_block_is_a_masked_counted_bad_sample(tmp_path):
    root = str(tmp_path)
    make_synthetic_root(root, lengths=(8, 8), height=8, width=8, block_size=4)
    _flip_block_byte(root, 1, "wrist", 0)
    with _loader(root, max_steps=4, batch_size=4) as loader:
        bad_rows = 0
        for batch in loader:
            for row, gid in enumerate(batch["sample_ids"].tolist()):
                if gid in (8, 9, 10, 11):  # episode 1, t < 4: block 0 of its wrist camera
                    assert not batch["sample_valid"][row] and not batch["action_valid"][row].any()
                    bad_rows += 1
                else:
                    assert batch["sample_valid"][row]
        assert loader.bad_samples == bad_rows == 4
    with _loader(root, max_steps=4, batch_size=4, bad_samples="raise") as loader:
        with pytest.raises(DataWorkerError, match="xxh3"):
            list(loader)


def test_val_episodes_are_left_out(tmp_path):
    root = str(tmp_path)
    make_synthetic_root(root, lengths=(4, 4, 4), height=8, width=8, val_episodes=(1,))
    with _loader(root, max_steps=2) as loader:
        ids = [i for b in loader for i in b["sample_ids"].tolist()]
    assert sorted(ids) == [0, 1, 2, 3, 8, 9, 10, 11]


def test_resume_continues_the_exact_sequence_and_refuses_another_order(v2_root):
    root, _ = v2_root
    kw = dict(seed=5, block_run=2, block_window=8)
    with _loader(root, max_steps=16, **kw) as full:  # crosses the epoch (11 steps)
        want = [b["sample_ids"].tolist() for b in full]
    with _loader(root, max_steps=6, **kw) as first:
        got = [b["sample_ids"].tolist() for b in first]
        state = first.state_dict()
    with _loader(root, max_steps=16, **kw) as second:
        second.load_state_dict(state)
        got += [b["sample_ids"].tolist() for b in second]
    assert got == want
    with _loader(root, seed=5, block_run=4, block_window=8) as other:
        with pytest.raises(CheckpointError, match="order"):
            other.load_state_dict(state)


def test_resume_with_another_loader_batch_for_grad_accum_reads_the_same_positions(tmp_path):
    """An elastic resume on 1 rank with grad accum 2 (loader batch 4) from a 2-rank run (global batch 8): the two
    micro batches after the resume are the two ranks' slices of the step the 2-rank run would have taken next.
    Before, the v2 loader refused the state ("checkpoint has global_batch=8 but this run has 4") and the
    fault suite's rank-kill rows on a format-2 root lost every later sample."""
    root, lengths = str(tmp_path), (9, 5, 12, 3, 7, 6)
    make_synthetic_root(root, lengths=lengths, height=8, width=8, block_size=4)
    kw = dict(seed=5, block_run=2, block_window=8)
    assert sum(lengths) // 8 * 8 == sum(lengths) // 4 * 4  # the same tail dropped at either batch (else refused)
    ranks = [_loader(root, batch_size=8, rank=r, world=2, max_steps=5, **kw) for r in (0, 1)]
    steps = [[b["sample_ids"].tolist() for b in r] for r in ranks]
    with _loader(root, batch_size=8, rank=0, world=2, max_steps=3, **kw) as first:
        list(first)
        state = first.state_dict()
    for r in ranks:
        r.close()
    with _loader(root, batch_size=4, max_steps=10, **kw) as one:
        one.load_state_dict(state)
        assert one.steps_done == 6  # 3 optimizer steps of 2 micro batches
        micro = [b["sample_ids"].tolist() for b in one]
    assert micro == [steps[0][3], steps[1][3], steps[0][4], steps[1][4]]


def test_loss_ignores_the_padded_action_rows(tmp_path):
    """A v2 batch whose samples run past their episode's end: the loss takes no gradient from the
    predictions at padded rows (action_valid False) and does from the real ones. As in GR00T, padded
    rows (repeats of the last row) are still part of the action head's input sequence; only the loss
    masks them. The model is built from the v2 root as the trainer does."""
    from loongforge.train.config import DataConfig, RunConfig, TrainConfig
    from loongforge.train.data.training_data import load_training_data
    from loongforge.train.model.model import VLAModel
    from loongforge.train.trainer import model_config

    root = str(tmp_path)
    make_synthetic_root(root, lengths=(3, 2), height=16, width=16)
    cfg = TrainConfig(recipe="tiny", data=DataConfig(root=root, global_batch_size=4, action_horizon=4),
                      run=RunConfig(run_dir=str(tmp_path / "run")))
    data = load_training_data(cfg.data)
    assert data.max_frames == 1 and data.dataset.action_horizon == 4
    torch.manual_seed(0)
    model = VLAModel(model_config(cfg, data))
    with BlockLoader(root, dataset=data.ds, batch_size=4, deltas=data.deltas, max_steps=1) as loader:
        batch = next(iter(loader))
    batch.pop("meta")
    valid = batch["action_valid"]
    assert (~valid).any() and valid.any()
    grads = {}
    model.velocity = _grad_tap(model.velocity, grads, "velocity")
    model.bin_logits = _grad_tap(model.bin_logits, grads, "logits")
    model(batch, torch.randn(batch["action"].shape), torch.rand(4))["loss"].backward()
    for name in ("velocity", "logits"):
        per_row = grads[name].abs().flatten(2).sum(-1)  # (B, H)
        assert (per_row[~valid] == 0).all() and (per_row[valid] > 0).all(), name


def _grad_tap(fn, grads, name):
    def wrapped(*args, **kw):
        out = fn(*args, **kw)
        out.register_hook(lambda g: grads.__setitem__(name, g))
        return out
    return wrapped


@pytest.mark.slow
def test_v2_through_real_cache_daemon(v2_root, tmp_path):
    """Workers read v2 blocks through a real `loongforge cache serve` on the v2 root (shard level);
    the rank's announce reaches the daemon as a plan; batches equal the origin's."""
    import json
    import os
    import subprocess
    import sys
    import time

    from loongforge.train.data.sources import SourceSpec

    root, _ = v2_root
    sock = str(tmp_path / "cache.sock")
    cli = [sys.executable, "-m", "loongforge", "cache"]
    daemon = subprocess.Popen([*cli, "serve", "--origin", root, "--socket", sock, "--ram-dir", str(tmp_path / "ram"),
                               "--ram-budget", "64MiB", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-budget", "256MiB"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert daemon.poll() is None, f"cache daemon exited: {daemon.stdout.read()[-2000:]}"
            assert time.monotonic() < deadline, "cache daemon did not create its socket in 30 s"
            time.sleep(0.1)
        spec = SourceSpec(root=root, cache_socket=sock)
        with _loader(root, max_steps=4, source=spec, num_workers=1) as via_cache:
            a = [(bt["sample_ids"].clone(), bt["frames"]["wrist"].clone()) for bt in via_cache]
        with _loader(root, max_steps=4) as origin:
            b = [(bt["sample_ids"].clone(), bt["frames"]["wrist"].clone()) for bt in origin]
        assert len(a) == 4 and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
        stats = subprocess.run([*cli, "stats", "--socket", sock, "--json"], capture_output=True, text=True,
                               timeout=30)
        doc = json.loads(stats.stdout)
        served = sum(doc["counters"]["hits"].values()) + sum(doc["counters"]["fills"].values())
        assert served > 0, doc["counters"]
        assert doc["plans"], "the loader's announce() did not reach the daemon"
    finally:
        subprocess.run([*cli, "stop", "--socket", sock], capture_output=True, timeout=30)
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=5)


def test_action_known_of_converted_roots_masks_actions(tmp_path):
    """Roots converted from v1 carry action_known (rows whose action v1 never stored): those rows
    are invalid in the batch even inside the episode."""
    from loongforge.shared.synthetic import synthetic_dataset_info, synthetic_episode
    from loongforge.shared.writer import RootWriter

    root = str(tmp_path)
    frames, arrays = synthetic_episode(0, 8, 8, 8, ("front",), 3, 2)
    arrays["action_known"] = np.arange(8) < 5
    with RootWriter(root, synthetic_dataset_info(8, 8, ("front",), 3, 2), block_size=4) as w:
        w.add_episode(0, frames, arrays)
    with _loader(root, batch_size=8, max_steps=1, deltas=DeltaSpec(action_horizon=4), block_run=1) as loader:
        batch = next(iter(loader))
    for row, t in enumerate(batch["sample_ids"].tolist()):
        rows = t + np.arange(4)
        assert batch["action_valid"][row].tolist() == ((rows < 8) & (rows < 5)).tolist()
