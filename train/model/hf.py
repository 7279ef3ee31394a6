"""The transformers blocks N1.6 is built from (SigLIP2's vision layers, Qwen3's decoder layers) and its
attention registry, imported in one place: only a process that builds the model pays for transformers'
modelling code (~1x a bare `import torch`), not one that reads a model config (preflight, the elastic
supervisor, `loongforge ckpt` on configs).

transformers imports torchao (when installed: the [fp8] extra) for its own quantizers, which
LoongForge never uses (its FP8 path calls torchao itself, kernels/precision.py). That import costs
~1 s and prints six warning lines (CUDA kernels built for another Python, deprecated pytree
registrations). transformers is told torchao is absent while its modelling code imports; a
transformers without that probe imports as it is.
"""

from __future__ import annotations

import transformers.utils as _tu
import transformers.utils.import_utils as _iu

_probe = getattr(_iu, "is_torchao_available", None)
if _probe is not None:
    _iu.is_torchao_available = _tu.is_torchao_available = lambda *a, **k: False
try:
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding
    from transformers.models.siglip2.configuration_siglip2 import Siglip2VisionConfig
    from transformers.models.siglip2.modeling_siglip2 import (Siglip2EncoderLayer,
                                                              Siglip2MultiheadAttentionPoolingHead,
                                                              Siglip2VisionEmbeddings)
finally:
    if _probe is not None:
        _iu.is_torchao_available = _tu.is_torchao_available = _probe

__all__ = ["AttentionInterface", "Qwen3Config", "Qwen3DecoderLayer", "Qwen3RMSNorm", "Qwen3RotaryEmbedding",
           "Siglip2EncoderLayer", "Siglip2MultiheadAttentionPoolingHead", "Siglip2VisionConfig",
           "Siglip2VisionEmbeddings"]
