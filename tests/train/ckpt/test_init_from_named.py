"""--init-from by hub id through huggingface_hub's cache (a pre-populated cache directory, never the
network), and N1.6's rule for a checkpoint's own statistics: kept for the embodiment tags it has,
the data's with --override-statistics."""

import json
import shutil

import pytest

from loongforge.shared.errors import ConfigError
from tests.outside import fixture_dir

HUB_ID = "nvidia/GR00T-N1.6-3B"


def _checkpoint(dst, statistics=None):
    """The reduced reference checkpoint's config (sized for the data: 128-D, 50 steps) with a statistics.json."""
    ref = fixture_dir("gr00t_n1d6")
    dst.mkdir(parents=True)
    config = json.loads((ref / "config.json").read_text())
    config["eagle_config"] = json.loads((ref / "eagle_config_reduced.json").read_text())
    config.update(max_state_dim=128, max_action_dim=128, action_horizon=50, max_num_embodiments=32)
    (dst / "config.json").write_text(json.dumps(config))
    if statistics is not None:
        (dst / "statistics.json").write_text(json.dumps(statistics))
    return dst


def _hub_cache(root, repo: str, files_from):
    """A huggingface_hub cache holding one snapshot of `repo` (the layout its downloads leave)."""
    snap = root / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
    shutil.copytree(files_from, snap)
    (root / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
    (root / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text("0" * 40)
    return snap


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(tmp_path, monkeypatch):
    from loongforge.train.ckpt.hub import resolve_checkpoint

    snap = _hub_cache(tmp_path / "hub", HUB_ID, _checkpoint(tmp_path / "src"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    assert resolve_checkpoint(HUB_ID) == str(snap)
    assert resolve_checkpoint(str(snap)) == str(snap)  # a directory is used as it is
    with pytest.raises(ConfigError, match="not in the hub cache .* downloads are off .HF_HUB_OFFLINE.") as err:
        resolve_checkpoint("nvidia/not-there")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not a directory, and not a hub id"):
        resolve_checkpoint(str(tmp_path / "missing" / "dir"))


@pytest.mark.parametrize("override", [False, True])
def test_init_from_keeps_the_checkpoints_statistics_for_its_tags(train_root, tmp_path, override):
    """A checkpoint with statistics for the data's tag (new_embodiment here): N1.6 normalises with the
    checkpoint's (set_statistics(override=False)); --override-statistics takes the data's."""
    from loongforge.train.config import DataConfig, ModelConfig, RunConfig, TrainConfig
    from loongforge.train.recipes import plan_model

    root, data = train_root
    own = data.embodiment_statistics()["new_embodiment"]
    theirs = json.loads(json.dumps(own))
    for kind in ("state", "action"):
        for stats in theirs[kind].values():
            stats["max"] = [v + 10.0 for v in stats["max"]]  # recognisably not the data's
    src = _checkpoint(tmp_path / "ckpt", {"new_embodiment": theirs, "oxe_droid": theirs})
    cfg = TrainConfig(recipe="gr00t-n1.6", data=DataConfig(root=root), run=RunConfig(run_dir=str(tmp_path / "run")),
                      model=ModelConfig(init_from=str(src), tokenizer="bytes", override_statistics=override))
    got = plan_model(cfg, data).processor.embodiments["new_embodiment"].statistics
    want = own if override else theirs
    assert got["state"] == want["state"] and got["action"] == want["action"]
