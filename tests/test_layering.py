"""Imports run one way (ARCHITECTURE.md): no import circle between modules, no import against the
layers, and a function-local import only where it defers an optional or heavy dependency.

A small AST check over every module of every package that pyproject.toml's package-dir mapping
installs (`loongforge.train` = train/, ...). Rules are written by package and folder, never by
file name, so a module renamed or added inside a folder falls under its folder's rule:

* LAYERS: for a package, its parts from the bottom up. A part (a subpackage or a module) may
  import the parts below it and itself, never one above; the parts grouped in one tuple are
  independent (none imports another). A package listed here must place every part it has.
* Anywhere: a `cli` module (command registration) is imported only by another `cli` module or
  a `__main__`; a `__main__` module is a process entry point, imported by nothing, and may import
  anything.
* Function-local imports: allowed for the third-party packages in OPTIONAL (each with its reason)
  and inside `cli` / `__main__` modules, whose handlers defer their service's imports so that
  `loongforge --help` stays fast. Anything else goes to the top of the module.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LAYERS: dict[str, list] = {
    # The services: the shard format at the bottom; the trainer reads shards through the cache's client.
    "loongforge": ["shared", ("preprocess", "cache"), "train", "benchmarks", "cli"],
    # Inside the trainer (train/README.md has the folder map).
    "loongforge.train": ["config", ("model", "data"), "recipes", ("kernels", "observe"), "parallel", "ckpt",
                         ("eval", "resilience"), "serve", "sim", "tune", "flags", "preflight", "trainer", "launch",
                         "warm", "cli"],
}

# What a function may import locally, and why: third-party packages, by their top-level name.
OPTIONAL = {
    "torch": "heavy (seconds to import): kept out of command registration and torch-free helpers",
    "transformers": "heavy (seconds to import): the model's SigLIP2 / Qwen3 modules and a run's tokenizer "
                    "(model/, data/prompt.py), never the cache or preprocess",
    "deepspeed": "heavy (seconds, plus its accelerator probe): only the paths that build or read an engine pay it",
    "torchao": "optional extra loongforge[fp8]: only --fp8 needs it",
    "flash_attn": "optional extra loongforge[gpu], CUDA only",
    "numba": "optional fast path of the CPU colour conversion; torch ops run without it",
    "matplotlib": "heavy, only for charts",
    "psutil": "optional: CPU accounting of benchmark processes",
    "wandb": "optional extra loongforge[track]: only --report-to wandb (rank 0) needs it",
    "torchcodec": "optional baseline decoder of the loader benchmark (its torch 2.13 wheels are CUDA builds)",
    "apache_beam": "the preprocess extra; Beam workers only",
    "google": "protobuf, through apache_beam (the local runner)",
    "av": "the preprocess extra (PyAV)",
    "PIL": "the preprocess extra (Pillow): only datasets with image features decode them; the image "
           "reference path (train/data/images.py), never the device path",
    "cv2": "OpenCV (the train extra): only the image reference path (train/data/images.py) runs it; the "
           "trainer's device path is torch",
    "distributed": "the preprocess-dask extra: only --runner dask",
    "pyarrow": "the preprocess extra (LeRobot parquet)",
    "pandas": "the preprocess extra: LeRobot's meta/tasks.parquet is a pandas frame indexed by the task (sample data)",
    "redis": "the cache extra",
    "prometheus_client": "the cache extra",
    "fsspec": "remote (URL) roots only; local paths never pay its registry import",
    "huggingface_hub": "only `--init-from ORG/NAME` (a checkpoint by its hub id) resolves through its cache",
    "zmq": "the serve extra (pyzmq): only `loongforge serve`, its client and its benchmark",
    "msgpack": "the serve extra: Isaac-GR00T's policy-server frames (train/serve/protocol.py)",
    "metaworld": "the sim extra (Meta-World's tasks and scripted experts): only `sample-data --sim` and `eval --env`",
    "mujoco": "the sim extra (MuJoCo 3, Meta-World's physics and renderer): imported after MUJOCO_GL is set",
    # A service, not a package: the trainer reads through the cache daemon only with --cache-socket or
    # --cache-tcp, and reads the origin when the cache's client cannot be imported (train/data/sources.py).
    "loongforge.cache": "the trainer's optional path through the cache daemon",
}

ENTRY_POINTS = ("cli", "__main__")


@dataclass(frozen=True)
class Import:
    src: str
    dst: str
    line: int
    local: bool  # inside a function body

    def __str__(self) -> str:
        return f"{self.src}:{self.line} imports {self.dst}" + (" (function-local)" if self.local else "")


def discover(root: Path) -> dict[str, Path]:
    """Module name -> file, from pyproject.toml's [tool.setuptools.package-dir]."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    mapped = {(root / d).resolve() for d in mapping.values()}
    modules = {}
    for package, folder in mapping.items():
        base = (root / folder).resolve()
        for dirpath, dirnames, filenames in os.walk(base):
            here = Path(dirpath)
            dirnames[:] = sorted(d for d in dirnames if (here / d / "__init__.py").exists()
                                 and (here / d).resolve() not in mapped)
            if not (here / "__init__.py").exists():
                continue
            parts = [package, *here.relative_to(base).parts]
            for name in sorted(filenames):
                if name.endswith(".py"):
                    mod = ".".join(parts if name == "__init__.py" else [*parts, name[:-3]])
                    modules[mod] = here / name
    return modules


def _resolve(name: str, modules: dict) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(mod: str, path: Path, modules: dict) -> tuple[list[Import], list[Import]]:
    """(first-party imports, third-party function-local imports) of one module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    first, third = [], []

    def add(name: str, node: ast.AST, local: bool) -> None:
        target = _resolve(name, modules) if name.split(".")[0] in _roots(modules) else None
        if target is not None:
            if target != mod:
                first.append(Import(mod, target, node.lineno, local))
        elif local:
            third.append(Import(mod, name, node.lineno, local))

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child, local)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                if base == "__future__":
                    continue
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    add(full if full in modules else base, child, local)
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return first, third


def _roots(modules: dict) -> set[str]:
    return {m.split(".")[0] for m in modules}


def _place(mod: str, layers: dict) -> tuple[str, int, object] | None:
    """(package, layer number, part) of the innermost LAYERS package holding `mod`; the package's
    own __init__ is layer -1 (any part may import it)."""
    best = None
    for package, parts in layers.items():
        if mod == package:
            if best is None or len(package) > len(best[0]):
                best = (package, -1, None)
        elif mod.startswith(package + "."):
            if best is not None and len(best[0]) > len(package):
                continue
            head = mod[len(package) + 1:].split(".")[0]
            for i, layer in enumerate(parts):
                if head in (layer if isinstance(layer, tuple) else (layer,)):
                    best = (package, i, head)
                    break
            else:
                best = (package, None, head)
    return best


def layer_errors(edges: list[Import], modules: dict, layers: dict) -> list[str]:
    errors = []
    for package, parts in layers.items():
        named = {p for layer in parts for p in (layer if isinstance(layer, tuple) else (layer,))}
        found = {m[len(package) + 1:].split(".")[0] for m in modules if m.startswith(package + ".")}
        for part in sorted(found - named - {"__main__"}):
            errors.append(f"{package}.{part} has no layer: place it in LAYERS[{package!r}] "
                          "(tests/test_layering.py) and in ARCHITECTURE.md")
    for e in edges:
        src_last, dst_last = e.src.rpartition(".")[2], e.dst.rpartition(".")[2]
        if src_last == "__main__":
            continue  # an entry point: may import anything
        if dst_last == "__main__":
            errors.append(f"{e}: a __main__ module is an entry point, imported by nothing")
            continue
        if dst_last == "cli" and src_last != "cli":
            errors.append(f"{e}: a cli module is imported only by another cli module or a __main__")
            continue
        # Compare at the innermost package holding both: the first LAYERS package where they differ.
        for package in sorted(layers, key=len, reverse=True):
            inside = (e.src == package or e.src.startswith(package + ".")) and \
                     (e.dst == package or e.dst.startswith(package + "."))
            if not inside:
                continue
            a, b = _place(e.src, {package: layers[package]}), _place(e.dst, {package: layers[package]})
            if a[2] == b[2] and a[1] is not None and a[1] >= 0:
                break  # same part: its own business (circles are checked apart)
            if b[1] == -1:
                break  # the package's __init__
            if a[1] is None or b[1] is None:
                break  # reported above as unplaced
            if b[1] > a[1] or (b[1] == a[1] and a[2] != b[2]):
                how = "is above" if b[1] > a[1] else "is independent of"
                errors.append(f"{e}: {package}.{b[2]} {how} {package}.{a[2]} (LAYERS[{package!r}])")
            break
    return errors


def local_errors(first: list[Import], third: list[Import], optional: dict) -> list[str]:
    errors = []
    for e in first + third:
        if not e.local or e.src.rpartition(".")[2] in ENTRY_POINTS:
            continue
        if e in third and e.dst.split(".")[0] in optional:
            continue
        if e in first and any(e.dst.startswith(k + ".") and not e.src.startswith(k + ".")
                              for k in optional if "." in k):
            continue  # another service, optional at run time
        errors.append(f"{e}: move it to the top of the module (a function-local import is only for the "
                      "optional or heavy packages in OPTIONAL, or inside a cli/__main__ handler)")
    return errors


def cycles(edges: list[Import]) -> list[list[Import]]:
    """One concrete circle per strongly connected component of the import graph (Tarjan)."""
    graph: dict[str, list[Import]] = {}
    for e in edges:
        graph.setdefault(e.src, []).append(e)
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        work = [(v, iter(graph.get(v, [])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for e in it:
                w = e.dst
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, []))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_circle(min(c), c, graph) for c in comps]


def _circle(start: str, comp: set, graph: dict) -> list[Import]:
    """The shortest path of imports from `start` back to itself inside the component."""
    paths, frontier = {start: []}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in graph.get(v, []):
                if e.dst == start:
                    return paths[v] + [e]
                if e.dst in comp and e.dst not in paths:
                    paths[e.dst] = paths[v] + [e]
                    nxt.append(e.dst)
        frontier = nxt
    return []


def check(root: Path, layers: dict = LAYERS, optional: dict = OPTIONAL) -> list[str]:
    """Every violation in the tree at `root`, one line each (circles as their chain of imports)."""
    modules = discover(root)
    first, third = [], []
    for mod, path in modules.items():
        f, t = imports_of(mod, path, modules)
        first += f
        third += t
    errors = [" -> ".join([c[0].src] + [f"{e.dst} (line {e.line} of {e.src})" for e in c])
              for c in cycles(first)]
    errors = [f"import circle: {c}" for c in errors]
    errors += layer_errors(first, modules, layers) + local_errors(first, third, optional)
    return list(dict.fromkeys(errors))  # `from m import a, b` is one line, one error


# ---- the repository ----


def _service(error: str) -> str:
    """The folder of the importing module (the first one of a circle): each service its own test case."""
    mod = error.removeprefix("import circle: ").split(":")[0].split(" ")[0]
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] not in ENTRY_POINTS) else parts[0]


@pytest.fixture(scope="module")
def repo_errors() -> list[str]:
    return check(REPO)


def _services(root: Path) -> list[str]:
    with open(root / "pyproject.toml", "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return sorted(p.split(".")[1] if "." in p else p for p in packages)


@pytest.mark.parametrize("service", _services(REPO))
def test_the_repository_keeps_its_layers(service, repo_errors):
    errors = [e for e in repo_errors if _service(e) == service]
    assert not errors, "\n".join(errors)


def test_every_service_is_seen():
    modules = discover(REPO)
    for mod in ("loongforge.cli", "loongforge.shared.errors", "loongforge.train.trainer",
                "loongforge.train.parallel.parallelize", "loongforge.cache.client"):
        assert mod in modules
    assert len(modules) > 150


# ---- the checker on small synthetic trees ----


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"app" = "app"\n"app.svc" = "svc"\n')
    for rel, text in {"app/__init__.py": "", "svc/__init__.py": "", "svc/low/__init__.py": "",
                      "svc/high/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


SYNTH_LAYERS = {"app": ["svc", "cli"], "app.svc": ["low", "high"]}


def test_a_clean_tree_passes(tmp_path):
    root = _tree(tmp_path, {"svc/low/a.py": "import os\n",
                            "svc/high/b.py": "from app.svc.low import a\n\ndef f():\n    import torch\n",
                            "app/cli.py": "def handler():\n    from app.svc.high import b\n"})
    assert check(root, SYNTH_LAYERS, {"torch": "heavy"}) == []


def test_a_backward_import_is_reported_with_its_chain(tmp_path):
    root = _tree(tmp_path, {"svc/low/a.py": "from app.svc.high import b\n",
                            "svc/high/b.py": "from app.svc.low import a\n"})
    errors = check(root, SYNTH_LAYERS, {})
    assert "import circle: app.svc.high.b -> app.svc.low.a (line 1 of app.svc.high.b) -> app.svc.high.b " \
           "(line 1 of app.svc.low.a)" in errors
    assert "app.svc.low.a:1 imports app.svc.high.b: app.svc.high is above app.svc.low (LAYERS['app.svc'])" in errors
    assert len(errors) == 2


def test_a_backward_import_hidden_in_a_function_is_still_reported(tmp_path):
    root = _tree(tmp_path, {"svc/low/a.py": "def late():\n    from app.svc.high import b\n",
                            "svc/high/b.py": "from app.svc.low import a\n"})
    errors = check(root, SYNTH_LAYERS, {})
    assert any(e.startswith("import circle: app.svc.high.b -> app.svc.low.a") for e in errors)
    assert any("app.svc.low.a:2 imports app.svc.high.b (function-local): app.svc.high is above" in e
               for e in errors)
    assert any("app.svc.low.a:2 imports app.svc.high.b (function-local): move it to the top" in e for e in errors)


def test_function_local_imports_outside_the_allow_list_are_reported(tmp_path):
    root = _tree(tmp_path, {"svc/low/a.py": "def f():\n    import json\n    import torch\n",
                            "app/cli.py": "def handler():\n    import json\n"})
    errors = check(root, SYNTH_LAYERS, {"torch": "heavy"})
    assert errors == ["app.svc.low.a:2 imports json (function-local): move it to the top of the module (a "
                      "function-local import is only for the optional or heavy packages in OPTIONAL, or inside "
                      "a cli/__main__ handler)"]


def test_independent_parts_and_unplaced_modules_and_cli_imports(tmp_path):
    layers = {"app": ["svc", "cli"], "app.svc": [("low", "high")]}
    root = _tree(tmp_path, {"svc/low/a.py": "from app.svc.high import b\nfrom app import cli\n",
                            "svc/high/b.py": "", "svc/stray.py": "", "app/cli.py": ""})
    errors = check(root, layers, {})
    assert "app.svc.stray has no layer: place it in LAYERS['app.svc'] (tests/test_layering.py) and in " \
           "ARCHITECTURE.md" in errors
    assert "app.svc.low.a:1 imports app.svc.high.b: app.svc.high is independent of app.svc.low " \
           "(LAYERS['app.svc'])" in errors
    assert "app.svc.low.a:2 imports app.cli: a cli module is imported only by another cli module or a " \
           "__main__" in errors


def test_command_registration_imports_no_heavy_package():
    """Why cli handlers import lazily: building `loongforge`'s parser (what --help does) must not
    import torch, DeepSpeed or the other extras, whatever a service's modules import at their top."""
    code = ("import sys, loongforge.cli as c; c.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (sorted(OPTIONAL),))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout
