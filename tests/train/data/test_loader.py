import os
import signal
import time

import numpy as np
import pytest
import torch

from loongforge.shared import color
from loongforge.shared.errors import CheckpointError, DataWorkerError
from loongforge.shared.index import load_index
from loongforge.shared.reader import ShardReader
from loongforge.train.data.loader_v1 import ShardLoader


def _collect(loader, n):
    out = []
    for batch in loader:
        out.append({"ids": batch["sample_ids"].clone(), "front": batch["frames"]["front"].clone(),
                    "state": batch["state"].clone(), "valid": batch["sample_valid"].clone()})
        if len(out) == n:
            break
    return out


@pytest.mark.slow
def test_workers_0_1_2_give_identical_batches(train_root):
    root, index = train_root
    runs = []
    for workers in (0, 1, 2):
        with ShardLoader(root, batch_size=4, num_workers=workers, seed=3, rank=1, world=2, index=index,
                         max_steps=10) as loader:
            runs.append(_collect(loader, 10))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a["ids"], b["ids"])
            assert torch.equal(a["front"], b["front"]) and torch.equal(a["state"], b["state"])


def test_batch_content_matches_reader_and_reference_colour(train_root):
    root, index = train_root
    reader = ShardReader(root)
    ds = index.dataset
    with ShardLoader(root, batch_size=4, index=index, max_steps=1, image_mean=0.0, image_std=1.0) as loader:
        batch = next(iter(loader))
    for row, gid in enumerate(batch["sample_ids"].tolist()):
        sample = reader[gid]
        for slot in ds.slots:
            rgb = color.nv12_to_rgb(sample.frames[slot], ds.color_matrix, ds.color_range)  # (K, h, w, 3)
            want = np.moveaxis(rgb, -1, -3).astype(np.float32) / 255.0
            np.testing.assert_allclose(batch["frames"][slot][row].numpy(), want, atol=1e-6)
        np.testing.assert_allclose(batch["state"][row].numpy(), sample.state, atol=1e-6)  # stats: mean 0, std 1
        text = bytes(t for t in batch["task_tokens"][row].tolist() if t < 256).decode()
        assert text == sample.task
    assert batch["sample_valid"].all() and batch["frame_mask"].all()


def test_length_buckets_and_frame_mask(variable_root):
    root, index = variable_root
    with ShardLoader(root, batch_size=2, index=index, max_steps=12, frame_buckets=(2, 4)) as loader:
        shapes = set()
        for batch in loader:
            k = batch["frames"]["front"].shape[1]
            shapes.add(k)
            for row, gid in enumerate(batch["sample_ids"].tolist()):
                shard, local = index.locate(gid)
                real = index.shards[shard].frames[local]
                assert batch["frame_mask"][row].tolist() == [i < real for i in range(k)]
    assert shapes <= {2, 4} and 4 in shapes


def test_state_dict_resume_continues_exact_sequence(train_root):
    root, index = train_root
    kw = dict(batch_size=4, seed=9, index=index, shuffle_window=8)
    with ShardLoader(root, max_steps=20, **kw) as full:
        want = [b["sample_ids"].tolist() for b in full]  # crosses an epoch (16 steps per epoch)
    with ShardLoader(root, max_steps=7, **kw) as first:
        got = [b["sample_ids"].tolist() for b in first]
        state = first.state_dict()
    with ShardLoader(root, max_steps=20, **kw) as second:
        second.load_state_dict(state)
        got += [b["sample_ids"].tolist() for b in second]
    assert got == want
    with ShardLoader(root, max_steps=1, batch_size=8, seed=9, index=index) as other:
        with pytest.raises(CheckpointError, match="global_batch"):
            other.load_state_dict(state)
        with pytest.raises(CheckpointError, match="version"):
            other.load_state_dict({**state, "version": 99})


def _corrupt_one_sample(root, index):
    """Flip bytes inside one sample's frame payload; the shard hash no longer matches,
    but range reads (the loader's path) do not hash-check, so the decode must catch it."""
    entry = index.shards[1]
    path = os.path.join(root, entry.name)
    data = bytearray(open(path, "rb").read())
    off, length = entry.offsets[2], entry.lengths[2]
    data[off + length - 700: off + length - 600] = b"\xff" * 100
    with open(path, "wb") as f:
        f.write(data)
    return index.shard_start(1) + 2


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_sample_skip_is_counted_and_masked(tmp_path, workers):
    from loongforge.shared.synthetic import make_synthetic_root

    index = make_synthetic_root(str(tmp_path), shards=2, samples_per_shard=4)
    bad = _corrupt_one_sample(str(tmp_path), index)
    with ShardLoader(str(tmp_path), batch_size=8, index=index, max_steps=1, num_workers=workers,
                     start_method="spawn") as loader:
        batch = next(iter(loader))
        assert loader.bad_samples == 1
    row = batch["sample_ids"].tolist().index(bad)
    assert not batch["sample_valid"][row] and not batch["frame_mask"][row].any()
    assert batch["sample_valid"].sum() == 7
    with ShardLoader(str(tmp_path), batch_size=8, index=index, max_steps=1, num_workers=workers,
                     bad_samples="raise") as loader:
        with pytest.raises(DataWorkerError, match=f"sample {bad}"):
            next(iter(loader))


@pytest.mark.slow
def test_killed_worker_is_a_clear_error_not_a_hang(train_root):
    root, index = train_root
    loader = ShardLoader(root, batch_size=4, num_workers=2, index=index, max_steps=None)
    try:
        it = iter(loader)
        next(it)
        victim = loader._pool._procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(DataWorkerError) as info:
            for _ in range(1000):
                next(it)
        assert time.monotonic() - t0 < 30
        msg = str(info.value)
        assert "data worker 1" in msg and "exit code -9" in msg and "OOM killer" in msg
    finally:
        loader.close()


@pytest.mark.slow
def test_script_without_main_guard_gets_the_fix_in_the_error(train_root, tmp_path):
    """The classic spawn trap: workers re-import an unguarded main script, which starts a loader of
    its own and dies. The trainer's error must say so, and no shared-memory slot may be left behind."""
    import subprocess
    import sys

    root, _ = train_root
    script = tmp_path / "unguarded.py"
    script.write_text("from loongforge.train.data.loader_v1 import ShardLoader\n"
                      f"with ShardLoader({root!r}, batch_size=4, num_workers=1, max_steps=2) as loader:\n"
                      "    for batch in loader:\n"
                      "        pass\n")
    before = set(os.listdir("/dev/shm"))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]  # the trainer's own error, after the worker's traceback
    assert last.startswith("loongforge.shared.errors.DataWorkerError: data worker 0"), run.stderr[-3000:]
    assert "re-import the main module" in last and "OOM killer" not in last
    assert "leaked shared_memory" not in run.stderr
    assert set(os.listdir("/dev/shm")) - before == set()


def _cache_client_or_skip():
    try:
        import importlib

        importlib.import_module("loongforge.cache.client")
        importlib.import_module("loongforge.cache.daemon")
    except ImportError as exc:
        pytest.skip(f"loongforge.cache not importable yet ({exc}); the origin path is covered above")


@pytest.mark.slow
def test_through_real_cache_daemon(train_root, tmp_path):
    """Workers read through a real `loongforge cache serve` (one node, no Redis); the rank's
    announce reaches the daemon as a plan; batches equal the origin's."""
    import json
    import subprocess
    import sys

    from loongforge.train.data.sources import SourceSpec

    _cache_client_or_skip()
    root, index = train_root
    sock = str(tmp_path / "cache.sock")
    cli = [sys.executable, "-m", "loongforge", "cache"]
    daemon = subprocess.Popen([*cli, "serve", "--origin", root, "--socket", sock, "--ram-dir", str(tmp_path / "ram"),
                               "--ram-budget", "64MiB", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-budget", "256MiB"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert daemon.poll() is None, f"cache daemon exited: {daemon.stdout.read()[-2000:]}"
            assert time.monotonic() < deadline, "cache daemon did not create its socket in 30 s"
            time.sleep(0.1)
        spec = SourceSpec(root=root, cache_socket=sock)
        with ShardLoader(root, batch_size=4, index=index, max_steps=4, source=spec, num_workers=1) as via_cache:
            a = [(bt["sample_ids"].clone(), bt["frames"]["wrist"].clone()) for bt in via_cache]
        with ShardLoader(root, batch_size=4, index=index, max_steps=4) as origin:
            b = [(bt["sample_ids"].clone(), bt["frames"]["wrist"].clone()) for bt in origin]
        assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
        stats = subprocess.run([*cli, "stats", "--socket", sock, "--json"], capture_output=True, text=True,
                               timeout=30)
        doc = json.loads(stats.stdout)
        served = sum(doc["counters"]["hits"].values()) + sum(doc["counters"]["fills"].values())
        assert served > 0, doc["counters"]
        assert doc["plans"], "the loader's announce() did not reach the daemon"
    finally:
        subprocess.run([*cli, "stop", "--socket", sock], capture_output=True, timeout=30)
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=5)


@pytest.mark.slow
def test_cache_client_without_daemon_degrades_to_origin(train_root, tmp_path):
    _cache_client_or_skip()
    from loongforge.train.data.sources import SourceSpec

    root, index = train_root
    spec = SourceSpec(root=root, cache_socket=str(tmp_path / "no-daemon.sock"))
    with ShardLoader(root, batch_size=4, index=index, max_steps=3, source=spec, num_workers=1) as via_cache:
        a = [bt["frames"]["wrist"].clone() for bt in via_cache]
    with ShardLoader(root, batch_size=4, index=index, max_steps=3) as origin:
        b = [bt["frames"]["wrist"].clone() for bt in origin]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_missing_cache_module_falls_back_with_warning(train_root, monkeypatch):
    import sys

    from loongforge.shared.source import OriginSource
    from loongforge.train.data.sources import SourceSpec, make_source

    monkeypatch.setitem(sys.modules, "loongforge.cache.client", None)  # import raises ImportError
    root, index = train_root
    with pytest.warns(RuntimeWarning, match="reading the origin"):
        src = make_source(SourceSpec(root=root, cache_socket="/nonexistent.sock"), load_index(root))
    assert isinstance(src, OriginSource)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetch_matches_cpu(train_root):
    """Pinned buffers + side-stream copy + device NV12->RGB give the CPU path's tensors."""
    root, index = train_root
    with ShardLoader(root, batch_size=4, index=index, max_steps=6, device="cuda", num_workers=1) as gpu:
        got = [{k: (v["front"] if k == "frames" else v).cpu() for k, v in b.items() if k != "meta"} for b in gpu]
    with ShardLoader(root, batch_size=4, index=index, max_steps=6) as cpu:
        want = [{k: (v["front"] if k == "frames" else v) for k, v in b.items() if k != "meta"} for b in cpu]
    for a, b in zip(got, want):
        for key in b:
            assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5), key


@pytest.mark.slow
def test_workers_exit_when_the_trainer_is_killed(train_root, tmp_path):
    """SIGKILL of the main process (OOM killer, scheduler) must not leave decode workers behind."""
    import subprocess
    import sys

    root, _ = train_root
    script = tmp_path / "victim.py"
    script.write_text(
        "import sys, time\n"
        "from loongforge.train.data.loader_v1 import ShardLoader\n"
        "if __name__ == '__main__':\n"
        "    loader = ShardLoader(sys.argv[1], batch_size=4, num_workers=2)\n"
        "    it = iter(loader); next(it)\n"
        "    print(' '.join(str(p.pid) for p in loader._pool._procs), flush=True)\n"
        "    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script), root], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if _alive(p)]
    assert not alive, f"decode workers {alive} outlived their killed parent"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
