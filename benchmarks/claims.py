"""The one shape every benchmark reports its claims in, so that ``benchmarks/report`` can
put them side by side in BENCHMARKS.md.

A claim is a ratio of our time (or throughput) to a baseline's, measured side by side
in the same run, round by round; the figure is the median of the per-round ratios and
the spread is their minimum and maximum. ``cmp`` says which way is good: ``"<="`` for a
time ratio that must stay under ``target``, ``">="`` for a throughput ratio that must
reach it; ``target=None`` marks a figure that is reported, not claimed.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["claim", "verdict"]


def claim(
    name: str,
    ratios: Sequence[float],
    *,
    what: str,
    baseline: str,
    target: Optional[float] = None,
    cmp: str = "<=",
    ours_s: Optional[Sequence[float]] = None,
    baseline_s: Optional[Sequence[float]] = None,
) -> Dict[str, Any]:
    """One claim: ``what`` we do, against ``baseline``, per-round ``ratios``."""
    rounds: List[float] = [float(r) for r in ratios]
    out: Dict[str, Any] = {
        "name": name,
        "what": what,
        "baseline": baseline,
        "target": target,
        "cmp": cmp,
        "rounds": rounds,
        "median": statistics.median(rounds) if rounds else None,
        "min": min(rounds) if rounds else None,
        "max": max(rounds) if rounds else None,
    }
    if ours_s:
        out["ours_median_s"] = statistics.median(ours_s)
    if baseline_s:
        out["baseline_median_s"] = statistics.median(baseline_s)
    out["verdict"] = verdict(out)
    return out


def verdict(c: Dict[str, Any]) -> str:
    """``PASS``/``FAIL`` against the target, ``reported`` without one."""
    if c.get("target") is None or c.get("median") is None:
        return "reported"
    ok = c["median"] <= c["target"] if c["cmp"] == "<=" else c["median"] >= c["target"]
    return "PASS" if ok else "FAIL"
