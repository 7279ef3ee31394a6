"""The elastic supervisor end to end under ZeRO-2, down and back up: 2 ranks -> a rank lost -> 1 rank ->
capacity returns -> 2 ranks. Each rank-count change converts the checkpoint (elastic/reshard.py), so every
step's loss equals an uninterrupted 2-rank run's: data order, noise and Adam state all continue."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.ckpt.test_ckpt_resilience import COMMON, _kill_tree, _metrics, _ok  # noqa: E402
from loongforge.train.resilience.owner import rank_pid  # noqa: E402
from tests.train.resilience.test_faults import _global_order, _wait_steps  # noqa: E402
from tests.train.train_launch import VENV_BIN, launch_env, torchrun  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 16


def _wait_for(pred, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"condition not met before the deadline (supervisor exit {proc.poll()})")


def _elastic_events(run_dir, action):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip().endswith("}")]
    return [r for r in rows if r.get("event") == "elastic" and r["action"] == action]


@pytest.mark.full  # four launches (a reference and three elastic attempts), two conversions
def test_elastic_down_and_back_up_matches_the_uninterrupted_run(train_root, tmp_path):
    root, index = train_root
    args = ["--data", root, "--steps", str(STEPS), "--zero", "2", "--save-every", "4", *COMMON]
    ref = str(tmp_path / "ref")
    _ok(torchrun(2, ["--run-dir", ref, *args], cwd=str(tmp_path), timeout=600))
    run_dir, cap = str(tmp_path / "run"), tmp_path / "capacity"
    # later launches resume past step 7 or have no rank 1
    env = launch_env(dict(os.environ, LOONGFORGE_INJECT_HANG="7@1"))
    proc = subprocess.Popen([str(VENV_BIN / "loongforge"), "train", "--elastic", "--min-ranks", "1", "--max-ranks",
                             "2", "--capacity-file", str(cap), "--run-dir", run_dir, *args], cwd=str(tmp_path),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_steps(proc, run_dir, 6)  # step 7 never starts on 2 ranks: rank 1 blocks there
        cap.write_text("1")
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
        _wait_for(lambda: len(_elastic_events(run_dir, "launch")) == 2, proc)  # the 1-rank attempt has started
        cap.write_text("2")  # capacity returns: the supervisor scales up at the next checkpoint (step 8)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    launches = [(e["ranks"], e["grad_accum"]) for e in _elastic_events(run_dir, "launch")]
    assert launches == [(2, 1), (1, 2), (2, 1)], launches
    conv = _elastic_events(run_dir, "reshard")
    # The scale-up stop comes once the step-8 checkpoint is published: the ranks write one more at the step
    # in flight, which is how far a loaded machine got by then (8 to 13 seen), not a fixed step.
    up = int(conv[1]["from_tag"][4:]) if len(conv) == 2 else -1
    assert [(c["ok"], c["from_tag"], c["tag"]) for c in conv] == [
        (True, "step00000004", "step00000004_w1z2t1"), (True, f"step{up:08d}", f"step{up:08d}_w2z2t1")], conv
    assert 8 <= up < STEPS, conv
    want = _metrics(ref)
    got = [r for r in _metrics(run_dir) if "event" not in r]
    assert [r["step"] for r in got] == list(range(STEPS))
    assert [r["world"] for r in got] == [2] * 4 + [1] * (up - 4) + [2] * (STEPS - up)
    seen = [sorted(i for rank_ids in r["sample_ids"] for i in rank_ids) for r in got]
    assert seen == _global_order(index, STEPS, 8)
    for a, b in zip(want, got, strict=True):
        for key in ("loss", "flow_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-4), (b["step"], key, a[key], b[key])
