import numpy as np
import pytest
import torch

from loongforge.shared import color
from loongforge.train.data import colorspace, colorspace_jit
from loongforge.train.data.colorspace import nv12_to_input, nv12_to_input_reference, nv12_to_rgb


@pytest.fixture(params=["jit", "ops"])
def cpu_path(request, monkeypatch):
    """Both CPU forms of nv12_to_input: the numba pass ("jit") and the torch ops it falls back to ("ops")."""
    if request.param == "jit":
        pytest.importorskip("numba")
        assert colorspace_jit.available(), "numba is installed but the NV12 kernel did not compile"
    else:
        monkeypatch.setattr(colorspace_jit, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
@pytest.mark.parametrize("rng_", ["limited", "full"])
def test_device_path_matches_numpy_reference(matrix, rng_):
    rng = np.random.default_rng(7)
    nv12 = rng.integers(0, 256, size=(3, 2, 24, 16), dtype=np.uint8)  # (B, K, 3h/2, w), h=16
    want = color.nv12_to_rgb(nv12, matrix, rng_)
    got = nv12_to_rgb(torch.from_numpy(nv12), matrix, rng_).numpy()
    assert got.shape == want.shape == (3, 2, 16, 16, 3)
    assert np.array_equal(got, want)


def test_model_input_is_reference_rgb_normalized():
    rng = np.random.default_rng(1)
    nv12 = rng.integers(0, 256, size=(2, 12, 8), dtype=np.uint8)
    ref = color.nv12_to_rgb(nv12, "bt709", "limited").astype(np.float32)  # (2, 8, 8, 3)
    x = nv12_to_input(torch.from_numpy(nv12), "bt709", "limited", mean=0.5, std=0.25).numpy()
    assert x.shape == (2, 3, 8, 8)
    # 1 LSB of RGB is 1/255/std = 0.0157 here; a differing pixel (~1e-6 of them) is exactly one LSB off.
    np.testing.assert_allclose(x, (np.moveaxis(ref, -1, -3) / 255.0 - 0.5) / 0.25, rtol=0, atol=1e-5 + 1 / 255 / 0.25)


def _every_yuv_triple(frames_per_chunk: int):
    """All 2^24 (Y, Cb, Cr) as NV12 256x256 frames: each 2x2 block holds one (Cb, Cr) and 4 of the
    256 Y values, so 64 blocks cover one chroma pair; 16,384 blocks per frame, 256 frames in all."""
    block = np.arange(1 << 22)
    cbcr, ys = block // 64, (block % 64) * 4
    for f0 in range(0, 256, frames_per_chunk):
        b = block[f0 * 16384:(f0 + frames_per_chunk) * 16384]
        n = len(b) // 16384
        y = (ys[b][:, None] + np.arange(4)).reshape(n, 128, 128, 2, 2).transpose(0, 1, 3, 2, 4).reshape(n, 256, 256)
        uv = np.stack((cbcr[b] >> 8, cbcr[b] & 0xFF), axis=-1).reshape(n, 128, 256)
        yield np.concatenate((y, uv), axis=1).astype(np.uint8)


def test_fused_conversion_is_within_one_lsb_of_the_reference_on_every_input(cpu_path, matrix="bt601",
                                                                            rng_="limited"):
    # Every input once for the default matrix (the other three are covered by the random test below).
    # mean=0, std=1/255 makes the model input the rounded RGB itself, so LSBs compare directly.
    # The numba pass does the reference's float32 ops in its order: not one value may differ.
    off, checked = 0, 0
    for nv12 in _every_yuv_triple(32):
        ref = np.moveaxis(color.nv12_to_rgb(nv12, matrix, rng_), -1, -3).astype(np.int16)
        got = nv12_to_input(torch.from_numpy(nv12), matrix, rng_, mean=0.0, std=1 / 255).numpy()
        diff = np.abs(got - ref)
        assert float(diff.max()) <= 1.0 + 1e-3, "more than 1 LSB away from shared.color"
        off += int((diff > 0.5).sum())
        checked += diff.size
    assert checked == 3 << 24
    assert off / checked < 1e-4, f"{off} of {checked} channel values differ by 1 LSB"
    if cpu_path == "jit":
        assert off == 0, f"{off} of {checked} channel values differ from shared.color"


def test_fused_conversion_equals_the_unfused_one_on_odd_shapes_and_dtypes(monkeypatch, cpu_path):
    # Several CPU chunks and a partial last one (CHUNK_PX / (h*w) = 3 frames per chunk), output passes
    # over 2-frame slices of each (a partial one too), bf16 output.
    monkeypatch.setattr(colorspace, "CHUNK_PX", 3 * 64 * 64)
    monkeypatch.setattr(colorspace, "OUT_PX", 2 * 64 * 64)
    nv12 = torch.from_numpy(np.random.default_rng(4).integers(0, 256, size=(5, 7, 96, 64), dtype=np.uint8))
    kw = dict(mean=0.45, std=0.22)
    for matrix, rng_ in (("bt601", "limited"), ("bt601", "full"), ("bt709", "limited"), ("bt709", "full")):
        got = nv12_to_input(nv12, matrix, rng_, **kw)
        want = nv12_to_input_reference(nv12, matrix, rng_, **kw)
        assert got.shape == want.shape == (5, 7, 3, 64, 64) and got.is_contiguous()
        assert float((got - want).abs().max()) <= 1 / 255 / 0.22 + 1e-5
        assert cpu_path == "ops" or torch.equal(got, want)  # the numba pass is bit-identical
    assert nv12_to_input(nv12, "bt601", "limited", dtype=torch.bfloat16, **kw).dtype == torch.bfloat16
    with pytest.raises(Exception, match="NV12"):
        nv12_to_input(nv12[..., :95, :], "bt601", "limited", **kw)


@pytest.mark.parametrize("width", [2, 6, 8, 10])
def test_fused_conversion_handles_any_even_width_and_unaligned_views(width, cpu_path):
    # The chroma split reads the CbCr rows as int32 words: widths that are not a multiple of 4 and
    # views that start at an odd byte (a frame sliced out of a byte buffer) must still convert.
    rng = np.random.default_rng(width)
    buf = torch.from_numpy(rng.integers(0, 256, size=1 + 4 * 12 * width, dtype=np.uint8))
    nv12 = buf[1:].view(4, 12, width)  # storage offset 1
    kw = dict(mean=0.0, std=1 / 255)
    want = np.moveaxis(color.nv12_to_rgb(nv12.numpy(), "bt601", "limited"), -1, -3).astype(np.float32)
    got = nv12_to_input(nv12, "bt601", "limited", **kw).numpy()
    assert got.shape == (4, 3, 8, width)
    assert float(np.abs(got - want).max()) <= 1.0 + 1e-3
    column_major = nv12.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, row stride 1
    assert torch.equal(nv12_to_input(column_major, "bt601", "limited", **kw), torch.from_numpy(got))
    every_other = torch.stack((nv12, nv12), dim=1)[:, 1]  # frame stride twice its size
    assert torch.equal(nv12_to_input(every_other, "bt601", "limited", **kw), torch.from_numpy(got))
    if cpu_path == "jit":
        assert np.array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_reference():
    nv12 = np.random.default_rng(2).integers(0, 256, size=(4, 24, 16), dtype=np.uint8)
    got = nv12_to_rgb(torch.from_numpy(nv12).cuda(), "bt601", "limited").cpu().numpy()
    assert np.array_equal(got, color.nv12_to_rgb(nv12, "bt601", "limited"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_input_matches_the_cpu_one_within_one_lsb():
    # The prefetcher converts on the device (one chunk, CPU scalars as 0-dim tensors): same transform.
    nv12 = torch.from_numpy(np.random.default_rng(5).integers(0, 256, size=(3, 2, 48, 32), dtype=np.uint8))
    kw = dict(mean=0.45, std=0.22)
    got = nv12_to_input(nv12.cuda(), "bt709", "limited", **kw)
    assert got.device.type == "cuda"
    want = nv12_to_input_reference(nv12, "bt709", "limited", **kw)
    assert float((got.cpu() - want).abs().max()) <= 1 / 255 / 0.22 + 1e-5
