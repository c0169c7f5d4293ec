"""The data a job trains on: the loader's position in a checkpoint, so a resumed run sees
the very same batches, and :func:`data_version`, the fingerprint of the data itself.

Why this module exists
----------------------
Restoring the model, the optimizer and the global RNGs is not enough for a resume to be
exact: the run must also continue at the same sample of the same shuffled epoch, and
every random number drawn afterwards must be the one the uninterrupted run drew. A plain
``torch.utils.data.DataLoader`` gets both wrong mid-epoch: its position lives in a
Python iterator no one can save, and each new iterator draws its workers' base seed
(and ``RandomSampler``'s seed) from the *global* torch RNG, so the iterator made after a
resume shifts every later random number - dropout masks included. Nothing fails; the
final weights just differ.

What is kept, in order of preference:

* a loader with ``state_dict()``/``load_state_dict()`` - torchdata's
  ``StatefulDataLoader`` (``pip install torchdata``): its sampler position, its workers'
  base seed and each worker's dataset ``state_dict()``. Resumes bitwise exact with any
  ``num_workers``; a dataset that draws random numbers in its workers (augmentation)
  keeps them exact by returning the worker's RNG state from its ``state_dict()`` (or by
  deriving them from the index), since the loader cannot replay a worker's RNG stream;
* a plain ``DataLoader`` whose sampler (or batch sampler) has ``state_dict()``: the
  sampler's state, plus the loader's ``generator=`` state when it has one;
* anything else: nothing, with a warning (once per process) that says the fix.

A plain ``DataLoader`` without ``generator=`` is warned about (once) even when its
sampler is stateful, because of the global-RNG draw above.

Only this module, :mod:`slurm_ckpt.torch` and :mod:`slurm_ckpt.torch_codec` import torch.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import torch

from slurm_ckpt.errors import CkptError, UnsupportedState
from slurm_ckpt.job.dataversion import fingerprint_files, fingerprint_manifest
from slurm_ckpt.torch_codec import as_tensor

__all__ = ["apply_loader", "capture_loader", "data_version"]

LOADER_FIX = (
    "use torchdata.stateful_dataloader.StatefulDataLoader (pip install torchdata; same "
    "arguments as DataLoader), which keeps its position and its workers' seeds"
)

_warned: set = set()


def _warn_once(kind: str, message: str) -> None:
    if kind in _warned:
        return
    _warned.add(kind)
    warnings.warn(message, UserWarning, stacklevel=4)


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _stateful_sampler(loader: Any) -> Optional[Any]:
    """The sampler of a plain DataLoader that can save its position, if any."""
    for name in ("batch_sampler", "sampler"):
        s = getattr(loader, name, None)
        if s is not None and _stateful(s):
            return s
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return inner if inner is not None and _stateful(inner) else None


def capture_loader(loader: Any) -> Dict[str, Any]:
    """The loader's position as a state tree (see the module docstring)."""
    if _stateful(loader):
        return {"kind": "loader", "state": loader.state_dict()}
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise UnsupportedState(
            f"data loader {type(loader).__name__}: has no state_dict()/load_state_dict(); "
            f"{LOADER_FIX}"
        )
    out: Dict[str, Any] = {"kind": "sampler"}
    gen = loader.generator
    if gen is None:
        _warn_once(
            "global-rng",
            "slurm_ckpt: this DataLoader draws each iterator's seeds from the global torch "
            "RNG, so a resume mid-epoch changes every later random number (dropout, "
            f"augmentation) and the run is not exact: {LOADER_FIX}",
        )
    else:
        out["generator"] = gen.get_state()
    sampler = _stateful_sampler(loader)
    if sampler is None:
        _warn_once(
            "no-position",
            "slurm_ckpt: this DataLoader's sampler has no state_dict(), so its position "
            f"in the epoch is not saved: {LOADER_FIX}, or give it a sampler with "
            "state_dict()/load_state_dict()",
        )
    else:
        out["state"] = sampler.state_dict()
        if getattr(loader, "num_workers", 0) > 0:
            _warn_once(
                "prefetch",
                "slurm_ckpt: with num_workers > 0 a DataLoader's sampler runs ahead of the "
                "batches trained on (prefetching), so its state_dict() is not the position "
                f"reached: {LOADER_FIX}",
            )
    return out


def apply_loader(saved: Dict[str, Any], loader: Any) -> None:
    """Put the position :func:`capture_loader` saved back into ``loader`` (a fresh one,
    built with the same arguments); its next iterator continues there."""
    kind = saved.get("kind")
    if kind == "loader":
        if not _stateful(loader):
            raise UnsupportedState(
                f"the checkpoint holds a stateful loader's position, but "
                f"{type(loader).__name__} has no load_state_dict(): {LOADER_FIX}"
            )
        loader.load_state_dict(saved["state"])
        if hasattr(loader, "_initial_iter_for_state_dict"):
            # StatefulDataLoader: its next iterator draws seeds from the global RNG before
            # it puts the saved ones in place. Make that iterator now - state_dict() does,
            # and the next iter() hands out this one - so the draws happen before
            # apply() restores the RNGs, not after (they would shift every later number).
            loader.state_dict()
        return
    if kind != "sampler":
        raise UnsupportedState(f"data_loader: unknown saved kind {kind!r}")
    if "generator" in saved and getattr(loader, "generator", None) is not None:
        loader.generator.set_state(as_tensor(saved["generator"]).to(torch.uint8).cpu().clone())
    if "state" in saved:
        sampler = _stateful_sampler(loader)
        if sampler is None:
            raise UnsupportedState(
                "the checkpoint holds a sampler position, but this loader's sampler has no "
                "load_state_dict()"
            )
        sampler.load_state_dict(saved["state"])


# ---------------------------------------------------------------------------------------
# data version
# ---------------------------------------------------------------------------------------
_SOURCE_ATTRS = ("files", "paths", "file_paths", "data_files", "filenames", "root", "data_dir")


def data_version(source: Any = None, *, manifest: Any = None) -> str:
    """A fingerprint of the data a job trains on, for ``save(..., data_version=...)`` and
    ``restore(expect_data_version=...)`` (see :mod:`slurm_ckpt.job.dataversion`).

    ``source``: a path or a list of paths (files, directories), or a
    ``torch.utils.data.DataLoader``/``Dataset``: its dataset's ``data_version`` (a string,
    or a method returning one) if it has one, else the paths named by
    ``data_sources()`` or one of the attributes ``files``, ``paths``, ``file_paths``,
    ``data_files``, ``filenames``, ``root``, ``data_dir``. ``manifest``: a data manifest
    the pipeline already has (JSON-able, or its text) instead of the files."""
    if manifest is not None:
        return fingerprint_manifest(manifest)
    if source is None:
        raise CkptError("data_version(): give the data paths, a data loader or manifest=")
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        return fingerprint_files([source])  # type: ignore[list-item]
    dataset = getattr(source, "dataset", source)
    given = getattr(dataset, "data_version", None)
    if given is not None:
        value = given() if callable(given) else given
        if not isinstance(value, str):
            raise CkptError(f"data_version(): the dataset's data_version is {value!r}")
        return value
    if callable(getattr(dataset, "data_sources", None)):
        return fingerprint_files(list(dataset.data_sources()))
    for attr in _SOURCE_ATTRS:
        paths = getattr(dataset, attr, None)
        if paths:
            return fingerprint_files([paths] if isinstance(paths, (str, bytes)) else paths)
    if isinstance(source, (list, tuple)):
        return fingerprint_files(source)
    raise CkptError(
        f"data_version(): cannot find the data sources of {type(dataset).__name__}: pass "
        "the paths, or give the dataset a data_sources() method or a data_version"
    )
