"""A series' life from this node's ledger and event log: ``ckpt-slurm report KEY``.

Why the ledger: it is the one record with the times that matter for "how safe was this
run, when": each save's local commit (``committed_at["local"]``), when its warm copy was
verified (``verified_at[WARM_SLOT]``), and the failures (the event log's ``failure``
events, with their reason). From those, *steps at risk* over time: at each moment, the
newest step committed locally minus the newest step verified on the warm tier - what a
node loss at that moment would have cost.

A series' ranks and DCP parts (``KEY.rank00001``, ``KEY.dcp.*``) are part of ``KEY``.
The picture (:func:`plot_png`) needs matplotlib (the ``plot`` extra); the numbers do not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import CkptError, NotFound, UsageError
from slurm_ckpt.job.bookkeeping import ledger_dir
from slurm_ckpt.ledger.events import default_node, read_events
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.record import WARM_SLOT

__all__ = ["SeriesLife", "plot_png", "series_life"]

Point = Tuple[float, int]


def _in_series(name: str, key: str) -> bool:
    return name == key or name.startswith(key + ".")


@dataclass
class SeriesLife:
    """What happened to one series, in time order (epoch seconds)."""

    user: str
    key: str
    #: (local commit time, step) per checkpoint, every rank and part.
    commits: List[Point] = field(default_factory=list)
    #: (warm verification time, step).
    flushes: List[Point] = field(default_factory=list)
    #: (time, reason) of every failed local write or flush.
    failures: List[Tuple[float, str]] = field(default_factory=list)
    #: (time, steps at risk) after every commit and every flush.
    at_risk: List[Point] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {
            "user": self.user,
            "key": self.key,
            "saves": len(self.commits),
            "flushes": len(self.flushes),
            "failures": len(self.failures),
            "max_steps_at_risk": max((r for _, r in self.at_risk), default=0),
            "steps_at_risk_now": self.at_risk[-1][1] if self.at_risk else 0,
            "commits": [{"t": t, "step": s} for t, s in self.commits],
            "warm_verified": [{"t": t, "step": s} for t, s in self.flushes],
            "failure_events": [{"t": t, "reason": r} for t, r in self.failures],
            "at_risk": [{"t": t, "steps": s} for t, s in self.at_risk],
        }


def series_life(cfg: Config, user: str, key: str, node: Optional[str] = None) -> SeriesLife:
    """The life of ``user/key`` as this node's ledger and event log tell it; NotFound when
    the ledger knows nothing of it."""
    directory = Path(ledger_dir(cfg, user))
    if not (directory / "ledger.json").exists():
        raise NotFound(f"no ledger at {directory}: nothing recorded on this node")
    ledger = Ledger(directory, node or default_node())
    life = SeriesLife(user, key)
    for rec in ledger.records(user=user):
        if not _in_series(rec.key, key):
            continue
        if "local" in rec.committed_at:
            life.commits.append((rec.committed_at["local"], rec.step))
        if WARM_SLOT in rec.verified_at:
            life.flushes.append((rec.verified_at[WARM_SLOT], rec.step))
    if not life.commits:
        raise NotFound(f"{user}/{key}: no checkpoint of this series in the ledger at {directory}")
    events = directory / "events.jsonl"
    if cfg.metrics.events_dir is not None:
        events = Path(cfg.metrics.events_dir) / f"events-{ledger.node}.jsonl"
    if events.exists():
        for ev in read_events(events):
            mine = ev.get("user") == user and _in_series(str(ev.get("key", "")), key)
            if ev.get("type") == "failure" and mine:
                life.failures.append((float(ev.get("ts", 0.0)), str(ev.get("reason", "?"))))
    life.commits.sort()
    life.flushes.sort()
    life.failures.sort()
    life.at_risk = _at_risk(life.commits, life.flushes)
    return life


def _at_risk(commits: List[Point], flushes: List[Point]) -> List[Point]:
    marks = sorted([(t, 0, s) for t, s in commits] + [(t, 1, s) for t, s in flushes])
    newest_local = newest_warm = -1
    out: List[Point] = []
    for t, kind, step in marks:
        if kind == 0:
            newest_local = max(newest_local, step)
        else:
            newest_warm = max(newest_warm, step)
        out.append((t, max(0, newest_local - max(newest_warm, 0))))
    return out


def plot_png(life: SeriesLife, path: str) -> int:
    """Draw the series' life into a PNG at ``path``; returns its size in bytes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "report --png needs matplotlib: install slurm_ckpt with its plot extra "
            "(pip install '/path/to/slurm_ckpt[plot]')"
        ) from None
    t0 = life.commits[0][0]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    top.plot(
        [(t - t0) for t, _ in life.commits],
        [s for _, s in life.commits],
        "o",
        ms=4,
        label="committed locally",
    )
    if life.flushes:
        top.plot(
            [(t - t0) for t, _ in life.flushes],
            [s for _, s in life.flushes],
            "^",
            ms=5,
            label="verified on the warm tier",
        )
    for t, _reason in life.failures:
        top.axvline(t - t0, color="red", alpha=0.6, lw=1)
    if life.failures:
        top.plot([], [], color="red", label=f"failures ({len(life.failures)})")
    from matplotlib.ticker import MaxNLocator

    for ax in (top, bottom):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("step")
    top.set_title(f"{life.user}/{life.key}: saves, flushes, failures")
    top.legend(loc="upper left", fontsize=8)
    xs = [t - t0 for t, _ in life.at_risk]
    bottom.step(xs, [r for _, r in life.at_risk], where="post", color="darkorange")
    bottom.set_ylabel("steps at risk")
    bottom.set_xlabel("seconds since the first save")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise CkptError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return os.path.getsize(path)
