"""Flushes a run owes from an earlier run of its series, on a machine without SLURM.

On a cluster, a flush that a job could not finish (it was killed, or its time ran out) is
left in the node ledger as ``FLUSH_PENDING``, and the epilog or the stager copies it to the
warm tier. A laptop or workstation has neither: a run killed before its flush would leave
that checkpoint on the local disk alone until someone ran ``ckpt-slurm flush`` by hand. So
a Checkpointer outside SLURM picks up its own series' owed flushes when it starts
(:func:`queue_owed`): every step its ledger says was selected for the warm tier and not
safely there (``FLUSH_PENDING``, ``FLUSHING`` from a killed copy, ``FAILED``), that is
still committed on the local tier, is queued on the pipeline's flusher - the same engine,
the same verification, in the background - before any new save. A step the warm tier
already holds is verified there, not copied again. Nothing else is touched: other
series, other users, steps never selected for a flush.

:func:`no_epilog` says when this applies (no SLURM job around this process), and
:func:`without_epilog` makes a laptop's messages say who finishes a flush instead of
"left to the epilog".
"""

from __future__ import annotations

import logging
import os
from typing import List, Mapping, Optional, Union

from slurm_ckpt.core.config import (
    Config,
    config_origin,
    load_config,
    own_config_path,
    resolve_config_path,
    user_config_path,
)
from slurm_ckpt.core.config_schema import ENV_CONFIG
from slurm_ckpt.errors import CkptError, ConfigError
from slurm_ckpt.job.bookkeeping import SaveRecord
from slurm_ckpt.job.pipeline import Pipeline
from slurm_ckpt.ledger.record import LIVE_LOCAL, WARM_SLOT, State

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

__all__ = [
    "LEFT_FOR_NEXT_RUN",
    "load_job_config",
    "no_epilog",
    "owed_steps",
    "queue_owed",
    "without_epilog",
]

#: The flush status (and ledger note) of a flush a laptop run could not finish.
LEFT_FOR_NEXT_RUN = "left for the next run"

#: Warm-tier states of a checkpoint whose flush was owed and is not known to be done.
OWED_STATES = (State.FLUSH_PENDING.value, State.FLUSHING.value, State.FAILED.value)


def load_job_config(path: Optional[PathLike] = None) -> Config:
    """The configuration of ``Checkpointer.from_env()``: the one ``ckpt-slurm`` reads
    (``path``; ``$SLURM_CKPT_CONFIG``; the site default; else, not as root, the user's
    own), so a laptop with ``~/.config/slurm-ckpt/config.toml`` needs nothing more. One
    log line says which was read; none found is one ConfigError naming every way out."""
    if path is None or os.fspath(path) == "":
        own = own_config_path()
        if own is not None:
            path = own
    where, origin = resolve_config_path(path)
    if origin == "default" and not os.path.lexists(where):
        raise ConfigError(
            f"no config: {where} not found and no {user_config_path()} (write one of "
            f"them, set {ENV_CONFIG}, pass config_path=, or give the tiers: "
            "Checkpointer(local=..., warm=..., key=...))"
        )
    cfg = load_config(path)
    log.info("[ckpt] configuration: %s", config_origin(path))
    return cfg


def no_epilog(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True outside a SLURM job: no epilog or stager will flush what this run leaves."""
    env = os.environ if environ is None else environ
    return not (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def owed_steps(pipe: Pipeline) -> List[int]:
    """The steps of this pipeline's series owed to the warm tier (see the module
    docstring), oldest first; none without a ledger or a warm tier."""
    if pipe.warm is None or pipe.books.ledger is None:
        return []
    sh = pipe.shard
    owed: List[int] = []
    for step, rec in sorted(pipe.books.records().items()):
        warm_state = rec.tiers.get(WARM_SLOT)
        if warm_state not in OWED_STATES or rec.tiers.get("local") not in LIVE_LOCAL:
            continue
        if not rec.selected_for_flush and not rec.forced:
            continue
        try:
            pipe.local.manifest(sh.user, sh.key, step)
        except (CkptError, OSError):
            continue  # no longer (validly) on the local tier: nothing to copy from
        # Queued even when the warm tier holds it committed already (the copy finished,
        # its ledger update did not): the flusher then verifies it there without copying
        # and records it, which lets local retention delete the local copy.
        owed.append(step)
    return owed


def queue_owed(pipe: Pipeline) -> List[int]:
    """Queue this series' owed flushes on ``pipe`` (started here), oldest first; return
    their steps. The flushes run on the pipeline's flush thread and ``close()`` waits
    for them like for any other."""
    try:
        steps = owed_steps(pipe)
    except (CkptError, OSError) as exc:
        log.warning("[ckpt] could not look for flushes an earlier run owes: %s", exc)
        return []
    if not steps:
        return []
    records = pipe.books.records()
    log.info(
        "[ckpt] an earlier run of %s left %d flush(es) unfinished (step(s) %s): "
        "flushing them to the warm tier in the background",
        pipe.shard.key,
        len(steps),
        ", ".join(map(str, steps)),
    )
    pipe.start()
    for step in steps:
        rec = SaveRecord(
            step=step,
            tokens=None,
            seq=-1,
            reason="owed by an earlier run",
            nbytes=records[step].nbytes if step in records else 0,
            forced=True,  # never displaced by a newer save's flush
            selected=True,
            local_status="committed",
        )
        pipe.queue_flush(rec)
    return steps


def without_epilog(pipe: Pipeline) -> None:
    """Word what this run cannot flush for a machine without an epilog (its status,
    ledger note and log lines say the next run takes it over)."""
    pipe.left_status = LEFT_FOR_NEXT_RUN
    pipe.left_to = "the next run of this series on this machine (or: ckpt-slurm flush)"
    if pipe.flusher is not None:
        pipe.flusher.hand_off_note = LEFT_FOR_NEXT_RUN
