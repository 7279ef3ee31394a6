"""README "Use LoongForge shards from your own training loop" runs as written: its commands (sample
data in LeRobot's v3.0 layout, preprocess), then its Python (the adapter in a torch DataLoader, then
the fast path), with only the paths moved into a temp dir."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import torch

from loongforge.cli import main

README = Path(__file__).resolve().parents[3] / "README.md"
IN_MEMORY = ["--", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


def _section() -> str:
    text = README.read_text()
    start = text.index("## Use LoongForge shards from your own training loop")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_example_runs(tmp_path):
    section = _section()
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for line in bash.strip().splitlines():
        argv = shlex.split(line.split("#")[0].replace("data/", f"{tmp_path}/data/"))
        assert argv[0] == "loongforge"
        assert main(argv[1:] + (IN_MEMORY if argv[1] == "preprocess" else [])) == 0, line
    ns: dict = {}
    exec(code.replace('"data/v3-shards"', repr(f"{tmp_path}/data/v3-shards")), ns)
    frames, actions, batch = ns["frames"], ns["actions"], ns["batch"]
    assert frames.shape == (8, 2, 3, 64, 64) and frames.dtype == torch.float32 and actions.shape == (8, 16, 8)
    assert 0.0 <= float(frames.min()) and float(frames.max()) <= 1.0
    assert set(batch) == {"observation.images.ego_view", "observation.images.wrist_view", "observation.state",
                          "action", "observation.images.ego_view_is_pad", "observation.state_is_pad",
                          "action_is_pad", "timestamp", "frame_index", "episode_index", "index", "task_index",
                          "task"}
    assert batch["observation.images.ego_view"].shape == (8, 2, 3, 64, 64) and len(batch["task"]) == 8
