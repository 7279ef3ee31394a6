"""One rank of test_the_step_reads_nothing_back_from_the_device: a real training run (the trainer's entry
point, ARGV[2:] its flags) with torch.Tensor's host reads wrapped; writes to ARGV[1] every such read that
the project's own code makes while a step runs (Trainer._one_step), and how many reads the late log
writes made (Trainer._write_record). On CUDA each of those reads waits for the GPU: a host sync."""

import json
import os
import sys

import torch

from loongforge.train import launch, trainer

READS = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(trainer.__file__)))
# The trainer's code, not DeepSpeed's or torch's (their own syncs are theirs), nor the data path's: the
# loader works on host buffers (decode, the CPU colour conversion) and copies them to the GPU without
# blocking, so a read there is of host memory, never a wait for the GPU.
OURS = tuple(os.path.join(CHECKOUT, d) + os.sep for d in ("train", "shared", "benchmarks", "loongforge"))
DATA = os.path.join(CHECKOUT, "train", "data") + os.sep
state = {"where": None, "in_step": [], "in_log": 0}


def _wrap(name):
    orig = getattr(torch.Tensor, name)

    def read(self, *a, **kw):
        caller = sys._getframe(1)
        path = caller.f_code.co_filename
        if state["where"] and path.startswith(OURS) and not path.startswith(DATA):
            if state["where"] == "step":
                state["in_step"].append(f"{os.path.relpath(path, CHECKOUT)}:{caller.f_lineno} "
                                        f"{caller.f_code.co_name}: .{name}")
            else:
                state["in_log"] += 1
        return orig(self, *a, **kw)

    setattr(torch.Tensor, name, read)


def _region(fn, where):
    def wrapped(*a, **kw):
        outer, state["where"] = state["where"], where
        try:
            return fn(*a, **kw)
        finally:
            state["where"] = outer

    return wrapped


for _name in READS:
    _wrap(_name)
trainer.Trainer._one_step = _region(trainer.Trainer._one_step, "step")
trainer.Trainer._write_record = _region(trainer.Trainer._write_record, "log")
_exit_now = launch.exit_now


def _report_then_exit(code):  # the entry point leaves with os._exit
    with open(sys.argv[1], "w") as f:
        json.dump(state, f)
    _exit_now(code)


launch.exit_now = _report_then_exit
launch.main(sys.argv[2:])
