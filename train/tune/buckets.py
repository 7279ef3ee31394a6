"""`loongforge tune buckets`: sweep ZeRO's reduce / all-gather (ZeRO-3: prefetch) bucket size and
overlap_comm with real trainer launches on this machine.

  loongforge tune buckets --world 2 --sizes 20000,200000,2000000,50000000 [--plan tp=2,sp=2,zero=3]

Each setting is one short job (train/tune/jobs.py): the same recipe, plan, data and seed,
`--steps` steps, the first one left out. Per setting: median step time, exposed communication
(host seconds inside collectives: on gloo every collective blocks, so that is what the step
waits for; on CUDA the host figure is launch time, see `loongforge profile` of the run for the
trace's exposed/overlapped split), collective calls and bytes sent per step by this rank. The
bucket size sets how many collectives carry the same bytes (fewer, larger calls pay the
per-call latency less often; smaller ones start earlier and overlap more on a GPU). The best
setting is the fastest median step; pass it to the trainer as --reduce-bucket-size (and
--no-overlap-comm when off wins).
"""

from __future__ import annotations

import logging
import os

from loongforge.shared.errors import ConfigError
from loongforge.train.tune import jobs

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


def sweep(*, world: int, plan: str, sizes, overlaps, recipe: str, steps: int, micro_batch: int, data: str | None,
          workdir: str, device: str) -> dict:
    spec, flags = jobs.plan_args(plan)
    if world % (spec["tp"] * spec["sp"]):
        raise ConfigError(f"--world {world}: not a multiple of tp*sp = {spec['tp'] * spec['sp']} of --plan {plan}")
    dp = world // (spec["tp"] * spec["sp"])
    data = data or jobs.synthetic_data(workdir)
    common = [*flags, "--recipe", recipe, "--steps", str(steps), "--batch-size", str(micro_batch * dp),
              "--seed", "1", "--no-ds-breakdown", "--log-every", "1"]
    rows = []
    for size in sizes:
        for overlap in overlaps:
            args = [*common, "--reduce-bucket-size", str(size), *([] if overlap else ["--no-overlap-comm"])]
            res = jobs.run_job(world, args, data=data, run_dir=os.path.join(workdir, f"b{size}-o{int(overlap)}"),
                               device=device)
            rows.append({"bucket_bytes": size, "overlap_comm": overlap, "step_s": res.step_s,
                         "exposed_comm_s": res.comm_s, "comm_share": res.comm_share,
                         "calls": sum(g["calls"] for g in res.groups.values()), "wire_bytes": res.wire_bytes,
                         "groups": res.groups})
            log.info("bucket %d overlap %s: step %.1f ms, exposed comm %.1f ms", size, overlap,
                     res.step_s * 1e3, res.comm_s * 1e3)
    best = min(rows, key=lambda r: r["step_s"])
    return {"version": FORMAT_VERSION, "world": world, "plan": spec, "recipe": recipe, "device": device,
            "micro_batch": micro_batch, "steps": steps, "rows": rows,
            "best": {"bucket_bytes": best["bucket_bytes"], "overlap_comm": best["overlap_comm"]},
            "note": "exposed_comm_s = host seconds inside collectives (blocking on gloo); on CUDA see the "
                    "profiler trace for exposed vs overlapped"}


def table(doc: dict) -> str:
    lines = [f"bucket sweep: world={doc['world']} plan={doc['plan']} recipe={doc['recipe']} device={doc['device']}",
             f"{'bucket B':>12} {'overlap':>7} {'step ms':>9} {'exposed comm ms':>16} {'share':>6} {'calls':>6} "
             f"{'sent MB':>8}"]
    for r in doc["rows"]:
        lines.append(f"{r['bucket_bytes']:>12} {str(r['overlap_comm']):>7} {r['step_s'] * 1e3:>9.1f} "
                     f"{r['exposed_comm_s'] * 1e3:>16.1f} {r['comm_share']:>6.1%} {r['calls']:>6.0f} "
                     f"{r['wire_bytes'] / 1e6:>8.3f}")
    b = doc["best"]
    lines.append(f"fastest: --reduce-bucket-size {b['bucket_bytes']}" + ("" if b["overlap_comm"] else
                                                                          " --no-overlap-comm"))
    return "\n".join(lines)
