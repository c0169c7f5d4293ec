"""The lazy snapshot: ``save()`` returns before the big tensors are copied.

Why: an eager snapshot blocks training for one memory copy of the state (the memcpy
floor: seconds of device-to-host traffic per save on a GPU node with tens of GB per
rank). Between the end of one ``optimizer.step()`` and the start of the next, the
parameters and the optimizer state do not change, so their copy can run *during* the
next forward and backward pass; only the next optimizer step has to wait for it
(DataStates-LLM, ByteCheckpoint).

How it stays exact:

* ``save(..., lazy=pred)`` splits the leaves: those ``pred`` accepts (the caller vouches
  that they change only through guarded paths: for :class:`slurm_ckpt.torch.TorchCheckpointer`
  the parameters and the optimizer state, which change only in ``optimizer.step()`` and
  ``load_state_dict``) are *deferred*; every other leaf - buffers such as BatchNorm's
  running statistics, which the forward pass updates in place, RNG states, small
  tensors - is copied before ``save()`` returns, as before.
* A :class:`Drain` copies the deferred leaves on a background thread into the same
  staging buffers (the copy itself is spread over the staging area's threads; CUDA
  tensors go by a side stream into pinned buffers).
* The guarded paths wait for the drain: TorchCheckpointer registers optimizer step
  pre-hooks and ``load_state_dict`` pre-hooks that call :meth:`Drain.wait`.
* Anything else that writes a deferred tensor in place before the drain ends is
  detected by the tensor's version counter (bumped by every in-place op autograd sees,
  e.g. ``with torch.no_grad(): p.copy_(x)``): the drain then refuses the checkpoint
  (:class:`SnapshotTorn`, a failed save: nothing is committed, the previous checkpoint
  stays the newest) rather than commit values that are neither the old ones nor the
  new. Writes through ``p.data`` bypass version counters: call
  ``Checkpointer.wait_snapshot()`` before them.
* The local write starts only once the drain is complete, so a SIGKILL during the drain
  leaves at most an uncommitted ``.tmp-*`` that the next start sweeps.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.state import TensorLeaf

__all__ = ["Drain", "SnapshotTorn", "defer_mask"]

#: Leaves smaller than this are copied eagerly even when deferrable: their copy costs
#: less than the bookkeeping.
MIN_DEFERRED_BYTES = 64 * 1024


class SnapshotTorn(CkptError):
    """A deferred tensor was written in place before its copy ended: checkpoint refused."""


def _nbytes(leaf: TensorLeaf) -> int:
    obj = leaf.buffer
    try:
        return int(obj.numel() * obj.element_size())
    except AttributeError:
        return int(getattr(obj, "nbytes", 0) or len(obj))


def defer_mask(tensors: Sequence[TensorLeaf], pred: Callable[[Any], bool]) -> List[bool]:
    """Which leaves the drain copies later: torch tensors ``pred`` accepts, big enough."""
    torch = sys.modules.get("torch")
    out = []
    for leaf in tensors:
        obj = leaf.buffer
        ok = (
            torch is not None
            and isinstance(obj, torch.Tensor)
            and _nbytes(leaf) >= MIN_DEFERRED_BYTES
            and bool(pred(obj))
        )
        out.append(ok)
    return out


class Drain:
    """The background copy of one save's deferred leaves (see the module docstring)."""

    def __init__(
        self,
        copy: Callable[[], Dict[str, memoryview]],
        tensors: Sequence[TensorLeaf],
        mask: Sequence[bool],
    ) -> None:
        self._copy = copy
        self._watch = [(t.name, t.buffer, t.buffer._version) for t, m in zip(tensors, mask) if m]
        self.deferred_bytes = sum(_nbytes(t) for t, m in zip(tensors, mask) if m)
        self._done = threading.Event()
        self._views: Optional[Dict[str, memoryview]] = None
        self._error: Optional[BaseException] = None
        self.copy_s: Optional[float] = None
        self.waited_s = 0.0
        self.waits = 0
        self._thread = threading.Thread(target=self._run, name="ckpt-drain", daemon=True)

    def start(self) -> Drain:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            views = self._copy()
            changed = [name for name, t, v in self._watch if t._version != v]
            if changed:
                more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
                raise SnapshotTorn(
                    f"the snapshot was refused: {changed[0]}{more} was written in place "
                    "before its background copy ended; call Checkpointer.wait_snapshot() "
                    "before writing parameters or optimizer state outside optimizer.step()"
                )
            self._views = views
        except BaseException as exc:  # noqa: BLE001 - handed to the writer thread
            self._error = exc
        finally:
            self.copy_s = time.monotonic() - t0
            self._watch = []  # drop the references to the live tensors
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> float:
        """Block until the copy is complete; returns the seconds this call waited."""
        if self._done.is_set():
            return 0.0
        t0 = time.monotonic()
        self._done.wait()
        waited = time.monotonic() - t0
        self.waited_s += waited
        self.waits += 1
        return waited

    def result(self) -> Dict[str, memoryview]:
        """The staging views holding the whole snapshot, or the drain's error."""
        self.wait()
        if self._error is not None:
            raise self._error
        assert self._views is not None
        return self._views
