"""Block affinity of the decode pool (train/data/workers.py, DecodePool._pick): a batch goes to the worker
whose block cache most likely holds its blocks, unless that worker already has AFFINITY_DEPTH batches in
flight. Narrow: the choice alone, on a pool object without processes (the bench's output table measures
what it saves: block decodes per sample with 2 workers)."""

from collections import OrderedDict

from loongforge.train.data.workers import AFFINITY_DEPTH, DecodePool


def _pool(workers: int, blocks: int) -> DecodePool:
    pool = DecodePool.__new__(DecodePool)
    pool.num_workers, pool.affinity_blocks = workers, blocks
    pool._recent = [OrderedDict() for _ in range(workers)]
    pool._inflight = [0] * workers
    pool._next_worker = 0
    return pool


def _send(pool, keys) -> int:
    wid = pool._pick(keys)
    pool._inflight[wid] += 1
    return wid


def test_a_batch_follows_its_blocks_to_the_worker_that_decoded_them():
    pool = _pool(2, blocks=8)
    first = _send(pool, {("e0", 0), ("e1", 3)})
    other = _send(pool, {("e2", 0)})
    assert other != first  # no blocks in common: the least loaded worker
    assert _send(pool, {("e1", 3), ("e5", 1)}) == first  # shares a block with the first batch
    assert _send(pool, {("e2", 0)}) == other


def test_a_worker_with_a_full_queue_is_passed_over_whatever_its_blocks():
    pool = _pool(2, blocks=8)
    sent = [_send(pool, {("e0", 0), ("e0", 1)}) for _ in range(AFFINITY_DEPTH)]
    assert sent == [sent[0]] * AFFINITY_DEPTH
    assert _send(pool, {("e0", 0)}) != sent[0]  # its queue is full: the other worker, which now has e0/0 too
    pool._inflight[sent[0]] -= 1  # one of its batches came back
    assert _send(pool, {("e0", 1)}) == sent[0]


def test_the_model_forgets_blocks_past_the_cache_and_zero_means_least_loaded():
    pool = _pool(1, blocks=2)
    _send(pool, {("a", 0)})
    _send(pool, {("b", 0), ("b", 1)})  # two newer blocks push ("a", 0) out of the worker's modelled cache
    assert list(pool._recent[0]) == [("b", 0), ("b", 1)] or list(pool._recent[0]) == [("b", 1), ("b", 0)]
    plain = _pool(3, blocks=0)
    got = [_send(plain, {("a", 0)}) for _ in range(3)]
    assert sorted(got) == [0, 1, 2]  # no affinity: spread over the least loaded
