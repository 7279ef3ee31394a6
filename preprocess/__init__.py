"""The preprocess service: LeRobot v2 datasets (parquet + H.264 mp4) -> NV12
shards + global index, as an Apache Beam job (pipeline.py; one module per stage:
discover, episode, decode, convert, pack, stats, finalize; the runner it runs on:
runners.py, launch.py, dask_job.py). sample_data.py generates LeRobot v2 datasets
with real H.264 for demos, tests and benchmarks.

Entry points other services use:
    loongforge.preprocess.pipeline.run_job(PreprocessConfig, beam_args, RunnerConfig) -> summary dict
    loongforge.preprocess.sample_data.generate_dataset(root, ...) -> Path
    loongforge.preprocess.report.summarize(shard_root) -> summary dict
"""
