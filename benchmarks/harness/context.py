"""What every row needs: the config, the prepared inputs, where LoongForge
reads from, and figures one row measured that a later row reuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.benchmarks.loader.baseline import LeRobotVideoDataset
from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.data import Prepared


@dataclass(slots=True)
class Context:
    cfg: BenchConfig
    prep: Prepared
    socket: str | None  # cache daemon socket; None = the origin (row notes say why)
    source_label: str
    measured: dict = field(default_factory=dict)  # figures later rows reuse (P5 uses P1's)
    socket_v2: str | None = None  # the format-2 root's own daemon (P1's format-2 cells)
    source_label_v2: str = "origin mmap"

    def root_of(self, version: int) -> str:
        return self.prep.shards_v2 if version == 2 else self.prep.shards

    def socket_of(self, version: int) -> str | None:
        return self.socket_v2 if version == 2 else self.socket

    def label_of(self, version: int) -> str:
        return self.source_label_v2 if version == 2 else self.source_label

    def make_loader(self, version: int, *, workers: int, rgb: bool, socket: str | None | bool = True):
        """LoongForge's loader of either format as the trainer builds it; socket=True: the hot daemon."""
        from loongforge.benchmarks.loader import fast_path as lf

        sock = self.socket_of(version) if socket is True else socket
        if version == 2:
            return lf.make_loader_v2(self.prep.shards_v2, self.cfg, workers=workers, socket=sock, rgb=rgb)
        return lf.make_loader(self.prep.shards, self.prep.index, self.cfg, workers=workers, socket=sock, rgb=rgb)

    def baseline_dataset(self, backend: str = "pyav", gop: int | None = None) -> LeRobotVideoDataset:
        cams = tuple(f"observation.images.{c}" for c in self.cfg.cameras)
        root = self.prep.gop_datasets.get(gop, self.prep.dataset) if gop is not None else self.prep.dataset
        return LeRobotVideoDataset(root, list(self.prep.windows), backend=backend,
                                   action_horizon=self.prep.index.dataset.action_horizon, cameras=cams)

    def window_params(self, version: int = 1) -> dict:
        ds = self.prep.index.dataset
        samples = self.prep.index.num_samples
        if version == 2 and "v2_shape" in self.measured:  # format 2's sample count (± a tail window an episode)
            samples = self.measured["v2_shape"][0]
        return {"frames_per_sample": ds.frames_per_sample, "cameras": list(ds.slots),
                "resolution": [ds.height, ds.width], "batch_size": self.cfg.batch_size,
                "samples": samples, "gop": self.cfg.gop}

    def p1_params(self, gop: int, workers: int) -> dict:
        """What every P1 row of one (GOP, workers) cell shares, so rows compare like with like."""
        return {**self.window_params(), "gop": gop, "workers": workers, "baseline_batches": self.cfg.baseline_batches,
                "ours_batches": self.cfg.ours_batches, "warmup_batches": self.cfg.warmup_batches,
                "repeats": self.cfg.repeats, "ours_source": self.source_label,
                "ours_shards_from_gop": self.cfg.gop, "pinned_cores": self.cfg.pin_cores}
