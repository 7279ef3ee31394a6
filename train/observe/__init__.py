"""Run observability: per-step metrics, profiler, timeline arithmetic, the `loongforge profile` breakdown."""
