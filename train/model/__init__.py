"""The model: GR00T N1.6 (Eagle backbone + AlternateVLDiT action head), attention, masks, weights'
names. Knows nothing of parallelism. transformers' blocks come in through hf.py only."""
