"""The episode codec of the shard format (spec: FORMAT.md).

One episode is one run of tar members inside a shard:

    e<id>.<name>.npy                     per-episode arrays (state, action, timestamp, ...), once
    e<id>_b<block>.<slot>.nv12.zst       B consecutive NV12 frames of one camera, one zstd frame

Blocks are written block-major (block 0 of every camera, then block 1, ...), so
the cameras of one time range sit next to each other in the file. Each member's
data range (not its header) is what the index points at: a reader seeks to a
block's offset and reads exactly its compressed bytes.

`encode_episode` streams an episode into any binary file object and returns its
layout with offsets relative to the fragment start; the writer adds the
episode's offset in its shard.

Block codecs (manifest `params.block_codec`, absent = "zstd"): "zstd" stores a
block's frames as they are; "delta-zstd" stores frame 0 as it is and frame i as
(frame i - frame i-1) mod 256, then zstd. Both are lossless and a block still
decodes alone. The delta turns a fixed camera's unchanged pixels into runs of
zeros and moving content into small residuals, which zstd codes 11-23 % smaller
at the same decode CPU on synthetic footage (benchmarks/README.md, storage table). The per-block
xxh3 covers the stored (compressed) bytes whatever the codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import xxhash
import zstandard

from loongforge.shared.errors import ConfigError, FormatError
from loongforge.shared.members import BLOCK, DEFAULT_ZSTD_LEVEL, NV12_SUFFIX, decompress_into, npy_bytes, tar_member
from loongforge.shared.paths import camera_slot

EPISODE_KEY_TEMPLATE = "e{episode:06d}"
BLOCK_KEY_TEMPLATE = "e{episode:06d}_b{block:06d}"
# Arrays every episode carries (FORMAT.md); writers may add more (e.g. action_known).
REQUIRED_ARRAYS = {"state": np.float32, "action": np.float32, "timestamp": np.float64,
                   "frame_index": np.int64, "task_index": np.int64}


BLOCK_CODECS = ("zstd", "delta-zstd")
DEFAULT_BLOCK_CODEC = "zstd"


def check_block_codec(codec, origin: str) -> str:
    """The codec name if this reader decodes it; FormatError with the fix otherwise."""
    if codec not in BLOCK_CODECS:
        raise FormatError(f"{origin}: block codec {codec!r} is unknown to this reader (it decodes {BLOCK_CODECS}): "
                          "upgrade loongforge (a newer one wrote it), or re-run `loongforge preprocess "
                          "--block-codec zstd`")
    return codec


def block_codec_param(codec: str) -> dict:
    """The manifest `params` entry for `codec`: none for plain zstd, so roots written
    without a codec choice stay byte-identical to those from before codecs existed."""
    return {} if codec == DEFAULT_BLOCK_CODEC else {"block_codec": codec}


def _predict(block: np.ndarray, codec: str) -> np.ndarray:
    """What is stored for one block's frames (n, 3h/2, w) under `codec`, before zstd."""
    if codec == "zstd":
        return np.ascontiguousarray(block)
    out = np.empty(block.shape, np.uint8)
    out[0] = block[0]
    np.subtract(block[1:], block[:-1], out=out[1:])  # uint8 arithmetic wraps: mod 256
    return out


def _unpredict(out: np.ndarray, codec: str) -> None:
    """Invert `_predict` in place, one add per frame: np.cumsum over axis 0 made the whole
    block decode ~8x slower in a probe; these adds cost about what zstd saves on the
    smaller payload (interleaved decode CPU equal, benchmarks/README.md)."""
    if codec == "delta-zstd":
        for i in range(1, len(out)):
            np.add(out[i], out[i - 1], out=out[i])


def episode_key(episode: int) -> str:
    return EPISODE_KEY_TEMPLATE.format(episode=episode)


def block_key(episode: int, block: int) -> str:
    return BLOCK_KEY_TEMPLATE.format(episode=episode, block=block)


def num_blocks(frames: int, block_size: int) -> int:
    return -(-frames // block_size)


@dataclass(frozen=True, slots=True)
class EpisodeLayout:
    """Where an episode's parts lie inside its fragment (offsets relative to it)."""

    episode: int
    num_frames: int
    length: int  # fragment bytes (a multiple of 512)
    arrays: tuple[int, int, int]  # (offset, length, xxh3_64) of the arrays' members, headers included
    blocks: tuple[tuple[tuple[int, int, int, int], ...], ...]  # per slot (writer order): (off, len, n, xxh3)

    def shifted(self, by: int) -> "EpisodeLayout":
        """The same layout with every offset moved by `by` (the fragment's offset in its shard)."""
        off, length, digest = self.arrays
        return EpisodeLayout(self.episode, self.num_frames, self.length, (off + by, length, digest),
                             tuple(tuple((o + by, n_bytes, n, d) for o, n_bytes, n, d in cam) for cam in self.blocks))


def check_arrays(episode: int, arrays: dict[str, np.ndarray], frames: int) -> dict[str, np.ndarray]:
    """Cast the required arrays to their dtypes; every array must have `frames` rows."""
    missing = sorted(set(REQUIRED_ARRAYS) - set(arrays))
    if missing:
        raise FormatError(f"episode {episode}: arrays {missing} missing (an episode needs {sorted(REQUIRED_ARRAYS)})")
    out = {}
    for name in sorted(arrays):
        camera_slot(name)  # a member-name-safe identifier, no dots
        arr = np.asarray(arrays[name])
        if name in REQUIRED_ARRAYS:
            arr = arr.astype(REQUIRED_ARRAYS[name], copy=False)
        if arr.dtype.hasobject or arr.ndim == 0 or arr.shape[0] != frames:
            raise FormatError(f"episode {episode}: array {name!r} has shape {arr.shape} {arr.dtype}, "
                              f"expected {frames} rows of a plain dtype")
        out[name] = arr
    return out


def encode_episode(out: BinaryIO, episode: int, frames: dict[str, np.ndarray], arrays: dict[str, np.ndarray],
                   *, slots: list[str], block_size: int, zstd_level: int = DEFAULT_ZSTD_LEVEL,
                   codec: str = DEFAULT_BLOCK_CODEC) -> EpisodeLayout:
    """Write one episode's members to `out` (positioned at the fragment start).
    `frames`: slot -> uint8 (T, 3h/2, w) NV12. Deterministic for equal input."""
    if block_size < 1:
        raise FormatError(f"block_size={block_size}: must be >= 1")
    if codec not in BLOCK_CODECS:
        raise ConfigError(f"block codec {codec!r}: choose one of {BLOCK_CODECS}")
    if sorted(frames) != sorted(slots):
        raise FormatError(f"episode {episode}: cameras {sorted(frames)} != dataset cameras {sorted(slots)}")
    t = int(frames[slots[0]].shape[0])
    if t < 1:
        raise FormatError(f"episode {episode}: no frames")
    for slot in slots:
        f = frames[slot]
        if f.dtype != np.uint8 or f.ndim != 3 or f.shape[0] != t:
            raise FormatError(f"episode {episode}/{slot}: frames must be uint8 (T={t}, 3h/2, w), got {f.dtype} "
                              f"{f.shape}")
    arrays = check_arrays(episode, arrays, t)
    pos = 0
    key = episode_key(episode)
    arrays_bytes = b"".join(tar_member(f"{key}.{name}.npy", npy_bytes(arr)) for name, arr in arrays.items())
    out.write(arrays_bytes)
    arrays_entry = (0, len(arrays_bytes), xxhash.xxh3_64_intdigest(arrays_bytes))
    pos += len(arrays_bytes)
    # One compressor per episode: each compress() call is an independent zstd
    # frame (content size recorded), so output depends only on input and level.
    cctx = zstandard.ZstdCompressor(level=zstd_level, write_content_size=True, threads=0)
    per_cam: list[list[tuple[int, int, int, int]]] = [[] for _ in slots]
    for b in range(num_blocks(t, block_size)):
        lo, hi = b * block_size, min(t, (b + 1) * block_size)
        for c, slot in enumerate(slots):
            blob = cctx.compress(_predict(frames[slot][lo:hi], codec).data)
            member = tar_member(f"{block_key(episode, b)}.{slot}{NV12_SUFFIX}", blob)
            out.write(member)
            per_cam[c].append((pos + BLOCK, len(blob), hi - lo, xxhash.xxh3_64_intdigest(blob)))
            pos += len(member)
    return EpisodeLayout(episode=episode, num_frames=t, length=pos, arrays=arrays_entry,
                         blocks=tuple(tuple(cam) for cam in per_cam))


def decode_block(blob, out: np.ndarray, what: str, codec: str = DEFAULT_BLOCK_CODEC) -> np.ndarray:
    """Decode one block straight into `out` (uint8 (n, 3h/2, w), no temp copy; `codec`
    already checked); FormatError naming `what` unless the payload fills it exactly."""
    try:
        decompress_into(blob, out)
    except FormatError as exc:
        raise FormatError(f"{what}: {exc}") from exc
    _unpredict(out, codec)
    return out
