"""Surviving faults: the elastic supervisor, the hang watchdog, the NaN guard."""
