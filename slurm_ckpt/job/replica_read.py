"""Read a checkpoint once per replica group: each rank reads a stripe, the group shares.

Why: in data-parallel training every rank restores the same bytes. Read rank by rank,
a job of N ranks reads the checkpoint N times from the warm tier (one PFS, one object
store, capped per node) and waits N times as long as one rank alone. Here the ranks
that hold the same bytes (a *replica group*: the DDP world, the replicated dimension of
HSDP) read the checkpoint once between them:

* every rank opens its own copy and reads its index (small); the group then checks,
  with one all-gather of a 16-byte digest, that all of them are about to restore the
  same step with the same chunk hashes. Any difference (another step, other bytes, a
  copy that would not open) and every rank reads its own copy as before;
* the hash chunks are striped over the ranks: chunk *k* is read from storage by rank
  ``k mod N`` (verified as it lands, as any read is), all ranks' stripes in parallel;
* each chunk is then broadcast from its reader over the job's process group, and
  every receiver hashes it against **its own** manifest before using it. A peer that
  sends other bytes (a bug, a bit flip, a hostile peer) is refused chunk by chunk;
* whatever did not arrive verified (a refused chunk, a peer that died or stalled past
  the timeout: the exchange stops at the first error) is read from the rank's own copy,
  chunk by chunk: today's per-rank read, for the part still missing.

So the group reads about one copy (plus one index per rank) and each rank ends with
bytes that match its own manifest, whoever sent them. The broadcasts run in the
caller's thread, one chunk at a time, while the rank's own stripe is read ahead by its
reader threads.

Limits: only whole restores share (``restore(weights_only=True)`` reads the rest in a
background thread, where a collective could interleave with the training's own); the
ranks must call ``restore()`` together (it is collective, as with an agreement
function); where no process group exists yet, ranks read alone.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import xxhash

from slurm_ckpt.core.fastread import READ_STREAMS, ChunkReader, ReadJob, chunk_ok, run_tasks
from slurm_ckpt.errors import CkptError, VerifyError

log = logging.getLogger(__name__)

__all__ = ["ReplicaGroup", "SharedRead", "replica_group", "shared_read"]

#: How long a rank waits for one chunk's broadcast before it reads the rest alone.
EXCHANGE_TIMEOUT = 120.0
_NO_DIGEST = bytes(16)


class ReplicaGroup:
    """The ranks that restore the same bytes: a ``torch.distributed`` process group
    (None: the default group) and this rank's place in it."""

    def __init__(self, group: Any = None, timeout: float = EXCHANGE_TIMEOUT) -> None:
        dist = _dist()
        if dist is None:
            raise CkptError("restore(replicas=...): torch.distributed is not initialised")
        self.dist, self.group, self.timeout = dist, group, timeout
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise CkptError("restore(replicas=group): this rank is not in that group")
        self.backend = str(dist.get_backend(group))
        self.ranks = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self.size)
        ]

    def carries_cpu(self) -> bool:
        """Whether the group moves CPU tensors (gloo, or ``cpu:gloo,cuda:nccl``): the
        chunks land in host memory, and an NCCL-only group would need a staging copy
        through the GPU (not done: such a group reads alone)."""
        return "gloo" in self.backend

    def digests(self, mine: bytes) -> List[bytes]:
        """Every rank's 16-byte digest (a collective; raw bytes, no pickle)."""
        torch = sys.modules["torch"]
        t = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        out = [torch.empty(16, dtype=torch.uint8) for _ in range(self.size)]
        self.dist.all_gather(out, t, group=self.group)
        return [bytes(o.tolist()) for o in out]

    def broadcast(self, tensor: Any, owner: int) -> None:
        """``tensor`` from group rank ``owner`` to all (waits at most ``timeout``)."""
        work = self.dist.broadcast(tensor, src=self.ranks[owner], group=self.group, async_op=True)
        work.wait(timeout=timedelta(seconds=self.timeout))


def _dist() -> Optional[Any]:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def replica_group(replicas: Any, timeout: float = EXCHANGE_TIMEOUT) -> Optional[ReplicaGroup]:
    """``restore(replicas=...)``: None/False (each rank reads alone), True (the default
    process group: DDP) or a process group (the ranks that hold the same state, e.g.
    HSDP's replicate dimension). None as well when there is no one to share with."""
    if replicas is None or replicas is False:
        return None
    if isinstance(replicas, ReplicaGroup):
        return replicas if replicas.size > 1 else None
    if _dist() is None:
        log.info("[ckpt] restore(replicas=...): no process group: every rank reads alone")
        return None
    group = ReplicaGroup(None if replicas is True else replicas, timeout)
    if not group.carries_cpu():
        log.warning(
            "[ckpt] restore(replicas=...): the process group has no CPU backend (%s): every "
            "rank reads alone; init_process_group(backend='cpu:gloo,cuda:nccl') lets it share",
            group.backend,
        )
        return None
    return group if group.size > 1 else None


@dataclass
class SharedRead:
    """What a shared read did on this rank (``Restored.read_bytes`` etc.)."""

    bufs: Dict[str, Any]
    #: Bytes this rank read from storage (its stripe, and whatever it read again alone).
    read_bytes: int = 0
    #: Verified bytes received from the other ranks.
    peer_bytes: int = 0
    #: Chunks a peer sent that failed verification here (refused, read alone).
    refused: int = 0
    #: Why the exchange stopped early (a peer died or stalled), else None.
    broken: Optional[str] = None


def digest_of(jobs: Sequence[ReadJob], chunk_size: int, step: int) -> bytes:
    """What the group must share: the step, the chunk size and every file's chunk
    hashes, in order."""
    h = xxhash.xxh3_128()
    h.update(f"{step}:{chunk_size}".encode())
    for job in jobs:
        h.update(f"\n{job.name}:{job.entry.size}:".encode())
        h.update(",".join(job.entry.chunks).encode())
    return h.digest()


def agree_to_share(group: ReplicaGroup, mine: Optional[bytes]) -> bool:
    """Whether every rank of the group is about to read the very same bytes (collective:
    every rank calls it once per restore, ``mine=None`` when it will not share)."""
    try:
        digests = group.digests(mine or _NO_DIGEST)
    except Exception as exc:  # noqa: BLE001 - a group already broken: read alone
        log.warning("[ckpt] restore: not shared (the group did not answer: %s)", exc)
        return False
    return mine is not None and all(d == mine for d in digests)


def shared_read(
    group: ReplicaGroup,
    jobs: Sequence[ReadJob],
    chunk_size: int,
    *,
    streams: int = READ_STREAMS,
    where: str = "checkpoint",
) -> SharedRead:
    """Read ``jobs`` (this rank's own copy) together with the group, after
    :func:`agree_to_share` said yes on every rank: name -> verified memory. Raises
    :class:`VerifyError` only when this rank's own copy fails for a chunk it had to read
    itself."""
    torch = sys.modules["torch"]
    with ChunkReader(jobs, chunk_size, where) as cr:
        tasks = cr.tasks()
        n, me = group.size, group.rank
        mine = [k for k in range(len(tasks)) if k % n == me]
        got: Set[int] = set()
        out = SharedRead(bufs={})
        pool = ThreadPoolExecutor(max_workers=max(1, streams), thread_name_prefix="ckpt-stripe")
        try:
            futs: Dict[int, Future[None]] = {k: pool.submit(cr.read, tasks[k]) for k in mine}
            for k, (i, c0, c1, want) in enumerate(tasks):
                owner = k % n
                if owner == me:
                    try:
                        futs[k].result()
                        got.add(k)
                    except VerifyError as exc:  # still send: the others refuse it
                        log.warning("[ckpt] restore: %s", exc)
                view = torch.frombuffer(cr.bufs[i], dtype=torch.uint8, count=c1 - c0, offset=c0)
                try:
                    group.broadcast(view, owner)
                except Exception as exc:  # noqa: BLE001 - a dead or stalled peer: go alone
                    out.broken = f"chunk {k} from rank {owner}: {exc}".splitlines()[0]
                    log.warning(
                        "[ckpt] restore: shared read stopped (%s); reading the rest alone",
                        out.broken,
                    )
                    break
                if owner == me:
                    continue
                if chunk_ok(memoryview(cr.bufs[i])[c0:c1], want):
                    got.add(k)
                    out.peer_bytes += c1 - c0
                else:
                    out.refused += 1
                    log.warning(
                        "[ckpt] restore: %s: chunk %d (bytes %d-%d) from rank %d fails "
                        "verification: refused, read here",
                        where,
                        k,
                        c0,
                        c1,
                        owner,
                    )
            for k in mine:  # my stripe, read even when the exchange stopped
                if k not in got:
                    try:
                        futs[k].result()
                        got.add(k)
                    except VerifyError:
                        pass
        finally:
            pool.shutdown(wait=True)
        missing = [tasks[k] for k in range(len(tasks)) if k not in got]
        if missing:
            _read_alone(cr, missing, streams)
        out.read_bytes = cr.nbytes_read
        out.bufs = {job.name: buf for job, buf in zip(jobs, cr.bufs)}
        return out


def _read_alone(cr: ChunkReader, missing: List[Tuple[int, int, int, str]], streams: int) -> None:
    """The chunks that did not arrive verified, from this rank's own copy (a chunk of
    my stripe that failed once is read again: a read error may pass)."""
    run_tasks(cr.read, missing, streams)
