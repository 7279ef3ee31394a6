"""The launcher's side of a job on a dask.distributed cluster (Beam's Dask runner).

    dask scheduler --port 8786                                  # one machine
    dask worker tcp://SCHEDULER:8786 --nthreads 1 --nworkers N  # every machine, N = its cores
    loongforge preprocess --input D --output S --runner dask --dask-scheduler tcp://SCHEDULER:8786

The scheduler unpickles the job's task graph and the workers run it, so both need this
project installed at the launcher's version (and a restart after a code change): checked
before any work, with a message that says what to install where (infra/dask/). The input
and the output must be reachable under the same path or URL from every worker (an object
store, or a shared mount): convert tasks read the source and write staging files, shard
writers and finalize write the root.

Without --dask-scheduler the job starts a local cluster of --workers single-threaded
worker processes for its duration (dask's LocalCluster).

Losing a worker: dask recomputes what the worker held or was running on the others
(an episode is then converted again, to the same bytes); a task whose workers died more
often than the scheduler allows (distributed.scheduler.allowed-failures, 3) fails the job
with a RunnerError, and nothing is published (index.json is written last).
"""

from __future__ import annotations

import importlib.metadata
import logging
import time

from loongforge import __version__
from loongforge.preprocess.runner.progress import EpisodeEvents
from loongforge.shared.errors import ConfigError, RunnerError

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 20
WORKERS_TIMEOUT_S = 60
SETTLE_S = 10  # after the job: the last tasks' events may still be on their way


def load_job_modules() -> str:
    """Run on every worker and on the scheduler before the job: loads the modules its tasks
    unpickle (a missing install or extra fails here, in one message, not in the first task; and
    no worker pays the import in its first task while the others take the work), and returns the
    installed version."""
    importlib.import_module("loongforge.preprocess.pipeline")
    return importlib.metadata.version("loongforge")


class DaskSession:
    """The cluster (given, or a local one), a client subscribed to the job's progress topic,
    and the checks before any work. `start()`, the job, `settle()`, then `close()`."""

    def __init__(self, scheduler: str, workers: int, topic: str, events: EpisodeEvents):
        self.scheduler, self.workers, self.topic, self.events = scheduler, workers, topic, events
        self.address = scheduler
        self.cluster = self.client = None

    def start(self) -> None:
        try:
            import distributed  # optional dependency: the dask extra (apache-beam[dask])
        except ImportError as exc:
            raise ConfigError(f"--runner dask needs the dask extra: pip install 'loongforge[preprocess-dask]' "
                              f"({exc})") from exc
        if not self.scheduler:
            # ":0": any free port for the scheduler's HTTP endpoints (another cluster may hold 8787)
            self.cluster = distributed.LocalCluster(n_workers=self.workers, threads_per_worker=1, processes=True,
                                                    dashboard_address=":0")
            self.address = self.cluster.scheduler_address
            log.info("dask: a local cluster of %d worker processes at %s", self.workers, self.address)
        try:
            self.client = distributed.Client(self.address, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
        except (OSError, TimeoutError) as exc:
            raise RunnerError(f"cannot reach the dask scheduler at {self.address} ({exc}). Start it (`dask "
                              f"scheduler`) and its workers (`dask worker {self.address} --nthreads 1`), or fix "
                              "--dask-scheduler") from exc
        self._check_cluster()
        self.client.subscribe_topic(self.topic, self.events.handle)

    def _check_cluster(self) -> None:
        try:
            self.client.wait_for_workers(1, timeout=WORKERS_TIMEOUT_S)
        except TimeoutError as exc:
            raise RunnerError(f"no dask worker joined {self.address} within {WORKERS_TIMEOUT_S} s: start workers "
                              f"(`dask worker {self.address} --nthreads 1`) where this project is installed") from exc
        found = self.client.run(load_job_modules, on_error="return")
        try:
            found["scheduler"] = self.client.run_on_scheduler(load_job_modules)
        except Exception as exc:  # noqa: BLE001 - whatever the scheduler raised is the answer
            found["scheduler"] = exc
        wrong = {where: got for where, got in sorted(found.items()) if got != __version__}
        if wrong:
            where = "; ".join(f"{w}: {g if isinstance(g, str) else f'{type(g).__name__}: {g}'}"[:300]
                              for w, g in wrong.items())
            raise RunnerError(f"the dask cluster at {self.address} does not run loongforge {__version__} with the "
                              f"preprocess extra ({where}). The scheduler unpickles the job's graph and the workers "
                              "run it: install this project on both (pip install 'loongforge[preprocess-dask]', "
                              "infra/dask/) and restart them")
        log.info("dask: %d workers at %s", len(found) - 1, self.address)

    def explain(self, exc: Exception) -> RunnerError | None:
        """A worker loss dask gave up on, as one clear error; None for anything else."""
        import distributed  # optional dependency, imported by start()

        if not isinstance(exc, distributed.KilledWorker):
            return None
        return RunnerError(f"dask workers died running a task of this job, more often than the scheduler retries "
                           f"({exc}). Nothing was published: index.json is written last and is absent. Check the "
                           "workers' logs and memory, then re-run (same input, same shards)")

    def settle(self, finished: int) -> None:
        """Wait (briefly) until the events of `finished` episodes are in, then add any the live
        subscription missed from the scheduler's log of the topic."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and len(set().union(*self.events.finished())) < finished:
            time.sleep(0.05)
        for event in self.client.get_events(self.topic):
            self.events.handle(event)

    def close(self, result=None) -> None:
        """The runner's own client (Beam leaves it open), ours, and the local cluster if we started one."""
        for client in (getattr(result, "client", None), self.client):
            if client is not None:
                client.close()
        if self.cluster is not None:
            self.cluster.close()
        self.cluster = self.client = None
