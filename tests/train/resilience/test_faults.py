"""Fault handling on real multi-process DeepSpeed runs (gloo, CPU): a corrupt `latest`
checkpoint falls back to the previous one, a NaN loss never reaches the weights, a stopped
rank is detected by the heartbeat watchdog, and the elastic supervisor resumes a run on the
surviving ranks with every sample seen exactly once."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.ckpt.test_ckpt_resilience import COMMON, _metrics, _ok  # noqa: E402
from tests.train.train_launch import torchrun  # noqa: E402
from loongforge.benchmarks.faults.data import flip_byte  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.full  # the fallback itself is test_ckpt_writer.py::test_resume_falls_back_past_a_corrupt_and_a_missing_file; this adds the elastic relaunch around it
def test_corrupt_latest_falls_back_to_the_previous_checkpoint(train_root, tmp_path):
    """keep-last 1 still keeps step 2 as the fallback; a flipped byte in rank 1's optimizer partition of
    step 4 is named in a WARNING and the run resumes from step 2 (steps 2, 3 redone, none doubled)."""
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    args = ["--data", root, "--run-dir", run_dir, "--zero", "2", "--save-every", "2", "--keep-last", "1", *COMMON]
    _ok(torchrun(2, [*args, "--steps", "4"], cwd=str(tmp_path)))
    ckpts = os.path.join(run_dir, "checkpoints")
    assert sorted(d for d in os.listdir(ckpts) if d.startswith("step")) == ["step00000002", "step00000004"]
    bad = os.path.join(ckpts, "step00000004", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    flip_byte(bad, mask=1)
    done = torchrun(2, [*args, "--steps", "6", "--resume"], cwd=str(tmp_path))
    _ok(done)
    warn = [ln for ln in done.stderr.splitlines() if "WARNING" in ln and "failed verification" in ln]
    assert warn and bad in warn[0] and "corrupt" in warn[0], done.stderr[-3000:]
    assert "resumed from step00000002 at step 2" in done.stderr
    assert [r["step"] for r in _metrics(run_dir) if "event" not in r] == list(range(6))
    from loongforge.train.observe.metrics import read_events

    rec = [e for e in read_events(run_dir) if e["event"] == "ckpt_fallback"]  # the record the fault suite checks
    assert len(rec) == 1 and (rec[0]["latest"], rec[0]["loaded"]) == ("step00000004", "step00000002"), rec
    assert bad in rec[0]["rejected"][0] and "sha256" in rec[0]["rejected"][0]
    assert open(os.path.join(ckpts, "latest")).read().strip() == "step00000006"


def _module_weights(run_dir, tag):
    import torch

    from loongforge.train.ckpt.files import weights_only_loads

    with weights_only_loads():
        doc = torch.load(os.path.join(run_dir, "checkpoints", tag, "mp_rank_00_model_states.pt"), weights_only=True)
    return doc["module"]


def test_nan_loss_on_one_rank_skips_the_step_on_both_and_never_reaches_the_weights(train_root, tmp_path):
    """NaN injected into rank 1's loss at steps 2 and 3 (real NaN gradients through the all-reduce). ZeRO-0,
    where nothing in DeepSpeed would catch them: the weights after step 3 are bit-identical to those after
    step 1, every weight stays finite, and metrics.jsonl counts the two skips."""
    import torch

    root, _ = train_root
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, LOONGFORGE_INJECT_NAN="2,3@1")
    done = torchrun(2, ["--data", root, "--run-dir", run_dir, "--zero", "0", "--steps", "6", "--save-every", "2",
                        *COMMON], cwd=str(tmp_path), env=env)
    _ok(done)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["nonfinite_skip"] for r in rows] == [None, None, "loss", "loss", None, None]
    assert rows[-1]["nonfinite_skips"] == 2
    w2, w4, w6 = (_module_weights(run_dir, f"step{s:08d}") for s in (2, 4, 6))
    assert all(torch.equal(w2[k], w4[k]) for k in w2)  # both skipped steps left the weights untouched
    assert all(torch.isfinite(v).all() for v in w6.values())
    assert any(not torch.equal(w4[k], w6[k]) for k in w4)  # and training went on after them


@pytest.mark.full  # the NaN guard's skip is test_nan_loss_on_one_rank_skips_the_step_on_both; these are its other policies
def test_nan_policy_fail_and_max_consecutive_end_the_run(train_root, tmp_path):
    from tests.train.train_launch import launch

    root, _ = train_root
    for extra, said in ((["--nan-policy", "fail"], "--nan-policy fail"),
                        (["--nan-max-consecutive", "1"], "more than --nan-max-consecutive 1 in a row")):
        run_dir = str(tmp_path / extra[0])
        env = dict(os.environ, LOONGFORGE_INJECT_NAN="1,2")
        proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, "--steps", "5",
                       *extra, *COMMON], cwd=str(tmp_path), env=env)
        assert proc.returncode == 1 and "NonFiniteLossError" in proc.stderr and said in proc.stderr, \
            proc.stderr[-3000:]
        assert [r["step"] for r in _metrics(run_dir)] == ([0] if extra[0] == "--nan-policy" else [0, 1])


def _wait_steps(proc, run_dir, n, timeout=240):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        path = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(path) and len([r for r in _metrics(run_dir) if "step" in r]) >= n:
            return
        time.sleep(0.2)
    err = proc.communicate()[1]
    raise AssertionError(f"no {n} steps before the deadline: {err[-3000:]}")


@pytest.mark.full  # ~30 s: make faults runs it; the suite's rank_sigstop row measures the same path
def test_sigstop_rank_is_detected_and_the_launch_ends_with_a_fault_record(train_root, tmp_path):
    """SIGSTOP of rank 1 mid-run: rank 0's watchdog sees no heartbeat, writes one fault record naming rank 1,
    its host and why, fences the stopped rank and exits 75; the launch ends well inside the hang timeout
    instead of blocking in the next all-reduce (DeepSpeed's CPU shm all-reduce has no timeout at all)."""
    import signal
    import socket
    import subprocess
    import time

    from tests.train.ckpt.test_ckpt_resilience import _kill_tree
    from loongforge.train.resilience.owner import rank_pid
    from tests.train.train_launch import VENV_BIN, _port, launch_env

    root, _ = train_root
    run_dir = str(tmp_path / "run")
    env = launch_env()
    proc = subprocess.Popen([str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(_port()),
                             "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, "--steps", "100000",
                             "--heartbeat-s", "0.5", "--hang-timeout-s", "60", *COMMON], cwd=str(tmp_path),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_steps(proc, run_dir, 3)
        victim = rank_pid(run_dir, 1)
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        ended_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.communicate()
    assert proc.returncode != 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        events = [r for r in map(json.loads, f) if "event" in r]
    assert len(events) == 1, (events, err[-4000:])
    ev = events[0]
    assert (ev["kind"], ev["rank"], ev["host"], ev["detected_by"]) == ("dead", 1, socket.gethostname(), 0)
    assert "no heartbeat" in ev["why"] and "stopped (SIGSTOP)" in ev["why"]
    assert ev["detected_after_s"] < 30
    assert ended_s < 60, ended_s  # detection (~3 s) + teardown, not the 60 s hang timeout nor a launcher timeout
    assert "watchdog: rank 1 on" in err and "exit 75" in err


def _global_order(index, steps, batch, seed=1, window=8, run=4):
    """The samples of each global step (sorted) in the BlockLoader's order for these flags (COMMON:
    --seed 1 --block-window 8, the default --block-run 4): what every step of a faulted run must read."""
    import numpy as np

    from loongforge.train.data.order import EpochOrder
    from loongforge.train.data.samples import SampleTable

    table = SampleTable(np.asarray(index.ds.episode_lengths))
    per_epoch = table.num_samples // batch
    orders = {}
    out = []
    for s in range(steps):
        epoch, pos = divmod(s, per_epoch)
        if epoch not in orders:
            orders[epoch] = EpochOrder(table, index.ds.block_size, seed, epoch, run=run, window=window)
        out.append(sorted(orders[epoch].ids(pos * batch, (pos + 1) * batch).tolist()))
    return out


@pytest.mark.full  # ~65 s: `make faults` runs it; make test keeps elastic node loss (test_multinode.py) and elastic_unit
def test_elastic_supervisor_resumes_on_the_surviving_rank_with_every_sample_once(train_root, tmp_path):
    """`loongforge train --elastic --min-ranks 1 --max-ranks 2`, ZeRO-2: rank 1 blocks at the start of step 7
    (test hook, so the fault point is exact) and is SIGKILLed; the supervisor converts the step-4 checkpoint
    to 1 rank (elastic/reshard.py: the partitioned Adam moments kept) and relaunches on 1 rank with grad accum 2
    (same global batch 8). The redone steps 4 and 5 repeat the 2-rank run's losses (step 5's depends on the
    Adam moments of step 4's update: a re-initialized optimizer misses it), and the samples of every step are
    exactly that step's slice of the global order: none lost, none twice. The console says so in one line
    naming rank 1 and SIGKILL (no launcher or collateral traceback: rank 0's gloo error goes to the node's
    log), and a fault record is written."""
    import signal
    import subprocess

    from tests.train.ckpt.test_ckpt_resilience import _kill_tree
    from loongforge.train.resilience.owner import rank_pid
    from tests.train.train_launch import VENV_BIN, launch_env

    root, index = train_root
    run_dir = str(tmp_path / "run")
    # a 1-rank relaunch has no rank 1: it runs through
    env = launch_env(dict(os.environ, LOONGFORGE_INJECT_HANG="7@1"))
    steps = 12
    proc = subprocess.Popen([str(VENV_BIN / "loongforge"), "train", "--elastic", "--min-ranks", "1",
                             "--max-ranks", "2", "--capacity-file", str(tmp_path / "capacity"), "--data", root,
                             "--run-dir", run_dir, "--steps", str(steps), "--zero", "2",
                             "--save-every", "4", *COMMON], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_steps(proc, run_dir, 6)
        # Rows are written one step late: step 5's once step 6 ran; step 7 never starts, so no save at 8.
        before = [r for r in _metrics(run_dir) if "event" not in r]
        (tmp_path / "capacity").write_text("1")  # the node of rank 1 is gone: no slot to scale back up to
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
        _, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    events = [r for r in rows if r.get("event") == "elastic"]
    steps_rows = [r for r in rows if "event" not in r]
    launches = [(e["ranks"], e["grad_accum"]) for e in events if e["action"] == "launch"]
    assert launches == [(2, 1), (1, 2)], events
    assert [r["step"] for r in steps_rows] == list(range(steps))
    assert steps_rows[0]["world"] == 2 and steps_rows[-1]["world"] == 1
    assert [r["step"] for r in before] == list(range(6))
    for a, b in zip(before[4:6], steps_rows[4:6], strict=True):  # redone on 1 rank from the converted tag
        for key in ("loss", "flow_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-4), (b["step"], key, a[key], b[key])
    seen = [sorted(i for rank_ids in r["sample_ids"] for i in rank_ids) for r in steps_rows]
    assert seen == _global_order(index, steps, 8)  # each step: its slice of the global order, exactly once
    conv = [e for e in events if e["action"] == "reshard"]
    assert len(conv) == 1 and conv[0]["ok"] and conv[0]["from_tag"] == "step00000004", conv
    assert conv[0]["tag"] == "step00000004_w1z2t1" and "Adam moments and step kept" in err
    faults = [ln for ln in err.splitlines() if ln.startswith("loongforge train: fault")]
    assert len(faults) == 1 and "rank 1 on node" in faults[0] and "killed by SIGKILL" in faults[0], err[-4000:]
    for noise in ("Traceback", "ChildFailedError", "remote worker hanging", "Terminated"):
        assert noise not in err, (noise, err[-4000:])
    (rec,) = [r for r in rows if r.get("event") == "fault"]
    assert (rec["kind"], rec["rank"], rec["detected_by"]) == ("signal", 1, "supervisor"), rec
    logs = "".join(open(os.path.join(run_dir, "logs", f)).read() for f in os.listdir(os.path.join(run_dir, "logs")))
    assert "a peer is gone; this rank's traceback" in logs and "ChildFailedError" in logs  # kept, off the console


# The bench harness on one row (~12 s); make test keeps the product behaviour it measures
# (test_nan_loss_on_one_rank_skips_the_step_on_both_and_never_reaches_the_weights); `make faults` runs it.
@pytest.mark.full
def test_fault_suite_fast_subset_nan_loss(tmp_path):
    """`loongforge bench faults`' harness on its fastest fault (the full list runs in `make faults`), on its
    default format-2 root: the row says detected, recovered, nothing redone, no sample lost or seen twice
    against the BlockLoader's global order (10 steps: across the epoch boundary)."""
    from loongforge.benchmarks.faults import run as faults

    doc = faults.run_suite(["nan_loss"], steps=10, work=tmp_path, baseline=False)
    row = doc["rows"][0]
    assert doc["data_format"] == 2 and doc["data"].startswith("format 2"), doc
    assert row["fault"] == "nan_loss" and row["recovered"], row
    assert row["detected_after_s"] == 0.0 and "skipped on every rank" in row["action"]
    assert (row["steps_redone"], row["samples_lost"], row["samples_duplicated"]) == (0, 0, 0)
    assert "| nan_loss |" in faults.markdown_table(doc)


@pytest.mark.full
def test_fault_suite_rank_sigstop_relaunches_on_the_survivor(tmp_path):
    from loongforge.benchmarks.faults import run as faults

    doc = faults.run_suite(["rank_sigstop"], steps=10, work=tmp_path, baseline=False)
    row = doc["rows"][0]
    assert row["recovered"] and row["relaunches"] == 1 and "watchdog: rank 1 dead" in row["action"], row
    assert (row["samples_lost"], row["samples_duplicated"]) == (0, 0)


@pytest.mark.full
def test_fault_suite_corrupt_checkpoint_row_falls_back(tmp_path):
    """The relaunch must load a corrupt `latest`: both ranks are frozen before the byte flips, so nothing newer
    is published; the row is built from the relaunch's ckpt_fallback record."""
    from loongforge.benchmarks.faults import run as faults

    doc = faults.run_suite(["corrupt_checkpoint"], steps=10, work=tmp_path, baseline=False)
    row = doc["rows"][0]
    assert row["recovered"] and "check_failed" not in row, row
    fb = row["fallback"]
    assert int(fb["loaded"][4:]) < int(fb["rejected"][4:]) and fb["file"].startswith(f"checkpoints/{fb['rejected']}/")
    assert row["steps_redone"] >= int(fb["rejected"][4:]) - int(fb["loaded"][4:]) > 0
    assert (row["samples_lost"], row["samples_duplicated"]) == (0, 0)


def test_corrupt_checkpoint_row_fails_without_a_fallback_record(tmp_path):
    """The suite's own check: a relaunch that loaded something without rejecting the corrupted tag (no
    ckpt_fallback record, as when a newer checkpoint was published after the flip) fails the row."""
    from types import SimpleNamespace

    from loongforge.benchmarks.faults import env as fe

    log = tmp_path / "run.log"
    log.write_text("resumed from step00000008 at step 8\n")
    rows = [{"step": s} for s in range(10)] + [{"event": "elastic", "action": "launch", "t": 1.0}]
    run = SimpleNamespace(rows=lambda: rows, log=SimpleNamespace(name=str(log)), run_dir=str(tmp_path))
    setup = fe.Setup(str(tmp_path), info={"corrupt_tag": "step00000006", "stopped_after": 8,
                                          "corrupt_file": str(tmp_path / "checkpoints/step00000006/x.pt")})
    row = {"recovered": True, "t_inject": 0.0, "action": "relaunched"}
    fe.annotate_corrupt_checkpoint(row, run, setup)
    assert not row["recovered"] and "no ckpt_fallback record rejecting step00000006" in row["check_failed"]
    assert row["action"].startswith("CHECK FAILED")
    rows.append({"event": "elastic", "action": "fault", "t": 1.0})
    rows.append({"event": "ckpt_fallback", "latest": "step00000006", "loaded": "step00000004", "t": 3.0,
                 "rejected": [f"step00000006: {setup.info['corrupt_file']}: sha256 ..."]})
    rows.append({"event": "elastic", "action": "reshard", "from_tag": "step00000004", "to": "world=1,zero=2,tp=1",
                 "ok": True, "t": 2.0})  # the supervisor converted the fallback to 1 rank first (elastic/reshard.py)
    log.write_text("resumed from step00000004_w1z2t1 at step 4 (loader epoch 0)\n")
    row = {"recovered": True, "t_inject": 0.0, "action": "relaunched"}
    fe.annotate_corrupt_checkpoint(row, run, setup)
    assert row["recovered"] and row["steps_redone"] == 4 and row["detected_after_s"] == 3.0, row
    assert row["launch_ended_after_s"] == 1.0 and "launch ended after 1.0 s" in row["action"]
    assert "converted to world=1,zero=2,tp=1 first: ok" in row["action"]


@pytest.mark.full
def test_staged_faults(tmp_path):  # short: the cache socket lives under tmp_path (AF_UNIX <= 107 bytes)
    """The three faults staged around the run (faults_env.py): Redis SIGKILL under the cache daemon, one byte
    flipped in a shard at the origin (skipped by policy, never silently lost), the checkpoint tmpfs filled."""
    from loongforge.benchmarks.faults import run as faults

    names = ["redis_sigkill", "corrupt_shard_at_origin", "checkpoint_disk_full"]
    doc = faults.run_suite(names, steps=10, work=tmp_path, baseline=False)
    rows = {r["fault"]: r for r in doc["rows"]}
    for name in names:
        row = rows[name]
        if row.get("status") == "not run":  # e.g. no tmpfs mount without root: the row says why
            assert name == "checkpoint_disk_full" and "mount" in row["why"], row
            continue
        assert row["recovered"] and (row["samples_lost"], row["samples_duplicated"]) == (0, 0), row
        assert row["detected_after_s"] is not None, row
    assert "redis unreachable" in rows["redis_sigkill"]["action"]
    cs = rows["corrupt_shard_at_origin"]
    assert doc["data_format"] == 2  # the default root: frame blocks
    # Block 1 (t 4-5) of episode 2 (ids 11..16) of shard 1, not the shard (ids 11-21): its samples only, each
    # skipped again when the next epoch trains it (skip_events), none silently lost.
    assert cs["skipped_ids"] == cs["expected_skipped_ids"] == [15, 16] and cs["skip_events"] >= 2, cs
    assert "blocks one by one from origin" in cs["action"] and "other 9 trained delivered" in cs["action"], cs
    assert "(2 skipped by policy)" in faults.markdown_table(doc).split("| corrupt_shard_at_origin |")[1].split("\n")[0]


def test_steps_redone_reads_the_console_steps_counted_from_1():
    """The console prints "step N/T" (N steps done); the old parser wanted a bare integer and never matched,
    so every row said 0 steps redone."""
    from loongforge.benchmarks.faults.run import steps_redone

    log = "\n".join(["x INFO elastic: launching 2 ranks", *[f"step {n:6d}/12  loss 1.0" for n in range(1, 8)],
                     "x INFO elastic: launching 1 ranks", "x INFO trainer: resumed from step00000006_w1z2t1 at step 6 "
                     "(loader epoch 0, consumed 48)", "step      7/12  loss 1.0"])
    assert steps_redone(log) == 1


# The two rows of the suite that this issue added; make test covers their product behaviour
# (test_rundir.py's refusals on every launcher path, test_multinode.py's node loss). `make faults` runs them.
@pytest.mark.full
def test_fault_suite_overwrite_and_node_loss_rows(tmp_path):
    from loongforge.benchmarks.faults import run as faults

    doc = faults.run_suite(["overwrite_refused", "node_loss"], steps=10, work=tmp_path, baseline=False)
    rows = {r["fault"]: r for r in doc["rows"]}
    ow, nl = rows["overwrite_refused"], rows["node_loss"]
    assert ow["recovered"] and ow["unchanged"] and set(ow["tries"]) == {"elastic", "plain rank"}, ow
    assert nl["recovered"] and nl["relaunches"] == 1 and "node a named it in one line" in nl["action"], nl
    for r in (ow, nl):
        assert (r["samples_lost"], r["samples_duplicated"]) == (0, 0), r
