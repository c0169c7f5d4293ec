"""One unit grammar (issue 11, item 4): what the tools print parses back; SLURM's time
formats are durations; bare numbers are refused; overflow is an error, not ``inf``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_ckpt.core.units import (
    MAX_BYTES,
    duration_resolution,
    format_bytes,
    format_duration,
    format_rate,
    parse_bandwidth,
    parse_duration,
    parse_size,
    parse_slurm_time,
    size_resolution,
)
from slurm_ckpt.errors import CkptError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        # every form format_duration prints
        ("0s", 0.0),
        ("250ms", 0.25),
        ("2.5s", 2.5),
        ("59.9s", 59.9),
        ("4m05s", 245.0),
        ("1h30m", 5400.0),
        ("1d00h", 86400.0),
        ("3d04h", 3 * 86400.0 + 4 * 3600.0),
        # what people write
        ("90s", 90.0),
        ("500ms", 0.5),
        ("30min", 1800.0),
        ("5 minutes", 300.0),
        ("6h", 21600.0),
        ("1.5h", 5400.0),
        ("2d 6h", 2 * 86400.0 + 6 * 3600.0),
        ("1w", 7 * 86400.0),
        ("0", 0.0),
        # SLURM's time formats
        ("10:00", 600.0),
        ("90:00", 5400.0),
        ("6:00:00", 21600.0),
        ("1-00:00:00", 86400.0),
        ("1-06", 86400.0 + 6 * 3600.0),
        ("1-06:30", 86400.0 + 6 * 3600.0 + 1800.0),
        ("2-12:30:15", 2 * 86400.0 + 12 * 3600.0 + 1815.0),
        # typed numbers are seconds
        (90, 90.0),
        (2.5, 2.5),
    ],
)
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("6", "'6' has no unit: write 6s, 6min or 6h (SLURM's 6:00 is 6 minutes)"),
        ("2.5", "has no unit: write 2.5s"),
        ("1e400", "too large"),
        ("1e400s", "too large"),
        ("-5s", "negative"),
        ("5m5m", "largest first"),
        ("30m1h", "largest first"),
        ("5 fortnights", "unknown unit"),
        ("1-24", "below 24"),
        ("1:60", "below 60"),
        ("6:61:00", "below 60"),
        ("soon", "expected a duration"),
        (True, "expected a value"),
        (float("nan"), "not a number"),
        (math.inf, "too large"),
    ],
)
def test_parse_duration_refuses(text: object, fragment: str) -> None:
    with pytest.raises(CkptError, match=None) as info:
        parse_duration(text, "--wait")
    assert str(info.value).startswith("--wait: ") and fragment in str(info.value)


def test_slurm_minutes() -> None:
    # SLURM's bare number is minutes: only where SLURM's meaning applies.
    assert parse_slurm_time("30") == 1800.0
    assert parse_duration("30", minutes=True) == 1800.0
    with pytest.raises(CkptError, match="no unit"):
        parse_duration("30")


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("0", 0),
        ("512B", 512),
        ("8.0MiB", 8 * 2**20),
        ("64MiB", 64 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("10 GB", 10**10),
        ("1kB", 1000),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("2TiB", 2 * 2**40),
        ("100 bytes", 100),
        (4096, 4096),
    ],
)
def test_parse_size(text: object, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("350", "'350' has no unit: write 350B, 350MB or 350MiB"),
        ("64M", "'M' is ambiguous"),
        ("4G", "write 4GiB or 4GB"),
        ("1e400GB", "too large (at most 8EiB)"),
        ("1e400", "too large"),
        (1e400, "too large"),
        (10**400, "too large"),
        ("16EiB", "too large"),
        ("-1MB", "negative"),
        ("5 parsecs", "unknown unit"),
    ],
)
def test_parse_size_refuses(text: object, fragment: str) -> None:
    with pytest.raises(CkptError) as info:
        parse_size(text, "min_free")
    assert str(info.value).startswith("min_free: ") and fragment in str(info.value)
    assert len(str(info.value)) < 200  # a 400-digit integer is cut in the message


@pytest.mark.parametrize(
    ("text", "bps"),
    [("500MB/s", 5e8), ("500MBps", 5e8), ("3GB/s", 3e9), ("1GiB/s", 2**30), ("1GiB", 2**30)],
)
def test_parse_bandwidth(text: str, bps: float) -> None:
    assert parse_bandwidth(text) == bps


@pytest.mark.parametrize("text", ["500", "0", "1e400GB/s", "fast", "-1MB/s"])
def test_parse_bandwidth_refuses(text: str) -> None:
    with pytest.raises(CkptError):
        parse_bandwidth(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "0ms"),
        (0.25, "250ms"),
        (0.9996, "1.0s"),
        (2.46, "2.5s"),
        (59.96, "1m00s"),  # rounded up across the unit, never "60.0s"
        (245.6, "4m06s"),  # rounded, not truncated (4m05s)
        (3599.6, "1h00m"),
        (5399.0, "1h30m"),
        (86399, "1d00h"),
        (None, "-"),
        (math.inf, "-"),
    ],
)
def test_format_duration_rounds(seconds: object, text: str) -> None:
    assert format_duration(seconds) == text  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0B"), (1023, "1023B"), (1023.6, "1.0KiB"), (1536, "1.5KiB"), (2**63, "8.0EiB")],
)
def test_format_bytes(nbytes: float, text: str) -> None:
    assert format_bytes(nbytes) == text


@settings(max_examples=400, deadline=None)
@given(st.floats(min_value=0, max_value=10 * 365 * 86400, allow_nan=False))
def test_every_printed_duration_parses_back(seconds: float) -> None:
    text = format_duration(seconds)
    assert " " not in text
    assert abs(parse_duration(text) - seconds) <= duration_resolution(text) + 1e-9 * seconds


@settings(max_examples=400, deadline=None)
@given(st.integers(min_value=0, max_value=MAX_BYTES))
def test_every_printed_size_parses_back(nbytes: int) -> None:
    text = format_bytes(nbytes)
    assert " " not in text
    assert abs(parse_size(text) - nbytes) <= size_resolution(text) * (1 + 1e-9) + 1


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1.0, max_value=1e15, allow_nan=False))
def test_every_printed_rate_parses_back(bps: float) -> None:
    text = format_rate(bps)
    assert text.endswith("/s") and " " not in text
    assert abs(parse_bandwidth(text) - bps) <= size_resolution(text) * (1 + 1e-9) + 1


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 400), st.integers(0, 23), st.integers(0, 59), st.integers(0, 59))
def test_slurm_time_forms(d: int, h: int, m: int, s: int) -> None:
    total = ((d * 24 + h) * 60 + m) * 60 + s
    assert parse_duration(f"{d}-{h:02d}:{m:02d}:{s:02d}") == total
    assert parse_duration(f"{d * 24 + h}:{m:02d}:{s:02d}") == total
    assert parse_duration(f"{d}-{h}") == (d * 24 + h) * 3600
