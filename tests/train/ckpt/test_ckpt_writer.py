"""The checkpoint writer on real files, without DeepSpeed: snapshot isolation, manifest
hashes, publication order, pruning, and a real ENOSPC on the tiny tmpfs."""

import json
import logging
import os

import pytest
import torch

from loongforge.shared.errors import CheckpointError
from loongforge.benchmarks.faults.data import flip_byte
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.ckpt.async_writer import SaveJob, SnapshotEngine, prune, run_job


def _job(root, tag, state, **kw):
    tag_dir = os.path.join(root, tag)
    sidecar = {"format": "loongforge-checkpoint", "format_version": 2, "step": int(tag[4:]), "world": 1,
               "loader": {}}
    return SaveJob(root=root, tag=tag, rank=0, world=1, snapshots=[(os.path.join(tag_dir, "model.pt"), state)],
                   blobs=[(os.path.join(tag_dir, ckpt_files.SIDECAR), json.dumps(sidecar).encode())], **kw)


def test_snapshot_is_isolated_from_later_updates():
    snap = SnapshotEngine(inner=None)
    w = torch.arange(4.0)
    snap.save({"module": {"w": w}, "step": [1]}, "/x/mp_rank_00_model_states.pt")
    w.add_(100)  # the optimizer keeps stepping while the writer works
    (path, state), = snap.take()
    assert path.endswith("model_states.pt") and state["module"]["w"].tolist() == [0, 1, 2, 3]
    snap.save({"module": {"w": w}, "step": [2]}, "/x/mp_rank_00_model_states.pt")
    (_, again), = snap.take()
    assert again["module"]["w"].data_ptr() == state["module"]["w"].data_ptr()  # host buffer reused


def test_publish_writes_manifest_then_latest_and_verifies(tmp_path):
    run_dir = str(tmp_path)
    root = ckpt_files.ckpt_root(run_dir)
    assert run_job(_job(root, "step00000002", {"w": torch.ones(1000)}))
    assert ckpt_files.latest_tag(run_dir) == "step00000002"
    ckpt_files.verify_manifest(run_dir, "step00000002")
    model = os.path.join(root, "step00000002", "model.pt")
    with open(model, "r+b") as f:  # flip one byte inside the tensor data
        f.seek(os.path.getsize(model) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointError, match="corrupt"):
        ckpt_files.verify_manifest(run_dir, "step00000002")


def test_prune_keeps_last_k_and_removes_crash_debris(tmp_path):
    root = str(tmp_path)
    for step in (2, 4, 6):
        assert run_job(_job(root, f"step{step:08d}", {"w": torch.ones(10)}, keep_last=2))
    assert sorted(os.listdir(root)) == ["latest", "step00000004", "step00000006", "zero_to_fp32.py",
                                        "zero_to_torch.py"]
    os.makedirs(os.path.join(root, "step00000007"))  # a save killed mid-write: no manifest
    open(os.path.join(root, "step00000007", "model.pt.tmp"), "wb").close()
    assert run_job(_job(root, "step00000008", {"w": torch.ones(10)}, keep_last=2))
    assert sorted(d for d in os.listdir(root) if d.startswith("step")) == ["step00000006", "step00000008"]
    assert prune(root, keep_last=0) == []


def test_disk_full_keeps_previous_latest_and_removes_partial_files(tiny_disk, caplog):
    """A real 128 KiB tmpfs: the first save fits, the second hits ENOSPC mid-file."""
    root = str(tiny_disk / "checkpoints")
    assert run_job(_job(root, "step00000001", {"w": torch.ones(8_000)}))  # ~32 KB
    with caplog.at_level(logging.WARNING):
        assert not run_job(_job(root, "step00000002", {"w": torch.ones(40_000)}))  # ~160 KB: cannot fit
    msg = caplog.text
    assert "step00000002 NOT saved" in msg and "No space left on device" in msg
    assert os.path.join(root, "step00000002", "model.pt") in msg and "bytes (0.0" in msg and "MiB) free there" in msg
    assert "`latest` stays step00000001" in msg
    assert sorted(os.listdir(root)) == ["latest", "step00000001", "zero_to_fp32.py", "zero_to_torch.py"] or \
        sorted(os.listdir(root)) == ["latest", "step00000001"]  # recovery scripts may not fit either
    ckpt_files.verify_manifest(str(tiny_disk), "step00000001")
    assert run_job(_job(root, "step00000003", {"w": torch.ones(1_000)}))  # the next interval retries
    assert ckpt_files.latest_tag(str(tiny_disk)) == "step00000003"


def test_delta_roundtrip_is_bit_exact_and_small_for_nearby_states():
    from loongforge.train.ckpt import delta as ckpt_delta

    g = torch.Generator().manual_seed(0)
    w = torch.randn(10_000, generator=g)
    special = torch.tensor([float("nan"), float("inf"), -0.0, 0.0, 1e-45])
    base = {"module": {"w": w, "b": torch.zeros(3, dtype=torch.bfloat16), "s": special.clone()},
            "steps": [torch.tensor(5)], "scale": 1.0, "flag": torch.tensor([True, False])}
    new = {"module": {"w": w + 1e-4 * torch.randn(10_000, generator=g), "b": torch.ones(3, dtype=torch.bfloat16),
                      "s": special.neg()},
           "steps": [torch.tensor(6)], "scale": 2.0, "flag": torch.tensor([False, False]),
           "extra": torch.arange(4)}  # no base tensor here: stored as is
    tree, payload = ckpt_delta.encode(new, base)
    back = ckpt_delta.decode(tree, base)
    for key in ("w", "b", "s"):
        got, want = back["module"][key], new["module"][key]
        assert got.dtype == want.dtype and torch.equal(got.view(torch.int16 if key == "b" else torch.int32),
                                                       want.view(torch.int16 if key == "b" else torch.int32))
    assert torch.equal(back["steps"][0], new["steps"][0]) and back["scale"] == 2.0
    assert torch.equal(back["flag"], new["flag"]) and torch.equal(back["extra"], new["extra"])
    assert payload < 0.8 * ckpt_delta.nbytes(new)  # sign/exponent/high mantissa bytes unchanged


def test_noise_is_a_function_of_the_sample_not_of_its_batch():
    from loongforge.train.model.noise import noise_for

    cpu = torch.device("cpu")
    n4, u4, c4 = noise_for(7, 1, [10, 11, 12, 13], (4, 3, 2), cpu)
    n2, u2, c2 = noise_for(7, 1, [12, 10], (2, 3, 2), cpu)  # other batch, other order, other rank
    assert torch.equal(n2[0], n4[2]) and torch.equal(n2[1], n4[0]) and u2[0] == u4[2] and u2[1] == u4[0]
    assert torch.equal(c2[0], c4[2]) and torch.equal(c2[1], c4[0])  # the image crop follows the sample too
    assert ((0 <= u4) & (u4 < 1)).all() and not torch.equal(n4[0], n4[1])
    n_next, _, _ = noise_for(7, 2, [10], (1, 3, 2), cpu)  # the next epoch draws anew
    assert not torch.equal(n_next[0], n4[0])


def test_keep_last_one_still_keeps_a_fallback_and_drops_it_just_before_the_next_write(tmp_path):
    from loongforge.train.ckpt.async_writer import prune_before_write

    root = str(tmp_path)
    for step in (2, 4):
        assert run_job(_job(root, f"step{step:08d}", {"w": torch.ones(10)}, keep_last=1))
    steps = lambda: sorted(d for d in os.listdir(root) if d.startswith("step"))  # noqa: E731
    assert steps() == ["step00000002", "step00000004"]  # latest + the fallback
    assert prune_before_write(root, keep_last=1) == ["step00000002"]  # room for the save in flight
    assert steps() == ["step00000004"]
    assert prune_before_write(root, keep_last=2) == []


def test_resume_falls_back_past_a_corrupt_and_a_missing_file(tmp_path, caplog):
    from loongforge.train.ckpt.fallback import pick_resume_tag

    run_dir = str(tmp_path)
    root = ckpt_files.ckpt_root(run_dir)
    for step in (2, 4, 6):
        assert run_job(_job(root, f"step{step:08d}", {"w": torch.full((1000,), float(step))}))
    assert pick_resume_tag(run_dir, "step00000006") == "step00000006"
    bad = os.path.join(root, "step00000006", "model.pt")
    flip_byte(bad, mask=1)
    os.unlink(os.path.join(root, "step00000004", ckpt_files.SIDECAR))
    with caplog.at_level(logging.WARNING):
        assert pick_resume_tag(run_dir, "step00000006") == "step00000002"
    assert bad in caplog.text and "is corrupt" in caplog.text
    assert os.path.join(root, "step00000004", ckpt_files.SIDECAR) in caplog.text
    assert "resuming from step00000002 instead of `latest` step00000006" in caplog.text
    from loongforge.train.observe.metrics import read_events

    (rec,) = read_events(run_dir)  # one record of the fallback (the fault suite's corrupt_checkpoint row reads it)
    assert (rec["event"], rec["latest"], rec["loaded"]) == ("ckpt_fallback", "step00000006", "step00000002")
    assert bad in rec["rejected"][0] and ckpt_files.SIDECAR in rec["rejected"][1]
    flip_byte(os.path.join(root, "step00000002", "model.pt"), mask=1)
    with pytest.raises(CheckpointError, match="no checkpoint .* verifies"):
        pick_resume_tag(run_dir, "step00000006")


def test_a_save_waiting_for_a_lost_peers_part_fails_at_once_when_told(tmp_path, caplog):
    """Rank 0 of 2 publishes once rank 1's part is there. A rank that ends because its peer is gone (a failed
    collective, launch.py) tells its writer so: the save stops waiting for the part that will never come
    (up to peer_timeout_s otherwise, holding the job's restart), and `latest` stays where it was."""
    import time

    from loongforge.train.ckpt.async_writer import Writer

    root = ckpt_files.ckpt_root(str(tmp_path))
    job = _job(root, "step00000004", {"w": torch.ones(10)}, peer_timeout_s=600.0)
    job.world = 2
    writer = Writer()
    writer.submit(job, background=True)
    assert not writer.wait(0.5)  # rank 1's manifest never comes: still waiting
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        writer.peers_gone()
        assert writer.wait(5.0)
    assert time.monotonic() - t0 < 2.0 and writer.last_ok is False
    assert "a peer of this rank is gone" in caplog.text
    assert ckpt_files.latest_tag(str(tmp_path)) is None
