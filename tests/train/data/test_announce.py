"""What a rank tells the cache daemon about its future reads (narrow unit test:
a recording announcer stands in for the CacheClient)."""

import numpy as np

from loongforge.shared.dataset import open_root
from loongforge.train.data.loader import ANNOUNCE_BATCHES, BlockLoader


class Recorder:
    def __init__(self):
        self.calls = []

    def announce(self, shards, *, rank, epoch):
        self.calls.append((epoch, list(shards)))


def test_rank_announces_whole_epoch_then_next_near_its_end(synthetic_root):
    root, index = synthetic_root
    loader = BlockLoader(root, batch_size=4, rank=1, world=2, seed=3, block_run=2, block_window=32)
    loader._announcer = rec = Recorder()
    steps = loader.plan.steps
    assert steps > ANNOUNCE_BATCHES + 1
    seen = []  # (step, epoch) at which each announce happened
    for step, (meta, items) in enumerate(loader.plans()):
        seen += [(step, meta["epoch"])] * (len(rec.calls) - len(seen))
        if step == 2 * steps - 1:
            break
    epochs = [e for e, _ in rec.calls]
    assert epochs == [0, 1, 2], "each epoch's plan sent once"
    ds = open_root(root)
    shard_of = np.asarray(ds.tables["episode_shard"])
    names = [s.name for s in index.shards]
    for epoch, shards in rec.calls:
        order = loader.epoch_order(epoch)
        mine = np.concatenate([order.rank_ids(c, 4, 1, 2) for c in range(0, steps * 4, 4)])
        eps, _ = loader.table.locate(mine)
        first_use = list(dict.fromkeys(names[int(shard_of[e])] for e in eps))
        assert shards == first_use, f"epoch {epoch}: the whole epoch, in order of first use"
    # Epoch e+1 is announced while epoch e still runs, ANNOUNCE_BATCHES before its end.
    assert seen == [(0, 0), (steps - ANNOUNCE_BATCHES, 0), (2 * steps - ANNOUNCE_BATCHES, 1)]
    loader.close()
