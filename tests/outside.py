"""Outside reference data (`../shared/fixtures` beside the repository: written by other tools,
never by this code). Tests copy what they need into a temp dir and skip, saying why, without it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def fixture_dir(name: str) -> Path:
    """`<ancestor>/shared/fixtures/<name>` for the nearest ancestor of the repository that has it
    (`../shared/fixtures` for a checkout beside it; a git worktree may sit deeper); skips without."""
    for parent in REPO.parents:
        found = parent / "shared" / "fixtures" / name
        if found.is_dir():
            return found
    pytest.skip(f"outside fixtures {name!r} not found in ../shared/fixtures (looked above {REPO})")


def copy_fixture(name: str, dest: Path) -> Path:
    """A writable copy of fixtures/<name> at `dest` (fixtures are read-only)."""
    shutil.copytree(fixture_dir(name), dest, copy_function=shutil.copyfile)
    for p in [dest, *dest.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dest
