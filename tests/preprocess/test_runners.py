"""The runner choice (short names, --dask-scheduler, Beam options passed through) and the job's
graph as a portable runner sees it: no tagged outputs, no side inputs, no defaulted global
combine, and on the Dask runner every per-episode and per-shard step spread over partitions."""

from __future__ import annotations

import argparse
import logging

import apache_beam as beam
import pytest

from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.stages.discover import discover
from loongforge.preprocess.runner.launch import beam_options
from loongforge.preprocess.pipeline import build_pipeline
from loongforge.preprocess.runner.choice import RUNNERS, RunnerConfig, add_runner_arguments, runner_from_args
from loongforge.shared.errors import ConfigError, RunnerError, SourceDataError

DASK = "apache_beam.runners.dask.dask_runner.DaskRunner"


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser()
    add_runner_arguments(parser)
    return parser.parse_known_args(argv)


@pytest.mark.parametrize("name, beam_name, kind", [
    ("local", "FnApiRunner", "local"), ("direct", "DirectRunner", "direct"), ("dask", DASK, "dask"),
    ("Dask", DASK, "dask"), ("DaskRunner", DASK, "dask"), ("dataflow", "DataflowRunner", "other"),
    ("flink", "FlinkRunner", "other"),
    ("spark", "SparkRunner", "other"), ("PortableRunner", "PortableRunner", "other"), (DASK, DASK, "dask")])
def test_short_runner_names_map_to_beams_and_others_pass_through(name, beam_name, kind):
    runner = RunnerConfig(name=name)
    assert (runner.beam_name, runner.kind) == (beam_name, kind)
    assert set(RUNNERS) == {"local", "direct", "dask", "dataflow", "flink", "spark"}


def test_runner_flags_also_come_among_the_beam_options():
    args, rest = _args(["--runner", "dask", "--dask-scheduler", "tcp://10.0.0.5:8786", "--dask_npartitions=3"])
    runner, beam_args = runner_from_args(args, rest)
    assert runner == RunnerConfig(name="dask", dask_scheduler="tcp://10.0.0.5:8786") and beam_args == [
        "--dask_npartitions=3"]
    args, _ = _args([])
    runner, beam_args = runner_from_args(args, ["--runner=dask", "--dask_client_address", "h:1", "--project=P"])
    assert runner == RunnerConfig(name="dask", dask_scheduler="h:1") and beam_args == ["--project=P"]
    assert runner_from_args(args, [])[0] == RunnerConfig()
    args, _ = _args(["--runner", "dask"])
    with pytest.raises(ConfigError, match="give one"):
        runner_from_args(args, ["--runner=DataflowRunner"])


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "local", "dask_scheduler": "tcp://h:8786"}, "only with --runner dask"),
    ({"name": "dask", "dask_scheduler": "h"}, "scheduler's address"),
    ({"name": "dask", "dask_scheduler": "tcp://h:port"}, "scheduler's address"),
    ({"name": " "}, "choose one of local, direct, dask")])
def test_bad_runner_choices_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RunnerConfig(**kwargs)
    assert RunnerConfig(name="dask", dask_scheduler="tcp://[::1]:8786").dask_scheduler == "tcp://[::1]:8786"


def test_dask_scheduler_without_the_dask_runner_is_one_line_exit_1(tmp_path, capsys):
    from loongforge.cli import main

    rc = main(["preprocess", "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--dask-scheduler",
               "tcp://127.0.0.1:8786"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "only with --runner dask" in err and len(err.splitlines()) == 1


def _cfg(tmp_path, **kw) -> PreprocessConfig:
    return PreprocessConfig(input=str(tmp_path / "in"), output=str(tmp_path / "out"), workers=3, **kw)


def test_dask_options_one_episode_per_task_and_no_unparseable_noise(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        opts = beam_options(_cfg(tmp_path), RunnerConfig(name="dask"), ["--dask_connection_timeout=7"], 40,
                            "tcp://127.0.0.1:8786").get_all_options()
    assert "Discarding unparseable args" not in caplog.text
    assert (opts["runner"], opts["address"], opts["timeout"], opts["partition_size"]) == (
        DASK, "tcp://127.0.0.1:8786", 7, 1)
    big = beam_options(_cfg(tmp_path), RunnerConfig(name="dask"), [], 10_000, "h:1").get_all_options()
    assert big["partition_size"] == 3  # a few episodes per task past 4096 tasks
    theirs = beam_options(_cfg(tmp_path), RunnerConfig(name="dask"), ["--dask_npartitions=5"], 40, "h:1")
    assert (theirs.get_all_options()["npartitions"], theirs.get_all_options()["partition_size"]) == (5, None)


def test_local_options_and_the_callers_own_flags_win(tmp_path):
    opts = beam_options(_cfg(tmp_path), RunnerConfig(), [], 4).get_all_options()
    assert (opts["runner"], opts["direct_num_workers"], opts["direct_running_mode"]) == (
        "FnApiRunner", 3, "multi_processing")
    opts = beam_options(_cfg(tmp_path), RunnerConfig(), ["--direct_running_mode=in_memory",
                                                         "--direct_num_workers=1"], 4).get_all_options()
    assert (opts["direct_num_workers"], opts["direct_running_mode"]) == (1, "in_memory")
    opts = beam_options(_cfg(tmp_path), RunnerConfig(name="dataflow"), ["--project=P"], 4).get_all_options()
    assert (opts["runner"], opts["project"], opts["direct_num_workers"]) == ("DataflowRunner", "P", 1)


def _graph(sample_dataset, tmp_path, runner: RunnerConfig, address: str = ""):
    cfg = PreprocessConfig(input=sample_dataset, output=str(tmp_path / "out"), shard_size=1 << 16)
    meta, episodes = discover(sample_dataset)
    options = beam_options(cfg, runner, [], len(episodes), address)
    p = beam.Pipeline(options=options)
    build_pipeline(p, cfg, meta, episodes)
    return p, options, episodes


class _Leaves(beam.pipeline.PipelineVisitor):
    def __init__(self):
        self.leaves = []

    def visit_transform(self, node):
        self.leaves.append(node)


def test_graph_has_no_tagged_outputs_and_no_side_inputs(sample_dataset, tmp_path):
    """What a portable runner may not implement: a ParDo's tagged outputs split for it (Dask's
    runner hands every consumer all of them), side inputs (Dask's computes each one on its own:
    every episode converted once per side input), a global combine's default (a side input too)."""
    p, _, _ = _graph(sample_dataset, tmp_path, RunnerConfig())
    visitor = _Leaves()
    p.visit(visitor)
    assert [n.full_label for n in visitor.leaves if n.side_inputs] == []
    assert [n.full_label for n in visitor.leaves if len(n.outputs) > 1] == []
    assert sum(n.full_label == "ConvertEpisodes" for n in visitor.leaves) == 1


def test_dask_runner_spreads_episodes_and_shards_over_tasks(sample_dataset, tmp_path):
    """The graph as the Dask runner builds it (dask bags; nothing runs): one partition (task) per
    episode for the conversion, and the shard writes in as many partitions as the shard groups'
    shuffle has, not one; the last step, finalize, is what the runner computes."""
    from apache_beam.runners.dask.dask_runner import DaskOptions, DaskRunner
    from apache_beam.runners.dask.overrides import dask_overrides

    p, options, episodes = _graph(sample_dataset, tmp_path, RunnerConfig(name="dask"), "tcp://127.0.0.1:1")
    p.replace_all(dask_overrides())
    dask_options = options.view_as(DaskOptions).get_all_options(drop_default=True, current_only=True)
    visitor = DaskRunner.to_dask_bag_visitor(DaskOptions._extract_bag_kwargs(dask_options))
    p.visit(visitor)
    bags = {node.full_label: bag for node, bag in visitor.bags.items()}
    assert bags["ConvertEpisodes"].npartitions == len(episodes) == 3
    assert bags["WriteShards/WriteShard"].npartitions >= len(episodes)
    assert list(bags)[-1] == "WriteIndex"  # the runner computes the last step: everything leads to it


def test_unreachable_scheduler_fails_before_the_output_is_touched(sample_dataset, tmp_path, monkeypatch):
    import loongforge.preprocess.runner.dask_job as dask_job
    from loongforge.preprocess.pipeline import run_job
    from tests.conftest import free_port

    monkeypatch.setattr(dask_job, "CONNECT_TIMEOUT_S", 1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "index.json").write_text("{}")  # a previous run's root stays published
    address = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(RunnerError, match=f"cannot reach the dask scheduler at {address}"):
        run_job(PreprocessConfig(input=sample_dataset, output=str(out)), [],
                RunnerConfig(name="dask", dask_scheduler=address))
    assert (out / "index.json").read_text() == "{}"


def test_a_dataset_without_episodes_is_refused_not_published_empty(tmp_path, run_in_memory):
    from loongforge.preprocess.samples.dataset import generate_dataset

    root = generate_dataset(tmp_path / "ds", episodes=1, frames=(4, 4), gop=2)
    (root / "meta" / "episodes.jsonl").write_text("")
    with pytest.raises(SourceDataError, match="no episodes"):
        run_in_memory(str(root), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_direct_runner_writes_the_local_runners_bytes(sample_dataset, tmp_path, run_in_memory):
    from loongforge.preprocess.pipeline import run_job
    from tests.preprocess.conftest import tree

    run_in_memory(sample_dataset, str(tmp_path / "local"), shard_size=1 << 16)
    run_job(PreprocessConfig(input=sample_dataset, output=str(tmp_path / "direct"), shard_size=1 << 16, workers=1),
            [], RunnerConfig(name="direct"))
    want, got = tree(str(tmp_path / "local")), tree(str(tmp_path / "direct"))
    assert sorted(got) == sorted(want) and [n for n in got if got[n] != want[n]] == []
