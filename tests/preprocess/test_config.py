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
    ({"frames_per_sample": 0}, "frames_per_sample"),
    ({"min_frames": 5, "frames_per_sample": 4}, "min_frames"),
    ({"height": 64}, "height and width"),
    ({"height": 63, "width": 64}, "height"),
    ({"resize_mode": "stretch"}, "resize_mode"),
    ({"shard_size": 100}, "shard_size"),
    ({"zstd_level": 0}, "zstd_level"),
    ({"output": "in"}, "output must differ"),
    ({"format_version": 3}, "format_version"),
    ({"format_version": 2, "block_frames": 0}, "block_frames"),
    ({"block_codec": "lz4"}, "block_codec"),
    ({"format_version": 1, "block_codec": "delta-zstd"}, "format-2 option"),
])
def test_config_rejects_with_field_name(kw, field):
    with pytest.raises(ConfigError, match=field):
        PreprocessConfig(**{"input": "in", "output": "out", **kw})


def test_config_is_frozen_and_records_output_params():
    cfg = PreprocessConfig(input="in", output="out", workers=3)
    with pytest.raises(AttributeError):
        cfg.stride = 2  # type: ignore[misc]
    params = cfg.output_params()
    assert "workers" not in params and "input" not in params  # they never change the bytes written
    assert params["frames_per_sample"] == 4 and params["shard_size"] == 64 << 20
    assert cfg.num_workers == 3


def test_format_version_flag_and_params():
    import argparse

    from loongforge.preprocess.config import add_job_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    default = config_from_args(parser.parse_args(["--input", "in", "--output", "out"]))
    assert default.format_version == 2 == PreprocessConfig(input="in", output="out").format_version  # the default
    v1 = config_from_args(parser.parse_args(["--input", "in", "--output", "out", "--format-version", "1"]))
    assert v1.format_version == 1 and "format_version" not in v1.output_params()  # v1 params keep their bytes
    v2 = config_from_args(parser.parse_args(["--input", "in", "--output", "out", "--block-frames", "8"]))
    assert v2.output_params()["format_version"] == 2 and v2.output_params()["block_frames"] == 8
    assert "block_codec" not in v2.output_params()  # absent = zstd: default params keep their bytes
    delta = config_from_args(parser.parse_args(["--input", "in", "--output", "out", "--block-codec", "delta-zstd"]))
    assert delta.output_params()["block_codec"] == "delta-zstd"


def test_block_codec_choices_match_the_format():
    from loongforge.preprocess.config import BLOCK_CODEC_CHOICES
    from loongforge.shared.blocks import BLOCK_CODECS

    assert BLOCK_CODEC_CHOICES == BLOCK_CODECS


def test_v1_window_flags_without_format_1_are_refused():
    """Format 2 (the default) has no windows: a K or stride flag would be silently ignored."""
    import argparse

    from loongforge.preprocess.config import add_job_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    base = ["--input", "in", "--output", "out"]
    with pytest.raises(ConfigError, match=r"--frames-per-sample, --stride: .*--format-version 1"):
        config_from_args(parser.parse_args(base + ["--frames-per-sample", "1", "--stride", "1"]))
    with pytest.raises(ConfigError, match=r"--min-frames"):
        config_from_args(parser.parse_args(base + ["--min-frames", "1"]))
    v1 = config_from_args(parser.parse_args(base + ["--frames-per-sample", "1", "--stride", "1",
                                                    "--format-version", "1"]))
    assert (v1.frames_per_sample, v1.stride, v1.format_version) == (1, 1, 1)
