"""What a rank tells the cache daemon about its future reads (narrow unit test:
a recording announcer stands in for the CacheClient)."""

from loongforge.train.data import order_v1 as order
from loongforge.train.data.loader_v1 import ANNOUNCE_BATCHES, ShardLoader


class Recorder:
    def __init__(self):
        self.calls = []

    def announce(self, shards, *, rank, epoch):
        self.calls.append((epoch, list(shards)))


def test_rank_announces_whole_epoch_then_next_near_its_end(synthetic_root):
    root, index = synthetic_root
    loader = ShardLoader(root, batch_size=2, rank=1, world=2, seed=3, shuffle_window=4)
    loader._announcer = rec = Recorder()
    steps = loader.plan.steps
    seen = []  # (step, epoch) at which each announce happened
    for step, (meta, _, items) in enumerate(loader._plans()):
        seen += [(step, meta["epoch"])] * (len(rec.calls) - len(seen))
        if step == 2 * steps - 1:
            break
    epochs = [e for e, _ in rec.calls]
    assert epochs == [0, 1, 2], "each epoch's plan sent once"
    names = [s.name for s in index.shards]
    for epoch, shards in rec.calls:
        seq = order.epoch_sequence([s.samples for s in index.shards], 3, epoch, 4)
        mine = [int(g) for c in range(0, steps * 2, 2) for g in order.rank_batch(seq, c, 2, 1, 2)]
        first_use = list(dict.fromkeys(names[index.locate(g)[0]] for g in mine))
        assert shards == first_use, f"epoch {epoch}: the whole epoch, in order of first use"
    # Epoch e+1 is announced while epoch e still runs, ANNOUNCE_BATCHES before its end.
    assert seen == [(0, 0), (steps - ANNOUNCE_BATCHES, 0), (2 * steps - ANNOUNCE_BATCHES, 1)]
    loader.close()
