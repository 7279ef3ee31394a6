"""The training run of one rank, top to bottom: preflight -> process group and parallel plan ->
build_model -> parallelize (TP, SP, FP8, fusion/graphs, AC, ZeRO engine) -> loader -> resume ->
steps -> final checkpoint -> close, with every resource closed on every exit path
(`Trainer(cfg)`, `.run()`, `.close()`; launch.py drives it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time

import numpy as np
import torch

from loongforge.train.ckpt import checkpoint, fallback as ckpt_fallback, files as ckpt_files
from loongforge.train.config import TrainConfig
from loongforge.train.data import training_data
from loongforge.train.eval.validation import ValSet, val_metrics, val_sample_ids
from loongforge.train.model.build import build_model
from loongforge.train.model.noise import noise_for
from loongforge.train.observe.metrics import MetricsLog
from loongforge.train.observe.profiler import LateWriter, StepTimer, TraceWindow
from loongforge.train.parallel import plan
from loongforge.train.parallel.comm import StepComm
from loongforge.train.parallel.engine import (comm_seconds, init_distributed, param_counts, pick_device,
                                              release_cpu_shm_buffers, write_ds_config)
from loongforge.train.parallel.parallelize import parallelize
from loongforge.train.preflight import preflight
from loongforge.train.resilience.nan_guard import NanGuard
from loongforge.train.resilience.watchdog import Watchdog

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.device = pick_device(cfg.run.device)
        checked = preflight(cfg)  # config errors fail here, before any process group (exit code 2)
        self.index, self.model_cfg = checked.index, checked.model_cfg
        self.rank, self.world = init_distributed(self.device, cfg.parallel.dist_timeout_s)
        self.par = plan.initialize(plan.plan_of(cfg))  # every process group of the TP x SP x DP plan, once
        # The loader reads by DP coordinate: the TP ranks of one replica get the same batch.
        self.data_rank, self.data_world = self.par.get_data_parallel_rank(), self.par.get_data_parallel_world_size()
        torch.manual_seed(cfg.data.seed)  # identical initial weights on every rank
        # The model is handed over as a factory: ZeRO-3 constructs it already partitioned (parallelize.py).
        built = parallelize(functools.partial(build_model, self.model_cfg), cfg, self.par, device=self.device)
        self.engine, self.ds_conf, self.policies = built.engine, built.ds_config, built.policies
        self.dp_sync = built.dp_sync  # --grad-compression topk, else None
        self.params, _ = param_counts(self.engine.module)  # the full count, also when ZeRO-3 partitioned it
        self.nan_guard = NanGuard(self.engine, policy=cfg.faults.nan_policy, rank=self.rank, device=self.device,
                                  max_consecutive=cfg.faults.nan_max_consecutive)
        self.step_comm = StepComm()  # bytes per step and group kind, into metrics.jsonl
        d = cfg.data
        accum = cfg.parallel.grad_accum
        # samples are (episode, t), block-aware order, training episodes only (train/data/loader.py)
        self.loader = training_data.make_loader(d, self.index, batch_size=d.global_batch_size // accum,
                                                rank=self.data_rank, world=self.data_world, device=self.device)
        self.valset = self._valset()
        f = cfg.faults
        self.watchdog = Watchdog(rank=self.rank, world=self.world, run_dir=cfg.run.run_dir, heartbeat_s=f.heartbeat_s,
                                 hang_timeout_s=f.hang_timeout_s,
                                 closers=[self.loader.close, lambda: release_cpu_shm_buffers(self.world)])
        r = cfg.run
        self.ckpt = checkpoint.Checkpointer(self.engine, r.run_dir, rank=self.rank, world=self.world,
                                            device=self.device, background=r.save_async, when_busy=r.save_busy,
                                            keep_last=r.keep_last, write_mbps=r.save_mbps,
                                            peer_timeout_s=cfg.parallel.dist_timeout_s, full_every=r.full_every,
                                            delta_max_ratio=r.delta_max_ratio)
        self.step = 0
        self.save_stall_s: list[float] = []
        if cfg.run.resume:
            self._resume()
        self.metrics = MetricsLog(cfg.run.run_dir, enabled=self.rank == 0, resume=self.step > 0 or cfg.run.resume,
                                  log_every=cfg.run.log_every, keep_below=self.step)
        if self.rank == 0:
            os.makedirs(cfg.run.run_dir, exist_ok=True)
            write_ds_config(self.ds_conf, cfg.run.run_dir)
            log.info("model %s: %.2fM params, %d ranks, device %s, ZeRO-%d", cfg.recipe, self.params / 1e6,
                     self.world, self.device, cfg.parallel.zero_stage)

    def _valset(self):
        """The fixed validation subset --eval-every scores (None when off)."""
        run, d = self.cfg.run, self.cfg.data
        if not run.eval_every:
            return None
        ids = val_sample_ids(self.index, run.eval_samples, d.sample_stride)  # raises ConfigError without a split
        return ValSet(self.index, ids, batch_size=8, text_len=d.max_text_tokens, device=self.device,
                      image_mean=d.image_mean, image_std=d.image_std)

    def _resume(self) -> None:
        tag = ckpt_files.latest_tag(self.cfg.run.run_dir)
        if tag is None:
            log.info("--resume: no checkpoint in %s yet, starting fresh", self.cfg.run.run_dir)
            return
        # A corrupt or incomplete `latest` falls back to the previous verified checkpoint (ckpt/fallback.py).
        tag = ckpt_fallback.pick_resume_tag(self.cfg.run.run_dir, tag, rank=self.rank, device=self.device)
        checkpoint.check_resume_layout(ckpt_files.read_sidecar(self.cfg.run.run_dir, tag), self.par, tag,
                                       self.world, run_dir=self.cfg.run.run_dir,
                                       zero_stage=self.cfg.parallel.zero_stage)
        doc = checkpoint.load(self.engine, self.cfg.run.run_dir, tag, rank=self.rank, world=self.world,
                              zero_stage=self.cfg.parallel.zero_stage, device=self.device)
        self.loader.load_state_dict(doc["loader"])
        self.step = int(doc["step"])
        sched = self.engine.lr_scheduler
        if not sched.loaded:  # a weights-only resume (another layout, no reshard): the schedule goes on from here
            sched.fast_forward(self.step)
        if self.dp_sync is not None:
            self.dp_sync.load(os.path.join(ckpt_files.ckpt_root(self.cfg.run.run_dir), tag))
        log.info("resumed from %s at step %d (loader epoch %d, consumed %d)", tag, self.step,
                 doc["loader"]["epoch"], doc["loader"]["consumed"])

    def run(self) -> None:
        run = self.cfg.run
        start = self.step
        timer = StepTimer(self.device)
        trace = TraceWindow(run.run_dir, self.rank, run.profile_steps, self.device)
        late = LateWriter(self.metrics.write)  # CUDA timings are read one step late: no sync per step
        it = iter(self.loader)
        self.watchdog.start()  # heartbeats from here; startup (engine, resume) is not judged
        try:
            while self.step < run.steps:
                self.watchdog.progress(self.step)
                trace.before(self.step)
                timing, record = self._one_step(it, timer, sync=trace.active)
                record["warmup"] = self.step == start  # first step of this process: report skips it
                if self.save_stall_s:
                    record["save_s"] = self.save_stall_s.pop()  # the previous step's save, blocking part
                trace.after(self.step)
                if self.valset is not None and (self.step + 1) % run.eval_every == 0:
                    record.update(val_metrics(self.engine.module, self.valset, seed=self.cfg.data.seed))
                late.push(timing, record)
                self.step += 1
                if run.save_every and self.step % run.save_every == 0 and self.step < run.steps:
                    late.flush()
                    self.save()
            late.flush()
            if self.step > start:
                self.watchdog.progress(self.step, "save")
                self.save(final=True)
            self.watchdog.stop(done=True)
        finally:
            with contextlib.suppress(Exception):  # after a failure: the steps that did finish are still logged
                late.flush()
            trace.close()

    def _one_step(self, it, timer: StepTimer, sync: bool = False) -> tuple:
        e, accum = self.engine, self.cfg.parallel.grad_accum
        comm_seconds()  # drop collectives from outside the step (checkpoint saves, logging)
        self.policies.on_step(self.step)
        lr = self.engine.lr_scheduler.get_last_lr()[0]  # this step's; the boundary step advances the schedule
        timer.begin(sync=sync)
        self.step_comm.begin()
        losses, ids = [], []
        for micro in range(accum):
            self.watchdog.phase = "data"  # a hang here is this rank's own, not a peer's collective
            with timer.phase("data_wait"):
                batch = next(it)
            self.watchdog.phase = "step"
            meta = batch.pop("meta")
            ids.append(meta["sample_ids"])
            shape = batch["action"].shape
            noise, t = noise_for(self.cfg.data.seed, meta["epoch"], meta["sample_ids"], shape, self.device)
            self.policies.before_forward()  # --cuda-graphs: a new graph-tree iteration
            with timer.phase("forward"):
                out = e(batch, noise, t)
                out["loss"] = self.nan_guard.observe(self.step, out["loss"])
            with timer.phase("backward"):
                e.backward(out["loss"])
                if self.dp_sync is not None:
                    self.dp_sync()  # compressed gradient sync across DP replicas (hybrid sharding)
            with timer.phase("optimizer"):
                if micro < accum - 1:
                    e.step()  # inside the accumulation window: DeepSpeed only counts it
                else:  # the boundary: skipped on every rank when any rank's loss was non-finite
                    skipped = self.nan_guard.step(self.step)
            losses.append(torch.stack([out["loss"].detach().float(), out["flow_loss"].float(),
                                       out["ce_loss"].float()]))
        comm = comm_seconds() if self.device.type == "cpu" else None
        timing = timer.stop(comm)
        rec = {"epoch": meta["epoch"], "epoch_pos": meta["consumed"],  # where this step's batch came from
               "lr": lr,
               "comm_groups": self.step_comm.end(), "nonfinite_skip": skipped,
               "nonfinite_skips": self.nan_guard.skipped}
        return timing, self._gather(rec, torch.stack(losses).mean(0), np.concatenate(ids))

    def _gather(self, rec: dict, losses: torch.Tensor, ids: np.ndarray) -> dict:
        """One all_gather per step for the log line: every rank's losses and sample ids."""
        t0 = time.perf_counter()
        mine = torch.cat([losses.cpu().double(), torch.from_numpy(ids.astype(np.float64)),
                          torch.tensor([self.loader.bad_samples], dtype=torch.float64)])
        if self.world > 1:
            dev_t = mine.to(self.device)
            out = [torch.empty_like(dev_t) for _ in range(self.world)]
            torch.distributed.all_gather(out, dev_t)
            allr = torch.stack(out).cpu()[plan.replica_ranks(self.par, self.world)]  # no TP copies
        else:
            allr = mine[None]
        n = len(ids)
        rec.update(step=self.step, loss=float(allr[:, 0].mean()), flow_loss=float(allr[:, 1].mean()),
                   ce_loss=float(allr[:, 2].mean()), samples=n * len(allr), **plan.layout(self.par),
                   sample_ids=[[int(v) for v in row[3:3 + n]] for row in allr],
                   bad_samples=int(allr[:, -1].sum()), log_s=time.perf_counter() - t0, world=self.world)
        return rec

    def save(self, final: bool = False) -> str | None:
        t0 = time.perf_counter()
        blobs = () if self.dp_sync is None else self.dp_sync.blobs()  # per-rank compression residuals
        tag = self.ckpt.save(step=self.step, loader_state=self.loader.state_dict(), final=final, blobs=blobs,
                             extra={"recipe": self.cfg.recipe, "zero_stage": self.cfg.parallel.zero_stage,
                                    "parallel": plan.layout(self.par),
                                    "global_batch_size": self.cfg.data.global_batch_size,
                                    # What Policy.load needs to rebuild the model and its input transform.
                                    "model": dataclasses.asdict(self.model_cfg),
                                    "data": {"image_mean": self.cfg.data.image_mean,
                                             "image_std": self.cfg.data.image_std,
                                             "max_text_tokens": self.cfg.data.max_text_tokens,
                                    # the sample shape Policy.load rebuilds (data/training_data.py)
                                    "video_deltas": list(self.cfg.data.video_deltas),
                                    "state_deltas": list(self.cfg.data.state_deltas),
                                    "action_pad": self.cfg.data.action_pad}})
        self.save_stall_s = [time.perf_counter() - t0]  # what the step loop waited for; logged with the next step
        return tag

    def close(self) -> None:
        # A clean run ends with a synchronous save, so a save still in flight here means a failure: its peers
        # may be gone, and launchers SIGKILL ranks that take long to stop (deepspeed's after 30 s), which
        # would skip the rest of this teardown. `latest` still names the previous complete checkpoint.
        for closer in (lambda: self.watchdog.stop(done=False), lambda: self.ckpt.close(timeout_s=3.0),
                       self.loader.close, self.metrics.close,
                       self.step_comm.close):
            try:
                closer()
            except Exception as exc:  # noqa: BLE001 - close the rest, then report
                log.warning("close failed: %s", exc)

