"""A torch.distributed.checkpoint (DCP) storage backend over slurm_ckpt's tiers.

::

    ckpt = Checkpointer.from_env(key="run")
    reader = ckpt.dcp_reader()                  # collective; None when there is nothing
    if reader is not None:
        dcp.load(state, storage_reader=reader)  # any world size: DCP's planner reshards
    ...
    fut = dcp.async_save(state, storage_writer=ckpt.dcp_writer(step=step, tokens=tokens))

Save (``dcp.save``, ``dcp.async_save`` in thread or process mode): every rank writes its
items, raw bytes, into one file of its own *part*, a checkpoint of the series
``<key>.dcp.rank<NNNNN>`` on its node's local tier, hashed as written (fsync, manifest
last). Non-coordinator ranks commit their part at the end of ``write_data``; the
coordinator (rank 0) keeps its part open until ``finish``, adds the global metadata -
JSON (:mod:`slurm_ckpt.job.dcp_meta`), never a pickle, which names every part's content
hash - and commits it last. So a step exists once rank 0's part is committed, and it
binds the exact bytes of every other part. The Checkpointer then takes each part through
the ledger, retention and the one flush engine to the warm tier
(:mod:`slurm_ckpt.job.dcp_series`).

Load (:meth:`Checkpointer.dcp_reader`, collective over the process group): the ranks
agree on the newest step every one of them finds whole and sound (a min all-reduce,
repeated until all hold the same step): its metadata verifies, every part is committed
with the hash the metadata names on some tier this rank sees, and the parts assigned to
this rank (part ``p`` to rank ``p % world``) verify byte for byte, their non-tensor items
load with ``weights_only=True``. Those verified bytes are kept for ``read_data``; any
other part a rank's plan needs is read and verified then, from the fastest tier holding
it (local first), falling back to the next tier when a copy does not verify. A step that
fails anywhere is skipped by all ranks together: nothing hangs, nobody mixes steps.

Non-tensor items are loaded with ``torch.load(weights_only=True)`` before the planner
sees them (a pickle that would run code is refused with one line).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import signal
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from slurm_ckpt.core.commit import AlreadyCommitted
from slurm_ckpt.core.fastread import ReadJob, read_files
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.errors import CkptError, NotFound, TierError, VerifyError
from slurm_ckpt.job.dcp_meta import (
    Decoded,
    ItemInfo,
    decode,
    dtype_name,
    encode,
    misfit,
    parse_dtype,
)
from slurm_ckpt.job.dcp_series import notify_committed, part_key
from slurm_ckpt.job.dist import all_reduce_ints
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["METADATA_FILE", "SlurmDcpReader", "SlurmDcpWriter", "select_step"]

METADATA_FILE = "dcp.metadata.json"
STATE_FORMAT = "torch.dcp/slurm_ckpt.1"
#: Items start at multiples of this in a part's data file (aligned tensor views on load).
ALIGN = 64
#: Test hook: ``<label>`` makes the writer SIGTERM its own process there (DCP's
#: process-mode child keeps SIGTERM's default action, as under SLURM).
_SIGNAL_AT = "SLURM_CKPT_DCP_SIGTERM_AT"


def _fault(label: str) -> None:
    if os.environ.get(_SIGNAL_AT) == label:
        os.kill(os.getpid(), signal.SIGTERM)


def _data_file(rank: int) -> str:
    return f"rank-{rank:05d}/dcp.bin"


def _raw(data: Any, item: Any) -> Tuple[memoryview, str, Optional[str], Optional[tuple]]:
    """The bytes of one resolved write item (zero-copy for CPU tensors)."""
    if item.type == WriteItemType.BYTE_IO:
        return memoryview(data.getbuffer()), "bytes", None, None
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    shape = tuple(t.shape)
    if t.numel() == 0:
        return memoryview(b""), "tensor", dtype_name(t.dtype), shape
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()), "tensor", dtype_name(t.dtype), shape


class SlurmDcpWriter(StorageWriter):
    """DCP ``StorageWriter`` that commits each rank's part on its local tier (see the
    module docstring). Made by :meth:`Checkpointer.dcp_writer`; picklable (DCP's process
    mode sends it to its child)."""

    def __init__(
        self,
        tier: Tier,
        user: str,
        key: str,
        step: int,
        *,
        tokens: Optional[int] = None,
        job: Optional[str] = None,
        node: Optional[str] = None,
        meta: Optional[Dict[str, Any]] = None,
        token: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.tier, self.user, self.key, self.step = tier, user, key, step
        self.tokens, self.job, self.node = tokens, job, node
        self.meta = dict(meta or {})
        self.token = token
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self._w: Any = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_w"] = None  # an open tier writer never travels
        return state

    def __del__(self) -> None:
        # Rank 0's part when another rank failed (DCP never called finish): its work
        # directory goes now rather than at the next sweep. Nothing of it was listable.
        w, self._w = self.__dict__.get("_w"), None
        if w is not None:
            with contextlib.suppress(Exception):
                w.abort()

    # -- the StorageWriter protocol ----------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank, self.is_coordinator = int(rank), bool(is_coordinator)
        if kwargs.get("use_collectives") is False:
            # Every rank would write its own metadata: nothing would bind the parts.
            raise CkptError("dcp_writer(): use_collectives=False is not supported")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return plans

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(
            checkpoint_id=f"slurm_ckpt:{self.user}/{self.key}/step-{self.step}",
            save_id=self.save_id,
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # reached through Checkpointer.dcp_writer(), never by a path

    def _open(self) -> Any:
        meta = dict(self.meta)
        meta.update(
            rank=self.rank,
            base_key=self.key,
            state_format=STATE_FORMAT,
            dcp_save_id=self.save_id,
        )
        kw = dict(tokens=self.tokens, job=self.job, node=self.node, meta=meta)
        key = part_key(self.key, self.rank)
        try:
            return self.tier.writer(self.user, key, self.step, **kw)
        except AlreadyCommitted:
            # An abandoned timeline's step (we resumed from an older one): superseded.
            log.warning("[ckpt] dcp step=%d: replacing the older committed part", self.step)
            self.tier.delete(self.user, key, self.step)
            return self.tier.writer(self.user, key, self.step, **kw)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[Any]:
        w = self._open()
        relpath = _data_file(self.rank)
        placed: List[Tuple[Any, int, int, str, Optional[str], Optional[tuple]]] = []
        try:
            with w.open_stream(relpath) as out:
                pos = 0
                for item in plan.items:
                    buf, kind, dtype, shape = _raw(planner.resolve_data(item), item)
                    pad = -pos % ALIGN
                    if pad:
                        out.write(b"\0" * pad)
                        pos += pad
                    out.write(buf)
                    placed.append((item.index, pos, len(buf), kind, dtype, shape))
                    pos += len(buf)
            entry: FileEntry = w._entries[relpath]
            # Every item also names its part's content hash (gathered to rank 0).
            results = [
                WriteResult(
                    index=idx,
                    size_in_bytes=n,
                    storage_data=ItemInfo(
                        self.rank, relpath, p, n, kind, dtype, shape, entry.hash, self.node
                    ),
                )
                for idx, p, n, kind, dtype, shape in placed
            ]
            _fault("before_part_commit")
            if self.is_coordinator:
                self._w = w  # committed in finish(), with the metadata, last
            else:
                w.commit()
                w = None
                notify_committed(self.token, self.step)
        except BaseException:
            if w is not None:
                w.abort()
            raise
        fut: Future[Any] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        w, self._w = self._w, None
        if w is None:
            raise CkptError(f"dcp step={self.step}: finish() without write_data() on rank 0")
        try:
            items: Dict[MetadataIndex, ItemInfo] = {}
            parts: Dict[int, Dict[str, Any]] = {}
            for rank in range(len(results)):
                parts[rank] = {"file": None, "hash": None, "node": None}
            for wrs in results:
                for wr in wrs:
                    info: ItemInfo = wr.storage_data
                    items[wr.index] = info
                    parts[info.rank] = {
                        "file": info.file,
                        "hash": info.part_hash,
                        "node": info.node,
                    }
            if metadata.version is None:
                from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

                metadata.version = CURRENT_DCP_VERSION
            metadata.storage_meta = self.storage_meta()
            w.write_buffers({METADATA_FILE: encode(metadata, items, parts)})
            _fault("before_metadata_commit")
            w.commit()
        except BaseException:
            w.abort()
            raise
        notify_committed(self.token, self.step)


# ---------------------------------------------------------------------------- loading
def safe_load(raw: Any, what: str) -> Any:
    """A non-tensor item, unpickled with ``weights_only=True`` (one-line refusal)."""
    try:
        return torch.load(io.BytesIO(bytes(raw)), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise VerifyError(
            f"{what}: refused: not loadable with weights_only=True (a pickle that would run "
            f"code?): {first}"
        ) from None


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

    def _note_bad(self, tier: Tier, key: str, step: int, exc: BaseException) -> None:
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
            where = tier.where(self.user, key, step)
            try:
                with tier.reader(self.user, key, step) as tr:
                    entry = tr.manifest.file(relpath)
                    if entry.hash != want:
                        raise VerifyError(f"{where}: {relpath} is not the part the metadata names")
                    src = tr.open(relpath)
                    try:
                        fd = src.fileno()
                        job = ReadJob(relpath, entry, fd, None if fd is not None else src)
                        buf = read_files([job], tr.manifest.chunk_size, where=where)[0]
                    finally:
                        src.close()
                return tier.name, memoryview(buf)[: entry.size]
            except KeyError:
                self._note_bad(tier, key, step, VerifyError(f"{where}: no {relpath}"))
            except (VerifyError, TierError, NotFound, OSError) as exc:
                self._note_bad(tier, key, step, exc)
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

    def __init__(self, chosen: _Step, parts: _Parts) -> None:
        super().__init__()
        self.chosen, self._parts = chosen, parts
        self.step, self.tokens = chosen.step, chosen.tokens
        #: Part rank -> tier name each part was read from (for logs and tests).
        self.read_from: Dict[int, str] = {}
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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[Any]:
        by_part: Dict[int, List[Any]] = {}
        for req in plan.items:
            by_part.setdefault(self.storage[req.storage_index].rank, []).append(req)
        for rank in sorted(by_part):
            buf = self._part(rank)
            for req in by_part[rank]:
                info = self.storage[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    raw = buf[info.pos : info.pos + info.nbytes]
                    obj = safe_load(raw, f"dcp step {self.step}: {req.storage_index.fqn}")
                    safe = io.BytesIO()
                    torch.save(obj, safe)  # our own pickle of weights_only-loaded objects
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


def _group() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _qualify(parts: _Parts, step: int, holders0: List[Tuple[Tier, Manifest]]) -> Optional[_Step]:
    """``step`` as this rank sees it, or None when it is not whole and sound here."""
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
            parts._note_bad(tier, key0, step, exc)
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
    me, world = _group()
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
            if item.rank == r and item.kind == "bytes":
                try:
                    safe_load(got[1][item.pos : item.pos + item.nbytes], idx.fqn)
                except VerifyError as exc:
                    log.error("[ckpt] dcp restore: step %d: %s", step, exc)
                    return None
    return chosen


def select_step(
    tiers: Sequence[Tier],
    user: str,
    key: str,
    *,
    step: Optional[int] = None,
    mark_bad: Any = None,
) -> Optional[SlurmDcpReader]:
    """Agree with every rank on the newest step all of them find whole and sound (see
    the module docstring); a reader for it, or None when there is none. Collective."""
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

    def best(bound: Optional[int]) -> Optional[_Step]:
        for s in order:
            if bound is not None and s > bound:
                continue
            if s not in seen:
                try:
                    seen[s] = _qualify(parts, s, cands[s])
                except Exception as exc:  # noqa: BLE001 - never leave the others waiting
                    log.error("[ckpt] dcp restore: step %d: %s", s, exc)
                    seen[s] = None
            if seen[s] is not None:
                return seen[s]
        return None

    bound: Optional[int] = None
    while True:
        mine = best(bound)
        mine_step = -1 if mine is None else mine.step
        agreed = all_reduce_ints([mine_step], "min")[0]
        if agreed < 0:
            return None
        if all_reduce_ints([1 if mine_step == agreed else 0], "min")[0] == 1:
            assert mine is not None
            for s, other in seen.items():  # keep only the chosen step's verified bytes
                if other is not None and s != agreed:
                    other.cache.clear()
            return SlurmDcpReader(mine, parts)
        bound = agreed
