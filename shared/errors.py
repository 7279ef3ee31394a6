"""The one error hierarchy of LoongForge. Every service raises these, so callers
can catch `LoongForgeError` at a boundary and tests can assert the precise kind."""

from __future__ import annotations


class LoongForgeError(Exception):
    """Root of every error LoongForge raises on purpose. `exit_code`: what the
    `loongforge` command exits with when this error ends it."""

    exit_code = 1


class ConfigError(LoongForgeError, ValueError):
    """A config value or file is invalid. The message names the field and the fix."""


class UsageError(ConfigError):
    """The command cannot run as asked, found before any work: a flag that names what the
    input does not have, or an input this LoongForge does not read. Exit code 2, as for bad flags."""

    exit_code = 2


class FormatError(LoongForgeError):
    """On-disk bytes do not follow the shard/index format (truncated, malformed)."""


class FormatVersionError(FormatError):
    """An artifact carries a format version this build cannot read."""


class IntegrityError(FormatError):
    """Bytes do not match the size or hash recorded in the index."""


class UnsafePathError(LoongForgeError, ValueError):
    """A shard or sample name tries to leave its directory (path traversal)."""


class StorageError(LoongForgeError, OSError):
    """Storage failed under us: a remote URL (object store, HTTP) unreachable,
    denied or throttled, or an output disk full. The message names the place
    and what to check."""


class RunnerError(LoongForgeError):
    """The job's runner failed under it: a cluster unreachable, without workers or without this
    project installed, or workers lost past the runner's retries. The message says what to fix;
    nothing was published."""


class SourceDataError(LoongForgeError):
    """Input dataset problem: corrupt video, missing file, length mismatch."""


class UnsupportedSourceError(SourceDataError):
    """The input is not a dataset this LoongForge reads (an unknown LeRobot version, a
    meta/info.json that is not JSON): refused before any work, exit code 2."""

    exit_code = 2


class CacheError(LoongForgeError):
    """Cache daemon or client failure."""


class CacheUnavailableError(CacheError):
    """The cache daemon cannot be reached."""


class ShardNotFoundError(CacheError, KeyError):
    """A shard name is not in the index."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its key: quotes around the whole message
        return str(self.args[0]) if self.args else ""


class TrainError(LoongForgeError):
    """Trainer failure: data worker died, bad checkpoint, bad layout."""


class CheckpointError(TrainError):
    """A checkpoint is missing, corrupt or of an unknown format version."""


class DataWorkerError(TrainError):
    """A decode worker died or raised; the message says which and why."""


class ServeError(LoongForgeError):
    """The policy server or its client failed: a server that cannot start (address, key file), or a
    client whose server did not answer in time or answered with an error."""


class RequestError(ServeError, ValueError):
    """A request the policy server refuses: a malformed frame, a wrong token, an unknown endpoint, an
    observation outside the served modality config. Its message is the one-line error reply."""
