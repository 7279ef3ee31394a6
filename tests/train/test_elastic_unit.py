"""The elastic supervisor's pure parts: the batch arithmetic and the argv it relaunches with."""

import pytest

from loongforge.shared.errors import ConfigError
from loongforge.train.elastic import accum_for, strip_flags


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
