"""parallel/comm.py's patched collectives count the time an ASYNC collective blocks in
wait(), not only its launch: ZeRO-3 gathers parameters with async_op=True and waits in
its fetch hook, so without this the transfer (or a late peer) lands in compute."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tests.train.parallel.dist_helpers import run_ranks

LATE_S = 0.4  # rank 1 joins the gather this much later: rank 0's wait() blocks on it


def _late_peer(rank: int, world: int) -> None:
    from loongforge.train.parallel import comm

    counter = comm.CommCounter()
    inp, out = torch.full((4,), float(rank)), torch.empty(4 * world)
    with comm.patch_torch_distributed(counter):
        if rank == 1:
            time.sleep(LATE_S)
        work = dist.all_gather_into_tensor(out, inp, async_op=True)  # how DeepSpeed's ZeRO-3 calls it
        launched = counter.seconds[("world", "all_gather_into_tensor")]
        work.wait()
    assert out.tolist() == [0.0] * 4 + [1.0] * 4
    assert counter.calls[("world", "all_gather_into_tensor")] == 1  # the wait adds time, not a call
    if rank == 0:  # launched at once, then blocked on the late peer
        waited = counter.seconds[("world", "all_gather_into_tensor")]
        assert launched < LATE_S / 2 and waited >= LATE_S / 2, (launched, waited)


def test_async_collective_wait_is_counted_as_communication():
    run_ranks(_late_peer, 2, timeout=120)
