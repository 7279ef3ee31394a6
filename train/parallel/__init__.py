"""Parallelism applied to the model from outside: process groups (plan), tensor parallel (module
swap), sequence parallel on video tokens, ZeRO, top-k gradient compression with error feedback,
per-group communication accounting, and `parallelize()`, the one ordered step from a model
factory to the DeepSpeed engine. The model never imports this package; see README.md here."""
