"""Real multi-process DeepSpeed on gloo (2 CPU ranks), launched like production:
torchrun and the deepspeed launcher, via subprocess with a timeout."""

import functools
import json
import os
import re
import shutil
import sys

import pytest

from loongforge.train.resilience.owner import rank_pid
from tests.train.train_launch import (assert_ok as _ok, deepspeed_launch, launch, read_metrics as _metrics,
                                      torchrun)

pytestmark = pytest.mark.slow
COMMON = ["--batch-size", "8", "--recipe", "tiny", "--seed", "1", "--block-window", "8", "--lr", "3e-3",
          "--dit-dropout", "0"]  # the DiT's dropout masks follow the rank layout: off where layouts are compared
STEPS = "20"  # 2.5 epochs of the 64-sample root: crosses epoch boundaries


@pytest.fixture(scope="module")
def zero2_run(train_root, tmp_path_factory):
    """20 steps, 2 ranks, ZeRO-2, one decode worker per rank, checkpoints every 5, trace of steps 3..5."""
    root, _ = train_root
    work = tmp_path_factory.mktemp("zero2")
    run_dir = str(work / "run")
    proc = torchrun(2, ["--data", root, "--run-dir", run_dir, "--steps", STEPS, "--zero", "2", "--workers", "1",
                        "--save-every", "5", "--profile-steps", "3:6", *COMMON], cwd=str(work))
    _ok(proc)
    return run_dir, proc


def _shm_files() -> set[str]:
    """Our decode slots (psm_*) and DeepSpeed's CPU allreduce buffers in /dev/shm."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "deepspeed_allreduce_buffer_"))}



def test_zero2_two_ranks_read_disjoint_slices(zero2_run, train_root):
    """Whether it learns is test_learning.py's question (an open-loop eval against baselines); 20 steps of
    N1.6's flow-matching loss at batch 8 are too noisy to say (its random flow time dominates them)."""
    run_dir, proc = zero2_run
    _, index = train_root
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(20))
    assert all(0 < r["loss"] < 10 for r in rows), [r["loss"] for r in rows]
    by_epoch = {}
    for r in rows:
        assert r["world"] == 2 and len(r["sample_ids"]) == 2 and len(r["sample_ids"][0]) == 4
        a, b = (set(x) for x in r["sample_ids"])
        assert not a & b  # ranks never read the same sample in a step
        by_epoch.setdefault(r["epoch"], []).extend(r["sample_ids"][0] + r["sample_ids"][1])
    for epoch in (0, 1):  # full epochs: every sample exactly once (64 % 8 == 0: no tail to drop)
        assert sorted(by_epoch[epoch]) == list(range(index.num_samples))
    assert by_epoch[0] != by_epoch[1]  # reshuffled per epoch
    for key in ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "comm_s", "compute_s", "overhead_s"):
        assert all(r[key] is not None and r[key] >= 0 for r in rows), key
    assert any(r["comm_s"] > 0 for r in rows)  # gloo collectives were timed
    assert "samples/s" in proc.stderr + proc.stdout and "data-wait" in proc.stderr + proc.stdout
    ds = json.load(open(os.path.join(run_dir, "ds_config.json")))
    assert ds["zero_optimization"]["stage"] == 2 and ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["bf16"]["enabled"] is False
    # DeepSpeed's own timer lines are off by default (--ds-breakdown turns them on); ours: progress and summary
    out = proc.stderr + proc.stdout
    assert ds["wall_clock_breakdown"] is False and "time (ms)" not in out
    assert re.search(r"step\s+20/20 ", out) and "run summary: steps 1-20/20 in " in out, out[-3000:]


def test_profile_cli_table_chart_and_gloo_trace(zero2_run, capsys):
    """`loongforge profile` in this process (as a process: test_tracking_train.py)."""
    from loongforge.cli import main

    run_dir, _ = zero2_run
    capsys.readouterr()
    assert main(["profile", run_dir]) == 0
    out = capsys.readouterr().out
    for phase in ("data wait", "communication", "launch/dispatch overhead", "compute", "% of step"):
        assert phase in out
    assert "gloo:all_reduce" in out  # parsed from the CPU chrome trace
    assert "CPU trace: Python overhead (host between ATen ops" in out  # the CPU's dispatch share, measured
    assert os.path.getsize(os.path.join(run_dir, "profile.png")) > 5000
    assert main(["profile", run_dir, "--json", "--no-chart"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert abs(sum(b["percent"].values()) - 100.0) < 5.0  # the four parts account for the step
    assert b["table"]["communication"] > 0
    assert 0.0 < b["python_overhead_share"] < 1.0
    trace = b["traces"][0]
    assert trace["kind"] == "cpu" and len(trace["comm_s_per_step"]) == 3 and all(c > 0 for c in trace["comm_s_per_step"])


def _resume_copy(run_dir, dest, tag="step00000005"):
    shutil.copytree(run_dir, dest)
    with open(os.path.join(dest, "checkpoints", "latest"), "w") as f:
        f.write(tag)
    return dest


def test_resume_is_exact(zero2_run, train_root, tmp_path):
    """20 steps straight == 5 steps + resume + 15 steps: same sample ids, same losses."""
    run_dir, _ = zero2_run
    root, _ = train_root
    resumed = _resume_copy(run_dir, str(tmp_path / "resumed"))
    proc = torchrun(2, ["--data", root, "--run-dir", resumed, "--steps", STEPS, "--zero", "2", "--workers", "1",
                        "--resume", *COMMON], cwd=str(tmp_path))
    _ok(proc)
    want, got = _metrics(run_dir), _metrics(resumed)
    assert [r["step"] for r in got] == list(range(20))  # steps 5.. replaced, not appended twice
    for a, b in zip(want[5:], got[5:]):
        assert a["sample_ids"] == b["sample_ids"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)


def test_resume_on_one_rank_keeps_global_sequence(zero2_run, train_root, tmp_path):
    run_dir, _ = zero2_run
    root, _ = train_root
    resumed = _resume_copy(run_dir, str(tmp_path / "one_rank"))
    proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", resumed, "--steps", STEPS,
                   "--zero", "2", "--resume", *COMMON], cwd=str(tmp_path))
    _ok(proc)
    want, got = _metrics(run_dir), _metrics(resumed)
    for a, b in zip(want[5:], got[5:]):
        assert b["world"] == 1
        assert b["sample_ids"][0] == a["sample_ids"][0] + a["sample_ids"][1]  # rank r held the r-th half
        assert b["loss"] == b["loss"] and b["loss"] < 100  # finite
    # The first resumed step trains the same samples from the same weights on 1 rank as on 2: with noise
    # seeded per global sample id its losses are the same (fp32 sums aside). Seeded per (step, micro, rank)
    # they differed by ~0.5%. (test_ckpt_resilience's 2 -> 1 -> 4 variant is `full`.)
    for key in ("loss", "flow_loss"):
        assert got[5][key] == pytest.approx(want[5][key], rel=1e-5, abs=1e-6), key
    from loongforge.train.observe import breakdown as report

    segs = report.breakdown(resumed)["segments"]  # one table per rank count, each without its warm-up
    assert [(s["world"], s["first_step"], s["last_step"]) for s in segs] == [(2, 0, 4), (1, 5, 19)]
    assert segs[0]["warmup_steps"] == [0] and segs[1]["warmup_steps"] == [5] and segs[1]["steps"] == 14


@pytest.fixture(scope="module")
def zero3_ds_run(train_root, tmp_path_factory):
    """4 steps, ZeRO-3, grad accum 2, under the deepspeed launcher (which sets LOCAL_SIZE)."""
    root, _ = train_root
    work = tmp_path_factory.mktemp("z3")
    run_dir = str(work / "z3")
    shm_before = _shm_files()
    proc = deepspeed_launch(2, ["--data", root, "--run-dir", run_dir, "--steps", "4", "--zero", "3",
                                "--grad-accum", "2", "--no-ds-breakdown", *COMMON], cwd=str(work))
    return run_dir, proc, shm_before


def test_zero3_deepspeed_launcher_with_grad_accum(zero3_ds_run):
    run_dir, proc, shm_before = zero3_ds_run
    _ok(proc)
    # The deepspeed launcher sets LOCAL_SIZE, so DeepSpeed's CPU shm allreduce made a ~66 MB segment
    # per rank, which it never unlinks; the trainer's teardown does.
    assert _shm_files() - shm_before == set()
    assert "bwd_allreduce" not in proc.stdout  # DeepSpeed's per-step timer lines are off
    rows = _metrics(run_dir)
    assert len(rows) == 4 and all(r["world"] == 2 for r in rows)
    ids = [x for r in rows for rank_ids in r["sample_ids"] for x in rank_ids]
    assert all(len(r["sample_ids"][0]) == 4 for r in rows)  # 2 micro batches x 2 samples per rank per step
    assert len(ids) == len(set(ids)) == 32
    conf = json.load(open(os.path.join(run_dir, "ds_config.json")))
    assert conf["zero_optimization"]["stage"] == 3 and conf["gradient_accumulation_steps"] == 2
    assert conf["train_micro_batch_size_per_gpu"] == 2 and conf["wall_clock_breakdown"] is False
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "latest"))


# `full`: make test covers the universal-checkpoint resume of a 2-rank ZeRO-3 run on 1 rank, with the
# resumed losses compared, in test_ckpt_resilience.py::test_zero3_checkpoint_reshards_to_another_rank_count...
@pytest.mark.full
def test_zero3_grad_accum_resumes_on_one_rank(zero3_ds_run, train_root, tmp_path):
    """ZeRO-3 partitions the parameters themselves: a different rank count goes through a universal checkpoint."""
    run_dir, proc, _ = zero3_ds_run
    _ok(proc)
    root, _ = train_root
    proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, "--steps", "6",
                   "--zero", "3", "--grad-accum", "2", "--resume", *COMMON], cwd=str(tmp_path))
    _ok(proc)
    assert "through a universal checkpoint" in proc.stderr and len(_metrics(run_dir)) == 6


def test_config_error_exit_code(train_root, tmp_path):
    root, _ = train_root
    proc = launch([sys.executable, "-m", "loongforge", "train", "--data", root, "--run-dir", str(tmp_path / "r"),
                   "--batch-size", "0"], cwd=str(tmp_path), timeout=120)
    assert proc.returncode == 2 and "data.global_batch_size" in proc.stderr


def test_gpu_run_smoke(train_root, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root, _ = train_root
    run_dir = str(tmp_path / "gpu")
    proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, "--steps", "4",
                   "--device", "cuda", "--profile-steps", "1:3", "--workers", "1", *COMMON], cwd=str(tmp_path),
                  cuda=True)
    _ok(proc)
    assert len(_metrics(run_dir)) == 4


test_gpu_run_smoke = pytest.mark.gpu(test_gpu_run_smoke)


def test_bad_sample_raise_fails_the_launch_without_hanging(tmp_path):
    """A rank that hits a corrupt sample with --bad-samples raise must end the whole launch
    with a non-zero code and a clear message; the peer must not wait forever in allreduce."""
    from loongforge.shared.dataset import open_root
    from loongforge.shared.synthetic import make_synthetic_root

    root = str(tmp_path / "shards")
    make_synthetic_root(root, lengths=(8, 8), shard_size=1)
    ds = open_root(root)
    path = os.path.join(root, ds.block_entry(0, 0, 0)[0])
    data = bytearray(open(path, "rb").read())
    for cam in ds.cameras:  # every block of episode 0: every sample of it is bad, hit on the first steps
        for b in range(ds.num_blocks(0)):
            _, off, length, _, _ = ds.block_entry(0, cam, b)
            data[off + length // 2] ^= 0xFF
    open(path, "wb").write(data)
    proc = torchrun(2, ["--data", root, "--run-dir", str(tmp_path / "run"), "--steps", "4", "--batch-size", "4",
                        "--bad-samples", "raise", "--workers", "1", "--dist-timeout", "60"], cwd=str(tmp_path),
                    timeout=180)
    assert proc.returncode != 0
    assert "DataWorkerError" in proc.stderr and "bad sample" in proc.stderr


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("deepspeed", marks=pytest.mark.full)])
def test_killed_rank_ends_the_launch_and_resume_continues(launcher, train_root, tmp_path):
    """SIGKILL of one rank mid-run (OOM killer, node loss): the launch must end non-zero instead of
    leaving its peer blocked in an allreduce, and --resume continues from the last complete checkpoint."""
    import signal
    import subprocess
    import time

    from tests.train.train_launch import deepspeed_cmd, launch_env, torchrun_cmd

    root, _ = train_root
    run_dir = str(tmp_path / "run")
    args = ["--data", root, "--run-dir", run_dir, "--zero", "2", "--workers", "1", "--save-every", "4", *COMMON]
    env = launch_env()
    if launcher == "torchrun":
        cmd = torchrun_cmd(2, ["-m", "loongforge.train", *args, "--steps", "100000"])
    else:
        cmd = deepspeed_cmd(2, ["--module", "loongforge.train", *args, "--steps", "100000"])
    shm_before = _shm_files()
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:  # past the first checkpoint (step 4)
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(_metrics(run_dir)) >= 7:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        victim = rank_pid(run_dir, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)  # a hang here is the failure this test exists for
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    said = out + err
    # torchrun names the killed rank; deepspeed's launcher reports the first failed code it polls
    # (-9 from the victim, or 1 from the peer whose collective broke first).
    expected = "Signal 9 (SIGKILL)" if launcher == "torchrun" else "exits with return code = "
    assert expected in said, said[-3000:]
    # Nothing stays in /dev/shm: the surviving rank (its collective failed, or the launcher's SIGTERM
    # arrived) closes its loader and removes every rank's DeepSpeed buffer, and the killed rank's
    # decode slots go with its resource tracker.
    time.sleep(1.0)
    assert _shm_files() - shm_before == set()
    done = len(_metrics(run_dir))
    latest = open(os.path.join(run_dir, "checkpoints", "latest")).read().strip()
    assert latest.startswith("step") and int(latest[4:]) % 4 == 0 and int(latest[4:]) <= done

    if launcher == "torchrun":
        # make test stops here: the resume after a kill (steps redone, none doubled) is checked by
        # test_ckpt_resilience.py::test_sigkill_mid_save_keeps_previous_latest; the `full` deepspeed
        # variant resumes after this one-rank kill too.
        return
    relaunch = functools.partial(deepspeed_launch, module=True)
    resumed = relaunch(2, [*args, "--steps", str(done + 3), "--resume"], cwd=str(tmp_path))
    _ok(resumed)
    steps = [r["step"] for r in _metrics(run_dir)]
    assert steps == list(range(done + 3))  # the steps after the checkpoint were redone, none doubled


@pytest.mark.full  # SIGTERM on every launch path is test_stop.py's
def test_sigterm_tears_a_rank_down_cleanly(train_root, tmp_path):
    """SIGTERM with --no-save-on-term (a launcher stopping the survivors) closes the loader and exits
    143 with a resume hint; the decode workers do not outlive the rank. (The default, a checkpoint first
    and exit 85: tests/train/resilience/test_stop.py.)"""
    import signal
    import subprocess
    import time

    from tests.train.train_launch import launch_env

    root, _ = train_root
    run_dir = str(tmp_path / "run")
    env = launch_env()
    proc = subprocess.Popen([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir,
                             "--steps", "100000", "--workers", "2", "--no-save-on-term", *COMMON], cwd=str(tmp_path),
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(_metrics(run_dir)) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("loongforge train:")]
    assert "terminated (SIGTERM: stopped at once, --no-save-on-term) at step" in line and "--resume" in line, line
    assert "Traceback" not in err
    assert "leaked shared_memory" not in err  # the rank unlinked its slots itself
    assert len(workers) >= 2  # the two decode workers (and multiprocessing's resource tracker)
    deadline = time.monotonic() + 10
    while [w for w in workers if _running(w)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if _running(w)], "children outlived the terminated rank"


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _parent(pid: int) -> int | None:
    st = _stat(pid)
    return int(st[1]) if st else None


def _running(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")  # an unreaped zombie has exited
