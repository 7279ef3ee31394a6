"""The alpha-beta model behind `loongforge bench scale`'s projection.

Per group kind g (tp / sp / dp / sp_dp / world) and step, one rank spends
    t_g = calls_g * alpha_link + wire_g / bw_link
in collectives: alpha = per-call latency, wire = bytes this rank sends (ring /
pairwise, comm.py). Two things are fitted to the measured points:

  link    alpha, 1/bw of the machine that ran them (gloo here): least squares of every
          measured (group, size) host time on its calls and bytes. The fit's error on the
          measured comm time says how well the model form holds.
  bytes   wire_g(G) = a_g (G-1)/G + b_g in the group size G (a ring all-reduce sends
          2 (G-1)/G of the payload, reduce-scatter / all-gather (G-1)/G each), and calls_g as
          measured (a fixed count of buckets and layers per step).

The projection to N GPUs swaps the fitted link for the inputs: NVLink inside a node,
InfiniBand for a group that spans nodes (rank = dp*S*T + sp*T + tp, so a group's span
decides it; a ring across nodes runs at the slowest link), scales the bytes from the
measured recipe to the target one (gradient/parameter traffic by parameter count,
activation traffic by dim x depth x tokens), and adds the compute time per step (an
input: the GPU's, not this machine's). Comm share = comm / (comm + compute), with no
overlap: an upper bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

ACT_GROUPS = ("tp", "sp")  # activation traffic (TP all-reduces, Ulysses all-to-alls); the rest (dp, sp_dp,
# world) is gradient / parameter traffic (ZeRO)


@dataclass(frozen=True, slots=True)
class Hardware:
    gpus_per_node: int = 8
    nvlink_gbps: float = 150.0  # GB/s per GPU, achieved bus bandwidth (H100 NVLink 4: ~450 peak per direction)
    nvlink_latency_us: float = 5.0
    ib_gbps: float = 40.0  # GB/s per GPU: one 400 Gb/s NDR NIC per GPU, ~80% achieved
    ib_latency_us: float = 10.0

    def to_dict(self) -> dict:
        return asdict(self)


def group_size(kind: str, n: int, tp: int, sp: int) -> int:
    return {"tp": tp, "sp": sp, "dp": n // (tp * sp), "sp_dp": n // tp, "world": n}.get(kind, n)


def group_span(kind: str, n: int, tp: int, sp: int) -> int:
    """Consecutive global ranks a group of this kind covers (placement: TP innermost, DP outermost)."""
    return {"tp": tp, "sp": tp * sp}.get(kind, n)


def fit_link(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(calls, wire bytes, seconds) -> (alpha s/call, beta s/byte), both >= 0 (least squares; when
    the joint fit gives a negative term, the better of the two one-term fits)."""
    if not points:
        return 0.0, 0.0
    a = np.array([[c, w] for c, w, _ in points], dtype=float)
    y = np.array([s for *_, s in points], dtype=float)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if min(coef) >= 0:
        return float(coef[0]), float(coef[1])
    best = None
    for j in (0, 1):
        c = max(float(a[:, j] @ y / max(a[:, j] @ a[:, j], 1e-30)), 0.0)
        err = float(np.sum((a[:, j] * c - y) ** 2))
        if best is None or err < best[0]:
            best = (err, (c, 0.0) if j == 0 else (0.0, c))
    return best[1]


def fit_bytes(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(group size G, wire bytes) -> (a, b) of wire = a (G-1)/G + b; a constant when G never varies."""
    sizes = {g for g, _ in points}
    if len(sizes) < 2:
        return 0.0, float(np.mean([w for _, w in points]))
    a = np.array([[(g - 1) / g, 1.0] for g, _ in points])
    coef, *_ = np.linalg.lstsq(a, np.array([w for _, w in points]), rcond=None)
    return float(coef[0]), float(coef[1])


def fit_plan(rows: list[dict]) -> dict:
    """Per group kind: bytes fit and mean calls, from one plan's measured rows."""
    out = {}
    kinds = sorted({k for r in rows for k in r["groups"]})
    for kind in kinds:
        have = [r for r in rows if kind in r["groups"]]
        pts = [(group_size(kind, r["world"], r["plan"]["tp"], r["plan"]["sp"]), r["groups"][kind]["wire_bytes"])
               for r in have]
        a, b = fit_bytes(pts)
        out[kind] = {"a": a, "b": b, "calls": float(np.mean([r["groups"][kind]["calls"] for r in have]))}
    return out


def project(fit: dict, plan: dict, n: int, hw: Hardware, compute_s: float, scale: dict) -> dict:
    """Comm seconds per step per group at n GPUs, and the comm share against compute_s."""
    groups = {}
    for kind, f in fit.items():
        g = group_size(kind, n, plan["tp"], plan["sp"])
        wire = (f["a"] * (g - 1) / g + f["b"]) if g > 1 else 0.0
        wire *= scale["act"] if kind in ACT_GROUPS else scale["param"]
        inter = group_span(kind, n, plan["tp"], plan["sp"]) > hw.gpus_per_node
        bw, lat = (hw.ib_gbps, hw.ib_latency_us) if inter else (hw.nvlink_gbps, hw.nvlink_latency_us)
        calls = f["calls"] if g > 1 else 0.0
        groups[kind] = {"link": "ib" if inter else "nvlink", "group_size": g, "wire_bytes": wire, "calls": calls,
                        "seconds": calls * lat * 1e-6 + wire / (bw * 1e9)}
    comm = sum(v["seconds"] for v in groups.values())
    share = comm / (comm + compute_s) if comm + compute_s > 0 else 0.0
    return {"world": n, "comm_s": comm, "compute_s": compute_s, "comm_share": share, "over_30pct": share > 0.30,
            "wire_bytes": sum(v["wire_bytes"] for v in groups.values()), "groups": groups}
