"""The elastic supervisor's pure parts: the batch arithmetic and the argv it relaunches with."""

import pytest

from loongforge.shared.errors import ConfigError
from loongforge.train.resilience.elastic import accum_for, strip_flags


def test_accum_keeps_the_global_batch_and_bounds_the_micro_batch():
    assert accum_for(8, 2, max_micro=4) == 1  # the full layout: micro 4
    assert accum_for(8, 1, max_micro=4) == 2  # one rank left: micro 4, accumulated twice
    assert accum_for(12, 3, max_micro=2) == 2
    with pytest.raises(ConfigError, match="cannot be split over 3 ranks"):
        accum_for(8, 3, max_micro=4)


def test_strip_flags_removes_what_the_supervisor_sets_and_keeps_the_rest():
    argv = ["--elastic", "--min-ranks", "1", "--max-ranks=2", "--data", "D", "--grad-accum", "2", "--resume",
            "--capacity-file", "F", "--steps", "9"]
    assert strip_flags(argv) == ["--data", "D", "--steps", "9"]


def test_which_layout_changes_the_supervisor_converts_before_a_relaunch():
    from loongforge.train.resilience.elastic import _tag_step
    from loongforge.train.resilience.elastic_reshard import needs_conversion

    z2 = {"world": 2, "zero_stage": 2}
    assert needs_conversion(z2, world=1, zero=2, tp=1, sp=1)  # ZeRO-1/2: partitioned Adam state
    assert not needs_conversion(z2, world=2, zero=2, tp=1, sp=1)  # same layout
    assert not needs_conversion({"world": 2, "zero_stage": 0}, world=1, zero=0, tp=1, sp=1)  # replicated
    assert not needs_conversion({"world": 2, "zero_stage": 3}, world=1, zero=3, tp=1, sp=1)  # trainer: universal
    assert needs_conversion({"world": 2, "zero_stage": 3}, world=1, zero=3, tp=1, sp=1, topk=True)  # hybrid
    assert _tag_step("step00000004") == 4 and _tag_step("step00000004_w1z2t1") == 4


def test_a_failed_conversion_warns_and_leaves_latest_on_the_original(tmp_path, caplog):
    """The converter's child fails on a checkpoint that verifies but is no DeepSpeed checkpoint: one WARNING,
    `latest` untouched, no new tag or work directory left, and the record says why."""
    import json
    import logging
    import os

    from loongforge.train.ckpt.files import SIDECAR
    from loongforge.train.ckpt.reshard_io import publish
    from loongforge.train.resilience.elastic_reshard import convert_for_launch

    root = tmp_path / "run" / "checkpoints"
    out = root / ".staging"
    out.mkdir(parents=True)
    (out / "mp_rank_00_model_states.pt").write_bytes(b"not a torch file")
    publish(str(root), str(out), "step00000004", {"format": "loongforge-checkpoint", "format_version": 2,
                                                  "step": 4, "world": 2, "zero_stage": 2, "loader": {}})
    before = sorted(os.listdir(root))
    with caplog.at_level(logging.WARNING, logger="loongforge.train.resilience.elastic_reshard"):
        rec = convert_for_launch(str(tmp_path / "run"), world=1, zero=2, timeout_s=300)
    assert rec["action"] == "reshard" and rec["ok"] is False and rec["from_tag"] == "step00000004", rec
    assert (root / "latest").read_text() == "step00000004" and sorted(os.listdir(root)) == before
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warn and "failed, resuming it as it is" in warn[0] and rec["error"][:40] in warn[0]
    assert json.loads((root / "step00000004" / SIDECAR).read_text())["world"] == 2
