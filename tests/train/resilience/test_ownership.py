"""Who owns a run, in-process and cheap: the resume tag agreed by name (2 gloo ranks), the run-dir lock,
stale build locks, the start-up watchdog, the watchdog's blame for a dead torchrun agent, the elastic
supervisor's up-front rank-count check, and the bad-sample summary."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest

from loongforge.shared.errors import CheckpointError, UsageError

PY = sys.executable


# -- the resume tag, agreed by name ----------------------------------------------------------------------

def _publish(run_dir: str, steps) -> None:
    import torch

    from loongforge.train.ckpt import files as ckpt_files
    from loongforge.train.ckpt.async_writer import SaveJob, run_job

    root = ckpt_files.ckpt_root(run_dir)
    for step in steps:
        tag = f"step{step:08d}"
        sidecar = {"format": "loongforge-checkpoint", "format_version": 2, "step": step, "world": 1, "loader": {}}
        assert run_job(SaveJob(root=root, tag=tag, rank=0, world=1,
                               snapshots=[(os.path.join(root, tag, "model.pt"), {"w": torch.full((8,), float(step))})],
                               blobs=[(os.path.join(root, tag, ckpt_files.SIDECAR), json.dumps(sidecar).encode())]))


def _agree_while_latest_moves(rank: int, world: int, run_dir: str, out: str) -> None:
    """Rank 0 reads `latest`, then (the test hook) `latest` moves to an older tag before rank 1 looks:
    what a second launch on the run dir, or a per-node directory cache, does."""
    import torch

    from loongforge.train.ckpt import fallback, files as ckpt_files

    real = ckpt_files.latest_tag
    if rank == 0:
        def read_then_move(d):
            tag = real(d)
            with open(os.path.join(ckpt_files.ckpt_root(d), "latest"), "w") as f:
                f.write("step00000002")
            return tag
        ckpt_files.latest_tag = read_then_move
    try:
        torch.distributed.barrier()
        tag = fallback.agree_resume_tag(run_dir, rank=rank, device=torch.device("cpu"))
    finally:
        ckpt_files.latest_tag = real
    with open(f"{out}.{rank}", "w") as f:
        f.write(tag)


def test_every_rank_resumes_rank_0s_tag_by_name_even_when_latest_moves(tmp_path):
    from tests.train.parallel.dist_helpers import run_ranks

    run_dir = str(tmp_path / "run")
    _publish(run_dir, (2, 4))
    run_ranks(_agree_while_latest_moves, 2, run_dir, str(tmp_path / "tag"))
    assert [open(tmp_path / f"tag.{r}").read() for r in (0, 1)] == ["step00000004", "step00000004"]


def _check_mixed(rank: int, world: int, out: str) -> None:
    import torch

    from loongforge.train.ckpt import fallback

    tag = ("step00000004", "step00000002")[rank]
    try:
        fallback.check_same_checkpoint(tag, int(tag[4:]), device=torch.device("cpu"))
    except CheckpointError as exc:
        with open(f"{out}.{rank}", "w") as f:
            f.write(str(exc))


def test_ranks_that_restored_different_checkpoints_refuse_on_every_rank(tmp_path):
    from tests.train.parallel.dist_helpers import run_ranks

    run_ranks(_check_mixed, 2, str(tmp_path / "err"))
    for r in (0, 1):
        msg = open(tmp_path / f"err.{r}").read()
        assert "rank 0: step 4, rank 1: step 2" in msg and "another launch" in msg, msg


# -- one live run per run dir -----------------------------------------------------------------------------

def _hold_lock(run_dir: str) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import sys, time
        from loongforge.train.resilience.runlock import RunLock
        RunLock({run_dir!r}).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_of_a_run_dir_is_refused_naming_the_first_until_it_dies(tmp_path):
    from loongforge.train.resilience.runlock import RunLock

    run_dir = str(tmp_path / "run")
    holder = _hold_lock(run_dir)
    try:
        with pytest.raises(UsageError, match=rf"in use by a live run \(pid {holder.pid} on \S+, started 20"):
            RunLock(run_dir).acquire()
    finally:
        holder.kill()  # SIGKILL: the kernel drops the flock with the process
        holder.wait()
    RunLock(run_dir).acquire().release()


def test_a_training_launch_on_a_locked_run_dir_exits_2_naming_the_holder(train_root, tmp_path):
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    holder = _hold_lock(run_dir)
    try:
        proc = subprocess.run([PY, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, "--steps", "2",
                               "--batch-size", "8", "--recipe", "tiny", "--no-ds-breakdown"], cwd=str(tmp_path),
                              capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is in use by a live run (pid {holder.pid}" in proc.stderr
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))  # it never trained


# -- start-up: stale build locks and the start-up watchdog -----------------------------------------------

def test_a_build_lock_left_by_a_dead_builder_is_removed_and_a_held_one_is_kept(tmp_path, caplog):
    from loongforge.train.resilience.startup import clear_stale_build_locks

    stale = tmp_path / "deepspeed_shm_comm" / "lock"
    held = tmp_path / "fused_adam" / "lock"
    for p in (stale, held):
        p.parent.mkdir()
        p.write_text("")
    with open(held) as f, caplog.at_level(logging.WARNING):  # a live builder keeps its lock open
        assert clear_stale_build_locks(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and held.exists()
    assert f"removed a stale build lock {stale}" in caplog.text


def test_no_first_step_in_time_ends_the_rank_naming_its_phase(tmp_path):
    code = textwrap.dedent(f"""
        import logging, time
        logging.basicConfig(level="INFO")
        from loongforge.train.resilience.startup import StartupWatch
        w = StartupWatch(1.0, run_dir={str(tmp_path)!r}, rank=0).start()
        w.enter("init_distributed", "rendezvous of 2 ranks")
        time.sleep(60)
    """)
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75, proc.stderr
    assert "no first step within 1 s (--startup-timeout-s): stuck in phase 'init_distributed' (rendezvous of 2 " \
        "ranks)" in proc.stderr
    (rec,) = [json.loads(ln) for ln in open(tmp_path / "metrics.jsonl")]
    assert (rec["kind"], rec["rank"], rec["phase"]) == ("startup", None, "init_distributed")


# -- the watchdog blames torchrun's agent, not rank 0, when the agent's store dies ------------------------

def test_a_dead_agent_store_is_the_launchers_fault_not_rank_0s(tmp_path, monkeypatch):
    from loongforge.train.resilience.watchdog import Watchdog

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    w = Watchdog(rank=1, world=2, run_dir=str(tmp_path), heartbeat_s=0.01, hang_timeout_s=60)
    w._store_failed_since = 1.0  # failing for a long time
    kind, rank, _, _, why = w._store_trouble(ConnectionResetError())
    assert (kind, rank) == ("launcher", None) and "torchrun agent" in why
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    kind, rank, _, _, _ = w._store_trouble(ConnectionResetError())
    assert (kind, rank) == ("dead", 0)  # the deepspeed launcher / a plain run: rank 0 serves the store


# -- the elastic supervisor checks its rank counts against tp x sp before any launch ----------------------

def test_elastic_rank_counts_that_do_not_fit_tp_are_a_usage_error_up_front(tmp_path):
    from loongforge.train.resilience.elastic.supervisor import Supervisor

    args = types.SimpleNamespace(batch_plan=None, min_ranks=1, max_ranks=2, tp=2, sp=1, zero=2, batch_size=8,
                                 grad_accum=1, grad_compression="none", capacity_file=None, max_restarts=3,
                                 run_dir=str(tmp_path / "run"), steps=4, resume=False, term_grace_s=60.0)
    with pytest.raises(UsageError, match=r"multiple of tp x sp = 2 ranks"):
        Supervisor(args, [])
    assert not os.path.exists(tmp_path / "run")  # nothing launched, nothing locked


def test_elastic_tp_mismatch_is_one_line_and_exit_2_from_the_cli(tmp_path):
    proc = subprocess.run([PY, "-m", "loongforge", "train", "--elastic", "--min-ranks", "1", "--max-ranks", "2",
                           "--tp", "2", "--data", str(tmp_path), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "multiple of tp x sp" in err[0], proc.stderr


# -- a corrupt shard: one line per shard with its count, not one per sample -------------------------------

def test_bad_samples_log_once_per_shard_then_one_summary_with_the_count(caplog):
    from loongforge.train.data.workers import BadSamples

    bad = BadSamples()
    with caplog.at_level(logging.WARNING):
        bad.add([f"sample {i} (episode 3, t {i}): truncated block in /d/shard-00002.tar" for i in range(300)])
        bad.add(["sample 9 (episode 0, t 9): truncated block in /d/shard-00000.tar"])
        bad.summarize()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines  # first of each shard, then one summary per shard
    assert "skipped 300 bad samples from /d/shard-00002.tar (data.bad_samples='skip'; sample ids 0-299)" in lines[3]
    assert "skipped 1 bad sample from /d/shard-00000.tar (data.bad_samples='skip'; sample ids 9)" in lines[2]
    from loongforge.benchmarks.faults.data import _skipped

    _, ids, events = _skipped([f"x {ln}" for ln in lines])  # what the fault suite reads back
    assert ids == set(range(300)) and events == 301


def test_the_resume_command_names_the_launcher_and_drops_its_per_rank_flags():
    from loongforge.train.resilience.exits import resume_command

    argv = ["--local_rank=1", "--data", "D", "--run-dir", "R", "--resume"]
    ds = {"LOCAL_SIZE": "2", "CROSS_RANK": "0"}
    assert resume_command(argv, ds) == "deepspeed --num_gpus 2 --module loongforge.train --data D --run-dir R --resume"
    tr = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}
    assert resume_command(["--local-rank", "0", "--data", "D"], tr) == \
        "torchrun --nproc_per_node 2 -m loongforge.train --data D --resume"
    assert resume_command(["--data", "a b"], {}) == "loongforge train --data 'a b' --resume"


@pytest.mark.slow
def test_a_config_error_in_a_supervised_launch_ends_the_supervisor_with_2_and_no_retry(train_root, tmp_path):
    """A config error only a rank finds (here: a batch its data cannot fill) is not a fault: one launch, exit 2."""
    from tests.train.train_launch import VENV_BIN, launch_env

    root, _ = train_root
    run_dir = tmp_path / "run"
    proc = subprocess.run([str(VENV_BIN / "loongforge"), "train", "--elastic", "--min-ranks", "1", "--max-ranks", "1",
                           "--data", root, "--run-dir", str(run_dir), "--steps", "2", "--recipe", "no-such-recipe",
                           "--batch-size", "8", "--no-ds-breakdown", "--max-restarts", "3"], cwd=str(tmp_path),
                          env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    events = [json.loads(ln) for ln in open(run_dir / "metrics.jsonl")]
    assert len([e for e in events if e.get("action") == "launch"]) == 1, events
    assert "no-such-recipe" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
