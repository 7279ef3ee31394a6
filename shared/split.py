"""Train/validation split by episode.

Preprocess chooses the validation episodes (episode ids `--val-episodes 3,7`, a number of them
`--val-count 2`, a fraction `--val-fraction 0.1`, or the percentage `--val-episodes 10%`) against
the episodes it discovered, before any transcoding, and records them in the index
(`split.val_episodes`); the trainer reads training samples only and
evaluation reads whole validation episodes. Splitting by episode, not by sample, matters:
neighbouring samples of one episode share frames and action rows, so a per-sample split would
score the model on what it trained on.

A count or fraction picks a deterministic pseudo-random set (seeded, sorted), so re-running
preprocess gives the same split; at least one episode always stays for training.
"""

from __future__ import annotations

import numpy as np

from loongforge.shared.errors import ConfigError, UsageError

SPLIT_SEED = 0x5EED


def parse_val_spec(spec: str) -> float | tuple[int, ...] | None:
    """'' -> None, '10%' -> 0.1, '3,7' -> (3, 7)."""
    spec = (spec or "").strip()
    if not spec:
        return None
    if spec.endswith("%"):
        try:
            pct = float(spec[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct < 100:
            raise ConfigError(f"val_episodes={spec!r}: a percentage must be in (0, 100), e.g. 10%")
        return pct / 100.0
    try:
        eps = tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
    except ValueError:
        raise ConfigError(f"val_episodes={spec!r}: give a percentage (10%) or episode ids (3,7)") from None
    if not eps or min(eps) < 0:
        raise ConfigError(f"val_episodes={spec!r}: episode ids must be integers >= 0")
    return eps


def check_val_options(spec: str, count: int, fraction: float) -> None:
    """At most one way of naming the split, each well-formed (ConfigError otherwise)."""
    parse_val_spec(spec)
    given = [name for name, on in (("--val-episodes", bool((spec or "").strip())), ("--val-count", count != 0),
                                   ("--val-fraction", fraction != 0)) if on]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)}: give one way of holding out validation episodes")
    if count < 0:
        raise ConfigError(f"val_count={count}: must be >= 0 (0 = no split)")
    if not 0 <= fraction < 1:
        raise ConfigError(f"val_fraction={fraction}: must be in [0, 1), e.g. 0.1 (0 = no split)")


def _pick(n: int, have: list[int]) -> tuple[int, ...]:
    pick = np.random.default_rng(SPLIT_SEED).choice(len(have), size=n, replace=False)
    return tuple(sorted(have[i] for i in pick))


def choose_val_episodes(spec: str, episodes: list[int], *, count: int = 0, fraction: float = 0.0) -> tuple[int, ...]:
    """The validation episodes among `episodes` (the ones discovered): ids (`spec` "3,7"), a number of them
    (`count`), or a fraction (`fraction`, or `spec` "10%"). UsageError when ids are missing or nothing would
    be left to train on."""
    check_val_options(spec, count, fraction)
    parsed = parse_val_spec(spec)
    have = sorted(set(episodes))
    listed = ", ".join(map(str, have[:8])) + (", ..." if len(have) > 8 else "")
    if isinstance(parsed, tuple):
        missing = sorted(set(parsed) - set(have))
        if missing:
            raise UsageError(f"--val-episodes {spec}: episode{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(str, missing))} not in the dataset (it has {len(have)}: {listed}); "
                             "pick ids from those, or hold out a number of episodes with --val-count N or a "
                             "fraction with --val-fraction F")
        return parsed
    if count:
        if count >= len(have):
            raise UsageError(f"--val-count {count}: the dataset has {len(have)} episode(s); hold out fewer, so at "
                             "least one is left to train on")
        return _pick(count, have)
    share = parsed if parsed is not None else fraction
    if not share:
        return ()
    if len(have) < 2:
        raise UsageError(f"{'--val-episodes ' + spec if parsed is not None else f'--val-fraction {fraction}'}: "
                         f"{len(have)} episode(s) cannot be split; add episodes or drop the split")
    return _pick(min(len(have) - 1, max(1, round(share * len(have)))), have)
