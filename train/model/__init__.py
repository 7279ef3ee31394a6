"""The model: layers, attention, masks, recipes. Knows nothing of parallelism."""
