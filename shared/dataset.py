"""Read a shard root: frame blocks, per-episode arrays, O(1) lookups.

    ds = open_root("out/shards")                   # local path or fsspec URL
    e, t = ds.locate(123_456)                      # global frame -> (episode row, frame)
    b, i = ds.block_of(t)                          # frame -> (block, position in it)
    nv12 = ds.read_block(e, "ego_view", b)[i]      # uint8 (3h/2, w)
    both = ds.read_blocks(e, b)                    # {slot: block}, all cameras in one range read
    arrays = ds.read_arrays(e)                     # state, action, timestamp, frame_index, task_index

Episodes are addressed by their row e in the tables (0..num_episodes-1, global
order); `episode_id(e)` is the source's episode index. The tables are
memory-mapped (local roots), so opening costs a few header reads whatever the
dataset size, and every process on a node shares the same pages. Every block
and arrays read is checked against its xxh3 in the index before it is decoded.

Every reader of a shard root (the trainer's loader and validation set, evaluation,
tuning, `loongforge inspect`, the cache daemon) opens it here, so the manifest's
format version is checked in one place (`index.parse_manifest`): a root of the
retired format 1 is refused with the `loongforge convert` command that rewrites it.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import cached_property

import numpy as np
import xxhash

from loongforge.shared import paths, storage
from loongforge.shared.blocks import DEFAULT_BLOCK_CODEC, decode_block, episode_key
from loongforge.shared.errors import FormatError, IntegrityError
from loongforge.shared.index import TABLES, ShardIndex, check_table, parse_manifest, shard_level_index
from loongforge.shared.members import load_npy, split_members
from loongforge.shared.source import OriginSource, ShardSource


def _flat(arr: np.ndarray) -> memoryview:
    """A 1-D native-format memoryview of a C-contiguous table (2-D tables row-major)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1))  # a view: the tables are C-contiguous


def _load_table(root: str, name: str, entry: dict, origin: str) -> np.ndarray:
    path = paths.join(root, entry["name"])
    try:
        if storage.is_local(path):
            # mmap: no parse, no copy; pages are shared by every process mapping the file.
            arr = np.load(path[len("file://"):] if path.startswith("file://") else path, mmap_mode="r",
                          allow_pickle=False)
            arr = arr.view(np.ndarray)  # plain ndarray over the map: numpy calls skip memmap's wrapping
        else:  # remote root: one read per table (a node-local copy is what makes it shared)
            arr = np.load(io.BytesIO(storage.read_bytes(path)), allow_pickle=False)
    except FileNotFoundError:
        raise FormatError(f"{origin}: table {entry['name']} is missing: the root is incomplete; re-run the writer") \
            from None
    except ValueError as exc:  # short file: "mmap length is greater than file size", bad header
        raise IntegrityError(f"{origin}: table {entry['name']} is unreadable ({exc}): truncated; re-run the writer") \
            from exc
    return check_table(name, arr, entry, origin)


class Dataset:
    def __init__(self, root: str, manifest: dict, tables: dict[str, np.ndarray],
                 source: ShardSource | Callable[[ShardIndex], ShardSource] | None = None):
        self.root = root
        self.info = manifest.pop("_dataset")
        self.manifest = manifest
        self.shard_index = shard_level_index({**manifest, "_dataset": self.info})
        self._source_arg = source
        self.source = source(self.shard_index) if callable(source) and not hasattr(source, "read_range") else \
            source if source is not None else OriginSource(root, self.shard_index)
        self.cameras = list(self.info.slots)
        self._camera = {**{slot: c for c, slot in enumerate(self.cameras)}, **{c: c for c in range(len(self.cameras))}}
        self.block_size = int(manifest["params"]["block_size"])
        self.block_codec = manifest["params"].get("block_codec", DEFAULT_BLOCK_CODEC)  # checked by parse_manifest
        self._shard_names = [s["name"] for s in manifest["shards"]]
        self.episode_lengths = tables["episode_length"]
        self.episode_starts = tables["episode_start"]
        self.tables = tables
        self._shapes = [(h * 3 // 2, w) for h, w in map(self.info.camera_size, range(len(self.cameras)))]
        self._ncam = len(self.cameras)
        self._shift = int(manifest["frame_bucket_shift"])
        # Flat memoryviews over the mapped tables: indexing one returns a Python int in
        # ~30 ns, where a numpy scalar read plus int() costs ~10x that; this is what
        # keeps locate/block_entry O(1) and under 2 us (benchmarks/micro/index_scale.py).
        mv = {name: _flat(arr) for name, arr in tables.items()}
        self._starts, self._bucket, self._lengths = mv["episode_start"], mv["frame_bucket"], mv["episode_length"]
        self._ids, self._shard, self._arrays = mv["episode_id"], mv["episode_shard"], mv["episode_arrays"]
        self._first, self._blocks = mv["first_block"], mv["blocks"]

    def __reduce__(self):
        """Pickled (spawned loader workers) as root + source argument: the worker re-opens,
        mapping the same table files instead of receiving copies of them."""
        return _reopen, (self.root, self._source_arg)  # a custom source must itself pickle

    # -- metadata ---------------------------------------------------------------
    @property
    def num_episodes(self) -> int:
        return int(self.episode_lengths.shape[0])

    @property
    def num_frames(self) -> int:
        """Frames per camera over every episode (= samples at stride 1)."""
        return int(self.episode_starts[-1])

    @property
    def stats(self) -> dict:
        return self.info.stats

    @property
    def tasks(self) -> dict:
        return self.info.tasks

    def frame_shape(self, camera: str | int) -> tuple[int, int]:
        """(3h/2, w) of one stored NV12 frame of `camera` (cameras may differ: DatasetInfo.camera_size)."""
        return self._shapes[self._cam(camera)]

    def episode_id(self, e: int) -> int:
        return self._ids[e]

    @cached_property
    def val_episodes(self) -> frozenset[int]:
        return frozenset(int(x) for x in self.manifest.get("split", {}).get("val_episodes", ()))

    @cached_property
    def val_mask(self) -> np.ndarray:
        """bool per episode row: True = held out for validation (shared/split.py)."""
        return np.isin(self.tables["episode_id"], np.fromiter(self.val_episodes, np.int64, len(self.val_episodes)))

    def split(self, e: int) -> str:
        return "val" if self._ids[e] in self.val_episodes else "train"

    # -- O(1) lookups -----------------------------------------------------------
    def locate(self, n: int) -> tuple[int, int]:
        """Global frame number (0..num_frames-1, episodes in table order) -> (episode row, frame)."""
        starts = self._starts
        if not 0 <= n < starts[-1]:
            raise IndexError(f"frame {n} out of range [0, {starts[-1]})")
        e = self._bucket[n >> self._shift]  # the episode holding the bucket's first frame
        while starts[e + 1] <= n:  # rarely more than one step: buckets are <= the median episode
            e += 1
        return e, n - starts[e]

    def block_of(self, t: int) -> tuple[int, int]:
        return divmod(t, self.block_size)

    def num_blocks(self, e: int) -> int:
        return -(-self._lengths[e] // self.block_size)

    def _cam(self, camera: str | int) -> int:
        """Camera slot name or column number -> column number."""
        try:
            return self._camera[camera]
        except (KeyError, TypeError):
            raise KeyError(f"camera {camera!r} not in this dataset: {self.cameras}") from None

    def block_entry(self, e: int, camera: str | int, b: int) -> tuple[str, int, int, int, int]:
        """(shard name, offset, length, n_frames, xxh3_64) of block b of episode row e's camera."""
        c = self._camera.get(camera)
        if c is None:
            c = self._cam(camera)  # raises KeyError naming the cameras
        if not 0 <= b < -(-self._lengths[e] // self.block_size):
            raise IndexError(f"episode row {e}: block {b} out of range [0, {self.num_blocks(e)})")
        row = 4 * (self._first[e * self._ncam + c] + b)
        blocks = self._blocks
        return self._shard_names[self._shard[e]], blocks[row], blocks[row + 1], blocks[row + 2], blocks[row + 3]

    # -- reads ------------------------------------------------------------------
    def read_block(self, e: int, camera: str | int, b: int, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 (n, 3h/2, w): the n (<= block_size) frames of block b, xxh3-checked. `out`
        (optional, at least n frames): decode into it and return its first n frames."""
        name, off, length, n, digest = self.block_entry(e, camera, b)
        view = self.source.read_range(name, off, length)
        return self._decode(view, e, self._cam(camera), b, (name, off, length, n, digest), out)

    def read_blocks(self, e: int, b: int, cameras: list[str] | None = None) -> dict[str, np.ndarray]:
        """Block b of several cameras (default: all) with ONE range read: the block-major layout
        puts them next to each other in the shard (one request instead of C from an object store)."""
        cams = self.cameras if cameras is None else [self.cameras[self._cam(c)] for c in cameras]
        entries = [self.block_entry(e, cam, b) for cam in cams]
        lo = min(x[1] for x in entries)
        hi = max(x[1] + x[2] for x in entries)
        view = self.source.read_range(entries[0][0], lo, hi - lo)
        return {cam: self._decode(view[x[1] - lo : x[1] - lo + x[2]], e, self._cam(cam), b, x, None)
                for cam, x in zip(cams, entries)}

    def _decode(self, view, e: int, c: int, b: int, entry: tuple, out: np.ndarray | None) -> np.ndarray:
        name, off, length, n, digest = entry
        what = f"{name}: episode {self.episode_id(e)} camera {self.cameras[c]} block {b}"
        if len(view) != length or xxhash.xxh3_64_intdigest(view) != digest:
            raise IntegrityError(f"{what} (bytes {off}+{length}) does not match its xxh3 in the index: corrupt "
                                 "shard; re-fetch it or re-run `loongforge preprocess`")
        shape = self._shapes[c]
        target = np.empty((n, *shape), np.uint8) if out is None else out[:n]
        if target.shape != (n, *shape) or target.dtype != np.uint8 or not target.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous uint8 with >= {n} frames of {shape}")
        return decode_block(view, target, what, self.block_codec)

    def read_arrays(self, e: int) -> dict[str, np.ndarray]:
        """The episode's per-frame arrays: state (T,S) f32, action (T,A) f32, timestamp (T,) f64,
        frame_index (T,) i64, task_index (T,) i64 (+ any optional ones, e.g. action_known)."""
        off, length, digest = self._arrays[3 * e : 3 * e + 3].tolist()
        name = self._shard_names[self._shard[e]]
        view = self.source.read_range(name, off, length)
        if len(view) != length or xxhash.xxh3_64_intdigest(view) != digest:
            raise IntegrityError(f"{name}: episode {self.episode_id(e)} arrays (bytes {off}+{length}) do not match "
                                 "their xxh3 in the index: corrupt shard; re-fetch it or re-run `loongforge preprocess`")
        key = episode_key(self.episode_id(e))
        out = {}
        for member, data in split_members(view).items():
            k, _, ext = member.partition(".")
            if k != key or not ext.endswith(".npy"):
                raise FormatError(f"{name}: episode {self.episode_id(e)} arrays hold member {member!r}")
            out[ext[:-4]] = load_npy(data, f"{name}:{member}")
        return out

    def verify(self) -> list[str]:
        """Hash-check every shard (size + sha256) and table; returns what failed and why."""
        bad = []
        for name in self._shard_names:
            try:
                self.source.read_shard(name)
            except Exception as exc:  # noqa: BLE001 - report every failure, keep going
                bad.append(f"{name}: {exc}")
        for entry in self.manifest["tables"].values():
            try:
                data = storage.read_bytes(paths.join(self.root, entry["name"]))
                storage.verify(data, entry["name"], entry["bytes"], entry["sha256"])
            except Exception as exc:  # noqa: BLE001
                bad.append(f"{entry['name']}: {exc}")
        return bad


def read_manifest(root: str) -> dict:
    path = paths.join(root, paths.INDEX_FILE)
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        raise FormatError(f"no {paths.INDEX_FILE} under {root!r}: not a shard root, or the writer did not finish "
                          "(the index is written last). Run `loongforge preprocess --input DATASET --output ROOT`.") \
            from None
    return parse_manifest(raw, origin=path)


def open_root(root: str, *, source: ShardSource | Callable[[ShardIndex], ShardSource] | None = None) -> Dataset:
    """Open a shard root. `source`: where shard bytes come from (default: the origin);
    a ShardSource, or a factory taking the shard-level ShardIndex (e.g. `lambda ix:
    CacheClient(root, ix)`), since a cache client needs the shard list first."""
    doc = read_manifest(root)
    origin = paths.join(root, paths.INDEX_FILE)
    tables = {name: _load_table(root, name, doc["tables"][name], origin) for name in TABLES}
    e, c = int(doc["episodes"]), len(doc["_dataset"].cameras)
    want = {"episode_id": (e,), "episode_shard": (e,), "episode_length": (e,), "episode_start": (e + 1,),
            "episode_arrays": (e, 3), "first_block": (e, c), "blocks": (int(doc["blocks"]), 4),
            "frame_bucket": (-(-int(doc["frames"]) >> doc["frame_bucket_shift"]),)}
    for name, shape in want.items():
        if tables[name].shape != shape:
            raise FormatError(f"{origin}: table {name} has shape {tables[name].shape}, expected {shape}")
    return Dataset(root, doc, tables, source)


def _reopen(root: str, source) -> Dataset:
    return open_root(root, source=source)


def load_shard_index(root: str) -> ShardIndex:
    """The shard level of a root (shard names, sizes, hashes) from its manifest alone, tables
    unread: what the cache daemon serves (it works per shard, never inside one)."""
    return shard_level_index(read_manifest(root))
