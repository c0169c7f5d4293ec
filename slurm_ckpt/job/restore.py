"""Find the newest checkpoint that is complete and sound, and load it.

Multi-rank layout
-----------------
The tier layout is ``<root>/<user>/<key>/step-N/`` and one step directory is committed
atomically by one process (temp dir, rename, manifest last). Ranks on different nodes
have different local tiers, and two ranks on one node cannot commit into the same step
directory. So **each rank is its own checkpoint series**:

* ``world_size == 1``: key ``<key>``;
* ``world_size > 1``: key ``<key>.rank<NNNNN>`` (``run.rank00003``).

Inside its step directory a rank writes its payload under ``rank-<NNNNN>/`` (index and
blobs) and records ``rank`` and ``world_size`` in the manifest's ``meta``; the prefix
keeps shards from colliding if tools ever gather them into one directory.

A step is **complete** only when every one of the ``world_size`` shards is committed
(and, for the shard a rank loads, verified). How the ranks agree:

* with an ``agree`` function (a min-reduce over all ranks; by default
  ``torch.distributed.all_reduce(MIN)`` when torch.distributed is initialised): each rank
  loads the newest step of *its own* shard that verifies, on any tier; the ranks take
  the minimum; a rank above it searches again at or below it; repeat until all ranks hold
  the same step. Cost per rank: its own listing, no look at other ranks' files.
* without one (plain processes): a rank only considers steps whose shards of *all*
  ranks it can see committed - all on the PFS, or all on the local tier it sees (one
  node). Every rank evaluates the same rule on the same shared PFS, so they pick the
  same step - save for steps that another rank of this same launch has saved already
  (it started first; ``meta["launch"]``, :func:`~slurm_ckpt.job.dist.run_launch`): those
  are left out. A rank whose own shard then fails verification on every tier falls back
  alone: that is logged as an error (ranks would diverge; use ``agree`` to avoid it).

Tiers
-----
The Restorer reads through the Tier protocol, so it looks at every configured tier:
local, PFS, object store, cold archive (in that order, fastest first). The newest step
held anywhere wins; within a step the fastest tier holding it is read. A copy that fails
verification is marked ``BAD`` in the ledger and skipped: the same step from the next
tier, or else the next newest step. (POSIX tiers are read with direct I/O through their
file descriptors, objects with parallel ranged GETs: :mod:`slurm_ckpt.job.state_reader`.)

Replica groups
--------------
With ``replicas`` (the ranks that hold the same bytes, e.g. the DDP world) the newest
step is first tried as one read shared by the group (:mod:`.replica_read`): each chunk
read by one rank and broadcast, verified by every receiver against its own manifest.
Whatever that cannot do (other bytes, a dead peer, a copy on the rank's own node) falls
back to the per-rank read below, which then finds the shared result already in hand.

Lineages
--------
A rollback (a restore of an older step, then a save) starts a new lineage and retires
the newer steps of the old one (:mod:`slurm_ckpt.core.lineage`). Only current steps are
candidates of an automatic restore; ``restore(step=N, lineage=L)`` reads a retired one.

Data version
------------
``save(..., data_version=...)`` records which data a checkpoint was trained on (in the
manifest's ``meta``). ``restore(expect_data_version=...)`` compares it before reading
any payload, and warns or refuses (``on_data_change``) when the data changed since.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from slurm_ckpt.core.fastread import READ_STREAMS
from slurm_ckpt.core.lineage import SeriesView, lineage_of
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.core.replicas import newest_pin, not_automatic, pin_of
from slurm_ckpt.errors import CkptError, NotFound, TierError, VerifyError
from slurm_ckpt.job.replica_read import ReplicaGroup
from slurm_ckpt.job.rest_load import RestLoad
from slurm_ckpt.job.restored import (
    DATA_CHANGE_ACTIONS,
    DataVersionMismatch,
    NotThisFormat,
    Restored,
    check_tier_names,
    payload_format,
    shard_key,
    shard_prefix,
)
from slurm_ckpt.job.state import GROUP_REST, GROUP_WEIGHTS, STATE_FORMAT
from slurm_ckpt.job.state_reader import StateReader
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = [
    "DATA_CHANGE_ACTIONS",
    "DataVersionMismatch",
    "NotThisFormat",
    "Restored",
    "Restorer",
    "check_tier_names",
    "shard_key",
    "shard_prefix",
]


class Restorer:
    """Restore logic for one rank over an ordered list of tiers (fastest first)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        user: str,
        key: str,
        rank: int = 0,
        world_size: int = 1,
        *,
        mark_bad: Optional[Callable[[str, str, int, str], None]] = None,
        on_corrupt: Optional[Callable[[Tier, str, int], None]] = None,
        streams: int = READ_STREAMS,
        agree: Optional[Callable[[int], int]] = None,
        step: Optional[int] = None,
        expect_data_version: Optional[str] = None,
        on_data_change: str = "warn",
        lineage: Optional[str] = None,
        launch: Optional[str] = None,
        pin: Optional[Tuple[int, float]] = None,
        replicas: Optional[ReplicaGroup] = None,
        node_tiers: Sequence[str] = (),
    ) -> None:
        if on_data_change not in DATA_CHANGE_ACTIONS:
            raise CkptError(
                f"on_data_change must be one of {', '.join(DATA_CHANGE_ACTIONS)}, "
                f"got {on_data_change!r}"
            )
        self.tiers = list(tiers)
        self.only_step = step
        self.only_lineage = lineage
        #: The lineages of this rank's series over the tiers read (set by own_steps).
        self.view = SeriesView([])
        self.expect_data_version = expect_data_version
        self.on_data_change = on_data_change
        self.user, self.key = user, key
        self.rank, self.world_size = rank, world_size
        self.own_key = shard_key(key, rank, world_size)
        self.prefix = shard_prefix(rank)
        self.mark_bad = mark_bad
        self.on_corrupt = on_corrupt
        self.streams = streams
        self.agree = agree
        #: This launch of the ranks (:func:`~slurm_ckpt.job.dist.run_launch`).
        self.launch = launch
        #: The ``last_healthy`` pin this process set (one recorded in a manifest counts
        #: too: the newest wins).
        self.pin = pin
        self.replicas = replicas
        #: Tiers on the rank's own node (local, RAM, partner): a copy there is read alone.
        self.node_tiers = set(node_tiers)
        self._bad: Set[Tuple[str, int]] = set()
        self._passed: Set[int] = set()  # steps said to be passed over (suspect, pinned)
        self._rest: Optional[RestLoad] = None
        self._steps: List[int] = []
        self._own: Dict[int, List[Tuple[Tier, Manifest]]] = {}

    # -- listing -----------------------------------------------------------------------
    def _shard_steps(self, tier: Tier, rank: int, any_step: bool = False) -> Dict[int, Manifest]:
        """Committed steps of ``rank``'s shard on ``tier`` that belong to this world size
        (only the step asked for, unless ``any_step``)."""
        key = shard_key(self.key, rank, self.world_size)
        try:
            infos = tier.steps(self.user, key)
        except (TierError, OSError) as exc:
            log.warning("[ckpt] cannot list %s: %s", tier.where(self.user, key), exc)
            return {}
        out = {}
        for info in infos:
            if self.only_step is not None and info.step != self.only_step and not any_step:
                continue
            meta = info.manifest.meta
            if meta.get("world_size", 1) == self.world_size and meta.get("rank", 0) == rank:
                out[info.step] = info.manifest
        return out

    def own_steps(self) -> Dict[int, List[Tuple[Tier, Manifest]]]:
        """My shard's committed steps -> the tiers holding it (in tier order): the current
        ones (:mod:`slurm_ckpt.core.lineage`), or those of the lineage asked for. A step
        asked for that only a retired lineage holds is a one-line error naming it."""
        found = [
            (tier, step, m)
            for tier in self.tiers
            for step, m in self._shard_steps(tier, self.rank, any_step=True).items()
        ]
        self.view = SeriesView.of((step, m.meta, m.wall_time) for _, step, m in found)
        pin = newest_pin([self.pin] + [pin_of(m.meta) for _, _, m in found])
        out: Dict[int, List[Tuple[Tier, Manifest]]] = {}
        retired: Set[str] = set()
        passed: Dict[int, str] = {}
        for tier, step, m in found:
            if self.only_step is not None and step != self.only_step:
                continue
            if self.only_lineage is not None:
                keep = lineage_of(m.meta).name == self.only_lineage
            else:
                keep = self.view.active(step, m.meta)
                if not keep:
                    retired.add(lineage_of(m.meta).name)
            why = not_automatic(step, m.meta, m.wall_time, pin)
            if keep and why is not None:
                if self.only_step is None:  # a step asked for by number is read anyway
                    passed[step] = why
                    keep = False
                else:
                    log.warning("[ckpt] restore(step=%d): %s", step, why)
            if keep:
                out.setdefault(step, []).append((tier, m))
        for step, why in sorted(passed.items(), reverse=True):
            if step not in out and step not in self._passed:
                self._passed.add(step)
                log.warning("[ckpt] restore: passing over step %d: %s", step, why)
        if self.only_step is not None and not out and retired:
            names = ", ".join(sorted(retired))
            raise CkptError(
                f"restore(step={self.only_step}): that step is retired (lineage {names}: a "
                "rollback, or a later writer, went back behind it): say "
                f"restore(step={self.only_step}, lineage={sorted(retired)[0]!r})"
            )
        return out

    def _this_launch(self, m: Manifest) -> bool:
        return self.launch is not None and m.meta.get("launch") == self.launch

    def complete_steps(self) -> List[int]:
        """Steps whose every shard this rank can see committed (newest first)."""
        own = self.own_steps()
        if self.world_size == 1 or self.agree is not None:
            return sorted(own, reverse=True)
        complete: Set[int] = set()
        # A rank of this very launch that started first may have saved a newer step
        # already: not one to resume at, unless this rank saved it in this launch too.
        mine = {s for s, copies in own.items() if any(self._this_launch(m) for _, m in copies)}
        for tier in self.tiers:
            steps: Optional[Set[int]] = None
            for r in range(self.world_size):
                shard = self._shard_steps(tier, r)
                s = {st for st, m in shard.items() if st in mine or not self._this_launch(m)}
                steps = s if steps is None else steps & s
                if not steps:
                    break
            complete |= steps or set()
        return sorted(complete & set(own), reverse=True)

    # -- loading -----------------------------------------------------------------------
    def is_bad(self, tier: str, step: int) -> bool:
        """Whether this restore found ``step`` on ``tier`` unusable already: a reader of
        another kind (a shared read, a directory fetch) passes over it too."""
        return (tier, step) in self._bad

    def restored(
        self,
        tier: Tier,
        m: Manifest,
        state: Any,
        t0: float,
        partial: bool,
        read: Optional[int] = None,
        peer: int = 0,
    ) -> Restored:
        """The :class:`Restored` of step ``m`` read from ``tier`` (started at ``t0``):
        the one way every reader of this restore (weights first, the rest, a shared or a
        directory read) reports what it read."""
        return Restored(
            step=m.step,
            tokens=m.tokens,
            state=state,
            tier=tier.name,
            key=self.key,
            rank=self.rank,
            world_size=self.world_size,
            meta=dict(m.meta),
            data_version=m.meta.get("data_version"),
            lineage=lineage_of(m.meta).name,
            retired=not self.view.active(m.step, m.meta),
            nbytes=m.total_bytes,
            seconds=time.monotonic() - t0,
            partial=partial,
            read_bytes=m.total_bytes if read is None else read,
            peer_bytes=peer,
        )

    def _load(self, tier: Tier, m: Manifest, weights_only: bool) -> Restored:
        """Read one step from one tier. With ``weights_only`` the weight blobs are read
        first (all streams on them) and returned; the rest is then read and verified in
        the background (:class:`RestLoad`) while the caller uses the weights."""
        t0 = time.monotonic()
        where = tier.where(self.user, self.own_key, m.step)
        fmt = payload_format(m, self.prefix)
        if fmt != STATE_FORMAT:
            raise NotThisFormat(f"{where}: holds {fmt or 'files'}, not a slurm_ckpt state")
        self.check_data(m, where)
        with tier.reader(self.user, self.own_key, m.step) as tr:
            reader = StateReader(tr, tr.manifest, self.prefix, streams=self.streams, where=where)
        if not weights_only:
            with reader:
                state = reader.build(reader.read(reader.blobs(None)))
            return self.restored(tier, m, state, t0, False)
        try:
            state = reader.build(reader.read(reader.blobs([GROUP_WEIGHTS])), [GROUP_WEIGHTS])
        except BaseException:
            reader.close()
            raise
        rest = RestLoad(reader, tier, m, where)  # takes the reader over
        self._rest = rest
        return self.restored(tier, m, state, t0, True)

    def check_data(self, m: Manifest, where: str) -> None:
        """Compare the data version the checkpoint was trained on with the expected one
        (before a byte of payload is read): warn, or refuse with one line."""
        want = self.expect_data_version
        if want is None:
            return
        have = m.meta.get("data_version")
        if have == want:
            return
        msg = f"{where}: trained on data version {have!r}, the data now is {want!r}" + (
            "" if have is not None else " (the checkpoint recorded none)"
        )
        if self.on_data_change == "refuse":
            raise DataVersionMismatch(msg + ": refused (on_data_change='refuse')")
        log.warning("[ckpt] restore: %s", msg)

    def _try_step(
        self, step: int, holders: List[Tuple[Tier, Manifest]], weights_only: bool
    ) -> Optional[Restored]:
        for tier, m in holders:
            if (tier.name, step) in self._bad:
                continue
            try:
                return self._load(tier, m, weights_only)
            except NotThisFormat as exc:
                self._bad.add((tier.name, step))
                log.info("[ckpt] restore: skipping %s", exc)
            except (VerifyError, TierError, NotFound) as exc:
                self.note_bad(tier, step, exc)
        return None

    def _bytes_verify(self, tier: Tier, step: int) -> bool:
        """Whether the copy's bytes match its manifest after all (re-read, every byte):
        then what failed was reading it as a state, and the copy is kept."""
        try:
            return tier.verify(self.user, self.own_key, step).ok
        except (CkptError, OSError):
            return False

    def note_bad(self, tier: Tier, step: int, exc: BaseException) -> None:
        """``step`` on ``tier`` failed (``exc``): passed over from now on, booked BAD and,
        when its bytes do not match its manifest, handed to ``on_corrupt``."""
        self._bad.add((tier.name, step))
        if isinstance(exc, VerifyError) and self._bytes_verify(tier, step):
            # Never delete or uncommit a copy whose bytes are what was committed: it is
            # not readable the way this restore reads (a payload of another format).
            log.warning("[ckpt] restore: skipping %s (its bytes verify: kept)", exc)
            return
        log.warning("[ckpt] restore: skipping %s", exc)
        if self.mark_bad is not None:
            self.mark_bad(self.own_key, tier.name, step, str(exc))
        if isinstance(exc, VerifyError) and self.on_corrupt is not None:
            # The bytes do not match the manifest (not a read error that may pass).
            self.on_corrupt(tier, self.own_key, step)

    def _best_own(
        self,
        steps: List[int],
        own: Dict[int, List[Tuple[Tier, Manifest]]],
        bound: Optional[int],
        weights_only: bool,
        current: Optional[Restored],
    ) -> Optional[Restored]:
        if current is not None and (bound is None or current.step <= bound):
            return current
        for step in steps:
            if bound is not None and step > bound:
                continue
            got = self._try_step(step, own.get(step, []), weights_only)
            if got is not None:
                return got
        return None

    def restore(self, weights_only: bool = False) -> Optional[Restored]:
        """The newest complete, verified checkpoint (None if there is none).

        With ``weights_only`` only the weights are read and verified before returning;
        the rest of that step is read meanwhile and handed out by :meth:`restore_rest`,
        which rolls back to an older step if the rest turns out corrupt.
        """
        self.cancel()
        own = self._own = self.own_steps()
        steps = self._steps = self.complete_steps()
        shared = None
        if self.replicas is not None and not weights_only:
            shared = self._shared(steps, own)
        if self.agree is None:
            got = self._best_own(steps, own, None, weights_only, shared)
            if got is not None and steps and got.step != steps[0] and self.world_size > 1:
                log.error(
                    "[ckpt] restore: rank %d fell back to step %d while step %d is complete; "
                    "without an agreement function ranks may now hold different steps",
                    self.rank,
                    got.step,
                    steps[0],
                )
        else:
            got = self._agreed(steps, own, weights_only, current=shared)
        return got

    def _shared(
        self, steps: List[int], own: Dict[int, List[Tuple[Tier, Manifest]]]
    ) -> Optional[Restored]:
        """The newest step read once by the replica group, or None (each rank then
        reads alone): :func:`slurm_ckpt.job.replica_restore.shared_restore`."""
        from slurm_ckpt.job.replica_restore import shared_restore  # it needs this module

        return shared_restore(self, steps, own)

    def _agreed(
        self,
        steps: List[int],
        own: Dict[int, List[Tuple[Tier, Manifest]]],
        weights_only: bool,
        bound: Optional[int] = None,
        current: Optional[Restored] = None,
    ) -> Optional[Restored]:
        assert self.agree is not None
        while True:
            current = self._best_own(steps, own, bound, weights_only, current)
            mine = -1 if current is None else current.step
            agreed = self.agree(mine)
            if agreed < 0:
                self.cancel()
                return None
            if self.agree(1 if mine == agreed else 0) == 1:
                return current
            bound = agreed
            if current is not None and current.step > agreed:
                current = None
                self.cancel()  # the rest of a step we give up

    def cancel(self) -> None:
        """Stop and drop a background read of the rest (a restore never completed)."""
        rest, self._rest = self._rest, None
        if rest is not None:
            rest.cancel()

    def restore_rest(self) -> Restored:
        """After ``restore(weights_only=True)``: everything but the weights.

        Waits for the background read of the weights' step. If that part fails
        verification (the weights did not), the copy is marked bad and:

        * the same step from another tier is used when its weights are the very same
          bytes (same manifest entries and index): the weights handed out stay valid;
        * else the newest older step that verifies is restored **whole** and returned
          with ``rolled_back=True``: its ``state`` holds the weights too, and the caller
          must apply them again. With an agreement function every rank takes part in
          this decision (this call is then collective, like :meth:`restore`).

        Raises :class:`VerifyError` when nothing older verifies either.
        """
        rest = self._rest
        if rest is None:
            raise CkptError("restore_rest(): call restore(weights_only=True) first")
        self._rest = None
        step = rest.manifest.step
        got: Optional[Restored] = None
        err: Optional[BaseException] = None
        try:
            got = rest.result(self)
        except (VerifyError, TierError, NotFound) as exc:
            err = exc
            self.note_bad(rest.tier, step, exc)
            got = self._rest_elsewhere(rest)
        if self.agree is not None:
            if self.agree(1 if got is not None else 0) == 1:
                assert got is not None
                return got
            got = None
        if got is not None:
            return got
        # roll back: an older step, whole
        older = [s for s in self._steps if s < step]
        if self.agree is not None:
            full = self._agreed(older, self._own, False, bound=step - 1)
        else:
            full = self._best_own(older, self._own, None, False, None)
        if full is None:
            raise VerifyError(
                f"{rest.where}: the optimizer/other state failed verification ({err}) "
                "and no older checkpoint verifies: the weights handed out have no "
                "matching rest; start from scratch"
            )
        log.error(
            "[ckpt] restore: the rest of step %d failed verification; rolled back to "
            "step %d (its weights must be applied again)",
            step,
            full.step,
        )
        full.rolled_back = True
        return full

    def _rest_elsewhere(self, failed: RestLoad) -> Optional[Restored]:
        """The rest of the same step from another tier whose weights are identical."""
        step = failed.manifest.step
        for tier, m in self._own.get(step, []):
            if (tier.name, step) in self._bad or tier.name == failed.tier.name:
                continue
            if not failed.same_weights(m):
                continue
            t0 = time.monotonic()
            where = tier.where(self.user, self.own_key, step)
            try:
                with tier.reader(self.user, self.own_key, step) as tr:
                    reader = StateReader(
                        tr, tr.manifest, self.prefix, streams=self.streams, where=where
                    )
                with reader:
                    if reader.data != failed.reader.data:
                        continue
                    state = reader.build(reader.read(reader.blobs([GROUP_REST])), [GROUP_REST])
            except (VerifyError, TierError, NotFound) as exc:
                self.note_bad(tier, step, exc)
                continue
            log.warning("[ckpt] restore: the rest of step %d came from %s", step, tier.name)
            return self.restored(tier, m, state, t0, True)
        return None
