"""`loongforge bench faults`: fault injection against real elastic runs."""
