"""The numbers `loongforge preprocess` ends with and `loongforge inspect` prints,
computed from the index alone (no Beam import: inspect runs anywhere)."""

from __future__ import annotations

from loongforge.shared.index import load_index


def summarize(root: str, seconds: float | None = None) -> dict:
    index = load_index(root)
    ds = index.dataset
    out = index.summary()
    bytes_in = int(ds.source.get("bytes", 0))
    nv12 = index.num_frames * ds.frame_bytes * len(ds.cameras)
    out.update({
        "source_frames": int(ds.source.get("frames", 0)),
        "bytes_in": bytes_in,
        "bytes_out": index.total_bytes,
        "out_over_in": round(index.total_bytes / bytes_in, 3) if bytes_in else None,
        "nv12_over_out": round(nv12 / index.total_bytes, 3) if index.total_bytes else None,
        "warnings": list(ds.source.get("warnings", [])),
        "failed_records": list(index.failed),
    })
    if seconds is not None:
        decoded = out["source_frames"] * len(ds.cameras)
        out["seconds"] = round(seconds, 2)
        out["frames_per_s"] = round(decoded / seconds, 1) if seconds > 0 else None
    return out


def format_summary(s: dict) -> str:
    lines = [
        f"episodes   {s['episodes']} converted, {s['failed']} failed",
        f"samples    {s['samples']} ({s['frames']} window frames per camera)",
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
