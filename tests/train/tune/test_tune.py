"""`loongforge tune batch` (train/tune/batch.py) and the trainer's --batch-plan."""

import json
import os
import sys

import pytest

from loongforge.shared.errors import ConfigError
from loongforge.train.tune import batch as tune_batch
from loongforge.train.tune.results import load_plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.train_launch import launch  # noqa: E402


@pytest.mark.parametrize("edge,limit,want", [(37, 256, 37), (1, 256, 1), (0, 256, 0), (500, 256, 256),
                                             (64, 64, 64), (63, 64, 63)])
def test_largest_fit_search(edge, limit, want):
    calls = []

    def check(m):
        calls.append(m)
        return m <= edge, m * 10

    m, used = tune_batch.largest_fit(check, limit)
    assert m == want and (used == m * 10 or m == 0)
    assert len(calls) <= 2 * limit.bit_length() + 1 and len(set(calls)) == len(calls)  # no repeated probe
    for guess in (2, want, want + 1, 30, limit):  # any guess: same answer, probes stay near it
        calls.clear()
        assert tune_batch.largest_fit(check, limit, guess)[0] == want
        assert len(set(calls)) == len(calls)
        if guess == want and 1 < want < limit:
            assert max(calls) == want + 1  # a right guess costs one probe above the edge


def test_affine_guess():
    assert tune_batch.affine_guess(100, 150, 1000, 256) == 19  # 100 + 18 * 50 = 1000
    assert tune_batch.affine_guess(100, 150, 10_000, 64) == 64 and tune_batch.affine_guess(100, 150, 50, 64) == 1
    assert tune_batch.affine_guess(100, 100, 1000, 64) is None


@pytest.fixture(scope="module")
def workload(train_root):
    from loongforge.train.tune.ac import Workload

    w = Workload("tiny", train_root[0], 2, device="cpu", video_deltas=(-1, 0))  # K = 2 frames per sample
    yield w
    w.close()


def _bytes(w, micro, frames, every):
    from loongforge.train.kernels.checkpointing import SavedBytesProbe, apply_ac
    from loongforge.train.tune.ac import measure_step

    probe = SavedBytesProbe(w.model)
    apply_ac(w.model, every, probe=probe)
    try:
        return measure_step(w, probe, micro, frames, backward=False)["saved_bytes"]
    finally:
        apply_ac(w.model, 0)


def test_tune_batch_finds_the_edge_per_frame_count(workload):
    w = workload
    budget = int(_bytes(w, 5, 2, 0) * 1.02)  # 5 fits at 2 frames, 6 would not (bytes grow ~linearly)
    assert [r["frames"] for r in tune_batch.tune_batch(w, budget, limit=64)["rows"]] == [2]  # the run's K alone
    res = tune_batch.tune_batch(w, budget, ac_every=0, limit=64, frame_counts=(2, 1))
    rows = {r["frames"]: r for r in res["rows"]}
    assert sorted(rows) == [1, 2]
    assert res["micro_batch"] == rows[2]["micro_batch"] == 5 and res["frames"] == 2
    assert rows[2]["bytes"] <= budget < _bytes(w, 6, 2, 0)
    assert rows[1]["micro_batch"] > rows[2]["micro_batch"]  # fewer frames, shorter sequence, more samples
    with_ac = tune_batch.tune_batch(w, budget, ac_every=1, limit=64, frame_counts=(2,))
    assert with_ac["micro_batch"] > 5  # checkpointing every block frees memory for samples
    table = tune_batch.format_batch_table(res)
    assert "micro-batch 5 at 2 frames" in table


def test_tune_batch_nothing_fits(workload):
    res = tune_batch.tune_batch(workload, 1000, limit=8, frame_counts=(2,))
    assert res["micro_batch"] == 0 and "not even micro-batch 1 fits" in tune_batch.format_batch_table(res)


def _plan(tmp_path, **kw):
    doc = {"version": 1, "kind": "batch", "micro_batch": 6, "frames": 2, "rows": [], **kw}
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(doc))
    return str(p)


def test_batch_plan_overrides_global_batch(tmp_path, monkeypatch):
    import argparse

    from loongforge.train.flags import add_train_args, config_from_args

    p = argparse.ArgumentParser()
    add_train_args(p)
    monkeypatch.setenv("WORLD_SIZE", "2")
    a = p.parse_args(["--data", "d", "--run-dir", "r", "--grad-accum", "3", "--batch-plan", _plan(tmp_path),
                      "--ac-every", "4"])
    cfg = config_from_args(a)
    assert cfg.data.global_batch_size == 6 * 2 * 3 and cfg.memory.ac_every == 4
    assert config_from_args(p.parse_args(["--data", "d", "--run-dir", "r"])).data.global_batch_size == 8


@pytest.mark.parametrize("kw,msg", [({"kind": "ac"}, "not a `loongforge tune batch` result"),
                                    ({"version": 7}, "format version 7"),
                                    ({"micro_batch": 0}, "found no micro-batch")])
def test_batch_plan_rejects(tmp_path, kw, msg):
    with pytest.raises(ConfigError, match=msg):
        load_plan(_plan(tmp_path, **kw))
    with pytest.raises(ConfigError, match="cannot read"):
        load_plan(str(tmp_path / "missing.json"))


@pytest.mark.slow
def test_tune_batch_cli(train_root, tmp_path):
    out = tmp_path / "b.json"
    proc = launch([sys.executable, "-m", "loongforge", "tune", "batch", "--recipe", "tiny", "--data", train_root[0],
                   "--video-deltas=-1,0", "--memory-budget", "8MiB", "--ac-every", "2", "--limit", "32",
                   "--json", str(out)],
                  cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kind"] == "batch" and doc["ac_every"] == 2 and 1 <= doc["micro_batch"] <= 32
    assert f"micro-batch {doc['micro_batch']} at 2 frames" in proc.stdout
    assert load_plan(str(out))["micro_batch"] == doc["micro_batch"]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_fixed_sample_shape_settles_allocator_after_warmup(train_root):
    """Every batch of a run has one shape (K frames per sample): after the first steps, further
    steps allocate no new CUDA segments (torch.cuda.memory_stats)."""
    import torch

    from loongforge.train.kernels.checkpointing import SavedBytesProbe
    from loongforge.train.tune.ac import Workload, measure_step

    w = Workload("tiny", train_root[0], 4, device="cuda", video_deltas=(-1, 0))
    try:
        probe = SavedBytesProbe(w.model)
        segments = []
        for _ in range(4):
            for _ in range(2):
                measure_step(w, probe, 4)
            segments.append(torch.cuda.memory_stats()["segment.all.allocated"])
        assert segments[1] == segments[2] == segments[3], segments
    finally:
        w.close()


def test_tune_workload_reads_a_root_with_the_default_deltas(tmp_path):
    """`loongforge tune --data ROOT`: the batch comes from the BlockLoader with the trainer's default
    delta indices (one frame per camera); without --data, a synthetic root at 4 frames per sample."""
    import torch

    from loongforge.shared.synthetic import make_synthetic_root
    from loongforge.train.tune.ac import Workload

    root = str(tmp_path / "root")
    make_synthetic_root(root, lengths=(12, 9), height=16, width=16, block_size=4)
    w = Workload("tiny", root, 2, device="cpu")
    try:
        assert w.max_frames == 1 and w.base["action"].shape[0] == 8
        batch, noise, t = w.batch(3)
        assert batch["action"].shape[0] == 3 and torch.isfinite(w.loss(batch, noise, t))
    finally:
        w.close()
    synthetic = Workload("tiny", None, 2, device="cpu")
    try:
        assert synthetic.max_frames == 4 and synthetic.base["frames"]["front"].shape[:2] == (8, 4)
    finally:
        synthetic.close()
