"""Prometheus metrics of one node, in node_exporter's textfile format.

Why a textfile and not an HTTP endpoint: the processes that know the numbers (training
jobs, prolog/epilog, the stager) come and go; node_exporter is already running on every
node, and its textfile collector serves whatever ``*.prom`` files a directory holds. Every
such process calls :func:`refresh_textfile` after it changed something, and the file is
rebuilt whole from durable state, so it never depends on which process wrote it last.

Sources
-------
* the **ledger** (state): flush queue depth, flushes in flight, steps and bytes at risk,
  failure counters by reason, and the durations the ledger records per checkpoint
  (``snapshot_s``/``stall_s``, ``local_s``, ``flush_s``);
* the **event summary** (:mod:`slurm_ckpt.ledger.events`): counters of events by type, the
  total of flushed bytes, the last hook runs, and the exact save stall when the job layer
  emitted it. For a "last value" present in both, the newer one wins.

The exposition is produced by ``prometheus_client`` (a custom collector in a private
``CollectorRegistry``, written with ``write_to_textfile``: temp file + rename, so
node_exporter never reads a half-written file).

Metrics (all gauges unless noted; every series has a ``node`` label)
--------------------------------------------------------------------
``slurm_ckpt_save_stall_seconds{user,key}``       last save: training blocked
``slurm_ckpt_local_write_seconds{user,key}``      last local-tier write (background)
``slurm_ckpt_flush_seconds{user,key}``            last flush to the warm tier (the PFS, or
                                                  the object store on a site without one;
                                                  "the PFS" below means that tier too)
``slurm_ckpt_warm_tier_info{tier}``               1 for that tier: ``pfs`` or ``object``
``slurm_ckpt_flush_bytes{user,key}``              size of that flush
``slurm_ckpt_flushed_bytes_total``                counter: bytes flushed (from events)
``slurm_ckpt_flush_queue_bytes``                  bytes committed locally, owed to the warm tier
``slurm_ckpt_flush_queue_checkpoints``            checkpoints owed to the warm tier
``slurm_ckpt_flushes_in_flight``                  copies running now
``slurm_ckpt_steps_at_risk{user,key}``            newest local step minus newest step
                                                  verified on the warm tier (whole newest step
                                                  when the node knows of no warm copy)
``slurm_ckpt_bytes_at_risk{user,key}``            bytes of that series owed to the warm tier
``slurm_ckpt_warm_verified_step{user,key}``       newest step of the series verified on the
                                                  warm tier (from this node)
``slurm_ckpt_warm_verified_timestamp_seconds{user,key}``  when that step's warm copy was
                                                  verified: ``time() - it`` is the age of the
                                                  newest checkpoint a restart could use
``slurm_ckpt_save_interval_seconds{user,key}``    time between the series' two newest local
                                                  commits (what "too old" is measured against)
``slurm_ckpt_warm_tier_size_bytes``, ``..._avail_bytes``  the warm tier's filesystem (a PFS
                                                  root; absent for an object store)
``slurm_ckpt_drain_checkpoints``                  checkpoints owed to the warm tier that keep
                                                  this node drained (not held for their
                                                  owner's doing): above 0, the epilog drained
                                                  the node and the stager has not finished
``slurm_ckpt_failures_total{reason}``             counter: ledger failure counters
``slurm_ckpt_events_total{type}``                 counter: events by type
``slurm_ckpt_suspect_steps_total``                counter: steps whose replicas did not agree,
                                                  once each (not per rank), from this node's
                                                  event log: root's hooks record each step
                                                  flagged in a manifest on the local tier
``slurm_ckpt_hook_seconds{hook}``                 duration of the last run of each hook
``slurm_ckpt_hook_success{hook}``                 1 if that run succeeded, else 0
``slurm_ckpt_hook_last_run_timestamp_seconds{hook}``  when it ran (epoch seconds)
``slurm_ckpt_admission_queue_depth``              flushes queued for a warm-tier slot,
                                                  cluster-wide, at this node's last ask
``slurm_ckpt_admission_slots_in_use``             slots held then (the "PFS queue
                                                  watermark" beside it)
``slurm_ckpt_admission_wait_seconds``             this node's last wait for a slot
``slurm_ckpt_admission_wait_seconds_sum_total``   counter: all those waits summed
``slurm_ckpt_admission_requests_total{outcome}``  counter: admitted / not_admitted
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.config_schema import PFS
from slurm_ckpt.ledger.events import events_path, read_summary
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.record import LIVE_LOCAL, WARM_SLOT, State, is_held
from slurm_ckpt.ledger.suspect_steps import count_of

__all__ = [
    "METRICS",
    "TEXTFILE_NAME",
    "NodeMetrics",
    "build_registry",
    "collect",
    "refresh_textfile",
    "textfile_path",
]

TEXTFILE_NAME = "slurm_ckpt.prom"
#: The ledger's failure counters every node exports, at 0 until one happens.
FAILURE_REASONS = ("local_write_failed", "flush_failed")
_P = "slurm_ckpt_"

#: name -> (type, help, extra labels besides ``node``). The dashboard and tests use it.
METRICS: Dict[str, Tuple[str, str, Tuple[str, ...]]] = {
    _P + "save_stall_seconds": (
        "gauge",
        "Seconds the training loop was blocked by the last save.",
        ("user", "key"),
    ),
    _P + "local_write_seconds": (
        "gauge",
        "Seconds the last write to the local tier took (in the background).",
        ("user", "key"),
    ),
    _P + "flush_seconds": (
        "gauge",
        "Seconds the last flush to the warm tier (PFS or object store) took.",
        ("user", "key"),
    ),
    _P + "flush_bytes": ("gauge", "Bytes of the last flush to the warm tier.", ("user", "key")),
    _P + "flushed_bytes": ("counter", "Bytes flushed to the warm tier (from the event log).", ()),
    _P + "flush_queue_bytes": ("gauge", "Bytes committed locally and owed to the warm tier.", ()),
    _P + "flush_queue_checkpoints": ("gauge", "Checkpoints owed to the warm tier.", ()),
    _P + "warm_tier_info": (
        "gauge",
        "1 for the tier flushes go to: pfs, or object (an object store, no PFS).",
        ("tier",),
    ),
    _P + "flushes_in_flight": ("gauge", "Copies to another tier running now.", ()),
    _P + "steps_at_risk": (
        "gauge",
        "Newest local step minus the newest step verified on the warm tier.",
        ("user", "key"),
    ),
    _P + "bytes_at_risk": ("gauge", "Bytes of the series owed to the warm tier.", ("user", "key")),
    _P + "warm_verified_step": (
        "gauge",
        "Newest step of the series verified on the warm tier.",
        ("user", "key"),
    ),
    _P + "warm_verified_timestamp_seconds": (
        "gauge",
        "When the newest warm-verified step of the series was verified (epoch seconds).",
        ("user", "key"),
    ),
    _P + "save_interval_seconds": (
        "gauge",
        "Seconds between the series' two newest local commits.",
        ("user", "key"),
    ),
    _P + "warm_tier_size_bytes": ("gauge", "Size of the warm tier's filesystem.", ()),
    _P + "warm_tier_avail_bytes": (
        "gauge",
        "Bytes of the warm tier's filesystem available to users.",
        (),
    ),
    _P + "drain_checkpoints": (
        "gauge",
        "Checkpoints owed to the warm tier that keep this node drained (not held).",
        (),
    ),
    _P + "failures": ("counter", "Failures by reason (ledger counters).", ("reason",)),
    _P + "events": ("counter", "Events by type (event log).", ("type",)),
    _P + "suspect_steps": (
        "counter",
        "Saved steps whose data-parallel replicas did not agree, once per step (event log).",
        (),
    ),
    _P + "hook_seconds": ("gauge", "Duration of the last run of a hook.", ("hook",)),
    _P + "hook_success": ("gauge", "1 if the last run of a hook succeeded, else 0.", ("hook",)),
    _P + "hook_last_run_timestamp_seconds": (
        "gauge",
        "When a hook last ran (epoch seconds).",
        ("hook",),
    ),
    _P + "admission_queue_depth": (
        "gauge",
        "Flushes queued for a warm-tier slot, cluster-wide, at this node's last request.",
        (),
    ),
    _P + "admission_slots_in_use": (
        "gauge",
        "Warm-tier slots held, cluster-wide, at this node's last request.",
        (),
    ),
    _P + "admission_wait_seconds": (
        "gauge",
        "Seconds this node's last flush waited for a warm-tier slot (jitter included).",
        (),
    ),
    _P + "admission_wait_seconds_sum": (
        "counter",
        "Seconds waited for warm-tier slots, summed (divide by the requests for the mean).",
        (),
    ),
    _P + "admission_requests": (
        "counter",
        "Requests for a warm-tier slot by outcome (admitted, not_admitted within the budget).",
        ("outcome",),
    ),
}

Series = Tuple[str, str]


@dataclass
class _Last:
    """Newest observation of one value: ``(timestamp, value)`` per series."""

    values: Dict[Series, Tuple[float, float]] = field(default_factory=dict)

    def offer(self, series: Series, ts: Optional[float], value: Any) -> None:
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        t = float(ts or 0.0)
        old = self.values.get(series)
        if old is None or t >= old[0]:
            self.values[series] = (t, float(value))


@dataclass
class NodeMetrics:
    """Every number exported for one node (plain data; see :func:`collect`)."""

    node: str
    stall: _Last = field(default_factory=_Last)
    local: _Last = field(default_factory=_Last)
    flush: _Last = field(default_factory=_Last)
    flush_bytes: _Last = field(default_factory=_Last)
    queue_bytes: int = 0
    queue_checkpoints: int = 0
    in_flight: int = 0
    steps_at_risk: Dict[Series, int] = field(default_factory=dict)
    bytes_at_risk: Dict[Series, int] = field(default_factory=dict)
    #: Newest warm-verified step per series, and when it was verified.
    warm_verified: Dict[Series, Tuple[int, float]] = field(default_factory=dict)
    #: The two newest local commit times per series (newest first).
    commits: Dict[Series, List[float]] = field(default_factory=dict)
    drain_checkpoints: int = 0
    #: ``(size, avail)`` of the warm tier's filesystem, when it is one.
    warm_fs: Optional[Tuple[int, int]] = None
    failures: Dict[str, int] = field(default_factory=dict)
    events: Dict[str, int] = field(default_factory=dict)
    flushed_bytes: int = 0
    #: Suspect steps, each counted once (:mod:`slurm_ckpt.ledger.suspect_steps`).
    suspect_steps: int = 0
    hooks: Dict[str, Dict[str, float]] = field(default_factory=dict)
    #: Last admission decision: queue_depth, holders, wait_s (absent until one was made).
    admission: Dict[str, float] = field(default_factory=dict)
    admission_wait_sum: float = 0.0
    admission_requests: Dict[str, int] = field(default_factory=dict)
    #: The warm tier (``cfg.tiers.warm``): the ledger's :data:`WARM_SLOT` stands for it.
    warm: str = PFS


def _series_of(label: str) -> Optional[Series]:
    user, sep, key = label.partition("/")
    return (user, key) if sep and user and key else None


def collect(ledger: Ledger, events_file: Optional[Path] = None) -> NodeMetrics:
    """Gather the node's numbers from the ledger and (when given) the event summary."""
    m = NodeMetrics(node=ledger.node)
    newest_local: Dict[Series, int] = {}
    newest_warm: Dict[Series, int] = {}
    for rec in ledger.records():
        series = (rec.user, rec.key)
        tiers = {t: str(getattr(s, "value", s)) for t, s in rec.tiers.items()}
        d = rec.durations
        local_at = rec.committed_at.get("local", rec.created_at)
        m.stall.offer(series, local_at, d.get("stall_s", d.get("snapshot_s")))
        m.local.offer(series, local_at, d.get("local_s"))
        if "flush_s" in d:
            flushed_at = rec.verified_at.get(WARM_SLOT, rec.updated_at)
            m.flush.offer(series, flushed_at, d["flush_s"])
            m.flush_bytes.offer(series, flushed_at, rec.nbytes)
        if tiers.get("local") in LIVE_LOCAL:
            newest_local[series] = max(rec.step, newest_local.get(series, -1))
        if "local" in rec.committed_at:
            times = m.commits.setdefault(series, [])
            times.append(float(rec.committed_at["local"]))
            times.sort(reverse=True)
            del times[2:]
        if tiers.get(WARM_SLOT) == State.VERIFIED.value:
            newest_warm[series] = max(rec.step, newest_warm.get(series, -1))
            at = rec.verified_at.get(WARM_SLOT, rec.updated_at)
            if rec.step >= m.warm_verified.get(series, (-1, 0.0))[0]:
                m.warm_verified[series] = (rec.step, float(at))
        if rec.pending_flush:
            if not is_held(rec.extra):
                m.drain_checkpoints += 1
            m.queue_checkpoints += 1
            m.queue_bytes += int(rec.nbytes)
            m.bytes_at_risk[series] = m.bytes_at_risk.get(series, 0) + int(rec.nbytes)
        m.in_flight += sum(1 for s in tiers.values() if s == State.FLUSHING.value)
    for series, step in newest_local.items():
        # With no PFS copy known to this node, everything up to the newest step is at risk.
        m.steps_at_risk[series] = max(0, step - max(newest_warm.get(series, 0), 0))
        m.bytes_at_risk.setdefault(series, 0)
    # Counters start at 0 (Prometheus' rule): a failure panel shows "none", not "no data".
    m.failures = dict.fromkeys(FAILURE_REASONS, 0)
    m.failures.update({str(k): int(v) for k, v in ledger.failures().items()})
    if events_file is not None:
        _merge_summary(m, read_summary(events_file))
    return m


def _merge_summary(m: NodeMetrics, doc: Dict[str, Any]) -> None:
    m.events = {
        str(k): int(v)
        for k, v in doc.get("counts", {}).items()
        if isinstance(v, int) and not isinstance(v, bool)
    }
    m.suspect_steps = count_of(doc)
    flushed = doc.get("flushed_bytes", 0)
    m.flushed_bytes = flushed if isinstance(flushed, int) and not isinstance(flushed, bool) else 0
    last = doc.get("last", {})
    for etype, target, name in (
        ("save", m.stall, "stall_s"),
        ("local_write", m.local, "local_s"),
        ("flush", m.flush, "flush_s"),
        ("flush", m.flush_bytes, "nbytes"),
    ):
        for label, entry in (last.get(etype) or {}).items():
            series = _series_of(str(label))
            if series is not None and isinstance(entry, dict):
                target.offer(series, entry.get("ts"), entry.get(name))
    _merge_admission(m, doc)
    for hook, entry in (last.get("hook") or {}).items():
        if not isinstance(entry, dict):
            continue
        out: Dict[str, float] = {}
        if isinstance(entry.get("ts"), (int, float)):
            out["ts"] = float(entry["ts"])
        seconds = entry.get("seconds")
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
            out["seconds"] = float(seconds)
        if "ok" in entry:
            out["ok"] = 1.0 if entry["ok"] else 0.0
        m.hooks[str(hook)] = out


def _merge_admission(m: NodeMetrics, doc: Dict[str, Any]) -> None:
    """Counters and the newest decision of the ``admission``/``admission_refused`` events."""
    counts = doc.get("counts", {})
    for etype, outcome in (("admission", "admitted"), ("admission_refused", "not_admitted")):
        n = counts.get(etype, 0)
        if isinstance(n, int) and not isinstance(n, bool):
            m.admission_requests[outcome] = n
    total = doc.get("admission_wait_s", 0.0)
    if isinstance(total, (int, float)) and not isinstance(total, bool):
        m.admission_wait_sum = float(total)
    newest: Optional[Dict[str, Any]] = None
    for etype in ("admission", "admission_refused"):
        entry = ((doc.get("last") or {}).get(etype) or {}).get("pool")
        if isinstance(entry, dict) and (
            newest is None or float(entry.get("ts", 0)) >= float(newest.get("ts", 0))
        ):
            newest = entry
    for name in ("queue_depth", "holders", "wait_s"):
        value = None if newest is None else newest.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            m.admission[name] = float(value)


class _Collector:
    """A prometheus_client collector over one :class:`NodeMetrics` snapshot."""

    def __init__(self, m: NodeMetrics) -> None:
        self.m = m

    def describe(self) -> List[Any]:
        return []  # unchecked collector: the registry does not call collect() at register

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m, node = self.m, self.m.node

        def family(name: str) -> Any:
            kind, doc, labels = METRICS[name]
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            return cls(name, doc, labels=["node", *labels])

        for name, last in (
            (_P + "save_stall_seconds", m.stall),
            (_P + "local_write_seconds", m.local),
            (_P + "flush_seconds", m.flush),
            (_P + "flush_bytes", m.flush_bytes),
        ):
            f = family(name)
            for (user, key), (_, value) in sorted(last.values.items()):
                f.add_metric([node, user, key], value)
            yield f
        for name, value in (
            (_P + "flushed_bytes", m.flushed_bytes),
            (_P + "flush_queue_bytes", m.queue_bytes),
            (_P + "flush_queue_checkpoints", m.queue_checkpoints),
            (_P + "flushes_in_flight", m.in_flight),
        ):
            f = family(name)
            f.add_metric([node], value)
            yield f
        for name, per_series in (
            (_P + "steps_at_risk", m.steps_at_risk),
            (_P + "bytes_at_risk", m.bytes_at_risk),
            (_P + "warm_verified_step", {s: v[0] for s, v in m.warm_verified.items()}),
            (
                _P + "warm_verified_timestamp_seconds",
                {s: v[1] for s, v in m.warm_verified.items()},
            ),
            (
                _P + "save_interval_seconds",
                {s: v[0] - v[1] for s, v in m.commits.items() if len(v) == 2},
            ),
        ):
            f = family(name)
            for (user, key), value in sorted(per_series.items()):
                f.add_metric([node, user, key], value)
            yield f
        f = family(_P + "drain_checkpoints")
        f.add_metric([node], m.drain_checkpoints)
        yield f
        for name, index in ((_P + "warm_tier_size_bytes", 0), (_P + "warm_tier_avail_bytes", 1)):
            f = family(name)
            if m.warm_fs is not None:
                f.add_metric([node], m.warm_fs[index])
            yield f
        for name, counts in ((_P + "failures", m.failures), (_P + "events", m.events)):
            f = family(name)
            for label, value in sorted(counts.items()):
                f.add_metric([node, label], value)
            yield f
        # replicas that did not agree (slurm_ckpt.core.replicas): a step may hold
        # silently corrupted state; an alert on any increase is the point
        f = family(_P + "suspect_steps")
        f.add_metric([node], m.suspect_steps)
        yield f
        for name, field_name in (
            (_P + "hook_seconds", "seconds"),
            (_P + "hook_success", "ok"),
            (_P + "hook_last_run_timestamp_seconds", "ts"),
        ):
            f = family(name)
            for hook, values in sorted(m.hooks.items()):
                if field_name in values:
                    f.add_metric([node, hook], values[field_name])
            yield f
        yield from _admission_families(m, family)
        f = family(_P + "warm_tier_info")
        f.add_metric([node, m.warm], 1)
        yield f


def _admission_families(m: NodeMetrics, family: Any) -> Iterator[Any]:
    node = m.node
    for name, field_name in (
        (_P + "admission_queue_depth", "queue_depth"),
        (_P + "admission_slots_in_use", "holders"),
        (_P + "admission_wait_seconds", "wait_s"),
    ):
        f = family(name)
        # 0 until this node asked for a slot: no queue seen, no wait.
        f.add_metric([node], m.admission.get(field_name, 0.0))
        yield f
    f = family(_P + "admission_wait_seconds_sum")
    f.add_metric([node], m.admission_wait_sum)
    yield f
    f = family(_P + "admission_requests")
    for outcome in ("admitted", "not_admitted"):
        f.add_metric([node, outcome], m.admission_requests.get(outcome, 0))
    yield f


def build_registry(m: NodeMetrics) -> Any:
    """A fresh ``CollectorRegistry`` holding exactly these metrics."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(m))  # type: ignore[arg-type]
    return registry


def textfile_path(cfg: Config) -> Optional[Path]:
    """``<metrics.textfile_dir>/slurm_ckpt.prom``, or None when not configured."""
    if cfg.metrics.textfile_dir is None:
        return None
    return Path(cfg.metrics.textfile_dir) / TEXTFILE_NAME


def _warm_filesystem(cfg: Config) -> Optional[Tuple[int, int]]:
    """``(size, avail)`` of the PFS root's filesystem (the admin's path, not a user's),
    or None for an object store or a root that cannot be asked."""
    if cfg.tiers.warm != PFS or cfg.tiers.pfs is None:
        return None
    try:
        st = os.statvfs(cfg.tiers.pfs.root)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def refresh_textfile(
    ledger: Ledger, cfg: Config, *, events_file: Optional[Path] = None
) -> Optional[Path]:
    """Rebuild the node's textfile from the ledger and the event summary.

    Returns the file written, or None when ``metrics.textfile_dir`` is not configured.
    ``events_file`` defaults to :func:`~slurm_ckpt.ledger.events.events_path` of the
    ledger's node. Raises OSError when the directory cannot be written (and
    :class:`~slurm_ckpt.ledger.LedgerError` when the ledger cannot be read); callers on a
    checkpoint path should catch both: metrics must never stop a save.
    """
    target = textfile_path(cfg)
    if target is None:
        return None
    from prometheus_client import write_to_textfile

    m = collect(ledger, events_file or events_path(cfg, ledger.node))
    m.warm = cfg.tiers.warm  # what the ledger's WARM_SLOT stands for
    m.warm_fs = _warm_filesystem(cfg)
    os.makedirs(target.parent, mode=0o755, exist_ok=True)
    write_to_textfile(str(target), build_registry(m))
    return target
