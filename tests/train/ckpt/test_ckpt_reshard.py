"""`loongforge ckpt reshard`: train 10 steps in layout A, reshard, continue 10 steps in layout B; the
losses equal those of continuing in A (fp32, CPU, real gloo launches). Plus the TP index rules
against the trainer's own TP module swap, and the layout parser."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys

import pytest
import torch

from tests.train.train_launch import assert_ok as _ok, launch, read_metrics as _metrics, torchrun

from loongforge.shared.errors import CheckpointError, ConfigError  # noqa: E402

COMMON = ["--batch-size", "8", "--recipe", "tiny", "--seed", "1", "--block-window", "8", "--lr", "3e-3",
          "--no-ds-breakdown", "--workers", "1", "--dit-dropout", "0",  # dropout masks follow the rank layout
          "--lr-schedule", "constant", "--warmup-steps", "1"]  # runs of different --steps continue each other


def _reshard(run_dir, to, tag, cwd):
    """`loongforge ckpt reshard` in this process (its command line as a process: test_reshard_cli_...)."""
    from loongforge.cli import main

    assert main(["ckpt", "reshard", run_dir, "--to", to, "--tag", tag]) == 0
    root = os.path.join(run_dir, "checkpoints")
    new = open(os.path.join(root, "latest")).read().strip()
    assert new.startswith(tag + "_") and os.path.isdir(os.path.join(root, tag))  # source kept, latest moved
    return new, json.load(open(os.path.join(root, new, "loongforge.json")))


def _same_continuation(want, got, first):
    """Steps first.. of `got` (layout B) against `want` (layout A): same samples, losses within 1e-4."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    ids = lambda r: sorted(x for row in r["sample_ids"] for x in row)  # noqa: E731 - rank split differs
    for a, b in zip(want[first:], got[first:], strict=True):
        assert ids(a) == ids(b), b["step"]
        for key in ("loss", "flow_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-4), (b["step"], key, a[key], b[key])


@pytest.mark.slow
@pytest.mark.full  # 60+ s; make test converts through the elastic test (test_faults.py, ZeRO-2 w2 -> w1 losses) and
# test_ckpt_resilience's ZeRO-3 rank-count change
def test_zero3_two_ranks_resharded_to_zero2_one_rank(train_root, tmp_path):
    root, _ = train_root
    a = str(tmp_path / "a")
    _ok(torchrun(2, ["--data", root, "--run-dir", a, "--zero", "3", "--steps", "20", "--save-every", "10", *COMMON],
                 cwd=str(tmp_path), timeout=400))
    b = str(tmp_path / "b")
    shutil.copytree(a, b)
    tag, doc = _reshard(b, "world=1,zero=2", "step00000010", str(tmp_path))
    src = json.load(open(os.path.join(b, "checkpoints", "step00000010", "loongforge.json")))
    assert (doc["world"], doc["zero_stage"], doc["step"]) == (1, 2, 10)
    assert doc["loader"] == src["loader"] and doc["model"] == src["model"]  # data position, model config kept
    assert doc["resharded"]["from"] == {"world": 2, "zero_stage": 3, "tp": 1, "sp": 1}
    proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", b, "--zero", "2",
                   "--steps", "20", "--resume", *COMMON], cwd=str(tmp_path), timeout=400)
    _ok(proc)
    assert "Adam moments and step kept" in proc.stderr
    got = _metrics(b)
    assert all(r["world"] == 1 for r in got[10:])
    _same_continuation(_metrics(a), got, 10)


@pytest.fixture(scope="module")
def tp2_run(train_root, tmp_path_factory):
    """Layout A for the TP tests: TP 2 on 2 ranks, ZeRO-2, 20 steps, checkpoints at 10 and 20."""
    root, _ = train_root
    work = tmp_path_factory.mktemp("reshard_tp2")
    a = str(work / "a")
    _ok(torchrun(2, ["--data", root, "--run-dir", a, "--zero", "2", "--tp", "2", "--steps", "20",
                     "--save-every", "10", *COMMON], cwd=str(work), timeout=400))
    return a


def _tp1_leg(a, root, tmp_path, steps):
    """A's step 10 resharded to TP 1 on 1 rank, trained to `steps` (saving there)."""
    b = str(tmp_path / "b")
    shutil.copytree(a, b)
    _, doc = _reshard(b, "world=1,zero=2,tp=1", "step00000010", str(tmp_path))
    assert doc["parallel"] == {"tp": 1, "sp": 1} and doc["resharded"]["from"]["tp"] == 2
    _ok(launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", b, "--zero", "2",
                "--steps", str(steps), "--save-every", str(steps), "--resume", *COMMON], cwd=str(tmp_path),
               timeout=400))
    return b


@pytest.mark.slow
@pytest.mark.full  # two more launches; make test keeps the ZeRO-3 -> ZeRO-2 reshard and the TP split/merge rules
def test_tp2_resharded_to_tp1_one_rank(tp2_run, train_root, tmp_path):
    """The column/row/qkv shards and their Adam moments are gathered into TP 1: A's losses continue."""
    root, _ = train_root
    b = _tp1_leg(tp2_run, root, tmp_path, 20)
    got = _metrics(b)
    assert [(r["tp"], r["world"]) for r in got[10:]] == [(1, 1)] * 10
    _same_continuation(_metrics(tp2_run), got, 10)


@pytest.mark.full
def test_tp1_resharded_back_to_tp2_zero3(tp2_run, train_root, tmp_path):
    """TP 2 -> step 10 -> TP 1 (1 rank) -> step 15 -> TP 2 with ZeRO-3 (2 ranks) -> 20: split again, and
    every step continues the TP-2 run's losses."""
    root, _ = train_root
    b = _tp1_leg(tp2_run, root, tmp_path, 15)
    _, doc = _reshard(b, "world=2,zero=3,tp=2", "step00000015", str(tmp_path))
    assert doc["parallel"] == {"tp": 2, "sp": 1} and doc["resharded"]["from"] == \
        {"world": 1, "zero_stage": 2, "tp": 1, "sp": 1}
    _ok(torchrun(2, ["--data", root, "--run-dir", b, "--zero", "3", "--tp", "2", "--steps", "20", "--resume",
                     *COMMON], cwd=str(tmp_path), timeout=400))
    got = _metrics(b)
    assert [r["tp"] for r in got[10:]] == [1] * 5 + [2] * 5
    _same_continuation(_metrics(tp2_run), got, 10)


def test_layout_parse():
    from loongforge.train.ckpt.reshard import Layout

    assert Layout.parse("world=4,zero=2,tp=1", default_world=2) == Layout(world=4, zero=2, tp=1)
    assert Layout.parse("dp=2,zero=3,tp=2", default_world=1) == Layout(world=4, zero=3, tp=2)
    assert Layout.parse("zero=1", default_world=8).world == 8
    assert Layout(world=4, zero=2, tp=2).slug() == "w4z2t2"
    assert Layout.parse("dp=1,zero=3,sp=2", default_world=1) == Layout(world=2, zero=3, sp=2)
    for bad, match in (("world=3,zero=2,tp=2", "multiple of tp"), ("world=2", "ZeRO stage"),
                       ("world=2,zero=0,tp=2", "zero=1"), ("world=2,zero=2,tp=2,sp=2", "multiple of tp"),
                       ("w=2,zero=2", "expected")):
        with pytest.raises(ConfigError, match=match):
            Layout.parse(bad, default_world=2)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_rules_match_the_trainers_module_swap(tp):
    """split_tp cuts exactly the shards apply_tensor_parallel gives TP rank t (column-parallel rows by head,
    row-parallel columns, the rest replicated), and merge_tp inverts it bit for bit, on N1.6 (small: every
    tower's heads split 4 ways)."""
    from loongforge.train.ckpt.reshard import full_shapes, local_shape, merge_tp, split_tp, tp_kinds
    from loongforge.train.model.model import Gr00tN1d6
    from loongforge.train.parallel.tensor_parallel import TP_PLAN, apply_tensor_parallel, tp_modules
    from loongforge.train.recipes import small

    class _Rank:  # the three things apply_tensor_parallel asks of the parallel state
        def __init__(self, t):
            self.t = t

        def group(self, kind):
            return None

        def size(self, kind):
            return tp

        def rank_in(self, kind):
            return self.t

    torch.manual_seed(0)
    cfg = small().model
    full_model = Gr00tN1d6(cfg)
    full = {n: p.detach().clone() for n, p in full_model.named_parameters()}
    kinds = tp_kinds({"model": cfg.to_dict()})
    assert full_shapes({"model": cfg.to_dict()}) == {n: v.shape for n, v in full.items()}
    split = sum(1 + (kind == "col") for _, m in tp_modules(full_model) for _, kind in TP_PLAN[type(m).__name__]
                if kind != "sum")  # a weight each, and the column-parallel biases (every planned linear has one
    # but Qwen3's, which have none)
    assert set(kinds.values()) == {"col", "row"} and len(kinds) <= split
    shards = []
    for t in range(tp):
        m = copy.deepcopy(full_model)
        apply_tensor_parallel(m, _Rank(t))
        local = dict(m.named_parameters())
        assert local.keys() == full.keys()  # the swap keeps every name: checkpoints stay interchangeable
        for name, value in full.items():
            assert torch.equal(split_tp(value, kinds.get(name), t, tp), local[name].detach()), (name, t)
            # ZeRO-3's universal files are flat: the TP-local shape is rebuilt from the sidecar's model
            assert local_shape(value.shape, kinds.get(name), tp) == local[name].shape, name
        shards.append(local)
    for name, value in full.items():
        assert torch.equal(merge_tp([s[name].detach() for s in shards], kinds.get(name), name), value), name


def test_refusals_name_the_converter():
    from loongforge.train.ckpt.checkpoint import check_layout
    from loongforge.train.ckpt.reshard_io import load_tag_dir

    with pytest.raises(CheckpointError, match=r"loongforge ckpt reshard RUN --to world=1,zero=2,tp=1"):
        check_layout({"world": 2, "zero_stage": 3}, "RUN", "step00000010", world=1, zero_stage=2)
    with pytest.raises(CheckpointError, match=r"loongforge ckpt reshard RUN --to world=4,zero=3,tp=2"):
        check_layout({"world": 2, "zero_stage": 2, "parallel": {"tp": 2}}, "RUN", "step00000010", world=4,
                     zero_stage=3)
    doc = {"parallel": {"tp": 2}, "resharded": {"version": 1, "dir": "universal_tp{tp:02d}"}}
    assert load_tag_dir(doc, "step00000010_w4z2t2", 3) == os.path.join("step00000010_w4z2t2", "universal_tp01")
    assert load_tag_dir({}, "step00000010", 0) is None
    with pytest.raises(CheckpointError, match="reshard it again"):
        load_tag_dir({**doc, "resharded": {"version": 99}}, "t", 0)


def test_resume_hint_keeps_the_global_batch_and_micro_batch():
    from loongforge.train.ckpt.reshard import Layout, check_batch, resume_hint

    dp2 = {"world": 2, "zero_stage": 2, "global_batch_size": 8}  # micro 4, no grad_accum recorded = 1
    assert resume_hint(dp2, Layout(world=1, zero=2)) == "--zero 2 --tp 1 --batch-size 8 --grad-accum 2 --resume"
    assert "--grad-accum 1 " in resume_hint(dp2, Layout(world=4, zero=2))
    accum2 = {"world": 1, "zero_stage": 2, "global_batch_size": 8, "grad_accum": 2}  # micro 4
    assert "--grad-accum 1 " in resume_hint(accum2, Layout(world=2, zero=3))
    assert "--sp 2 --batch-size 8 --grad-accum 2 " in resume_hint(dp2, Layout(world=2, zero=3, sp=2))
    with pytest.raises(ConfigError, match=r"3 data-parallel ranks cannot split this checkpoint's global batch of 8"):
        check_batch(dp2, Layout(world=3, zero=2))
    check_batch(dp2, Layout(world=6, zero=2, tp=3))  # DP 2: fine


def _tree(path: str) -> list[tuple[str, int]]:
    return sorted((os.path.join(d, f), os.path.getsize(os.path.join(d, f))) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.slow
def test_reshard_cli_refuses_an_unsplittable_batch_and_hints_grad_accum(zero3_run, tmp_path):
    """A 2-rank global-batch-8 run: world=3 is refused (exit 2, one line) before anything is written;
    world=1 prints a resume hint with --grad-accum 2 (the source's micro-batch of 4)."""
    run = str(tmp_path / "run")
    shutil.copytree(zero3_run, run)
    before = _tree(run)
    cmd = [sys.executable, "-m", "loongforge", "ckpt", "reshard", run, "--to"]
    bad = launch([*cmd, "world=3,zero=2"], cwd=str(tmp_path), timeout=120)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert len(bad.stderr.strip().splitlines()) == 1 and "global batch of 8" in bad.stderr, bad.stderr
    assert _tree(run) == before  # nothing written, `latest` unmoved
    ok = launch([*cmd, "world=1,zero=2"], cwd=str(tmp_path), timeout=400)
    _ok(ok)
    assert "1 rank(s): --zero 2 --tp 1 --batch-size 8 --grad-accum 2 --resume" in ok.stdout, ok.stdout
    # The parameters the optimizer never held (the vision pooling head N1.6 never calls; a fine-tune's frozen
    # tower) are carried too: frozen.pt holds what DeepSpeed's own consolidation reads from the source.
    from loongforge.train.ckpt.weights import load_weights

    root = os.path.join(run, "checkpoints")
    new = open(os.path.join(root, "latest")).read().strip()
    frozen = torch.load(os.path.join(root, new, "frozen.pt"), weights_only=True)
    src = load_weights(run, "step00000004", 3)
    head = {n for n in src if ".vision_model.head." in n}
    assert head and set(frozen) == head
    for n in head:
        assert torch.equal(frozen[n].float(), src[n].float()), n
    assert json.load(open(os.path.join(root, new, "loongforge.json")))["resharded"]["frozen_parameters"] == len(head)
