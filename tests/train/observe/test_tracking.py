"""--report-to: real TensorBoard event files and real W&B offline runs, written by a real Tracker in its
own process (SIGKILLed mid-run, then resumed) and read back through TensorBoard's event reader and the
W&B run's .wandb files. The 2-rank training variant is test_tracking_train.py (`full`)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from loongforge.shared.errors import ConfigError, FormatError
from loongforge.train.flags import add_train_args, config_from_args
from loongforge.train.observe import wandb_files
from loongforge.train.observe.metrics import read_metrics
from loongforge.train.observe.tracking import STATE_FILE, TB_DIR, resolve_report_to, step_scalars

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from readback import tensorboard_scalars, wandb_history, wandb_id  # noqa: E402
from tracking_session import row  # noqa: E402

SESSION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tracking_session.py")


def _env(**extra) -> dict:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1", **extra)
    env.pop("WANDB_API_KEY", None)
    return env


def _session(run_dir, report_to, start, stop, offset, *args, env=None):
    cmd = [sys.executable, SESSION, str(run_dir), report_to, str(start), str(stop), str(offset), *args]
    out = subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def test_report_to_flag_and_its_default():
    p = argparse.ArgumentParser()
    add_train_args(p)
    parse = lambda *a: config_from_args(p.parse_args(["--data", "d", "--run-dir", "r", *a])).track  # noqa: E731
    assert parse().report_to is None
    assert parse("--report-to", "none").report_to == ()
    assert parse("--report-to", "wandb,tensorboard,wandb").report_to == ("wandb", "tensorboard")
    with pytest.raises(SystemExit):
        p.parse_args(["--data", "d", "--run-dir", "r", "--report-to", "none,wandb"])
    with pytest.raises(ConfigError, match="unknown"):
        parse("--report-to", "comet")
    said = []
    assert resolve_report_to(None, say=said.append) == ("tensorboard",)  # installed here ([dev] has [track])
    assert said == ["--report-to: tensorboard (the default; the package is installed)"]


def test_a_named_tracker_that_is_not_installed_is_one_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what importlib reports for a package that is absent
    with pytest.raises(ConfigError) as err:
        resolve_report_to(("tensorboard", "wandb"))
    assert "wandb package is not installed" in str(err.value) and "loongforge[track]" in str(err.value)
    assert "\n" not in str(err.value)
    said = []
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert resolve_report_to(None, say=said.append) == () and "none" in said[0] and len(said) == 1


def test_step_scalars_are_the_metrics_row():
    r = {**row(3, 0.0), "save_s": 0.5, "val_flow_loss": 0.7, "warmup": False, "sample_ids": [[1]], "timer": "host"}
    s = step_scalars(r)
    assert s["train/loss"] == r["loss"] and s["train/lr"] == r["lr"] and s["train/grad_norm"] == r["grad_norm"]
    assert s["train/samples_per_s"] == pytest.approx(8 / 0.23)
    assert s["train_time/step_ms"] == pytest.approx(230.0)
    assert s["train_time/data_wait_ms"] == pytest.approx(10.0) and s["train_time/data_wait_pct"] == pytest.approx(100 / 23)
    assert s["train_time/compute_pct"] + s["train_time/communication_pct"] + s["train_time/launch_overhead_pct"] + \
        s["train_time/data_wait_pct"] == pytest.approx(100.0)
    assert s["train_ckpt/save_stall_s"] == 0.5 and s["val/flow_loss"] == 0.7
    assert "train_time/communication_ms" not in step_scalars({**r, "comm_s": None})  # CUDA without a trace: not measured
    assert all(isinstance(v, float) for v in s.values())


def test_sigkill_then_resume_every_step_once_in_tensorboard_and_wandb(tmp_path):
    """Launch 1 logs steps 0..5 (a save before step 4) and is SIGKILLed with its W&B process; launch 2 resumes
    from the step-4 checkpoint and logs 4..7 with other values. TensorBoard shows every step once with launch
    2's values from step 4 on: what metrics.jsonl holds. The W&B run holds every step once: W&B's process
    writes its file every ~15 s, so the killed launch's rows are mostly lost, and launch 2 sends the rows below
    its checkpoint from metrics.jsonl; a row W&B did keep from launch 1 keeps launch 1's values (as W&B does
    online; test_resumed_wandb_run_skips_the_steps_it_holds)."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, SESSION, str(run), "tensorboard,wandb", "0", "6", "0", "--save-at", "4",
                             "--hang"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "HUNG", proc.stderr.read()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the session and W&B's service process, mid-run
        proc.wait()
    before = {r["step"]: r for r in read_metrics(str(run))}
    assert sorted(before) == list(range(6))
    _session(run, "tensorboard,wandb", 4, 8, 100.0, "--resume", "--save-at", "6")
    after = {r["step"]: r for r in read_metrics(str(run))}
    assert after[3] == before[3] and after[4]["loss"] == pytest.approx(100.2)

    tb = tensorboard_scalars(str(run))
    assert set(step_scalars(after[0])) <= set(tb)
    for tag, points in tb.items():
        if tag.startswith(("train/", "train_time/")):
            assert [s for s, _ in points] == list(range(8)), tag
            assert [v for _, v in points] == pytest.approx([step_scalars(after[s])[tag] for s in range(8)], rel=1e-6)
    assert tb["train_ckpt/save_stall_s"] == [(6, 0.5)] and tb["train_ckpt/write_s"] == [(6, 1.5)]  # launch 1's step 4 purged

    hist = wandb_history(str(run))
    assert [s for _, s, _ in hist] == list(range(8))  # once each, over both sessions' files
    for n, s, got in hist:
        want = step_scalars(before[s] if n == 0 or s < 4 else after[s])
        assert {k: got[k] for k in want} == want and set(got) - set(want) <= {"train_ckpt/write_s"}
    assert hist[6][2]["train_ckpt/write_s"] == 1.5


def test_resumed_wandb_run_skips_the_steps_it_holds(tmp_path):
    """W&B held steps 0..5 when the launch ended (its file flushed); the resume from step 4 adds 6 and 7 only."""
    run = tmp_path / "run"
    _session(run, "wandb", 0, 6, 0, "--save-at", "4")
    _session(run, "wandb", 4, 8, 100.0, "--resume")
    hist = wandb_history(str(run))
    assert [(n, s) for n, s, _ in hist] == [(0, s) for s in range(6)] + [(1, 6), (1, 7)]
    assert hist[5][2]["train/loss"] == pytest.approx(1 / 6) and hist[6][2]["train/loss"] == pytest.approx(100 + 1 / 7)


def test_report_to_none_writes_neither_and_wandb_added_on_resume_gets_the_earlier_steps(tmp_path):
    run = tmp_path / "run"
    _session(run, "none", 0, 4, 0, "--save-at", "2")
    assert os.listdir(run) == ["metrics.jsonl"]  # no tensorboard/, no wandb/, no tracking.json
    # Resumed at 2 with W&B on: steps 0..1 come from metrics.jsonl (the tracker was off when they ran).
    _session(run, "wandb", 2, 5, 10.0, "--resume")
    assert not (run / TB_DIR).exists()
    rows = {r["step"]: r for r in read_metrics(str(run))}
    hist = wandb_history(str(run))
    assert [s for _, s, _ in hist] == list(range(5))
    assert all(got == step_scalars(rows[s]) for _, s, got in hist)


def test_wandb_server_unreachable_goes_offline_in_bounded_time(tmp_path):
    """Online mode, a key, and no server: the run goes offline after W&B's init timeout instead of failing."""
    env = _env(WANDB_BASE_URL="http://127.0.0.1:9", WANDB_API_KEY="0" * 40, WANDB_INIT_TIMEOUT="3")
    env.pop("WANDB_MODE")
    t0 = time.monotonic()
    out = _session(tmp_path / "run", "wandb", 0, 3, 0, env=env)
    assert time.monotonic() - t0 < 60
    assert "cannot start the run online" in out.stderr and "wandb sync" in out.stderr
    hist = wandb_history(str(tmp_path / "run"))
    assert [s for _, s, _ in hist] == [0, 1, 2]
    assert os.path.basename(os.path.dirname(wandb_files.run_files(str(tmp_path / "run"),
                                                                   wandb_id(str(tmp_path / "run")))[0])
                            ).startswith("offline-run-")


def test_a_torn_or_corrupt_wandb_file(tmp_path):
    run = tmp_path / "run"
    _session(run, "wandb", 0, 3, 0)
    path = wandb_files.run_files(str(run), wandb_id(str(run)))[0]
    whole = open(path, "rb").read()
    torn = tmp_path / "torn.wandb"
    torn.write_bytes(whole[:-5])  # killed mid-record: the rows before it still read
    assert [s for s, _ in wandb_files.history(str(torn))][:2] == [0, 1]
    bad = bytearray(whole)
    bad[20] ^= 0xFF
    (tmp_path / "bad.wandb").write_bytes(bytes(bad))
    with pytest.raises(FormatError, match="checksum"):
        list(wandb_files.payloads(str(tmp_path / "bad.wandb")))


def test_eval_and_profile_add_to_the_same_run(tmp_path, monkeypatch):
    """`loongforge eval`'s and `profile`'s results, reported into a run that logs to both trackers: TensorBoard
    gets the images and tables at the given step (not one-point charts), W&B the tables, images and scalars in
    the run's summary."""
    from PIL import Image

    from loongforge.train.observe.tracking import report_eval, report_profile
    from readback import tensorboard_accumulator, wandb_summary

    run = tmp_path / "run"
    run.mkdir()  # what a training launch with --report-to tensorboard,wandb leaves for the commands
    (run / STATE_FILE).write_text(json.dumps({"v": 1, "report_to": ["tensorboard", "wandb"], "tensorboard": TB_DIR,
                                              "wandb": {"id": "evalrun1", "project": "p", "name": "run"}}))
    monkeypatch.setenv("WANDB_MODE", "offline")
    plot = str(tmp_path / "episode_000007.png")
    Image.new("RGB", (64, 48), (200, 30, 30)).save(plot)
    overall = {m: {"mse": {"arm": 0.1 * i, "gripper": 0.2 * i, "all": 0.3 * i},
                   "mae": {"arm": 0.01 * i, "gripper": 0.02 * i, "all": 0.03 * i}}
               for i, m in enumerate(("policy", "ridge", "mean"), 1)}
    report_eval(str(run), {"overall": overall, "episodes": {"7": {}}}, 3, [plot])
    b = {"table": {p: 0.01 * (i + 1) for i, p in enumerate(("data wait", "communication", "launch/dispatch overhead",
                                                             "compute"))},
         "step_s": 0.1, "samples_per_s": 80.0, "last_step": 2, "footnote": "means over steps 1..2"}
    b["percent"] = {k: 100 * v / 0.1 for k, v in b["table"].items()}
    report_profile(str(run), b, plot)
    acc = tensorboard_accumulator(str(run))
    assert [(e.step, e.width, e.height) for e in acc.Images("eval/episode_000007")] == [(3, 64, 48)]
    assert [e.step for e in acc.Images("profile/chart")] == [3]
    table = acc.Tensors("eval/mse/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| group | policy | ridge | mean |" in table and "| gripper | 0.2 | 0.4 | 0.6 |" in table
    assert acc.Tags()["scalars"] == []  # one-point values stay in the tables, off the charts
    summary = wandb_summary(str(run))
    assert summary["eval/mse"]["_type"] == "table-file" and summary["eval/episode_000007"]["_type"] == "image-file"
    assert summary["eval/mae/gripper/mean"] == pytest.approx(0.06)
    assert summary["profile/data_wait_pct"] == pytest.approx(10.0) and summary["profile/compute_pct"] == 40.0
    assert wandb_history(str(run)) == []  # summaries only: W&B's history steps stay the training's


def test_tensorboard_names_the_run_after_its_directory_and_shows_train_first(tmp_path):
    """TensorBoard opened on the `eval` group (30 one-point charts of `loongforge eval`) above the training
    curves, and named the run `.` (the events sat in the --logdir itself). Read as TensorBoard reads a
    --logdir: the run is named after the run directory, and train/ is the first group (TensorBoard orders
    groups by name) with no eval/ or profile/ chart after a report."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    from loongforge.train.observe.tracking import report_eval

    run = tmp_path / "pi0-ft"
    _session(run, "tensorboard", 0, 4, 0, "--save-at", "2")
    overall = {m: {"mse": {"arm": 0.1, "all": 0.1}, "mae": {"arm": 0.1, "all": 0.1}} for m in ("policy", "mean")}
    report_eval(str(run), {"overall": overall, "episodes": {}}, 4, [])
    logdir = run / TB_DIR
    mux = EventMultiplexer().AddRunsFromDirectory(str(logdir))
    mux.Reload()
    assert list(mux.Runs()) == ["pi0-ft"]
    tags = mux.Runs()["pi0-ft"]["tensors"] + mux.Runs()["pi0-ft"].get("scalars", [])
    groups = sorted({t.split("/")[0] for t in tags if "/" in t and not t.endswith("text_summary")})
    assert groups[0] == "train" and not {"eval", "profile"} & set(groups), groups
