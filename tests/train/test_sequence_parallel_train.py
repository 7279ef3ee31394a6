"""The trainer with `--sp`: real launches on gloo. 2 ranks x SP 2 (one data-parallel replica, the
video tokens split in two, Ulysses attention) give the losses of 1 rank on the same global batch,
step for step, in fp32, under ZeRO-3 (the loss gradient seeded for ZeRO-3's average over SP;
gradient clipping at 1.0 binds, so the global norm must be right too) with activation
checkpointing on half the trunk blocks; the SP group's bytes are counted per step; a checkpoint
saved in the SP layout resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from tests.train.train_launch import assert_ok as _ok, launch, read_metrics as _metrics, torchrun

COMMON = ["--batch-size", "8", "--recipe", "tiny", "--seed", "1", "--block-window", "8", "--lr", "3e-3",
          "--steps", "4", "--no-ds-breakdown", "--zero", "3",
          "--ac-every", "2"]  # AC on trunk block 0 only: a recomputed block re-runs its all-to-alls in backward


@pytest.fixture(scope="module")
def sp_run(train_root, tmp_path_factory):
    root, _ = train_root
    work = tmp_path_factory.mktemp("sp2")
    run_dir = str(work / "run")
    proc = torchrun(2, ["--data", root, "--run-dir", run_dir, "--sp", "2", "--save-every", "2", *COMMON],
                    cwd=str(work), timeout=400)
    _ok(proc)
    return run_dir, proc


@pytest.mark.slow
def test_sp2_matches_one_rank(sp_run, train_root, tmp_path):
    run_dir, proc = sp_run
    root, _ = train_root
    assert "parallel plan: world=2 tp=1 sp=2 dp=1" in proc.stdout
    ref_dir = str(tmp_path / "ref")
    _ok(launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", ref_dir, *COMMON],
               cwd=str(tmp_path)))
    want, got = _metrics(ref_dir), _metrics(run_dir)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    m = json.load(open(os.path.join(run_dir, "checkpoints", "step00000004", "loongforge.json")))
    assert m["parallel"] == {"tp": 1, "sp": 2}
    # image tokens per sample in the LLM: 2 cameras x 1 frame x (56 px / 14 per patch x 0.5 unshuffle)^2
    per_image = (m["processor"]["image_edge"] // m["model"]["vision"]["patch_size"]
                 * m["model"]["downsample_ratio"]) ** 2
    n_video = 2 * len(m["data"]["video_deltas"]) * int(per_image)
    for a, b in zip(want, got, strict=True):
        assert b["sp"] == 2 and b["world"] == 2 and b["samples"] == 8
        assert b["sample_ids"] == a["sample_ids"]  # both SP ranks read the replica's batch; one row logged
        for key in ("loss", "flow_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (b["step"], key)
        sp = b["comm_groups"]["sp"]
        # at least the merge's all-gather of the (B, Nv, d) image tokens at the LLM's width: the rest
        # is Ulysses
        assert sp["payload_bytes"] >= 8 * n_video * m["model"]["text"]["hidden_size"] * 4, sp


@pytest.mark.slow
@pytest.mark.full  # make test keeps the TP2 exact-resume test ([zero3]); this is the same path with SP
def test_sp2_resume_is_exact(sp_run, train_root, tmp_path):
    """4 steps straight == 2 steps + resume (same layout) + 2 steps."""
    run_dir, _ = sp_run
    root, _ = train_root
    resumed = str(tmp_path / "resumed")
    shutil.copytree(run_dir, resumed)
    with open(os.path.join(resumed, "checkpoints", "latest"), "w") as f:
        f.write("step00000002")
    _ok(torchrun(2, ["--data", root, "--run-dir", resumed, "--sp", "2", "--resume", *COMMON], cwd=str(tmp_path),
                 timeout=400))
    want, got = _metrics(run_dir), _metrics(resumed)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for a, b in zip(want[2:], got[2:], strict=True):
        assert b["sample_ids"] == a["sample_ids"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)


@pytest.mark.slow
@pytest.mark.full  # 4 ranks: ~3 min on a loaded 2-core box
def test_sp2_dp2_hybrid_compression_matches_one_rank(train_root, tmp_path):
    """SP 2 x DP 2 under hybrid sharding (ZeRO-3 inside each SP group, the DP replicas synced by the
    compressor; ratio 1 = every bucket dense) == 1 rank, step for step."""
    root, _ = train_root
    args = ["--data", root, *COMMON, "--steps", "3"]  # the later --steps wins
    _ok(torchrun(4, [*args, "--run-dir", str(tmp_path / "hyb"), "--sp", "2", "--grad-compression", "topk",
                     "--compress-ratio", "1"], cwd=str(tmp_path), timeout=600))
    _ok(launch([sys.executable, "-m", "loongforge.train", *args, "--run-dir", str(tmp_path / "ref")],
               cwd=str(tmp_path)))
    want, got = _metrics(str(tmp_path / "ref")), _metrics(str(tmp_path / "hyb"))
    assert len(got) == 3
    for a, b in zip(want, got, strict=True):
        # one row per replica here, one row of 8 in the reference: the same samples in the step
        assert sorted(sum(b["sample_ids"], [])) == sorted(sum(a["sample_ids"], [])) and b["samples"] == 8
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["comm_groups"]["dp"]["wire_bytes"] > 0  # the replicas did exchange gradients


def test_layout_checks_for_sp():
    """Before any group: heads must split tp*sp ways; CUDA graphs, FP8 and forced fusion are refused with SP."""
    from types import SimpleNamespace

    from loongforge.shared.errors import ConfigError
    import dataclasses

    from loongforge.train.config import MemoryConfig, ParallelConfig
    from loongforge.train.parallel.plan import check_layout
    from loongforge.train.recipes import recipe

    tiny = recipe("tiny").model  # 8 LLM query heads, 4 KV heads
    cfg = SimpleNamespace(parallel=ParallelConfig(sp=2), memory=MemoryConfig())
    assert check_layout(cfg, 4, tiny) == 2
    three_kv = dataclasses.replace(tiny, text=dataclasses.replace(tiny.text, num_key_value_heads=3,
                                                                  num_attention_heads=6))
    with pytest.raises(ConfigError, match="KV heads"):
        check_layout(cfg, 4, three_kv)
    with pytest.raises(ConfigError, match="world size 3"):
        check_layout(cfg, 3, tiny)
    for mem in (MemoryConfig(cuda_graphs=True), MemoryConfig(fp8=True)):
        with pytest.raises(ConfigError, match="sequence parallel"):
            check_layout(SimpleNamespace(parallel=ParallelConfig(sp=2), memory=mem), 2, tiny)
