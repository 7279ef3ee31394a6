"""`loongforge bench ablation`: the seed's ablation ladder, measured on this machine."""
