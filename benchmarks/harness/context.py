"""What every row needs: the config, the prepared inputs, where LoongForge
reads from, and figures one row measured that a later row reuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.data import Prepared
from loongforge.benchmarks.loader.baseline import LeRobotVideoDataset


@dataclass(slots=True)
class Context:
    cfg: BenchConfig
    prep: Prepared
    socket: str | None  # cache daemon socket; None = the origin (row notes say why)
    source_label: str
    measured: dict = field(default_factory=dict)  # figures later rows reuse (P5 uses P1's)

    def make_loader(self, *, workers: int, rgb: bool, socket: str | None | bool = True):
        """LoongForge's loader as the trainer builds it; socket=True: the hot daemon."""
        from loongforge.benchmarks.loader import fast_path as lf

        return lf.make_loader(self.prep.shards, self.cfg, workers=workers, rgb=rgb,
                              socket=self.socket if socket is True else socket)

    def baseline_dataset(self, backend: str = "pyav", gop: int | None = None) -> LeRobotVideoDataset:
        cams = tuple(f"observation.images.{c}" for c in self.cfg.cameras)
        root = self.prep.gop_datasets.get(gop, self.prep.dataset) if gop is not None else self.prep.dataset
        return LeRobotVideoDataset(root, list(self.prep.windows), backend=backend,
                                   action_horizon=self.prep.info.action_horizon, cameras=cams)

    def window_params(self) -> dict:
        info = self.prep.info
        return {"frames_per_sample": info.frames_per_sample, "stride": self.cfg.stride, "cameras": list(info.slots),
                "resolution": [info.height, info.width], "batch_size": self.cfg.batch_size,
                "samples": self.prep.num_samples, "gop": self.cfg.gop, "block_frames": self.cfg.block_frames}

    def p1_params(self, gop: int, workers: int) -> dict:
        """What every P1 row of one (GOP, workers) cell shares, so rows compare like with like."""
        return {**self.window_params(), "gop": gop, "workers": workers, "baseline_batches": self.cfg.baseline_batches,
                "ours_batches": self.cfg.ours_batches, "warmup_batches": self.cfg.warmup_batches,
                "repeats": self.cfg.repeats, "ours_source": self.source_label,
                "ours_shards_from_gop": self.cfg.gop, "pinned_cores": self.cfg.pin_cores}
