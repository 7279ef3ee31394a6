"""`loongforge export RUN --format gr00t OUT --data SHARDS`: a run's checkpoint as an Isaac-GR00T N1.6
checkpoint directory (gr00t.py writes it), with the processor files GR00T's tools deploy it with.

What the processor files say, from the run's sidecar and the data root it trained on:
  processor_config.json  Gr00tN1d6Processor's kwargs: one modality config for the run's embodiment
                         tag (video: the camera slots at the run's video deltas; state and action: the
                         groups of the root's modality.json, or one "state" / "action" group; the
                         action's delta indices 0..H-1, absolute, non-EEF), the image settings the run
                         trained with (shortest edge, crop fraction), N1.6's normalisation (min/max,
                         clip_outliers, no percentiles), max_state_dim / max_action_dim / horizon
  statistics.json        per group: min, max, mean, std of the training episodes (preprocess's
                         statistics); q01 / q99 are the min / max (used only with use_percentiles)
  embodiment_id.json     {tag: projector index}
So an exported fine-tune reads and writes the robot's units exactly as training normalised them.
"""

from __future__ import annotations

import torch

from loongforge.shared.dataset import open_root
from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.ckpt.gr00t import export_gr00t
from loongforge.train.ckpt.weights import load_weights
from loongforge.train.model.build import build_model
from loongforge.train.model.config import EMBODIMENT_TAGS, GrootConfig, model_config_from

LANGUAGE_KEY = "annotation.human.action.task_description"


def groups(modality: dict, kind: str, dim: int) -> dict[str, tuple[int, int]]:
    """name -> [start, end) of modality.json's groups of `kind` (one group named `kind` without them)."""
    found = modality.get(kind, {}) if isinstance(modality, dict) else {}
    out = {n: (int(g["start"]), int(g["end"])) for n, g in found.items() if isinstance(g, dict) and "start" in g}
    covered = sorted(out.values())
    if not out or covered[0][0] != 0 or covered[-1][1] != dim:
        return {kind: (0, dim)}
    return out


def _modality(keys, deltas) -> dict:
    return {"delta_indices": list(deltas), "modality_keys": list(keys), "sin_cos_embedding_keys": None,
            "mean_std_embedding_keys": None, "action_configs": None}


def processor_files(doc: dict, info, tag: str) -> tuple[dict, dict, dict]:
    """(processor_config.json, statistics.json, embodiment_id.json) of a run (its sidecar `doc`) on the
    data root whose DatasetInfo is `info`."""
    cfg, proc, data = model_config_from(doc), doc.get("processor", {}), doc.get("data", {})
    st_groups = groups(info.modality, "state", info.state_dim)
    ac_groups = groups(info.modality, "action", info.action_dim)
    horizon = info.action_horizon
    action = _modality(ac_groups, range(horizon))
    action["action_configs"] = [{"rep": "ABSOLUTE", "type": "NON_EEF", "format": "DEFAULT", "state_key": None}
                                for _ in ac_groups]
    modality = {"video": _modality(info.slots, data.get("video_deltas", (0,))),
                "state": _modality(st_groups, data.get("state_deltas") or data.get("video_deltas", (0,))),
                "action": action, "language": _modality([LANGUAGE_KEY], (0,))}
    processor = {"processor_class": "Gr00tN1d6Processor", "processor_kwargs": {
        "modality_configs": {tag: modality}, "image_crop_size": None, "image_target_size": None,
        "use_albumentations": True, "random_rotation_angle": None, "color_jitter_params": None,
        "shortest_image_edge": proc.get("image_edge", 256), "crop_fraction": proc.get("crop_fraction", 0.95),
        "model_name": "nvidia/Eagle-Block2A-2B-v2", "model_type": "eagle", "formalize_language": True,
        "max_state_dim": cfg.max_state_dim, "max_action_dim": cfg.max_action_dim, "max_action_horizon": horizon,
        "use_percentiles": False, "clip_outliers": True, "apply_sincos_state_encoding": False,
        "use_relative_action": False}}
    stats = {kind: {name: _stats(info.stats.get(kind, {}), a, b) for name, (a, b) in g.items()}
             for kind, g in (("state", st_groups), ("action", ac_groups))}
    return processor, {tag: {**stats, "relative_action": {}}}, {tag: int(doc["embodiment_id"])}


def _stats(st: dict, a: int, b: int) -> dict:
    pick = lambda k: [float(v) for v in st.get(k, [])[a:b]]  # noqa: E731
    return {"min": pick("min"), "max": pick("max"), "mean": pick("mean"), "std": pick("std"), "q01": pick("min"),
            "q99": pick("max")}


def trainable_names(cfg: GrootConfig) -> set[str]:
    with torch.device("meta"):
        return {n for n, p in build_model(cfg).named_parameters() if p.requires_grad}


def embodiment_tag(index: int) -> str:
    return next((t for t, i in EMBODIMENT_TAGS.items() if i == index), str(index))


def export_run(run_dir: str, out: str, data_root: str, *, tag: str | None = None) -> list[str]:
    tag = tag or ckpt_files.latest_tag(run_dir)
    if tag is None:
        raise CheckpointError(f"no checkpoint under {ckpt_files.ckpt_root(run_dir)}; did training finish?")
    doc = ckpt_files.read_sidecar(run_dir, tag)
    cfg = model_config_from(doc)
    info = open_root(data_root).info
    processor, statistics, embodiment = processor_files(doc, info, embodiment_tag(int(doc["embodiment_id"])))
    state = load_weights(run_dir, tag, int(doc.get("zero_stage", 2)))
    return export_gr00t(state, cfg, out, trainable=trainable_names(cfg), stored=doc.get("init_dtypes") or None,
                        processor=processor, statistics=statistics, embodiment=embodiment,
                        tokenizer=doc.get("tokenizer"))
