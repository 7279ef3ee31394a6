"""The numbers `loongforge preprocess` ends with and `loongforge inspect` prints,
computed from the index alone (no Beam import: inspect runs anywhere)."""

from __future__ import annotations

from loongforge.shared.dataset_v2 import load_any_index, open_v2
from loongforge.shared.index import load_index


def _summary_v2(root: str) -> tuple[dict, object, int, int, list]:
    """Format 2: samples = frames (every timestep), frames stored once."""
    v2 = open_v2(root)
    ds, m = v2.info, v2.manifest
    total = sum(int(s["bytes"]) for s in m["shards"]) + sum(int(t["bytes"]) for t in m["tables"].values())
    out = {"format_version": 2, "episodes": v2.num_episodes, "samples": v2.num_frames, "frames": v2.num_frames,
           "shards": len(m["shards"]), "bytes": total, "cameras": [c.key for c in ds.cameras],
           "resolution": [ds.height, ds.width], "fps": ds.fps, "failed": len(m["failed"]),
           "block_size": v2.block_size, "block_codec": v2.block_codec}
    return out, ds, v2.num_frames, total, list(m["failed"])


def summarize(root: str, seconds: float | None = None) -> dict:
    index = load_any_index(root)
    if index.format_version == 2:
        out, ds, frames, total, failed = _summary_v2(root)
    else:
        index = load_index(root)
        out, ds, frames, total, failed = index.summary(), index.dataset, index.num_frames, index.total_bytes, \
            list(index.failed)
    bytes_in = int(ds.source.get("bytes", 0))
    nv12 = frames * ds.frame_bytes * len(ds.cameras)
    out.update({
        "source_frames": int(ds.source.get("frames", 0)),
        "bytes_in": bytes_in,
        "bytes_out": total,
        "out_over_in": round(total / bytes_in, 3) if bytes_in else None,
        "nv12_over_out": round(nv12 / total, 3) if total else None,
        "warnings": list(ds.source.get("warnings", [])),
        "failed_records": failed,
    })
    if seconds is not None:
        decoded = out["source_frames"] * len(ds.cameras)
        out["seconds"] = round(seconds, 2)
        out["frames_per_s"] = round(decoded / seconds, 1) if seconds > 0 else None
    return out


def format_summary(s: dict) -> str:
    lines = [
        f"episodes   {s['episodes']} converted, {s['failed']} failed",
        f"samples    {s['samples']} (every timestep; frames stored once, {s.get('block_codec', 'zstd')} blocks of "
        f"{s['block_size']})"
        if s.get("format_version") == 2 else f"samples    {s['samples']} ({s['frames']} window frames per camera)",
        f"shards     {s['shards']}, {s['bytes_out'] / 1e6:.2f} MB",
        f"cameras    {', '.join(s['cameras'])} at {s['resolution'][0]}x{s['resolution'][1]}, {s['fps']:g} fps",
        f"bytes in   {s['bytes_in'] / 1e6:.2f} MB (parquet + mp4), out {s['bytes_out'] / 1e6:.2f} MB",
        f"ratio      out/in {s['out_over_in']}x, raw NV12/out (zstd) {s['nv12_over_out']}x",
    ]
    if "frames_per_s" in s:
        lines.append(f"speed      {s['source_frames']} frames x {len(s['cameras'])} cameras in {s['seconds']} s"
                     f" = {s['frames_per_s']} frames/s")
    for w in s.get("warnings", []):
        lines.append(f"warning    {w}")
    for r in s.get("failed_records", []):
        lines.append(f"failed     episode {r['episode']} {r.get('camera') or ''}: {r['reason']}")
    if "verified" in s:
        lines.append("verify     all shards match their sha256" if s["verified"] else
                     f"verify     FAILED: {'; '.join(s['bad_shards'])}")
    return "\n".join(lines)
