"""`loongforge bench ablation`: the seed's ablation table, measured on this machine.

The same training job (same data, seed, global batch, timed steps after warm-up) runs
under each row of the ladder (ablation/rows.py) with the real trainer on N ranks
(gloo on CPU, NCCL on GPU). Repeats are interleaved (repeat-major), so load drift on a
shared machine hits every row alike. Per row: step time median [min-max] over the
repeats; for the median repeat, the step split into data wait, exposed communication,
launch/dispatch overhead and compute (they sum to the step); activation bytes saved for
backward (saved-tensor hooks on CPU, max_memory_allocated on CUDA); samples/s; speed-up
of samples/s over row 0.

    loongforge bench ablation                       # tiny recipe, 4 ranks, 3 repeats
    loongforge bench ablation --quick               # 2 rows, 1 rank, < 90 s idle (make test-full)
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from loongforge.benchmarks.ablation import report
from loongforge.benchmarks.ablation.rows import Plan, RowSpec, ladder, sp_accepted, train_argv
from loongforge.benchmarks.harness.report import RESULTS_DIR
from loongforge.shared.errors import ConfigError
from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.daemon import CacheDaemon
from loongforge.benchmarks.harness.data import generate, transcode
from loongforge.train.recipes import RECIPES

log = logging.getLogger(__name__)
RANK_TIMEOUT_S = 600


@dataclass(frozen=True, kw_only=True, slots=True)
class AblationConfig:
    recipe: str = "tiny"
    ranks: int = 4
    repeats: int = 3
    warmup: int = 2  # untimed steps: worker start-up, first-touch, allocator settling
    steps: int = 8  # timed steps per run
    batch: int = 8  # global batch (all ranks)
    workers: int = 1  # loader workers per rank, both loaders
    # The data-bound setting: GR00T-class 224x224 frames, H.264 at the GR00T demo data's GOP 250,
    # 2 cameras, K = 4 frames per sample (BenchConfig's samples); the tiny model's step is cheap, as a GPU step is.
    episodes: int = 4
    episode_frames: tuple[int, int] = (260, 300)
    size: int = 224
    gop: int = 250
    seed: int = 0
    quick: bool = False
    only: tuple[str, ...] = ()  # row ids to run (the rest are listed as "not run"); () = all

    def __post_init__(self):
        def need(ok: bool, name: str, fix: str):
            if not ok:
                raise ConfigError(f"ablation.{name}: {fix}")

        need(self.recipe in ("tiny", "small"), "recipe", "use tiny or small")
        need(self.ranks >= 1, "ranks", "must be >= 1 (--ranks)")
        need(self.batch % self.ranks == 0, "batch", f"global batch {self.batch} must divide by --ranks {self.ranks}")
        need(self.repeats >= 1 and self.steps >= 1 and self.warmup >= 1, "repeats", "repeats, steps, warmup >= 1")

    @classmethod
    def quick_preset(cls, **kw) -> "AblationConfig":
        return cls(**{"ranks": 1, "repeats": 1, "warmup": 1, "steps": 3, "batch": 4, "episodes": 2,
                      "episode_frames": (100, 120), "size": 64, "gop": 100, "quick": True, **kw})

    def bench_config(self):
        return BenchConfig(episodes=self.episodes, episode_frames=self.episode_frames, height=self.size,
                           width=self.size, gop=self.gop, gops=(self.gop,), shard_size="4MB",
                           preprocess_workers=1 if self.quick else 2, batch_size=self.batch, seed=self.seed)


@dataclass(slots=True)
class Inputs:
    dataset: str
    shards: str
    frames: int  # K frames per camera per sample
    stride: int
    socket: str | None = None


def prepare(cfg: AblationConfig, workdir: Path) -> Inputs:
    """Generate the LeRobot dataset and transcode it with the real `loongforge preprocess`; a
    workdir that already holds the inputs of the same data settings is reused (inputs.json)."""
    bc = cfg.bench_config()
    marker = workdir / "inputs.json"
    data_key = {k: v for k, v in dataclasses.asdict(bc).items() if k not in ("batch_size",)}
    shape = {"frames": bc.frames_per_sample, "stride": bc.stride}
    if marker.exists():
        doc = json.loads(marker.read_text())
        if doc.get("data") == json.loads(json.dumps(data_key)):
            log.info("reusing the dataset and shards in %s", workdir)
            return Inputs(dataset=doc["dataset"], shards=doc["shards"], **shape)
    dataset, shards = generate(bc, workdir / "lerobot"), workdir / "shards"
    transcode(bc, dataset, shards)
    marker.write_text(json.dumps({"data": data_key, "dataset": str(dataset), "shards": str(shards)}))
    return Inputs(dataset=str(dataset), shards=str(shards), **shape)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, ranks: int, workdir: Path, threads: int) -> list[dict]:
    """Run one row's ranks to completion; their per-rank result documents."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = _free_port()
    procs = []
    for r in range(ranks):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads),
               "PYTHONUNBUFFERED": "1"}
        logf = open(out / f"rank{r}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "loongforge.benchmarks.ablation.rank",
                                        str(spec_path)], env=env, stdout=logf, stderr=subprocess.STDOUT), logf))
    deadline = time.monotonic() + RANK_TIMEOUT_S
    failed = None
    try:
        for r, (p, logf) in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0 and failed is None:
                failed = (r, rc)
                break
    finally:
        for q, logf in procs:  # a dead rank leaves its peers blocked in a collective; ^C must not orphan ranks
            if q.poll() is None:
                q.kill()
                q.wait()
            logf.close()
    if failed is not None:
        tail = (out / f"rank{failed[0]}.log").read_text().strip().splitlines()[-6:]
        raise RuntimeError(f"rank {failed[0]} exit {failed[1]}: " + " | ".join(tail))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def row_spec(cfg: AblationConfig, row: RowSpec, inputs: Inputs, run_dir: Path, cuda: bool) -> dict:
    s = row.setting
    argv = train_argv(s, shards=inputs.shards, run_dir=str(run_dir), recipe=cfg.recipe, batch=cfg.batch,
                      steps=cfg.warmup + cfg.steps + 1, seed=cfg.seed, cuda=cuda, cache_socket=inputs.socket,
                      frames=inputs.frames, stride=inputs.stride)
    spec = {"train_args": argv, "warmup": cfg.warmup, "steps": cfg.steps, "out": str(run_dir), "cuda": cuda,
            "prefetch": s.prefetch, "loader": s.loader}
    if s.loader == "pyav":
        spec["dataset"] = inputs.dataset  # the mp4 + parquet tree the shards were made from
    return spec


def measure(cfg: AblationConfig, rows: list[RowSpec], inputs: Inputs, workdir: Path, cuda: bool,
            on_progress=None) -> dict:
    """{row id: [per-repeat summaries]} for every runnable row; failures recorded, never raised."""
    runs: dict[str, list] = {r.id: [] for r in rows if r.skip is None}
    errors: dict[str, str] = {}
    threads = max(1, (os.cpu_count() or 1) // cfg.ranks) if cuda else 1
    for rep in range(cfg.repeats):
        for row in rows:
            if row.skip is not None or row.id in errors:
                continue
            run_dir = workdir / "runs" / f"{row.id}-r{rep}"
            t0 = time.perf_counter()
            try:
                docs = launch(row_spec(cfg, row, inputs, run_dir, cuda), cfg.ranks, workdir, threads)
            except Exception as exc:  # noqa: BLE001 - one broken row never hides the others
                errors[row.id] = f"failed: {exc}"
                log.error("row %s: %s", row.id, exc)
                continue
            runs[row.id].append(report.summarise_run(docs))
            if on_progress is not None:
                on_progress({"runs": runs, "errors": errors})
            log.info("row %s repeat %d: %.3f s/step (%.0f s wall)", row.id, rep, runs[row.id][-1]["step_s"],
                     time.perf_counter() - t0)
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {"runs": runs, "errors": errors}


def run(cfg: AblationConfig, out_dir: Path = RESULTS_DIR, workdir: Path | None = None, plot: bool = True):
    import torch


    cuda = torch.cuda.is_available()
    plan = Plan(ranks=cfg.ranks, cuda=cuda, sp_accepted=sp_accepted(cfg.ranks), heads=tp_heads(RECIPES[cfg.recipe]().model))
    rows = ladder(plan, quick=cfg.quick)
    if cfg.only:
        rows = [r if r.id in cfg.only or r.skip else dataclasses.replace(r, skip="not run (--rows)") for r in rows]
    tmp = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="lf-ablation-")) if tmp else Path(workdir)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "ablation-quick" if cfg.quick else f"ablation-{cfg.recipe}-{cfg.ranks}r"
    path = out_dir / f"{stem}.json"

    def write(measured: dict, final: bool) -> dict:
        doc = report.build_doc(cfg=dataclasses.asdict(cfg), plan=dataclasses.asdict(plan), rows=rows,
                               measured=measured, device="cuda" if cuda else "cpu")
        doc.update(wall_s=time.perf_counter() - t0, load_avg_start=list(load0), load_avg_end=list(os.getloadavg()),
                   date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   host=socket.gethostname(), cores=os.cpu_count(), complete=final)
        if plot and final:
            doc["plot"] = report.plot(doc, path.with_suffix(".png"))
        tmp_path = path.with_suffix(".json.tmp")
        tmp_path.write_text(json.dumps(doc, indent=1))
        os.replace(tmp_path, path)  # a long run leaves a readable partial result after every row
        return doc

    daemon = None
    try:
        inputs = prepare(cfg, workdir)
        if any(r.setting.cache and r.skip is None for r in rows):
            daemon = CacheDaemon(inputs.shards, workdir / "cache").start()
            inputs.socket = daemon.socket
        measured = measure(cfg, rows, inputs, workdir, cuda, on_progress=lambda m: write(m, False))
    finally:
        if daemon is not None:
            daemon.stop()
        if tmp:
            shutil.rmtree(workdir, ignore_errors=True)
    return write(measured, True), path


def tp_heads(m) -> int:
    """The head count TP must divide: every tower's (vision, LLM query and KV, DiT)."""
    return math.gcd(m.vision.num_attention_heads, m.text.num_attention_heads, m.text.num_key_value_heads,
                    m.dit.num_attention_heads)
