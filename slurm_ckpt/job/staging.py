"""Phase one of a save: snapshot the state into host buffers, fast, then let training go on.

``Checkpointer.save()`` must return as soon as the state is safe from later mutation, not
when it is on disk. So the leaves are copied into *staging buffers*: one page-aligned
buffer per blob of the payload (see :func:`slurm_ckpt.job.state.layout`), laid out
exactly as the blob will be on disk. The background writer hands those very buffers to
:meth:`CheckpointWriter.write_buffers`, so the bytes are copied once (state -> staging)
and written from there: no serialisation copy, no extra pass.

* Buffers are allocated once and reused while the layout is the same (the usual case: a
  training state keeps its shapes), so a save does not pay for page faults each time.
* They are bounded by ``staging_memory_limit`` (0 = auto: ``min(2 x state, 50% of the
  available RAM)``). When the state does not fit, the caller falls back to a synchronous
  write straight from the leaves (:func:`write_direct`) and logs it.
* Big tensors are copied in pieces on several threads (``Tensor.copy_`` and numpy copies
  release the GIL), to approach memory bandwidth rather than one core's copy speed.
* CUDA tensors (only when ``torch.cuda.is_available()``) go to pinned host buffers by
  asynchronous copies on a side stream that first waits for the compute stream; the
  snapshot synchronises that stream before returning, so the state may then be changed.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import psutil

from slurm_ckpt.core.commit import CheckpointWriter
from slurm_ckpt.job.state import TensorLeaf, index_bytes, leaf_bytes

log = logging.getLogger(__name__)

__all__ = ["PIECE", "StagingArea", "auto_limit", "write_direct"]

#: Copies of big tensors are split into pieces of this size, spread over threads.
PIECE = 32 * 2**20


def auto_limit(state_bytes: int) -> int:
    """The automatic staging budget: ``min(2 x state, 50% of available RAM)``."""
    return int(min(2 * state_bytes, psutil.virtual_memory().available // 2))


def _cuda_wanted(tensors: List[TensorLeaf]) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False
    return any(isinstance(t.buffer, torch.Tensor) and t.buffer.is_cuda for t in tensors)


class StagingArea:
    """Reusable host buffers for snapshots, within a memory limit (0 = automatic)."""

    def __init__(self, limit: int = 0, threads: Optional[int] = None) -> None:
        self.limit = int(limit)
        self.threads = threads or max(1, min(8, os.cpu_count() or 1))
        self._bufs: List[Any] = []  # mmap objects or pinned torch tensors
        self._views: List[np.ndarray] = []  # uint8 numpy views of the same memory
        self._sizes: List[int] = []
        self._pinned = False
        self._pool: Optional[ThreadPoolExecutor] = None

    def budget(self, state_bytes: int) -> int:
        return self.limit if self.limit > 0 else auto_limit(state_bytes)

    def ensure(self, sizes: List[int], tensors: List[TensorLeaf]) -> bool:
        """Make buffers of exactly ``sizes`` ready; False when that exceeds the budget
        (or memory cannot be had), in which case the caller writes synchronously."""
        pinned = _cuda_wanted(tensors)
        if sizes == self._sizes and pinned == self._pinned and self._bufs:
            return True
        total = sum(sizes)
        self.release()
        if total > self.budget(total):
            return False
        try:
            for n in sizes:
                self._allocate(n, pinned)
        except (OSError, MemoryError, RuntimeError) as exc:
            log.warning("[ckpt] cannot allocate %d bytes of staging memory: %s", total, exc)
            self.release()
            return False
        self._sizes = list(sizes)
        self._pinned = pinned
        return True

    def _allocate(self, n: int, pinned: bool) -> None:
        if pinned:  # pragma: no cover - needs a GPU
            import torch

            buf = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True)
            view = buf.numpy()[:n]
        else:
            # Anonymous mmap: page-aligned, zero-filled, returned to the OS on release.
            buf = mmap.mmap(-1, max(n, 1))
            view = np.frombuffer(buf, dtype=np.uint8)[:n]
        self._bufs.append(buf)
        self._views.append(view)

    def release(self) -> None:
        """Give the staging memory back (the next save allocates again)."""
        self._views.clear()
        for buf in self._bufs:
            if isinstance(buf, mmap.mmap):
                # A view may still be exported somewhere: then the GC frees it later.
                with contextlib.suppress(BufferError):
                    buf.close()
        self._bufs.clear()
        self._sizes = []
        self._pinned = False

    def close(self) -> None:
        self.release()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-snap")
        return self._pool

    # -- the snapshot ------------------------------------------------------------------
    def snapshot(
        self,
        index: Dict[str, Any],
        tensors: List[TensorLeaf],
        select: Optional[Sequence[bool]] = None,
    ) -> Dict[str, memoryview]:
        """Copy every leaf to its place in the staging buffers; returns ``{blob: view}``.

        :meth:`ensure` must have succeeded for this layout. When this returns, the
        buffers hold the state and nothing refers to the caller's objects any more.
        ``select`` (one flag per leaf) copies only those leaves: the lazy snapshot copies
        the eager ones here and the deferred ones later (:mod:`slurm_ckpt.job.lazy`).
        """
        names = [b["name"] for b in index["blobs"]]
        where = dict(zip(names, self._views))
        pinned = dict(zip(names, self._bufs)) if self._pinned else {}
        big: List[Callable[[], None]] = []
        small: List[Callable[[], None]] = []
        cuda_stream = None
        torch = sys.modules.get("torch")
        flags = select if select is not None else [True] * len(tensors)
        for entry, leaf, wanted in zip(index["tensors"], tensors, flags):
            n = entry["nbytes"]
            if not n or not wanted:
                continue
            dst = where[entry["blob"]][entry["offset"] : entry["offset"] + n]
            obj = leaf.buffer
            if torch is not None and isinstance(obj, torch.Tensor):
                if obj.is_cuda:  # pragma: no cover - needs a GPU
                    if cuda_stream is None:
                        cuda_stream = torch.cuda.Stream(device=obj.device)
                        cuda_stream.wait_stream(torch.cuda.current_stream(obj.device))
                    # Slice the pinned tensor itself (not a numpy alias), so that the
                    # copy is a true asynchronous DMA into page-locked memory.
                    off = entry["offset"]
                    host = pinned[entry["blob"]][off : off + n].view(obj.dtype).reshape(obj.shape)
                    with torch.cuda.stream(cuda_stream):
                        host.copy_(obj.detach(), non_blocking=True)
                    continue
                _plan_torch(torch, dst, obj.detach(), big, small)
            elif isinstance(obj, np.ndarray):
                _plan_numpy(dst, obj, big, small)
            else:
                small.append(_bytes_copy(dst, obj))
        futures = [self._executor().submit(fn) for fn in big] if len(big) > 1 else []
        if len(big) == 1:
            small.append(big[0])
        for fn in small:
            fn()
        for fut in futures:
            fut.result()
        if cuda_stream is not None:  # pragma: no cover - needs a GPU
            cuda_stream.synchronize()
        return {name: memoryview(v) for name, v in zip(names, self._views)}


def _bytes_copy(dst: np.ndarray, obj: Any) -> Callable[[], None]:
    def run() -> None:
        dst[:] = np.frombuffer(obj, dtype=np.uint8)

    return run


def _pieces(n: int) -> List[slice]:
    return [slice(a, min(a + PIECE, n)) for a in range(0, n, PIECE)]


def _plan_numpy(
    dst: np.ndarray, arr: np.ndarray, big: List[Callable[[], None]], small: List[Callable[[], None]]
) -> None:
    if arr.flags.c_contiguous:
        src = arr.reshape(-1).view(np.uint8)
        for sl in _pieces(src.size):
            big.append(lambda sl=sl: np.copyto(dst[sl], src[sl]))
    else:
        # One strided copy straight into place: the staging layout is already contiguous.
        small.append(lambda: np.copyto(dst.view(arr.dtype).reshape(arr.shape), arr))


def _torch_dst(torch: Any, dst: np.ndarray, t: Any) -> Any:
    return torch.from_numpy(dst).view(t.dtype).reshape(t.shape)


def _plan_torch(
    torch: Any,
    dst: np.ndarray,
    t: Any,
    big: List[Callable[[], None]],
    small: List[Callable[[], None]],
) -> None:
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        src = t.reshape(-1).view(torch.uint8)
        d = torch.from_numpy(dst)
        for sl in _pieces(d.numel()):
            big.append(lambda sl=sl: d[sl].copy_(src[sl]))
    else:
        small.append(lambda: _torch_dst(torch, dst, t).copy_(t))


def write_direct(
    writer: CheckpointWriter,
    prefix: str,
    index: Dict[str, Any],
    tensors: List[TensorLeaf],
) -> int:
    """The fallback when staging memory is short: stream every leaf straight from the
    training state into the blobs (synchronous; the caller blocks until it is written).
    Returns the payload bytes written."""
    by_blob: Dict[str, List[Any]] = {b["name"]: [] for b in index["blobs"]}
    for entry, leaf in zip(index["tensors"], tensors):
        by_blob[entry["blob"]].append((entry["offset"], entry["nbytes"], leaf.buffer))
    total = 0
    for blob in index["blobs"]:
        pos = 0
        with writer.open_stream(f"{prefix}/{blob['name']}") as out:
            for off, n, obj in sorted(by_blob[blob["name"]], key=lambda x: x[0]):
                if off > pos:
                    out.write(bytes(off - pos))
                if n:
                    out.write(leaf_bytes(obj))
                pos = off + n
            if blob["nbytes"] > pos:
                out.write(bytes(blob["nbytes"] - pos))
        total += blob["nbytes"]
    data = index_bytes(index)
    writer.write_buffers({f"{prefix}/index.json": data})
    return total + len(data)
