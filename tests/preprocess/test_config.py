import pytest

from loongforge.preprocess.config import PreprocessConfig, parse_size
from loongforge.shared.errors import ConfigError


@pytest.mark.parametrize("text,want", [("64MB", 64 * 10**6), ("64MiB", 64 << 20), ("512k", 512_000),
                                       ("1GiB", 1 << 30), ("1000", 1000), (4096, 4096), ("1.5MiB", 3 << 19)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "12XB", "-1MB", "MB"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("kw,field", [
    ({"action_horizon": 0}, "action_horizon"),
    ({"height": 64}, "height and width"),
    ({"height": 63, "width": 64}, "height"),
    ({"resize_mode": "stretch"}, "resize_mode"),
    ({"shard_size": 100}, "shard_size"),
    ({"zstd_level": 0}, "zstd_level"),
    ({"output": "in"}, "output must differ"),
    ({"block_frames": 0}, "block_frames"),
    ({"block_codec": "lz4"}, "block_codec"),
])
def test_config_rejects_with_field_name(kw, field):
    with pytest.raises(ConfigError, match=field):
        PreprocessConfig(**{"input": "in", "output": "out", **kw})


def test_config_is_frozen_and_records_output_params():
    cfg = PreprocessConfig(input="in", output="out", workers=3)
    with pytest.raises(AttributeError):
        cfg.zstd_level = 2  # type: ignore[misc]
    params = cfg.output_params()
    assert "workers" not in params and "input" not in params  # they never change the bytes written
    assert params["action_horizon"] == 16 and params["shard_size"] == 64 << 20
    assert cfg.num_workers == 3


def test_block_flags_and_params():
    import argparse

    from loongforge.preprocess.config import add_job_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    default = config_from_args(parser.parse_args(["--input", "in", "--output", "out"]))
    assert default.block_frames == 16 and "block_codec" not in default.output_params()  # absent = zstd
    eight = config_from_args(parser.parse_args(["--input", "in", "--output", "out", "--block-frames", "8"]))
    assert eight.block_frames == 8
    delta = config_from_args(parser.parse_args(["--input", "in", "--output", "out", "--block-codec", "delta-zstd"]))
    assert delta.output_params()["block_codec"] == "delta-zstd"


def test_block_codec_choices_match_the_format():
    from loongforge.preprocess.config import BLOCK_CODEC_CHOICES
    from loongforge.shared.blocks import BLOCK_CODECS

    assert BLOCK_CODEC_CHOICES == BLOCK_CODECS


@pytest.mark.parametrize("flags", [["--format-version", "1"], ["--format-version", "2"], ["--stride", "1"],
                                   ["--frames-per-sample", "4"], ["--frame-step", "2"], ["--min-frames", "1"]])
def test_format_1_flags_are_refused_in_one_line_saying_how_to_convert(flags, capsys):
    """Format 1 is retired: its flags are a usage error (exit 2) saying so and naming the converter,
    never silently ignored, through `loongforge preprocess` and the pipeline module alike."""
    from loongforge.cli import main
    from loongforge.preprocess.pipeline import run

    with pytest.raises(SystemExit) as info:
        main(["preprocess", "--input", "in", "--output", "out", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"loongforge preprocess: error: {flags[0]}: ")
    assert "format 1" in err and "retired" in err and "loongforge convert ROOT --to v2 OUT" in err
    with pytest.raises(SystemExit) as info:
        run(["--input", "in", "--output", "out", *flags])
    assert info.value.code == 2 and "loongforge convert" in capsys.readouterr().err
