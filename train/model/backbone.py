"""N1.6's Eagle3-VL backbone: SigLIP2 images -> pixel unshuffle -> mlp1 -> placed at the image
tokens of the chat-template prompt -> Qwen3 (transformers' decoder layers, cut at `select_layer`)
-> the final RMSNorm of the last kept layer. Module names are the checkpoint's
(`backbone.model.{vision_model, mlp1, language_model.model}`); the LM head is tied to the
embeddings and never used, so it is not built (nor stored, as in the reference's files).

Two places where a parallel plan may re-cut the work, from outside (train/parallel/video_sp.py):
`model.images` splits the image batch over an SP group before the vision tower and gathers the
embeddings after it; `model.tokens` shards the LLM's image tokens before its layers and gathers
them after. The defaults here cut nothing, and the model imports no parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.train.model.attention import HF_ATTENTION, Attention, bind_attention
from loongforge.train.model.config import GrootConfig, TextConfig
from loongforge.train.model.hf import Qwen3Config, Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding
from loongforge.train.model.mask import Causal
from loongforge.train.model.vision import VisionModel


def hf_text_config(cfg: TextConfig, layers: int) -> Qwen3Config:
    hf = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=layers, num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act=cfg.hidden_act,
                     max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                     rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                     attention_bias=False, use_sliding_window=False, tie_word_embeddings=True, use_cache=False)
    hf._attn_implementation = HF_ATTENTION
    return hf


class Images:
    """Where the image batch may be split (default: not at all)."""

    def split(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels

    def merge(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds


class Tokens:
    """Where the LLM's token sequence may be re-cut (default: not at all). `split` gets the
    (B, N, d) embeddings, (B, N) positions, the Causal mask and the (B, N) image-token mask, and
    returns what the layers run on; `merge` restores the (B, N, d) sequence."""

    def split(self, seq, positions, mask, image_mask):
        return seq, positions, mask

    def merge(self, seq: torch.Tensor) -> torch.Tensor:
        return seq


class TextModel(nn.Module):
    """Qwen3's `model` (embed_tokens, layers, norm) cut at `layers`; the loop is ours so positions
    and the mask description travel with the tokens a plan may re-cut."""

    def __init__(self, cfg: TextConfig, layers: int):
        super().__init__()
        hf = hf_text_config(cfg, layers)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(hf, i) for i in range(layers)])
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(hf)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask) -> torch.Tensor:
        rope = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_embeddings=rope)
        return self.norm(x)


class LanguageModel(nn.Module):
    """`language_model` of the Eagle model (Qwen3ForCausalLM without its tied head)."""

    def __init__(self, cfg: TextConfig, layers: int):
        super().__init__()
        self.model = TextModel(cfg, layers)


class EagleModel(nn.Module):
    def __init__(self, cfg: GrootConfig, attn: Attention):
        super().__init__()
        self.image_token_index = cfg.image_token_index
        self.unshuffle = cfg.unshuffle
        self.vision_model = VisionModel(cfg.vision, attn)
        self.language_model = LanguageModel(cfg.text, cfg.select_layer)
        width = cfg.vision.hidden_size * cfg.unshuffle ** 2
        self.mlp1 = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, cfg.text.hidden_size), nn.GELU(),
                                  nn.Linear(cfg.text.hidden_size, cfg.text.hidden_size))
        bind_attention(self.language_model, attn)
        self.images, self.tokens = Images(), Tokens()  # a plan may replace them (module docstring)

    def image_embeds(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) -> (N * H/28 * W/28, d_llm): vision tower, 2 x 2 pixel unshuffle, mlp1."""
        x, (gh, gw) = self.vision_model(self.images.split(pixels))
        n, _, c = x.shape
        x = F.pixel_unshuffle(x.transpose(1, 2).reshape(n, c, gh, gw), self.unshuffle)
        x = self.mlp1(x.flatten(2).transpose(1, 2))
        return self.images.merge(x).flatten(0, 1)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """-> (B, N, d_llm) features: the final norm of the last kept layer, every position."""
        lm = self.language_model.model
        seq = lm.embed_tokens(input_ids)
        image_mask = input_ids == self.image_token_index
        vit = self.image_embeds(pixels).to(seq.dtype)
        # A prompt whose image tokens do not match the images would train on garbage silently
        # (masked_scatter takes what it needs): checked on the device, no host sync.
        torch._assert_async(image_mask.sum() == vit.shape[0], "image tokens in the prompts != image embeddings")
        seq = seq.masked_scatter(image_mask[..., None], vit)  # row-major, as the reference fills them
        b, n = input_ids.shape
        # NOTE: positions 0..N-1 on every row, padding included: the reference (HF Qwen3 without
        # position_ids) counts a left-padded row's pads too.
        positions = torch.arange(n, device=input_ids.device)[None].expand(b, n)
        seq, positions, mask = self.tokens.split(seq, positions, Causal(attention_mask.bool()), image_mask)
        return self.tokens.merge(lm(seq, positions, mask))


class Backbone(nn.Module):
    """`backbone`: the Eagle model and the masks the action head reads."""

    def __init__(self, cfg: GrootConfig, attn: Attention):
        super().__init__()
        self.model = EagleModel(cfg, attn)

    def forward(self, pixels, input_ids, attention_mask) -> dict[str, torch.Tensor]:
        return {"backbone_features": self.model(pixels, input_ids, attention_mask),
                "backbone_attention_mask": attention_mask.bool(),
                "image_mask": input_ids == self.model.image_token_index}
