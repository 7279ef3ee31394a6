"""The SigLIP2 vision tower of N1.6's Eagle backbone, built from transformers' SigLIP2 blocks.

Module and parameter names are the checkpoint's (`vision_model.vision_model.embeddings...`,
`.encoder.layers.N...`, `.post_layernorm`, `.head...`). The reference packs every image of a batch
into one sequence and attends within each image (flash-attn varlen over per-image lengths); with
every image of a run the same size that is exactly a batch of images with full attention each,
which is what runs here: (images, patches, width), no mask, one kernel call per layer.

The pooling head is part of the checkpoint (and of the parameter count) but N1.6 never calls it:
it is built, loaded and saved, never run, and never trains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.train.model.attention import HF_ATTENTION, Attention, bind_attention
from loongforge.train.model.config import VisionConfig
from loongforge.train.model.hf import (Siglip2EncoderLayer, Siglip2MultiheadAttentionPoolingHead, Siglip2VisionConfig,
                                       Siglip2VisionEmbeddings)


def hf_vision_config(cfg: VisionConfig) -> Siglip2VisionConfig:
    hf = Siglip2VisionConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                             num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                             num_channels=cfg.num_channels, num_patches=cfg.num_patches, patch_size=cfg.patch_size,
                             layer_norm_eps=cfg.layer_norm_eps, hidden_act=cfg.hidden_act, attention_dropout=0.0)
    hf._attn_implementation = HF_ATTENTION
    return hf


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, H/p * W/p, p * p * C), patches row-major, each (py, px, c) as the
    reference's convert_images_to_patches."""
    n, c, h, w = pixels.shape
    x = pixels.reshape(n, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(n, (h // patch) * (w // patch), patch * patch * c)


class Encoder(nn.Module):
    def __init__(self, hf: Siglip2VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList([Siglip2EncoderLayer(hf) for _ in range(hf.num_hidden_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attention_mask=None)
        return x


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        hf = hf_vision_config(cfg)
        self.patch_size = cfg.patch_size
        self.embeddings = Siglip2VisionEmbeddings(hf)
        self.encoder = Encoder(hf)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.head = Siglip2MultiheadAttentionPoolingHead(hf)  # in the checkpoint, never called

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """(N, 3, H, W) normalized images -> (N, H/p * W/p, width) last hidden state, and the
        (H/p, W/p) patch grid."""
        grid = (pixels.shape[-2] // self.patch_size, pixels.shape[-1] // self.patch_size)
        emb = self.embeddings
        x = emb.patch_embedding(patchify(pixels, self.patch_size).to(emb.patch_embedding.weight.dtype))
        return self.post_layernorm(self.encoder(x + self.positions(grid))), grid

    def positions(self, grid: tuple[int, int]) -> torch.Tensor:
        """The learned square position table resized to the image's patch grid: the numbers of
        Siglip2VisionEmbeddings.resize_positional_embeddings (bilinear, antialiased, fp32 on the CPU
        where antialiasing has no bf16 kernel), computed once for the batch (every image has the same
        grid) and without its per-image host loop."""
        table = self.embeddings.position_embedding.weight
        side = self.embeddings.position_embedding_size
        x = table.reshape(side, side, -1).permute(2, 0, 1)[None]
        x = x.float() if x.device.type == "cpu" else x
        x = F.interpolate(x, size=grid, mode="bilinear", align_corners=False, antialias=True)
        return x.reshape(table.shape[-1], grid[0] * grid[1]).transpose(0, 1).to(table.dtype)[None]


class VisionModel(nn.Module):
    """`vision_model` of the Eagle model; its one child keeps the reference's second `vision_model`."""

    def __init__(self, cfg: VisionConfig, attn: Attention):
        super().__init__()
        self.vision_model = VisionTransformer(cfg)
        bind_attention(self, attn)

    def forward(self, pixels: torch.Tensor):
        return self.vision_model(pixels)
