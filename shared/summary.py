"""The numbers `loongforge preprocess` ends with and `loongforge inspect` prints, computed from the
index alone (no Beam, no torch: inspect's summary runs anywhere)."""

from __future__ import annotations

import numpy as np

from loongforge.shared.dataset import open_root


def summarize(root: str, seconds: float | None = None) -> dict:
    """Samples = frames (every timestep), frames stored once; bytes of shards and tables."""
    root_ds = open_root(root)
    ds, m = root_ds.info, root_ds.manifest
    frames = root_ds.num_frames
    total = sum(int(s["bytes"]) for s in m["shards"]) + sum(int(t["bytes"]) for t in m["tables"].values())
    out = {"format_version": m["format_version"], "episodes": root_ds.num_episodes, "samples": frames,
           "frames": frames, "shards": len(m["shards"]), "bytes": total, "cameras": [c.key for c in ds.cameras],
           "resolution": [ds.height, ds.width], "fps": ds.fps,
           "camera_sizes": {c.key: list(ds.camera_size(i)) for i, c in enumerate(ds.cameras)},
           "failed": len(m["failed"]),
           "block_size": root_ds.block_size, "block_codec": root_ds.block_codec}
    bytes_in = int(ds.source.get("bytes", 0))
    nv12 = frames * ds.timestep_bytes
    out.update({
        "source_frames": int(ds.source.get("frames", 0)),
        "bytes_in": bytes_in,
        "bytes_out": total,
        "out_over_in": round(total / bytes_in, 3) if bytes_in else None,
        "nv12_over_out": round(nv12 / total, 3) if total else None,
        "warnings": list(ds.source.get("warnings", [])),
        "failed_records": list(m["failed"]),
        # The validation split (episode ids held out of training and of the normalisation stats).
        "val_episodes": sorted(int(e) for e in root_ds.val_episodes),
        "train_episodes": root_ds.num_episodes - int(np.asarray(root_ds.val_mask).sum()),
        "source_version": ds.source.get("codebase_version", ""),
        "frame_timing": ds.source.get("frame_timing") or {},
        "embodiment": _embodiment(ds.embodiment),
        "image_color": ds.source.get("image_color") or {},
    })
    if seconds is not None:
        decoded = out["source_frames"] * len(ds.cameras)
        out["seconds"] = round(seconds, 2)
        out["frames_per_s"] = round(decoded / seconds, 1) if seconds > 0 else None
    return out


def _embodiment(rec: dict) -> dict:
    """The recorded N1.6 embodiment in brief: tag, and per state/action key its width and how it is taken."""
    if not rec:
        return {}
    cfg, layout = rec["config"], rec["layout"]
    acts = cfg["action"].get("action_configs") or [None] * len(cfg["action"]["modality_keys"])

    def width(kind, key):
        s = layout[kind][key]
        return s["end"] - s["start"]
    state = [f"{k}({width('state', k)}{', sin/cos' if k in (cfg['state'].get('sin_cos_embedding_keys') or []) else ''}"
             f"{', mean/std' if k in (cfg['state'].get('mean_std_embedding_keys') or []) else ''})"
             for k in cfg["state"]["modality_keys"]]
    action = [f"{k}({width('action', k)}{', relative' if a and a['rep'] == 'RELATIVE' else ''}"
              f"{', ' + a['format'] if a and a['type'] == 'EEF' else ''})"
              for k, a in zip(cfg["action"]["modality_keys"], acts)]
    return {"tag": rec["tag"], "state": state, "action": action, "horizon": len(cfg["action"]["delta_indices"]),
            "video": list(cfg["video"]["modality_keys"])}


def _cameras(s: dict) -> str:
    sizes = s.get("camera_sizes") or {}
    if len({tuple(v) for v in sizes.values()}) > 1:
        return ", ".join(f"{key} at {h}x{w}" for key, (h, w) in sizes.items())
    return f"{', '.join(s['cameras'])} at {s['resolution'][0]}x{s['resolution'][1]}"


def _timing_lines(timing: dict) -> list[str]:
    """Which frame each row shows: one line when every row shows its own frame, else per camera the
    rows shifted (another frame, within the tolerance), clamped and skipped, plus a warning line."""
    cams = timing.get("cameras") or {}
    if not timing:
        return []
    rule = f"nearest frame to each row's timestamp (tolerance {timing['tolerance_s']:g} s, mismatch " \
           f"{timing['mismatch']})"
    if not any(any(c.values()) for c in cams.values()):
        return [f"frames     {rule}: every row shows its own frame"]
    lines = [f"frames     {rule}:"]
    for key, c in cams.items():
        lines.append(f"           {key}: {c['shifted']} rows shifted, {c['clamped']} clamped, {c['skipped']} skipped")
    off = {key: c["clamped"] + c["skipped"] for key, c in cams.items() if c["clamped"] + c["skipped"]}
    if off:
        lines.append(f"warning    rows without a frame within {timing['tolerance_s']:g} s of their timestamp were "
                     f"{'clamped' if timing['mismatch'] == 'clamp' else 'skipped'}: "
                     + ", ".join(f"{key} {n}" for key, n in off.items()))
    return lines


def format_summary(s: dict) -> str:
    lines = [
        f"episodes   {s['episodes']} converted, {s['failed']} failed",
        f"samples    {s['samples']} (every timestep; frames stored once, {s['block_codec']} blocks of "
        f"{s['block_size']})",
        f"shards     {s['shards']}, {s['bytes_out'] / 1e6:.2f} MB",
        f"cameras    {_cameras(s)}, {s['fps']:g} fps",
        f"bytes in   {s['bytes_in'] / 1e6:.2f} MB (parquet + mp4), out {s['bytes_out'] / 1e6:.2f} MB",
        f"ratio      out/in {s['out_over_in']}x, raw NV12/out (zstd) {s['nv12_over_out']}x",
    ]
    val = s.get("val_episodes", [])
    lines.append(f"split      {len(val)} validation episode(s) held out: {', '.join(map(str, val))}; "
                 f"{s.get('train_episodes', s['episodes'])} train" if val else
                 "split      none: every episode trains (--val-count N, --val-fraction F or --val-episodes IDS "
                 "hold some out)")
    lines += _timing_lines(s.get("frame_timing") or {})
    e = s.get("embodiment") or {}
    if e:
        lines.append(f"embodiment {e['tag']}: video {', '.join(e['video'])}; state {' '.join(e['state'])}; "
                     f"action {' '.join(e['action'])} over {e['horizon']} steps")
    for key, c in (s.get("image_color") or {}).items():
        lines.append(f"colour     {key}: image feature stored as NV12 ({c['chroma']} chroma: one colour per 2x2 "
                     f"pixels): read back, it differs from the source images by up to {c['max_255']}/255, mean "
                     f"{c['mean_255']:.2f}/255 (sharp colour edges blend; shared/FORMAT.md, 'Image features')")
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


def output_counters(root: str, summary: dict) -> dict[str, int]:
    """The job's counters (its Beam counters' names) from what it wrote, for a runner that reports
    no metrics; a counter that stayed 0 is left out, as Beam leaves it out."""
    shards = open_root(root).manifest["shards"]
    counters = {"episodes_converted": summary["episodes"], "episodes_failed": summary["failed"],
                "samples": summary["samples"], "frames_decoded": summary["source_frames"] * len(summary["cameras"]),
                "shards_written": len(shards), "shard_bytes_written": sum(int(s["bytes"]) for s in shards)}
    return {name: value for name, value in sorted(counters.items()) if value}
