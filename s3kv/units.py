"""Parsing of human-written sizes ("8GiB") and durations ("90s", "7d")."""

from __future__ import annotations

import re

from s3kv.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, *, name: str = "size") -> int:
    """Bytes from an int or a string such as "8GiB", "512 MiB", "1.5GB" or "4096".

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB,
    MB, GB, TB) powers of 1000. ``name`` goes into the error message.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size such as 8GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: a size cannot be negative, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a size such as 8GiB, got {value!r}")
    m = _SIZE_RE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"{name}: cannot read {value!r} as a size; use bytes or a number with "
            "one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '8GiB')"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_duration(value: object, *, name: str = "duration") -> float:
    """Seconds from a number or a string such as "250ms", "90s", "15m", "2h", "7d"."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a duration such as 30s, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{name}: a duration cannot be negative, got {value}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a duration such as 30s, got {value!r}")
    m = _DURATION_RE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or (unit and unit not in _DURATION_UNITS):
        raise ConfigError(
            f"{name}: cannot read {value!r} as a duration; use seconds or a number "
            "with one of ms, s, m, h, d, w (e.g. '7d')"
        )
    return float(m.group(1)) * _DURATION_UNITS[unit or "s"]


def format_size(n: float) -> str:
    """ "1.5 MiB" for 1572864: for logs and tables."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
