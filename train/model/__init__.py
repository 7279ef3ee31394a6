"""The model: GR00T N1.6 (Eagle backbone + AlternateVLDiT action head), attention, masks, weights'
names. Knows nothing of parallelism."""

import logging as _logging


def _import_transformers_quietly() -> None:
    """transformers imports torchao (when installed, the [fp8] extra) for its quantizers, and torchao
    warns at import about CUDA kernels built for another Python plus deprecated pytree registrations:
    six lines on every command, even `ckpt reshard`'s one-line errors. Those two loggers are raised to
    ERROR for this one import only; later torchao messages (the FP8 path's) are untouched."""
    loggers = [_logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(_logging.ERROR)
    try:
        import transformers.modeling_utils  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_import_transformers_quietly()
