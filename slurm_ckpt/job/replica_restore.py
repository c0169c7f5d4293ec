"""A restore step read once by a replica group, as one rank's Restorer sees it.

:class:`~slurm_ckpt.job.restore.Restorer` calls :func:`shared_restore` first when it was
given ``replicas``: which copy this rank would read, the group's one digest exchange,
and the shared read (:mod:`slurm_ckpt.job.replica_read`); a copy that fails is booked
as the Restorer books any. Apart from the Restorer to keep that module one concept
(which step, from which tier) and under its size.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Protocol, Set, Tuple

from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.errors import CkptError, VerifyError
from slurm_ckpt.job.replica_read import agree_to_share, digest_of, shared_read
from slurm_ckpt.job.restored import (
    DataVersionMismatch,
    NotThisFormat,
    Restored,
    payload_format,
)
from slurm_ckpt.job.state import STATE_FORMAT
from slurm_ckpt.job.state_reader import StateReader
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["SharingRestorer", "shared_restore"]


class SharingRestorer(Protocol):
    """What :func:`shared_restore` uses of the :class:`~slurm_ckpt.job.restore.Restorer`
    that calls it (a protocol: that module imports this one, so importing it back would
    make a circle; the Restorer satisfies it, and a type checker says so)."""

    replicas: Any
    node_tiers: Set[str]
    user: str
    own_key: str
    prefix: str
    streams: int

    def is_bad(self, tier: str, step: int) -> bool: ...

    def check_data(self, m: Manifest, where: str) -> None: ...

    def note_bad(self, tier: Tier, step: int, exc: BaseException) -> None: ...

    def restored(
        self,
        tier: Tier,
        m: Manifest,
        state: Any,
        t0: float,
        partial: bool,
        read: Optional[int] = None,
        peer: int = 0,
    ) -> Restored: ...


def shared_restore(
    r: SharingRestorer, steps: List[int], own: Dict[int, List[Tuple[Tier, Manifest]]]
) -> Optional[Restored]:
    """The newest step read once by the replica group (:mod:`.replica_read`), or None
    (then each rank reads alone). ``r`` is the calling
    :class:`~slurm_ckpt.job.restore.Restorer`. Collective over the group: every rank takes
    part in the one digest exchange whatever it finds; only when all of them are
    about to read the same bytes do they share the read."""
    assert r.replicas is not None
    pick: Optional[Tuple[Tier, Manifest]] = None
    for step in steps:
        pick = next(((t, m) for t, m in own.get(step, []) if not r.is_bad(t.name, step)), None)
        if pick is not None:
            break
    reader: Optional[StateReader] = None
    digest: Optional[bytes] = None
    if pick is not None and pick[0].name in r.node_tiers:
        pick = None  # on this node: faster read here than received from the group
    if pick is not None:
        tier, m = pick
        where = tier.where(r.user, r.own_key, m.step)
        try:
            if payload_format(m, r.prefix) != STATE_FORMAT:
                raise NotThisFormat(f"{where}: not a slurm_ckpt state")
            r.check_data(m, where)
            with tier.reader(r.user, r.own_key, m.step) as tr:
                reader = StateReader(tr, tr.manifest, r.prefix, streams=r.streams, where=where)
            digest = digest_of(reader.jobs(reader.blobs(None)), m.chunk_size, m.step)
        except DataVersionMismatch:
            raise
        except (CkptError, OSError) as exc:  # each rank alone, below, sorts it out
            log.info("[ckpt] restore: not shared (%s)", exc)
    try:
        if not agree_to_share(r.replicas, digest) or reader is None or pick is None:
            return None
        tier, m = pick
        t0 = time.monotonic()
        try:
            got = shared_read(
                r.replicas,
                reader.jobs(reader.blobs(None)),
                m.chunk_size,
                streams=r.streams,
                where=reader.where,
            )
        except VerifyError as exc:
            r.note_bad(tier, m.step, exc)
            return None
        state = reader.build(got.bufs)
        idx = len(reader.data)
        return r.restored(tier, m, state, t0, False, got.read_bytes + idx, got.peer_bytes)
    finally:
        if reader is not None:
            reader.close()
