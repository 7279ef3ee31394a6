"""`loongforge train / profile / eval / export`, `serve`, and the `tune` and `ckpt` command groups. Heavy imports
(torch, deepspeed, matplotlib) happen inside the handlers so `loongforge --help` is fast."""

from __future__ import annotations

import json
import os
import sys

from loongforge.shared.errors import CheckpointError, UsageError
from loongforge.train.ckpt.cli import register as register_ckpt
from loongforge.train.flags import add_train_args
from loongforge.train.resilience.rundir import refuse_over_checkpoints
from loongforge.train.resilience.runlock import joins_live_run
from loongforge.train.serve.cli import register as register_serve
from loongforge.train.tune.cli import register as register_tune


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a VLA model with DeepSpeed (run under torchrun/deepspeed "
                                            "for several ranks: python -m loongforge.train ...)")
    add_train_args(p)
    el = p.add_argument_group("elastic (train/resilience/elastic/): one supervisor per node relaunches torchrun on "
                              "the ranks and nodes that are left, and scales back up")
    el.add_argument("--elastic", action="store_true", help="supervise the launch: on a fault relaunch from the last "
                    "checkpoint on the surviving ranks (same global batch), scale up when capacity returns")
    el.add_argument("--min-ranks", type=int, default=1, help="fewer ranks than this: stop instead of relaunching")
    el.add_argument("--max-ranks", type=int, default=None, help="ranks to start with and scale back up to, over all "
                    "nodes (default: --min-ranks)")
    el.add_argument("--capacity-file", default=None, help="file holding the ranks this node can run now (absent = "
                    "--nproc-per-node)")
    el.add_argument("--max-restarts", type=int, default=3, help="relaunches after faults allowed within any "
                    "--restart-window (torchelastic's max_restarts, replenished)")
    el.add_argument("--restart-window", type=float, default=3600.0, help="seconds: a fault older than this no longer "
                    "counts against --max-restarts (0: over the whole run, torchelastic's count)")
    el.add_argument("--nodes", type=int, default=1, help="nodes of the run: start one supervisor per node, each with "
                    "the same command and run dir (shared filesystem); the first to take the run lock leads")
    el.add_argument("--nproc-per-node", type=int, default=None, help="ranks this node runs at most (default: "
                    "--max-ranks on one node, --max-ranks / --nodes on several)")
    el.add_argument("--node-id", default=None, help="this node's name in the run (default: the hostname; give one "
                    "per supervisor when several share a host)")
    el.add_argument("--node-addr", default=None, help="address the other nodes reach this node at, for the "
                    "rendezvous store it hosts when it leads (default: 127.0.0.1 on one node, else the FQDN)")
    el.add_argument("--rdzv-timeout-s", type=float, default=300.0, help="bound of every wait for other nodes: to "
                    "join, to end an attempt, to be taken into a launch (one line says what is awaited)")
    p.set_defaults(func=_train)
    q = subparsers.add_parser("profile", help="step-time breakdown table + chart of a run directory")
    q.add_argument("run_dir", metavar="RUN_DIR")
    q.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    q.add_argument("--no-chart", action="store_true", help="skip profile.png / profile.html")
    q.set_defaults(func=_profile)
    e = subparsers.add_parser("eval", help="open-loop evaluation of a trained run over validation episodes: "
                                           "MSE/MAE per action group vs baselines, plots, eval.json; with --env, "
                                           "closed-loop rollouts in a simulator: success rate vs baselines")
    e.add_argument("run_dir", metavar="RUN", nargs="?", default=None, help="run directory (holds checkpoints/), or "
                   "with --env an exported GR00T directory too")
    e.add_argument("--data", default=None, metavar="SHARDS", help="shard root (its index has the split and stats); "
                   "required open loop; with --env the root the policy trained on (the state baselines' demonstrations "
                   "and the render size)")
    e.add_argument("--episodes", type=int, nargs="+", default=None, help="episode ids (default: validation split); "
                   "with --env: the number of rollouts (50)")
    e.add_argument("--out", default=None, help="output directory (default: RUN/eval)")
    e.add_argument("--steps", type=int, default=4, help="Euler steps of the flow (4, as GR00T)")
    e.add_argument("--samples", type=int, default=8, help="noise seeds averaged in the K-sample column (the "
                   "1-sample column is what a robot gets; their gap is sampling noise)")
    e.add_argument("--plot-dims", type=int, default=8, help="action dims per episode plot: those with the "
                   "largest policy error, labelled by modality.json group")
    e.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    e.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    e.add_argument("--json", action="store_true", help="print the summary as JSON")
    c = e.add_argument_group("closed loop (--env; README 'Evaluate in simulation')")
    c.add_argument("--env", default=None, metavar="metaworld:TASK", help="roll the policy out in this simulated task "
                   "(the [sim] extra) on seeds no demonstration used: success rate with its 95%% interval, steps to "
                   "success, mp4s, plot, closed_loop.json")
    c.add_argument("--action-steps", type=int, default=8, help="steps of each predicted chunk executed before the "
                   "policy looks again (Isaac-GR00T's n_action_steps; 8)")
    c.add_argument("--num-envs", type=int, default=4, help="env worker processes; the policy answers them in one batch")
    c.add_argument("--baselines", default=",".join(("expert", "random", "state-mlp", "state-ridge")),
                   help="comma list of expert, random, state-mlp, state-ridge (the state ones need --data); '' none")
    c.add_argument("--server", default=None, metavar="tcp://HOST:PORT", help="act through a running `loongforge "
                   "serve` instead of loading RUN here")
    c.add_argument("--api-token-file", default=None, help="--server: the token file of the server")
    c.add_argument("--videos", type=int, default=3, help="episodes of each agent written as mp4 (3)")
    c.add_argument("--seed-start", type=int, default=None, help="first rollout seed (default 1000000: demonstrations "
                   "use the seeds below)")
    c.add_argument("--size", type=int, default=None, help="render size (default: the --data root's frames, else 56)")
    c.add_argument("--max-steps", type=int, default=None, help="step limit per episode (default: the task's)")
    e.set_defaults(func=_eval)
    x = subparsers.add_parser("export", help="write a run's checkpoint as an Isaac-GR00T N1.6 checkpoint directory "
                                             "(config.json, safetensors, processor files)")
    x.add_argument("run_dir", metavar="RUN", help="run directory (holds checkpoints/)")
    x.add_argument("out", metavar="OUT", help="new directory to write")
    x.add_argument("--format", default="gr00t", choices=("gr00t",), help="gr00t: what Isaac-GR00T's loader reads")
    x.add_argument("--data", default=None, metavar="SHARDS", help="not needed: the run's N1.6 processor (modality "
                   "configs, statistics) is in its checkpoint")
    x.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    x.set_defaults(func=_export)
    i = subparsers.add_parser("inspect", help="summarise (and verify) a shard root, or write samples exactly as the "
                                              "model receives them (--at E:F --npz OUT)")
    i.add_argument("root", metavar="SHARDS", help="shard root (path or URL)")
    i.add_argument("--verify", action="store_true", help="hash-check every shard (exit 1 if any fails)")
    i.add_argument("--json", action="store_true", help="print a JSON object")
    i.add_argument("--at", action="append", default=[], metavar="EPISODE:FRAME", help="a sample to write (source "
                   "episode id and frame; repeat the flag for more)")
    i.add_argument("--npz", default=None, metavar="OUT", help="where --at's samples go (numpy .npz, the names "
                   "Isaac-GR00T's collator emits, and the raw arrays)")
    i.add_argument("--train", action="store_true", help="training mode: the crop and colour jitter training draws "
                   "for each sample at --seed (default: evaluation, centred crop)")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--recipe", default="gr00t-n1.6", help="the model whose inputs to build (default: the released "
                   "N1.6: 128-D state and action, 50 steps, 252-pixel images)")
    i.add_argument("--init-from", default=None, metavar="DIR", help="a checkpoint's processor and statistics instead")
    i.add_argument("--tokenizer", default=None, metavar="DIR", help="the tokenizer's files (Qwen3's for N1.6; "
                   "default: bytes)")
    i.add_argument("--run", default=None, metavar="RUN", help="a trained run's processor and tokenizer instead")
    i.add_argument("--padding", default=None, metavar="S,A,H", help="pad state / action dims and action steps to "
                   "these (default: with the gr00t-n1.6 recipe the released checkpoint's 128,128,50; else the model's)")
    i.set_defaults(func=_inspect)
    register_tune(subparsers)
    register_ckpt(subparsers)
    register_serve(subparsers)


def _train(args) -> int:
    # A fresh run over checkpoints: exit 2 now, before the trainer's or the supervisor's imports (seconds);
    # a node joining a live multi-node run follows it (the supervisor checks again, under the run lock).
    if not (args.elastic and joins_live_run(args.run_dir, args.nodes)):
        refuse_over_checkpoints(args.run_dir, resume=args.resume, overwrite=args.overwrite)
    if args.elastic:  # this process only supervises; the ranks are torchrun's children
        from loongforge.train.resilience.elastic.cli import supervise

        return supervise(args, getattr(args, "raw_argv", None) or sys.argv[1:])
    from loongforge.train.launch import run_args
    from loongforge.train.resilience.exits import exit_now

    # Never returns: os._exit after teardown (gloo can abort in interpreter shutdown).
    exit_now(run_args(args))
    return 1  # unreachable


def _inspect(args) -> int:
    from loongforge.shared.dataset import open_root
    from loongforge.shared.summary import format_summary, summarize

    if args.at or args.npz:
        import numpy as np

        from loongforge.train.eval.inspect import parse_at, samples

        if not (args.at and args.npz):
            raise UsageError("inspect: --at EPISODE:FRAME and --npz OUT go together")
        from loongforge.train.eval.inspect import RELEASED_PADDING

        padding = RELEASED_PADDING if args.recipe == "gr00t-n1.6" and not (args.run or args.init_from) else None
        if args.padding:
            try:
                padding = tuple(int(x) for x in args.padding.split(","))
                assert len(padding) == 3
            except (ValueError, AssertionError):
                raise UsageError(f"--padding {args.padding!r}: three integers, e.g. 128,128,50") from None
        out = samples(args.root, parse_at(args.at), train=args.train, seed=args.seed, recipe=args.recipe,
                      init_from=args.init_from, tokenizer=args.tokenizer, run=args.run, padding=padding)
        np.savez(args.npz, **out)
        print(f"wrote {len(args.at)} sample(s) to {args.npz}: " + ", ".join(f"{k} {list(v.shape)}"
                                                                         for k, v in out.items()))
        return 0
    summary = summarize(args.root)
    rc = 0
    if args.verify:
        bad = open_root(args.root).verify()
        summary["verified"], summary["bad_shards"] = not bad, bad
        rc = 1 if bad else 0
    print(json.dumps(summary, indent=2, sort_keys=True) if args.json else format_summary(summary))
    return rc


def _export(args) -> int:
    from loongforge.train.ckpt.export import export_run

    files = export_run(args.run_dir, args.out, args.data, tag=args.tag)
    print(f"exported {args.run_dir} -> {args.out}: {', '.join(files)}")
    return 0


def _profile(args) -> int:
    from loongforge.train.observe import breakdown as report
    from loongforge.train.observe.chart import write_chart
    from loongforge.train.observe.tracking import report_profile

    b = report.breakdown(args.run_dir)
    print(report.to_json(b) if args.json else report.format_table(b))
    png = None
    if not args.no_chart:
        png = write_chart(b, args.run_dir)
        html = report.write_html(b, args.run_dir)
        if not args.json:
            print(f"chart: {png}\nhtml:  {html}")
    report_profile(args.run_dir, b, png)  # to the run's TensorBoard / W&B, when it reports to them
    return 0


def _eval(args) -> int:
    if args.env:
        return _closed_loop(args)
    if args.run_dir is None or args.data is None:
        raise UsageError("eval: RUN and --data SHARDS are required (or --env for closed-loop rollouts)")
    import torch
    from loongforge.shared.dataset import open_root
    from loongforge.train.ckpt import files as ckpt_files
    from loongforge.train.eval.openloop import check_request, format_table, run_eval
    from loongforge.train.eval.policy import Policy
    from loongforge.train.observe.tracking import report_eval

    # Everything asked is checked before the checkpoint loads (seconds, and DeepSpeed's output).
    check_request(open_root(args.data), args.episodes, args.steps, args.samples)
    tag = args.tag or ckpt_files.latest_tag(args.run_dir)
    if tag is None:
        raise CheckpointError(f"no checkpoint under {ckpt_files.ckpt_root(args.run_dir)}; did training finish?")
    if not os.path.isdir(os.path.join(ckpt_files.ckpt_root(args.run_dir), tag)):
        raise UsageError(f"--tag {tag}: no such checkpoint under {ckpt_files.ckpt_root(args.run_dir)} "
                         f"(latest: {ckpt_files.latest_tag(args.run_dir)})")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    policy = Policy.load(args.run_dir, args.data, tag=tag, device=device)
    out = args.out or os.path.join(args.run_dir, "eval")
    summary = run_eval(policy, args.data, out, episodes=args.episodes, steps=args.steps, samples=args.samples,
                       plot_dims=args.plot_dims)
    plots = [os.path.join(out, f"episode_{int(ep):06d}.png") for ep in summary["episodes"]]
    report_eval(args.run_dir, summary, _step_of(tag), plots)  # to the run's TensorBoard / W&B
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(f"open-loop eval, {len(summary['episodes'])} episodes, {args.steps} flow steps (dataset units):")
        print(format_table(summary))
        print(f"summary: {os.path.join(out, 'eval.json')}  plots: {out}/episode_*.png")
    return 0


def _closed_loop(args) -> int:
    import torch
    from loongforge.preprocess.samples.sim_env import EVAL_SEED_START
    from loongforge.train.sim.evaluate import EvalRequest, closed_loop
    from loongforge.train.sim.report import format_table

    if args.episodes is not None and len(args.episodes) != 1:
        raise UsageError("--env: --episodes takes one number, the rollouts to run")
    if args.run_dir is None and args.server is None and "expert" not in args.baselines:
        raise UsageError("--env: give RUN (a run or an exported directory) or --server")
    token = None
    if args.api_token_file:
        with open(args.api_token_file, encoding="utf-8") as f:
            token = f.read().strip()
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    req = EvalRequest(env=args.env, episodes=args.episodes[0] if args.episodes else 50,
                      policy=None if args.server else args.run_dir, server=args.server, api_token=token,
                      data=args.data, baselines=tuple(b for b in args.baselines.split(",") if b),
                      action_steps=args.action_steps, num_envs=args.num_envs,
                      seed_start=EVAL_SEED_START if args.seed_start is None else args.seed_start, videos=args.videos,
                      samples=args.samples, flow_steps=args.steps, size=args.size, max_steps=args.max_steps,
                      device=device)
    out = args.out or os.path.join(args.run_dir or ".", "closed_loop", args.env.replace(":", "_"))
    summary = closed_loop(req, out, log=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(format_table(summary))
        print(f"summary: {os.path.join(out, 'closed_loop.json')}  plot: {summary['plot']}  videos: {out}/videos/")
    return 0


def _step_of(tag: str) -> int:
    """The step a checkpoint tag (`step00000008`, files.tag_for) was saved at; 0 for another name."""
    digits = tag[4:].split("_", 1)[0]
    return int(digits) if tag.startswith("step") and digits.isdigit() else 0
