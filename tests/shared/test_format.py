import io
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loongforge.shared import format as fmt
from loongforge.shared.errors import FormatError, FormatVersionError, UnsafePathError
from loongforge.shared.paths import sample_key


@st.composite
def samples(draw):
    k = draw(st.integers(1, 4))
    h = 2 * draw(st.integers(1, 6))
    w = 2 * draw(st.integers(1, 6))
    horizon = draw(st.integers(1, 5))
    ds, da = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    slots = draw(st.lists(st.sampled_from(["front", "wrist", "ego_view", "cam2"]), min_size=1, max_size=3, unique=True))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    episode, start = draw(st.integers(0, 999_999)), draw(st.integers(0, 999_999))
    return fmt.Sample(
        key=sample_key(episode, start), episode=episode,
        frame_indices=np.arange(start, start + k, dtype=np.int64),
        timestamps=np.arange(k) / 30.0,
        frames={s: rng.integers(0, 256, (k, h * 3 // 2, w), dtype=np.uint8) for s in slots},
        state=rng.standard_normal((k, ds)).astype(np.float32),
        action=rng.standard_normal((horizon, da)).astype(np.float32),
        action_valid=draw(st.integers(1, horizon)),
        task=draw(st.text(max_size=40)), task_index=draw(st.integers(-1, 100)),
    ), h, w


@settings(max_examples=60, deadline=None)
@given(samples())
def test_round_trip(case):
    sample, h, w = case
    blob = fmt.pack_sample(sample)
    assert len(blob) % fmt.BLOCK == 0
    back = fmt.SampleParts(blob).decode(h, w)
    assert back.key == sample.key and back.episode == sample.episode
    assert back.task == sample.task and back.task_index == sample.task_index
    assert back.action_valid == sample.action_valid
    np.testing.assert_array_equal(back.frame_indices, sample.frame_indices)
    np.testing.assert_array_equal(back.state, sample.state)
    np.testing.assert_array_equal(back.action, sample.action)
    assert sorted(back.frames) == sorted(sample.frames)
    for slot, frames in sample.frames.items():
        np.testing.assert_array_equal(back.frames[slot], frames)
    # The fragment is a valid tar stream that the standard library reads too.
    names = tarfile.open(fileobj=io.BytesIO(blob + fmt.END_OF_ARCHIVE)).getnames()
    assert all(n.startswith(sample.key + ".") for n in names)


@settings(max_examples=20, deadline=None)
@given(samples())
def test_pack_is_deterministic(case):
    sample, _, _ = case
    assert fmt.pack_sample(sample) == fmt.pack_sample(sample)


def _one_sample():
    rng = np.random.default_rng(0)
    return fmt.Sample(key="e000001_f000002", episode=1, frame_indices=np.arange(2), timestamps=np.zeros(2),
                      frames={"front": rng.integers(0, 256, (2, 6, 4), dtype=np.uint8)},
                      state=np.zeros((2, 3), np.float32), action=np.zeros((4, 3), np.float32),
                      action_valid=4, task="t")


def test_truncated_fragment_is_rejected():
    blob = fmt.pack_sample(_one_sample())
    with pytest.raises(FormatError, match="truncated"):
        fmt.SampleParts(blob[: len(blob) - 1024 + 512 + 20])  # into the last payload
    # Cut exactly at a member boundary: parses, but the missing camera is caught.
    parts = fmt.SampleParts(blob[: len(blob) - 1024])
    with pytest.raises(FormatError, match="no camera"):
        parts.decode(4, 4)


def test_corrupt_header_is_rejected():
    blob = bytearray(fmt.pack_sample(_one_sample()))
    blob[130] ^= 0x01  # inside the size field of the first header
    with pytest.raises(FormatError, match="checksum"):
        fmt.SampleParts(bytes(blob))


def test_corrupt_frame_payload_is_rejected():
    sample = _one_sample()
    parts = fmt.SampleParts(fmt.pack_sample(sample))
    blob = bytes(parts.frames_blob("front"))
    out = np.empty((2, 6, 4), np.uint8)
    with pytest.raises(FormatError):
        fmt.decompress_into(blob[:-3], out)
    with pytest.raises(FormatError, match="wrong size"):
        fmt.decompress_into(blob, np.empty((3, 6, 4), np.uint8))


def test_unknown_sample_version_is_rejected():
    blob = fmt.pack_sample(_one_sample())
    # Rewrite meta.json in place with another version, keeping the tar valid.
    members = fmt.split_members(blob)
    meta = bytes(members["e000001_f000002.meta.json"]).replace(b'"format_version": 1', b'"format_version": 9')
    rebuilt = fmt._member("e000001_f000002.meta.json", meta) + b"".join(
        fmt._member(n, bytes(d)) for n, d in members.items() if not n.endswith("meta.json"))
    with pytest.raises(FormatVersionError, match="re-run `loongforge preprocess`"):
        fmt.SampleParts(rebuilt)


@pytest.mark.parametrize("name", ["../evil.meta.json", "/etc/passwd", "a/b.json", "..", ".hidden"])
def test_traversal_member_names_rejected(name):
    with pytest.raises(UnsafePathError):
        fmt._member(name, b"x")
    header = bytearray(fmt._member("ok.txt", b"x"))
    header[0:100] = name.encode().ljust(100, b"\0")
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header[:512]):06o}\0 ".encode()
    with pytest.raises(UnsafePathError):
        fmt.split_members(bytes(header))


def test_format_md_stdlib_reader_works(synthetic_root):
    """The FORMAT.md snippet is what third parties copy: run it as written."""
    root, index = synthetic_root
    text = (Path(fmt.__file__).parent / "FORMAT.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if '["format_version"] == 1' in b)
    code = code.replace('root = "out"', f"root = {root!r}")
    ns: dict = {}
    exec(code, ns)
    assert ns["nv12"].shape == (index.dataset.frames_per_sample, 24, 16)
    assert ns["meta"]["episode"] == 0 and ns["state"].dtype == np.float32


@pytest.mark.parametrize("arr", [np.arange(12, dtype=np.float32).reshape(3, 4), np.asfortranarray(np.ones((3, 5))),
                                 np.zeros((0, 2), np.float32), np.arange(3, dtype=np.int64)])
def test_npy_header_cache_matches_np_load(arr):
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    data = buf.getvalue()
    for _ in range(2):  # first call fills the header cache, second one uses it
        got = fmt._load_npy(memoryview(data), "x.npy")
        assert got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr)
        assert got.flags.writeable  # a copy, not a view into the (read-only) shard map
    if arr.size:
        with pytest.raises(FormatError):
            fmt._load_npy(memoryview(data[:-3]), "x.npy")


def test_object_npy_is_refused():
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(FormatError, match="not a valid .npy"):
        fmt._load_npy(memoryview(buf.getvalue()), "x.npy")
