"""The offline GPU bundle (infra/gpu/: wheels.txt, bundle.lock.json written by `make gpu-bundle`) against
the H200 image's package list (infra/gpu/image.txt, from the device notes) and the project's own
requirements: a wheel the GPU side lacks, or one for the wrong Python, fails here, not there. Reads
committed files only (no download, no bundle needed); where .gpu-bundle/ is built, it must be the locked one."""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "infra" / "gpu"
# What the GPU path imports beyond the package's own dependencies: the test tools gpu-check runs, and
# transformers / safetensors (the model's building blocks), which the image has and the bundle must not carry.
EXTRA_NEEDS = ("pytest", "pytest-timeout", "hypothesis", "transformers", "safetensors")


def _bundle_module():
    spec = importlib.util.spec_from_file_location("loongforge_gpu_bundle", GPU / "bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _image() -> dict[str, str | None]:
    out = {}
    for line in (GPU / "image.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version or None
    return out


def _lock() -> dict:
    return json.loads((GPU / "bundle.lock.json").read_text())


def _project_needs() -> set[str]:
    """The runtime requirements of the GPU path: core + [train] + [fp8] of pyproject.toml."""
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = proj["dependencies"] + proj["optional-dependencies"]["train"] + proj["optional-dependencies"]["fp8"]
    return {canonicalize_name(Requirement(r).name) for r in reqs} | {canonicalize_name(n) for n in EXTRA_NEEDS}


def test_the_lock_is_the_list_and_the_built_bundle_is_the_lock():
    spec = {(canonicalize_name(n), v) for n, v, _ in _bundle_module().read_spec()}
    lock = _lock()
    assert {(canonicalize_name(w["name"]), w["version"]) for w in lock["wheels"]} == spec, \
        "infra/gpu/wheels.txt changed: run `make gpu-bundle` (it rewrites infra/gpu/bundle.lock.json) and commit both"
    manifest = REPO / ".gpu-bundle" / "MANIFEST.json"
    if manifest.exists():  # built here: it must be what the lock says (else rebuild it)
        built = json.loads(manifest.read_text())
        assert sorted((w["file"], w["size"]) for w in built["wheels"]) == \
            sorted((w["file"], w["size"]) for w in lock["wheels"]), "stale .gpu-bundle: run `make gpu-bundle`"


def test_every_wheel_installs_on_the_image_python():
    """CPython 3.12 on manylinux x86-64 (the image's python3 3.12.3): pure-Python, cp312 or abi3 <= 3.12."""
    assert _image()["python"] == "3.12.3"
    for w in _lock()["wheels"]:
        ok = False
        for tag in w["tags"]:
            interp, abi, plat = tag.split("-")
            py = interp in ("py3", "cp312") or (abi == "abi3" and re.fullmatch(r"cp3(\d+)", interp)
                                                and int(interp[3:]) <= 12)
            plat_ok = plat == "any" or (plat.endswith("_x86_64") and plat.startswith("manylinux"))
            ok |= bool(py and abi in ("none", "cp312", "abi3") and plat_ok)
        assert ok, f"{w['file']}: no tag for CPython 3.12 on manylinux x86-64 ({w['tags']})"


def test_no_wheel_shadows_a_package_of_the_image():
    """The bundle installs next to the image's packages (--target, first on PYTHONPATH): a carried torch,
    numpy or transformers would replace the image's own."""
    image = _image()
    clash = sorted(canonicalize_name(w["name"]) for w in _lock()["wheels"] if canonicalize_name(w["name"]) in image)
    assert not clash, f"carried and already on the image: {clash}; drop them from infra/gpu/wheels.txt"


def test_the_image_and_the_bundle_hold_everything_the_gpu_path_imports():
    """Every requirement of the GPU path, and of each carried wheel, recursively (on Python 3.12, Linux),
    is on the image or in the bundle: `pip install --no-deps` there installs nothing else."""
    image, wheels = _image(), {canonicalize_name(w["name"]): w for w in _lock()["wheels"]}
    missing, todo, seen = set(), list(_project_needs()), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in wheels:
            todo.extend(wheels[name]["requires"])
        elif name not in image:
            missing.add(name)
    assert not missing, f"needed on the GPU side, neither on the image nor in the bundle: {sorted(missing)}"
    assert not set(wheels) - seen, f"carried but never needed: {sorted(set(wheels) - seen)}"


def test_the_bundle_and_the_tree_fit_one_device_call():
    mod = _bundle_module()
    lock = _lock()
    carried = sum(w["size"] for w in lock["wheels"]) + lock["shards_bytes"] + 64 * 1024  # + MANIFEST.json
    tree = mod.tree_bytes(str(REPO))
    assert tree + carried <= mod.LIMIT, (f"working tree {tree / 2**20:.1f} MiB + bundle {carried / 2**20:.1f} MiB "
                                         f"> {mod.LIMIT / 2**20:.0f} MiB a device call carries")


SETUP = """from setuptools import setup
names = {f"pkg{i}" for i in range(40)}  # as deepspeed's setup.py: extras gathered in a set
setup(name="lfrepro", version="1.0", py_modules=["lfrepro"], extras_require={"all": sorted(names, key=hash)})
"""


def test_a_wheel_built_from_an_sdist_is_the_same_on_every_build(tmp_path):
    """`make gpu-bundle` built deepspeed's wheel with the build's clock in every zip entry and its
    extras in hash order, so the committed lock changed on every build (2,168,852 -> 2,168,857 bytes)
    and a fresh clone's check dirtied the tree. Two builds of a small sdist of the same kind, seconds
    apart (the zip clock's step is 2 s), are now the same bytes."""
    import subprocess
    import sys
    import time

    src = tmp_path / "lfrepro-1.0"
    src.mkdir()
    (src / "setup.py").write_text(SETUP)
    (src / "lfrepro.py").write_text("VALUE = 1\n")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=src, check=True,
                   capture_output=True)
    (sdist,) = tmp_path.glob("lfrepro-1.0.tar.gz")
    built = []
    for i in range(2):
        out = tmp_path / f"out{i}"
        _bundle_module().build_wheel(str(sdist), str(out))
        (wheel,) = out.glob("*.whl")
        built.append(wheel.read_bytes())
        time.sleep(2.1)
    assert built[0] == built[1]
