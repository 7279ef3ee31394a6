"""Each Beam transform of the job, run on Beam's local runner (TestPipeline)."""

from __future__ import annotations

import io
import tarfile

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to

from loongforge.preprocess.stages.timing import FrameTiming
from loongforge.preprocess.stages.convert import FAILED, STAGED, STATS, ConvertEpisodeFn, ConvertParams, select_tag
from loongforge.preprocess.stages.discover import discover
from loongforge.preprocess.stages.finalize import JobResultsFn
from loongforge.preprocess.stages.pack import ShardPlan, StagedEpisode, WriteShardFn, WriteShards, place_episodes
from loongforge.preprocess.stages.stats import Moments, episode_moments, norm_stats
from loongforge.shared import paths
from loongforge.shared.blocks import EpisodeLayout
from loongforge.shared.members import END_OF_ARCHIVE


def pipeline() -> test_pipeline.TestPipeline:
    # FnApiRunner in-process: Beam's default DirectRunner would try to fetch Prism.
    return test_pipeline.TestPipeline(options=PipelineOptions(["--runner=FnApiRunner", "--direct_running_mode=in_memory"]))


def params(output, **kw) -> ConvertParams:
    base = dict(output=str(output), height=64, width=64, resize_mode="resize", zstd_level=3,
                slots=("ego_view", "wrist_view"), block_frames=4)
    return ConvertParams(**{**base, **kw})


def test_convert_episode_fn_stages_episodes_and_tags_failures(quirky_dataset, tmp_path):
    """One main output of (tag, value) pairs, split by filters: runners that do not split a
    ParDo's tagged outputs (Dask's) run it unchanged."""
    meta, episodes = discover(quirky_dataset)
    lengths = {e.index: e.length for e in episodes}
    with pipeline() as p:
        fail = FrameTiming(mismatch="fail")  # the short video's episode fails (the default clamps its last rows)
        out = p | beam.Create(episodes) | beam.ParDo(ConvertEpisodeFn(meta, params(tmp_path, timing=fail)))
        layouts = out | "Staged" >> beam.FlatMap(select_tag, STAGED) | "Layouts" >> beam.Map(
            lambda e: (e.episode, e.layout.num_frames, [len(c) for c in e.layout.blocks]))
        want = [(ep, lengths[ep], [-(-lengths[ep] // 4)] * 2) for ep in (0, 2)]  # 1 = corrupt video, 3 = mismatch
        assert_that(layouts, equal_to(want), label="CheckLayouts")
        reasons = out | "Failed" >> beam.FlatMap(select_tag, FAILED) | "Reasons" >> beam.Map(
            lambda r: (r["episode"], r["camera"], "unreadable" in r["reason"] or "has no frame within" in r["reason"]))
        assert_that(reasons, equal_to([(1, "observation.images.ego_view", True),
                                       (3, "observation.images.ego_view", True)]), label="CheckFailed")
        counts = (out | "Stats" >> beam.FlatMap(select_tag, STATS)
                  | "Counts" >> beam.Map(lambda e: (e[0], e[1]["state"].count)))
        assert_that(counts, equal_to([(0, lengths[0]), (2, lengths[2])]), label="CheckStats")
    staged = sorted(f for f in (tmp_path / "_staging").iterdir() if f.suffix == ".bin")
    assert [f.name for f in staged] == ["episode_000000.bin", "episode_000002.bin"]
    # Failed episodes leave a marker (the local runner's progress line counts both kinds).
    assert sorted(f.name for f in (tmp_path / "_staging").glob("*.failed")) == [
        "episode_000001.failed", "episode_000003.failed"]
    # A staging file is the episode's fragment: a plain tar once terminated, arrays then blocks.
    with tarfile.open(fileobj=io.BytesIO(staged[0].read_bytes() + END_OF_ARCHIVE)) as tar:
        names = tar.getnames()
    blocks = -(-lengths[0] // 4)
    # `index`: the source's global frame index (LeRobot's column), an optional array (FORMAT.md); `col_*`: the
    # other columns of LeRobot's item (LeRobot's own task_index: the task_index array holds GR00T's task column)
    assert names[:9] == [f"e000000.{n}.npy" for n in ("action", "col_annotation_human_validity", "col_next_done",
                                                      "col_task_index", "frame_index", "index", "state",
                                                      "task_index", "timestamp")]
    assert names[9:] == [f"e000000_b{b:06d}.{c}.nv12.zst" for b in range(blocks) for c in ("ego_view", "wrist_view")]


def test_job_results_stats_equal_numpy_and_are_order_free(sample_dataset):
    _, episodes = discover(sample_dataset)
    tables = [pq.read_table(e.parquet) for e in episodes]
    states = [np.array(t.column("observation.state").to_pylist(), np.float32) for t in tables]
    actions = [np.array(t.column("action").to_pylist(), np.float32) for t in tables]
    parts = [(STATS, episode_moments(i, s, a)) for i, (s, a) in enumerate(zip(states, actions))]
    failed = [(FAILED, {"episode": 9, "camera": None, "reason": "x"})]
    with pipeline() as p:
        results = (p | beam.Create(parts[::-1] + failed) | beam.CombineGlobally(JobResultsFn()).without_defaults())
        stats = results | beam.Map(lambda r: norm_stats(r.moments))
        assert_that(stats | beam.Map(lambda s: sorted(s)), equal_to([["action", "state"]]), label="Names")
        assert_that(stats | "Count" >> beam.Map(lambda s: s["state"]["count"]),
                    equal_to([sum(len(s) for s in states)]), label="Count")
        assert_that(results | "Failed" >> beam.Map(lambda r: r.failed), equal_to([(failed[0][1],)]), label="Failed")
    allstate = np.concatenate(states).astype(np.float64)
    combined = JobResultsFn()

    def merged(order):
        accs = [combined.add_input(combined.create_accumulator(), part) for part in order]
        return norm_stats(combined.extract_output(combined.merge_accumulators(accs)).moments)

    out = merged(parts)
    np.testing.assert_allclose(out["state"]["mean"], allstate.mean(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out["state"]["std"], allstate.std(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(out["state"]["min"], allstate.min(0))
    np.testing.assert_array_equal(out["action"]["max"], np.concatenate(actions).astype(np.float64).max(0))
    assert merged(parts[::-1]) == out  # bit-identical whatever the arrival order


def _staged(ep: int, length: int, path="s") -> StagedEpisode:
    layout = EpisodeLayout(episode=ep, num_frames=4, length=length, arrays=(0, 512, 0), blocks=(((512, 0, 4, 0),),))
    return StagedEpisode(episode=ep, path=f"{path}{ep}", layout=layout, source_frames=4, source_bytes=1, videos=())


def test_shard_plan_is_greedy_sorted_and_size_bounded():
    staged = [_staged(2, 500), _staged(0, 900), _staged(3, 300), _staged(1, 5000)]
    places = dict(place_episodes([(s.episode, s.layout.length) for s in staged], shard_size=2200))
    assert places == {
        0: (0, 0),  # 1024 (end marker) + 900 fits, + 5000 would not
        1: (1, 0),  # an episode over the bound on its own gets its own shard
        2: (2, 0), 3: (2, 1),  # whole episodes, in episode order
    }


def test_write_shards_groups_each_shards_episodes_by_key(tmp_path, monkeypatch):
    """Each shard is one group (keyed by its number), its episodes in plan order: the writes
    spread over workers on any runner, not one task fanned out from the plan."""
    import loongforge.preprocess.stages.pack as pack

    def fake_write(output, number, fragments):
        return {"name": f"shard-{number}", "bytes": 1}, [layout for layout, _ in fragments]

    monkeypatch.setattr(pack, "write_shard", fake_write)
    monkeypatch.setattr(pack, "_fragment", lambda path: b"")
    staged = [_staged(2, 500), _staged(0, 900), _staged(3, 300), _staged(1, 5000)]
    with pipeline() as p:
        written = (p | beam.Create(staged) | WriteShards(str(tmp_path), 2200)
                   | beam.Map(lambda w: (w[0], [lay.episode for lay in w[2]])))
        assert_that(written, equal_to([(0, [0]), (1, [1]), (2, [2, 3])]))


def test_write_shard_fn_copies_staged_fragments(tmp_path):
    from loongforge.shared.blocks import encode_episode
    from loongforge.shared.synthetic import synthetic_episode
    from loongforge.shared.writer import write_shard

    items, frags = [], []
    for ep in (0, 1):
        path = tmp_path / f"episode_{ep:06d}.bin"
        with open(path, "wb") as f:
            layout = encode_episode(f, ep, *synthetic_episode(ep, 6, 8, 8, ("front",), 3, 2), slots=["front"],
                                    block_size=4)
        items.append((str(path), layout))
        frags.append((layout, path.read_bytes()))
    plan = ShardPlan(number=0, items=tuple(items))
    want_entry, want_placed = write_shard(str(tmp_path / "want"), 0, frags)
    out = tmp_path / "out"
    with pipeline() as p:
        written = p | beam.Create([plan]) | beam.ParDo(WriteShardFn(str(out)))
        assert_that(written, equal_to([(0, want_entry, tuple(want_placed))]))
    assert (out / paths.shard_name(0)).read_bytes() == (tmp_path / "want" / paths.shard_name(0)).read_bytes()
    assert want_placed[1].arrays[0] == items[0][1].length  # the second episode sits after the first


def test_moments_merge_matches_direct():
    rng = np.random.default_rng(0)
    a, b = rng.normal(5, 2, (30, 3)), rng.normal(-1, 1, (7, 3))
    merged = Moments.of(a).merge(Moments.of(b)).summary()
    both = np.concatenate([a, b])
    np.testing.assert_allclose(merged["mean"], both.mean(0))
    np.testing.assert_allclose(merged["std"], both.std(0))


def test_shard_plan_of_nothing_is_empty():
    assert list(place_episodes([], 1 << 16)) == []


def test_unexpected_decoder_error_is_a_failed_record_but_output_errors_raise(sample_dataset, tmp_path, monkeypatch):
    import loongforge.preprocess.stages.convert as convert

    meta, episodes = discover(sample_dataset)

    def broken(*args, **kwargs):
        raise RuntimeError("decoder exploded")

    with monkeypatch.context() as m:
        m.setattr(convert, "decode_nv12", broken)
        out = list(ConvertEpisodeFn(meta, params(tmp_path)).process(episodes[0]))
    assert len(out) == 1 and out[0][0] == FAILED
    assert out[0][1]["camera"] == "observation.images.ego_view"
    assert "RuntimeError: decoder exploded" in out[0][1]["reason"]
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the output root should be")
    with pytest.raises(OSError):  # disk full / unwritable output fails loudly, not as bad input
        list(ConvertEpisodeFn(meta, params(blocker)).process(episodes[0]))
