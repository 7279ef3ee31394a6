"""Tar members of a shard (shared/members.py): what the episode codec writes and every reader
parses, on tiny synthetic inputs. The episode codec's round trips are in test_dataset.py and
test_block_codec.py."""

import io
import tarfile
import threading

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from loongforge.shared import members as m
from loongforge.shared.errors import FormatError, UnsafePathError


def _run() -> bytes:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (2, 6, 4), dtype=np.uint8)
    blob = zstandard.ZstdCompressor(write_content_size=True).compress(frames.tobytes())
    return (m.tar_member("e000001.state.npy", m.npy_bytes(np.zeros((2, 3), np.float32)))
            + m.tar_member("e000001_b000000.front.nv12.zst", blob))


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,20}\.[a-z]{1,5}", fullmatch=True), st.binary(max_size=2000),
                       min_size=1, max_size=5))
def test_members_round_trip_and_are_a_plain_tar(payloads):
    run = b"".join(m.tar_member(name, data) for name, data in payloads.items())
    assert len(run) % m.BLOCK == 0 and run == b"".join(m.tar_member(n, d) for n, d in payloads.items())
    assert {n: bytes(v) for n, v in m.split_members(run).items()} == payloads
    with tarfile.open(fileobj=io.BytesIO(run + m.END_OF_ARCHIVE)) as tar:  # the standard library reads it too
        assert {t.name: tar.extractfile(t).read() for t in tar} == payloads


def test_truncated_run_is_rejected():
    blob = _run()
    with pytest.raises(FormatError, match="truncated"):
        m.split_members(blob[: len(blob) - 1024 + 512 + 20])  # into the last payload
    assert list(m.split_members(blob[: 2 * m.BLOCK])) == ["e000001.state.npy"]  # cut at a member boundary


def test_corrupt_header_is_rejected():
    blob = bytearray(_run())
    blob[130] ^= 0x01  # inside the size field of the first header
    with pytest.raises(FormatError, match="checksum"):
        m.split_members(bytes(blob))
    with pytest.raises(FormatError, match="empty"):
        m.split_members(m.END_OF_ARCHIVE)


def test_corrupt_frame_payload_is_rejected():
    blob = bytes(m.split_members(_run())["e000001_b000000.front.nv12.zst"])
    out = np.empty((2, 6, 4), np.uint8)
    m.decompress_into(blob, out)
    with pytest.raises(FormatError):
        m.decompress_into(blob[:-3], out)
    with pytest.raises(FormatError, match="wrong size"):
        m.decompress_into(blob, np.empty((3, 6, 4), np.uint8))


@pytest.mark.parametrize("name", ["../evil.meta.json", "/etc/passwd", "a/b.json", "..", ".hidden"])
def test_traversal_member_names_rejected(name):
    with pytest.raises(UnsafePathError):
        m.tar_member(name, b"x")
    header = bytearray(m.tar_member("ok.txt", b"x"))
    header[0:100] = name.encode().ljust(100, b"\0")
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header[:512]):06o}\0 ".encode()
    with pytest.raises(UnsafePathError):
        m.split_members(bytes(header))


@pytest.mark.parametrize("arr", [np.arange(12, dtype=np.float32).reshape(3, 4), np.asfortranarray(np.ones((3, 5))),
                                 np.zeros((0, 2), np.float32), np.arange(3, dtype=np.int64)])
def test_npy_header_cache_matches_np_load(arr):
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    data = buf.getvalue()
    for _ in range(2):  # first call fills the header cache, second one uses it
        got = m.load_npy(memoryview(data), "x.npy")
        assert got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr)
        assert got.flags.writeable  # a copy, not a view into the (read-only) shard map
    if arr.size:
        with pytest.raises(FormatError):
            m.load_npy(memoryview(data[:-3]), "x.npy")


def test_object_npy_is_refused():
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(FormatError, match="not a valid .npy"):
        m.load_npy(memoryview(buf.getvalue()), "x.npy")


def test_decompress_into_is_thread_safe():
    """An inline loader decodes blocks in its prefetch thread while the main thread reads the same
    kind of blocks (validation, the LeRobot adapter): each thread's frames must come out intact."""
    rng = np.random.default_rng(0)
    # Blocks of the size a loader decodes (16 NV12 frames of 128x128): zstd releases the GIL on them.
    frames = [rng.integers(0, 16, size=(16, 192, 128), dtype=np.uint8) for _ in range(4)]
    blobs = [zstandard.ZstdCompressor(level=3, write_content_size=True).compress(f.tobytes()) for f in frames]
    errors = []

    def worker(seed: int) -> None:
        out = np.empty((16, 192, 128), np.uint8)
        try:
            for i in range(60):
                k = (i + seed) % len(blobs)
                m.decompress_into(blobs[k], out)
                assert np.array_equal(out, frames[k])
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
