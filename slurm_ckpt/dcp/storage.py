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
JSON (:mod:`slurm_ckpt.dcp.meta`), never a pickle, which names every part's content
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
import logging
import os
import signal
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from slurm_ckpt.core.commit import AlreadyCommitted
from slurm_ckpt.core.lease import LeaseRecord, check_generation
from slurm_ckpt.core.manifest import FileEntry
from slurm_ckpt.dcp.meta import ItemInfo, dtype_name, encode
from slurm_ckpt.dcp.reading import (
    METADATA_FILE,
    Group,
    Refused,
    SlurmDcpReader,
    safe_load,
    select_step,
)
from slurm_ckpt.dcp.values import Unstorable, encode_value
from slurm_ckpt.errors import CkptError, VerifyError
from slurm_ckpt.job.dcp_series import notify_committed, part_key
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = [
    "METADATA_FILE",
    "Group",
    "Refused",
    "SlurmDcpReader",
    "SlurmDcpWriter",
    "select_step",
]

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


def _tensor_raw(data: Any) -> Tuple[memoryview, str, Optional[str], Optional[tuple]]:
    """The bytes of one resolved tensor item (zero-copy for CPU tensors)."""
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    shape = tuple(t.shape)
    if t.numel() == 0:
        return memoryview(b""), "tensor", dtype_name(t.dtype), shape
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()), "tensor", dtype_name(t.dtype), shape


def _lookup(planner: SavePlanner, item: Any) -> Any:
    """The non-tensor value behind a BYTE_IO write item. DCP's default planner (and
    every planner built on it) has ``lookup_object``; for another one the value comes
    back from the planner's own pickle, made a moment ago in this process from the
    user's own state (nothing loaded here comes from storage)."""
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        return lookup(item.index)
    data = planner.resolve_data(item)
    data.seek(0)
    return torch.load(data, map_location="cpu", weights_only=False)


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
        fence: Optional[Tuple[str, int]] = None,
    ) -> None:
        super().__init__()
        #: ``(series key, generation)`` of the writer's lease: every part's commit checks
        #: that no newer writer took the series over (job/lease.py), as save() does.
        self.fence = fence
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
        if self.fence is not None:
            meta["generation"] = self.fence[1]
        kw = dict(tokens=self.tokens, job=self.job, node=self.node, meta=meta)
        key = part_key(self.key, self.rank)
        try:
            return self.tier.writer(self.user, key, self.step, **kw)
        except AlreadyCommitted:
            # An abandoned timeline's step (we resumed from an older one): superseded.
            log.warning("[ckpt] dcp step=%d: replacing the older committed part", self.step)
            self.tier.delete(self.user, key, self.step)
            return self.tier.writer(self.user, key, self.step, **kw)

    def _check_fence(self) -> None:
        """StaleGeneration when a newer writer holds the series (read from the local
        tier's lease record: this may run in DCP's save process, not the trainer's)."""
        if self.fence is None:
            return
        key, mine = self.fence
        read = getattr(self.tier, "read_lease", None)
        data = read(self.user, key) if read is not None else None
        rec = None if data is None else LeaseRecord.from_bytes(data)
        check_generation(rec, mine, self.tier.where(self.user, key))

    def _value(self, planner: SavePlanner, item: Any) -> Tuple[memoryview, str]:
        """A non-tensor item as data (:mod:`slurm_ckpt.dcp.values`), else as the
        planner's pickle when ``weights_only=True`` loads it (classes registered with
        ``add_safe_globals``); anything else fails the save now, in one line, rather
        than leaving a step that no load will take."""
        fqn = item.index.fqn
        try:
            return memoryview(encode_value(_lookup(planner, item))), "value"
        except Unstorable as exc:
            data = planner.resolve_data(item)
            raw = memoryview(data.getbuffer())
            try:
                safe_load(raw, fqn)
            except VerifyError:
                at = f" (at {exc.where})" if exc.where else ""
                msg = (
                    f"dcp_writer(): step {self.step}: item {fqn!r} holds a {exc.what}{at}, "
                    "which no load with weights_only=True takes: save it as tensors, numbers, "
                    "strings, bytes, lists, dicts or numpy arrays (e.g. its state_dict()), or "
                    "register its class with torch.serialization.add_safe_globals()"
                )
                log.error("[ckpt] %s", msg)
                raise CkptError(msg) from None
            return raw, "bytes"

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[Any]:
        w = self._open()
        relpath = _data_file(self.rank)
        placed: List[Tuple[Any, int, int, str, Optional[str], Optional[tuple]]] = []
        try:
            with w.open_stream(relpath) as out:
                pos = 0
                for item in plan.items:
                    if item.type == WriteItemType.BYTE_IO:
                        buf, kind = self._value(planner, item)
                        dtype, shape = None, None
                    else:
                        buf, kind, dtype, shape = _tensor_raw(planner.resolve_data(item))
                    pad = -pos % ALIGN
                    if pad:
                        out.write(b"\0" * pad)
                        pos += pad
                    out.write(buf)
                    placed.append((item.index, pos, len(buf), kind, dtype, shape))
                    pos += len(buf)
            entry: FileEntry = next(e for e in w.written() if e.path == relpath)
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
                self._check_fence()
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
            self._check_fence()
            w.commit()
        except BaseException:
            w.abort()
            raise
        notify_committed(self.token, self.step)
