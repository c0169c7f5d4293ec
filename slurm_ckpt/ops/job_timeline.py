"""ckpt-srun's part of the job timeline, where it lives, and the goodput read back from
it (:mod:`slurm_ckpt.core.timeline` has the format and the arithmetic).

The directory is the job's own below the user's warm-tier directory on a PFS:
``<pfs root>/<user>/.slurm_ckpt/jobs/<job>/`` (the user's, mode 0700, readable from a
login node). A site whose warm tier is an object store has no such directory and no
timeline. Writing never stops the job: a failure is said once and the job goes on.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import validate_user
from slurm_ckpt.core.timeline import Goodput, analyze, append_record, parse_lines
from slurm_ckpt.errors import NotFound, UsageError

__all__ = ["SrunTimeline", "job_goodput", "timeline_dir"]

#: Bytes read per timeline file at most.
MAX_FILE_BYTES = 32 * 2**20


def timeline_dir(cfg: Optional[Config], user: str, job: str) -> Optional[str]:
    """``<pfs root>/<user>/.slurm_ckpt/jobs/<job>``, or None without a PFS tier."""
    if cfg is None or cfg.tiers.pfs is None:
        return None
    if not job.isdigit() and not job.replace("_", "").isdigit():
        raise UsageError(f"job {job!r}: a SLURM job id (digits, or ARRAYJOB_TASK)")
    return os.path.join(str(cfg.tiers.pfs.root), validate_user(user), ".slurm_ckpt", "jobs", job)


class SrunTimeline:
    """Appends ckpt-srun's records to ``<dir>/srun.jsonl``."""

    def __init__(self, directory: Optional[str], say: Callable[[str], None]) -> None:
        self.directory = directory
        self.say = say
        self.path: Optional[str] = None
        if directory is None:
            return
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self.path = os.path.join(directory, "srun.jsonl")
        except OSError as exc:
            say(f"no job timeline ({directory}: {exc.strerror or exc}); goodput not measured")

    def note(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        try:
            append_record(self.path, event, **fields)
        except OSError as exc:
            self.say(f"job timeline not written ({exc.strerror or exc}); goodput not measured")
            self.path = None


def _open_dir(base: str, below: Tuple[str, ...]) -> int:
    """``base`` (the admin's path, resolved), then every component ``below`` it opened
    relative to the one above without following a symlink: below a tier root the path is
    the user's, and root's ``goodput`` must not be led elsewhere by a link they planted."""
    fd = os.open(os.path.realpath(base), os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in below:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except NotADirectoryError:
                # Linux says ENOTDIR for a symlink opened with O_DIRECTORY|O_NOFOLLOW
                if stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                    raise OSError(errno.ELOOP, "a symlink") from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read(base: str, below: Tuple[str, ...], name: str) -> List[str]:
    """The lines of ``base/below.../name``: no symlink followed below ``base``, no FIFO
    waited on (the user's file; root's ``goodput`` reads it too), at most
    MAX_FILE_BYTES."""
    try:
        dfd = _open_dir(base, below)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:  # ELOOP: a symlink where a directory belongs
        where = os.path.join(base, *below)
        raise UsageError(f"{where}: {exc.strerror or exc} (not followed)") from None
    try:
        fd, _st = fsio.open_regular(dfd, name)
    except FileNotFoundError:
        return []
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_FILE_BYTES)
    return data.decode("utf-8", "replace").splitlines()


def job_goodput(cfg: Config, user: str, job: str, directory: Optional[str] = None) -> Goodput:
    """The measured goodput of ``job`` (NotFound when it left no timeline)."""
    if directory is not None:
        base, below = directory, ()
    else:
        where = timeline_dir(cfg, user, job)
        if where is None:
            raise NotFound("no job timeline: the warm tier is not a PFS directory (use --dir)")
        base = str(cfg.tiers.pfs.root)  # type: ignore[union-attr]
        below = tuple(Path(os.path.relpath(where, base)).parts)
    srun = parse_lines(_read(base, below, "srun.jsonl"))
    rank0 = parse_lines(_read(base, below, "rank0.jsonl"))
    if not srun and not rank0:
        shown = os.path.join(base, *below)
        raise NotFound(f"job {job}: no timeline in {shown} (was it run under ckpt-srun?)")
    return analyze(job, srun, rank0)
