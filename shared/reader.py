"""Read samples from a shard root: iterate in order, or random-access by number.

    reader = ShardReader("out/shards")            # local path or fsspec URL
    sample = reader[123]                          # one byte-range read
    for sample in reader: ...                     # every sample, in index order
    reader.verify()                               # size + sha256 of every shard

Samples come back as `format.Sample` with NV12 uint8 frames; `color.nv12_to_rgb`
converts with the matrix and range recorded in the index.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from loongforge.shared import color, paths
from loongforge.shared.format import Sample, SampleParts
from loongforge.shared.index import ShardIndex, load_index
from loongforge.shared.source import OriginSource, ShardSource


class ShardReader:
    def __init__(self, root: str, *, verify: bool = False, source: ShardSource | None = None,
                 index: ShardIndex | None = None):
        self.root = root
        self.index = index if index is not None else load_index(root)
        self.source = source if source is not None else OriginSource(root, self.index)
        # verify=True: every shard is read whole and hash-checked before use.
        self.verify_hashes = verify

    def __len__(self) -> int:
        return self.index.num_samples

    def parts(self, number: int) -> SampleParts:
        shard_no, local = self.index.locate(number)
        entry = self.index.shards[shard_no]
        if self.verify_hashes:
            buf = self.source.read_shard(entry.name)
            view = memoryview(buf)[entry.offsets[local] : entry.offsets[local] + entry.lengths[local]]
        else:
            view = self.source.read_range(entry.name, entry.offsets[local], entry.lengths[local])
        entry.check_sample(local, view)
        return SampleParts(view)

    def __getitem__(self, number: int) -> Sample:
        ds = self.index.dataset
        return self.parts(number).decode(ds.height, ds.width, ds.slots)

    def __iter__(self) -> Iterator[Sample]:
        ds = self.index.dataset
        for entry in self.index.shards:
            buf = self.source.read_shard(entry.name) if self.verify_hashes else None
            for local, (off, length) in enumerate(zip(entry.offsets, entry.lengths)):
                view = memoryview(buf)[off : off + length] if buf is not None else \
                    self.source.read_range(entry.name, off, length)
                entry.check_sample(local, view)
                yield SampleParts(view).decode(ds.height, ds.width, ds.slots)

    def rgb(self, sample: Sample, slot: str) -> np.ndarray:
        ds = self.index.dataset
        return color.nv12_to_rgb(sample.frames[slot], ds.color_matrix, ds.color_range)

    def verify(self) -> list[str]:
        """Hash-check every shard; returns the names that failed (and why)."""
        bad = []
        for entry in self.index.shards:
            try:
                self.source.read_shard(entry.name)
            except Exception as exc:  # noqa: BLE001 - report every failure, keep going
                bad.append(f"{entry.name}: {exc}")
        return bad


def open_reader(root: str, **kw) -> ShardReader:
    paths.check_relative(paths.INDEX_FILE)
    return ShardReader(root, **kw)
