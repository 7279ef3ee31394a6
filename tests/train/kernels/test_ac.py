"""Activation checkpointing applied from outside (train/kernels/checkpointing.py) and `loongforge tune ac`."""

import json
import os
import sys

import pytest
import torch
from torch import nn

from loongforge.train.kernels import checkpointing as memory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.train_launch import launch  # noqa: E402


class Blk(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, d)) for _ in range(2)])  # not model blocks

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x))) + sum(e(x) for e in self.experts)


class Toy(nn.Module):
    def __init__(self, depth=6):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # bare linears: not blocks
        self.trunk = nn.Module()
        self.trunk.layers = nn.ModuleList([Blk() for _ in range(depth)])
        self.head_blocks = nn.ModuleList([Blk()])

    def forward(self, x):
        for b in self.trunk.layers:
            x = b(x)
        return self.head_blocks[0](x).sum()


def test_block_lists_outermost_block_lists_only():
    got = [p for p, _ in memory.block_lists(Toy())]
    assert got == ["trunk.layers", "head_blocks"]


def test_every_n_selects_blocks_and_keeps_names_and_state_dict():
    m = Toy(depth=6)
    keys = list(m.state_dict())
    names = [n for n, _ in m.named_parameters()]
    assert memory.apply_ac(m, 4) == ["trunk.layers.0", "trunk.layers.4", "head_blocks.0"]
    assert memory.apply_ac(m, 2) == ["trunk.layers.0", "trunk.layers.2", "trunk.layers.4", "head_blocks.0"]
    assert len(memory.checkpointed(m)) == 4  # the second call replaced the first
    assert list(m.state_dict()) == keys and [n for n, _ in m.named_parameters()] == names
    assert all(type(b) is Blk for b in m.trunk.layers)
    assert memory.apply_ac(m, 0) == [] and memory.checkpointed(m) == []
    with pytest.raises(ValueError):
        memory.apply_ac(m, -1)


def test_probe_counts_exact_bytes_dedupes_storage_and_skips_params():
    lin = nn.Linear(8, 8)
    probe = memory.SavedBytesProbe(lin)
    x = torch.randn(4, 8, requires_grad=True)
    with probe.forward():
        h = lin(x)  # saves x (128 B) and the weight (a parameter: not counted)
        a = torch.relu(h)  # saves its output a (128 B)
        y = (a * a[:, :4].sum(1, keepdim=True)).sum()  # saves a again (same storage) and a (4, 1) sum
    assert probe.saved_bytes == 128 + 128 + 4 * 4
    with probe.backward():
        y.backward()
    assert probe.recompute_calls == 0


def _vla(depth, dropout=0.0):
    """The reduced N1.6 with `depth` DiT blocks and LLM layers, in training mode, and its inputs."""
    from tests.train.n16 import CFG, build, make_inputs

    cfg = CFG.replace(dit={"dropout": dropout, "num_layers": depth}, select_layer=min(depth, 3))
    return build(cfg).train(), make_inputs(0, cfg=cfg)


def _grads(model, args, every, probe=None):
    model.zero_grad(set_to_none=True)
    memory.apply_ac(model, every, probe=probe)
    torch.manual_seed(1)  # dropout draws: the recompute must replay them
    if probe is not None:
        probe.reset()
        with probe.forward():
            loss = model(*args)["loss"]
        with probe.backward():
            loss.backward()
    else:
        model(*args)["loss"].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("every", [1, 2, 3])
def test_ac_gradients_equal_no_ac_with_dropout(every):
    model, args = _vla(depth=4, dropout=0.1)
    ref = _grads(model, args, 0)
    got = _grads(model, args, every)
    assert ref.keys() == got.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_saved_bytes_fall_with_more_checkpointing_and_recompute_is_timed():
    model, args = _vla(depth=4)
    probe = memory.SavedBytesProbe(model)
    seen = {}
    for every in (0, 4, 2, 1):
        _grads(model, args, every, probe)
        seen[every] = (probe.saved_bytes, probe.recompute_calls, probe.recompute_s, len(memory.checkpointed(model)))
    assert seen[0][0] > seen[4][0] > seen[2][0] > seen[1][0] > 0
    assert [seen[e][1] for e in (0, 4, 2, 1)] == [seen[e][3] for e in (0, 4, 2, 1)]  # one recompute per block
    assert seen[0][3] == 0 < seen[4][3] < seen[2][3] < seen[1][3]
    assert seen[0][2] == 0 and seen[1][2] > 0


def test_pick_ac_least_recompute_within_budget():
    from loongforge.train.tune.ac import pick_ac

    rows = [{"every": 0, "saved_bytes": 100, "recompute_pct": 0.0},
            {"every": 4, "saved_bytes": 70, "recompute_pct": 7.0},
            {"every": 2, "saved_bytes": 50, "recompute_pct": 15.0},
            {"every": 1, "saved_bytes": 10, "recompute_pct": 30.0}]
    assert pick_ac(rows, 100) == 0 and pick_ac(rows, 80) == 4 and pick_ac(rows, 60) == 2
    assert pick_ac(rows, 10) == 1 and pick_ac(rows, 9) is None


@pytest.mark.parametrize("text,n", [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000),
                                    ("4096", 4096)])
def test_parse_bytes(text, n):
    from loongforge.train.tune.cli import parse_bytes

    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "lots", "-1GiB", "2 parsecs", "0"])
def test_parse_bytes_rejects(bad):
    from loongforge.shared.errors import ConfigError
    from loongforge.train.tune.cli import parse_bytes

    with pytest.raises(ConfigError, match="memory-budget"):
        parse_bytes(bad)


@pytest.mark.slow
def test_tune_ac_cli_prints_table_and_json(train_root, tmp_path):
    root, _ = train_root
    out = tmp_path / "ac.json"
    proc = launch([sys.executable, "-m", "loongforge", "tune", "ac", "--recipe", "tiny", "--data", root,
                   "--memory-budget", "1GiB", "--micro-batch", "2", "--reps", "1", "--json", str(out)],
                  cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recompute %" in proc.stdout and "-> --ac-every 0" in proc.stdout  # 1 GiB fits everything: off
    doc = json.loads(out.read_text())
    assert doc["kind"] == "ac" and doc["version"] == 1 and doc["choice"] == 0
    by = {r["every"]: r for r in doc["rows"]}
    assert sorted(by) == [0, 1, 2, 4, 8]
    assert by[1]["saved_bytes"] < by[0]["saved_bytes"] and by[1]["recompute_pct"] > 0 == by[0]["recompute_pct"]


@pytest.mark.slow
def test_ac_under_zero3_two_ranks_gradients_equal(ac_fp8_zero3_launch):
    """2 gloo ranks, DeepSpeed ZeRO-3, the trainer's build path (apply_memory_policies then the
    engine): full gradients with --ac-every 1 and 2 equal those without AC; also for blocks
    holding a parameter of their own (layer scale / adaLN style). One launch with test_precision's
    FP8 check (tests/train/conftest.py)."""
    proc = ac_fp8_zero3_launch
    # AC-ZERO3-OK: printed by each rank after all its AC checks passed (the FP8 part runs after it)
    assert proc.stdout.count("AC-ZERO3-OK") == 2, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_trainer_applies_ac_before_the_engine(train_root, tmp_path):
    """The real entry point with --ac-every: one rank, 2 steps, the policy log line, a loss."""
    root, _ = train_root
    run_dir = tmp_path / "run"
    proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", str(run_dir),
                   "--steps", "2", "--batch-size", "4", "--ac-every", "1", "--zero", "3"], cwd=str(tmp_path), timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert ("activation checkpointing every 1 blocks: 8 blocks (backbone.model.vision_model.vision_model.encoder."
            "layers.0, ") in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["loss"] == r["loss"] for r in rows)
