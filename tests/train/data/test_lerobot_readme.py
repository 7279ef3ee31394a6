"""README "Use LoongForge shards from your own training loop" runs as written: its commands (sample
data in LeRobot's v3.0 layout, preprocess), then its Python saved as snippet.py and run as
`python snippet.py` (both loaders start worker processes, which import the script: it must run
as a script, not only under exec), in a temp dir as the working directory."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from loongforge.cli import main

README = Path(__file__).resolve().parents[3] / "README.md"
IN_MEMORY = ["--", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


def _section() -> str:
    text = README.read_text()
    start = text.index("## Use LoongForge shards from your own training loop")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_example_runs_as_a_script(tmp_path):
    section = _section()
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    cwd = Path.cwd()
    os.chdir(tmp_path)  # the README's relative paths (data/...) land in the temp dir
    try:
        for line in bash.strip().splitlines():
            argv = shlex.split(line.split("#")[0])
            assert argv[0] == "loongforge"
            assert main(argv[1:] + (IN_MEMORY if argv[1] == "preprocess" else [])) == 0, line
    finally:
        os.chdir(cwd)
    (tmp_path / "snippet.py").write_text(code)
    run = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = re.fullmatch(r"(\(.*?\)) (\(.*?\)) (\[.*\])", run.stdout.strip().splitlines()[-1])
    frames, actions, keys = (ast.literal_eval(g) for g in printed.groups())
    assert frames == (8, 2, 3, 64, 64) and actions == (8, 16, 8)
    assert set(keys) == {"observation.images.ego_view", "observation.images.wrist_view", "observation.state",
                         "action", "observation.images.ego_view_is_pad", "observation.state_is_pad",
                         "action_is_pad", "timestamp", "frame_index", "episode_index", "index", "task_index",
                         "annotation.human.action.task_description", "annotation.human.validity", "next.done",
                         "task"}
