"""`loongforge ckpt reshard RUN --to LAYOUT`: the checkpoint tools (heavy imports inside the handler)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("ckpt", help="checkpoint tools (reshard to another rank count / ZeRO stage / TP)")
    sub = p.add_subparsers(dest="ckpt_command", metavar="TOOL", required=True)
    r = sub.add_parser("reshard", help="convert a checkpoint to another layout (DP degree / world size, ZeRO stage, "
                                       "TP degree), keeping fp32 master weights, Adam moments, step, LR schedule "
                                       "and data position; `latest` then names the new tag")
    r.add_argument("run_dir", metavar="RUN", help="run directory (holds checkpoints/)")
    r.add_argument("--to", required=True, metavar="LAYOUT",
                   help="target layout, e.g. world=4,zero=2,tp=1 (keys: world or dp, zero, tp; tp defaults to 1, "
                        "world to the source's)")
    r.add_argument("--tag", default=None, help="source checkpoint tag (default: latest)")
    r.set_defaults(func=_reshard)


def _reshard(args) -> int:
    from loongforge.train.ckpt import files as ckpt_files
    from loongforge.train.ckpt.reshard import Layout, reshard, resume_hint

    tag = args.tag or ckpt_files.latest_tag(args.run_dir)
    doc = ckpt_files.read_sidecar(args.run_dir, tag) if tag else {}
    to = Layout.parse(args.to, default_world=doc.get("world", 1))
    new_tag = reshard(args.run_dir, to, tag=tag)
    print(f"resharded -> {ckpt_files.ckpt_root(args.run_dir)}/{new_tag} (now `latest`); resume it with "
          f"{to.world} rank(s): {resume_hint(doc, to)}")
    return 0
