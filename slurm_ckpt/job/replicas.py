"""Replicas agree before a step counts: the exchange of digests between replica ranks.

``Checkpointer(replicas=...)`` says which ranks hold replicas of the same state:

* ``True``: every rank of the job (DDP: one model, replicated on every rank);
* a list of rank lists, a partition of the ranks (HSDP: ``[[0, 2], [1, 3]]``, the ranks
  of each shard's replicas);
* a ``torch.distributed`` process group holding this rank's replicas, or
  ``(device_mesh, "dim")``: the mesh dimension along which the state is replicated
  (HSDP's replicate dimension).

At each save the background writer hashes the files as it writes them (the manifest's
xxh3-128). Before it commits the manifest it sends the digests of the files that must be
identical across replicas (``replicated="weights"``: the model's blobs; ``"all"``: every
file of the rank's payload, for jobs whose whole state is replicated) to every rank and
gets theirs back - 16 bytes per file and rank, over a gloo group of its own, so that
the exchange never shares a communicator with the training's collectives on another
thread. :func:`slurm_ckpt.core.replicas.compare` gives the verdict, the same on every
rank, and it goes into the manifest (``meta.replicas``): a suspect step is recorded as
such wherever it is copied. The training thread never waits for any of this: it
happens while the next steps run, between the write and the commit.

What can go wrong: a rank whose local write fails still takes part (with no digests: the
step is "not compared"); a rank that never comes (dead, hung) makes the exchange time
out (``timeout_s``), after which the check is off for the rest of the run (the group may
be out of step) and the log says so. Every rank must save the same steps, which is what
a DDP job does.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from slurm_ckpt.core.replicas import ReplicaRecord, Verdict, compare, verdict_meta
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.dist import process_group
from slurm_ckpt.job.state import GROUP_WEIGHTS, INDEX_NAME

log = logging.getLogger(__name__)

__all__ = [
    "REPLICATED_SCOPES",
    "ReplicaCheck",
    "SuspectStep",
    "agree_before_commit",
    "replica_set_of",
    "replicated_files",
    "tell_suspects",
]

#: ``replicated=``: which files of a save must be identical across replicas.
REPLICATED_SCOPES = ("weights", "all")
#: How long a rank waits for the others' digests before the check gives up.
DEFAULT_TIMEOUT_S = 300.0


class SuspectStep(CkptError):
    """The replicas of a saved step did not agree (``on_suspect="raise"``): raised on the
    training thread by the next ``save()`` - on every rank the same one, before it saves
    anything - or ``wait()``/``close()``. ``verdict`` names the step, the ranks and nodes
    that differ, and the files."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.describe())
        self.verdict = verdict


def _group_ranks(dist: Any, group: Any) -> List[int]:
    getter = getattr(dist, "get_process_group_ranks", None)
    if getter is None:  # pragma: no cover - torch < 2.0
        raise CkptError("replicas=: this torch cannot list a process group's ranks")
    return sorted(int(r) for r in getter(group))


def replica_set_of(spec: Any, rank: int, world: int, dist: Any = None) -> int:
    """The id of ``rank``'s replica set (the lowest rank in it) under ``replicas=spec``;
    a one-line error for a spec that is none of the accepted forms."""
    if spec is True:
        return 0
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, (list, tuple)) for s in spec):
        seen: set = set()
        mine: Optional[int] = None
        for ranks in spec:
            if not ranks or not all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in ranks
            ):
                raise CkptError(f"replicas=: {list(ranks)!r} is not a list of ranks 0..{world - 1}")
            if seen & set(ranks):
                raise CkptError("replicas=: a rank is in two replica sets")
            seen |= set(ranks)
            if rank in ranks:
                mine = min(ranks)
        if mine is None:
            raise CkptError(f"replicas=: rank {rank} is in no replica set")
        return mine
    if dist is not None:
        if isinstance(spec, tuple) and len(spec) == 2 and hasattr(spec[0], "get_group"):
            spec = spec[0].get_group(spec[1])  # (DeviceMesh, "replicate dim")
        if type(spec).__name__ == "ProcessGroup":
            return _group_ranks(dist, spec)[0]
    raise CkptError(
        "replicas= must be True (every rank), a list of rank lists, a process group, or "
        f"(device_mesh, dim), not {type(spec).__name__}"
    )


def _encode(rec: ReplicaRecord) -> bytes:
    return json.dumps(
        {"r": rec.rank, "n": rec.node, "s": rec.replica_set, "t": rec.step, "d": rec.digests},
        separators=(",", ":"),
    ).encode()


def _decode(data: bytes) -> ReplicaRecord:
    doc = json.loads(data)
    digests = doc["d"]
    return ReplicaRecord(
        rank=int(doc["r"]),
        node=str(doc["n"]),
        replica_set=int(doc["s"]),
        step=int(doc["t"]),
        digests=None if digests is None else {str(k): str(v) for k, v in digests.items()},
    )


class ReplicaCheck:
    """This rank's side of the exchange (see the module docstring). Built at the
    Checkpointer's construction: creating its gloo group is collective, so every rank
    of the job builds one, in the same order as its other groups."""

    def __init__(
        self,
        spec: Any,
        rank: int,
        node: str,
        *,
        scope: str = "weights",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if scope not in REPLICATED_SCOPES:
            raise CkptError(
                f"replicated= must be one of {', '.join(REPLICATED_SCOPES)}, got {scope!r}"
            )
        dist = process_group()
        if dist is None:
            raise CkptError(
                "replicas=: needs torch.distributed initialised with more than one rank "
                "(call init_process_group() before the Checkpointer)"
            )
        self.dist = dist
        self.torch = sys.modules["torch"]
        self.rank = dist.get_rank()
        if rank != self.rank:
            raise CkptError(
                f"replicas=: the Checkpointer's rank {rank} is not torch.distributed's "
                f"rank {self.rank}"
            )
        self.world = dist.get_world_size()
        self.replica_set = replica_set_of(spec, self.rank, self.world, dist)
        self.node = node
        self.scope = scope
        self.group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=float(timeout_s))
        )
        #: Why the check stopped (an exchange failed), or None while it runs.
        self.broken: Optional[str] = None

    def exchange(self, step: int, digests: Optional[Mapping[str, str]]) -> Verdict:
        """Send this rank's digests of ``step``, get every rank's, return the verdict.
        Collective over the job's ranks (the background writer calls it, at every save,
        in the order of the saves). Never raises: a failed exchange turns the check off."""
        if self.broken is not None:
            return Verdict(step=step, skipped=self.broken)
        mine = ReplicaRecord(
            self.rank, self.node, self.replica_set, step, None if digests is None else dict(digests)
        )
        try:
            records = [_decode(b) for b in self._all_gather(_encode(mine))]
        except Exception as exc:  # noqa: BLE001 - a failed check must never kill training
            self.broken = f"the replica exchange failed at step {step}: {exc}"
            self.broken = " ".join(self.broken.split())[:300]
            log.error("[ckpt] %s; replicas are no longer compared in this run", self.broken)
            return Verdict(step=step, skipped=self.broken)
        return compare(step, records)

    def _all_gather(self, data: bytes) -> Sequence[bytes]:
        torch, dist, group = self.torch, self.dist, self.group
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=group)
        most = max(int(s.item()) for s in sizes)
        buf = torch.zeros(most, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.zeros(most, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(outs, buf, group=group)
        return [bytes(o[: int(s.item())].numpy().tobytes()) for o, s in zip(outs, sizes)]


def agree_before_commit(
    check: ReplicaCheck, step: int, want: Sequence[str], writer: Any, prefix: str
) -> Verdict:
    """The exchange of one save, between its write and its commit: this rank's digests of
    the files in ``want`` (names inside its payload directory ``prefix``) against every
    replica's; the verdict goes into the manifest the writer is about to commit."""
    pre = f"{prefix}/" if prefix else ""
    names = set(want)
    digests = {
        e.path[len(pre) :]: e.hash
        for e in writer.written()
        if e.path.startswith(pre) and e.path[len(pre) :] in names
    }
    verdict = check.exchange(step, digests)
    writer.meta["replicas"] = verdict_meta(verdict)
    return verdict


def replicated_files(blobs: Sequence[Dict[str, Any]], scope: str) -> Tuple[str, ...]:
    """The files of a save (names inside the rank's payload directory) whose digests
    replicas compare: the weights' blobs, or (``"all"``) every blob and the index."""
    if scope == "all":
        return tuple([b["name"] for b in blobs] + [INDEX_NAME])
    return tuple(b["name"] for b in blobs if b["group"] == GROUP_WEIGHTS)


def tell_suspects(
    pending: Deque[Verdict], on_suspect: Union[None, str, Callable[[Verdict], Any]]
) -> None:
    """On the training thread: hand the verdicts of suspect steps to the job's choice -
    its callback, or :class:`SuspectStep` (one per call; the next call raises the next).
    Without a choice they were logged and evented, which is all."""
    while pending:
        verdict = pending.popleft()
        if on_suspect == "raise":
            raise SuspectStep(verdict)
        if callable(on_suspect):
            on_suspect(verdict)
