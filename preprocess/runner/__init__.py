"""Where the preprocess job runs: choice (which Beam runner and its options), launch (one job
from start to summary), dask_job (a dask.distributed cluster), progress (the progress lines)."""
