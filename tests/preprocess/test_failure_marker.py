"""A failed episode whose failure marker cannot be written is still a counted, recorded failure,
and the lost marker is a WARNING naming the episode (it was a DEBUG line)."""

import logging
from types import SimpleNamespace

from loongforge.preprocess.stages.convert import FAILED, ConvertEpisodeFn


def test_unwritable_failure_marker_is_warned(tmp_path, caplog):
    blocker = tmp_path / "out"
    blocker.write_text("a file where the output folder should be")  # every write under it fails
    fn = ConvertEpisodeFn.__new__(ConvertEpisodeFn)  # narrow: only what _fail reads
    fn.failed = SimpleNamespace(inc=lambda: None)
    fn.meta, fn.params, fn.progress_topic = SimpleNamespace(uri="src://x"), SimpleNamespace(output=str(blocker)), ""
    with caplog.at_level(logging.WARNING, logger="loongforge.preprocess.stages.convert"):
        tag, record = fn._fail(SimpleNamespace(index=7), "front", ValueError("bad frame"))
    assert tag == FAILED and record["reason"]
    lost = [r.getMessage() for r in caplog.records if "failure marker" in r.getMessage()]
    assert len(lost) == 1 and lost[0].startswith("episode 7: could not write its failure marker")
