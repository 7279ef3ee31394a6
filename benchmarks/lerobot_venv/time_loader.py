"""Run by the lerobot venv's Python (setup.sh), never imported by LoongForge: samples/s of the real
lerobot 0.6.1 as users run it, `torch.utils.data.DataLoader(LeRobotDataset(root, delta_timestamps=...,
video_backend=B), batch_size, shuffle=True, num_workers=N)`, timed over full batches after one
warm-up batch for at least `--seconds` (benchmarks/loader/lerobot_baseline.py --lerobot-venv).
Prints one JSON line: {"samples_per_s", "batches", "seconds"} or {"error": "..."}.

    python time_loader.py --root DATASET --deltas JSON --workers 2 --batch-size 32 --seconds 20 --backend pyav
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local root: nothing to fetch


def _endless(loader):
    while True:
        yield from loader


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--deltas", default="{}")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--backend", default="pyav")
    args = p.parse_args(argv)
    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    torch.set_num_threads(1)  # as LoongForge's pass: the pinned cores are the budget
    try:
        ds = LeRobotDataset("local/bench", root=args.root, delta_timestamps=json.loads(args.deltas) or None,
                            video_backend=args.backend)
        loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True,
                                             num_workers=args.workers, drop_last=True,
                                             generator=torch.Generator().manual_seed(0),
                                             persistent_workers=args.workers > 0)
        batches = _endless(loader)
        next(batches)
        n, t0 = 0, time.perf_counter()
        while True:
            next(batches)
            n += 1
            took = time.perf_counter() - t0
            if took >= args.seconds:
                break
    except Exception as exc:  # noqa: BLE001 - a backend that does not run here is a result (torchcodec)
        print(json.dumps({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}))
        return 0
    print(json.dumps({"samples_per_s": n * args.batch_size / took, "batches": n, "seconds": round(took, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
