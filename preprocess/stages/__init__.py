"""The preprocess job's stages, one module per stage: discover (1), episode (2), decode / images (3),
convert (2-5 for one episode), pack (5), stats, finalize (6); colorspace: each stream's colour."""
