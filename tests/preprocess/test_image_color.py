"""Image features (PNG/JPEG in the parquet) are stored as NV12, whose 4:2:0 chroma keeps one colour per
2x2 pixels: on LeRobot's own PNG fixture a colour edge comes back off by up to 142/255. That loss is
measured as each image is converted, recorded per camera (`dataset.source.image_color`) and printed by
`loongforge preprocess` and `loongforge inspect`; here it is checked against what a user sees: the
LeRobotDataset's default colour against lerobot 0.6.1's own items (the PNGs, decoded by lerobot)."""

from __future__ import annotations

import json

import numpy as np

from loongforge.cli import main
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.train.data.lerobot import LeRobotDataset
from tests.outside import copy_fixture, fixture_dir


def test_image_features_colour_loss_is_measured_recorded_and_printed(tmp_path, capsys):
    src = copy_fixture("lerobot_v3/image", tmp_path / "src")
    out = tmp_path / "out"
    run_job(PreprocessConfig(input=str(src), output=str(out), workers=1, progress_s=0),
            ["--direct_running_mode=in_memory", "--direct_num_workers=1"])
    recorded = json.loads((out / "index.json").read_text())["dataset"]["source"]["image_color"]
    assert set(recorded) == {"observation.images.front", "observation.images.wrist"}, recorded
    spec = json.loads((fixture_dir("lerobot_v3") / "image_items.json").read_text())
    z = np.load(fixture_dir("lerobot_v3") / "image_items.npz")
    ours = LeRobotDataset(str(out), delta_timestamps=spec["delta_timestamps"], split="all")
    for key, rec in recorded.items():
        diffs = [np.abs(ours[int(i)][key].numpy() - z[f"{i}/{key}"]) * 255 for i in z["indices"]]
        seen = max(float(d.max()) for d in diffs)
        assert rec["chroma"] == "4:2:0" and rec["max_255"] >= seen - 1, (key, rec, seen)  # these items: a subset
        assert 0.5 < rec["mean_255"] < 5, rec
    assert max(r["max_255"] for r in recorded.values()) > 100  # the fixture's sharp colour edges
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    for key, rec in recorded.items():
        assert (f"colour     {key}: image feature stored as NV12 (4:2:0 chroma" in text
                and f"up to {rec['max_255']}/255, mean {rec['mean_255']:.2f}/255" in text), text
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["image_color"] == recorded

