"""The data path: global order, samples, decode workers, batches, prefetch, colour conversion."""
