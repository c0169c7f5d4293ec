"""One grammar for sizes, rates and durations, in and out.

Admins write ``64MiB``, ``500MB/s`` and ``6h`` in config files and on command lines, and
paste back what the tools print (``1h30m``, ``8.0MiB``) or what SLURM prints
(``1-00:00:00``). One parser and one formatter keep all of that consistent:

**Sizes.** Output is IEC (powers of 1024, like ``df -h`` and ``ls -lh``): ``512B``,
``8.0MiB``, ``1.5GiB``. Input takes IEC (``KiB`` ... ``EiB``) *and* SI (``kB``/``KB``,
``MB`` ... ``EB``: powers of 1000, the way disk and network vendors write them), plus
``B``/``bytes``. A single letter (``64M``, ``4G``) is refused: SLURM's ``--mem`` and
``dd`` read it as MiB/GiB, vendors as MB/GB, and the difference is 7% at G.

**Rates** are a size per second: ``500MB/s``, ``3GB/s``, ``1GiB/s`` (also ``500MBps``;
a size without ``/s`` is read as per second). Output: ``476.8MiB/s``.

**Durations.** Output, rounded (never truncated) to what is shown: ``0s``, ``250ms``,
``2.5s``, ``4m05s``, ``1h30m``, ``1d00h``. Input takes every one of those forms, any
sequence of number+unit from largest to smallest (``1h30m``, ``2d 6h``, ``1.5h``,
``90s``, ``500ms``; units ``ms``, ``s``/``sec``/``second(s)``, ``m``/``min``/
``minute(s)``, ``h``/``hr``/``hour(s)``, ``d``/``day(s)``, ``w``/``week(s)``), and
SLURM's time formats ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.
SLURM's plain ``MM`` (a bare number of minutes) is accepted only where SLURM's own
meaning applies (``minutes=True``, for values read from SLURM).

**Bare numbers.** A number *string* without a unit (``"350"``, ``"6"``) is refused with
a message that shows the fix: on a command line ``--mtbi 6`` could mean 6 seconds,
minutes (SLURM) or hours. Only zero needs no unit. Typed numbers (a Python ``int`` or
``float``, or a TOML number in the config file) are the base unit - bytes, seconds,
bytes per second - as the config documents; that is where a bare number is still fine.

**Limits.** Every value must be finite and not negative; sizes stop at 8 EiB (2**63
bytes) and durations at 1000 years, so ``1e400``, ``"1e400GB"`` or a TOML ``1e400`` are
one-line errors rather than an ``inf`` or an ``OverflowError`` later.

Every string :func:`format_bytes`, :func:`format_rate` and :func:`format_duration` return
parses back (:func:`parse_size`, :func:`parse_bandwidth`, :func:`parse_duration`) to the
value within half of its last printed digit, and no output contains a space, so a table
cell is one field for ``awk``.
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Tuple

from slurm_ckpt.errors import CkptError

__all__ = [
    "MAX_BYTES",
    "MAX_SECONDS",
    "duration_resolution",
    "format_bytes",
    "format_duration",
    "format_rate",
    "parse_bandwidth",
    "parse_duration",
    "parse_size",
    "parse_slurm_time",
    "size_resolution",
]

#: Largest size accepted: 8 EiB (2**63 bytes, about what a 64-bit byte count holds; the
#: printed "8.0EiB" must parse back).
MAX_BYTES = 2**63
#: Longest duration accepted (1000 years): anything longer is a typo or an overflow.
MAX_SECONDS = 1000 * 365.25 * 86400.0

_IEC = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]

# Lower-cased unit -> bytes. Single letters are handled apart (refused as ambiguous).
_SIZE_UNITS: Dict[str, int] = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "eb": 10**18,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "eib": 2**60,
}
_AMBIGUOUS = {"k": "K", "m": "M", "g": "G", "t": "T", "p": "P", "e": "E"}

# Lower-cased unit -> (seconds, rank); compound durations go from high rank to low.
_TIME_UNITS: Dict[str, Tuple[float, int]] = {}
for _names, _secs, _rank in (
    (("w", "wk", "week", "weeks"), 604800.0, 6),
    (("d", "day", "days"), 86400.0, 5),
    (("h", "hr", "hrs", "hour", "hours"), 3600.0, 4),
    (("m", "min", "mins", "minute", "minutes"), 60.0, 3),
    (("s", "sec", "secs", "second", "seconds"), 1.0, 2),
    (("ms", "msec", "millisecond", "milliseconds"), 0.001, 1),
):
    for _n in _names:
        _TIME_UNITS[_n] = (_secs, _rank)

_NUM = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_QUANTITY_RE = re.compile(r"^\s*([+-]?" + _NUM + r")\s*([A-Za-z]*)\s*$")
_RATE_RE = re.compile(
    r"^\s*([+-]?" + _NUM + r")\s*([A-Za-z]*?)\s*(/\s*s(?:ec)?|ps)?\s*$", re.IGNORECASE
)
_PART_RE = re.compile(r"\s*(" + _NUM + r")\s*([A-Za-z]+)")
_SLURM_RE = re.compile(r"^\s*(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?\s*$")
_BARE_RE = re.compile(r"^\s*[+-]?" + _NUM + r"\s*$")


# --------------------------------------------------------------------------- helpers


def _typed_number(value: object, what: str, example: str) -> Optional[float]:
    """``value`` as a float if it is a typed number (int/float), None for a string;
    CkptError for anything else (bool, list, ...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise CkptError(f"{what}: expected a value such as {example}, got {value!r}")
    if isinstance(value, str):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float range
        return math.inf


def _show(value: object) -> str:
    """``repr(value)``, cut so that a 400-digit integer does not swamp the error line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:30] + "..." + text[-6:]


def _finite(x: float, what: str, value: object, limit: float, limit_text: str) -> float:
    """Refuse NaN, infinities, negatives and values beyond ``limit`` with one line."""
    if math.isnan(x):
        raise CkptError(f"{what}: not a number: {_show(value)}")
    if x < 0:
        raise CkptError(f"{what}: must not be negative, got {_show(value)}")
    if math.isinf(x) or x > limit:
        raise CkptError(f"{what}: {_show(value)} is too large (at most {limit_text})")
    return x


def _float(text: str) -> float:
    """float() that never raises for our number grammar (huge exponents become inf)."""
    try:
        return float(text)
    except OverflowError:  # pragma: no cover - float() returns inf instead
        return math.inf


def _no_unit(what: str, value: object, examples: List[str], note: str = "") -> CkptError:
    text = str(value).strip()
    fixes = ", ".join(f"{text}{u}" for u in examples[:-1]) + f" or {text}{examples[-1]}"
    return CkptError(f"{what}: {value!r} has no unit: write {fixes}{note}")


# --------------------------------------------------------------------------- sizes


def _size_multiplier(unit: str, what: str, value: object, number: str) -> int:
    low = unit.lower()
    if low in _AMBIGUOUS:
        letter = _AMBIGUOUS[low]
        raise CkptError(
            f"{what}: {value!r}: unit {unit!r} is ambiguous (SLURM and dd read it as "
            f"{letter}iB, disk vendors as {letter}B): write {number}{letter}iB or "
            f"{number}{letter}B"
        )
    if low not in _SIZE_UNITS:
        raise CkptError(
            f"{what}: unknown unit {unit!r} in {value!r}: use B, kB, MB, GB, TB, "
            "KiB, MiB, GiB or TiB"
        )
    return _SIZE_UNITS[low]


def parse_size(value: object, what: str = "size") -> int:
    """Bytes from ``"64MiB"``, ``"1.5GB"``, ``"512B"``, ``"0"`` or a typed number.

    A number string without a unit is refused (see the module docstring).
    """
    n = _typed_number(value, what, "64MiB")
    if n is not None:
        return int(round(_finite(n, what, value, MAX_BYTES, "8EiB")))
    text = str(value)
    m = _QUANTITY_RE.match(text)
    if not m:
        raise CkptError(f"{what}: expected a size such as 64MiB or 10GB, got {value!r}")
    number, unit = m.group(1), m.group(2)
    x = _float(number)
    if unit == "" and x != 0:
        _finite(x, what, value, MAX_BYTES, "8EiB")  # "too large" before "no unit"
        raise _no_unit(what, value, ["B", "MB", "MiB"])
    nbytes = x * _size_multiplier(unit, what, value, number)
    return int(round(_finite(nbytes, what, value, MAX_BYTES, "8EiB")))


def parse_bandwidth(value: object, what: str = "bandwidth") -> float:
    """Bytes per second from ``"500MB/s"``, ``"3GB/s"``, ``"1GiB/s"``, ``"1GiB"`` or a
    typed number; must be positive."""
    n = _typed_number(value, what, "500MB/s")
    if n is not None:
        bw = _finite(n, what, value, MAX_BYTES, "8EiB/s")
    else:
        m = _RATE_RE.match(str(value))
        if not m:
            raise CkptError(f"{what}: expected a rate such as 500MB/s, got {value!r}")
        number, unit = m.group(1), m.group(2)
        x = _float(number)
        if unit == "" and x != 0:
            _finite(x, what, value, MAX_BYTES, "8EiB/s")
            raise _no_unit(what, value, ["MB/s", "GB/s", "MiB/s"])
        mult = _size_multiplier(unit or "B", what, value, number)
        bw = _finite(x * mult, what, value, MAX_BYTES, "8EiB/s")
    if bw <= 0:
        raise CkptError(f"{what}: must be positive, got {value!r}")
    return bw


# --------------------------------------------------------------------------- durations


def parse_slurm_time(value: object, what: str = "time") -> float:
    """Seconds from SLURM's time formats: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``,
    ``D-HH:MM``, ``D-HH:MM:SS`` (a bare number is minutes, as in ``sbatch --time``)."""
    m = _SLURM_RE.match(str(value))
    if not m:
        raise CkptError(
            f"{what}: expected a SLURM time such as 30, 1:30:00 or 1-00:00:00, got {value!r}"
        )
    days, a, b, c = m.groups()
    nums = [int(p) for p in (a, b, c) if p is not None]
    if days is not None:
        nums += [0] * (3 - len(nums))  # D-HH, D-HH:MM
        h, mi, s = nums
        d = int(days)
        if h >= 24:
            raise CkptError(f"{what}: hours must be below 24 after 'D-', got {value!r}")
    elif len(nums) == 3:
        d, (h, mi, s) = 0, nums
    elif len(nums) == 2:
        d, h, (mi, s) = 0, 0, nums
    else:
        d, h, mi, s = 0, 0, nums[0], 0
    if s >= 60 or (mi >= 60 and (h or d or len(nums) == 3)):
        raise CkptError(f"{what}: minutes and seconds must be below 60, got {value!r}")
    total = float(((d * 24 + h) * 60 + mi) * 60 + s)
    return _finite(total, what, value, MAX_SECONDS, "1000 years")


def _compound(text: str, what: str, value: object) -> Optional[float]:
    """``1h30m``, ``2d 6h``, ``500ms``: the sum, or None if ``text`` is not that form."""
    pos, total, last_rank = 0, 0.0, 99
    for m in _PART_RE.finditer(text):
        if m.start() != pos:
            return None
        unit = m.group(2).lower()
        if unit not in _TIME_UNITS:
            raise CkptError(
                f"{what}: unknown unit {m.group(2)!r} in {value!r}: use ms, s, min, h, d or w"
            )
        secs, rank = _TIME_UNITS[unit]
        if rank >= last_rank:
            raise CkptError(
                f"{what}: {value!r}: write the units largest first, each once (as 1h30m)"
            )
        last_rank = rank
        total += _float(m.group(1)) * secs
        pos = m.end()
    if pos == 0 or text[pos:].strip():
        return None
    return total


def parse_duration(value: object, what: str = "duration", *, minutes: bool = False) -> float:
    """Seconds from every form :func:`format_duration` prints, the usual unit words,
    SLURM's ``[D-]HH:MM:SS`` family, ``"0"`` or a typed number (seconds).

    A bare number string is refused, unless ``minutes`` (SLURM's meaning: ``"30"`` is 30
    minutes), for values that come from SLURM.
    """
    n = _typed_number(value, what, "30min")
    if n is not None:
        return _finite(n, what, value, MAX_SECONDS, "1000 years")
    text = str(value).strip()
    if text.startswith("-"):
        raise CkptError(f"{what}: must not be negative, got {value!r}")
    if _BARE_RE.match(text):
        x = _float(text)
        _finite(x, what, value, MAX_SECONDS, "1000 years")  # say "too large", not "no unit"
        if minutes:
            return _finite(x * 60.0, what, value, MAX_SECONDS, "1000 years")
        if x != 0:
            note = f" (SLURM's {text}:00 is {text} minutes)" if text.isdigit() else ""
            raise _no_unit(what, value, ["s", "min", "h"], note)
        return 0.0
    if ":" in text or re.match(r"^[0-9]+-", text):
        return parse_slurm_time(text, what)
    total = _compound(text, what, value)
    if total is None:
        raise CkptError(
            f"{what}: expected a duration such as 90s, 30min, 1h30m or 1-00:00:00, got {value!r}"
        )
    return _finite(total, what, value, MAX_SECONDS, "1000 years")


# --------------------------------------------------------------------------- output


def format_bytes(n: Optional[float]) -> str:
    """``1536 -> '1.5KiB'``: IEC units, one decimal, rounded, no space; ``None -> '-'``."""
    if n is None:
        return "-"
    x = float(n)
    if not math.isfinite(x):
        return "-"
    sign = "-" if x < 0 else ""
    x = abs(x)
    if round(x) < 1024:
        return f"{sign}{int(round(x))}B"
    for i, unit in enumerate(_IEC[1:], 1):
        v = round(x / 1024.0**i, 1)
        if v < 1024 or unit == _IEC[-1]:
            return f"{sign}{v:.1f}{unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_rate(bps: Optional[float]) -> str:
    """``500e6 -> '476.8MiB/s'``; ``None -> '-'``."""
    return "-" if bps is None else format_bytes(bps) + "/s"


def format_duration(seconds: Optional[float]) -> str:
    """``5400 -> '1h30m'``: short, rounded to what is shown, no space; ``None -> '-'``.

    ``0s``, ``250ms`` (below 1 s), ``2.5s`` (below 1 min), ``4m05s`` (below 1 h),
    ``1h30m`` (below 1 day), ``3d04h``.
    """
    if seconds is None:
        return "-"
    s = float(seconds)
    if not math.isfinite(s):
        return "-"
    if s < 0:
        return "-" + format_duration(-s)
    if s == 0:
        return "0s"
    if round(s * 1000) < 1000:
        return f"{int(round(s * 1000))}ms"
    if round(s, 1) < 60:
        return f"{round(s, 1):.1f}s"
    if round(s) < 3600:
        m, sec = divmod(int(round(s)), 60)
        return f"{m}m{sec:02d}s"
    if round(s / 60.0) < 1440:
        h, mi = divmod(int(round(s / 60.0)), 60)
        return f"{h}h{mi:02d}m"
    d, h = divmod(int(round(s / 3600.0)), 24)
    return f"{d}d{h:02d}h"


def size_resolution(text: str) -> float:
    """Half the last printed digit of a :func:`format_bytes` string, in bytes (the bound
    within which it parses back)."""
    m = _QUANTITY_RE.match(text.lstrip("-").removesuffix("/s"))
    if not m or m.group(2) == "B":
        return 0.5
    return 0.05 * _SIZE_UNITS[m.group(2).lower()]


def duration_resolution(text: str) -> float:
    """Half the last printed unit of a :func:`format_duration` string, in seconds."""
    t = text.lstrip("-")
    if t == "0s":
        return 0.0
    if t.endswith("ms"):
        return 0.0005
    if re.fullmatch(_NUM + "s", t):
        return 0.05
    last = re.findall(r"[a-z]+", t)[-1]
    return _TIME_UNITS[last][0] / 2.0
