"""What a save hands its local write: exactly one of four kinds of bytes, typed.

A :class:`~slurm_ckpt.job.bookkeeping.SaveRecord` once carried four ``Any`` fields
(staging buffers, the tensors themselves, a lazy drain, a prepared directory) of which
one was set, and the writer guessed which from the ``None``\\ s. A payload is now one
frozen value of one of these kinds, and the writer dispatches on its type:

* :class:`Staged`: the snapshot in the staging buffers (the usual ``save()``);
* :class:`Lazy`: a snapshot whose copy is still running (``save(lazy=...)``); the
  writer waits for it and writes what it staged;
* :class:`Direct`: a state too large for the staging memory, written straight from the
  tensors on the caller's thread (a synchronous save);
* :class:`Prepared`: a directory of files already in an open writer of the local tier
  (``output()``/``adopt()``), hashed and committed by the writer thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Protocol, Union

from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.job.lazy import Drain
from slurm_ckpt.job.state import TensorLeaf

__all__ = ["Direct", "Lazy", "Payload", "Prepared", "PreparedFiles", "Staged"]


class PreparedFiles(Protocol):
    """A directory of files in an open local-tier writer
    (:class:`slurm_ckpt.job.output.PreparedDir`; a protocol, since that module builds
    save records itself)."""

    def commit(self) -> Manifest: ...

    def abort(self) -> None: ...


@dataclass(frozen=True)
class Staged:
    """The snapshot in the staging buffers: ``{blob name: view}`` (the index is the
    record's ``index_data``)."""

    views: Dict[str, memoryview]


@dataclass(frozen=True)
class Lazy:
    """A lazy snapshot: its background copy (:mod:`slurm_ckpt.job.lazy`) ends in a
    :class:`Staged` payload before anything is written."""

    drain: Drain


@dataclass(frozen=True)
class Direct:
    """A state written straight from its tensors (it did not fit the staging memory)."""

    index: Dict[str, Any]
    tensors: List[TensorLeaf]


@dataclass(frozen=True)
class Prepared:
    """A directory checkpoint whose files are already in the local tier's writer."""

    files: PreparedFiles


#: What a save's local write writes.
Payload = Union[Staged, Lazy, Direct, Prepared]
