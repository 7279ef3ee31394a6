"""LoongForge trainer: deterministic sharded data order, shared-memory decode
workers, async device prefetch, a GR00T-like VLA model and DeepSpeed ZeRO
training with a per-step time breakdown. Map of modules: README.md.

Public entry points: `loongforge.train.data.loader.BlockLoader` (data),
`python -m loongforge.train` (one rank under torchrun/deepspeed),
`loongforge train` / `loongforge profile` (CLI)."""
