"""The training run of one rank, top to bottom: preflight -> process group and parallel plan ->
build_model -> parallelize (TP, SP, FP8, fusion/graphs, AC, ZeRO engine) -> loader -> resume ->
steps -> final checkpoint -> close, with every resource closed on every exit path
(`Trainer(cfg)`, `.run()`, `.close()`; launch.py drives it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time

import numpy as np
import torch

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt import checkpoint, fallback as ckpt_fallback, files as ckpt_files
from loongforge.train.config import TrainConfig
from loongforge.train.ckpt.gr00t import load_gr00t_weights
from loongforge.train.data import training_data
from loongforge.train.eval.validation import ValSet, val_metrics, val_sample_ids
from loongforge.train.model.build import build_model
from loongforge.train.kernels.dropout import sample_keys
from loongforge.train.model.noise import noise_for
from loongforge.train.observe.metrics import MetricsLog
from loongforge.train.observe.profiler import LateWriter, StepTimer, TraceWindow
from loongforge.train.observe.tracking import Tracker
from loongforge.train.parallel import plan
from loongforge.train.parallel.comm import StepComm
from loongforge.train.parallel.engine import (comm_seconds, init_distributed, param_counts, pick_device,
                                              release_cpu_shm_buffers, write_ds_config)
from loongforge.train.parallel.parallelize import parallelize
from loongforge.train.preflight import preflight
from loongforge.train.resilience.exits import Preempted, Terminated, supervised
from loongforge.train.resilience.nan_guard import NanGuard
from loongforge.train.resilience.rundir import claim_for_rank
from loongforge.train.resilience.startup import StartupWatch, clear_stale_build_locks
from loongforge.train.resilience.stop import StopSignals, stop_decision
from loongforge.train.resilience.watchdog import Watchdog

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: TrainConfig, stop: StopSignals | None = None):
        self.cfg = cfg
        self.stop = stop or StopSignals(save_on_term=False)  # launch.py installs the real one
        # Start-up is bounded: no first step within --startup-timeout-s ends the rank naming the phase.
        self.startup = StartupWatch(cfg.faults.startup_timeout_s, run_dir=cfg.run.run_dir).start()
        self.run_lock = None
        try:
            self._setup(cfg)
        except BaseException:
            # A failed construction (a config error, a peer gone) must not leave the start-up watch armed:
            # it would end the calling process at the timeout, long after (a notebook, a test process).
            self.startup.done()
            for closer in [*self.startup.closers, lambda: self.run_lock and self.run_lock.release()]:
                with contextlib.suppress(Exception):
                    closer()
            raise

    def _setup(self, cfg: TrainConfig) -> None:
        self.device = pick_device(cfg.run.device)
        self.startup.enter("preflight", f"reading the shard index under {cfg.data.root}")
        checked = preflight(cfg)  # config errors fail here, before any process group (exit code 2)
        self.index, self.plan = checked.index, checked.model
        self.model_cfg = self.plan.model
        self.init_dtypes: dict[str, str] = {}  # what --init-from's files stored: export writes them back so
        # One live run per run dir (exit 2 naming the holder); rank 0 holds it unless a supervisor does,
        # and never trains over checkpoints without --resume or --overwrite (exit 2).
        self.run_lock = claim_for_rank(cfg.run.run_dir, int(os.environ.get("RANK", "0")), resume=cfg.run.resume,
                                       overwrite=cfg.run.overwrite)
        clear_stale_build_locks()  # a killed launch's DeepSpeed op build lock would block this one forever
        self.startup.enter("init_distributed", f"rendezvous of {os.environ.get('WORLD_SIZE', '1')} ranks at "
                           f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '?')} "
                           "and DeepSpeed's communication op (its build lock)")
        self.rank, self.world = init_distributed(self.device, cfg.parallel.dist_timeout_s)
        # The log record's host values (sample ids, SIGTERM votes) are gathered over gloo: read from an NCCL
        # all-gather they would make the host wait for the GPU every step (_gather).
        self.host_group = (torch.distributed.new_group(backend="gloo")
                           if self.world > 1 and self.device.type == "cuda" else None)
        self.startup.closers.append(lambda: release_cpu_shm_buffers(self.world))
        self.startup.enter("parallelize", "building the model and the DeepSpeed engine")
        self.par = plan.initialize(plan.plan_of(cfg))  # every process group of the TP x SP x DP plan, once
        # The loader reads by DP coordinate: the TP ranks of one replica get the same batch.
        self.data_rank, self.data_world = self.par.get_data_parallel_rank(), self.par.get_data_parallel_world_size()
        torch.manual_seed(cfg.data.seed)  # identical initial weights on every rank
        # The model is handed over as a factory: ZeRO-3 constructs it already partitioned (parallelize.py),
        # except when it starts from a checkpoint's weights, which load into the whole model first.
        built = parallelize(functools.partial(self._build, cfg.model.attention, self.plan.init_from), cfg, self.par,
                            device=self.device, build_full=self.plan.init_from is not None)
        self.engine, self.ds_conf, self.policies = built.engine, built.ds_config, built.policies
        self.dp_sync = built.dp_sync  # --grad-compression topk, else None
        self.params, _ = param_counts(self.engine.module)  # the full count, also when ZeRO-3 partitioned it
        self.nan_guard = NanGuard(self.engine, policy=cfg.faults.nan_policy, rank=self.rank, device=self.device,
                                  max_consecutive=cfg.faults.nan_max_consecutive)
        self.step_comm = StepComm()  # bytes per step and group kind, into metrics.jsonl
        d = cfg.data
        accum = cfg.parallel.grad_accum
        # samples are (episode, t), block-aware order, training episodes only (train/data/loader.py)
        self.startup.enter("loader", "starting the decode workers")
        self.processor = self.plan.processor  # N1.6's processor: one per run, in every checkpoint's sidecar
        proc = self.processor.cfg
        self.loader = training_data.make_loader(d, self.index, batch_size=d.global_batch_size // accum,
                                                rank=self.data_rank, world=self.data_world, device=self.device,
                                                processor=self.processor, prompts=self.plan.prompts,
                                                image_mean=proc.image_mean, image_std=proc.image_std,
                                                step_batch=d.global_batch_size)
        self.startup.closers.insert(0, self.loader.close)
        self.valset = self._valset()
        f = cfg.faults
        self.watchdog = Watchdog(rank=self.rank, world=self.world, run_dir=cfg.run.run_dir, heartbeat_s=f.heartbeat_s,
                                 hang_timeout_s=f.hang_timeout_s,
                                 closers=[self.loader.close, lambda: release_cpu_shm_buffers(self.world)])
        self.stop.closers = self.watchdog.closers  # the SIGTERM grace period, when it expires
        self.stop.inject_for(self.rank)
        self.stop.on_request.append(self.watchdog.mute)  # from a SIGTERM on, the grace timer bounds the stop
        r = cfg.run
        self.ckpt = checkpoint.Checkpointer(self.engine, r.run_dir, rank=self.rank, world=self.world,
                                            device=self.device, background=r.save_async, when_busy=r.save_busy,
                                            keep_last=r.keep_last, write_mbps=r.save_mbps,
                                            peer_timeout_s=cfg.parallel.dist_timeout_s, full_every=r.full_every,
                                            delta_max_ratio=r.delta_max_ratio)
        self.step = 0
        self.save_stall_s: list[float] = []
        self.last_stall_s = 0.0
        self._stop_votes = None  # set by _gather when any rank got SIGTERM during the step
        if cfg.run.resume:
            self.startup.enter("resume", "agreeing on and loading the checkpoint")
            self._resume()
        self.startup.enter("first step", "the first batch (decode workers) and the first forward/backward")
        # TensorBoard / W&B (--report-to), rank 0: fed each metrics.jsonl row, flushed at each save.
        self.tracker = Tracker.for_training(cfg, rank=self.rank, start_step=self.step)
        self.metrics = MetricsLog(cfg.run.run_dir, enabled=self.rank == 0, resume=self.step > 0 or cfg.run.resume,
                                  log_every=cfg.run.log_every, keep_below=self.step, total_steps=cfg.run.steps,
                                  sinks=(self.tracker,))
        if self.rank == 0:
            os.makedirs(cfg.run.run_dir, exist_ok=True)
            write_ds_config(self.ds_conf, cfg.run.run_dir)
            # Said at a run's start; a relaunch from a checkpoint under the supervisor has its one line already.
            log.log(logging.DEBUG if self.step and supervised() else logging.INFO,
                    "model %s: %.2fM params, %d ranks, device %s, ZeRO-%d", cfg.recipe, self.params / 1e6,
                    self.world, self.device, cfg.parallel.zero_stage)

    def _build(self, attention: str, init_from: str | None):
        self.startup.enter("build_model", "building the model")
        model = build_model(self.model_cfg, attention=attention)
        if init_from is not None:  # one-line CheckpointError on a missing/mismatched tensor
            self.init_dtypes = load_gr00t_weights(model, init_from)
            log.info("initialised from %s (%d tensors)", init_from, len(self.init_dtypes))
        self.startup.enter("parallelize", "the DeepSpeed engine")
        return model

    def _valset(self):
        """The fixed validation subset --eval-every scores (None when off)."""
        run, d = self.cfg.run, self.cfg.data
        if not run.eval_every:
            return None
        ids = val_sample_ids(self.index, run.eval_samples, d.sample_stride)  # raises ConfigError without a split
        return ValSet(self.index, ids, self.plan.prompts[0], self.processor, batch_size=8, device=self.device)

    def _resume(self) -> None:
        # Rank 0 reads `latest` (falling back past a corrupt one) and every rank gets the tag by name.
        tag = ckpt_fallback.agree_resume_tag(self.cfg.run.run_dir, rank=self.rank, device=self.device)
        if tag is None:
            # The elastic supervisor launches with --resume itself: a first launch there said "--resume" to a user
            # who never gave it. A user's own --resume with nothing to resume is worth their line (rank 0's).
            log.log(logging.INFO if self.rank == 0 and not supervised() else logging.DEBUG,
                    "--resume: no checkpoint in %s yet, starting fresh", self.cfg.run.run_dir)
            return
        checkpoint.check_resume_layout(ckpt_files.read_sidecar(self.cfg.run.run_dir, tag), self.par, tag,
                                       self.world, run_dir=self.cfg.run.run_dir,
                                       zero_stage=self.cfg.parallel.zero_stage)
        doc = checkpoint.load(self.engine, self.cfg.run.run_dir, tag, rank=self.rank, world=self.world,
                              zero_stage=self.cfg.parallel.zero_stage, device=self.device)
        self.loader.load_state_dict(doc["loader"])
        self.step = int(doc["step"])
        ckpt_fallback.check_same_checkpoint(tag, self.step, device=self.device)  # or refuse a mix of two
        sched = self.engine.lr_scheduler
        if not sched.loaded:  # a weights-only resume (another layout, no reshard): the schedule goes on from here
            sched.fast_forward(self.step)
        if self.dp_sync is not None:
            self.dp_sync.load(os.path.join(ckpt_files.ckpt_root(self.cfg.run.run_dir), tag))
        log.log(logging.INFO if self.rank == 0 else logging.DEBUG,  # one line, not one per rank
                "resumed from %s at step %d (loader epoch %d, consumed %d)", tag, self.step,
                doc["loader"]["epoch"], doc["loader"]["consumed"])

    def run(self) -> None:
        run = self.cfg.run
        start = self.step
        timer = StepTimer(self.device)
        trace = TraceWindow(run.run_dir, self.rank, run.profile_steps, self.device)
        late = LateWriter(self._write_record)  # CUDA timings and losses are read one step late: no sync per step
        it = iter(self.loader)
        self.watchdog.start()  # heartbeats from here; startup (engine, resume) is not judged
        self.stop.armed = True  # a SIGTERM from here is handled after the step in flight (resilience/stop.py)
        try:
            while self.step < run.steps:
                self.watchdog.progress(self.step)
                self.stop.at_step(self.step)
                trace.before(self.step)
                timing, record = self._one_step(it, timer, sync=trace.active)
                record["warmup"] = self.step == start  # first step of this process: report skips it
                if record["warmup"]:  # where the process's start-up went (`loongforge bench startup`)
                    record["startup"] = self.startup.split(time.time())
                if self.save_stall_s:
                    record["save_s"] = self.save_stall_s.pop()  # the previous step's save, blocking part
                trace.after(self.step)
                if self.valset is not None and (self.step + 1) % run.eval_every == 0:
                    record.update(val_metrics(self.engine.module, self.valset, seed=self.cfg.data.seed))
                late.push(timing, record)
                self.step += 1
                self.startup.done()
                if self._stop_votes is not None and self.step < run.steps:
                    late.flush()
                    self._stop_on_term()  # every rank saw the same votes: all stop after this step
                if run.save_every and self.step % run.save_every == 0 and self.step < run.steps:
                    late.flush()
                    self.save()
            self.stop.armed = False
            late.flush()
            if self.step > start:
                self.watchdog.progress(self.step, "save")
                self.save(final=True)
                if not self._saved_everywhere():
                    raise CheckpointError(self._unsaved("the final checkpoint"))
            self.watchdog.stop(done=True)
            self.metrics.write_summary()
        finally:
            self.stop.armed = False
            try:  # after a failure: the steps that did finish are still logged
                late.flush()
            except Exception as exc:  # noqa: BLE001 - never hide the failure that brought us here
                log.warning("could not write the last metrics rows to metrics.jsonl (%s): it may end before the "
                            "last finished step", exc)
            trace.close()

    def _one_step(self, it, timer: StepTimer, sync: bool = False) -> tuple:
        e, accum = self.engine, self.cfg.parallel.grad_accum
        comm_seconds()  # drop collectives from outside the step (checkpoint saves, logging)
        self.policies.on_step(self.step)
        lr = self.engine.lr_scheduler.get_last_lr()[0]  # this step's; the boundary step advances the schedule
        timer.begin(sync=sync)
        self.watchdog.phase = "data"  # a hang here is this rank's own, not a peer's collective
        with timer.phase("data_wait"):  # the step's micro-batches first: the loss needs all their rows
            batches = [next(it) for _ in range(accum)]
            self.watchdog.phase = "step"  # from here a hang is a peer's (the rows' all-reduce)
            # Every DP rank's rows: the step cannot start before the slowest rank has its batch, so the
            # wait for a peer's data in this all-reduce is data wait (it goes through no deepspeed.comm
            # timer and no per-group counter: outside this phase it read as launch/dispatch overhead).
            denom = self._loss_denominator(batches)
        self.step_comm.begin()
        losses, ids = [], []
        for micro, batch in enumerate(batches):
            meta = batch.pop("meta")
            ids.append(meta["sample_ids"])
            b = batch["action"].shape[0]
            root = meta.get("dataset", 0)  # a mixture's batch comes from one root (train/data/mixture.py)
            draws = noise_for(self.cfg.data.seed, meta["epoch"], meta["sample_ids"],
                              (b, self.model_cfg.action_horizon, self.model_cfg.max_action_dim), self.device,
                              stream=root)
            self.policies.before_forward()  # --cuda-graphs: a new graph-tree iteration
            self.policies.set_sample_keys(sample_keys(self.cfg.data.seed, meta["epoch"], meta["sample_ids"], root),
                                          self.device)
            with timer.phase("forward"):
                r = self.index.roots[root]
                with timer.phase("inputs"):  # a part of the forward: images, augmentation, padding (inputs_s)
                    images = self.processor.draws(self.cfg.data.seed, meta["epoch"], meta["sample_ids"], root)
                    inputs = self.processor(batch, r.tag, r.cameras, draws=images)
                inputs["state_dropout_u"] = draws.state_dropout
                out = e(inputs, draws.noise, draws.u, denom)
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
            losses.append(torch.stack([out["loss"].detach().float(), out["flow_loss"].float()]))
        comm = comm_seconds() if self.device.type == "cpu" else None
        timing = timer.stop(comm)
        rec = {"epoch": meta["epoch"], "epoch_pos": meta["consumed"],  # where this step's batch came from
               **({"dataset": meta["dataset"]} if "dataset" in meta else {}),  # a mixture's root
               "lr": lr,
               "comm_groups": self.step_comm.end(), "nonfinite_skip": skipped,
               "nonfinite_skips": self.nan_guard.skipped}
        rec = self._gather(rec, torch.stack(losses).mean(0), np.concatenate(ids))
        rec["_grad_norm"] = e.get_global_grad_norm()  # None under ZeRO-0; read a step late (_write_record)
        return timing, rec

    def _loss_denominator(self, batches: list[dict]) -> torch.Tensor:
        """What each micro-batch's loss sum is divided by (model.forward's `denom`): the step's action-mask
        elements (valid rows x action dims) over every DP replica and micro-batch, / (D replicas x accum
        micro-batches): N1.6's masked mean over the global batch, however it is split.
        DeepSpeed divides each backward by accum and averages gradients over the D replicas (every
        ZeRO stage; with SP, zero.zero_loss_scale keeps SP out of it; the top-k sync averages over
        D too), so the gradient, and the logged mean of the micro losses, is the global batch's
        mean over its valid rows, however it is split. One all-reduce of one number per step, before
        the step's communication window (comm_groups counts the model's traffic only)."""
        n = torch.stack([(b["action_valid"] & b["sample_valid"][:, None]).sum() * b["action"].shape[-1]
                         for b in batches]).sum().to(torch.float64)
        if self.data_world > 1:
            torch.distributed.all_reduce(n, group=self.par.group("dp"))
        return (n.clamp_min(1.0) / (self.data_world * len(batches))).float()

    def _gather(self, rec: dict, losses: torch.Tensor, ids: np.ndarray) -> dict:
        """Every rank's part of the step's log record, with no host sync: the host values (sample ids,
        bad samples, this rank's SIGTERM vote and save estimate) in one all_gather_object over gloo,
        read at once (every rank acts on the same votes after this step); the device values (losses,
        the NaN guard's flag) in one all_gather on the device, read a step late (_write_record)."""
        t0 = time.perf_counter()
        # The tail: bad samples, then this rank's SIGTERM vote (flag, grace left) and its save estimate.
        host = [*ids.tolist(), self.loader.bad_samples, *self.stop.vote(), self._save_estimate_s()]
        dev = torch.cat([losses.detach().double(), self.nan_guard.flag.double()])
        if self.world > 1:
            every = [None] * self.world
            torch.distributed.all_gather_object(every, host, group=self.host_group)
            devs = [torch.empty_like(dev) for _ in range(self.world)]
            torch.distributed.all_gather(devs, dev)
            every_dev = torch.stack(devs)
            replicas = plan.replica_ranks(self.par, self.world)  # no TP copies
        else:
            every, every_dev, replicas = [host], dev[None], [0]
        n = len(ids)
        votes = [row[n + 1:] for row in every]  # every rank's, TP copies included: all must stop together
        self._stop_votes = votes if any(flag for flag, _, _ in votes) else None
        rec.update(step=self.step, samples=n * len(replicas), **plan.layout(self.par),
                   sample_ids=[[int(v) for v in every[r][:n]] for r in replicas],
                   bad_samples=int(sum(every[r][n] for r in replicas)), log_s=time.perf_counter() - t0,
                   world=self.world)
        rec["_device"] = (every_dev, replicas)
        return rec

    def _write_record(self, rec: dict) -> None:
        """A step's record into metrics.jsonl, one step late (LateWriter): its device values are read
        on the host now, when the next step is queued and this one's kernels are done (no stall)."""
        every_dev, replicas = rec.pop("_device")
        every_dev = every_dev.cpu()
        allr = every_dev[replicas]
        norm = rec.pop("_grad_norm", None)
        rec.update(loss=float(allr[:, 0].mean()), flow_loss=float(allr[:, 1].mean()),
                   grad_norm=None if norm is None else float(norm),
                   nonfinite_skip=NanGuard.reason(rec["nonfinite_skip"], bool(every_dev[:, 2].max() > 0)))
        self.metrics.write(rec)

    def save(self, final: bool = False) -> str | None:
        self.tracker.on_save(self.ckpt.writer.last_s)  # the trackers' rows up to here reach disk first
        t0 = time.perf_counter()
        blobs = () if self.dp_sync is None else self.dp_sync.blobs()  # per-rank compression residuals
        tag = self.ckpt.save(step=self.step, loader_state=self.loader.state_dict(), final=final, blobs=blobs,
                             extra={"recipe": self.cfg.recipe, "zero_stage": self.cfg.parallel.zero_stage,
                                    "parallel": plan.layout(self.par),
                                    "global_batch_size": self.cfg.data.global_batch_size,
                                    "grad_accum": self.cfg.parallel.grad_accum,  # the resume hint of ckpt reshard
                                    # What Policy.load and export need to rebuild the model and its inputs.
                                    **self.plan.sidecar(), "init_dtypes": self.init_dtypes,
                                    "data": {
                                    # the sample shape Policy.load rebuilds (data/training_data.py)
                                    "video_deltas": list(self.cfg.data.video_deltas),
                                    "state_deltas": list(self.cfg.data.state_deltas),
                                    "action_horizon": self.cfg.data.action_horizon,
                                    "action_pad": self.cfg.data.action_pad,
                                    # the roots' camera slots per video key (observations keyed by slot)
                                    "cameras": {r.tag: r.keys["video"] for r in self.index.roots}}})
        self.last_stall_s = time.perf_counter() - t0
        self.save_stall_s = [self.last_stall_s]  # what the step loop waited for; logged with the next step
        return tag

    def _stop_on_term(self) -> None:
        """A rank got SIGTERM: write a checkpoint if it fits in the grace period left, then leave (stop.py)."""
        save, left, est = stop_decision([(f, lft) for f, lft, _ in self._stop_votes],
                                        est_save_s=[e for _, _, e in self._stop_votes])
        latest = ckpt_files.read_pointer(ckpt_files.ckpt_root(self.cfg.run.run_dir))
        if not save:
            log.warning("SIGTERM: no checkpoint at step %d: the last save took ~%.0f s, %.0f s of the grace period "
                        "are left; `latest` stays %s", self.step, est, left, latest)
            raise Terminated(f"no checkpoint: ~{est:.0f} s needed, {left:.0f} s of the grace period left")
        self.watchdog.progress(self.step, "save")
        tag = self.save(final=True)
        if not self._saved_everywhere():
            raise Terminated(self._unsaved("the checkpoint on SIGTERM"))
        raise Preempted(tag, self.step)

    def _saved_everywhere(self) -> bool:
        """Did the synchronous save just made land on every rank (and was it published by rank 0)?"""
        ok = torch.tensor([1.0 if self.ckpt.writer.last_ok else 0.0], device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        return bool(ok.item())

    def _unsaved(self, what: str) -> str:
        root = ckpt_files.ckpt_root(self.cfg.run.run_dir)
        latest = ckpt_files.read_pointer(root)
        good = f"the last good checkpoint is {latest} (`latest`)" if latest else "there is no earlier checkpoint"
        return (f"{what}, {ckpt_files.tag_for(self.step)}, was NOT saved (the WARNING above names the file and "
                f"the free space); {good} under {root}: free the space, then resume with --resume"
                + (f" (steps {int(latest[4:])}..{self.step - 1} are redone)" if latest else ""))

    def _save_estimate_s(self) -> float:
        """How long a synchronous save would take here: the last one's blocking part + write, with margin
        (0 before the first: try it, the grace timer still bounds it)."""
        w = self.ckpt.writer.last_s
        return 0.0 if w is None else 1.25 * (w + self.last_stall_s)

    def close(self, *, peers_gone: bool = False) -> None:
        # A clean run ends with a synchronous save, so a save still in flight here means a failure: its peers
        # may be gone, and launchers SIGKILL ranks that take long to stop (deepspeed's after 30 s), which
        # would skip the rest of this teardown. `latest` still names the previous complete checkpoint.
        # `peers_gone` (a collective failed on a lost peer): the save stops waiting for the parts they never
        # wrote, instead of holding the job's restart for the 3 s (launch.py).
        for closer in (self.startup.done, lambda: self.watchdog.stop(done=False),
                       lambda: self.ckpt.close(timeout_s=3.0, peers_gone=peers_gone), self.loader.close,
                       self.metrics.close,
                       self.tracker.close, self.step_comm.close, lambda: self.run_lock and self.run_lock.release()):
            try:
                closer()
            except Exception as exc:  # noqa: BLE001 - close the rest, then report
                log.warning("close failed: %s", exc)

