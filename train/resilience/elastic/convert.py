"""The elastic supervisor's converting child (reshard.py says when and why it runs):

    python -m loongforge.train.resilience.elastic.convert RUN TAG LAYOUT

reshards TAG to LAYOUT without moving `latest`, verifies the new tag against its manifest, then
moves `latest` to it (last). Its own process: it imports torch and the model, which the supervisor
does not, and a crash here cannot take the supervisor with it. Exit 0, or 1 with one line on stderr.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys

from loongforge.shared.storage import write_bytes_atomic
from loongforge.train.ckpt import fallback as ckpt_fallback, files as ckpt_files
from loongforge.train.ckpt.reshard import Layout, reshard


def convert_and_publish(run_dir: str, tag: str, layout_text: str) -> str:
    """The child: reshard without moving `latest`, verify the new tag, then move `latest` (last). A failure
    removes the new tag and leaves `latest` on the source."""
    doc = ckpt_files.read_sidecar(run_dir, tag)
    to = Layout.parse(layout_text, default_world=doc["world"])
    root = ckpt_files.ckpt_root(run_dir)
    new = None
    try:
        new = reshard(run_dir, to, tag=tag, move_latest=False)
        ckpt_fallback.verify_chain(run_dir, new)
        ckpt_files.read_sidecar(run_dir, new)
    except BaseException:
        if new is not None:
            shutil.rmtree(os.path.join(root, new), ignore_errors=True)
        raise
    write_bytes_atomic(os.path.join(root, "latest"), new.encode())
    return new


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_dir, tag, layout = argv if argv is not None else sys.argv[1:]
    try:
        convert_and_publish(run_dir, tag, layout)
    except Exception as exc:  # noqa: BLE001 - the supervisor logs the last line and carries on
        print(f"{type(exc).__name__}: {' '.join(str(exc).split())[:480]}", file=sys.stderr)  # one line
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
