"""Checkpoints: async + delta writes, verified resume with fallback, layout conversion (reshard)."""
