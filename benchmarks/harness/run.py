"""`loongforge bench data`: LoongForge's data path against the loaders users run today,
timed in the same run on the same machine; one markdown table, results/<date>-<host>.json
(+ .png beside it).

Order of work: generate a LeRobot dataset -> transcode it with the real `loongforge
preprocess` -> start a real cache daemon on the shard root and warm it -> P1..P5 -> the
component benchmarks (benchmarks/loader/preprocess.py, benchmarks/loader/cache.py) ->
JSON + PNG + markdown table. A row whose component is missing says "not available:
<reason>"; a row that crashes says "failed: <error>" and the rest still run, so one broken
service never hides the others' figures.
"""

from __future__ import annotations

import argparse
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

from loongforge.benchmarks.harness import report
from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.context import Context
from loongforge.benchmarks.harness.daemon import CacheDaemon
from loongforge.benchmarks.harness.data import prepare
from loongforge.benchmarks.harness.report import RESULTS_DIR
from loongforge.benchmarks.harness.rows import Row, component_row
from loongforge.benchmarks.loader import fast_path as lf
from loongforge.benchmarks.loader.onetime_rows import p4_rows, p5_rows
from loongforge.benchmarks.loader.p1_rows import p1_rows
from loongforge.benchmarks.loader.p2_rows import p2_rows
from loongforge.benchmarks.loader.p3_rows import p3_rows
from loongforge.shared.errors import ConfigError

log = logging.getLogger(__name__)
SECTIONS = (("P1", "Loader samples/s", p1_rows), ("P2", "Frames/s per worker vs zstd limit", p2_rows),
            ("P3", "Data-bound training", p3_rows), ("P4", "Cold start", None), ("P5", "Preprocess cost", p5_rows))
COMPONENTS = (("preprocess", "loongforge.benchmarks.loader.preprocess"),
              ("cache", "loongforge.benchmarks.loader.cache"))


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


def run(cfg: BenchConfig, *, out_dir: Path = RESULTS_DIR, workdir: Path | None = None,
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
            inputs = {"dataset": prep.dataset, "shards": prep.shards, "samples": prep.num_samples,
                      "generate_s": prep.generate_s, "transcode_s": prep.transcode_s}
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


def _measure(cfg: BenchConfig, prep, workdir: Path, stack: ExitStack, inputs: dict) -> list[Row]:
    rows: list[Row] = []
    shard_index = lf.shard_index_of(prep.shards)
    socket, label, cache_reason = None, "origin mmap", None
    try:
        daemon = stack.enter_context(CacheDaemon(prep.shards, workdir / "hot", ram_budget=cfg.ram_budget))
        inputs["warm_cache"] = lf.warm_cache(prep.shards, shard_index, daemon.socket)
        socket, label = daemon.socket, "cache daemon, hot"
    except Exception as exc:  # noqa: BLE001 - the rows then read the origin, and say so
        log.error("cache daemon unusable:\n%s", traceback.format_exc())
        cache_reason = f"cache daemon unusable ({type(exc).__name__}: {exc})"[:300]
        label = f"origin mmap; cache not available: {cache_reason}"
    inputs["loongforge_source"] = label
    ctx = Context(cfg=cfg, prep=prep, socket=socket, source_label=label)
    for sid, title, fn in SECTIONS:
        if sid == "P4":
            _section(rows, sid, title, p4_rows, ctx, cache_reason)
        else:
            _section(rows, sid, title, fn, ctx)
        if socket is not None and sid == "P3":  # the hot daemon served P1-P3
            inputs["hot_cache_counters_after_p1_p3"] = lf.cache_counters(prep.shards, shard_index, socket)
    return rows


def _counts(text: str, what: str, low: int) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {what}, e.g. 0,1,2") from None
    if not vals or min(vals) < low:
        raise argparse.ArgumentTypeError(f"{text!r}: {what} must be >= {low}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat (< 2 min; what CI runs)")
    p.add_argument("--repeats", type=int, help="repeats per figure (median and min-max reported); "
                                               "default 3, 1 with --quick")
    p.add_argument("--workers", type=lambda t: _counts(t, "worker counts", 0),
                   help="loader worker counts to compare (default 0,1,2)")
    p.add_argument("--gops", type=lambda t: _counts(t, "keyframe intervals", 1),
                   help="P1's keyframe intervals, e.g. 2,20,250 (default 2,20,250; 2,20,100 with --quick); "
                        "the largest is the source GOP of the shards")
    p.add_argument("--batch-size", type=int, help="samples per batch, both loaders (default 8, 4 with --quick)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"results folder (default {RESULTS_DIR})")
    p.add_argument("--workdir", type=Path, help="keep the generated dataset and shards here (default: a temp dir); "
                                              "must be new, empty or an earlier bench workdir: it is wiped")
    p.add_argument("--no-components", action="store_true",
                   help="skip the folded-in component benchmarks (benchmarks/loader/preprocess.py, cache.py)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")


def handle(args: argparse.Namespace) -> int:
    base = BenchConfig.quick_preset() if args.quick else BenchConfig()
    cfg = base.with_overrides(repeats=args.repeats, workers=args.workers, batch_size=args.batch_size, gops=args.gops,
                              gop=max(args.gops) if args.gops else None,
                              components=False if args.no_components else None)
    doc, path = run(cfg, out_dir=args.out, workdir=args.workdir, plot=not args.no_plot)
    print(report.markdown_table(doc))
    print(f"\nresults: {path}" + (f" (plot: {path.with_suffix('.png')})" if doc.get("plot") else ""))
    failed = [r["id"] for r in doc["rows"] if r["status"].startswith("failed")]
    return 1 if failed else 0
