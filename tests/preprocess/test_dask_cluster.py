"""The preprocess job on a real dask.distributed cluster (Beam's Dask runner): a scheduler and two
single-threaded worker processes on 127.0.0.1, started here as `dask scheduler` / `dask worker`.
Every output is compared byte for byte with the local runner's (FnApiRunner) on the same input;
the tasks' own events say which worker converted which episode, and how often."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.preprocess.runner.choice import RunnerConfig
from loongforge.preprocess.samples.dataset import generate_dataset
from loongforge.shared import paths
from loongforge.shared.errors import RunnerError
from tests.preprocess.conftest import tree
from tests.preprocess.dask_cluster import DaskProcs

SIX = {"episodes": 6, "frames": (8, 12), "height": 32, "width": 48, "gop": 4}
SPLIT = "1,4"  # validation episodes


def assert_same_tree(got: str, want: str) -> None:
    a, b = tree(got), tree(want)
    assert sorted(a) == sorted(b)
    assert [name for name in a if a[name] != b[name]] == []
    assert {"index.json", paths.FAILED_FILE} <= set(a) and any(n.startswith("shards/") for n in a)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    procs = DaskProcs(tmp_path_factory.mktemp("dask"))
    yield procs
    procs.stop()


@pytest.fixture(scope="module")
def six(tmp_path_factory) -> str:
    return str(generate_dataset(tmp_path_factory.mktemp("lerobot") / "six", **SIX))


def dask_job(data: str, out: str, address: str, **overrides) -> dict:
    cfg = PreprocessConfig(input=data, output=out, shard_size=1 << 16, block_frames=4, **overrides)
    return run_job(cfg, [], RunnerConfig(name="dask", dask_scheduler=address))


def local_job(data: str, out: str, run_in_memory, **overrides) -> dict:
    return run_in_memory(data, out, shard_size=1 << 16, block_frames=4, **overrides)


def test_dask_output_is_the_local_runners_byte_for_byte(cluster, six, tmp_path, run_in_memory, caplog):
    """Byte-identical output; both workers converted episodes, none twice; progress lines from
    the tasks' events; the summary's counters (from the outputs: the runner has no metrics) are
    the local runner's Beam counters."""
    want = local_job(six, str(tmp_path / "local"), run_in_memory)
    with caplog.at_level(logging.INFO, logger="loongforge.preprocess.runner.progress"):
        got = dask_job(six, str(tmp_path / "dask"), cluster.address, progress_s=0.2)
    assert_same_tree(str(tmp_path / "dask"), str(tmp_path / "local"))
    assert len(open_shards(tmp_path / "dask")) > 1  # 64 KB shards: several shard writes
    conversions = got["conversions"]
    assert conversions["attempts"] == SIX["episodes"] and conversions["repeated"] == []
    assert sorted(conversions["by_worker"]) == sorted(cluster.worker_addresses().values())
    assert all(n >= 1 for n in conversions["by_worker"].values())
    assert got["counters"] == want["counters"] and got["counters"]["episodes_converted"] == SIX["episodes"]
    lines = [r.getMessage() for r in caplog.records if r.name == "loongforge.preprocess.runner.progress"]
    assert lines and all(f"/{SIX['episodes']} episodes" in line for line in lines)
    assert lines[-1].startswith(f"progress: {SIX['episodes']}/{SIX['episodes']} episodes (0 failed)")


def open_shards(root: Path) -> list[Path]:
    return sorted((root / paths.SHARD_DIR).glob("*.tar"))


def test_corrupt_episode_same_records_and_exit_code(cluster, quirky_dataset, tmp_path, run_in_memory, capsys):
    """`loongforge preprocess --runner dask --dask-scheduler ...`: the same failed.jsonl and
    index as the local runner, and exit 3 when more records failed than --allow-failed permits."""
    from loongforge.cli import main

    want = local_job(quirky_dataset, str(tmp_path / "local"), run_in_memory, frame_mismatch="fail")
    out = str(tmp_path / "dask")
    rc = main(["preprocess", "--input", quirky_dataset, "--output", out, "--shard-size", "64KiB",
               "--block-frames", "4", "--allow-failed", "1", "--progress-s", "0", "--json", "--frame-mismatch", "fail",
               "--runner", "dask", "--dask-scheduler", cluster.address])
    assert want["failed"] == 2 and rc == 3, capsys.readouterr().err[-2000:]
    assert_same_tree(out, str(tmp_path / "local"))
    assert (Path(out) / paths.FAILED_FILE).read_text().count("\n") == 2


def test_validation_split_is_identical(cluster, six, tmp_path, run_in_memory):
    local_job(six, str(tmp_path / "local"), run_in_memory, val_episodes=SPLIT)
    got = dask_job(six, str(tmp_path / "dask"), cluster.address, val_episodes=SPLIT, progress_s=0)
    assert_same_tree(str(tmp_path / "dask"), str(tmp_path / "local"))
    assert got["conversions"]["repeated"] == []


def test_lerobot_v3_shared_files_are_identical(cluster, six, tmp_path, run_in_memory):
    """LeRobot v3.0: episodes are spans of shared parquet and mp4 files, each worker seeking into
    the same files."""
    from loongforge.preprocess.samples.layouts import write_v3

    v3 = str(write_v3(six, tmp_path / "v3", codec="h264", gop=2, episodes_per_file=4))
    local_job(v3, str(tmp_path / "local"), run_in_memory)
    got = dask_job(v3, str(tmp_path / "dask"), cluster.address, progress_s=0)
    assert_same_tree(str(tmp_path / "dask"), str(tmp_path / "local"))
    assert got["conversions"]["attempts"] == SIX["episodes"] and got["failed"] == 0


def test_a_scheduler_without_workers_is_one_clear_error(tmp_path, sample_dataset, monkeypatch):
    import loongforge.preprocess.runner.dask_job as dask_module

    monkeypatch.setattr(dask_module, "WORKERS_TIMEOUT_S", 1)
    procs = DaskProcs(tmp_path / "lonely", workers=0)
    try:
        with pytest.raises(RunnerError, match=f"no dask worker joined {procs.address}"):
            dask_job(sample_dataset, str(tmp_path / "out"), procs.address)
    finally:
        procs.stop()
    assert not (tmp_path / "out").exists()  # refused before the output was touched


KILL = {"episodes": 8, "frames": (24, 32), "height": 48, "width": 64, "gop": 4}


def _holds_a_dofn_result(client, worker: str) -> bool:
    """The Dask runner names each ParDo's partitions apply_dofn_to_bundle-*: the first ones in
    memory are converted episodes (nothing else is ready before them)."""
    keys = client.has_what().get(worker, ())
    return any(str(k[0] if isinstance(k, tuple) else k).startswith("apply_dofn_to_bundle") for k in keys)


def _run_and_kill_a_worker(procs: DaskProcs, data: str, out: str) -> tuple[dict | Exception, bool]:
    """The job in a thread; SIGKILL worker w0 once it holds a converted episode (a result still
    needed downstream, lost with the worker). Returns the job's summary (or its exception) and whether
    the kill came mid-job (the job still running, no index.json)."""
    from distributed import Client

    done: dict = {}

    def job():
        try:
            done["summary"] = dask_job(data, out, procs.address, progress_s=0)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            done["summary"] = exc

    victim = procs.worker_addresses()["w0"]
    thread = threading.Thread(target=job)
    with Client(procs.address, timeout=30, set_as_default=False) as client:
        thread.start()
        deadline = time.monotonic() + 120
        while not _holds_a_dofn_result(client, victim) and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.01)
        mid_job = thread.is_alive() and not (Path(out) / "index.json").exists()
        procs.kill_worker(0)
    thread.join(timeout=300)
    return done["summary"], mid_job


@pytest.fixture(scope="module")
def kill_data(tmp_path_factory) -> str:
    return str(generate_dataset(tmp_path_factory.mktemp("lerobot") / "kill", **KILL))


def test_worker_killed_mid_job_the_job_completes_identically(tmp_path, kill_data, run_in_memory):
    """SIGKILL one of two workers while episodes convert: dask recomputes what it held or ran on
    the other worker, and the output is still the local runner's, byte for byte."""
    procs = DaskProcs(tmp_path / "dask-kill")
    try:
        victim, survivor = (procs.worker_addresses()[w] for w in ("w0", "w1"))
        summary, mid_job = _run_and_kill_a_worker(procs, kill_data, str(tmp_path / "dask"))
    finally:
        procs.stop()
    assert mid_job, "the worker was killed after the job had finished: nothing was tested"
    assert procs.workers[0].returncode == -9
    assert isinstance(summary, dict), summary
    local_job(kill_data, str(tmp_path / "local"), run_in_memory)
    assert_same_tree(str(tmp_path / "dask"), str(tmp_path / "local"))
    conversions = summary["conversions"]  # the victim converted before it died; what it held was redone
    assert set(conversions["by_worker"]) == {victim, survivor}
    assert conversions["attempts"] == KILL["episodes"] + len(conversions["repeated"])


@pytest.mark.full
def test_worker_lost_past_the_retries_fails_clearly_and_publishes_nothing(tmp_path, kill_data):
    """A scheduler that retries no task whose worker died (allowed-failures 0): the kill fails the
    job with one RunnerError, and no index.json is published."""
    procs = DaskProcs(tmp_path / "dask-fail", env={"DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"})
    try:
        summary, mid_job = _run_and_kill_a_worker(procs, kill_data, str(tmp_path / "dask"))
    finally:
        procs.stop()
    assert mid_job
    assert isinstance(summary, RunnerError), summary
    assert "Nothing was published" in str(summary) and "died" in str(summary)
    assert not (tmp_path / "dask" / "index.json").exists()
    with pytest.raises(Exception, match="index.json"):
        from loongforge.shared.dataset import open_root

        open_root(str(tmp_path / "dask"))
