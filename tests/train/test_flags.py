"""The trainer's flags (train/flags.py): every default is the config dataclass's."""

import argparse

from loongforge.train.config import DataConfig, MemoryConfig, ParallelConfig, RunConfig, TrainConfig
from loongforge.train.flags import add_train_args, config_from_args


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_train_args(p)
    return config_from_args(p.parse_args(["--data", "d", "--run-dir", "r", *argv]))


def test_no_flag_means_the_config_defaults():
    assert _parse() == TrainConfig(data=DataConfig(root="d"), run=RunConfig(run_dir="r"))


def test_flags_reach_their_fields():
    cfg = _parse("--workers", "3", "--zero", "3", "--no-overlap-comm", "--sync-save", "--ac-every", "2",
                 "--fuse", "off", "--nan-policy", "fail", "--heartbeat-s", "2.5", "--video-deltas=-2,0",
                 "--profile-steps", "1:3", "--attention", "sdpa", "--zero3-leaf-blocks")
    assert cfg.data.num_workers == 3 and cfg.data.video_deltas == (-2, 0)
    assert cfg.parallel == ParallelConfig(zero_stage=3, overlap_comm=False, zero3_leaf_blocks=True)
    assert cfg.memory == MemoryConfig(ac_every=2, fuse="off")
    assert not cfg.run.save_async and cfg.run.profile_steps == (1, 3)
    assert cfg.faults.nan_policy == "fail" and cfg.faults.heartbeat_s == 2.5 and cfg.model.attention == "sdpa"
