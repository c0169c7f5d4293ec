"""Checkpoint accounting: how big, how long to write, how often to save.

Pure arithmetic: no SLURM, no torch, no click. The method is the one the two-tier design
(local NVMe first, asynchronous copy to the parallel file system) is sized with:

1. **Size.** A resumable checkpoint holds the weights in the training precision (bf16/fp16:
   2 bytes per parameter, fp32: 4), the fp32 master weights when training in mixed
   precision (4), the optimizer state (Adam/AdamW: two fp32 moments = 8; SGD with
   momentum: 4; none: 0) and "the rest" (RNG states, data-loader position, LR scheduler:
   a small constant, :data:`EXTRA_STATE_BYTES`). 70e9 parameters in bf16 with AdamW are
   140 GB of weights + 280 GB of master weights + 560 GB of moments = 980 GB.
   With ``sharded`` (ZeRO-3 / FSDP) layout every node writes ``1/nodes`` of it; with
   ``replicated`` (plain DDP) layout one data-parallel replica writes all of it.
2. **Write time per tier** = bytes / bandwidth. The local bandwidth is *per node* (each
   node writes its part to its own NVMe in parallel); the PFS bandwidth is the aggregate
   the job gets from the parallel file system for the whole checkpoint.
3. **Interval.** ``C`` is what blocks training per checkpoint: the local write, or the
   snapshot stall when saving asynchronously; ``M`` is the mean time between interrupts.
   Young (1974): ``T = sqrt(2 C M)``. Daly (2006), higher order: for ``C < 2M``
   ``T = sqrt(2 C M) * [1 + (1/3) sqrt(C/(2M)) + (1/9) (C/(2M))] - C``, else ``T = M``.
   ``T`` is compute time between the end of one save and the start of the next. The chosen
   interval is Daly's, capped by the progress you can afford to lose (``max_loss``): the
   seeds' rule "interval = the minutes you can afford to lose".
4. **Consequences.** Overhead ``C / T`` (blocked time relative to compute; the share of
   wall time is ``C / (T + C)``: a 10 min synchronous save every 30 min costs 25 % of the
   wall clock). The PFS copy keeps up when ``pfs_write_s <= interval``; if it does not,
   only every ``flush_every = ceil(pfs_write_s / interval)``-th local checkpoint is copied.

Loss model (stated once, used everywhere): interrupts arrive at random (Poisson, mean
``M``), so a failure falls uniformly inside a checkpoint period and throws away on average
half of it. Restoring costs ``R`` (requeue + read + re-init). Then

* ``expected_loss_s = T/2 + R_local`` -- the node's local copy survives (job killed,
  software crash, preemption) and the newest local checkpoint is restored;
* ``expected_loss_pfs_s = N*T/2 + L + R_pfs`` -- the node is lost with its NVMe and the
  newest *complete* PFS copy is restored; PFS copies are ``N = flush_every`` periods
  apart and each becomes usable ``L = pfs_write_s`` after its checkpoint (``L = 0`` when
  there is no local tier and the PFS write is synchronous).

``R`` is ``restart_cost_s`` when given, else the read time of the tier restored from, at
the same bandwidth as the write: a lower bound (the seeds quote 15-30 min from the PFS
for a 70B model once distributed state rebuild is included).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from slurm_ckpt.core.units import format_duration as _d
from slurm_ckpt.core.units import parse_bandwidth, parse_duration, parse_size
from slurm_ckpt.errors import EXIT_USAGE, CkptError

__all__ = [
    "EXTRA_STATE_BYTES",
    "MASTER_WEIGHT_BYTES",
    "OPTIMIZER_BYTES",
    "PRECISION_BYTES",
    "Plan",
    "PlanInputError",
    "SizeBreakdown",
    "auto_interval",
    "checkpoint_size",
    "daly_interval",
    "expected_loss",
    "flush_every",
    "make_plan",
    "overhead_fraction",
    "parse_count",
    "per_node_bytes",
    "write_time",
    "young_interval",
]

#: Bytes per parameter of the weights as trained.
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: Bytes per parameter of the fp32 master copy kept in mixed precision.
MASTER_WEIGHT_BYTES = 4
#: Bytes per parameter of optimizer state.
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "none": 0}
#: "The rest": RNG states, data-loader position, LR scheduler, step counters.
EXTRA_STATE_BYTES = 64 * 2**20

_EPS = 1e-9


class PlanInputError(CkptError):
    """A planner input is missing, malformed or out of range (exit code 2)."""

    exit_code = EXIT_USAGE


# --------------------------------------------------------------------------- inputs


_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(value: object, what: str = "count") -> float:
    """Return a positive number from ``70e9``, ``"70B"``, ``"1.5M"``, ``"7.5k"``.

    ``B``/``G`` mean billion (10**9), ``T`` trillion: the way model sizes are written.
    """
    if isinstance(value, bool):
        raise PlanInputError(f"{what}: expected a number such as 70e9 or 70B, got {value!r}")
    if isinstance(value, (int, float)):
        x = float(value)
    else:
        m = _COUNT_RE.match(str(value))
        if not m:
            raise PlanInputError(f"{what}: expected a number such as 70e9 or 70B, got {value!r}")
        x = float(m.group(1)) * _COUNT_UNITS[m.group(2).lower()]
    if not math.isfinite(x) or x <= 0:
        raise PlanInputError(f"{what}: must be a positive number, got {value!r}")
    return x


def _positive(x: float, what: str) -> float:
    x = float(x)
    if not math.isfinite(x) or x <= 0:
        raise PlanInputError(f"{what}: must be positive, got {x!r}")
    return x


def _non_negative(x: float, what: str) -> float:
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise PlanInputError(f"{what}: must not be negative, got {x!r}")
    return x


def as_size(value: object, what: str) -> int:
    try:
        n = parse_size(value, what)
    except PlanInputError:
        raise
    except CkptError as e:
        raise PlanInputError(str(e)) from None
    if n <= 0:
        raise PlanInputError(f"{what}: must be positive, got {value!r}")
    return n


def as_bandwidth(value: object, what: str) -> float:
    try:
        return parse_bandwidth(value, what)
    except PlanInputError:
        raise
    except CkptError as e:
        raise PlanInputError(str(e)) from None


def as_duration(value: object, what: str, *, positive: bool = True) -> float:
    try:
        s = parse_duration(value, what)
    except PlanInputError:
        raise
    except CkptError as e:
        raise PlanInputError(str(e)) from None
    if not math.isfinite(s):
        raise PlanInputError(f"{what}: must be finite, got {value!r}")
    if positive and s <= 0:
        raise PlanInputError(f"{what}: must be positive, got {value!r}")
    return s


# --------------------------------------------------------------------------- size


@dataclass(frozen=True)
class SizeBreakdown:
    """Bytes of one full checkpoint, by component."""

    weights: int
    master_weights: int
    optimizer: int
    extra: int

    @property
    def total(self) -> int:
        return self.weights + self.master_weights + self.optimizer + self.extra

    def to_dict(self) -> dict[str, int]:
        d = asdict(self)
        d["total"] = self.total
        return d


def checkpoint_size(
    params: float,
    precision: str = "bf16",
    optimizer: str = "adamw",
    master_weights: Optional[bool] = None,
    extra_bytes: int = EXTRA_STATE_BYTES,
) -> SizeBreakdown:
    """Bytes of a resumable checkpoint of a model with ``params`` parameters.

    ``master_weights=None`` means "fp32 master copy when the precision is below fp32"
    (mixed precision); pass ``False`` for pure half-precision training.
    """
    n = parse_count(params, "--params")
    prec = str(precision).lower()
    if prec not in PRECISION_BYTES:
        raise PlanInputError(
            f"--precision: expected one of {'|'.join(PRECISION_BYTES)}, got {precision!r}"
        )
    opt = str(optimizer).lower()
    if opt not in OPTIMIZER_BYTES:
        raise PlanInputError(
            f"--optimizer: expected one of {'|'.join(OPTIMIZER_BYTES)}, got {optimizer!r}"
        )
    wbytes = PRECISION_BYTES[prec]
    if master_weights is None:
        master_weights = wbytes < MASTER_WEIGHT_BYTES
    extra = int(_non_negative(extra_bytes, "extra bytes"))
    return SizeBreakdown(
        weights=int(round(n * wbytes)),
        master_weights=int(round(n * MASTER_WEIGHT_BYTES)) if master_weights else 0,
        optimizer=int(round(n * OPTIMIZER_BYTES[opt])),
        extra=extra,
    )


def per_node_bytes(total_bytes: int, nodes: int = 1, sharded: bool = True) -> int:
    """Bytes the busiest node writes: ``ceil(total/nodes)`` sharded, ``total`` replicated.

    Sharded (ZeRO-3/FSDP): every node holds and writes its own ``1/nodes`` slice.
    Replicated (DDP): every replica holds everything, one replica writes it.
    """
    total = int(total_bytes)
    if total <= 0:
        raise PlanInputError(f"checkpoint size: must be positive, got {total_bytes!r}")
    if isinstance(nodes, bool) or int(nodes) != nodes or nodes < 1:
        raise PlanInputError(f"--nodes: must be a whole number >= 1, got {nodes!r}")
    nodes = int(nodes)
    return -(-total // nodes) if sharded else total


def write_time(nbytes: float, bandwidth: float) -> float:
    """Seconds to move ``nbytes`` at ``bandwidth`` bytes/s."""
    return _non_negative(nbytes, "bytes") / _positive(bandwidth, "bandwidth")


# --------------------------------------------------------------------------- interval


def young_interval(save_cost_s: float, mtbi_s: float) -> float:
    """Young (1974): ``sqrt(2 C M)`` seconds of compute between checkpoints."""
    c = _positive(save_cost_s, "save cost")
    m = _positive(mtbi_s, "mean time between interrupts")
    return math.sqrt(2.0 * c * m)


def daly_interval(save_cost_s: float, mtbi_s: float) -> float:
    """Daly (2006) higher-order optimum; ``M`` itself once ``C >= 2M``."""
    c = _positive(save_cost_s, "save cost")
    m = _positive(mtbi_s, "mean time between interrupts")
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def auto_interval(save_cost_s: float, mtbi_s: float, max_loss_s: Optional[float] = None) -> float:
    """Seconds between checkpoints for ``interval="auto"``: Daly, capped by ``max_loss_s``.

    ``save_cost_s`` is what one save blocks training for (measured by the job),
    ``mtbi_s`` the mean time between interrupts. Raises :class:`PlanInputError` for a
    non-positive or non-finite input.
    """
    t = daly_interval(save_cost_s, mtbi_s)
    if max_loss_s is not None:
        t = min(t, _positive(max_loss_s, "max loss"))
    return t


def overhead_fraction(save_cost_s: float, interval_s: float) -> float:
    """Blocked time relative to compute time: ``C / T``."""
    return _non_negative(save_cost_s, "save cost") / _positive(interval_s, "interval")


def expected_loss(interval_s: float, restart_s: float = 0.0) -> float:
    """Expected seconds lost per interrupt: ``T/2 + R`` (see the module docstring)."""
    return _non_negative(interval_s, "interval") / 2.0 + _non_negative(restart_s, "restart")


def flush_every(pfs_write_s: float, interval_s: float) -> int:
    """Copy every N-th local checkpoint to the PFS so each copy ends before the next.

    1 when the PFS write fits in one interval, else ``ceil(pfs_write_s / interval_s)``.
    """
    w = _non_negative(pfs_write_s, "PFS write time")
    t = _positive(interval_s, "interval")
    return max(1, math.ceil(w / t - _EPS))


# --------------------------------------------------------------------------- plan


@dataclass
class Plan:
    """Every figure of the accounting, for one configuration. Times in seconds."""

    checkpoint_bytes: int
    bytes_per_node: int
    nodes: int
    sharded: bool
    local_bw: Optional[float]
    pfs_bw: float
    local_write_s: Optional[float]
    pfs_write_s: float
    save_cost_s: float
    save_cost_basis: str
    mtbi_s: float
    max_loss_s: Optional[float]
    young_interval_s: float
    daly_interval_s: float
    interval_s: float
    interval_basis: str
    tokens_per_s: Optional[float]
    interval_tokens: Optional[int]
    restore_local_s: Optional[float]
    restore_pfs_s: float
    expected_loss_s: float
    expected_loss_pfs_s: float
    overhead_fraction: float
    wall_overhead_fraction: float
    pfs_keeps_up: bool
    flush_every: int
    pfs_interval_s: float
    size_breakdown: Optional[SizeBreakdown] = None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; absent figures are ``None`` (``null``)."""
        d = asdict(self)
        d["size_breakdown"] = self.size_breakdown.to_dict() if self.size_breakdown else None
        d["warnings"] = list(self.warnings)
        return d


def make_plan(
    *,
    pfs_bw: object,
    mtbi: object,
    params: object = None,
    size: object = None,
    precision: str = "bf16",
    optimizer: str = "adamw",
    master_weights: Optional[bool] = None,
    local_bw: object = None,
    nodes: int = 1,
    sharded: bool = True,
    max_loss: object = None,
    tokens_per_s: object = None,
    restart_cost: object = None,
    stall: object = None,
) -> Plan:
    """Work out a :class:`Plan`.

    Give exactly one of ``params`` (parameter count: ``70e9`` or ``"70B"``) or ``size``
    (checkpoint bytes: ``"350GB"``). Sizes, bandwidths and durations accept numbers
    (bytes, bytes/s, seconds) or strings (``"3GB/s"``, ``"6h"``). ``local_bw=None``
    means no local tier: every save goes synchronously to the PFS. ``stall`` is the
    training stall per save when saving asynchronously (snapshot to host memory); by
    default the local write (or the PFS write without a local tier) blocks.
    Error messages name the matching ``ckpt-slurm plan`` option.
    """
    if (params is None) == (size is None):
        raise PlanInputError("give either the parameter count (--params) or the size (--size)")
    breakdown: Optional[SizeBreakdown] = None
    if params is not None:
        breakdown = checkpoint_size(params, precision, optimizer, master_weights)
        total = breakdown.total
    else:
        total = as_size(size, "--size")
    node_bytes = per_node_bytes(total, nodes, sharded)
    nodes = int(nodes)

    pfs = as_bandwidth(pfs_bw, "--pfs-bw")
    local = None if local_bw is None else as_bandwidth(local_bw, "--local-bw")
    m = as_duration(mtbi, "--mtbi")
    loss_cap = None if max_loss is None else as_duration(max_loss, "--max-loss")
    tps = None if tokens_per_s is None else parse_count(tokens_per_s, "--tokens-per-s")
    restart = (
        None
        if restart_cost is None
        else as_duration(restart_cost, "--restart-cost", positive=False)
    )

    pfs_write = write_time(total, pfs)
    local_write = None if local is None else write_time(node_bytes, local)
    restore_pfs = pfs_write if restart is None else restart
    restore_local = None
    if local_write is not None:
        restore_local = local_write if restart is None else restart

    warnings: list[str] = []
    if stall is not None:
        cost = as_duration(stall, "--stall")
        basis = "stall"
    elif local_write is not None:
        cost, basis = local_write, "local_write"
    else:
        cost, basis = pfs_write, "pfs_write"

    young = young_interval(cost, m)
    daly = daly_interval(cost, m)
    interval, ibasis = daly, "daly"
    if loss_cap is not None and loss_cap < daly:
        interval, ibasis = loss_cap, "max_loss"

    if basis == "pfs_write":
        keeps_up, n_flush, lag = True, 1, 0.0  # synchronous: done when training resumes
    else:
        keeps_up = pfs_write <= interval
        n_flush = flush_every(pfs_write, interval)
        lag = pfs_write
    loss_local = expected_loss(interval, restore_pfs if restore_local is None else restore_local)
    loss_pfs = n_flush * interval / 2.0 + lag + restore_pfs

    if interval < cost:
        warnings.append(
            f"the interval ({_d(interval)}) is shorter than one save ({_d(cost)}): "
            "more time saving than training; raise --max-loss or make saves cheaper"
        )
    if basis == "stall" and local_write is not None and local_write > interval:
        warnings.append(
            f"the background local write ({_d(local_write)}) is longer than the interval "
            f"({_d(interval)}): saves would queue up"
        )
    if not keeps_up:
        warnings.append(
            f"the PFS copy ({_d(pfs_write)}) is longer than the interval ({_d(interval)}): "
            f"copy one local checkpoint in every {n_flush} to the PFS (flush_every={n_flush})"
        )

    return Plan(
        checkpoint_bytes=int(total),
        bytes_per_node=int(node_bytes),
        nodes=nodes,
        sharded=bool(sharded),
        local_bw=local,
        pfs_bw=pfs,
        local_write_s=local_write,
        pfs_write_s=pfs_write,
        save_cost_s=cost,
        save_cost_basis=basis,
        mtbi_s=m,
        max_loss_s=loss_cap,
        young_interval_s=young,
        daly_interval_s=daly,
        interval_s=interval,
        interval_basis=ibasis,
        tokens_per_s=tps,
        interval_tokens=None if tps is None else int(round(interval * tps)),
        restore_local_s=restore_local,
        restore_pfs_s=restore_pfs,
        expected_loss_s=loss_local,
        expected_loss_pfs_s=loss_pfs,
        overhead_fraction=overhead_fraction(cost, interval),
        wall_overhead_fraction=cost / (interval + cost),
        pfs_keeps_up=keeps_up,
        flush_every=n_flush,
        pfs_interval_s=n_flush * interval,
        size_breakdown=breakdown,
        warnings=warnings,
    )
