"""raise_unless_rank0_ok (train/ckpt/fallback.py): the one "rank 0 did it alone, every rank learns
the outcome" step of the delta restore and the universal conversion. Without a process group
(these tests) it is the single-rank path; the 2-rank path runs in the resume tests."""

import pytest

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt import delta as ckpt_delta
from loongforge.train.ckpt.fallback import raise_unless_rank0_ok


def test_success_and_the_error_messages():
    assert raise_unless_rank0_ok("", device="cpu", failed="x failed", hint="do y") is None
    with pytest.raises(CheckpointError) as exc:
        raise_unless_rank0_ok("OSError: boom", device="cpu", failed="x failed", hint="do y")
    assert str(exc.value) == "x failed: OSError: boom; do y"


def test_delta_restore_failure_on_rank0_names_the_tag_the_base_and_the_fix(tmp_path):
    with pytest.raises(CheckpointError) as exc:
        ckpt_delta.restore_deltas(str(tmp_path), "step00000004", ["step00000002"], rank=0, device="cpu")
    msg = str(exc.value)
    assert msg.startswith("restoring delta checkpoint step00000004 from its base ['step00000002'] failed: "
                          "CheckpointError: ")
    assert msg.endswith("; point `latest` at the base (a full save)")
    # Other ranks do no work and, with no process group, see no failure.
    assert ckpt_delta.restore_deltas(str(tmp_path), "step00000004", ["step00000002"], rank=1,
                                     device="cpu") == "step00000004_restored"
