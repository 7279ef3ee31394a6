"""Speed and memory policies applied to a built model from outside: fusion, CUDA graphs, FP8, activation checkpointing."""
