"""Parse and format sizes, bandwidths and durations as people write them.

Admins write ``64MiB``, ``500MB/s`` and ``6h`` in config files and on command lines; one
parser for all of them keeps the meaning of "MB" identical everywhere (SI: 10**6, while
"MiB" is 2**20).
"""

from __future__ import annotations

import re

from slurm_ckpt.errors import CkptError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}

_TIME_UNITS = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hrs": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE_RE = re.compile(r"^\s*" + _NUM + r"\s*([A-Za-z]*)\s*$")
_BW_RE = re.compile(r"^\s*" + _NUM + r"\s*([A-Za-z]*)\s*(?:/\s*s|ps)?\s*$")


def parse_size(value: object, what: str = "size") -> int:
    """Return a byte count from ``4096``, ``"64MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool):
        raise CkptError(f"{what}: expected a size such as 64MiB, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise CkptError(f"{what}: must not be negative, got {value!r}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise CkptError(f"{what}: expected a size such as 64MiB or 10GB, got {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_bandwidth(value: object, what: str = "bandwidth") -> float:
    """Return bytes per second from ``"500MB/s"``, ``"3GB/s"``, ``"1GiB"`` or a number."""
    if isinstance(value, bool):
        raise CkptError(f"{what}: expected a rate such as 500MB/s, got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise CkptError(f"{what}: must be positive, got {value!r}")
        return float(value)
    m = _BW_RE.match(str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise CkptError(f"{what}: expected a rate such as 500MB/s, got {value!r}")
    bw = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if bw <= 0:
        raise CkptError(f"{what}: must be positive, got {value!r}")
    return bw


def parse_duration(value: object, what: str = "duration") -> float:
    """Return seconds from ``"6h"``, ``"30min"``, ``"90s"``, ``"1d"`` or a number."""
    if isinstance(value, bool):
        raise CkptError(f"{what}: expected a duration such as 30min, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise CkptError(f"{what}: must not be negative, got {value!r}")
        return float(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise CkptError(f"{what}: expected a duration such as 30min or 6h, got {value!r}")
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``; binary units, the way df -h and ls -lh read."""
    step = 1024.0
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    x = float(n)
    for unit in units:
        if abs(x) < step or unit == units[-1]:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= step
    return f"{x:.1f} PiB"  # pragma: no cover - loop always returns


def format_duration(seconds: float) -> str:
    """``5400 -> '1h30m'``; short and unambiguous for tables."""
    s = float(seconds)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"
