"""`loongforge ckpt reshard` for the two formats beyond ZeRO-1/2/3: ZeRO-0 (a plain torch AdamW inside
DeepSpeed's model-states file, ckpt_reshard_zero0.py) in and out of the universal path, and top-k
compression's error-feedback residuals (ckpt_reshard_topk.py: copied, averaged or dropped)."""

from __future__ import annotations

import logging
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.ckpt.test_ckpt_reshard import COMMON, _metrics, _ok, _reshard, _same_continuation  # noqa: E402
from tests.train.train_launch import launch, torchrun  # noqa: E402


def _adam_states(steps=3):
    """A small module and its torch AdamW after `steps` steps (param 'c' never gets a gradient)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 3), "c": torch.nn.Linear(2, 2)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for _ in range(steps):
        model["a"](torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_zero0_files_round_trip_through_the_universal_form(tmp_path):
    """model-states (module + torch AdamW state) -> per-parameter universal folders -> model-states: the
    weights and both moments come back bitwise, and one more AdamW step from the converted state equals
    the step from the original."""
    from loongforge.train.ckpt.reshard_zero0 import to_zero0_files, universal_from_zero0

    model, opt = _adam_states()
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"module": model.state_dict(), "optimizer": opt.state_dict(), "ds_version": "0.19.8",
                "global_steps": 3}, src / "mp_rank_00_model_states.pt")
    names = [n for n, _ in model.named_parameters()]
    [udir] = universal_from_zero0(str(src), str(tmp_path / "work"), 1, names)
    assert float(torch.load(os.path.join(udir, "zero", "c.weight", "step.pt"))) == 3.0
    out = tmp_path / "out"
    shutil.copytree(udir, out / "universal_tp00")
    optim = torch.load(os.path.join(udir, "zero", "optimizer_state.pt"), weights_only=False)
    to_zero0_files(str(out), str(out / "universal_tp00"), 0, {"ds_version": "0.19.8"}, optim, step=3, names=names,
                   frozen={})
    assert sorted(os.listdir(out)) == ["mp_rank_00_model_states.pt"]
    got = torch.load(out / "mp_rank_00_model_states.pt", weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.equal(got["module"][name], value), name
    for i in opt.state_dict()["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optimizer"]["state"][i][key], opt.state_dict()["state"][i][key])
    twin = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 3), "c": torch.nn.Linear(2, 2)})
    twin.load_state_dict(got["module"])
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01)
    twin_opt.load_state_dict(got["optimizer"])
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (twin, twin_opt)):
        m["a"](x).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model["a"].parameters(), twin["a"].parameters(), strict=True))


def _residual_files(tag_dir, world, buckets=(5, 3)):
    gen = torch.Generator().manual_seed(1)
    sds = {r: {"version": 1, "residuals": [torch.randn(n, generator=gen) for n in buckets]} for r in range(world)}
    for r, sd in sds.items():
        torch.save(sd, os.path.join(tag_dir, f"compressor_rank{r}.pt"))
    return sds


def test_topk_residuals_copied_averaged_or_dropped(tmp_path, caplog):
    """Same DP degree: bitwise copies. DP 2 -> 1 -> 2: each new replica holds the mean, so the pending
    gradient mass (sum of residuals / DP) is the same in every layout. TP changed: dropped, with a WARNING."""
    from loongforge.train.ckpt.reshard import Layout
    from loongforge.train.ckpt.reshard_topk import carry

    src_dir, one, two, tp2 = (tmp_path / n for n in ("src", "one", "two", "tp2"))
    for d in (src_dir, one, two, tp2):
        d.mkdir()
    sds = _residual_files(src_dir, 2)
    w2, w1 = Layout(world=2, zero=3), Layout(world=1, zero=3)
    assert carry(str(src_dir), str(two), w2, w2) == "copied"
    for r in (0, 1):
        got = torch.load(two / f"compressor_rank{r}.pt", weights_only=True)["residuals"]
        assert all(torch.equal(a, b) for a, b in zip(got, sds[r]["residuals"], strict=True))

    def mass(d, world):
        files = [torch.load(d / f"compressor_rank{r}.pt", weights_only=True)["residuals"] for r in range(world)]
        return [sum(f[i] for f in files) / world for i in range(2)]

    want = mass(src_dir, 2)
    assert carry(str(src_dir), str(one), w2, w1) == "averaged"
    back = tmp_path / "back"
    back.mkdir()
    assert carry(str(one), str(back), w1, w2) == "averaged"
    for d, world in ((one, 1), (back, 2)):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(mass(d, world), want, strict=True)), d
    with caplog.at_level(logging.WARNING, logger="loongforge.train.ckpt.reshard_topk"):
        assert carry(str(src_dir), str(tp2), w2, Layout(world=2, zero=3, tp=2)) == "dropped"
    assert not os.listdir(tp2) and "residuals dropped" in caplog.text and "pending gradient mass" in caplog.text


@pytest.mark.slow
@pytest.mark.full  # three launches: ZeRO-0 in and out of the converter, continuing one run
def test_zero0_two_ranks_to_zero2_one_rank_and_back_to_zero0(train_root, tmp_path):
    """ZeRO-0 on 2 ranks -> step 10 -> ZeRO-2 on 1 rank -> step 15 -> ZeRO-0 on 2 ranks -> 20: every step
    continues the ZeRO-0 run's losses (the torch AdamW moments and step carried both ways)."""
    root, _ = train_root
    a = str(tmp_path / "a")
    _ok(torchrun(2, ["--data", root, "--run-dir", a, "--zero", "0", "--steps", "20", "--save-every", "10",
                     *COMMON], cwd=str(tmp_path), timeout=400))
    b = str(tmp_path / "b")
    shutil.copytree(a, b)
    _, doc = _reshard(b, "world=1,zero=2", "step00000010", str(tmp_path))
    assert doc["resharded"]["from"] == {"world": 2, "zero_stage": 0, "tp": 1, "sp": 1}
    proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", b, "--zero", "2",
                   "--steps", "15", "--save-every", "15", "--resume", *COMMON], cwd=str(tmp_path), timeout=400)
    _ok(proc)
    assert "Adam moments and step kept" in proc.stderr
    _, doc = _reshard(b, "world=2,zero=0", "step00000015", str(tmp_path))
    assert (doc["zero_stage"], doc["world"], doc["resharded"]["dir"]) == (0, 2, None)
    _ok(torchrun(2, ["--data", root, "--run-dir", b, "--zero", "0", "--steps", "20", "--resume", *COMMON],
                 cwd=str(tmp_path), timeout=400))
    got = _metrics(b)
    assert [r["world"] for r in got[10:]] == [1] * 5 + [2] * 5
    _same_continuation(_metrics(a), got, 10)
    # No conversion needed: A's step 10 resumed on 1 rank with --zero 0 loads the torch optimizer as it is.
    c = str(tmp_path / "c")
    shutil.copytree(a, c)
    with open(os.path.join(c, "checkpoints", "latest"), "w") as f:
        f.write("step00000010")
    proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", c, "--zero", "0",
                   "--steps", "12", "--resume", *COMMON], cwd=str(tmp_path), timeout=400)
    _ok(proc)
    assert "re-initialized" not in proc.stderr
    got = _metrics(c)
    assert [r["world"] for r in got[10:]] == [1, 1]
    _same_continuation(_metrics(a)[:12], got, 10)


@pytest.mark.slow
@pytest.mark.full  # three launches and two conversions
def test_topk_run_resharded_to_one_rank_and_back(train_root, tmp_path):
    """`--grad-compression topk` (ZeRO-3 inside the SP group, top-k across DP): 2 ranks -> step 2 -> 1 rank ->
    step 3 -> 2 ranks -> 4. The weights and Adam state travel exactly (the first step after the first
    conversion repeats the 2-rank run's loss), the residuals by the averaging rule (each file the mean), and
    both resumed launches train on."""
    from loongforge.train.ckpt.files import weights_only_loads

    root, _ = train_root
    topk = ["--grad-compression", "topk", "--zero", "3"]
    a = str(tmp_path / "a")
    _ok(torchrun(2, ["--data", root, "--run-dir", a, *topk, "--steps", "4", "--save-every", "2", *COMMON],
                 cwd=str(tmp_path), timeout=400))
    b = str(tmp_path / "b")
    shutil.copytree(a, b)
    tag, doc = _reshard(b, "world=1,zero=3", "step00000002", str(tmp_path))
    assert doc["resharded"]["topk_residuals"] == "averaged"
    ck = os.path.join(b, "checkpoints")
    with weights_only_loads():
        src = [torch.load(os.path.join(ck, "step00000002", f"compressor_rank{r}.pt"))["residuals"] for r in (0, 1)]
        got = torch.load(os.path.join(ck, tag, "compressor_rank0.pt"))["residuals"]
    assert all(torch.allclose(g, (x + y) / 2, atol=1e-7) for g, x, y in zip(got, *src, strict=True))
    _ok(launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", b, *topk, "--steps", "3",
                "--save-every", "3", "--resume", *COMMON], cwd=str(tmp_path), timeout=400))
    rows = _metrics(b)
    assert rows[2]["world"] == 1 and rows[2]["loss"] == pytest.approx(_metrics(a)[2]["loss"], rel=1e-4, abs=1e-4)
    _, doc = _reshard(b, "world=2,zero=3", "step00000003", str(tmp_path))
    assert doc["resharded"]["topk_residuals"] == "averaged"
    _ok(torchrun(2, ["--data", root, "--run-dir", b, *topk, "--steps", "4", "--resume", *COMMON],
                 cwd=str(tmp_path), timeout=400))
    rows = _metrics(b)
    assert [r["world"] for r in rows] == [2, 2, 1, 2] and all(0 < r["loss"] < 10 for r in rows)
