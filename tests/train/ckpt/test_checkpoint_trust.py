"""DeepSpeed's load_checkpoint calls torch.load(weights_only=False); ours runs it
inside `weights_only_loads`, which must refuse code-carrying pickles and still
accept the DeepSpeed value types real checkpoints hold."""

import pickle

import pytest
import torch

from loongforge.train.ckpt.files import weights_only_loads


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_code_carrying_pickle_is_refused(tmp_path, capsys):
    path = tmp_path / "optim_states.pt"
    torch.save({"state": Evil()}, path)
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(path, weights_only=False)  # what DeepSpeed passes
    assert "pwned" not in capsys.readouterr().out
    # Outside the guard the same call would run it: the guard is what stops it.
    torch.load(path, weights_only=False)
    assert "pwned" in capsys.readouterr().out


def test_deepspeed_value_types_still_load(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = tmp_path / "zero_states.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients,
                "w": torch.ones(3)}, path)
    with weights_only_loads():
        state = torch.load(path, weights_only=False)
    assert state["zero_stage"] == ZeroStageEnum.gradients and state["w"].sum() == 3
