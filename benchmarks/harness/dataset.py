"""The shard format every benchmark reads and writes (format 2: frame blocks), in one place.

Benchmarks import the format's reader, writer, synthetic roots, sample semantics, order and
decode-worker body from here, never from their modules, so a rename in the library is one
edit in this file. Names are what the code calls them: `open_root` opens a shard root,
`RootWriter` writes one, `make_synthetic_root` makes a small valid one without video.
"""

from __future__ import annotations

import os

from loongforge.shared import paths
from loongforge.shared.blocks import decode_block
from loongforge.shared.dataset import open_root
from loongforge.shared.index import bucket_shift, frame_buckets, manifest_json
from loongforge.shared.synthetic import make_synthetic_root, synthetic_dataset_info
from loongforge.shared.writer import RootWriter, write_tables
from loongforge.train.data.fill import BlockFiller
from loongforge.train.data.order import EpochOrder, batch_diversity, block_sequence, rank_slice
from loongforge.train.data.samples import DeltaSpec, SampleTable, sample_lengths, video_indices
from loongforge.train.data.loader import BlockLoader

__all__ = ["BlockFiller", "DeltaSpec", "EpochOrder", "RootWriter", "SampleTable", "TRAIN_DELTAS", "batch_diversity",
           "block_loader", "block_sequence", "bucket_shift", "decode_block", "frame_buckets", "make_synthetic_root",
           "manifest_json", "open_root", "rank_slice", "synthetic_dataset_info", "synthetic_train_root",
           "sample_lengths", "video_indices", "write_tables"]
TRAIN_DELTAS = (-1, 0)  # what the training benchmarks read of a synthetic root: 2 frames per camera per sample


def synthetic_train_root(root: str, lengths: tuple[int, ...], **kwargs) -> list[str]:
    """A small synthetic shard root for `loongforge train` jobs, written unless `root` already holds
    one; returns the trainer flags that read it as the benchmarks do (TRAIN_DELTAS)."""
    if not os.path.exists(os.path.join(root, paths.INDEX_FILE)):
        make_synthetic_root(root, lengths=lengths, **kwargs)
    return [f"--video-deltas={','.join(map(str, TRAIN_DELTAS))}"]


def block_loader(root: str, **kwargs):
    """The trainer's loader of a shard root (`BlockLoader`), built with `kwargs`."""
    # NOTE: function-local: the loader needs torch (the train extra); the rest of this module does not,
    # so the index probes of micro/index_scale.py measure the reader alone.

    return BlockLoader(root, **kwargs)
