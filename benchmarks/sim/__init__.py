"""`loongforge bench closed-loop`: demonstrations -> preprocess -> train -> closed-loop eval in a simulator."""
