"""Train/validation split by episode.

Preprocess chooses the validation episodes (`--val-episodes 10%` or `--val-episodes 3,7`) and
records them in the index (`split.val_episodes`); the trainer reads training samples only and
evaluation reads whole validation episodes. Splitting by episode, not by sample, matters:
neighbouring samples of one episode share frames and action rows, so a per-sample split would
score the model on what it trained on.

A percentage picks a deterministic pseudo-random set (seeded, sorted), so re-running preprocess
gives the same split.
"""

from __future__ import annotations

import numpy as np

from loongforge.shared.errors import ConfigError

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


def choose_val_episodes(spec: str, episodes: list[int]) -> tuple[int, ...]:
    """The validation episodes among `episodes` (the ones preprocess wrote)."""
    parsed = parse_val_spec(spec)
    if parsed is None:
        return ()
    have = sorted(set(episodes))
    if isinstance(parsed, tuple):
        missing = sorted(set(parsed) - set(have))
        if missing:
            raise ConfigError(f"val_episodes: episodes {missing} are not in the dataset (it has {len(have)}: "
                              f"{have[:5]}...); pick from those")
        return parsed
    if len(have) < 2:
        raise ConfigError(f"val_episodes={spec!r}: {len(have)} episode(s) cannot be split; add episodes or drop "
                          "--val-episodes")
    n = min(len(have) - 1, max(1, round(parsed * len(have))))
    pick = np.random.default_rng(SPLIT_SEED).choice(len(have), size=n, replace=False)
    return tuple(sorted(have[i] for i in pick))
