"""Run by the lerobot venv's Python (setup.sh), never imported by LoongForge: what the real
`lerobot.datasets.lerobot_dataset.LeRobotDataset(root, delta_timestamps=..., video_backend=...)`
returns for the given indices, saved as an npz LoongForge's side compares with
(benchmarks/loader/lerobot_parity.py).

    python dump_items.py --root DATASET --out items.npz [--deltas JSON] [--indices 0,5,9 | all]

npz keys: "indices"; per index i, "<i>/<key>" for every key of the item (tensors as numpy, strings
as numpy str), or "<i>/__error__" (the exception's type and first line) where LeRobot raised.
"""

import argparse
import json
import os
import sys

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local root: nothing to fetch


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--deltas", default="{}", help="delta_timestamps as JSON")
    p.add_argument("--indices", default="all")
    p.add_argument("--backend", default="pyav")
    p.add_argument("--tolerance-s", type=float, default=1e-4)
    args = p.parse_args(argv)
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    deltas = json.loads(args.deltas) or None
    ds = LeRobotDataset("local/parity", root=args.root, delta_timestamps=deltas, video_backend=args.backend,
                        tolerance_s=args.tolerance_s)
    indices = range(len(ds)) if args.indices == "all" else [int(i) for i in args.indices.split(",")]
    out = {"indices": np.asarray(list(indices), np.int64)}
    for i in indices:
        try:
            item = ds[i]
        except Exception as exc:  # noqa: BLE001 - LeRobot's FrameTimestampError and the like are results here
            out[f"{i}/__error__"] = np.str_(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            continue
        for key, value in item.items():
            out[f"{i}/{key}"] = np.str_(value) if isinstance(value, str) else value.numpy()
    np.savez(args.out, **out)
    import lerobot
    print(json.dumps({"items": len(out["indices"]), "lerobot": lerobot.__version__, "len": len(ds)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
