"""Loading a DCP checkpoint of :mod:`slurm_ckpt.dcp.storage`: which step every rank
agrees on, what each rank verifies before it says yes, and the ``StorageReader`` that
hands DCP's planner the verified bytes (the module docstring of
:mod:`slurm_ckpt.dcp.storage` tells the whole story). Apart from the writer because
loading is its own concept: agreement over a group (the process group, a subgroup, or
none), verification, refusal.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from slurm_ckpt.core.fastread import read_files
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.dcp.meta import Decoded, ItemInfo, decode, misfit, parse_dtype
from slurm_ckpt.dcp.part_file import open_part
from slurm_ckpt.dcp.ranged import RangedRead, plan_ranges, read_ranges
from slurm_ckpt.dcp.values import decode_value
from slurm_ckpt.errors import CkptError, NotFound, TierError, VerifyError
from slurm_ckpt.job.dcp_series import part_key
from slurm_ckpt.job.dist import all_reduce_ints
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["METADATA_FILE", "Group", "Refused", "SlurmDcpReader", "safe_load", "select_step"]

METADATA_FILE = "dcp.metadata.json"


def safe_load(raw: Any, what: str) -> Any:
    """A non-tensor item, unpickled with ``weights_only=True`` (one-line refusal)."""
    try:
        return torch.load(io.BytesIO(bytes(raw)), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError) as exc:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # torch's bold, on a terminal
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", text)
        first = text.splitlines()[0] if text else type(exc).__name__
        if found:  # what the pickle wanted to run or build: the useful part
            first = f"it names {found.group(1)}"
        raise VerifyError(
            f"{what}: refused: not loadable with weights_only=True (a pickle that would run "
            f"code?): {first}"
        ) from None


class Refused(CkptError):
    """A verified item that this load will not build (a pickle ``weights_only=True``
    refuses, a value it cannot read): not damage - every copy holds the same bytes - so
    the load fails with this line instead of quietly using an older step."""


def load_item(raw: Any, info: ItemInfo, what: str) -> Any:
    """A non-tensor item: a stored value (no pickle at all), or a ``torch.save`` pickle
    loaded with ``weights_only=True`` (steps saved before values existed, classes
    registered with ``add_safe_globals``)."""
    if info.kind == "value":
        return decode_value(raw, what)
    return safe_load(raw, what)


def _refusal(step: int, exc: BaseException) -> Refused:
    return Refused(
        f"dcp step {step}: {exc} (not damage: every copy holds these bytes); register the "
        "item's classes with torch.serialization.add_safe_globals() before loading, or "
        "load an older step with dcp_reader(step=N)"
    )


class _Step:
    """One candidate step as this rank sees it: the decoded metadata, where each part
    is committed (binding hash checked), and the parts it has verified already."""

    def __init__(self, step: int, decoded: Decoded, tokens: Optional[int]) -> None:
        self.step, self.decoded, self.tokens = step, decoded, tokens
        self.holders: Dict[int, List[Tuple[Tier, Manifest]]] = {}
        self.cache: Dict[int, Tuple[str, memoryview]] = {}


class _Parts:
    """Reads and verifies whole part files from the tiers (fastest first)."""

    def __init__(self, tiers: Sequence[Tier], user: str, key: str, mark_bad: Any) -> None:
        self.tiers, self.user, self.key = list(tiers), user, key
        self.mark_bad = mark_bad
        self.bad: set = set()

    def note_bad(self, tier: Tier, key: str, step: int, exc: BaseException) -> None:
        """Skip ``key``'s ``step`` on ``tier`` from now on (it failed to verify or to
        open) and tell the Checkpointer's ``mark_bad`` (the ledger), as the step
        selection also does when the metadata itself will not decode."""
        self.bad.add((tier.name, key, step))
        log.warning("[ckpt] dcp restore: skipping %s", exc)
        if self.mark_bad is not None:
            self.mark_bad(key, tier.name, step, str(exc))

    def read_file(
        self, holders: List[Tuple[Tier, Manifest]], key: str, step: int, relpath: str, want: str
    ) -> Optional[Tuple[str, memoryview]]:
        """The verified bytes of ``relpath`` (content hash ``want``) from the first holder
        whose copy verifies, with that tier's name; None when none does."""
        for tier, _m in holders:
            if (tier.name, key, step) in self.bad:
                continue
            try:
                with open_part(tier, self.user, key, step, relpath, want) as part:
                    buf = read_files([part.job], part.chunk_size, where=part.where)[0]
                return tier.name, memoryview(buf)[: part.job.entry.size]
            except KeyError:
                where = tier.where(self.user, key, step)
                self.note_bad(tier, key, step, VerifyError(f"{where}: no {relpath}"))
            except (VerifyError, TierError, NotFound, OSError) as exc:
                self.note_bad(tier, key, step, exc)
        return None

    def holders(self, key: str, step: int, relpath: str, want: str) -> List[Tuple[Tier, Manifest]]:
        out = []
        for tier in self.tiers:
            if (tier.name, key, step) in self.bad:
                continue
            try:
                m = tier.manifest(self.user, key, step)
            except (NotFound, VerifyError, TierError, OSError):
                continue
            if any(f.path == relpath and f.hash == want for f in m.files):
                out.append((tier, m))
        return out


def _item_view(buf: memoryview, info: ItemInfo) -> torch.Tensor:
    dtype = parse_dtype(info.dtype)
    shape = info.shape or ()
    if info.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    t = torch.frombuffer(buf, dtype=dtype, count=info.nbytes // esize, offset=info.pos)
    return t.reshape(shape)


class SlurmDcpReader(StorageReader):
    """DCP ``StorageReader`` for the one step :func:`select_step` agreed on."""

    def __init__(self, chosen: _Step, parts: _Parts, ranged: bool = False) -> None:
        super().__init__()
        self.chosen, self._parts, self.ranged = chosen, parts, ranged
        self.step, self.tokens = chosen.step, chosen.tokens
        #: Part rank -> tier name each part was read from (for logs and tests).
        self.read_from: Dict[int, str] = {}
        #: Ranged loads: bytes the plan needed and bytes read from storage.
        self.ranged_read = RangedRead()
        self.storage: Dict[MetadataIndex, ItemInfo] = chosen.decoded.metadata.storage_data

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self.chosen.decoded.metadata
        if md.storage_meta is not None:
            md.storage_meta.load_id = uuid.uuid4().hex
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def _part(self, rank: int) -> memoryview:
        ch = self.chosen
        if rank in ch.cache:
            tier, buf = ch.cache[rank]
        else:
            info = ch.decoded.parts[rank]
            key = part_key(self._parts.key, rank)
            got = self._parts.read_file(ch.holders[rank], key, ch.step, info["file"], info["hash"])
            if got is None:
                raise VerifyError(
                    f"dcp step {ch.step}: part {rank} verifies on no tier (every copy is "
                    "damaged); load again to fall back to the previous step"
                )
            tier, buf = got
            ch.cache[rank] = got
        self.read_from[rank] = tier
        return buf

    def _ranged_part(self, rank: int, reqs: List[Any]) -> memoryview:
        """Only the chunks of part ``rank`` that ``reqs`` need, each verified."""
        ch = self.chosen
        info = ch.decoded.parts[rank]
        ranges, needed = plan_ranges(self.storage, reqs)
        self.ranged_read.nbytes_needed += needed
        tier, buf = read_ranges(
            ch.holders[rank],
            self._parts.user,
            part_key(self._parts.key, rank),
            ch.step,
            f"part {rank}",
            info["file"],
            info["hash"],
            ranges,
            self.ranged_read,
        )
        self.read_from[rank] = tier
        return buf

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[Any]:
        by_part: Dict[int, List[Any]] = {}
        for req in plan.items:
            by_part.setdefault(self.storage[req.storage_index].rank, []).append(req)
        for rank in sorted(by_part):
            buf = self._ranged_part(rank, by_part[rank]) if self.ranged else self._part(rank)
            for req in by_part[rank]:
                info = self.storage[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    raw = buf[info.pos : info.pos + info.nbytes]
                    try:
                        obj = load_item(raw, info, req.storage_index.fqn)
                    except VerifyError as exc:
                        raise _refusal(self.step, exc) from None
                    safe = io.BytesIO()
                    torch.save(obj, safe)  # our own pickle of the objects just built
                    safe.seek(0)
                    planner.load_bytes(req, safe)
                    continue
                src = narrow_tensor_by_index(
                    _item_view(buf, info), req.storage_offsets, req.lengths
                )
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise VerifyError(
                        f"dcp step {self.step}: {req.storage_index.fqn}: size "
                        f"{tuple(src.size())} != {tuple(target.size())}"
                    )
                target.copy_(src)
                planner.commit_tensor(req, target)
        fut: Future[Any] = Future()
        fut.set_result(None)
        return fut

    def release(self) -> None:
        """Drop the verified bytes kept for ``read_data`` (after ``dcp.load``)."""
        self.chosen.cache.clear()


class Group:
    """Who a load agrees with: the default process group (``group=None``), a subgroup
    (DCP's ``process_group=``), or no one (``no_dist=True``: one rank alone, or a
    process with no process group at all, reads the whole checkpoint)."""

    def __init__(self, group: Any = None, no_dist: bool = False) -> None:
        self.group, self.no_dist = group, no_dist
        self.rank, self.world = 0, 1
        if not no_dist and dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def reduce(self, values: List[int], op: str) -> List[int]:
        if self.world <= 1:
            return [int(v) for v in values]
        return all_reduce_ints(values, op, group=self.group)


def _qualify(
    parts: _Parts,
    step: int,
    holders0: List[Tuple[Tier, Manifest]],
    group: Group,
    ranged: bool = False,
) -> Optional[_Step]:
    """``step`` as this rank sees it, or None when it is not whole and sound here;
    :class:`Refused` when a verified item of it will not load. A ranged load checks the
    metadata and that every part is committed somewhere, but reads no part here: it
    verifies the chunks it needs as they land (:mod:`slurm_ckpt.dcp.ranged`)."""
    key0 = part_key(parts.key, 0)
    decoded: Optional[Decoded] = None
    tokens = None
    for tier, m in holders0:
        entry = next((f for f in m.files if f.path == METADATA_FILE), None)
        if entry is None:
            continue
        got = parts.read_file([(tier, m)], key0, step, METADATA_FILE, entry.hash)
        if got is None:
            continue
        try:
            decoded = decode(bytes(got[1]), tier.where(parts.user, key0, step))
        except VerifyError as exc:
            parts.note_bad(tier, key0, step, exc)
            continue
        tokens = m.tokens
        break
    if decoded is None:
        log.warning("[ckpt] dcp restore: step %d: no verified metadata on any tier", step)
        return None
    chosen = _Step(step, decoded, tokens)
    for r, info in decoded.parts.items():
        if info.get("file") is None:
            chosen.holders[r] = []
            continue
        chosen.holders[r] = parts.holders(part_key(parts.key, r), step, info["file"], info["hash"])
        if not chosen.holders[r]:
            log.warning(
                "[ckpt] dcp restore: step %d: part %d is on no tier this rank sees", step, r
            )
            return None
    sizes = {}
    for r, info in decoded.parts.items():
        if info.get("file") is not None and chosen.holders.get(r):
            sizes[r] = chosen.holders[r][0][1].file(info["file"]).size
    why = misfit(decoded, sizes)
    if why is not None:  # verified, but it does not fit its parts: skipped as corrupt
        log.error("[ckpt] dcp restore: step %d: metadata does not fit: %s", step, why)
        return None
    if ranged:
        return chosen
    me, world = group.rank, group.world
    for r in sorted(decoded.parts):
        info = decoded.parts[r]
        if r % world != me or info.get("file") is None:
            continue
        key = part_key(parts.key, r)
        got = parts.read_file(chosen.holders[r], key, step, info["file"], info["hash"])
        if got is None:
            log.warning("[ckpt] dcp restore: step %d: part %d verifies on no tier", step, r)
            return None
        chosen.cache[r] = got
        for idx, item in decoded.metadata.storage_data.items():
            if item.rank == r and item.kind != "tensor":
                try:
                    load_item(got[1][item.pos : item.pos + item.nbytes], item, idx.fqn)
                except VerifyError as exc:
                    raise _refusal(step, exc) from None
    return chosen


def select_step(
    tiers: Sequence[Tier],
    user: str,
    key: str,
    *,
    step: Optional[int] = None,
    mark_bad: Any = None,
    group: Optional[Group] = None,
    ranged: bool = False,
) -> Optional[SlurmDcpReader]:
    """Agree with every rank of ``group`` (default: the process group) on the newest
    step all of them find whole and sound (see the module docstring); a reader for it,
    or None when there is none. Collective over ``group``; raises :class:`Refused` on
    every rank when a rank finds a verified item of that step that will not load.
    ``ranged``: read only what the plan needs, later (see :mod:`~slurm_ckpt.dcp.ranged`)."""
    group = group if group is not None else Group()
    parts = _Parts(tiers, user, key, mark_bad)
    key0 = part_key(key, 0)
    cands: Dict[int, List[Tuple[Tier, Manifest]]] = {}
    for tier in parts.tiers:
        try:
            infos = tier.steps(user, key0)
        except (TierError, OSError) as exc:
            log.warning("[ckpt] cannot list %s: %s", tier.where(user, key0), exc)
            continue
        for info in infos:
            if step is None or info.step == step:
                cands.setdefault(info.step, []).append((tier, info.manifest))
    order = sorted(cands, reverse=True)
    seen: Dict[int, Optional[_Step]] = {}
    refused: List[Refused] = []

    def best(bound: Optional[int]) -> Tuple[int, Optional[_Step]]:
        for s in order:
            if bound is not None and s > bound:
                continue
            if s not in seen:
                try:
                    seen[s] = _qualify(parts, s, cands[s], group, ranged)
                except Refused as exc:  # not damage: an error, never a quiet fallback
                    refused.append(exc)
                    return s, None
                except Exception as exc:  # noqa: BLE001 - never leave the others waiting
                    log.error("[ckpt] dcp restore: step %d: %s", s, exc)
                    seen[s] = None
            if seen[s] is not None:
                return s, seen[s]
        return -1, None

    bound: Optional[int] = None
    while True:
        mine_step, mine = best(bound)
        agreed, anyone_refused = group.reduce([mine_step, -len(refused)], "min")
        if anyone_refused < 0:
            if refused:
                log.error("[ckpt] %s", refused[0])
                raise refused[0]
            raise Refused(
                f"dcp step {mine_step}: another rank refused an item that will not load "
                "(its log says which)"
            )
        if agreed < 0:
            return None
        if group.reduce([1 if mine_step == agreed else 0], "min")[0] == 1:
            assert mine is not None
            for s, other in seen.items():  # keep only the chosen step's verified bytes
                if other is not None and s != agreed:
                    other.cache.clear()
            return SlurmDcpReader(mine, parts, ranged)
        bound = agreed
