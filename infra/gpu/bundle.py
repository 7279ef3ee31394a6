"""`make gpu-bundle`: everything the offline GPU check needs beyond the H200 image, in one folder.

    python infra/gpu/bundle.py [--out .gpu-bundle]

Run here, with network, in the project's venv (`make setup`):
  wheels/   the packages of infra/gpu/wheels.txt for CPython 3.12 on manylinux x86-64 (pip download
            --only-binary, no dependencies: the list names each one); deepspeed is built from its
            sdist with DS_BUILD_OPS=0, a pure-Python wheel with no op prebuilt, reproducibly (the
            same bytes on every build: fixed zip times and str hashing)
  shards/   the shard root of gpu-check's training runs (synthetic, written by loongforge.shared's
            writer: no Beam, no PyAV on the GPU side)
  MANIFEST.json  every file's size and sha256, each wheel's name, version, tags and requirements
and infra/gpu/bundle.lock.json (committed): the wheels and the shards' size, which
tests/benchmarks/test_gpu_bundle.py checks against the image's package list and the 64 MiB a device
call carries (working tree + bundle). Prints the sizes; exits 1 if they do not fit.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LIMIT = 64 << 20  # what one device call carries: working tree + carried paths
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# The target interpreter, for the wheels' environment markers (the image's python3).
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_machine": "x86_64", "platform_system": "Linux", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
# gpu-check's training runs read this root (benchmarks/micro/gpu_check.py: SHARDS).
SHARDS = "gpu-check"


def read_spec(path: str = os.path.join(HERE, "wheels.txt")) -> list[tuple[str, str, bool]]:
    """[(name, version, from_sdist)] of wheels.txt."""
    out = []
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if line:
            req, *flags = line.split()
            name, version = req.split("==")
            out.append((name, version, "sdist" in flags))
    return out


def _pip(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def fetch_wheels(spec, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    target = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
              "--abi", "none", *[x for p in PLATFORMS for x in ("--platform", p)], "--platform", "any"]
    binary = [f"{n}=={v}" for n, v, sdist in spec if not sdist]
    for req in binary:  # one at a time: a failure names the package
        _pip("download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", out, req)
    for name, version, sdist in spec:
        if sdist:
            build_sdist_wheel(name, version, out)


def build_sdist_wheel(name: str, version: str, out: str) -> None:
    """A pure-Python wheel from the sdist. DeepSpeed: DS_BUILD_OPS=0 (its ops JIT-build on first use,
    and the trainer never asks for one: torch's AdamW, engine.py), built against this venv's torch
    (setup.py imports it) without build isolation."""
    with tempfile.TemporaryDirectory() as tmp:
        _pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", tmp, f"{name}=={version}")
        (sdist,) = glob.glob(os.path.join(tmp, "*.tar.gz"))
        build_wheel(sdist, out, DS_BUILD_OPS="0", DS_BUILD_STRING="")


# A wheel built here comes out byte for byte the same on every build, or each `make gpu-bundle` rewrote
# the committed lock (deepspeed's size moved by a few bytes) and a fresh clone's check dirtied the tree:
# zip entries carry the build's clock, and a setup.py that lists extras from a set (deepspeed's) writes
# METADATA in an order that follows str hashing, random per process.
REPRODUCIBLE = {"SOURCE_DATE_EPOCH": "315532800", "PYTHONHASHSEED": "0"}  # 1980-01-01: the zip format's epoch


def build_wheel(sdist: str, out: str, **env: str) -> None:
    _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, sdist,
         env=dict(os.environ, **REPRODUCIBLE, **env))


def make_shards(out: str) -> list[str]:
    from loongforge.benchmarks.micro.gpu_check import write_shards

    return write_shards(os.path.join(out, SHARDS))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_info(path: str) -> dict:
    """Name, version, tags and the requirements that apply on the target interpreter."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    name, version, _, tags = parse_wheel_filename(os.path.basename(path))
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    requires = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(TARGET):
            requires.append(canonicalize_name(req.name))
    return {"name": str(name), "version": str(version), "file": os.path.basename(path),
            "tags": sorted(str(t) for t in tags), "size": os.path.getsize(path), "sha256": _sha256(path),
            "requires": sorted(set(requires))}


def tree_bytes(repo: str = REPO) -> int:
    """The working tree a device call sends: tracked and untracked-not-ignored files."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return sum(os.path.getsize(os.path.join(repo, f)) for f in files if f and os.path.isfile(os.path.join(repo, f)))


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def write_manifest(out: str, flags: list[str]) -> dict:
    wheels = [wheel_info(p) for p in sorted(glob.glob(os.path.join(out, "wheels", "*.whl")))]
    shards = os.path.join(out, "shards")
    files = [{"path": os.path.relpath(os.path.join(d, f), out), "size": os.path.getsize(os.path.join(d, f)),
              "sha256": _sha256(os.path.join(d, f))} for d, _, fs in sorted(os.walk(shards)) for f in sorted(fs)]
    doc = {"version": 1, "wheels": wheels, "shards": {"root": SHARDS, "flags": flags, "files": files,
                                                       "bytes": sum(f["size"] for f in files)}}
    with open(os.path.join(out, "MANIFEST.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    lock = {"version": 1, "wheels": [{k: w[k] for k in ("name", "version", "file", "tags", "size", "requires")}
                                     for w in wheels], "shards_bytes": doc["shards"]["bytes"]}
    with open(os.path.join(HERE, "bundle.lock.json"), "w") as f:
        json.dump(lock, f, indent=1, sort_keys=True)
        f.write("\n")
    return doc


def report(out: str, doc: dict) -> int:
    tree, bundle = tree_bytes(), dir_bytes(out)
    mib = lambda n: n / (1 << 20)  # noqa: E731
    for w in doc["wheels"]:
        print(f"  {w['file']:<72} {mib(w['size']):6.2f} MiB")
    print(f"  shards/{SHARDS:<65} {mib(doc['shards']['bytes']):6.2f} MiB")
    total = tree + bundle
    print(f"gpu bundle {out}: {mib(bundle):.2f} MiB ({len(doc['wheels'])} wheels + shards); working tree "
          f"{mib(tree):.2f} MiB; together {mib(total):.2f} MiB of the {mib(LIMIT):.0f} MiB a device call carries")
    if total > LIMIT:
        print("gpu bundle: too large for one device call", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(REPO, ".gpu-bundle"))
    a = p.parse_args(argv)
    tmp = a.out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    fetch_wheels(read_spec(), os.path.join(tmp, "wheels"))
    flags = make_shards(os.path.join(tmp, "shards"))
    shutil.rmtree(a.out, ignore_errors=True)
    os.replace(tmp, a.out)  # the bundle appears whole or not at all
    return report(a.out, write_manifest(a.out, flags))


if __name__ == "__main__":
    sys.exit(main())
