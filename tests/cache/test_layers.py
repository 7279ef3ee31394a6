"""The cache service's imports run one way: it imports itself, loongforge.shared, the standard
library and its third-party dependencies, never the top-level `loongforge` command or another
service, not even inside a function (where a backward import hides from import-time checks)."""

from __future__ import annotations

import ast
from pathlib import Path

CACHE = Path(__file__).resolve().parents[2] / "cache"
ALLOWED = ("loongforge.cache", "loongforge.shared")


def _loongforge_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if name == "loongforge" or name.startswith("loongforge."):
                yield node.lineno, name


def test_cache_imports_only_itself_and_shared():
    modules = sorted(CACHE.glob("*.py"))
    assert len(modules) > 10  # the right folder
    backward = [f"cache/{p.name}:{line}: {name}" for p in modules for line, name in _loongforge_imports(p)
                if not (name + ".").startswith(tuple(a + "." for a in ALLOWED))]
    assert backward == [], "\n".join(backward)
