"""BlockLoader (train/data/loader.py) over real shard roots written by shared/writer.py: sample
semantics, real decode workers, resume, bad samples, the cache daemon, dying workers."""

import os
import signal
import time

import numpy as np
import pytest
import torch

from loongforge.shared import color
from loongforge.shared.dataset import open_root
from loongforge.shared.errors import CheckpointError, DataWorkerError
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.data.loader import LEND_EXTRA, BlockLoader
from loongforge.train.data.samples import DeltaSpec

LENGTHS = (9, 5, 12, 3, 7, 10)
TASKS = ("pick up the red cube", "open the drawer")


@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("small_root"))
    written = make_synthetic_root(root, lengths=LENGTHS, height=8, width=8, block_size=4, shard_size=4096)
    return root, written


def _loader(root, **kw):
    kw.setdefault("batch_size", 4)
    return BlockLoader(root, rgb=False, **kw)


def _locate(gid):
    ends = np.cumsum(LENGTHS)
    e = int(np.searchsorted(ends, gid, side="right"))
    return e, gid - int(ends[e] - LENGTHS[e])


def _root_processor(root):
    """The root's own N1.6 processing (its recorded embodiment: one "state" and one "action" key, min/max)."""
    from loongforge.shared.dataset import open_root
    from loongforge.train.data.state_action import StateAction, root_embodiment

    found = root_embodiment(open_root(root).info)
    return StateAction(found.config, found.statistics)


def _check_batch(batch, written, spec, sa):
    for row, gid in enumerate(batch["sample_ids"].tolist()):
        e, t = _locate(gid)
        n = LENGTHS[e]
        frames, arrays = written[e]
        shown = np.clip(t + np.asarray(spec.video), 0, n - 1)  # video clamped into the episode
        for slot in ("front", "wrist"):
            np.testing.assert_array_equal(batch["frames"][slot][row].numpy(), frames[slot][shown])
        state = {"state": arrays["state"][shown]}
        np.testing.assert_allclose(batch["state"][row].numpy(), sa.state(state))
        rows = np.minimum(t + np.arange(spec.action_horizon), n - 1)  # past the end: the last row, masked
        np.testing.assert_allclose(batch["action"][row].numpy(), sa.action({"action": arrays["action"][rows]}, state))
        assert batch["action_valid"][row].tolist() == (t + np.arange(spec.action_horizon) < n).tolist()
        text = bytes(v for v in batch["task_tokens"][row].tolist() if v < 256).decode()
        assert text == TASKS[e % 2]
    assert batch["frame_mask"].all() and batch["sample_valid"].all()


def test_batches_hold_the_gr00t_sample_semantics(small_root):
    root, written = small_root
    spec = DeltaSpec(video=(-3, 0), action_horizon=4)
    with _loader(root, deltas=spec, max_steps=11) as loader:
        ids = []
        for batch in loader:
            assert batch["frames"]["front"].shape == (4, 2, 12, 8)
            _check_batch(batch, written, spec, _root_processor(root))
            ids += batch["sample_ids"].tolist()
    assert len(ids) == len(set(ids)) == 44  # one epoch (46 samples, tail of 2 dropped), each once


@pytest.mark.parametrize("rgb", [False, True])
def test_inline_batches_fill_recycled_memory_and_kept_ones_stay_intact(small_root, rgb):
    """Inline decode fills each batch straight into recycled output memory (NV12 out: no copy at all);
    a batch the consumer keeps is never refilled, and the dropped ones are reused."""
    root, _ = small_root
    kw = dict(deltas=DeltaSpec(video=(-3, 0), action_horizon=4), max_steps=30, rgb=rgb)
    with BlockLoader(root, batch_size=4, recycle_buffers=False, **kw) as fresh:
        want = list(fresh)
    kept = {}
    with BlockLoader(root, batch_size=4, **kw) as loader:
        for i, batch in enumerate(loader):
            if not rgb:  # every field within the one buffer the batch was decoded into
                ptrs = [t.data_ptr() for t in (*batch["frames"].values(), batch["state"], batch["sample_ids"])]
                assert max(ptrs) - min(ptrs) < loader.layout.nbytes
            if i % 5 == 0:
                kept[i] = batch
        allocated = loader._prefetcher._host.allocated
    keys = 1 if not rgb else 3  # the batch buffer, and one float RGB buffer per camera
    assert allocated <= keys * (loader.prefetch + 3 + len(kept)), allocated
    for i, batch in kept.items():
        for name in ("state", "action", "action_valid", "sample_ids", "task_tokens"):
            assert torch.equal(batch[name], want[i][name]), (i, name)
        for slot in ("front", "wrist"):
            assert torch.equal(batch["frames"][slot], want[i]["frames"][slot]), (i, slot)


@pytest.mark.slow
def test_worker_batches_are_lent_out_of_the_ring_and_kept_ones_stay_intact(small_root):
    """NV12 out from workers on CPU: a batch is the shared-memory slot the worker filled (no copy), and the
    slot returns to the ring once the consumer drops it. A consumer that keeps more batches than the lending
    limit gets copies from then on, so the workers never run out of slots and no kept batch is overwritten."""
    root, _ = small_root
    kw = dict(deltas=DeltaSpec(video=(-3, 0), action_horizon=4), max_steps=40)
    with _loader(root, **kw) as inline:
        want = [{k: (v.clone() if k != "frames" else {s: f.clone() for s, f in v.items()}) for k, v in b.items()
                 if k != "meta"} for b in inline]
    kept = {}
    with _loader(root, num_workers=1, **kw) as loader:
        assert loader.lend
        it = iter(loader)
        first = next(it)
        slots = [loader._pool.buffer(i) for i in range(loader._pool_args["slots"])]
        spans = [(np.frombuffer(b, np.uint8).ctypes.data, len(b)) for b in slots]
        kept[0] = first
        for i in range(1, 40):  # next(), not a for loop over the loader: iter() would restart the pipeline
            batch = next(it)
            ptr = batch["frames"]["front"].data_ptr()
            if i % 4 == 0:
                kept[i] = batch  # 10 kept: more than the lending limit
            elif i < 4:  # fewer than the limit out whatever the prefetch thread staged ahead: lent, in a ring slot
                assert any(lo <= ptr < lo + n for lo, n in spans), i
        lent = loader._lender.lent
    # more lent than the limit (prefetch 2 + LEND_EXTRA) out at once: dropped batches went back to the ring;
    # once the kept ones held the limit, every batch after that was copied out
    assert len(kept) > 2 + LEND_EXTRA and 2 + LEND_EXTRA < lent < 40
    for i, batch in kept.items():
        for name in ("state", "action", "action_valid", "sample_ids", "task_tokens"):
            assert torch.equal(batch[name], want[i][name]), (i, name)
        for slot in ("front", "wrist"):
            assert torch.equal(batch["frames"][slot], want[i]["frames"][slot]), (i, slot)


@pytest.mark.slow
def test_workers_0_1_2_give_identical_batches_and_count_cache_hits(small_root):
    root, written = small_root
    spec = DeltaSpec(video=(0,), action_horizon=3)
    runs, counters = [], []
    for workers in (0, 1, 2):
        with _loader(root, deltas=spec, num_workers=workers, max_steps=10, rank=1, world=2,
                     block_run=2, block_window=16) as loader:
            it = iter(loader)
            got = [next(it)]
            # The bench opens its timed window here: every worker past start-up, and it is told how
            # many batches may already sit decoded ahead (ring slots + prefetch queue) to skip. NV12 out with
            # workers lends batches out of the ring: prefetch + LEND_EXTRA more slots.
            assert loader.wait_ready(60) == (2 * workers + 1 + (2 + LEND_EXTRA) + 2 if workers else 2)
            assert workers == 0 or loader._pool.workers_ready == workers
            got += [next(it) for _ in range(9)]  # not list(it): iter() would restart the pipeline
            with pytest.raises(StopIteration):
                next(it)
            runs.append([(b["sample_ids"].clone(), b["frames"]["front"].clone(), b["action"].clone())
                         for b in got])
            counters.append(loader.cache_counters())
    for other in runs[1:]:
        for (ia, fa, aa), (ib, fb, ab) in zip(runs[0], other):
            assert torch.equal(ia, ib) and torch.equal(fa, fb) and torch.equal(aa, ab)
    for c in counters:
        assert c["hits"] > 0 and c["misses"] > 0 and c["samples"] == 20


@pytest.mark.slow
def test_wait_ready_raises_when_a_worker_cannot_start(tmp_path):
    root = str(tmp_path / "r")
    make_synthetic_root(root, lengths=(6, 6), height=8, width=8, block_size=4)
    loader = _loader(root, num_workers=1, max_steps=2)
    import shutil

    shutil.rmtree(f"{root}/index")  # the worker opens the tables itself: its start-up fails
    try:
        iter(loader)
        with pytest.raises(DataWorkerError, match="died|failed to start"):
            loader.wait_ready(60)  # never a hang, never a silent partial pool
    finally:
        loader.close()


def _flip_block_byte(root, episode, camera, block):
    ds = open_root(root)
    name, off, length, _, _ = ds.block_entry(episode, camera, block)
    path = f"{root}/{name}"
    data = bytearray(open(path, "rb").read())
    data[off + length // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("workers", [0, 1])
def test_corrupt_block_is_a_masked_counted_bad_sample(tmp_path, workers):
    root = str(tmp_path)
    make_synthetic_root(root, lengths=(8, 8), height=8, width=8, block_size=4)
    _flip_block_byte(root, 1, "wrist", 0)
    with _loader(root, max_steps=4, batch_size=4, num_workers=workers) as loader:
        bad_rows = 0
        for batch in loader:
            for row, gid in enumerate(batch["sample_ids"].tolist()):
                if gid in (8, 9, 10, 11):  # episode 1, t < 4: block 0 of its wrist camera
                    assert not batch["sample_valid"][row] and not batch["action_valid"][row].any()
                    assert not batch["frame_mask"][row].any()
                    bad_rows += 1
                else:
                    assert batch["sample_valid"][row]
        assert loader.bad_samples == bad_rows == 4
    with _loader(root, max_steps=4, batch_size=4, num_workers=workers, bad_samples="raise") as loader:
        with pytest.raises(DataWorkerError, match="xxh3"):
            list(loader)


def test_val_episodes_are_left_out(tmp_path):
    root = str(tmp_path)
    make_synthetic_root(root, lengths=(4, 4, 4), height=8, width=8, val_episodes=(1,))
    with _loader(root, max_steps=2) as loader:
        ids = [i for b in loader for i in b["sample_ids"].tolist()]
    assert sorted(ids) == [0, 1, 2, 3, 8, 9, 10, 11]


def test_resume_continues_the_exact_sequence_and_refuses_another_order(small_root):
    root, _ = small_root
    kw = dict(seed=5, block_run=2, block_window=8)
    with _loader(root, max_steps=16, **kw) as full:  # crosses the epoch (11 steps)
        want = [b["sample_ids"].tolist() for b in full]
    with _loader(root, max_steps=6, **kw) as first:
        got = [b["sample_ids"].tolist() for b in first]
        state = first.state_dict()
    with _loader(root, max_steps=16, **kw) as second:
        second.load_state_dict(state)
        got += [b["sample_ids"].tolist() for b in second]
    assert got == want
    with _loader(root, seed=5, block_run=4, block_window=8) as other:
        with pytest.raises(CheckpointError, match="order"):
            other.load_state_dict(state)
    with _loader(root, batch_size=8, **kw) as other:  # 44 vs 40 samples an epoch: another tail, refused
        with pytest.raises(CheckpointError, match="global_batch"):
            other.load_state_dict(state)
        with pytest.raises(CheckpointError, match="version"):
            other.load_state_dict({**state, "version": 99})
        with pytest.raises(CheckpointError, match="format"):
            other.load_state_dict({k: v for k, v in state.items() if k != "format_version"})  # a format-1 state


def test_resume_with_another_loader_batch_for_grad_accum_reads_the_same_positions(tmp_path):
    """An elastic resume on 1 rank with grad accum 2 (loader batch 4) from a 2-rank run (global batch 8): the two
    micro batches after the resume are the two ranks' slices of the step the 2-rank run would have taken next
    (a loader that refused the state, "checkpoint has global_batch=8 but this run has 4", made the fault
    suite's rank-kill rows lose every later sample)."""
    root, lengths = str(tmp_path), (9, 5, 12, 3, 7, 6)
    make_synthetic_root(root, lengths=lengths, height=8, width=8, block_size=4)
    kw = dict(seed=5, block_run=2, block_window=8)
    assert sum(lengths) // 8 * 8 == sum(lengths) // 4 * 4  # the same tail dropped at either batch (else refused)
    ranks = [_loader(root, batch_size=8, rank=r, world=2, max_steps=5, **kw) for r in (0, 1)]
    steps = [[b["sample_ids"].tolist() for b in r] for r in ranks]
    with _loader(root, batch_size=8, rank=0, world=2, max_steps=3, **kw) as first:
        list(first)
        state = first.state_dict()
    for r in ranks:
        r.close()
    with _loader(root, batch_size=4, max_steps=10, **kw) as one:
        one.load_state_dict(state)
        assert one.steps_done == 6  # 3 optimizer steps of 2 micro batches
        micro = [b["sample_ids"].tolist() for b in one]
    assert micro == [steps[0][3], steps[1][3], steps[0][4], steps[1][4]]


def test_loss_ignores_the_padded_action_rows(tmp_path):
    """A batch whose samples run past their episode's end: the loss takes no gradient from the
    predictions at padded rows (action_valid False) and does from the real ones. As in GR00T, padded
    rows (repeats of the last row) are still part of the action head's input sequence; only the loss
    masks them. The model and its inputs are built from the root as the trainer builds them."""
    from loongforge.train.config import DataConfig, RunConfig, TrainConfig
    from loongforge.train.data.training_data import load_training_data
    from loongforge.train.model.build import build_model
    from loongforge.train.recipes import plan_model

    root = str(tmp_path)
    make_synthetic_root(root, lengths=(3, 2), height=16, width=16)
    cfg = TrainConfig(recipe="tiny", data=DataConfig(root=root, global_batch_size=4, action_horizon=4,
                                                     action_pad="last"),
                      run=RunConfig(run_dir=str(tmp_path / "run")))
    data = load_training_data(cfg.data)
    assert data.max_frames == 1 and data.dataset.action_horizon == 4
    plan = plan_model(cfg, data)
    torch.manual_seed(0)
    model = build_model(plan.model)
    with BlockLoader(root, dataset=data.ds, batch_size=4, deltas=data.deltas, max_steps=1,
                     prompts=plan.prompts[0]) as loader:
        batch = next(iter(loader))
    batch.pop("meta")
    valid = batch["action_valid"]
    assert (~valid).any() and valid.any()
    grads = {}
    model.action_head.velocity = _grad_tap(model.action_head.velocity, grads, "velocity")
    noise = torch.randn(4, 4, plan.model.max_action_dim)
    model(plan.processor(batch, "new_embodiment"), noise, torch.rand(4))["loss"].backward()
    per_row = grads["velocity"].abs().sum(-1)  # (B, H)
    assert (per_row[~valid] == 0).all() and (per_row[valid] > 0).all()


def _grad_tap(fn, grads, name):
    def wrapped(*args, **kw):
        out = fn(*args, **kw)
        out.register_hook(lambda g: grads.__setitem__(name, g))
        return out
    return wrapped


@pytest.mark.slow
def test_through_real_cache_daemon(small_root, tmp_path):
    """Workers read blocks through a real `loongforge cache serve` on the root (shard level);
    the rank's announce reaches the daemon as a plan; batches equal the origin's."""
    import json
    import os
    import subprocess
    import sys
    import time

    from loongforge.train.data.sources import SourceSpec

    root, _ = small_root
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
        with _loader(root, max_steps=4, source=spec, num_workers=1) as via_cache:
            a = [(bt["sample_ids"].clone(), bt["frames"]["wrist"].clone()) for bt in via_cache]
        with _loader(root, max_steps=4) as origin:
            b = [(bt["sample_ids"].clone(), bt["frames"]["wrist"].clone()) for bt in origin]
        assert len(a) == 4 and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
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


def test_action_known_of_converted_roots_masks_actions(tmp_path):
    """Roots converted from format 1 carry action_known (rows whose action it never stored): those
    rows are invalid in the batch even inside the episode."""
    from loongforge.shared.synthetic import synthetic_dataset_info, synthetic_episode
    from loongforge.shared.writer import RootWriter

    root = str(tmp_path)
    frames, arrays = synthetic_episode(0, 8, 8, 8, ("front",), 3, 2)
    arrays["action_known"] = np.arange(8) < 5
    with RootWriter(root, synthetic_dataset_info(8, 8, ("front",), 3, 2), block_size=4) as w:
        w.add_episode(0, frames, arrays)
    with _loader(root, batch_size=8, max_steps=1, deltas=DeltaSpec(action_horizon=4), block_run=1) as loader:
        batch = next(iter(loader))
    for row, t in enumerate(batch["sample_ids"].tolist()):
        rows = t + np.arange(4)
        assert batch["action_valid"][row].tolist() == ((rows < 8) & (rows < 5)).tolist()


def test_batch_content_matches_the_reader_and_the_reference_colour(train_root):
    """RGB frames as the model sees them (image_mean 0, std 1) equal shared/color.py's reference
    conversion of the stored NV12, with the index's matrix and range; state as the root's processor makes it."""
    root, data = train_root
    ds, info = data.ds, data.dataset
    spec = DeltaSpec(video=(-1, 0), action_horizon=4)
    with BlockLoader(root, batch_size=4, max_steps=1, image_mean=0.0, image_std=1.0, deltas=spec) as loader:
        batch = next(iter(loader))
    eps, ts = loader.table.locate(batch["sample_ids"].numpy())
    for row, (e, t) in enumerate(zip(eps.tolist(), ts.tolist())):
        shown = np.clip(t + np.asarray(spec.video), 0, int(ds.episode_lengths[e]) - 1)
        for slot in info.slots:
            nv12 = np.concatenate([ds.read_block(e, slot, b) for b in range(ds.num_blocks(e))])[shown]
            rgb = color.nv12_to_rgb(nv12, info.color_matrix, info.color_range)  # (K, h, w, 3)
            want = np.moveaxis(rgb, -1, -3).astype(np.float32) / 255.0
            np.testing.assert_allclose(batch["frames"][slot][row].numpy(), want, atol=1e-6)
        sa = _root_processor(root)
        np.testing.assert_allclose(batch["state"][row].numpy(), sa.state({"state": ds.read_arrays(e)["state"][shown]}),
                                   atol=1e-6)
        text = bytes(v for v in batch["task_tokens"][row].tolist() if v < 256).decode()
        assert text == info.tasks[str(int(ds.read_arrays(e)["task_index"][t]))]
    assert batch["sample_valid"].all() and batch["frame_mask"].all()


@pytest.mark.slow
def test_killed_worker_is_a_clear_error_not_a_hang(train_root):
    root, _ = train_root
    loader = BlockLoader(root, batch_size=4, num_workers=2, max_steps=None)
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
    made = tmp_path / "shm-names"  # the segments this script creates (/dev/shm is the whole machine's)
    script.write_text("import multiprocessing.shared_memory as sm\n"
                      "_init = sm.SharedMemory.__init__\n"
                      "def _logged(self, name=None, create=False, size=0, **kw):\n"
                      "    _init(self, name, create, size, **kw)\n"
                      f"    if create: open({str(made)!r}, 'a').write(self.name + '\\n')\n"
                      "sm.SharedMemory.__init__ = _logged\n"
                      "from loongforge.train.data.loader import BlockLoader\n"
                      f"with BlockLoader({root!r}, batch_size=4, num_workers=1, max_steps=2) as loader:\n"
                      "    for batch in loader:\n"
                      "        pass\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]  # the trainer's own error, after the worker's traceback
    assert last.startswith("loongforge.shared.errors.DataWorkerError: data worker 0"), run.stderr[-3000:]
    assert "re-import the main module" in last and "OOM killer" not in last
    assert "leaked shared_memory" not in run.stderr
    names = made.read_text().split()
    assert names and not [n for n in names if os.path.exists(f"/dev/shm/{n.lstrip('/')}")], names


@pytest.mark.slow
def test_cache_client_without_daemon_degrades_to_origin(train_root, tmp_path):
    from loongforge.train.data.sources import SourceSpec

    root, _ = train_root
    spec = SourceSpec(root=root, cache_socket=str(tmp_path / "no-daemon.sock"))
    with BlockLoader(root, batch_size=4, max_steps=3, source=spec, num_workers=1) as via_cache:
        a = [bt["frames"]["wrist"].clone() for bt in via_cache]
    with BlockLoader(root, batch_size=4, max_steps=3) as origin:
        b = [bt["frames"]["wrist"].clone() for bt in origin]
    assert len(a) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))


def test_missing_cache_module_falls_back_with_warning(train_root, monkeypatch):
    import sys

    from loongforge.shared.dataset import load_shard_index
    from loongforge.shared.source import OriginSource
    from loongforge.train.data.sources import SourceSpec, make_source

    monkeypatch.setitem(sys.modules, "loongforge.cache.client", None)  # import raises ImportError
    root, _ = train_root
    with pytest.warns(RuntimeWarning, match="reading the origin"):
        src = make_source(SourceSpec(root=root, cache_socket="/nonexistent.sock"), load_shard_index(root))
    assert isinstance(src, OriginSource)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetch_matches_cpu(train_root):
    """Pinned buffers + side-stream copy + device NV12->RGB give the CPU path's tensors: exactly, but
    for frames, where the two conversions are documented to differ by up to 1 LSB on ~1e-6 of the
    pixels (train/data/colorspace.py: CPU's numba pass vs CUDA's fused torch ops)."""
    root, _ = train_root
    lsb = 1 / 255 / 0.25  # BlockLoader's default image_std
    spec = DeltaSpec(video=(-1, 0), action_horizon=4)
    with BlockLoader(root, batch_size=4, max_steps=6, device="cuda", num_workers=1, deltas=spec) as gpu:
        got = [{k: (v["front"] if k == "frames" else v).cpu() for k, v in b.items() if k != "meta"} for b in gpu]
    with BlockLoader(root, batch_size=4, max_steps=6, deltas=spec) as cpu:
        want = [{k: (v["front"] if k == "frames" else v) for k, v in b.items() if k != "meta"} for b in cpu]
    for a, b in zip(got, want):
        for key in b:
            if key != "frames":
                assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5), key
                continue
            diff = (a[key].float() - b[key].float()).abs()
            assert float(diff.max()) <= lsb + 1e-5, "frames: more than 1 LSB apart"
            assert float((diff > 1e-5).float().mean()) <= 1e-3, "frames: more than 0.1% of values differ"


def _victim(tmp_path, body: str):
    """A script that starts a 2-worker BlockLoader on argv[1], takes one batch, runs `body` (which
    prints what the test needs on one line), then sleeps until it is killed."""
    script = tmp_path / "victim.py"
    script.write_text(
        "import sys, time\n"
        "from loongforge.train.data.loader import BlockLoader\n"
        "if __name__ == '__main__':\n"
        "    loader = BlockLoader(sys.argv[1], batch_size=4, num_workers=2)\n"
        "    it = iter(loader); next(it)\n"
        + body +
        "    time.sleep(120)\n")
    return script


@pytest.mark.slow
def test_workers_exit_when_the_trainer_is_killed(train_root, tmp_path):
    """SIGKILL of the main process (OOM killer, scheduler) must not leave decode workers behind."""
    import subprocess
    import sys

    root, _ = train_root
    script = _victim(tmp_path, "    print(' '.join(str(p.pid) for p in loader._pool._procs), flush=True)\n")
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


@pytest.mark.slow
def test_a_sigkill_of_the_whole_group_leaves_no_shared_memory(train_root, tmp_path):
    """A launcher that SIGKILLs a rank's process group (torchrun 30 s after its SIGTERM) takes the
    rank, its workers and its resource tracker at once: nothing is left to unlink the slots, so
    their names must already be gone from /dev/shm once every worker has mapped them."""
    import signal
    import subprocess
    import sys

    root, _ = train_root
    script = _victim(tmp_path,
                     "    loader._pool.wait_ready(60)\n"
                     "    deadline = time.monotonic() + 10\n"
                     "    while not getattr(loader._pool, '_unlinked', False) and time.monotonic() < deadline:\n"
                     "        time.sleep(0.05)\n"
                     "    print(' '.join(s.name for s in loader._pool._shms), flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(script), root], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        names = proc.stdout.readline().split()
        assert names, proc.stderr.read()[-3000:] if proc.poll() is not None else "no slot names"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    time.sleep(0.5)
    assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]
