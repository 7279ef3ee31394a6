"""The same intra-op thread count on every launch path, so that a layout's numerics do not depend on
the launcher that started it.

torchrun sets OMP_NUM_THREADS=1 for its workers only when --nproc-per-node > 1 and the variable is
unset; the deepspeed launcher and a plain process leave it unset, and torch then uses one thread per
core. CPU kernels split their reductions by thread, so 2 nodes x 1 rank (torchrun leaves the
variable unset) trained other weights than 1 node x 2 ranks (torchrun sets 1): up to 3e-4 apart
after 120 steps. Each rank therefore sets its intra-op threads itself, before any tensor work:

    OMP_NUM_THREADS if set (torchrun's 1, or the user's value on any path), else 1

and exports the value (OMP_NUM_THREADS, MKL_NUM_THREADS) to its decode workers. The elastic
supervisor passes the user's OMP_NUM_THREADS (or 1) to torchrun explicitly, so torchrun decides
nothing. Inter-op threads do not change results and are left alone.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
DEFAULT_THREADS = 1  # torchrun's own default for several ranks per node


def intra_op_threads(env=None) -> int:
    env = os.environ if env is None else env
    try:
        return max(1, int(env.get("OMP_NUM_THREADS") or DEFAULT_THREADS))
    except ValueError:
        return DEFAULT_THREADS


def pin_threads() -> int:
    """Set this rank's intra-op threads (see the module docstring); returns the count."""
    import torch  # heavy: launch_env serves the elastic supervisor, which never imports torch

    n = intra_op_threads()
    for var in THREAD_VARS:
        os.environ[var] = str(n)
    torch.set_num_threads(n)
    if os.environ.get("RANK", "0") == "0":
        log.info("intra-op threads: %d per rank (OMP_NUM_THREADS; 1 when unset, on every launch path)", n)
    return n


def launch_env(env: dict) -> dict:
    """What the supervisor passes to torchrun: the thread count decided here, not by torchrun."""
    n = intra_op_threads(env)
    return {**env, **{var: str(n) for var in THREAD_VARS}}
