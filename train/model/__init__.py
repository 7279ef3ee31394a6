"""The model: GR00T N1.6 (Eagle backbone + AlternateVLDiT action head), attention, masks, weights'
names. Knows nothing of parallelism."""


def _import_transformers_without_torchao() -> None:
    """transformers imports torchao (when installed: the [fp8] extra) for its own quantizers, which
    LoongForge never uses (its FP8 path calls torchao itself, kernels/precision.py). That import costs
    ~1 s in every process that builds the model (each rank, each CLI) and prints six warning lines
    (CUDA kernels built for another Python, deprecated pytree registrations). transformers is told
    torchao is absent while its modelling code imports; a transformers without that probe imports as
    it is."""
    import transformers.utils as tu
    import transformers.utils.import_utils as iu

    probe = getattr(iu, "is_torchao_available", None)
    if probe is not None:
        iu.is_torchao_available = tu.is_torchao_available = lambda *a, **k: False
    try:
        import transformers.modeling_utils  # noqa: F401
    finally:
        if probe is not None:
            iu.is_torchao_available = tu.is_torchao_available = probe


_import_transformers_without_torchao()
