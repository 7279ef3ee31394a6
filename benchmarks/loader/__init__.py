"""The data-path benchmark (`loongforge bench data`): LoongForge's loader against the loaders users run today."""
