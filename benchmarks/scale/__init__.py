"""`loongforge bench scale`: the same job at 1-8 ranks, then an alpha-beta projection."""
