"""A run dir that holds checkpoints is never trained over by accident (train/resilience/rundir.py): every
launcher path refuses a launch without --resume with one line naming the latest checkpoint and both ways
on, exit 2 (torchrun: 1, its own rule for any failed rank), before any process group; --overwrite moves
the old run aside and never deletes it."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.ckpt.test_ckpt_resilience import COMMON  # noqa: E402
from tests.train.train_launch import VENV_BIN, deepspeed_cmd, launch, torchrun_cmd  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
OLD = "step00000120"


def _old_run(run_dir) -> dict:
    """A finished 120-step run as the launcher sees it: `latest`, its checkpoint, metrics; returns a snapshot."""
    ck = run_dir / "checkpoints" / OLD
    ck.mkdir(parents=True)
    (ck / "mp_rank_00_model_states.pt").write_bytes(b"weights of a finished run")
    (run_dir / "checkpoints" / "latest").write_text(OLD)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(120)))
    return _snapshot(run_dir)


def _snapshot(run_dir) -> dict:
    out = {}
    for dirpath, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, run_dir)] = open(path, "rb").read()
    return out


def _refusals(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if "already holds a run" in ln]


def test_every_launcher_refuses_to_train_over_checkpoints_with_one_line(train_root, tmp_path):
    """Plain rank, `loongforge train`, torchrun, the deepspeed launcher, `--elastic` and the launch script's
    preflight, each on a run dir holding a 120-step run without --resume: nothing written, one line that
    names step00000120, --resume and --overwrite. (Before this, every path but --elastic trained from step 0
    over the run: `latest` moved back, metrics.jsonl cut.)"""
    root, _ = train_root
    run_dir = tmp_path / "run"
    before = _old_run(run_dir)
    args = ["--data", root, "--run-dir", str(run_dir), "--steps", "2", *COMMON]
    paths = {
        "plain": ([sys.executable, "-m", "loongforge.train", *args], 2),
        "cli": ([str(VENV_BIN / "loongforge"), "train", *args], 2),
        "torchrun": (torchrun_cmd(2, ["-m", "loongforge.train", *args]), 1),  # torchrun: 1 for any failed rank
        "deepspeed": (deepspeed_cmd(2, ["--module", "loongforge.train", *args, "--device", "cpu"]), 2),
        "elastic": ([str(VENV_BIN / "loongforge"), "train", "--elastic", "--min-ranks", "1", "--max-ranks", "2",
                     *args], 2),
        "launch_torchrun.sh": (["bash", os.path.join(REPO, "infra", "train", "launch_torchrun.sh"), *args], 2),
    }
    for name, (cmd, code) in paths.items():
        proc = launch(cmd, cwd=str(tmp_path), timeout=180, warm=False)  # each launcher as users start it
        lines = _refusals(proc.stderr)
        assert proc.returncode == code and len(lines) == 1, (name, proc.returncode, proc.stderr[-3000:])
        assert f"already holds a run (latest checkpoint {OLD}): add --resume" in lines[0], (name, lines)
        assert "--overwrite to move it aside" in lines[0], (name, lines)
        if name != "torchrun":  # torchrun prints its own ChildFailedError for the rank's exit 2
            assert "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
        assert _snapshot(run_dir) == before, name  # nothing written, nothing moved, no process group


# make test: test_ports.py's torchrun-script launch moves a finished run aside with --overwrite; this is
# the plain rank's path and the new run's first rows.
@pytest.mark.full
def test_overwrite_moves_the_old_run_aside_and_trains_afresh(train_root, tmp_path):
    root, _ = train_root
    run_dir = tmp_path / "run"
    before = _old_run(run_dir)
    proc = subprocess.run([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", str(run_dir),
                           "--steps", "1", "--overwrite", *COMMON], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert _snapshot(aside) == before  # every file of the old run, byte for byte
    assert f"moved aside to {aside}" in proc.stderr
    assert (run_dir / "checkpoints" / "latest").read_text() == "step00000001"
    assert [json.loads(ln)["step"] for ln in open(run_dir / "metrics.jsonl")] == [0]


def test_move_aside_keeps_the_lock_and_the_node_registry(tmp_path):
    from loongforge.train.resilience.rundir import move_aside

    run_dir = tmp_path / "run"
    (run_dir / "elastic" / "nodes").mkdir(parents=True)
    (run_dir / "run.lock").write_text("{}")
    (run_dir / "logs").mkdir()
    (run_dir / "metrics.jsonl").write_text("x\n")
    dest = move_aside(str(run_dir))
    assert sorted(os.listdir(dest)) == ["logs", "metrics.jsonl"]
    assert sorted(os.listdir(run_dir)) == ["elastic", "run.lock"]
    assert move_aside(str(run_dir)) is None  # nothing left to move


@pytest.mark.parametrize("flags", [["--resume"], ["--overwrite"]])
def test_resume_or_overwrite_is_not_refused(tmp_path, flags):
    from loongforge.train.resilience.rundir import refuse_over_checkpoints

    _old_run(tmp_path / "run")
    refuse_over_checkpoints(str(tmp_path / "run"), resume="--resume" in flags, overwrite="--overwrite" in flags)
