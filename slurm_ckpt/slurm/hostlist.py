"""SLURM host lists: ``n[1-3,5]`` <-> ``["n1", "n2", "n3", "n5"]``.

Pure Python, so that hooks and the job wrapper do not need to run ``scontrol show
hostnames`` (one more process and one more controller round trip) just to learn which
nodes a job has. The grammar is SLURM's: comma-separated items at the top level, each item
a name with any number of bracketed range lists (``rack[1-2]-n[01-03]`` is the cartesian
product); ranges keep their zero padding (``[01-10]`` gives ``01 .. 10``).

Expansion is capped (:data:`MAX_HOSTS`) because the input comes from environments and
command output: a typo such as ``n[1-99999999]`` must give an error, not eat the memory of a
root-run hook.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Tuple

from slurm_ckpt.errors import InvalidName

__all__ = ["MAX_HOSTS", "compress", "expand"]

#: Largest number of host names one list may expand to.
MAX_HOSTS = 1_000_000

_RANGE_RE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
_NAME_CHARS = re.compile(r"^[A-Za-z0-9_.\-]*$")
_SPLIT_NUM = re.compile(r"^(.*?)([0-9]+)$")


def _split_top(text: str) -> List[str]:
    """Split on commas that are not inside brackets."""
    items: List[str] = []
    depth = 0
    cur: List[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise InvalidName(f"host list {text!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise InvalidName(f"host list {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise InvalidName(f"host list {text!r}: unbalanced '['")
    items.append("".join(cur))
    return items


def _expand_ranges(spec: str, whole: str) -> List[str]:
    out: List[str] = []
    for part in spec.split(","):
        m = _RANGE_RE.match(part.strip())
        if not m:
            raise InvalidName(f"host list {whole!r}: bad range {part!r}")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise InvalidName(f"host list {whole!r}: range {part!r} runs backwards")
        if hi - lo + 1 + len(out) > MAX_HOSTS:
            raise InvalidName(f"host list {whole!r}: more than {MAX_HOSTS} hosts")
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        out.extend(f"{i:0{width}d}" for i in range(lo, hi + 1))
    return out


def _expand_item(item: str, whole: str) -> List[str]:
    # Split "pre[a]mid[b]post" into literal and range parts.
    pieces = re.split(r"(\[[^\]]*\])", item)
    names = [""]
    for piece in pieces:
        if piece.startswith("["):
            choices = _expand_ranges(piece[1:-1], whole)
        else:
            if not _NAME_CHARS.match(piece):
                raise InvalidName(f"host list {whole!r}: bad character in {piece!r}")
            choices = [piece]
        if len(names) * len(choices) > MAX_HOSTS:
            raise InvalidName(f"host list {whole!r}: more than {MAX_HOSTS} hosts")
        names = [n + c for n in names for c in choices]
    return names


def expand(hostlist: str) -> List[str]:
    """``"n[1-3,5],gpu07"`` -> ``["n1", "n2", "n3", "n5", "gpu07"]`` (order kept, no
    duplicates). Raises :class:`~slurm_ckpt.errors.InvalidName` on malformed input."""
    if not isinstance(hostlist, str):
        raise InvalidName(f"host list must be a string, got {type(hostlist).__name__}")
    text = hostlist.strip()
    if not text or text == "(null)":
        return []
    seen: Dict[str, None] = {}
    for item in _split_top(text):
        item = item.strip()
        if not item:
            continue
        for name in _expand_item(item, text):
            if not name:
                raise InvalidName(f"host list {text!r}: empty host name")
            seen.setdefault(name, None)
            if len(seen) > MAX_HOSTS:
                raise InvalidName(f"host list {text!r}: more than {MAX_HOSTS} hosts")
    return list(seen)


def _ranges(nums: List[Tuple[int, str]]) -> str:
    """Sorted (value, text) with one padding width -> ``"1-3,5"``."""
    parts: List[str] = []
    start = prev = nums[0]
    for cur in nums[1:]:
        if cur[0] == prev[0] + 1:
            prev = cur
            continue
        parts.append(start[1] if start == prev else f"{start[1]}-{prev[1]}")
        start = prev = cur
    parts.append(start[1] if start == prev else f"{start[1]}-{prev[1]}")
    return ",".join(parts)


def compress(hosts: Iterable[str]) -> str:
    """``["n1", "n2", "n3", "n5"]`` -> ``"n[1-3,5]"``; the inverse of :func:`expand`.

    Names are grouped by the prefix before their trailing number; groups appear in order
    of first appearance, numbers ascending within a group. Zero padding is kept exactly:
    ``n08, n09, n10`` gives ``n[08-10]`` (a width of 2 also prints ``10`` as ``10``), while
    ``n1`` and ``n01`` (different hosts) stay in separate groups. Names without a trailing
    number are kept as they are.
    """
    by_prefix: Dict[str, List[str]] = {}
    for host in hosts:
        if not isinstance(host, str) or not host or not _NAME_CHARS.match(host):
            raise InvalidName(f"invalid host name {host!r}")
        m = _SPLIT_NUM.match(host)
        prefix, digits = (m.group(1), m.group(2)) if m else (host, "")
        by_prefix.setdefault(prefix, [])
        if digits and digits not in by_prefix[prefix]:
            by_prefix[prefix].append(digits)
        elif not digits and "" not in by_prefix[prefix]:
            by_prefix[prefix].append("")
    out: List[str] = []
    for prefix, numbers in by_prefix.items():
        if "" in numbers:
            out.append(prefix)
            numbers = [n for n in numbers if n]
        groups: Dict[int, List[Tuple[int, str]]] = {}
        padded = {len(n) for n in numbers if n.startswith("0") and len(n) > 1}
        for n in numbers:
            width = len(n) if n.startswith("0") and len(n) > 1 else 0
            if width == 0 and len(padded) == 1:
                (only,) = padded
                if len(n) >= only:
                    width = only  # printing n with this width gives n itself
            groups.setdefault(width, []).append((int(n), n))
        for width in sorted(groups):
            nums = sorted(set(groups[width]))
            if len(nums) == 1:
                out.append(prefix + nums[0][1])
            else:
                out.append(f"{prefix}[{_ranges(nums)}]")
    return ",".join(out)
