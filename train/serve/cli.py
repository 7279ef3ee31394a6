"""`loongforge serve RUN_OR_EXPORT`: a trained policy behind Isaac-GR00T's policy-server
protocol. The handler imports the server (pyzmq, msgpack: the serve extra) and the model only when
it runs, so `loongforge --help` needs neither."""

from __future__ import annotations

import signal


def register(subparsers) -> None:
    s = subparsers.add_parser("serve", help="serve a run or an exported GR00T directory over Isaac-GR00T's policy "
                                            "server protocol (ZeroMQ + msgpack; its PolicyClient works as is)")
    s.add_argument("path", metavar="RUN_OR_EXPORT_DIR", help="run directory (holds checkpoints/) or the output "
                   "of `loongforge export`")
    s.add_argument("--data", default=None, metavar="SHARDS", help="not needed: the run's N1.6 processor (modality "
                   "config, statistics) is in its checkpoint, an export's in its processor files")
    s.add_argument("--embodiment-tag", default=None, metavar="TAG", help="which embodiment to serve when the policy "
                   "trained several (a mixture); default: its only one")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="serve the checkpoint of this step (default: latest)")
    which.add_argument("--tag", default=None, help="serve the checkpoint of this tag (default: latest)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; any other needs "
                   "--api-token-file)")
    s.add_argument("--port", type=int, default=5555, help="TCP port (default 5555, Isaac-GR00T's; 0 = any free one)")
    s.add_argument("--api-token-file", default=None, metavar="FILE", help="a file only you can read (chmod 600) "
                   "holding the token every request must carry as api_token")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument("--steps", type=int, default=None, help="Euler steps of the flow when a request's options do not "
                   "say (default: the model's, 4 for N1.6)")
    s.add_argument("--samples", type=int, default=None, help="flow samples averaged per action when a request's "
                   "options do not say (default: Policy.predict_action's, 8)")
    s.add_argument("--seed", type=int, default=0, help="first noise seed when a request's options do not say")
    s.set_defaults(func=_serve)


def _serve(args) -> int:
    from loongforge.train.serve.server import PolicyServer, ServeConfig, read_token_file

    # The address and the token are checked before torch and the model load (seconds).
    token = read_token_file(args.api_token_file) if args.api_token_file else None
    cfg = ServeConfig(host=args.host, port=args.port, api_token=token)  # the address rule
    with PolicyServer(cfg) as server:  # bound now: a busy port fails before the model loads
        import torch
        from loongforge.train.ckpt.files import tag_for
        from loongforge.train.serve.backend import Defaults, load_backend

        # SIGTERM ends the loop after the request in hand; the socket and context close on the way out.
        signal.signal(signal.SIGTERM, server.stop)
        defaults = Defaults(steps=args.steps, seed=args.seed,
                            **({} if args.samples is None else {"samples": args.samples}))
        device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
        backend = load_backend(args.path, data_root=args.data, tag=args.tag or (tag_for(args.step) if args.step is not
                               None else None), device=device, defaults=defaults, embodiment=args.embodiment_tag)
        print(f"loongforge serve: {args.path} on {server.endpoint} ({device}; token "
              f"{'required' if token else 'not required'}; stop with `kill` or SIGTERM)", flush=True)
        server.serve_forever(backend)
    print("loongforge serve: stopped", flush=True)
    return 0
