"""`loongforge bench gpu-check`'s verdicts and bookkeeping, on CPU: a test file per pytest process,
each test with its own timeout, parts that never outlast the deadline, "all skipped" is a failure, the
JSON is written after each part even when a later part dies. (The GPU parts run on a GPU.)"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pytest

from loongforge.benchmarks.micro import gpu_check


def _case(name, result, message=""):
    return {"name": name, "result": result, "message": message}


def test_all_skipped_or_nothing_collected_fails():
    skipped = [_case("t.py::a", "skipped", "needs CUDA"), _case("t.py::b", "skipped", "needs CUDA")]
    assert not gpu_check.judge_tests(skipped, "", flash=False)["ok"]
    assert not gpu_check.judge_tests([], "", flash=False)["ok"]
    assert not gpu_check.judge_tests([_case("t.py::a", "passed")], "ImportError ...", flash=False)["ok"]


def test_only_flash_attn_may_skip_and_only_when_not_installed():
    cases = [_case("t.py::a", "passed"), _case("t.py::test_flash", "skipped", "needs CUDA sm >= 8.0 and flash-attn")]
    res = gpu_check.judge_tests(cases, "", flash=False)
    assert res["ok"] and res["skipped_parts"] == ["t.py::test_flash: flash-attn is not installed (no wheel for "
                                                  "this torch)"]
    assert not gpu_check.judge_tests(cases, "", flash=True)["ok"]  # installed but skipped: a real failure
    for bad in ("killed", "failure", "error", "not run"):
        res = gpu_check.judge_tests([cases[0], _case("t.py::c", bad)], "", flash=False)
        assert not res["ok"] and res["not_ok"] == ["t.py::c"]


def test_each_test_gets_its_own_budget_and_junit(tmp_path):
    tests = tmp_path / "test_budget.py"
    tests.write_text("import time\n\ndef test_slow():\n    time.sleep(60)\n\n\ndef test_quick():\n    pass\n")
    slow = gpu_check.run_test(f"{tests}::test_slow", str(tmp_path), timeout=3)
    assert slow["result"] == "failure" and "Timeout" in slow["message"] and slow["seconds"] < 40
    quick = gpu_check.run_test(f"{tests}::test_quick", str(tmp_path), timeout=60)
    assert quick["result"] == "passed"
    assert not list(tmp_path.glob("junit-*.xml"))


def _args(tmp_path, **kw):
    ns = argparse.Namespace(out=str(tmp_path), steps=2, skip_tests=False, test_timeout=60, run_timeout=60, jobs=2,
                            deadline=600, shards=None, cache_dir=str(tmp_path / "cache"))
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(gpu_check, "environment", lambda: {"torch": "2.13.0", "cuda": "13.0", "cuda_available": True})
    monkeypatch.setattr(gpu_check, "collect_gpu_tests", lambda: (["t.py::a", "t.py::b"], ""))
    monkeypatch.setattr(gpu_check, "serve_latency", lambda out, part: {"ok": True, "line": "serve: p50 9 ms"})


def _group(result, message=""):
    return lambda path, nodes, out, timeout, test_timeout: [_case(n, result, message) for n in nodes]


def _ok_runs(report, a, part):
    report.data["runs"] = [{"recipe": "tiny", "ok": True, "seconds": 1}]
    report.data["launch_overhead"] = {"ok": True, "eager": {"launch_overhead_s": 0, "step_s": 1},
                                      "cuda_graphs": {"launch_overhead_s": 0, "step_s": 1}}


def test_report_is_written_when_a_later_part_dies(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "_runs", _ok_runs)

    def die(*a, **kw):
        raise RuntimeError("the test part died")

    monkeypatch.setattr(gpu_check, "gpu_tests", die)
    with pytest.raises(RuntimeError):
        gpu_check.handle(_args(tmp_path))
    (report,) = tmp_path.glob("gpu-check-*.json")
    data = json.loads(report.read_text())
    assert data["runs"][0]["ok"] and not data["finished"] and not data["ok"]
    assert data["budget_s"]["tests"] == data["budget_s"]["deadline"] == 600


def test_all_skipped_exits_non_zero(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "run_group", _group("skipped", "needs CUDA"))
    monkeypatch.setattr(gpu_check, "_runs", _ok_runs)
    assert gpu_check.handle(_args(tmp_path)) == 1
    assert gpu_check.handle(_args(tmp_path, skip_tests=True)) == 1  # the tests are a part that must run
    monkeypatch.setattr(gpu_check, "run_group", _group("passed"))
    assert gpu_check.handle(_args(tmp_path)) == 0
    (txt,) = {p.read_text() for p in tmp_path.glob("gpu-check-*.txt")} - set()
    assert "gpu-check tests: 2 collected, 2 ran, 2 passed, 0 failed, 0 not reached" in txt
    assert "\nserve: p50 9 ms\n" in txt  # the serve part's one line


@pytest.mark.parametrize("p50, says", [(31.5, "p50 31.5 / p95 40.0 / p99 45.0 ms (goal p50 < 50 ms: met)"),
                                       (75.0, "(goal p50 < 50 ms: NOT met)")])
def test_the_serve_part_is_one_line_against_the_goal(monkeypatch, tmp_path, p50, says):
    row = {"recipe": "gr00t-n1.6", "batch": 1, "clients": 1, "p50_ms": p50, "p95_ms": 40.0, "p99_ms": 45.0,
           "server_ms": {"decode": 1.0, "preprocess": 2.0, "model": 25.0, "encode": 0.5}}
    doc = {"gpu": "H200", "rows": [{**row, "batch": 8}, row]}
    calls = []
    monkeypatch.setattr(gpu_check, "_run", lambda cmd, timeout, **kw: calls.append(cmd) or (0, json.dumps(doc), 9.0))
    res = gpu_check.serve_latency(str(tmp_path), gpu_check.Part("serve", time.monotonic() + 100))
    assert res["ok"] and says in res["line"] and "model 25.0" in res["line"] and "\n" not in res["line"]
    assert calls[0][3:7] == ["bench", "serve", "--device", "cuda"]
    monkeypatch.setattr(gpu_check, "_run", lambda cmd, timeout, **kw: (1, "Traceback: boom", 2.0))
    assert not gpu_check.serve_latency(str(tmp_path), gpu_check.Part("serve", time.monotonic() + 100))["ok"]


def test_tests_past_the_deadline_are_not_run_and_fail(fake_gpu, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(gpu_check, "run_group", lambda path, nodes, *a: ran.extend(nodes) or [])
    res = gpu_check.gpu_tests(str(tmp_path), 60, gpu_check.Part("tests", time.monotonic()), save=lambda part: None)
    assert not ran and not res["ok"] and {c["result"] for c in res["cases"]} == {"not run"}
    assert gpu_check.tally({"tests": res, "runs": []})["tests"] == {"collected": 2, "ran": 0, "passed": 0,
                                                                    "failed": 0, "not_reached": 2}


@pytest.mark.parametrize("deadline", [1.0, 60.0, 420.0, 3600.0])
def test_the_parts_never_outlast_the_deadline(deadline):
    t0 = 1000.0
    parts = gpu_check.plan_parts(t0, deadline)
    assert list(parts) == list(gpu_check.BUDGET) and sum(gpu_check.BUDGET.values()) <= 1.0
    ends = [p.end for p in parts.values()]
    assert ends == sorted(ends) and ends[-1] == t0 + deadline and all(e <= t0 + deadline for e in ends)
    late = gpu_check.Part("x", time.monotonic() + 5)
    assert 4 < late.timeout(600) <= 5 and late.timeout(2) == 2  # a process gets what its part has left


def test_a_test_file_runs_in_one_process_with_a_timeout_per_test(tmp_path):
    tests = tmp_path / "test_group.py"
    tests.write_text("import os, time\n\nPID = os.getpid()\n\n"
                     "def test_a():\n    open(os.environ['PIDS'], 'a').write(f'{PID}\\n')\n\n"
                     "def test_b():\n    open(os.environ['PIDS'], 'a').write(f'{PID}\\n')\n\n"
                     "def test_slow():\n    time.sleep(60)\n")
    pids = tmp_path / "pids"
    nodes = [f"{tests}::test_a", f"{tests}::test_b", f"{tests}::test_slow"]
    import os

    os.environ["PIDS"] = str(pids)
    try:
        res = gpu_check.run_group(str(tests), nodes, str(tmp_path), timeout=120, test_timeout=1)
    finally:
        del os.environ["PIDS"]
    assert [r["result"] for r in res] == ["passed", "passed", "failure"] and "Timeout" in res[2]["message"]
    assert len(set(pids.read_text().split())) == 1  # one process for the file


def test_a_flash_attn_that_does_not_import_is_not_installed(tmp_path, monkeypatch):
    """A flash-attn wheel built for another torch is on the path but its CUDA extension fails to load;
    its tests then skip, and that skip is allowed only if the check reports flash-attn as not usable."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda: undefined symbol: _ZN3c104cuda9SetDevice')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert not gpu_check.flash_attn_installed()
    (pkg / "__init__.py").write_text("__version__ = '2.8.3'\n")
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert gpu_check.flash_attn_installed()


def test_gpu_test_modules_import_without_the_optional_gpu_packages(monkeypatch):
    """No GPU test module skips (or fails) at import when torchao or flash-attn is missing: a module-level
    importorskip turned the FP8 GPU tests into skips, which the check counts as failures on a machine
    without torchao; those tests must run and say what is missing."""
    import importlib.util
    import pathlib

    monkeypatch.setitem(sys.modules, "torchao", None)  # an import of torchao (or torchao.*) raises ImportError
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    tests = pathlib.Path(__file__).resolve().parents[1]
    for path in sorted(tests.rglob("test_*.py")):
        text = path.read_text()
        if "mark.gpu" not in text:
            continue
        spec = importlib.util.spec_from_file_location(f"_gpu_import_probe_{path.stem}", path)
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except BaseException as exc:  # noqa: BLE001 - pytest's Skipped is a BaseException
            pytest.fail(f"{path.relative_to(tests)}: importing it without torchao/flash-attn raised "
                        f"{type(exc).__name__}: {exc}")


def _fake_wheel(folder, version: str) -> None:
    import zipfile

    dist = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


def test_make_gpu_check_installs_the_cuda_pin_from_its_index_alone(tmp_path):
    """`make gpu-check`'s torch install (its GPU_PIP_ENV prefix): `torch==2.13.0` also matches
    2.13.0+cpu, which sorts higher, so a find-links of the CPU wheelhouse, from PIP_FIND_LINKS or from
    a pip.conf (an empty PIP_FIND_LINKS does not override that), would reinstall the CPU build."""
    import re
    import shlex
    import subprocess

    from loongforge.benchmarks.harness.report import SOURCE_CHECKOUT

    make = (SOURCE_CHECKOUT / "Makefile").read_text()
    prefix = shlex.split(re.search(r"^GPU_PIP_ENV\s*:?=\s*(.+)$", make, re.M).group(1))
    assert "$(GPU_PIP_ENV) $(BIN)/pip install -q --index-url $(GPU_TORCH_INDEX) '$(TORCH)'" in make
    cpu, index = tmp_path / "wheelhouse", tmp_path / "index" / "torch"
    cpu.mkdir()
    index.mkdir(parents=True)
    _fake_wheel(cpu, "2.13.0+cpu")
    _fake_wheel(index, "2.13.0")
    (index / "index.html").write_text('<a href="torch-2.13.0-py3-none-any.whl">torch-2.13.0-py3-none-any.whl</a>')
    conf = tmp_path / "xdg" / "pip"
    conf.mkdir(parents=True)
    (conf / "pip.conf").write_text(f"[global]\nfind-links = {cpu}\n")
    env = dict(os.environ, PIP_FIND_LINKS=str(cpu), XDG_CONFIG_HOME=str(tmp_path / "xdg"), PIP_NO_INPUT="1")
    report = tmp_path / "report.json"
    cmd = [*prefix, sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "-q",
           "--report", str(report), "--index-url", (tmp_path / "index").as_uri(), "torch==2.13.0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["version"] == "2.13.0", item["download_info"]["url"]
