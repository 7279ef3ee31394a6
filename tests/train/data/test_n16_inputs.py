"""Parity with Isaac-GR00T's own data path on ../shared/fixtures/gr00t_n1d6_data (its README is the spec):
both datasets (a registered oxe_droid: relative joint actions, a short episode, a portrait camera; a
new_embodiment from the user's Python modality config: sin/cos and mean/std keys, a relative joint
key tied to another state key, a relative end-effector key in xyz + rot6d, a constant dimension, key
order unlike storage order) go through `loongforge preprocess` (its Beam job computes the statistics)
and `loongforge inspect` (the samples as the model receives them), and are compared with what
Isaac-GR00T computed: statistics, every listed sample, the percentile variant, decode_action.

Tolerances: exact (float32) everywhere except the relative end-effector key, whose rotation the
reference takes through scipy's quaternions: its per-step range is ~6e-4, so a 1e-8 difference in
the relative pose is ~5e-6 after normalisation (the fixture's README: 1e-5 for EEF relative keys)."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.outside import fixture_dir

PY = [sys.executable, "-m", "loongforge"]
DATASETS = {"ds1_oxe_droid": ("oxe_droid", None), "ds2_new_embodiment": ("new_embodiment", "modality_config_ds2.py")}
EEF_TOL = 1e-5


@pytest.fixture(scope="module")
def fixture():
    return fixture_dir("gr00t_n1d6_data")


@pytest.fixture(scope="module")
def roots(fixture, tmp_path_factory):
    """Each dataset preprocessed (its copy: the fixture is read-only) with its tag and modality config."""
    out = {}
    for ds, (tag, config) in DATASETS.items():
        work = tmp_path_factory.mktemp(ds)
        shutil.copytree(fixture / "datasets" / ds, work / "src")
        cmd = [*PY, "preprocess", "--input", str(work / "src"), "--output", str(work / "shards"),
               "--embodiment-tag", tag, "--workers", "1"]
        if config:
            cmd += ["--modality-config", str(fixture / config)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[ds] = str(work / "shards")
    return out


def _eef_columns(ds: str) -> list[int]:
    """Action columns of the relative end-effector key (ds2's eef, 5:14), compared within EEF_TOL."""
    return list(range(5, 14)) if ds.startswith("ds2") else []


def _close(got, want, eef, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    rest = [c for c in range(got.shape[-1]) if c not in eef]
    np.testing.assert_array_equal(got[..., rest], want[..., rest], err_msg=what)
    if eef:
        np.testing.assert_allclose(got[..., eef], want[..., eef], atol=EEF_TOL, rtol=0, err_msg=what)


@pytest.mark.parametrize("ds", sorted(DATASETS))
def test_the_statistics_are_isaac_gr00ts(roots, fixture, ds):
    from loongforge.shared.dataset import open_root

    rec = open_root(roots[ds]).info.embodiment
    st = fixture / "stats" / ds
    want = json.loads((st / "stats.json").read_text())
    assert sorted(rec["feature_statistics"]) == sorted(want)
    for f, stats in want.items():
        for s, v in stats.items():  # the same numpy reductions over the same float32 rows: exact
            assert rec["feature_statistics"][f][s] == v, (f, s)
    rel = json.loads((st / "relative_stats.json").read_text())
    for key, stats in rel.items():
        tol = 1e-7 if key == "eef" else 0.0  # the rotation through scipy's quaternions (see the module docstring)
        for s, v in stats.items():
            np.testing.assert_allclose(rec["statistics"]["relative_action"][key][s], v, atol=tol, rtol=0,
                                       err_msg=f"{key} {s}")
    merged = json.loads((st / "dataset_statistics.json").read_text())
    (tag, by_kind), = merged.items()
    assert rec["tag"] == tag
    from loongforge.shared.statistics import merge_embodiment

    ours = merge_embodiment([rec["statistics"]], [1.0])  # one dataset, weight 1: Isaac-GR00T's merge
    for kind in ("state", "action", "relative_action"):
        for key, stats in by_kind[kind].items():
            for s, v in stats.items():
                np.testing.assert_allclose(ours[kind][key][s], v, atol=1e-7 if key == "eef" else 1e-12, rtol=0,
                                           err_msg=f"{kind} {key} {s}")


@pytest.fixture(scope="module")
def inspected(roots, fixture, tmp_path_factory):
    """`loongforge inspect` of every listed sample, with the fixture's Qwen3 tokenizer files."""
    out = {}
    for ds, root in roots.items():
        meta = json.loads((fixture / f"samples_{ds}.json").read_text())
        at = [a for s in meta["samples"] for a in ("--at", f"{s['episode_index']}:{s['frame_index']}")]
        npz = tmp_path_factory.mktemp("inspect") / f"{ds}.npz"
        proc = subprocess.run([*PY, "inspect", root, *at, "--npz", str(npz), "--tokenizer",
                               str(fixture / "tokenizer")], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[ds] = dict(np.load(npz))
    return out


@pytest.mark.parametrize("ds", sorted(DATASETS))
def test_every_listed_sample_is_what_isaac_gr00t_feeds_the_model(inspected, fixture, ds):
    got, want = inspected[ds], np.load(fixture / f"samples_{ds}.npz")
    for key in ("state", "action_mask", "embodiment_id", "input_ids", "attention_mask", "image_sizes"):
        assert got[key].shape == want[key].shape, key
        np.testing.assert_array_equal(got[key], want[key].astype(got[key].dtype), err_msg=key)
    assert got["state"].dtype == np.float32 and got["action"].dtype == np.float32
    _close(got["action"], want["action"], _eef_columns(ds), "action")
    np.testing.assert_array_equal(got["raw_state"], want["raw_state"])
    np.testing.assert_array_equal(got["raw_action"], want["raw_action"])
    for view in json.loads((fixture / f"samples_{ds}.json").read_text())["video_keys"]:  # the decoder's RGB
        np.testing.assert_array_equal(got[f"images_raw.{view}"], want[f"images_raw.{view}"], err_msg=view)
    # the reference path (OpenCV + Pillow on the decoder's RGB from the stored planes): bit for bit
    np.testing.assert_array_equal(got["pixel_values_uint8"], want["pixel_values_uint8"])
    # the path training runs (our NV12 -> RGB, then the libraries' resizes as matrices, no uint8 rounding
    # between steps): measured 4.4 levels at most, 1.0-1.1 on average, on these images (the note has it)
    levels = np.abs(got["pixel_values"] * 127.5 + 127.5 - want["pixel_values_uint8"])
    assert got["pixel_values"].shape == want["pixel_values_uint8"].shape
    assert levels.max() <= 5.0 and levels.mean() <= 1.5, (levels.max(), levels.mean())


@pytest.mark.parametrize("ds", sorted(DATASETS))
def test_percentiles_normalise_as_isaac_gr00t(inspected, roots, fixture, ds):
    """use_percentiles: q01/q99 for state and absolute action keys; relative keys stay on min/max."""
    from loongforge.shared.dataset import open_root
    from loongforge.train.data.state_action import StateAction, StateActionOptions, root_embodiment

    found = root_embodiment(open_root(roots[ds]).info)
    sa = StateAction(found.config, found.statistics, StateActionOptions(use_percentiles=True))
    want = np.load(fixture / f"samples_{ds}_percentiles.npz")
    raw = inspected[ds]
    state = sa.split_state(raw["raw_state"])
    action = dict(zip(sa.action_slices(), (raw["raw_action"][..., a:b] for a, b in sa.action_slices().values())))
    np.testing.assert_array_equal(sa.state(state), want["state_normalized_unpadded"])
    # the reference's float64 action before its one cast to float32 (the model's input)
    _close(sa.action(action, state), want["action_normalized_unpadded"].astype(np.float32), _eef_columns(ds),
           "action")
    out = sa.concat(sa.decode(want["decode_input_random"], state))
    np.testing.assert_allclose(out, want["decode_output_random"], atol=3e-7, rtol=0)


@pytest.mark.parametrize("ds", sorted(DATASETS))
def test_decode_action_is_isaac_gr00ts(roots, fixture, ds):
    """Normalised model output -> robot units: the samples' own actions back (clipped where they
    saturated) and random outputs, relative keys made absolute from the raw state."""
    from loongforge.shared.dataset import open_root
    from loongforge.train.data.state_action import StateAction, root_embodiment

    found = root_embodiment(open_root(roots[ds]).info)
    sa = StateAction(found.config, found.statistics)
    d = np.load(fixture / f"decode_action_{ds}.npz")
    state = sa.split_state(d["state_raw"])
    for inp, out in (("input_roundtrip", "output_roundtrip"), ("input_random", "output_random")):
        got = sa.concat(sa.decode(d[inp], state))
        assert got.dtype == np.float64 and got.shape == d[out].shape
        np.testing.assert_allclose(got, d[out], atol=3e-7, rtol=0, err_msg=out)


def _mixture_loader(roots, *, batch=4, rank=0, world=1):
    from loongforge.train.config import DataConfig
    from loongforge.train.data.training_data import load_training_data, make_loader

    d = DataConfig(root=roots["ds1_oxe_droid"], global_batch_size=batch,
                   mixture=((roots["ds1_oxe_droid"], 3.0), (roots["ds2_new_embodiment"], 1.0)))
    data = load_training_data(d)
    return make_loader(d, data, batch_size=batch, rank=rank, world=world, device="cpu"), data


def test_a_3_to_1_mixture_samples_75_25_over_an_epoch(roots, fixture):
    """N1.6's rule (mixture.json): a root's share of the samples is its ratio alone (75/25), not ratio x
    length (63.5/36.5 here: 47 vs 81 samples)."""
    want = json.loads((fixture / "mixture.json").read_text())["default_shard_size_1024"]["expected_sample_share"]
    loader, data = _mixture_loader(roots)
    with loader:
        counts = np.zeros(2)
        for _ in range(loader.epoch_batches):
            batch = next(loader)
            counts[batch["meta"]["dataset"]] += len(batch["sample_ids"])
    share = counts / counts.sum()
    assert abs(share[0] - want[0]) <= 0.01 and abs(share[1] - want[1]) <= 0.01, share
    assert sorted(r.tag for r in data.roots) == ["new_embodiment", "oxe_droid"]


def test_a_mixture_resumes_mid_epoch_exactly_and_any_rank_layout_reads_the_same_order(roots):
    def take(loader, n):
        return [(b["meta"]["dataset"], b["sample_ids"].tolist()) for b in (next(loader) for _ in range(n))]

    whole, _ = _mixture_loader(roots)
    with whole:
        want = take(whole, 12)
    first, _ = _mixture_loader(roots)
    with first:
        got = take(first, 5)
        state = first.state_dict()
    resumed, _ = _mixture_loader(roots)
    with resumed:
        resumed.load_state_dict(json.loads(json.dumps(state)))  # through JSON, as a checkpoint keeps it
        got += take(resumed, 7)
    assert got == want
    halves = []
    for rank in (0, 1):  # two data-parallel ranks: each its half of every global batch, the same roots
        loader, _ = _mixture_loader(roots, rank=rank, world=2)
        with loader:
            halves.append(take(loader, 12))
    assert [(a[0], a[1] + b[1]) for a, b in zip(*halves)] == want
