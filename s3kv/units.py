"""Parsing of human-written sizes ("8GiB") and durations ("90s", "7d")."""

from __future__ import annotations

import math
import re
from decimal import Decimal

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
    "pb": 10**15,
    "pib": 2**50,
}
MAX_SIZE = 2**63 - 1
"""No store, file system or S3 object is bigger than an int64 byte count."""
_MAX_TEXT = 64
"""Longer strings are not sizes or durations anyone writes."""
# ASCII only: Python's \d and float() also take other scripts' digits ("５GiB").
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)

_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)


def value_text(value: object) -> str:
    """``repr(value)`` for a message, cut short; a number too long to read
    (or even to print: Python refuses ints of over 4300 digits) is named by
    its size."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"a {'negative ' if value < 0 else ''}{value.bit_length()}-bit number"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _ascii_hint(text: str) -> str:
    return "" if text.isascii() else ", in ASCII digits and letters"


def parse_size(value: object, *, name: str = "size") -> int:
    """Bytes from an int or a string such as "8GiB", "512 MiB", "1.5GB" or "4096".

    Binary units (KiB, MiB, GiB, TiB, PiB) are powers of 1024, decimal units
    (KB, MB, GB, TB, PB) powers of 1000; a fraction of a byte is dropped.
    NaN, infinities, negative numbers and more than :data:`MAX_SIZE` bytes are
    refused. ``name`` goes into the error message.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size such as 8GiB, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{name}: a size must be a finite number of bytes, got {value!r}")
        if not value.is_integer():
            raise ConfigError(
                f"{name}: expected a whole number of bytes or a size such as 8GiB, got {value!r}"
            )
        value = int(value)
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value) if len(value) <= _MAX_TEXT else None
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{name}: cannot read {value_text(value)} as a size; use bytes or a number with "
                f"one of B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB (e.g. '8GiB'){_ascii_hint(value)}"
            )
        n = int(Decimal(m.group(1)) * _SIZE_UNITS[unit])  # exact: "1.5GB" is 1500000000
    else:
        raise ConfigError(f"{name}: expected a size such as 8GiB, got {value!r}")
    if n < 0:
        raise ConfigError(f"{name}: a size cannot be negative, got {value_text(value)}")
    if n > MAX_SIZE:
        raise ConfigError(
            f"{name}: {value_text(value)} is more bytes than any store holds (at most 2**63 - 1)"
        )
    return n


def parse_duration(value: object, *, name: str = "duration") -> float:
    """Seconds from a number or a string such as "250ms", "90s", "15m", "2h", "7d".

    NaN, infinities and negative numbers are refused.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a duration such as 30s, got {value!r}")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float
            raise ConfigError(
                f"{name}: a duration must be a finite number of seconds, got {value_text(value)}"
            ) from None
    elif isinstance(value, str):
        m = _DURATION_RE.match(value) if len(value) <= _MAX_TEXT else None
        unit = m.group(2).lower() if m else None
        if m is None or (unit and unit not in _DURATION_UNITS):
            raise ConfigError(
                f"{name}: cannot read {value_text(value)} as a duration; use seconds or a number "
                f"with one of ms, s, m, h, d, w (e.g. '7d'){_ascii_hint(value)}"
            )
        seconds = float(m.group(1)) * _DURATION_UNITS[unit or "s"]
    else:
        raise ConfigError(f"{name}: expected a duration such as 30s, got {value!r}")
    if not math.isfinite(seconds):
        raise ConfigError(f"{name}: a duration must be a finite number of seconds, got {value!r}")
    if seconds < 0:
        raise ConfigError(f"{name}: a duration cannot be negative, got {value!r}")
    return seconds


def format_size(n: float) -> str:
    """ "1.5 MiB" for 1572864: for logs and tables."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
