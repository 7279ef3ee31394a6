"""What `loongforge tune ac / batch` write: versioned JSON results; and the batch plan that
`loongforge train --batch-plan FILE` reads back. Torch-free: the trainer's flags import it."""

from __future__ import annotations

import json

from loongforge.shared.errors import ConfigError
from loongforge.shared.storage import write_bytes_atomic

FORMAT_VERSION = 1


def write_json(result: dict, path: str) -> None:
    write_bytes_atomic(path, json.dumps(result, indent=2, sort_keys=True).encode())


def load_plan(path: str) -> dict:
    """A `tune batch` JSON, validated; for the trainer's --batch-plan."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--batch-plan: cannot read {path}: {exc}; run `loongforge tune batch --json {path}`")
    if not isinstance(doc, dict) or doc.get("kind") != "batch":
        raise ConfigError(f"--batch-plan: {path} is not a `loongforge tune batch` result")
    if doc.get("version") != FORMAT_VERSION:
        raise ConfigError(f"--batch-plan: {path} has format version {doc.get('version')}, this build reads "
                          f"{FORMAT_VERSION}; rerun `loongforge tune batch`")
    if not isinstance(doc.get("micro_batch"), int) or doc["micro_batch"] < 1:
        raise ConfigError(f"--batch-plan: {path} found no micro-batch that fits; raise the budget and rerun")
    return doc
