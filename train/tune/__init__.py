"""`loongforge tune`: measured trade-offs (activation checkpointing, batch size, bucket sizes)."""
