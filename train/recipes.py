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
has Qwen3's. A from-scratch run trains everything; a run with --init-from takes the checkpoint's
architecture, image processing and fine-tuning switches (N1.6's: vision and the LLM below its top
4 layers frozen), and only the --tune-* flags the user gave change them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from loongforge.shared.errors import ConfigError
from loongforge.train.config import ModelConfig, TrainConfig
from loongforge.train.data.processor import ProcessorConfig, processor_from_gr00t_json
from loongforge.train.data.prompt import (BYTE_IMAGE_TOKEN, BYTE_VOCAB, PromptTable, build_prompts, has_tokenizer,
                                          load_tokenizer)
from loongforge.train.model.config import (EMBODIMENT_TAGS, DiTConfig, GrootConfig, TextConfig, VisionConfig,
                                           read_gr00t_dir_config)


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
        input_embedding_dim=32, max_seq_len=64, **_SCRATCH), ProcessorConfig(image_edge=56))


def small() -> Recipe:
    return Recipe(GrootConfig(
        vision=VisionConfig(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                            num_patches=64),
        text=TextConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=32, vocab_size=BYTE_VOCAB),
        dit=DiTConfig(num_layers=8, num_attention_heads=4, attention_head_dim=64, output_dim=256),
        image_token_index=BYTE_IMAGE_TOKEN, select_layer=4, backbone_embedding_dim=256, hidden_size=256,
        input_embedding_dim=256, max_seq_len=128, **_SCRATCH), ProcessorConfig(image_edge=112))


def gr00t_n1_6() -> Recipe:
    return Recipe(GrootConfig(**_SCRATCH), ProcessorConfig())


RECIPES = {"tiny": tiny, "small": small, "gr00t-n1.6": gr00t_n1_6}


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
    processor: ProcessorConfig
    prompts: PromptTable
    embodiment_id: int
    tokenizer: str | None  # the directory of the tokenizer files; None = bytes
    init_from: str | None

    def sidecar(self) -> dict:
        return {"model": self.model.to_dict(), "processor": self.processor.to_dict(),
                "embodiment_id": self.embodiment_id, "tokenizer": self.tokenizer, "init_from": self.init_from}


def embodiment_id(tag: str, cfg: GrootConfig) -> int:
    """A GR00T embodiment tag (or a projector index) -> the projector index, checked."""
    if tag in EMBODIMENT_TAGS:
        idx = EMBODIMENT_TAGS[tag]
    elif tag.isdigit():
        idx = int(tag)
    else:
        raise ConfigError(f"--embodiment-tag {tag!r}: use one of {', '.join(EMBODIMENT_TAGS)} or a projector "
                          "index")
    if idx >= cfg.max_num_embodiments:
        raise ConfigError(f"--embodiment-tag {tag!r} is projector {idx}, the model has {cfg.max_num_embodiments}")
    return idx


def _switches(opts: ModelConfig) -> dict:
    """The --tune-* flags the user gave (None = keep the recipe's / checkpoint's)."""
    names = ("tune_llm", "tune_visual", "tune_top_llm_layers", "tune_projector", "tune_diffusion_model", "tune_vlln")
    return {n: getattr(opts, n) for n in names if getattr(opts, n) is not None}


def base_configs(cfg: TrainConfig) -> tuple[GrootConfig, ProcessorConfig]:
    """The recipe's, or the --init-from checkpoint's (config.json, processor_config.json)."""
    src = cfg.model.init_from
    if src is None:
        r = recipe(cfg.recipe)
        return r.model, r.processor
    if not os.path.isdir(src):
        raise ConfigError(f"--init-from {src}: not a directory (give an Isaac-GR00T N1.6 checkpoint directory)")
    model = read_gr00t_dir_config(os.path.join(src, "config.json"))
    proc_path = os.path.join(src, "processor_config.json")
    proc = ProcessorConfig()
    if os.path.exists(proc_path):
        with open(proc_path, encoding="utf-8") as f:
            proc = processor_from_gr00t_json(json.load(f))
    return model, proc


def plan_model(cfg: TrainConfig, data, *, processor: ProcessorConfig | None = None) -> ModelPlan:
    """The run's model from the config and the data (a data.training_data.TrainingData); `processor`
    replaces the recipe's image processing (benchmarks that shrink the images)."""
    opts = cfg.model
    model, proc = base_configs(cfg)
    proc = processor or proc
    ds = data.dataset
    tok_dir = opts.tokenizer or (opts.init_from if has_tokenizer(opts.init_from) else None)
    tok = load_tokenizer(tok_dir, model.image_token_index)
    fields: dict = {**_switches(opts)}
    if opts.dit_dropout is not None:
        fields["dit"] = {"dropout": opts.dit_dropout}
    if opts.init_from is None:
        # From scratch: the vocabulary's image token, and room for the data's dims and horizon.
        fields.update(image_token_index=tok.image_token_id, action_horizon=ds.action_horizon,
                      max_state_dim=max(model.max_state_dim, ds.state_dim),
                      max_action_dim=max(model.max_action_dim, ds.action_dim))
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
    if ds.state_dim > model.max_state_dim or ds.action_dim > model.max_action_dim:
        raise ConfigError(f"the data has {ds.state_dim}-D state and {ds.action_dim}-D action; the model takes at "
                          f"most {model.max_state_dim} / {model.max_action_dim} (max_state_dim / max_action_dim "
                          "of the checkpoint): select the state/action columns it was trained on")
    tokens = model.tokens_per_image(*proc.image_size)
    images = len(ds.cameras) * data.max_frames
    prompts = build_prompts(tok, ds.tasks or {}, images=images, tokens_per_image=tokens,
                            vocab_size=model.text.vocab_size)
    return ModelPlan(model=model, processor=proc, prompts=prompts, embodiment_id=embodiment_id(opts.embodiment_tag, model),
                     tokenizer=tok_dir, init_from=opts.init_from)
