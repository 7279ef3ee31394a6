"""Hybrid parallelism applied to the model from outside: process groups (plan),
tensor parallel (module swap), sequence parallel on video tokens, top-k gradient
compression with error feedback, and per-group communication accounting.
The model never imports this package; see README.md here for the design."""
