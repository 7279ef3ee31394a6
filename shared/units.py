"""Human byte sizes, one convention for every service and flag:
SI units are powers of 1000 (kB, MB, GB, TB), IEC units powers of 1024
(KiB, MiB, GiB, TiB), as `df -H` and `df -h` print them. A bare number is bytes."""

from __future__ import annotations

import re

from loongforge.shared.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, field: str = "size") -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, 4096 or '4096' -> 4096."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field}: size must not be negative, got {value}")
        return value
    m = _SIZE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"{field}: cannot parse size {value!r}; use e.g. '512MiB', '2GiB', '64MB' or bytes")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"
