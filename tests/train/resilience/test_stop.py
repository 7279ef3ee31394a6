"""How a run stops on a signal (train/resilience/stop.py), on real launches: SIGTERM finishes the step on
every rank and writes a checkpoint the resume continues from exactly; Ctrl-C ends with one line that names
the last checkpoint and the resume command, on a plain rank and under the elastic supervisor."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.ckpt.test_ckpt_resilience import COMMON, _kill_tree, _metrics  # noqa: E402
from tests.train.conftest import ZERO3_RUN_ARGS  # noqa: E402
from tests.train.resilience.test_faults import _wait_steps  # noqa: E402
from tests.train.train_launch import VENV_BIN, launch_env, torchrun  # noqa: E402

pytestmark = pytest.mark.slow


def _lines(err: str, prefix: str = "loongforge train:") -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith(prefix)]


def test_sigterm_writes_a_checkpoint_at_the_step_and_the_resume_is_exact(train_root, zero3_run, tmp_path):
    """Rank 1 alone gets SIGTERM as step 1 starts (a real signal, LOONGFORGE_INJECT_TERM): both ranks finish
    step 1, write step00000002 and exit 85 (torchrun: 1); the line counts steps from 1 as the console's step
    lines do ("step 2/4" was the last one). The resume trains steps 2 and 3 with the very losses of the
    uninterrupted run (zero3_run, same arguments), and no step is trained twice."""
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    args = ["--data", root, "--run-dir", run_dir, *ZERO3_RUN_ARGS, "--save-every", "0"]
    stopped = torchrun(2, args, cwd=str(tmp_path), timeout=400, env=dict(os.environ, LOONGFORGE_INJECT_TERM="1@1"))
    assert "failed (exitcode: 85)" in stopped.stderr, stopped.stderr[-4000:]
    mine = _lines(stopped.stderr)
    assert len(mine) == 1 and "stopped by SIGTERM after step 2: checkpoint step00000002 written" in mine[0], mine
    assert mine[0].endswith("--save-every 0 --resume") and " torchrun --nproc_per_node 2 -m loongforge.train " \
        in f" {mine[0].split('resume: ')[1]}"
    ckpts = os.path.join(run_dir, "checkpoints")
    assert open(os.path.join(ckpts, "latest")).read() == "step00000002"
    assert [r["step"] for r in _metrics(run_dir) if "event" not in r] == [0, 1]
    resumed = torchrun(2, [*args, "--resume"], cwd=str(tmp_path), timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from step00000002 at step 2" in resumed.stderr
    got = [r for r in _metrics(run_dir) if "event" not in r]
    want = _metrics(zero3_run)
    assert [r["step"] for r in got] == [0, 1, 2, 3]  # nothing redone, nothing skipped
    for a, b in zip(want, got, strict=True):
        assert b["sample_ids"] == a["sample_ids"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7), (b["step"], a["loss"], b["loss"])


def _popen(cmd, cwd, env=None):
    return subprocess.Popen(cmd, cwd=cwd, env=launch_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _stop(proc, sig, run_dir, after_steps, timeout=120):
    try:
        _wait_steps(proc, run_dir, after_steps)
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.communicate()
    return proc.returncode, out + err


def test_ctrl_c_on_a_plain_rank_is_one_line_with_the_resume_command(train_root, tmp_path):
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    proc = _popen([str(VENV_BIN / "loongforge"), "train", "--data", root, "--run-dir", run_dir, "--steps", "100000",
                   "--save-every", "2", *COMMON], str(tmp_path))
    rc, err = _stop(proc, signal.SIGINT, run_dir, 3)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    (line,) = _lines(err)
    latest = open(os.path.join(run_dir, "checkpoints", "latest")).read()
    assert f"interrupted (SIGINT) at step" in line and f"last checkpoint {latest}" in line, line
    assert line.split("resume: ")[1] == f"loongforge train --data {root} --run-dir {run_dir} --steps 100000 " \
        f"--save-every 2 {' '.join(COMMON)} --resume"


def _supervised(root, run_dir, extra=()):
    return [str(VENV_BIN / "loongforge"), "train", "--elastic", "--min-ranks", "2", "--max-ranks", "2", "--data",
            root, "--run-dir", run_dir, "--steps", "100000", "--save-every", "50", *COMMON, *extra]


@pytest.mark.full  # the ranks' side: the torchrun SIGTERM test; the supervisor's: bench faults sigterm_preemption
def test_sigterm_to_the_supervisor_reaches_the_ranks_which_save_and_it_exits_85(train_root, tmp_path):
    """The supervisor forwards its SIGTERM to the ranks (not to torchrun, whose agent would print a traceback
    and SIGKILL them after 30 s): they finish the step, write a checkpoint, and the supervisor alone prints the
    one line; nothing else on stderr is a traceback."""
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    proc = _popen(_supervised(root, run_dir), str(tmp_path))
    t0 = time.monotonic()
    rc, err = _stop(proc, signal.SIGTERM, run_dir, 3)
    assert rc == 85, err[-4000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-4000:]
    (line,) = _lines(err)
    latest = open(os.path.join(run_dir, "checkpoints", "latest")).read()
    assert f"checkpoint {latest} written" in line and line.endswith("--save-every 50 " + " ".join(COMMON)
                                                                       + " --resume"), line
    assert "resume: loongforge train --elastic --min-ranks 2 --max-ranks 2" in line
    steps = [r["step"] for r in _metrics(run_dir) if "event" not in r]
    assert latest == f"step{len(steps):08d}" and steps == list(range(len(steps)))  # saved after the last step
    assert time.monotonic() - t0 < 200


def test_sigterm_to_the_supervisor_before_any_step_is_one_line_without_a_checkpoint(train_root, tmp_path):
    """SIGTERM while the ranks still start: the supervisor does not promise a checkpoint ("no rank has
    finished a step yet"), torchrun's ChildFailedError stays in the node's log, and the one line says that
    nothing was saved and how to resume; exit 143."""
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    proc = _popen(_supervised(root, run_dir), str(tmp_path))
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and proc.poll() is None and not os.path.exists(
                os.path.join(run_dir, "metrics.jsonl")):  # the supervisor's launch record: the ranks start now
            time.sleep(0.1)
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.communicate()
    assert proc.returncode == 143, err[-4000:]
    assert "no rank has finished a step yet" in err and "finish their step" not in err, err[-4000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-4000:]
    (line,) = _lines(err)
    assert "SIGTERM" in line and "last checkpoint none" in line and line.endswith("--resume"), line


@pytest.mark.full  # a second supervised launch; the plain-rank Ctrl-C test covers the rank's side
def test_ctrl_c_to_the_supervisor_is_one_line_and_130(train_root, tmp_path):
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    proc = _popen(_supervised(root, run_dir), str(tmp_path))
    rc, err = _stop(proc, signal.SIGINT, run_dir, 3)
    assert rc == 130, err[-4000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-4000:]
    (line,) = _lines(err)
    assert "interrupted (SIGINT)" in line and "--resume" in line, line


def _run_pids(mark: str) -> list[int]:
    """Live processes whose environment carries the launch's mark (every descendant inherits it)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"LOONGFORGE_TEST_RUN={mark}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.append(int(pid))
    return out


def _shm_mapped(pids) -> set[str]:
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                names.update(ln.split()[-1] for ln in f if "/dev/shm/" in ln)
        except OSError:
            continue
    return names


def test_sigkill_of_the_supervisor_takes_every_rank_and_worker_with_it(train_root, tmp_path):
    """Whatever kills the supervisor (here SIGKILL: no handler runs), torchrun, both ranks and their decode
    workers are gone within seconds and leave no /dev/shm segment; the run dir's lock is free again. The
    ranks save on the way out, and rank 0, seeing its supervisor gone, prints the one line with the
    supervisor's resume command; torchrun's SignalException stays in the node's log."""
    from loongforge.train.resilience.runlock import RunLock

    root, _ = train_root
    run_dir = str(tmp_path / "run")
    proc = _popen(_supervised(root, run_dir, ("--workers", "2")), str(tmp_path),
                  env=dict(os.environ, LOONGFORGE_TEST_RUN=run_dir))
    try:
        _wait_steps(proc, run_dir, 2)
        pids = _run_pids(run_dir)
        shm = _shm_mapped(pids)
        assert len(pids) >= 6 and shm, (pids, shm)  # supervisor, torchrun, 2 ranks, their workers
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while _run_pids(run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _run_pids(run_dir)
        _, err = proc.communicate(timeout=30)  # the ranks hold the pipe until they are gone
    finally:
        _kill_tree(proc.pid)
        for pid in _run_pids(run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, [open(f"/proc/{p}/cmdline", "rb").read()[:200] for p in left]
    assert not [n for n in shm if os.path.exists(n)], shm
    RunLock(run_dir).acquire().release()
    assert "Traceback" not in err and "SignalException" not in err, err[-4000:]
    (line,) = _lines(err)
    latest = open(os.path.join(run_dir, "checkpoints", "latest")).read()
    assert f"checkpoint {latest} written (the elastic supervisor, pid {proc.pid}, is gone)" in line, line
    assert "resume: loongforge train --elastic --min-ranks 2" in line and line.endswith("--resume"), line


def test_a_failed_final_checkpoint_exits_1_naming_the_last_good_one(train_root, tmp_path, tiny_disk):
    """Checkpoints on a real tmpfs with room for one checkpoint, not two: the save at step 2 fits, the final
    one (step 3) hits ENOSPC. The run must not exit 0 with `latest` on the older step: exit 1 and one line
    naming step00000002 as the last good checkpoint."""
    import torch

    from loongforge.train.recipes import recipe
    from loongforge.train.model.build import build_model
    from loongforge.train.model.model import count_parameters

    root, index = train_root
    with torch.device("meta"):
        params = count_parameters(build_model(recipe("tiny").model))
    ckpt = 17 * params + (200 << 10)  # as in test_disk_full_during_save_training_continues
    subprocess.run(["mount", "-o", f"remount,size={int(1.5 * ckpt) >> 10}k", str(tiny_disk)], check=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(tiny_disk, run_dir / "checkpoints")
    proc = subprocess.run([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", str(run_dir),
                           "--steps", "3", "--save-every", "2", "--keep-last", "1", *COMMON], cwd=str(tmp_path),
                          env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert open(tiny_disk / "latest").read() == "step00000002"
    assert "no later save retries it" in proc.stderr and "next save retries" not in proc.stderr
    (line,) = _lines(proc.stderr)
    assert "the final checkpoint, step00000003, was NOT saved" in line, line
    assert "the last good checkpoint is step00000002 (`latest`)" in line and "--resume" in line, line


@pytest.mark.full  # a variant of test_sigterm_writes_a_checkpoint_at_the_step_and_the_resume_is_exact
def test_sigterm_skips_a_checkpoint_that_would_not_fit_the_grace_period(train_root, tmp_path):
    """Saves throttled to take seconds, a 1 s grace period: the SIGTERM checkpoint cannot fit, so the rank says
    so in one WARNING, leaves `latest` on the last periodic save and exits 143 within the grace period. (The
    SIGTERM comes between two periodic saves: with one in flight the step waits for it and the grace timer
    ends the rank, also 143.)"""
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    proc = _popen([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, "--steps", "100000",
                   "--save-every", "100", "--save-mbps", "2", "--term-grace-s", "1", *COMMON], str(tmp_path))
    latest = os.path.join(run_dir, "checkpoints", "latest")
    try:
        deadline = time.monotonic() + 200
        while not os.path.exists(latest) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        saved = open(latest).read()
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    warn = [ln for ln in err.splitlines() if "WARNING" in ln and "SIGTERM: no checkpoint at step" in ln]
    assert len(warn) == 1 and "of the grace period are left" in warn[0], err[-3000:]
    assert open(latest).read() == saved  # no SIGTERM save
    assert time.monotonic() - t0 < 30
    (line,) = _lines(err)
    assert "terminated (SIGTERM: no checkpoint" in line and line.endswith("--resume"), line


@pytest.mark.full  # two supervised launches; the watchdog's attribution has a unit test in test_ownership.py
def test_killing_only_torchrun_relaunches_on_both_ranks(train_root, tmp_path):
    """torchrun's agent SIGKILLed under --elastic: its ranks stop with it (they may write a checkpoint on the
    way out), the supervisor relaunches on the same 2 ranks (no rank is blamed) and the run finishes."""
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    cmd = _supervised(root, run_dir)
    cmd[cmd.index("100000")] = "30"
    proc = _popen(cmd, str(tmp_path))
    try:
        _wait_steps(proc, run_dir, 4)
        # torchrun's agent: the supervisor's child running agent.py that has the ranks below it (not the fork
        # server, nor the next launch's standby agent)
        (agent,) = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == proc.pid
                    and b"loongforge.train.resilience.elastic.agent" in _cmdline(int(p))
                    and any(_ppid(int(q)) == int(p) for q in os.listdir("/proc") if q.isdigit())]
        os.kill(agent, signal.SIGKILL)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    events = [r for r in _metrics(run_dir) if r.get("event") in ("elastic", "fault")]
    launches = [e for e in events if e.get("action") == "launch"]
    assert len(launches) == 2 and all(e["ranks"] == 2 for e in launches), events
    assert not [e for e in events if e.get("event") == "fault" and e.get("rank") is not None], events
    assert [r["step"] for r in _metrics(run_dir) if "event" not in r] == list(range(30))


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _cmdline(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []
