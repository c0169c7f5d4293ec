"""Which data a checkpoint was trained on: a short, stable fingerprint of the sources.

When a model rolls back three days, is the data still that of three days ago? A
checkpoint records the answer (``save(..., data_version=...)``, stored in its manifest),
and a restore compares it with the data the job has now
(``restore(expect_data_version=...)``: warn or refuse).

A data version is any string the user chooses (a dataset release tag, a git commit of
the data repo), or a fingerprint computed here, cheaply, without reading the data:

* of files: every regular file under the given paths (directories recursively), by
  relative name, size and modification time: a file added, removed, rewritten or
  touched changes it (``files:<count>:<hash>``);
* of a manifest the data pipeline already has (a JSON-able mapping or list, or its
  text): its canonical JSON (``manifest:<hash>``).

:func:`slurm_ckpt.torch.data_version` finds the sources of a PyTorch data loader.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Iterable, List, Tuple, Union

import xxhash

from slurm_ckpt.errors import CkptError

__all__ = ["fingerprint_files", "fingerprint_manifest"]

PathLike = Union[str, "os.PathLike[str]"]
#: Files fingerprinted at most (a loader over millions of shards names their manifest).
MAX_FILES = 1_000_000


def _walk(top: str) -> Iterable[Tuple[str, os.stat_result]]:
    st = os.stat(top)
    if stat.S_ISREG(st.st_mode):
        yield os.path.basename(top), st
        return
    if not stat.S_ISDIR(st.st_mode):
        raise CkptError(f"data version: {top} is neither a file nor a directory")
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            try:
                fst = os.stat(path)
            except FileNotFoundError:
                continue  # removed while we looked: it is not part of the data
            if stat.S_ISREG(fst.st_mode):
                yield os.path.relpath(path, top), fst


def fingerprint_files(paths: Iterable[PathLike]) -> str:
    """``files:<count>:<hash>`` over (name, size, mtime) of every file below ``paths``."""
    h = xxhash.xxh3_128()
    count = 0
    tops: List[str] = [os.fspath(p) for p in paths]
    if not tops:
        raise CkptError("data version: no data paths given")
    for i, top in enumerate(tops):
        try:
            items = list(_walk(top))
        except FileNotFoundError:
            raise CkptError(f"data version: {top} does not exist") from None
        except PermissionError:
            raise CkptError(f"data version: {top}: permission denied") from None
        for rel, st in items:
            count += 1
            if count > MAX_FILES:
                raise CkptError(
                    f"data version: more than {MAX_FILES} files under {top}; "
                    "fingerprint the data's manifest instead"
                )
            h.update(f"{i}\0{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"files:{count}:{h.hexdigest()[:24]}"


def fingerprint_manifest(manifest: Any) -> str:
    """``manifest:<hash>`` of a data manifest (JSON-able object, str or bytes)."""
    if isinstance(manifest, bytes):
        data = manifest
    elif isinstance(manifest, str):
        data = manifest.encode()
    else:
        try:
            data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise CkptError(f"data version: the manifest is not JSON-able ({exc})") from None
    return f"manifest:{xxhash.xxh3_128_hexdigest(data)[:24]}"
