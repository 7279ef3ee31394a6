"""A small in-test stand-in for shared/dataset_v2.DatasetV2 (until the real one is merged):
the same read API over arrays in one .npz, so worker processes can open it by path."""

from __future__ import annotations

import json
import os

import numpy as np

from loongforge.shared.errors import IntegrityError
from loongforge.shared.index import CameraInfo, DatasetInfo


def write_fake(root: str, lengths, *, block_size=4, h=8, w=8, cameras=("front", "wrist"), state_dim=3,
               action_dim=2, val=(), corrupt=()):
    os.makedirs(root, exist_ok=True)
    arrays = {"lengths": np.asarray(lengths, np.int64)}
    for e, n in enumerate(lengths):
        for c, cam in enumerate(cameras):
            fr = np.zeros((n, h * 3 // 2, w), np.uint8)
            fr[:, 0, 0] = e  # frame identity readable from the pixels
            fr[:, 0, 1] = np.arange(n) % 256
            fr[:, 0, 2] = c
            arrays[f"f{e}_{cam}"] = fr
        arrays[f"s{e}"] = (e * 1000 + np.arange(n)[:, None] + np.zeros((1, state_dim))).astype(np.float32)
        arrays[f"a{e}"] = (e * 1000 + np.arange(n)[:, None] + np.zeros((1, action_dim))).astype(np.float32)
        arrays[f"k{e}"] = np.full(n, e % 2, np.int64)
    np.savez(os.path.join(root, "fake.npz"), **arrays)
    with open(os.path.join(root, "fake.json"), "w") as f:
        json.dump({"block_size": block_size, "h": h, "w": w, "cameras": list(cameras), "state_dim": state_dim,
                   "action_dim": action_dim, "val": list(val), "corrupt": [list(c) for c in corrupt]}, f)
    return open_fake(root)


class FakeV2:
    def __init__(self, root):
        self.meta = json.load(open(os.path.join(root, "fake.json")))
        self.npz = dict(np.load(os.path.join(root, "fake.npz")))
        m = self.meta
        self.block_size = m["block_size"]
        self.episode_lengths = self.npz["lengths"]
        self.num_episodes = len(self.episode_lengths)
        self.dataset = DatasetInfo(
            fps=20.0, height=m["h"], width=m["w"],
            cameras=tuple(CameraInfo(key=f"observation.images.{c}", slot=c, source_height=m["h"], source_width=m["w"])
                          for c in m["cameras"]),
            state_dim=m["state_dim"], action_dim=m["action_dim"],
            stats={"state": {"mean": [0.0] * m["state_dim"], "std": [1.0] * m["state_dim"]},
                   "action": {"mean": [0.0] * m["action_dim"], "std": [1.0] * m["action_dim"]}},
            tasks={"0": "pick", "1": "place"})
        self.block_reads = 0

    def block_of(self, t):
        return t // self.block_size, t % self.block_size

    def read_block(self, e, camera, b):
        if [e, camera, b] in self.meta["corrupt"]:
            raise IntegrityError(f"episode {e} {camera} block {b}: xxh3 mismatch")
        self.block_reads += 1
        B = self.block_size
        return self.npz[f"f{e}_{camera}"][b * B:(b + 1) * B].copy()

    def read_arrays(self, e):
        n = int(self.episode_lengths[e])
        return {"state": self.npz[f"s{e}"], "action": self.npz[f"a{e}"], "timestamp": np.arange(n) / 20.0,
                "task_index": self.npz[f"k{e}"]}

    def split(self, e):
        return "val" if e in self.meta["val"] else "train"


def open_fake(root):
    return FakeV2(root)
