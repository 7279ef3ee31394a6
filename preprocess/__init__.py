"""The preprocess service: LeRobot datasets (v2.0, v2.1, v3.0; video or image features) -> NV12
shards + global index, as an Apache Beam job (pipeline.py; one module per stage:
discover (lerobot_meta, lerobot_v2, lerobot_v3), episode, decode / images, convert, pack,
stats, finalize; the runner it runs on: runners.py, launch.py, dask_job.py). sample_data.py
generates LeRobot v2.0 datasets with real H.264 for demos, tests and benchmarks;
sample_layouts.py rewrites them as v2.1 or v3.0 (H.264, HEVC or AV1).

Entry points other services use:
    loongforge.preprocess.pipeline.run_job(PreprocessConfig, beam_args, RunnerConfig) -> summary dict
    loongforge.preprocess.sample_data.generate_dataset(root, ...) -> Path
    loongforge.preprocess.report.summarize(shard_root) -> summary dict
"""
