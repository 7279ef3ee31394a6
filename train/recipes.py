"""Model recipes, and the one place a run's model is decided: recipe or checkpoint, the data, the
tokenizer and the user's switches -> the architecture (GrootConfig), the image processing, the
prompt table and the embodiment.

Every recipe is GR00T N1.6: the same modules, names and data flow, at three sizes. The reduced ones
keep N1.6's grouped KV heads (2 query heads per KV head) and 4 KV heads, so the seed's TP 2 x SP 2
layouts split them.

  tiny        a CPU step in well under a second (tests, the demo): 2 vision layers, 2 of 3 LLM
              layers, 4 DiT blocks; 56-pixel images (4 image tokens each)
  small       a real but modest model (CPU minutes, one GPU): 4 / 4 of 6 / 8; 112-pixel images
  gr00t-n1.6  the released architecture (2,964,610,912 parameters; count it on the meta device,
              never instantiate it on a CPU): Isaac-GR00T's Gr00tN1d6Config defaults and the
              Eagle-Block2A-2B-v2 backbone; 256-pixel edge -> 252 x 252 images (81 tokens each)

The reduced recipes use the byte tokenizer's vocabulary (train/data/prompt.py); the released size
has Qwen3's. Colour jitter (N1.6's fine-tune default) is the released size's and --init-from's; the
reduced recipes train on the CPU without it (it costs ~100 elementwise passes per image there:
`--color-jitter 0.3,0.4,0.5,0.08` turns it on). A from-scratch run trains everything; a run with --init-from takes the checkpoint's
architecture, image processing and fine-tuning switches (N1.6's: vision and the LLM below its top
4 layers frozen), and only the --tune-* flags the user gave change them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

from loongforge.shared.errors import ConfigError
from loongforge.train.config import ModelConfig, TrainConfig
from loongforge.train.data.state_action import StateAction
from loongforge.shared import embodiment as emb
from loongforge.train.data.processor import Embodiment, Processor, ProcessorConfig, processor_from_gr00t_json
from loongforge.train.data.prompt import (BYTE_IMAGE_TOKEN, BYTE_VOCAB, PromptTable, build_prompts, has_tokenizer,
                                          load_tokenizer)
from loongforge.train.model.config import DiTConfig, GrootConfig, TextConfig, VisionConfig, read_gr00t_dir_config


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    model: GrootConfig
    processor: ProcessorConfig


_SCRATCH = dict(tune_llm=True, tune_visual=True, tune_top_llm_layers=0)  # nothing is pretrained: train it all


def tiny() -> Recipe:
    return Recipe(GrootConfig(
        vision=VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            num_patches=16),
        text=TextConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=8, vocab_size=BYTE_VOCAB),
        dit=DiTConfig(num_layers=4, num_attention_heads=4, attention_head_dim=8, output_dim=32),
        image_token_index=BYTE_IMAGE_TOKEN, select_layer=2, backbone_embedding_dim=48, hidden_size=32,
        input_embedding_dim=32, max_seq_len=64, **_SCRATCH), ProcessorConfig(image_edge=56, color_jitter=None))


def tiny_sim() -> Recipe:
    """tiny at twice the width, no DiT dropout, 84-pixel images (9 tokens each): the recipe that learns
    from 50 simulated demonstrations on a CPU (train/README.md "A recipe that learns")."""
    return Recipe(GrootConfig(
        vision=VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            num_patches=36),
        text=TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=8, vocab_size=BYTE_VOCAB),
        dit=DiTConfig(num_layers=4, num_attention_heads=4, attention_head_dim=16, output_dim=64, dropout=0.0),
        image_token_index=BYTE_IMAGE_TOKEN, select_layer=2, backbone_embedding_dim=64, hidden_size=64,
        input_embedding_dim=64, max_seq_len=64, **_SCRATCH), ProcessorConfig(image_edge=84, color_jitter=None))


def small() -> Recipe:
    return Recipe(GrootConfig(
        vision=VisionConfig(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                            num_patches=64),
        text=TextConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=32, vocab_size=BYTE_VOCAB),
        dit=DiTConfig(num_layers=8, num_attention_heads=4, attention_head_dim=64, output_dim=256),
        image_token_index=BYTE_IMAGE_TOKEN, select_layer=4, backbone_embedding_dim=256, hidden_size=256,
        input_embedding_dim=256, max_seq_len=128, **_SCRATCH), ProcessorConfig(image_edge=112, color_jitter=None))


def gr00t_n1_6() -> Recipe:
    return Recipe(GrootConfig(**_SCRATCH), ProcessorConfig())


RECIPES = {"tiny": tiny, "tiny-sim": tiny_sim, "small": small, "gr00t-n1.6": gr00t_n1_6}


def recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]()
    except KeyError:
        raise ConfigError(f"recipe: unknown {name!r}; use one of {', '.join(RECIPES)}") from None


# ---- the run's model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelPlan:
    """What a run trains: recorded in every checkpoint's sidecar (`sidecar`), rebuilt by Policy."""

    model: GrootConfig
    processor: Processor  # N1.6's processor: image settings, per embodiment its config and statistics
    prompts: tuple[PromptTable, ...]  # per root of the run's data
    tokenizer: str | None  # the directory of the tokenizer files; None = bytes
    init_from: str | None

    @property
    def embodiment_id(self) -> int:
        """The projector of the run's (first) embodiment."""
        return next(iter(self.processor.embodiments.values())).projector

    def sidecar(self) -> dict:
        return {"model": self.model.to_dict(), "processor": self.processor.cfg.to_dict(),
                "gr00t_processor": self.processor.to_json(), "embodiment_id": self.embodiment_id,
                "tokenizer": self.tokenizer, "init_from": self.init_from}


def embodiment_id(tag: str, cfg: GrootConfig) -> int:
    """A GR00T embodiment tag (or a projector index) -> the projector index, checked against the model."""
    return emb.projector_index(tag, cfg.max_num_embodiments)


def _switches(opts: ModelConfig) -> dict:
    """The --tune-* flags the user gave (None = keep the recipe's / checkpoint's)."""
    names = ("tune_llm", "tune_visual", "tune_top_llm_layers", "tune_projector", "tune_diffusion_model", "tune_vlln")
    return {n: getattr(opts, n) for n in names if getattr(opts, n) is not None}


def base_configs(cfg: TrainConfig) -> tuple[GrootConfig, ProcessorConfig, dict]:
    """The recipe's, or the --init-from checkpoint's (config.json, processor_config.json, and its
    statistics.json: {tag: statistics} the checkpoint was trained with, {} without one)."""
    src = cfg.model.init_from
    if src is None:
        r = recipe(cfg.recipe)
        return r.model, r.processor, {}
    if not os.path.isdir(src):
        raise ConfigError(f"--init-from {src}: not a directory (give an Isaac-GR00T N1.6 checkpoint directory)")
    model = read_gr00t_dir_config(os.path.join(src, "config.json"))
    proc, stats = ProcessorConfig(), {}
    for name in ("processor_config.json", "statistics.json"):
        path = os.path.join(src, name)
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--init-from {src}: {name} is unreadable ({exc})") from None
            if name == "statistics.json":
                stats = doc if isinstance(doc, dict) else {}
            else:
                proc = processor_from_gr00t_json(doc)
    return model, proc, stats


def embodiments(data, model: GrootConfig, pretrained: dict, override: bool) -> dict[str, Embodiment]:
    """The run's embodiments: per tag of its roots, the roots' statistics merged with their mixture weights,
    unless the --init-from checkpoint has statistics for the tag: N1.6 keeps those (set_statistics with
    override False) unless --override-statistics."""
    merged, configs = data.embodiment_statistics(), data.configs()
    out = {}
    for tag, config in configs.items():
        stats = merged[tag]
        if tag in pretrained and not override:
            stats = {k: pretrained[tag].get(k, {}) for k in ("state", "action", "relative_action")}
            log.info("embodiment %s: the checkpoint's statistics (as N1.6 fine-tunes; --override-statistics takes "
                     "the data's)", tag)
        out[tag] = Embodiment(tag, embodiment_id(tag, model), config, stats)
    return out


def plan_model(cfg: TrainConfig, data, *, processor: ProcessorConfig | None = None) -> ModelPlan:
    """The run's model from the config and the data (a data.training_data.TrainingData); `processor`
    replaces the recipe's image processing (benchmarks that shrink the images)."""
    opts = cfg.model
    model, proc, pretrained = base_configs(cfg)
    proc = processor or proc
    if opts.color_jitter is not None:
        proc = dataclasses.replace(proc, color_jitter=opts.color_jitter or None)
    ds = data.dataset
    tok_dir = opts.tokenizer or (opts.init_from if has_tokenizer(opts.init_from) else None)
    tok = load_tokenizer(tok_dir, model.image_token_index)
    fields: dict = {**_switches(opts)}
    if opts.dit_dropout is not None:
        fields["dit"] = {"dropout": opts.dit_dropout}
    if opts.state_dropout is not None:
        fields["state_dropout_prob"] = opts.state_dropout
    sizes = _data_sizes(data, proc)
    if opts.init_from is None:
        # From scratch: the vocabulary's image token, and room for the data's dims and horizon.
        fields.update(image_token_index=tok.image_token_id, action_horizon=sizes["horizon"],
                      max_state_dim=max(model.max_state_dim, sizes["state"]),
                      max_action_dim=max(model.max_action_dim, sizes["action"]))
        if has_tokenizer(tok_dir):
            fields["text"] = {"vocab_size": max(model.text.vocab_size, len(tok.tok))}
    elif tok_dir is None and model.text.vocab_size != BYTE_VOCAB:
        raise ConfigError(f"--init-from {opts.init_from}: its LLM reads Qwen3 tokens and the directory holds no "
                          "tokenizer; give --tokenizer DIR (Isaac-GR00T's "
                          "gr00t/model/modules/nvidia/Eagle-Block2A-2B-v2 folder; `--tokenizer bytes` only for "
                          "tests on a reduced checkpoint)")
    model = model.replace(**fields)
    if tok.image_token_id != model.image_token_index:
        raise ConfigError(f"tokenizer {tok.name}: <IMG_CONTEXT> is token {tok.image_token_id}, the model's image "
                          f"token is {model.image_token_index}; use the checkpoint's own tokenizer")
    if opts.embodiment_tag is not None and {r.tag for r in data.roots} != {opts.embodiment_tag}:
        raise ConfigError(f"--embodiment-tag {opts.embodiment_tag}: the data was preprocessed as "
                          f"{sorted({r.tag for r in data.roots})}; the tag is chosen at `loongforge preprocess "
                          "--embodiment-tag`")
    try:
        processor = Processor(proc, embodiments(data, model, pretrained, opts.override_statistics),
                              max_state_dim=model.max_state_dim, max_action_dim=model.max_action_dim,
                              max_action_horizon=model.action_horizon)
    except ConfigError as exc:
        hint = ": select the state/action keys the checkpoint was trained with" if opts.init_from else ""
        raise ConfigError(f"{exc}{hint}") from None
    tokens = model.tokens_per_image(*proc.image_size)
    prompts = tuple(build_prompts(tok, r.dataset.tasks or {}, images=len(r.cameras) * r.deltas.frames,
                                  tokens_per_image=tokens, vocab_size=model.text.vocab_size) for r in data.roots)
    return ModelPlan(model=model, processor=processor, prompts=prompts, tokenizer=tok_dir, init_from=opts.init_from)


def _data_sizes(data, proc: ProcessorConfig) -> dict:
    """The widest processed state and action and the longest horizon over the run's embodiments."""
    sas = [StateAction(c, data.embodiment_statistics()[t], proc.options, tag=t) for t, c in data.configs().items()]
    return {"state": max(sa.state_dim for sa in sas), "action": max(sa.action_dim for sa in sas),
            "horizon": max(sa.horizon for sa in sas)}
