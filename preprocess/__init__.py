"""The preprocess service: LeRobot datasets (v2.0, v2.1, v3.0; video or image features) -> NV12
shards + global index, as an Apache Beam job. One folder per concern:

    cli.py, pipeline.py, config.py, prepare.py, report.py, files.py   the job, its config, its summary
    stages/    one module per stage: discover, episode, decode / images, convert, pack, stats, finalize
    lerobot/   a LeRobot dataset's layout: meta, per_episode (v2.0 / v2.1), chunked (v3.0)
    runner/    where it runs: choice (local, Dask, Dataflow, ...), launch, dask_job, progress
    samples/   built-in sample data: dataset (LeRobot v2.0 with real H.264), camera, layouts (v2.1 /
               v3.0 rewrites: H.264, HEVC or AV1), learnable

Entry points other services use:
    loongforge.preprocess.pipeline.run_job(PreprocessConfig, beam_args, RunnerConfig) -> summary dict
    loongforge.preprocess.samples.dataset.generate_dataset(root, ...) -> Path
    loongforge.shared.summary.summarize(shard_root) -> summary dict
"""
