"""Which checkpoints one child copies, and in which order owners take their turns.

Forking a root process that holds a large ledger costs tens of milliseconds, so small
checkpoints of one owner queued together are copied by one child (at most
:data:`BATCH_MAX` of them, :data:`BATCH_BYTES` in all); and however many checkpoints one
user has owed, another's wait for one batch each round, never for all of them. Apart
from :mod:`slurm_ckpt.node.work` (which runs the children) because both are one rule
over a queue of records - plain data in, an order out - that the epilog and the stager
share and that is tested without a child or a ledger.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

from slurm_ckpt.ledger import Ident, Record

__all__ = ["BATCH_BYTES", "BATCH_MAX", "batch_from", "fair_order"]

#: At most this many checkpoints, and this many bytes, per child.
BATCH_MAX = 256
BATCH_BYTES = 64 * 2**20


def fair_order(records: List[Record]) -> List[Record]:
    """``records`` taken in turns by owner: one batch of each owner's (as many as one
    child copies: :data:`BATCH_MAX`, :data:`BATCH_BYTES`), then the next owner's, round
    after round, each owner's own in their order. Owners take their turns in the order
    of their first record (the ending job's owner first). However many checkpoints one
    user has owed, another's wait for one turn each round, never for all of them."""
    queues: Dict[str, List[List[Record]]] = {}
    filled: Dict[str, int] = {}  # bytes in each owner's last batch
    for rec in records:
        chunks = queues.setdefault(rec.user, [])
        nbytes = filled.get(rec.user, 0) + rec.nbytes
        if not chunks or len(chunks[-1]) >= BATCH_MAX or nbytes > BATCH_BYTES:
            chunks.append([rec])
            nbytes = rec.nbytes
        else:
            chunks[-1].append(rec)
        filled[rec.user] = nbytes
    out: List[Record] = []
    turn = 0
    while len(out) < len(records):
        for chunks in queues.values():
            if turn < len(chunks):
                out.extend(chunks[turn])
        turn += 1
    return out


def batch_from(
    queue: Sequence[Ident], queue_pos: Mapping[Ident, int], sizes: Mapping[Ident, int],
    ident: Ident,
) -> List[Ident]:  # fmt: skip
    """``ident`` and the checkpoints of the same owner queued right behind it in
    ``queue`` (``queue_pos``: each one's index there; ``sizes``: their bytes), while
    they are small (:data:`BATCH_BYTES`, :data:`BATCH_MAX`): copied by one child."""
    pos = queue_pos.get(ident)
    out = [ident]
    if pos is None:
        return out
    nbytes = sizes.get(ident, 0)
    for nxt in queue[pos + 1 :]:
        if nxt[0] != ident[0]:
            break
        nbytes += sizes.get(nxt, 0)
        if len(out) >= BATCH_MAX or nbytes > BATCH_BYTES:
            break
        out.append(nxt)
    return out
