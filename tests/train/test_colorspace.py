import numpy as np
import pytest
import torch

from loongforge.shared import color
from loongforge.train.colorspace import nv12_to_input, nv12_to_rgb


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
    np.testing.assert_allclose(x, (np.moveaxis(ref, -1, -3) / 255.0 - 0.5) / 0.25, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_reference():
    nv12 = np.random.default_rng(2).integers(0, 256, size=(4, 24, 16), dtype=np.uint8)
    got = nv12_to_rgb(torch.from_numpy(nv12).cuda(), "bt601", "limited").cpu().numpy()
    assert np.array_equal(got, color.nv12_to_rgb(nv12, "bt601", "limited"))
