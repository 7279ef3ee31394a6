"""`loongforge bench`: build the inputs once, run every row, write the results.

Order of work: generate a LeRobot dataset -> transcode it with the real
`loongforge preprocess`, format 2 (the default) and format 1 -> start a real cache
daemon per root and warm it -> P1..P5 (P2-P5 on format 2 unless `--format 1`) ->
the component benchmarks (benchmarks/loader/preprocess.py, benchmarks/loader/cache.py) ->
JSON + PNG + markdown table. A row whose component is missing says
"not available: <reason>"; a row that crashes says "failed: <error>" and the
rest still run, so one broken service never hides the others' figures.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import logging
import os
import shutil
import tempfile
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

from loongforge.benchmarks.loader import fast_path as lf
from loongforge.benchmarks.harness import report
from loongforge.benchmarks.harness.report import RESULTS_DIR
from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.daemon import CacheDaemon
from loongforge.benchmarks.harness.data import prepare
from loongforge.benchmarks.harness.context import Context
from loongforge.benchmarks.loader.p2_rows import p2_rows
from loongforge.benchmarks.loader.p1_rows import p1_rows
from loongforge.benchmarks.loader.onetime_rows import p4_rows, p5_rows
from loongforge.benchmarks.harness.rows import Row, component_row
from loongforge.shared.errors import ConfigError
from loongforge.benchmarks.loader.p3_rows import p3_rows

log = logging.getLogger(__name__)
DEFAULT_OUT = RESULTS_DIR
SECTIONS = (("P1", "Loader samples/s", p1_rows), ("P2", "Frames/s per worker vs zstd limit", p2_rows),
            ("P3", "Data-bound training", p3_rows), ("P4", "Cold start", None), ("P5", "Preprocess cost", p5_rows))
COMPONENTS = (("preprocess", "loongforge.benchmarks.loader.preprocess"), ("cache", "loongforge.benchmarks.loader.cache"))


def _section(rows: list[Row], sid: str, title: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        got = fn(*args)
    except Exception as exc:  # noqa: BLE001 - record and go on: the other rows still mean something
        log.error("%s failed:\n%s", sid, traceback.format_exc())
        got = [Row(id=sid, title=title, unit="", status=f"failed: {type(exc).__name__}: {exc}"[:400])]
    for row in got:
        row.extra.setdefault("section_wall_s", time.perf_counter() - t0)
    rows.extend(got)


def _components(quick: bool) -> list[dict]:
    out = []
    for kind, module_name in COMPONENTS:
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            out.append({"id": f"C-{kind}", "title": f"benchmarks/{kind}.py", "status": f"not available: {exc}",
                        "raw": {}})
            continue
        try:
            raws = module.run(quick)
            out.extend(component_row(kind, i, raw) for i, raw in enumerate(raws))
        except Exception as exc:  # noqa: BLE001
            log.error("component %s failed:\n%s", kind, traceback.format_exc())
            out.append({"id": f"C-{kind}", "title": f"benchmarks/{kind}.py", "raw": {},
                        "status": f"failed: {type(exc).__name__}: {exc}"[:400]})
        log.info("component %s took %.1fs", kind, time.perf_counter() - t0)
    return out


WORKDIR_MARK = ".loongforge-bench"


def _claim_workdir(workdir: Path) -> None:
    """Every run regenerates (the transcode is one of the figures), so an old
    workdir is wiped: only one this bench made, never a folder with other files."""
    if workdir.exists() and any(workdir.iterdir()):
        if not (workdir / WORKDIR_MARK).exists():
            raise ConfigError(f"--workdir {workdir}: not empty and not made by `loongforge bench`; "
                              "give a new or empty folder (it is wiped on every run)")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / WORKDIR_MARK).write_text("made by loongforge bench; wiped on every run\n")


def _unavailable_all(reason: str) -> list[Row]:
    return [Row.unavailable(sid, title, reason) for sid, title, _ in SECTIONS]


def run(cfg: BenchConfig, *, out_dir: Path = DEFAULT_OUT, workdir: Path | None = None,
        plot: bool = True) -> tuple[dict, Path]:
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    machine = report.machine_info()
    rows: list[Row] = []
    inputs: dict = {}
    with ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loongforge-bench-")))
        else:
            _claim_workdir(workdir)
        try:
            prep = prepare(cfg, workdir)
        except Exception as exc:  # noqa: BLE001 - no inputs, no rows; say why for each
            log.error("preparing the inputs failed:\n%s", traceback.format_exc())
            rows = _unavailable_all(f"inputs could not be prepared ({type(exc).__name__}: {exc})"[:400])
            prep = None
        if prep is not None:
            inputs = {"dataset": prep.dataset, "shards": prep.shards, "index": prep.index.summary(),
                      "generate_s": prep.generate_s, "transcode_s": prep.transcode_s,
                      "shards_v2": prep.shards_v2, "transcode_v2_s": prep.transcode_v2_s,
                      "ours_format": cfg.ours_format}
            rows = _measure(cfg, prep, workdir, stack, inputs)
    components = _components(cfg.quick) if cfg.components else []
    doc = {"result_version": report.RESULT_VERSION, "started": started.isoformat(timespec="seconds"),
           "wall_s": time.perf_counter() - t0, "config": cfg.to_dict(), "machine": machine, "inputs": inputs,
           "rows": [r.to_dict() for r in rows], "components": components}
    doc["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    path = report.result_path(out_dir, started, machine["host"])
    if plot:
        png = report.plot(doc, path.with_suffix(".png"))
        doc["plot"] = png.name if png else None
    report.write_json(path, doc)
    return doc, path


def _v2_daemon(cfg: BenchConfig, prep, workdir: Path, stack: ExitStack, inputs: dict) -> tuple[str | None, str]:
    """A second daemon, warmed the same way, for the format-2 root: P1's v2 cells read hot like v1's."""
    from loongforge.shared.dataset_v2 import open_v2

    try:
        daemon = stack.enter_context(CacheDaemon(prep.shards_v2, workdir / "hot2", ram_budget=cfg.ram_budget))
        shard_index = open_v2(prep.shards_v2).shard_index  # shard names and bytes: what the daemon serves
        inputs["warm_cache_v2"] = lf.warm_cache(prep.shards_v2, shard_index, daemon.socket)
        return daemon.socket, "cache daemon, hot"
    except Exception as exc:  # noqa: BLE001 - the v2 cells then read the origin, and say so
        log.error("format-2 cache daemon unusable:\n%s", traceback.format_exc())
        return None, f"origin mmap; cache not available: {type(exc).__name__}: {exc}"[:300]


def _measure(cfg: BenchConfig, prep, workdir: Path, stack: ExitStack, inputs: dict) -> list[Row]:
    rows: list[Row] = []
    missing = lf.loader_status()
    if missing:
        return _unavailable_all(missing)
    cache_reason = lf.cache_status()
    socket, label = None, "origin mmap"
    if cache_reason is None:
        try:
            daemon = stack.enter_context(CacheDaemon(prep.shards, workdir / "hot", ram_budget=cfg.ram_budget))
            inputs["warm_cache"] = lf.warm_cache(prep.shards, prep.index, daemon.socket)
            socket, label = daemon.socket, "cache daemon, hot"
        except Exception as exc:  # noqa: BLE001
            log.error("cache daemon unusable:\n%s", traceback.format_exc())
            cache_reason = f"cache daemon unusable ({type(exc).__name__}: {exc})"[:300]
    if cache_reason is not None:
        label = f"origin mmap; cache not available: {cache_reason}"
    inputs["loongforge_source"] = label
    ctx = Context(cfg=cfg, prep=prep, socket=socket, source_label=label)
    if socket is not None and prep.shards_v2:
        ctx.socket_v2, ctx.source_label_v2 = _v2_daemon(cfg, prep, workdir, stack, inputs)
    for sid, title, fn in SECTIONS:
        if sid == "P4":
            _section(rows, sid, title, p4_rows, ctx, cache_reason)
        else:
            _section(rows, sid, title, fn, ctx)
        if socket is not None and sid == "P3":  # the hot daemon served P1-P3
            inputs["hot_cache_counters_after_p1_p3"] = lf.cache_counters(prep.shards, prep.index, socket)
            if ctx.socket_v2 is not None:
                inputs["hot_cache_counters_v2_after_p1_p3"] = lf.cache_counters(
                    prep.shards_v2, lf.shard_index_of(prep.shards_v2, 2), ctx.socket_v2)
    return rows
