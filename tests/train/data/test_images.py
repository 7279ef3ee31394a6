"""N1.6's image transform (train/data/images.py) against Isaac-GR00T's own outputs:
../shared/fixtures/gr00t_n1d6_data, computed by Isaac-GR00T (ead52833) with albumentations 1.4.18,
OpenCV 4.11, Pillow 12.3 and torchcodec 0.4 (its README: "Images (eval)", "Images (train ...)").

The reference path must be bit-exact. The device path is measured against it: the bounds below
sit a little above what it measures on these images (in 8-bit levels)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.shared.dataset import open_root
from loongforge.train.data.images import ColorJitter, Geometry, ImageDraws, Jitter, area_weights, \
    bicubic_weights, device_images, device_jitter, image_draws, pixel_values, reference_augment, \
    reference_jitter, reference_pixels, reference_rgb
from loongforge.shared.embodiment import REGISTERED, projector_index
from loongforge.train.data.processor import Embodiment, Processor, ProcessorConfig
from tests.outside import copy_fixture

DATASETS = {"ds1_oxe_droid": "oxe_droid", "ds2_new_embodiment": "new_embodiment"}
GEO = Geometry()
# Measured on the fixture's 28 images (7 samples x 4 cameras), eval, per camera: max <= 2.11, mean
# <= 0.31, <= 2.1 % of values >= 1 level off (the 2x-enlarged 128-pixel cameras: 1.6, 0.21, 0.4 %);
# training (crop + jitter, 32 draws of one 96x128 image): mean 0.23, 3.5 % >= 1.
EVAL_BOUND = {"max": 2.5, "mean": 0.35, "share_ge_1": 0.03}
TRAIN_BOUND = {"mean": 0.3, "share_ge_1": 0.06}


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return copy_fixture("gr00t_n1d6_data", tmp_path_factory.mktemp("gr00t") / "fixture")


def _load(fx, ds: str) -> tuple[dict, list[str]]:
    views = json.loads((fx / "modality_configs.json").read_text())[DATASETS[ds]]["video"]["modality_keys"]
    return dict(np.load(fx / f"samples_{ds}.npz")), views


def _chw(rgb: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(rgb)).permute(0, 3, 1, 2).float()


def _measure(got: np.ndarray, want: np.ndarray) -> dict:
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return {"max": err.max(), "mean": err.mean(), "share_ge_1": (err >= 1).mean()}


def _records(fx) -> list[tuple[tuple[int, int], Jitter]]:
    """The recorded albumentations draws: crop_coords_xyxy -> (x0, y0), factors, order."""
    recs = json.loads(str(np.load(fx / "augmentation_samples.npz")["augmented_first3_params"]))
    return [((r["crop_coords_xyxy"][0], r["crop_coords_xyxy"][1]),
             Jitter(r["brightness"], r["contrast"], r["saturation"], r["hue"], tuple(r["order"]))) for r in recs]


# ---- the reference path: bit-exact ----


@pytest.mark.parametrize("ds", sorted(DATASETS))
def test_the_reference_path_reproduces_isaac_gr00ts_pixels(fx, ds):
    z, views = _load(fx, ds)
    n = len(z[f"images_raw.{views[0]}"])
    for v, view in enumerate(views):  # the albumentations output, kept for sample 0
        np.testing.assert_array_equal(reference_augment(z[f"images_raw.{view}"][0]), z["images_eval_transform"][0, v])
    # pixel_values: sample-major, then the views in the modality config's order
    got = np.stack([reference_pixels(z[f"images_raw.{view}"][i]) for i in range(n) for view in views])
    np.testing.assert_array_equal(got, z["pixel_values_uint8"])
    first = pixel_values(got[:len(views)])
    assert first.dtype == np.float32 and np.array_equal(first, z["pixel_values_first_sample"])


def test_the_reference_jitter_reproduces_albumentations_draws(fx):
    z = np.load(fx / "augmentation_samples.npz")
    for k, (offset, jit) in enumerate(_records(fx)):
        got = reference_augment(z["source_image"], offset=offset, jitter=jit)
        np.testing.assert_array_equal(got.transpose(2, 0, 1), z["augmented_first3"][k])
        assert not np.array_equal(got, reference_augment(z["source_image"], offset=offset))  # the jitter did act


def test_every_recorded_draw_replays_to_isaac_gr00ts_channel_statistics(fx):
    """All 200 recorded train-mode draws (augmentation_stats.json's parameters), replayed: the
    per-draw channel means and stds of the 256 x 256 output equal Isaac-GR00T's."""
    doc = json.loads((fx / "augmentation_stats.json").read_text())
    src = np.load(fx / "augmentation_samples.npz")["source_image"]
    for k, p in enumerate(doc["per_draw_params"]):
        jit = Jitter(p["brightness"], p["contrast"], p["saturation"], p["hue"], tuple(p["order"]))
        out = reference_augment(src, offset=tuple(p["crop_coords_xyxy"][:2]), jitter=jit).reshape(-1, 3)
        out = out.astype(np.float64)
        np.testing.assert_array_equal(out.mean(0), doc["per_draw_channel_mean"][k], err_msg=f"draw {k}")
        np.testing.assert_allclose(out.std(0), doc["per_draw_channel_std"][k], rtol=1e-12, err_msg=f"draw {k}")


# ---- the device path's matrices, against the libraries on float32 ----


@pytest.mark.parametrize("n_in, n_out", [(128, 256), (112, 256), (80, 256), (243, 256),  # enlarging
                                         (512, 256), (640, 256), (300, 256), (257, 256)])  # shrinking
def test_area_weights_are_opencvs_inter_area(n_in, n_out):
    import cv2

    x = np.random.default_rng(n_in).uniform(0, 255, (n_in, n_in)).astype(np.float32)
    m = area_weights(n_in, n_out)
    want = cv2.resize(x, (n_out, n_out), interpolation=cv2.INTER_AREA)
    np.testing.assert_allclose(m @ x.astype(np.float64) @ m.T, want, rtol=0, atol=2e-4)


@pytest.mark.parametrize("n_in, n_out", [(256, 252), (256, 224), (243, 256), (640, 252), (100, 252)])
def test_bicubic_weights_are_pillows_default_resize(n_in, n_out):
    from PIL import Image

    x = np.random.default_rng(n_in).uniform(0, 255, (n_in, n_in)).astype(np.float32)
    m = bicubic_weights(n_in, n_out)
    want = np.asarray(Image.fromarray(x, mode="F").resize((n_out, n_out), Image.Resampling.BICUBIC))
    np.testing.assert_allclose(m @ x.astype(np.float64) @ m.T, want, rtol=0, atol=2e-4)


# ---- the device path against the reference ----


@pytest.mark.parametrize("ds", sorted(DATASETS))
def test_the_device_path_is_within_a_level_of_the_reference(fx, ds):
    z, views = _load(fx, ds)
    for v, view in enumerate(views):
        raw = z[f"images_raw.{view}"]
        want = z["pixel_values_uint8"][v::len(views)]
        got = device_images(_chw(raw)).numpy()
        stats = _measure(got, want)
        assert all(stats[k] <= EVAL_BOUND[k] for k in EVAL_BOUND), (view, stats)
        # Eagle's normalized units give the same pixels (letterbox black is -1 there)
        norm = device_images(_chw(raw) / 127.5 - 1, units=(-1.0, 1.0)).numpy()
        np.testing.assert_allclose((norm + 1) * 127.5, got, rtol=0, atol=2e-3)


def test_device_jitter_is_the_reference_ops_on_the_same_levels(fx):
    src = np.load(fx / "augmentation_samples.npz")["source_image"]
    draws = image_draws(3, 0, np.arange(12))
    base = np.stack([reference_augment(src, offset=draws.sample(i)[0]) for i in range(len(draws))])
    want = np.stack([reference_jitter(base[i], draws.sample(i)[1]) for i in range(len(draws))])
    got = device_jitter(_chw(base), draws.factors, draws.order).permute(0, 2, 3, 1).numpy()
    stats = _measure(got, want)
    # equal but for float ties (cv2.addWeighted's fused multiply-add, OpenCV's division tables), which
    # the later ops can amplify: measured 0.04 % of values off
    assert stats["share_ge_1"] <= 0.002 and stats["mean"] <= 0.005, stats
    # a factor that changes nothing is skipped, as albumentations skips it: an 8-bit HSV round trip
    # (hue 0) is not the identity
    assert not np.array_equal(reference_jitter(base[0], Jitter(hue=1e-9)), base[0])
    still = device_jitter(_chw(base[:2]), np.array([[1.0, 1.0, 1.0, 0.0]] * 2), draws.order[:2])
    assert torch.equal(still, _chw(base[:2]))


def test_the_training_device_path_is_near_the_reference(fx):
    src = np.load(fx / "augmentation_samples.npz")["source_image"]
    draws = image_draws(5, 1, np.arange(16))
    want = np.stack([reference_pixels(src, offset=o, jitter=j) for o, j in map(draws.sample, range(len(draws)))])
    got = device_images(_chw(np.repeat(src[None], len(draws), 0)), draws=draws).numpy()
    stats = _measure(got, want)
    assert all(stats[k] <= TRAIN_BOUND[k] for k in TRAIN_BOUND), stats
    # the recorded albumentations draws too, at the albumentations stage
    z = np.load(fx / "augmentation_samples.npz")
    recs = _records(fx)
    rec = ImageDraws(np.array([o[0] for o, _ in recs]), np.array([o[1] for o, _ in recs]),
                     np.array([[j.brightness, j.contrast, j.saturation, j.hue] for _, j in recs]),
                     np.array([j.order for _, j in recs]))
    got = device_images(_chw(np.repeat(src[None], 3, 0)), draws=rec, stage="augment").numpy()
    assert _measure(got, z["augmented_first3"])["mean"] <= TRAIN_BOUND["mean"]


# ---- the draws ----


def test_draws_are_a_pure_function_of_seed_epoch_and_sample():
    a = image_draws(7, 1, [10, 11, 12, 13])
    b = image_draws(7, 1, [12, 10])  # another batch, another order, another rank
    for got, i in ((0, 2), (1, 0)):
        assert b.sample(got) == a.sample(i)
    assert image_draws(7, 2, [10]).sample(0) != a.sample(0)  # the next epoch draws anew
    many = image_draws(0, 0, np.arange(2000))
    assert set(many.x0.tolist()) == set(many.y0.tolist()) == set(range(GEO.offsets))
    for k, (lo, hi) in enumerate(ColorJitter().ranges()):
        assert lo <= many.factors[:, k].min() and many.factors[:, k].max() <= hi
        assert many.factors[:, k].min() < lo + 0.01 * (hi - lo) and many.factors[:, k].max() > hi - 0.01 * (hi - lo)
    assert (np.sort(many.order, 1) == np.arange(4)).all() and len({tuple(o) for o in many.order.tolist()}) == 24
    crop_only = image_draws(7, 1, [10, 11, 12, 13], jitter=None)
    assert crop_only.factors is None and (crop_only.x0 == a.x0).all()


@pytest.mark.parametrize("path", ["reference", pytest.param("device", marks=pytest.mark.full)])
def test_augmentation_statistics_match_isaac_gr00ts(fx, path):
    """200 draws of ours against Isaac-GR00T's 200 (augmentation_stats.json), per channel: the mean
    and the spread over draws of the channel means, and the mean of the channel stds. Each side is
    a sample of 200, so a difference has a standard error sqrt(2) x one side's: SE(mean) = sd /
    sqrt(200), SE(sd) ~ sd / sqrt(2 x 199). The tolerance is 4 of those standard errors (about
    7 levels for the means, 5 for the spread, 6 for the stds). The device path's run is `full` (200
    jittered images take ~30 s of CPU); test_the_training_device_path_is_near_the_reference ties it
    to the reference path image by image in the fast set."""
    summary = json.loads((fx / "augmentation_stats.json").read_text())["summary"]
    src, n = np.load(fx / "augmentation_samples.npz")["source_image"], 200
    draws = image_draws(11, 0, np.arange(n))
    if path == "reference":
        out = np.stack([reference_augment(src, offset=o, jitter=j) for o, j in map(draws.sample, range(n))])
    else:
        out = device_images(_chw(np.repeat(src[None], n, 0)), draws=draws, stage="augment").permute(0, 2, 3, 1).numpy()
    means, stds = out.astype(np.float64).mean((1, 2)), out.astype(np.float64).std((1, 2))
    se = 4 * math.sqrt(2)
    for c in range(3):
        sd_mean, sd_std = summary["std_of_channel_means"][c], summary["std_of_channel_stds"][c]
        assert abs(means[:, c].mean() - summary["mean_of_channel_means"][c]) <= se * sd_mean / math.sqrt(n)
        assert abs(means[:, c].std() - sd_mean) <= se * sd_mean / math.sqrt(2 * (n - 1))
        assert abs(stds[:, c].mean() - summary["mean_of_channel_stds"][c]) <= se * sd_std / math.sqrt(n)


# ---- the processor ----


def test_the_processor_stacks_cameras_of_different_sizes_in_the_given_order(fx):
    z, views = _load(fx, "ds1_oxe_droid")  # 96 x 128 and a portrait 112 x 84 wrist camera
    frames = {v: (_chw(z[f"images_raw.{v}"]) / 127.5 - 1)[:, None] for v in views}  # (B, K=1, 3, h, w)
    stats = json.loads((fx / "stats" / "ds1_oxe_droid" / "dataset_statistics.json").read_text())["oxe_droid"]
    droid = Embodiment("oxe_droid", projector_index("oxe_droid"), REGISTERED["oxe_droid"], stats)
    proc = Processor(ProcessorConfig(), {"oxe_droid": droid}, max_state_dim=8, max_action_dim=8, max_action_horizon=32)
    got = proc.images(frames, views)
    assert got.shape == (len(z["pixel_values_uint8"]), 3, 252, 252)
    stats = _measure(got.numpy() * 127.5 + 127.5, z["pixel_values_uint8"])
    assert all(stats[k] <= EVAL_BOUND[k] for k in EVAL_BOUND), stats
    swapped = proc.images(frames, views[::-1]).view(-1, 2, 3, 252, 252)
    assert torch.equal(swapped.flip(1), got.view(-1, 2, 3, 252, 252))
    # noise_for's crop uniforms still place the crop: at the centre's offset, the eval pixels
    centre = torch.full((len(got) // 2, 2), (GEO.centre + 0.5) / GEO.offsets)
    assert torch.allclose(proc.images(frames, views, centre), got, atol=1e-5)
    # per-sample draws: both cameras of a sample share its crop and jitter
    draws = image_draws(1, 0, np.arange(3))
    trained = proc.images({v: f[:3] for v, f in frames.items()}, views, draws=draws).numpy() * 127.5 + 127.5
    want = np.stack([reference_pixels(z[f"images_raw.{v}"][i], offset=draws.sample(i)[0], jitter=draws.sample(i)[1])
                     for i in range(len(draws)) for v in views])
    assert _measure(trained, want)["mean"] <= TRAIN_BOUND["mean"]


# ---- NV12 -> the decoder's RGB ----


def test_reference_rgb_is_the_decoders_rgb_bit_for_bit(fx, tmp_path):
    """A shard stores the decoded yuv420p planes as NV12; swscale on them again gives the RGB
    Isaac-GR00T's decoder (torchcodec) returned for the fixture's sampled frames."""
    out = tmp_path / "shards"
    run_job(PreprocessConfig(input=str(fx / "datasets" / "ds1_oxe_droid"), output=str(out), workers=1),
            ["--direct_running_mode=in_memory", "--direct_num_workers=1"])
    ds = open_root(str(out))
    assert ds.frame_shape("wrist_image_left") == (112 * 3 // 2, 84)  # each camera at its own size
    position = {ds.episode_id(e): e for e in range(ds.num_episodes)}
    z, views = _load(fx, "ds1_oxe_droid")
    info = json.loads((out / "index.json").read_text())["dataset"]
    for i, s in enumerate(json.loads((fx / "samples_ds1_oxe_droid.json").read_text())["samples"]):
        block, row = ds.block_of(s["frame_index"])
        for view in views:
            nv12 = ds.read_block(position[s["episode_index"]], view, block)[row]
            rgb = reference_rgb(nv12, info["color_matrix"], info["color_range"])
            np.testing.assert_array_equal(rgb, z[f"images_raw.{view}"][i], err_msg=f"sample {i} {view}")
