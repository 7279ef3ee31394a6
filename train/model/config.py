"""GR00T N1.6's architecture as typed, frozen configs, and the conversion to and from the files an
Isaac-GR00T checkpoint directory carries.

`GrootConfig()` with no arguments is the released N1.6 architecture (2,964,610,912 parameters): the
defaults are Isaac-GR00T's `Gr00tN1d6Config` fields plus the bundled Eagle-Block2A-2B-v2 backbone
config (SigLIP2 vision tower, Qwen3-1.7B cut at `select_layer`). The recipes (recipes.py) return
reduced configs of the same structure. The names of the fields are the reference's, so a
`config.json` maps onto them one to one (`from_gr00t_json` / `to_gr00t_json`).

What is not architecture stays out: which parameters train (the `tune_*` switches live here because
N1.6 stores them in its config.json, and a fine-tune exports them back), the data, the layout.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from loongforge.shared.embodiment import PROJECTOR_INDEX
from loongforge.shared.errors import ConfigError

# The embodiment tags of N1.6 and their projector index (Isaac-GR00T's EMBODIMENT_TAG_TO_PROJECTOR_INDEX):
# each index selects one slice of the category-specific encoders and decoder (shared/embodiment.py).
EMBODIMENT_TAGS = PROJECTOR_INDEX


def _need(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"model.{name}: {msg}")


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionConfig:
    """SigLIP2 vision tower (Eagle's `vision_config`). Images attend within themselves only."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    patch_size: int = 14
    num_patches: int = 256  # learned position table, a square (16 x 16), resized to each image's grid
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        _need(self.hidden_size % self.num_attention_heads == 0, "vision.hidden_size",
              "must be a multiple of vision.num_attention_heads")
        side = round(self.num_patches ** 0.5)
        _need(side * side == self.num_patches, "vision.num_patches", "must be a square (the position table)")


@dataclass(frozen=True, kw_only=True, slots=True)
class TextConfig:
    """Qwen3 language model (Eagle's `text_config`), before it is cut at `select_layer`."""

    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151680
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    hidden_act: str = "silu"

    def __post_init__(self):
        _need(self.num_attention_heads % self.num_key_value_heads == 0, "text.num_attention_heads",
              "must be a multiple of text.num_key_value_heads (grouped KV heads)")
        _need(self.head_dim % 2 == 0, "text.head_dim", "must be even (rotary embedding)")


@dataclass(frozen=True, kw_only=True, slots=True)
class DiTConfig:
    """AlternateVLDiT (the reference's `diffusion_model_cfg`): inner width = heads x head_dim."""

    num_layers: int = 32
    num_attention_heads: int = 32
    attention_head_dim: int = 48
    output_dim: int = 1024
    dropout: float = 0.2
    final_dropout: bool = True
    norm_type: str = "ada_norm"
    interleave_self_attention: bool = True
    positional_embeddings: str | None = None

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def __post_init__(self):
        _need(self.norm_type == "ada_norm", "dit.norm_type", "N1.6 uses ada_norm (the only one built)")
        _need(self.interleave_self_attention, "dit.interleave_self_attention", "AlternateVLDiT needs it")
        _need(self.positional_embeddings is None, "dit.positional_embeddings", "N1.6 uses none in the blocks")
        _need(0.0 <= self.dropout < 1.0, "dit.dropout", "must be in [0, 1)")


@dataclass(frozen=True, kw_only=True, slots=True)
class GrootConfig:
    """GR00T N1.6: Eagle3-VL backbone (vision -> pixel unshuffle -> mlp1 -> Qwen3 cut at
    select_layer) + flow-matching action head (vlln, AlternateVLDiT, per-embodiment MLPs)."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    # backbone
    downsample_ratio: float = 0.5  # pixel unshuffle 2 x 2 before mlp1
    image_token_index: int = 151669  # <IMG_CONTEXT>
    select_layer: int = 16  # LLM layers kept; the features are the final norm of layer select_layer - 1
    backbone_embedding_dim: int = 2048
    # action head
    hidden_size: int = 1024
    input_embedding_dim: int = 1536
    max_state_dim: int = 29
    max_action_dim: int = 29
    action_horizon: int = 16
    max_num_embodiments: int = 32
    max_seq_len: int = 1024
    add_pos_embed: bool = True
    use_vlln: bool = True
    attend_text_every_n_blocks: int = 2
    state_dropout_prob: float = 0.0
    # flow matching
    num_inference_timesteps: int = 4
    noise_beta_alpha: float = 1.5
    noise_beta_beta: float = 1.0
    noise_s: float = 0.999
    num_timestep_buckets: int = 1000
    # what trains (N1.6's fine-tuning defaults; stored in its config.json)
    tune_llm: bool = False
    tune_visual: bool = False
    tune_top_llm_layers: int = 4
    tune_projector: bool = True
    tune_diffusion_model: bool = True
    tune_vlln: bool = True

    def __post_init__(self):
        _need(1 <= self.select_layer <= self.text.num_hidden_layers, "select_layer",
              f"must be in [1, text.num_hidden_layers={self.text.num_hidden_layers}]")
        _need(self.backbone_embedding_dim == self.text.hidden_size, "backbone_embedding_dim",
              f"must equal text.hidden_size ({self.text.hidden_size}): the DiT cross-attends to the LLM's features")
        _need(self.dit.inner_dim == self.input_embedding_dim, "input_embedding_dim",
              f"must equal dit heads x head_dim ({self.dit.inner_dim})")
        _need(self.dit.output_dim == self.hidden_size, "hidden_size",
              f"must equal dit.output_dim ({self.dit.output_dim}): the action decoder reads the DiT output")
        _need(0 <= self.image_token_index < self.text.vocab_size, "image_token_index", "must be a token id of the vocab")
        _need(self.downsample_ratio == 0.5, "downsample_ratio", "N1.6 unshuffles 2 x 2 (0.5)")
        _need(self.action_horizon >= 1 and self.action_horizon < self.max_seq_len, "action_horizon",
              f"must be in [1, max_seq_len={self.max_seq_len})")
        _need(self.max_num_embodiments >= 1, "max_num_embodiments", "must be >= 1")
        _need(self.tune_top_llm_layers >= 0, "tune_top_llm_layers", "must be >= 0 (more than select_layer = all)")
        _need(self.num_inference_timesteps >= 1, "num_inference_timesteps", "must be >= 1")
        _need(0.0 <= self.state_dropout_prob < 1.0, "state_dropout_prob", "must be in [0, 1)")

    @property
    def unshuffle(self) -> int:
        return round(1 / self.downsample_ratio)

    @property
    def pixels_per_token(self) -> int:
        """Image side in pixels per LLM image token: patch x unshuffle (N1.6: 28)."""
        return self.vision.patch_size * self.unshuffle

    def tokens_per_image(self, height: int, width: int) -> int:
        f = self.pixels_per_token
        if height % f or width % f:
            raise ConfigError(f"model: images of {height}x{width} are not a multiple of {f} pixels "
                              "(patch x pixel unshuffle); the processor resizes them to one")
        return (height // f) * (width // f)

    def replace(self, **kw) -> "GrootConfig":
        """A copy with fields replaced; nested configs take dicts of their own fields."""
        out = {}
        for k, v in kw.items():
            cur = getattr(self, k)
            out[k] = dataclasses.replace(cur, **v) if isinstance(v, dict) and dataclasses.is_dataclass(cur) else v
        return dataclasses.replace(self, **out)

    # ---- dict form (the checkpoint sidecar) ----
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "GrootConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"model config: unknown fields {unknown} (written by a newer LoongForge?)")
        kw = dict(doc)
        for name, sub in (("vision", VisionConfig), ("text", TextConfig), ("dit", DiTConfig)):
            if name in kw:
                kw[name] = sub(**kw[name])
        return cls(**kw)


def model_config_from(doc: dict) -> GrootConfig:
    """The architecture a checkpoint was trained with, from its sidecar (ckpt/checkpoint.py)."""
    raw = doc.get("model")
    if not isinstance(raw, dict) or "dit" not in raw:
        raise ConfigError("checkpoint sidecar has no GR00T N1.6 'model' config (written by a trainer before "
                          "N1.6); retrain it with this version")
    return GrootConfig.from_dict(raw)


# ---- Isaac-GR00T's files ------------------------------------------------------------------------------
# config.json holds Gr00tN1d6Config's fields that differ from its defaults (HF's save_pretrained); the
# backbone sizes come from the Eagle config that ships beside the code, which a fine-tune of the released
# model never changes. We read both and write both: config.json gets every head field we know plus
# an `eagle_config` block (ignored by Isaac-GR00T's loader, which reads the bundled one) so the
# directory rebuilds the same model here without Isaac-GR00T installed.
_HEAD_FIELDS = ("select_layer", "backbone_embedding_dim", "hidden_size", "input_embedding_dim", "max_state_dim",
                "max_action_dim", "action_horizon", "max_num_embodiments", "max_seq_len", "add_pos_embed",
                "use_vlln", "attend_text_every_n_blocks", "state_dropout_prob", "num_inference_timesteps",
                "noise_beta_alpha", "noise_beta_beta", "noise_s", "num_timestep_buckets", "tune_llm", "tune_visual",
                "tune_top_llm_layers", "tune_projector", "tune_diffusion_model", "tune_vlln")
_VISION_FIELDS = tuple(f.name for f in dataclasses.fields(VisionConfig))
_TEXT_FIELDS = tuple(f.name for f in dataclasses.fields(TextConfig))
_DIT_FIELDS = tuple(f.name for f in dataclasses.fields(DiTConfig))


def from_gr00t_json(config: dict, eagle: dict | None = None) -> GrootConfig:
    """Isaac-GR00T's config.json (+ the Eagle backbone config, or the `eagle_config` block we write,
    else the released Eagle-Block2A-2B-v2 sizes) -> GrootConfig."""
    model_type = config.get("model_type")
    if model_type not in ("Gr00tN1d6", None):
        raise ConfigError(f"config.json: model_type {model_type!r} is not GR00T N1.6 ('Gr00tN1d6'); "
                          "only N1.6 checkpoints load")
    kw = {k: config[k] for k in _HEAD_FIELDS if k in config}
    if "diffusion_model_cfg" in config:
        kw["dit"] = DiTConfig(**{k: v for k, v in config["diffusion_model_cfg"].items() if k in _DIT_FIELDS})
    eagle = eagle if eagle is not None else config.get("eagle_config")
    if eagle is not None:
        v, t = eagle.get("vision_config", {}), eagle.get("text_config", {})
        kw["vision"] = VisionConfig(**{k: v[k] for k in _VISION_FIELDS if k in v})
        tkw = {k: t[k] for k in _TEXT_FIELDS if k in t}
        rope = t.get("rope_parameters") or {}
        if "rope_theta" not in tkw and "rope_theta" in rope:
            tkw["rope_theta"] = rope["rope_theta"]
        kw["text"] = TextConfig(**tkw)
        if "image_token_index" in eagle:
            kw["image_token_index"] = eagle["image_token_index"]
        if "downsample_ratio" in eagle:
            kw["downsample_ratio"] = eagle["downsample_ratio"]
    return GrootConfig(**kw)


def eagle_json(cfg: GrootConfig) -> dict:
    """The Eagle backbone config of `cfg`, in Eagle3_VLConfig's layout."""
    return {"model_type": "eagle_3_vl", "architectures": ["Eagle3_VLForConditionalGeneration"],
            "downsample_ratio": cfg.downsample_ratio, "image_token_index": cfg.image_token_index,
            "select_layer": -1, "use_pixel_shuffle": True, "mlp_connector_layers": 2,
            "vision_config": {"model_type": "siglip2_vision_model", "use_rope": False, "use_windows_attn": False,
                              **{k: getattr(cfg.vision, k) for k in _VISION_FIELDS}},
            "text_config": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
                            "tie_word_embeddings": True,
                            **{k: getattr(cfg.text, k) for k in _TEXT_FIELDS}}}


def to_gr00t_json(cfg: GrootConfig) -> dict:
    """GrootConfig -> an Isaac-GR00T config.json (every head field written, the backbone beside it)."""
    return {"architectures": ["Gr00tN1d6"], "model_type": "Gr00tN1d6",
            "model_name": "nvidia/Eagle-Block2A-2B-v2", "backbone_model_type": "eagle",
            **{k: getattr(cfg, k) for k in _HEAD_FIELDS},
            "use_alternate_vl_dit": True, "diffusion_model_cfg": {k: getattr(cfg.dit, k) for k in _DIT_FIELDS},
            "model_dtype": "bfloat16", "torch_dtype": "float32", "eagle_config": eagle_json(cfg)}


def read_gr00t_dir_config(path: str) -> GrootConfig:
    """config.json of a checkpoint directory -> GrootConfig (one-line ConfigError when unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the GR00T config ({exc})") from None
    try:
        return from_gr00t_json(doc)
    except TypeError as exc:
        raise ConfigError(f"{path}: not a GR00T N1.6 config ({exc})") from None
