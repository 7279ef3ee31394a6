"""`loongforge export RUN --format gr00t OUT`: a run's checkpoint as an Isaac-GR00T N1.6 checkpoint
directory (gr00t.py writes it), with the processor files GR00T's tools deploy it with.

The processor files are the run's N1.6 processor (train/data/processor.py, recorded in every
checkpoint's sidecar), written as Isaac-GR00T's Gr00tN1d6Processor.save_pretrained writes them:
  processor_config.json  its kwargs: the modality config of each embodiment tag the run trained (keys,
                         delta indices, relative/absolute actions, sin/cos and mean/std keys), the image
                         settings and colour jitter, use_relative_action, use_percentiles, clip_outliers,
                         sin/cos encoding, max_state_dim / max_action_dim / max_action_horizon
  statistics.json        per tag: state, action and relative_action statistics per key, the values training
                         normalised with (the data's merged over a mixture, or the checkpoint's own)
  embodiment_id.json     {tag: projector index}
So Isaac-GR00T's Gr00tPolicy decodes an exported fine-tune to the same absolute actions as LoongForge.
"""

from __future__ import annotations

import torch

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.ckpt.gr00t import export_gr00t
from loongforge.train.ckpt.weights import load_weights
from loongforge.train.model.build import build_model
from loongforge.train.data.processor import Processor
from loongforge.train.model.config import GrootConfig, model_config_from

def processor_files(doc: dict) -> tuple[dict, dict, dict]:
    """(processor_config.json, statistics.json, embodiment_id.json) of a run, from its sidecar's N1.6
    processor (train/data/processor.py): what Isaac-GR00T's Gr00tN1d6Processor.from_pretrained reads."""
    if "gr00t_processor" not in doc:
        raise CheckpointError("the checkpoint was written before the N1.6 processor was recorded in it; retrain it "
                              "with this version to export it")
    return Processor.from_json(doc["gr00t_processor"]).gr00t_files()


def trainable_names(cfg: GrootConfig) -> set[str]:
    with torch.device("meta"):
        return {n for n, p in build_model(cfg).named_parameters() if p.requires_grad}


def export_run(run_dir: str, out: str, data_root: str | None = None, *, tag: str | None = None) -> list[str]:
    """`data_root` is not needed: the run's processor (modality configs, statistics) is in its checkpoint."""
    tag = tag or ckpt_files.latest_tag(run_dir)
    if tag is None:
        raise CheckpointError(f"no checkpoint under {ckpt_files.ckpt_root(run_dir)}; did training finish?")
    doc = ckpt_files.read_sidecar(run_dir, tag)
    cfg = model_config_from(doc)
    processor, statistics, embodiment = processor_files(doc)
    state = load_weights(run_dir, tag, int(doc.get("zero_stage", 2)))
    return export_gr00t(state, cfg, out, trainable=trainable_names(cfg), stored=doc.get("init_dtypes") or None,
                        processor=processor, statistics=statistics, embodiment=embodiment,
                        tokenizer=doc.get("tokenizer"))
