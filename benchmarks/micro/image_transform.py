"""N1.6's image transform on the training device: the composed weight matrices of
train/data/images.py (`device_images`: two matmuls per camera) against the torch-interpolate
path the processor ran before (letterbox pad, antialiased bilinear resize, crop gather, resize,
antialiased bicubic resize: approximate kernels), on the same batches, interleaved round by round.

    loongforge bench image-transform [--batch 32] [--cameras 96x128,112x84] [--rounds 7] [--device cpu]

Rows: images/s (wall clock) of eval (centred crop) and of training crops (a per-sample offset);
the matrix path's training crop + colour jitter is timed beside them (the old path had no jitter).
Input is normalized float RGB (B, 3, h, w) per camera, as the loader delivers it; the default
sizes are the GR00T N1.6 fixture's (a 96x128 and a portrait 112x84 wrist camera). The matrices
are built once per camera size before timing (they are cached for the run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from loongforge.train.data.images import Geometry, device_images, image_draws


def interpolate_images(x: torch.Tensor, geo: Geometry, oy: torch.Tensor | None, ox: torch.Tensor | None):
    """The previous processor path, for one camera: (N, 3, h, w) normalized -> (N, 3, H, W)."""
    h, w = x.shape[-2:]
    if h != w:
        side = max(h, w)
        top, left = (side - h) // 2, (side - w) // 2
        x = F.pad(x, (left, side - w - left, top, side - h - top), value=-1.0)
    e, n = geo.edge, geo.crop
    x = F.interpolate(x, size=(e, e), mode="bilinear", antialias=True, align_corners=False)
    if oy is None:
        x = x[..., geo.centre:geo.centre + n, geo.centre:geo.centre + n]
    else:
        ar = torch.arange(n, device=x.device)
        rows, cols = (oy[:, None] + ar)[:, :, None], (ox[:, None] + ar)[:, None, :]
        x = x[torch.arange(x.shape[0], device=x.device)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)
    x = F.interpolate(x, size=(e, e), mode="bilinear", antialias=True, align_corners=False)
    return F.interpolate(x, size=geo.size, mode="bicubic", antialias=True, align_corners=False)


def measure(batch: int, cameras: list[tuple[int, int]], rounds: int, device: torch.device) -> dict:
    """{path: median images/s} over `rounds` interleaved rounds, every camera of a batch per call."""
    geo, gen = Geometry(), torch.Generator().manual_seed(0)
    frames = [(torch.rand(batch, 3, h, w, generator=gen) * 2 - 1).to(device) for h, w in cameras]
    draws = image_draws(0, 0, np.arange(batch))
    ox, oy = (torch.from_numpy(a).to(device) for a in (draws.x0, draws.y0))
    units = (-1.0, 1.0)
    paths = {
        "interpolate eval": lambda x: interpolate_images(x, geo, None, None),
        "interpolate crop": lambda x: interpolate_images(x, geo, oy, ox),
        "matrix eval": lambda x: device_images(x, geo, units=units),
        "matrix crop": lambda x: device_images(x, geo, offsets=(ox, oy), units=units),
        "matrix crop + jitter": lambda x: device_images(x, geo, draws=draws, units=units),
    }
    got: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds + 1):  # round 0 warms up (and builds the cached matrices)
        for name, fn in paths.items():
            _sync(device)
            t = time.perf_counter()
            for x in frames:
                fn(x)
            _sync(device)
            if r:
                got[name].append(batch * len(frames) / (time.perf_counter() - t))
    return {name: statistics.median(v) for name, v in got.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # NOTE: the only host sync: a timed round ends with the device's work


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=32, help="images per camera per call (samples x frames)")
    p.add_argument("--cameras", default="96x128,112x84", help="camera sizes HxW, comma-separated")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cpu")


def handle(args: argparse.Namespace) -> int:
    cams = [tuple(int(v) for v in c.split("x")) for c in args.cameras.split(",")]
    rates = measure(args.batch, cams, args.rounds, torch.device(args.device))
    print(f"| path | images/s (batch {args.batch}, cameras {args.cameras}, {args.device}, median of {args.rounds}) |")
    print("|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} |")
    return 0
