"""The restore side of the Checkpointer: the newest step that verifies, read back.

The :class:`~slurm_ckpt.job.checkpointer.Checkpointer` facade builds a :class:`Restoring`
over its typed :class:`~slurm_ckpt.job.context.JobContext` and delegates to it: ``restore``,
``restore_weights``, ``restore_rest``, and what a restore does with a copy that fails
verification (``BAD`` in the ledger; a corrupt shared-tier copy is uncommitted, so
that a good one is flushed again); on a spare after a node loss, the partner's disk
read as one more tier (:mod:`slurm_ckpt.job.partner_tier`). The reading itself is
:class:`~slurm_ckpt.job.restore.Restorer`; this is the part that needs the series'
tiers, identity, schedule and bookkeeping (the context) plus the partner link, the RAM
tier, the agreement and the timeline - never the Checkpointer. Why apart: saving and
restoring are two concepts, and the facade stays a facade.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from slurm_ckpt.core.lineage import SeriesView, lineage_of
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import CkptError, NotFound
from slurm_ckpt.job.context import JobContext
from slurm_ckpt.job.dist import dist_agree, run_launch
from slurm_ckpt.job.partner import PartnerLink
from slurm_ckpt.job.partner_fetch import relaunched
from slurm_ckpt.job.partner_tier import PARTNER, PARTNER_RAM, PartnerTier
from slurm_ckpt.job.ram_replica import RamCopies
from slurm_ckpt.job.ram_tier import RAM
from slurm_ckpt.job.replica_read import replica_group
from slurm_ckpt.job.restore import Restored, Restorer, check_tier_names
from slurm_ckpt.job.timeline import RankTimeline
from slurm_ckpt.ledger.record import State
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["Restoring"]


class Restoring:
    """The Checkpointer's restore side (see the module docstring)."""

    def __init__(
        self,
        ctx: JobContext,
        *,
        partner: Optional[PartnerLink],
        ram: Optional[RamCopies],
        agree: Optional[Callable[[int], int]],
        timeline: RankTimeline,
    ) -> None:
        self._ctx = ctx
        self._partner = partner
        self._ram = ram
        self._agree = agree
        self._timeline = timeline
        #: The restorer of the newest restore() (its rest may still be read).
        self.restorer: Optional[Restorer] = None
        #: What the newest restore returned (None: nothing restored).
        self.restored: Optional[Restored] = None

    def mark_bad(self, key: str, tier: str, step: int, reason: str) -> None:
        if tier in (PARTNER, PARTNER_RAM, RAM):
            return  # the holder's copy, not this node's, or memory: logged, not booked
        self._ctx.books.set_state(step, tier, State.BAD, reason, code="verify_failed", key=key)

    def uncommit_corrupt(self, tier: Tier, key: str, step: int) -> None:
        """A shared-tier copy whose bytes do not match its manifest is not a checkpoint:
        it is *uncommitted* there (its manifest moved aside as ``manifest.json.damaged``,
        as ``verify`` and the hooks' scrub do), so that no node's retention takes the
        copy that rotted for the safe one, and every node still holding a good local
        copy of that step sees at its next hook that the warm copy was found damaged and
        flushes its own again. Not deleted: a copy that is simply gone reads, to those
        nodes, as one the warm tier's retention removed - which they must not undo - so
        the step would stay lost while a good copy sat on a node. This node's own good
        copy, if any, is owed again too: the ledger says BAD there."""
        if tier.name == RAM:
            tier.delete(self._ctx.user, key, step)  # unlisted: its slot is refilled first
            return
        if tier.name in (self._ctx.local.name, PARTNER, PARTNER_RAM):
            return  # the job's own local copy (retention and the next save deal with it),
            # or the holder's partner copy (its own node's to deal with)
        where = tier.where(self._ctx.user, key, step)
        try:
            # The manifest now committed: uncommitted only while it is still this one.
            user = self._ctx.user
            done = tier.uncommit(user, key, step, tier.manifest_bytes(user, key, step))
        except NotFound:
            return  # no longer committed (uncommitted or removed by someone else)
        except CkptError as exc:
            log.warning("[ckpt] could not uncommit the corrupt %s: %s", where, exc)
            return
        if not done:
            return  # its manifest changed meanwhile: another writer's business now
        try:
            self._ctx.local.manifest_bytes(self._ctx.user, key, step)
            after = "this node's local copy is flushed again if it verifies"
            if self._ctx.books.state(step, self._ctx.local.name, key) == State.BAD:
                # Damaged on both tiers: this node's copy failed its check too.
                after = (
                    "this node's local copy of that step failed verification too; a node "
                    "that holds a good copy flushes it again, else it is lost"
                )
        except CkptError:
            # Say so: there may be no good copy at all (both tiers damaged).
            after = (
                "this node holds no other copy of that step; a node that does flushes it "
                "again, else it is lost"
            )
        log.warning("[ckpt] uncommitted the corrupt %s (manifest.json.damaged); %s", where, after)
        self._ctx.books.emit("corrupt_uncommitted", step=step, tier=tier.name)

    def make_restorer(
        self,
        tiers: Optional[Sequence[str]] = None,
        step: Optional[int] = None,
        expect_data_version: Optional[str] = None,
        on_data_change: str = "warn",
        factory: Callable[..., Restorer] = Restorer,
        partner: Sequence[PartnerTier] = (),
        lineage: Optional[str] = None,
        replicas: Any = None,
    ) -> Restorer:
        """The one place a restorer of this rank is built (``restore()``, and
        ``restore_path()`` with ``factory=partial(DirRestorer, local)``): the tier list
        (an unknown name is an error; ``partner`` goes right after the local tier), the
        agreement and the corrupt-copy handling. The own RAM tier goes first (when no
        ``tiers`` are named)."""
        if tiers is not None:
            names = [t.name for t in self._ctx.tiers]
            tiers = check_tier_names(tiers, names, self._ctx.config.tiers.warm)
        extra: Dict[str, Any] = {} if lineage is None else {"lineage": lineage}
        group = replica_group(replicas)
        if group is not None:
            extra["replicas"] = group
            extra["node_tiers"] = [self._ctx.local.name, RAM, PARTNER, PARTNER_RAM]
        use: List[Any] = list(
            self._ctx.tiers if tiers is None else [t for t in self._ctx.tiers if t.name in tiers]
        )
        if partner:
            at = next((i + 1 for i, t in enumerate(use) if t is self._ctx.local), 0)
            use[at:at] = list(partner)
        if self._ram is not None and tiers is None and factory is Restorer:
            use.insert(0, self._ram.tier)
        return factory(
            use,
            self._ctx.user,
            self._ctx.key,
            self._ctx.rank,
            self._ctx.world_size,
            mark_bad=self.mark_bad,
            on_corrupt=self.uncommit_corrupt,
            agree=self._agree or dist_agree(),
            launch=run_launch(),
            step=step,
            expect_data_version=expect_data_version,
            on_data_change=on_data_change,
            pin=self._ctx.pipeline.last_healthy,
            **extra,
        )

    def adopt_lineage(self, got: Restored, view: Optional[SeriesView]) -> None:
        """Saves after this restore go on in the restored step's lineage when it is the
        series' newest current step; else (a rollback) the next save starts a new
        lineage from it, retiring the newer steps (:mod:`slurm_ckpt.core.lineage`)."""
        if view is None:  # the restore looked at some tiers only: judge over local + warm
            view = self._ctx.pipeline.series.series_view()
        newest = view.newest_active()
        lineage = lineage_of(got.meta)
        if view.active(got.step, got.meta) and (newest is None or got.step >= newest):
            self._ctx.pipeline.series.follow(lineage)
        else:
            self._ctx.pipeline.series.branch_from(lineage, got.step)

    def restore(
        self,
        weights_only: bool = False,
        *,
        step: Optional[int] = None,
        tiers: Optional[Sequence[str]] = None,
        expect_data_version: Optional[str] = None,
        on_data_change: str = "warn",
        lineage: Optional[str] = None,
        replicas: Any = None,
    ) -> Optional[Restored]:
        """The newest complete checkpoint that verifies, on any configured tier (local,
        PFS, object store, cold; the fastest that holds it); None when there is none.
        With ``weights_only`` only the model weights (top-level keys such as ``model``)
        are returned as soon as they are read and verified, while the rest of the step is
        read in the background; get it with :meth:`restore_rest` (which may roll back to
        an older step, see there).

        ``step`` restores that step only (e.g. back to three days ago, from the cold
        tier); ``tiers`` limits the tiers looked at (names, e.g. ``["cold"]``).
        ``expect_data_version``: the data version the job has now; a checkpoint trained
        on another one is restored with a warning (``on_data_change="warn"``) or refused
        with :class:`~slurm_ckpt.job.restore.DataVersionMismatch` (``"refuse"``).

        Lineages (docs/user-guide.md, "Rolling back"): restoring an older step than the
        newest and saving on starts a new lineage; the newer steps are then retired and
        no automatic restore picks them. ``lineage`` names the lineage to read from
        (``Restored.lineage`` says which one a restore read): ``restore(step=20,
        lineage="main")`` gets a retired step back.

        ``replicas``: the ranks that restore the same bytes read them once between them
        (docs/user-guide.md, "Restoring at scale"): ``True`` for data parallelism (every
        rank of the default process group holds the same state), or the process group
        of ranks that do (HSDP's replicate dimension). Each chunk is read by one rank
        and broadcast; every rank verifies every chunk against its own manifest and
        reads alone whatever did not arrive verified. A step this rank holds on its own
        node (local tier, RAM, partner) is read there, alone. Collective over that group."""
        if self.restorer is not None:
            self.restorer.cancel()
        partner = self._partner_tiers() if tiers is None else []
        self.restorer = self.make_restorer(
            tiers,
            step,
            expect_data_version,
            on_data_change,
            partner=partner,
            lineage=lineage,
            replicas=replicas,
        )
        got = self.restorer.restore(weights_only=weights_only)
        if got is not None and got.tier == PARTNER and self._partner is not None:
            self._partner.adopt(got.step)  # the spare's own copy, in the background
        if got is None:
            log.info("[ckpt] restore: no checkpoint of %s found", self._ctx.shard_key)
            return None
        self.restored = got
        self._ctx.schedule.restored(got.step, got.tokens)
        self._timeline.restored(got.step, got.tier, got.seconds)
        self.adopt_lineage(got, self.restorer.view if tiers is None else None)
        log.info(
            "[ckpt] restored step=%d (lineage %s%s) tokens=%s from %s (%s in %.3fs)%s",
            got.step,
            got.lineage,
            ", retired" if got.retired else "",
            got.tokens,
            got.tier,
            format_bytes(got.nbytes),
            got.seconds,
            " weights only" if weights_only else "",
        )
        return got

    def pin_last_healthy(self, step: int) -> None:
        """Mark ``step`` as the newest healthy one: a NaN or loss-spike detector calls it
        (on every rank) when it finds the training went bad after that step. From now on
        an automatic :meth:`restore` passes over the steps after it that were saved until
        now (they stay, listed; ``restore(step=N)`` still reads one); a later save (after
        the rollback this usually leads to) counts again. The pin is recorded in every
        manifest saved from now on, so a restarted job honours it too once one of them
        is committed."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CkptError(f"pin_last_healthy(): step must be a whole number >= 0, got {step!r}")
        self._ctx.pipeline.last_healthy = (step, time.time())
        log.warning("[ckpt] last healthy step pinned at %d: newer steps are passed over", step)
        self._ctx.books.emit("last_healthy", step=step)

    @property
    def last_healthy(self) -> Optional[int]:
        """The step :meth:`pin_last_healthy` pinned in this process, or None."""
        pin = self._ctx.pipeline.last_healthy
        return None if pin is None else pin[0]

    def restore_weights(self) -> Optional[Restored]:
        """``restore(weights_only=True)``."""
        return self.restore(weights_only=True)

    def restore_rest(self) -> Restored:
        """Everything but the weights, from the step :meth:`restore_weights` chose.

        If that part of the step fails verification and no other tier holds it with the
        same weights, an older step is restored whole and returned with
        ``rolled_back=True``: its ``state`` has the weights too, apply them again. Raises
        :class:`VerifyError` when no older step verifies either."""
        if self.restorer is None:
            raise CkptError("restore_rest(): call restore(weights_only=True) first")
        got = self.restorer.restore_rest()
        if got.rolled_back:
            self.restored = got
            self._ctx.schedule.restored(got.step, got.tokens)
            self.adopt_lineage(got, self.restorer.view)
        return got

    def _partner_tiers(self) -> List[PartnerTier]:
        """A rank whose local tier holds nothing of its series (it runs on a spare) also
        reads what the other ranks hold of it - in a step relaunched after a node loss,
        or whenever the RAM tier is on: their RAM copies first (tier ``partner-ram``,
        with the RAM tier on), then their disks (``partner``): its newest checkpoints
        are there, and the PFS may hold only older ones (docs/spares.md,
        docs/in-job-recovery.md)."""
        if self._partner is None or not (relaunched() or self._ram is not None):
            return []
        try:
            if self._ctx.local.steps(self._ctx.user, self._ctx.shard_key):
                return []
        except NotFound:
            pass
        except (CkptError, OSError) as exc:
            log.warning("[ckpt] partner tier skipped: %s", exc)
            return []
        disk = PartnerTier(self._partner)
        return [PartnerTier(self._partner, ram=True), disk] if self._ram is not None else [disk]
