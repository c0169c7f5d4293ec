"""``seal DIR``: our manifest on a checkpoint directory another tool wrote (issue 34, item 2).

Trainers mostly write their checkpoints themselves: ``torch.distributed.checkpoint``
(``.metadata`` + ``__N_M.distcp``), the HF Trainer (``checkpoint-N/``), Lightning
(``*.ckpt`` files in its ``dirpath``), Orbax (a step directory). None of them records
what its bytes were, so a flipped bit or a truncated copy is found only when a restore
crashes, or never. ``seal`` writes the manifest our own checkpoints carry - every file's
size, per-chunk xxh3-128 digests, a checksum over the manifest itself - into the
directory, as ``manifest.json``, last and atomically (temp file, fsync, rename, fsync of
the directory), after every file and directory is fsynced. From then on ``ckpt-slurm
verify DIR`` checks it anywhere (a copy to scratch, a restore from tape), and names the
file and the byte range of each chunk that differs.

A directory that is still being written is refused, never sealed half-way:

* a format's own sign of an unfinished save: DCP shards without ``.metadata`` (DCP
  writes it last; without collectives a rank's ``__R.metadata``) or a
  ``*.metadata.tmp``; an HF ``checkpoint-N`` without its
  ``trainer_state.json`` (the Trainer writes it last), or its ``tmp-checkpoint-N``;
  an Orbax ``*.orbax-checkpoint-tmp-*`` directory;
* any file open for writing by a process (``/proc/*/fd``: root sees every process, a
  user their own; :mod:`~slurm_ckpt.core.writers`);
* any file whose size, mtime or ctime changed between the listing before hashing and
  the one after, and any file that came or went in between.

The manifest names a user (the directory's owner), a key (``--key``, default
:data:`DEFAULT_KEY`) and a step (``--step``, default the number that ends the
directory's name: ``checkpoint-500`` -> 500, Orbax's ``1000`` -> 1000; else 0), and
``meta.sealed`` says which tool wrote the directory. A Lightning checkpoint is one
file: seal the directory that holds it (its ``dirpath``); a file given to ``seal`` is
refused with that hint, because a manifest beside a lone file in a directory of others
would list the others as "not in the manifest" on every verify.

Root may seal a user's directory: the listing and the ``/proc`` scan run as root (to
see every writer), the reading, hashing and the manifest's commit as the directory's
owner (a child process, :mod:`~slurm_ckpt.node.asuser`), so the manifest is the owner's
like the files it describes, and no link planted in the directory lets root read or
write what the owner could not.
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import socket
import stat
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.chunks import ShortRead, hash_range, run_chunks
from slurm_ckpt.core.hashing import DEFAULT_CHUNK_SIZE, combine
from slurm_ckpt.core.manifest import MANIFEST_NAME, FileEntry, Manifest
from slurm_ckpt.core.manifest_limits import limits
from slurm_ckpt.core.names import node_name, validate_key, validate_relpath, validate_user
from slurm_ckpt.core.progress import ProgressFn, report
from slurm_ckpt.core.writers import open_writers
from slurm_ckpt.errors import CkptError, InvalidName

__all__ = [
    "DEFAULT_KEY",
    "SEALED_META",
    "SealRefused",
    "Sealed",
    "detect_format",
    "seal_dir",
    "step_from_name",
    "unfinished",
]

#: The key a sealed directory's manifest names when ``--key`` is not given.
DEFAULT_KEY = "sealed"
#: ``meta`` key of a sealed directory's manifest: the tool that wrote it.
SEALED_META = "sealed"
#: Deepest directory nesting sealed (HF DeepSpeed's ``global_stepN/`` is one level).
MAX_DEPTH = 32

#: Root's seal of a user's directory gives up on its child (running as the owner) after
#: this long without a sign of life (listing, one chunk hashed, the commit).
CHILD_STALL_S = 300.0

#: What Orbax names a step directory while it is being written (renamed when done).
ORBAX_TMP = ".orbax-checkpoint-tmp"

_TRAILING_NUMBER = re.compile(r"(\d+)$")
_HF_DIR = re.compile(r"checkpoint-\d+")


class SealRefused(CkptError):
    """The directory cannot be sealed (now): missing, not a directory, no permission, a
    writer still at work, files ``verify`` would refuse. One line; exit status 1."""


@dataclass
class Sealed:
    """What ``seal`` committed."""

    path: str
    fmt: str
    manifest: Manifest
    seconds: float


def step_from_name(name: str) -> int:
    """The step a directory's name ends with (``checkpoint-500``, ``step_100``, Orbax's
    ``1000``), else 0."""
    m = _TRAILING_NUMBER.search(name)
    return int(m.group(1)) if m else 0


def detect_format(base: str, names: Set[str]) -> str:
    """Which tool wrote a directory, from its name and its top-level entries ``names``:
    ``dcp``, ``hf``, ``orbax``, ``lightning`` or ``dir`` (anything else)."""
    if any(n.endswith((".distcp", ".metadata", ".metadata.tmp")) for n in names):
        return "dcp"
    if _HF_DIR.fullmatch(base) or "trainer_state.json" in names:
        return "hf"
    if "_CHECKPOINT_METADATA" in names or "_METADATA" in names:
        return "orbax"
    if any(n.endswith(".ckpt") for n in names):
        return "lightning"
    return "dir"


def unfinished(base: str, fmt: str, names: Set[str]) -> Optional[str]:
    """Why a directory of format ``fmt`` is still being written, by that tool's own
    signs (see the module docstring), or None."""
    if ORBAX_TMP in base:
        return "an Orbax temporary directory (Orbax renames it when the save is done)"
    if base.startswith("tmp-checkpoint-"):
        return "an HF Trainer temporary directory (renamed to checkpoint-N when done)"
    if fmt == "dcp":
        return _dcp_unfinished(names)
    if fmt == "hf" and _HF_DIR.fullmatch(base) and "trainer_state.json" not in names:
        return "no trainer_state.json (the HF Trainer writes it last)"
    return None


_DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
_DCP_RANK_METADATA = re.compile(r"__(\d+)\.metadata")


def _dcp_unfinished(names: Set[str]) -> Optional[str]:
    """DCP's ``FileSystemWriter.finish`` writes ``.metadata.tmp`` and renames it to
    ``.metadata`` once every shard is written (without collectives, each rank its own
    ``__R.metadata``): a temporary one, or a rank's shards without a metadata file
    that covers them, is a save in progress."""
    tmp = sorted(n for n in names if n.endswith(".metadata.tmp"))
    if tmp:
        return f"DCP is writing its metadata ({tmp[0]} is there)"
    if ".metadata" in names:
        return None
    ranks = {int(m.group(1)) for m in map(_DCP_SHARD.fullmatch, names) if m}
    have = {int(m.group(1)) for m in map(_DCP_RANK_METADATA.fullmatch, names) if m}
    if not have:
        return "DCP shards without .metadata (DCP writes .metadata last)"
    missing = sorted(ranks - have)
    if missing:
        return f"DCP shards of rank {missing[0]} without its __{missing[0]}.metadata (written last)"
    return None


# ---------------------------------------------------------------------- the path
def _lstat(path: str) -> os.stat_result:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SealRefused(f"{path}: no such file or directory") from None
    except PermissionError:
        raise SealRefused(
            f"{path}: permission denied (a directory on the way is not searchable)"
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise SealRefused(f"{path}: is a symlink; symlinks are never followed: give the directory")
    if stat.S_ISREG(st.st_mode) and path.endswith(".ckpt"):
        raise SealRefused(
            f"{path}: is a file: seal the directory that holds it (Lightning's dirpath): "
            f"ckpt-slurm seal {os.path.dirname(path) or '.'}"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise SealRefused(f"{path}: not a directory (seal a checkpoint directory)")
    return st


def _open_dir(path: str) -> int:
    try:
        return os.open(path, fsio.O_DIR)
    except PermissionError:
        raise SealRefused(f"{path}: permission denied (run as its owner or root)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SealRefused(f"{path}: is a symlink; symlinks are never followed") from None
        raise SealRefused(f"{path}: {exc.strerror or exc}") from None


Listing = Dict[str, Tuple[int, int, int, int, int]]


def _listing(dfd: int, path: str) -> Listing:
    """Every regular file below ``dfd``: relpath -> (size, mtime_ns, ctime_ns, dev, ino);
    anything that is not a regular file or a directory is refused."""
    try:
        files, problems = fsio.walk_files(
            dfd, max_entries=limits().max_entries, max_depth=MAX_DEPTH
        )
    except PermissionError:
        raise SealRefused(f"{path}: permission denied listing its files") from None
    except FileNotFoundError:
        raise SealRefused(f"{path}: a file went away while listing: still being written") from None
    if problems:
        raise SealRefused(f"{path}: {problems[0]} (a sealed directory holds regular files only)")
    return {rel: _sig(st) for rel, st in files}


def _check_writers(path: str, listing: Listing, skip: Tuple[int, ...] = ()) -> None:
    idents = {(v[3], v[4]): rel for rel, v in listing.items()}
    found = open_writers(idents, skip)
    if found:
        w = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise SealRefused(
            f"{path}: still being written: {w.name} is open for writing by process "
            f"{w.pid}{more}; seal it once the writer is done"
        )


def _precheck(dfd: int, path: str) -> Tuple[str, Listing]:
    """Everything that can be refused before a byte is read: no manifest yet, files
    only, names a manifest can hold, no format sign of a save in progress."""
    base = os.path.basename(path.rstrip("/"))
    owner = os.fstat(dfd).st_uid
    if os.geteuid() not in (0, owner):
        raise SealRefused(
            f"{path}: owned by uid {owner}: seal it as its owner or root (verify reads "
            "only a manifest of the directory's owner)"
        )
    try:
        data = fsio.read_small(dfd, MANIFEST_NAME)
    except FileNotFoundError:
        pass
    except PermissionError:
        raise SealRefused(f"{path}: permission denied (run as its owner or root)") from None
    except OSError as exc:
        raise SealRefused(f"{path}/{MANIFEST_NAME}: {exc.strerror or exc}") from None
    else:
        try:
            Manifest.from_bytes(data, path)
        except CkptError:
            raise SealRefused(
                f"{path}: holds a {MANIFEST_NAME} that is not slurm_ckpt's: it cannot be "
                "sealed in place (copy the directory, then seal the copy)"
            ) from None
        raise SealRefused(
            f"{path}: already sealed ({MANIFEST_NAME} is there): check it with "
            f"ckpt-slurm verify {path}"
        )
    listing = _listing(dfd, path)
    if not listing:
        raise SealRefused(f"{path}: no files to seal")
    top = {rel.split("/", 1)[0] for rel in listing}
    fmt = detect_format(base, top)
    why = unfinished(base, fmt, top)
    inner = sorted(r for r in listing if ORBAX_TMP in r.rsplit("/", 1)[0] and "/" in r)
    if not why and inner:
        why = f"an Orbax temporary directory inside it ({inner[0].rsplit('/', 1)[0]})"
    if why:
        raise SealRefused(f"{path}: still being written: {why}")
    for rel in listing:
        try:
            validate_relpath(rel)
        except InvalidName:
            if rel.startswith(f".{MANIFEST_NAME}{fsio.TMP_MARK}"):
                raise SealRefused(
                    f"{path}/{rel}: the temporary manifest of a seal that was interrupted: "
                    "remove it and seal again"
                ) from None
            raise SealRefused(
                f"{path}/{rel}: a name slurm_ckpt keeps for itself (a temporary file of "
                "a writer still at work?)"
            ) from None
    return fmt, listing


# ---------------------------------------------------------------------- hashing
#: Files open at once while hashing (a directory of 100,000 files must not hit EMFILE).
BATCH_FILES = 256


def _hash_all(
    dfd: int,
    path: str,
    before: Listing,
    chunk_size: int,
    streams: int,
    progress: Optional[ProgressFn],
) -> List[FileEntry]:
    """Hash every file (chunks in parallel, :data:`BATCH_FILES` files at a time), fsync
    it, and refuse any that changed."""
    rels = sorted(before)
    entries: List[FileEntry] = []
    try:
        for at in range(0, len(rels), BATCH_FILES):
            entries += _hash_batch(
                dfd, path, before, rels[at : at + BATCH_FILES], chunk_size, streams, progress
            )
        return entries
    except fsio.UnsafeFile as exc:
        raise SealRefused(
            f"{path}: {exc.strerror} (verify refuses such files: give the file a single "
            "link, owned by the directory's owner)"
        ) from None
    except ShortRead:
        raise SealRefused(f"{path}: still being written: a file shrank while hashing") from None
    except FileNotFoundError as exc:
        raise SealRefused(f"{path}: still being written: a file went away ({exc})") from None
    except PermissionError:
        raise SealRefused(f"{path}: permission denied reading its files") from None


def _hash_batch(
    dfd: int,
    path: str,
    before: Listing,
    rels: List[str],
    chunk_size: int,
    streams: int,
    progress: Optional[ProgressFn],
) -> List[FileEntry]:
    fds: List[int] = []
    try:
        for rel in rels:
            parts = rel.split("/")
            pfd = fsio.open_beneath(dfd, parts[:-1])
            try:
                fd, st = fsio.open_regular(pfd, parts[-1])
            finally:
                os.close(pfd)
            fds.append(fd)
            if _sig(st) != before[rel]:
                raise SealRefused(f"{path}: still being written: {rel} changed while listing")

        def op(fi: int, _ci: int, off: int, n: int) -> str:
            digest = hash_range(fds[fi], off, n)
            report(progress, n)
            return digest

        digests = run_chunks([before[r][0] for r in rels], chunk_size, op, lambda _i: None, streams)
        entries = []
        for rel, fd, chunks in zip(rels, fds, digests):
            os.fsync(fd)
            if _sig(os.fstat(fd)) != before[rel]:
                raise SealRefused(f"{path}: still being written: {rel} changed while hashing")
            entries.append(FileEntry(rel, before[rel][0], combine(chunks), chunks))
        return entries
    finally:
        for fd in fds:
            os.close(fd)


def _sig(st: os.stat_result) -> Tuple[int, int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)


def _sync_dirs(dfd: int, rels: List[str]) -> None:
    """fsync every directory that holds a file, deepest first, the top one last: the
    names must be durable before the manifest that lists them."""
    dirs = {
        "/".join(p[:i]) for p in (r.split("/")[:-1] for r in rels) for i in range(1, len(p) + 1)
    }
    for d in sorted(dirs, key=len, reverse=True):
        fd = fsio.open_beneath(dfd, d.split("/"))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.fsync(dfd)


def _commit(dfd: int, path: str, m: Manifest) -> None:
    """Write the manifest last and atomically (temp file, fsync, rename, fsync of the
    directory: :func:`~slurm_ckpt.core.fsio.atomic_replace`), not over one that
    appeared since the listing."""
    try:
        os.stat(MANIFEST_NAME, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        # Readable by whoever may read the directory (not by the umask of the moment).
        mode = 0o600 | (os.fstat(dfd).st_mode & 0o044)
        fsio.atomic_replace(dfd, MANIFEST_NAME, m.to_bytes(), mode)
        return
    raise SealRefused(f"{path}: already sealed (a {MANIFEST_NAME} appeared meanwhile)")


def _seal_open(
    dfd: int,
    path: str,
    key: str,
    step: Optional[int],
    chunk_size: int,
    streams: int,
    progress: Optional[ProgressFn],
    skip: Tuple[int, ...] = (),
) -> Dict[str, Any]:
    """Seal the open directory ``dfd`` (as whoever runs this: its owner)."""
    fmt, before = _precheck(dfd, path)
    _check_writers(path, before, skip)
    entries = _hash_all(dfd, path, before, chunk_size, streams, progress)
    after = _listing(dfd, path)
    if after != before:
        changed = sorted(set(after) ^ set(before)) or sorted(
            r for r in after if after[r] != before[r]
        )
        raise SealRefused(f"{path}: still being written: {changed[0]} changed while sealing")
    _check_writers(path, after, skip)
    _sync_dirs(dfd, sorted(after))
    owner = os.fstat(dfd).st_uid
    m = Manifest(
        user=_owner_name(owner),
        key=key,
        step=step_from_name(os.path.basename(path.rstrip("/"))) if step is None else step,
        files=entries,
        job=os.environ.get("SLURM_JOB_ID") or None,
        node=node_name(socket.gethostname()),
        meta={SEALED_META: fmt},
        chunk_size=chunk_size,
    )
    _commit(dfd, path, m)
    return {"fmt": fmt, "manifest": m.to_bytes().decode()}


def _owner_name(uid: int) -> str:
    try:
        return validate_user(pwd.getpwuid(uid).pw_name)
    except (KeyError, InvalidName):
        raise SealRefused(f"uid {uid} (the directory's owner) has no usable user name") from None


def seal_dir(
    target: str,
    key: str = DEFAULT_KEY,
    step: Optional[int] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    streams: int = 4,
    progress: Optional[ProgressFn] = None,
) -> Sealed:
    """Seal the directory ``target`` in place (see the module docstring); SealRefused
    with one line when it cannot be."""
    t0 = time.monotonic()
    validate_key(key)
    if step is not None and (isinstance(step, bool) or step < 0):
        raise SealRefused(f"--step must be a whole number >= 0, got {step!r}")
    path = os.path.abspath(target)
    st = _lstat(path)
    dfd = _open_dir(path)
    try:
        if os.geteuid() == 0 and st.st_uid != 0:
            out = _seal_as_owner(dfd, path, st, key, step, chunk_size, streams)
        else:
            out = _seal_open(dfd, path, key, step, chunk_size, streams, progress)
    finally:
        os.close(dfd)
    m = Manifest.from_bytes(out["manifest"].encode(), f"{path}/{MANIFEST_NAME}")
    return Sealed(path, str(out["fmt"]), m, time.monotonic() - t0)


def _seal_as_owner(
    dfd: int,
    path: str,
    st: os.stat_result,
    key: str,
    step: Optional[int],
    chunk_size: int,
    streams: int,
) -> Dict[str, Any]:
    """Root: look for writers among every process, then seal as the owner (a child)."""
    from slurm_ckpt.node.asuser import alive, run_as_user

    listing = _listing(dfd, path)
    _check_writers(path, listing)
    parent = os.getpid()

    def child() -> Dict[str, Any]:
        cfd = _open_dir(path)
        try:
            if os.fstat(cfd).st_ino != st.st_ino or os.fstat(cfd).st_dev != st.st_dev:
                raise SealRefused(f"{path}: replaced while sealing")
            beat = lambda _n: alive()  # noqa: E731 - a sign of life per chunk hashed
            return _seal_open(cfd, path, key, step, chunk_size, streams, beat, (parent,))
        finally:
            os.close(cfd)

    # Bounded: a child its user stops (SIGSTOP) or that hangs on a dead filesystem is
    # killed once it has shown no sign of life (a chunk hashed) for CHILD_STALL_S.
    out = run_as_user(
        _owner_name(st.st_uid), child, what=f"seal {path}", stall_timeout=CHILD_STALL_S
    )
    if not isinstance(out, dict) or not isinstance(out.get("manifest"), str):
        raise SealRefused(f"{path}: the sealing child answered garbage")
    return out
