"""Code every LoongForge service uses: shard format, index schema, reader, errors, paths."""
