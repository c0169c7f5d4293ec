"""Limits on a manifest's bytes, checked before any parser sees them.

Root reads every user's manifests, and a manifest's checksum proves only that its writer
meant those bytes. A parser that is handed 100,000 nested brackets recurses until
``RecursionError`` (which once stopped root's ``ckpt-slurm status`` for everyone); one
handed 400,000 entries spends seconds of root's time. So the size, the nesting depth and
the number of file entries are bounded here, on the raw bytes, with C-speed scans only
(``bytes.count``, ``re.sub``, ``bytes.translate``): nothing here recurses or builds
objects, and a refusal is a :class:`~slurm_ckpt.errors.VerifyError`, the same damage any
other bad manifest is, isolated to its series by every caller.

The limits are a site setting (``[manifests]`` in the config). Building a
:class:`~slurm_ckpt.core.config.Config` makes its limits the process's
(:func:`set_limits`): root's commands and hooks load one config per process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slurm_ckpt.errors import VerifyError

__all__ = [
    "DEFAULT_LIMITS",
    "ManifestLimits",
    "check_bytes",
    "check_entries",
    "limits",
    "set_limits",
]


@dataclass(frozen=True)
class ManifestLimits:
    """The bounds one manifest must keep."""

    max_bytes: int = 16 * 2**20
    max_depth: int = 40
    max_entries: int = 100_000


DEFAULT_LIMITS = ManifestLimits()
_active = DEFAULT_LIMITS

_ESCAPE = re.compile(rb"\\.", re.S)
_STRING = re.compile(rb'"[^"]*"')
_EMPTY_PAIR = re.compile(rb"\{\}|\[\]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"{}[]")


def set_limits(new: ManifestLimits) -> None:
    """Make ``new`` the limits every manifest read in this process is held to."""
    global _active
    _active = new


def limits() -> ManifestLimits:
    return _active


def nesting_within(data: bytes, max_depth: int) -> bool:
    """Whether the JSON text ``data`` nests at most ``max_depth`` brackets deep.

    Escapes, then strings, are cut out, leaving the structural brackets; each pass then
    removes the innermost ``{}``/``[]`` pairs, so a document of depth *d* is empty after
    *d* passes. Brackets left after ``max_depth`` passes are too deep (or do not pair,
    which no valid JSON does either). A text with at most ``max_depth`` opening brackets
    cannot nest deeper, paired or not (the parser refuses one that does not pair), and is
    settled without the passes: every manifest of a few files is.
    """
    if data.count(b"{") + data.count(b"[") <= max_depth:
        # No deeper than its number of opening brackets (those inside strings only add
        # to the count): settled by two C-speed counts.
        return True
    skeleton = _STRING.sub(b"", _ESCAPE.sub(b"", data)).translate(None, _NOT_BRACKET)
    for _ in range(max_depth):
        if not skeleton:
            return True
        skeleton = _EMPTY_PAIR.sub(b"", skeleton)
    return not skeleton


def check_bytes(data: bytes, where: str = "manifest") -> None:
    """Refuse (VerifyError) a manifest whose bytes exceed the active limits."""
    lim = _active
    if len(data) > lim.max_bytes:
        raise VerifyError(
            f"{where}: manifest larger than {lim.max_bytes} bytes ({len(data)}; "
            "manifests.max_bytes)"
        )
    if data.count(b'"path"') > lim.max_entries:
        raise VerifyError(
            f"{where}: manifest has more than {lim.max_entries} entries (manifests.max_entries)"
        )
    if not nesting_within(data, lim.max_depth):
        raise VerifyError(
            f"{where}: manifest nested deeper than {lim.max_depth} levels (manifests.max_depth)"
        )


def check_entries(count: int, where: str = "manifest") -> None:
    """Refuse a parsed manifest with more file entries than the limit (the byte scan
    counts ``"path"`` keys; this counts what the parser actually built)."""
    if count > _active.max_entries:
        raise VerifyError(
            f"{where}: manifest has more than {_active.max_entries} entries (manifests.max_entries)"
        )
