"""Reading a LeRobot dataset's layout: meta (any version), per_episode (v2.0 / v2.1: one parquet
and one mp4 per camera per episode), chunked (v3.0: many episodes per file)."""
