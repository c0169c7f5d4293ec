"""A pass-through FUSE filesystem that fails chosen operations with chosen errors.

Why: an I/O error from the disk (``EIO`` on write, fsync or read) must cost at most the
checkpoint it hit, never a listed-but-broken one, and the epilog must keep the node
drained until the data is safe. Real disks fail rarely and never on cue; device-mapper
needs dm targets this machine may not have. This filesystem forwards everything to a
backing directory and answers chosen operations with an error instead, so the kernel
hands the same ``errno`` to the real syscalls of the code under test.

Control: a JSON file (re-read whenever it changes), e.g.::

    {"rules": [{"ops": ["write", "fsync"], "match": "/step-", "errno": 5, "prob": 0.3}],
     "seed": 7}

``ops`` are operation names of :class:`Passthrough` (``write``, ``read``, ``fsync``,
``create``, ``mkdir``, ``rename``, ``unlink``, ``open``, ``fallocate``...), ``match`` a
substring of the path inside the mount ("" = any), ``prob`` the chance per call (seeded,
so a run is repeatable). Every injected error appends ``<op> <path>`` to
``<control>.hits``.

Run (as root, in the foreground, until unmounted)::

    python -m tests.faults.fusefs BACKING MOUNTPOINT CONTROL
"""

from __future__ import annotations

import errno
import json
import os
import random
import sys
import threading
from typing import Any, Dict, List, Optional

import mfusepy as fuse


class Passthrough(fuse.Operations):
    """Forward every operation to ``root``; files get the caller's uid/gid."""

    use_ns = True  # utimens gets nanoseconds

    def __init__(self, root: str, control: str) -> None:
        self.root = os.path.realpath(root)
        self.control = control
        self.hits = control + ".hits"
        self._stamp: Optional[int] = None
        self._rules: List[Dict[str, Any]] = []
        self._rng = random.Random(0)
        self._lock = threading.Lock()

    # -- fault injection ----------------------------------------------------------------
    def _reload(self) -> None:
        try:
            stamp = os.stat(self.control).st_mtime_ns
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            with open(self.control) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            doc = {}
        self._rules = list(doc.get("rules", []))
        self._rng = random.Random(doc.get("seed", 0))

    def _maybe_fail(self, op: str, path: str) -> None:
        with self._lock:
            self._reload()
            for rule in self._rules:
                if op not in rule.get("ops", ()) or rule.get("match", "") not in path:
                    continue
                if self._rng.random() >= float(rule.get("prob", 1.0)):
                    continue
                code = int(rule.get("errno", errno.EIO))
                with open(self.hits, "a") as fh:
                    fh.write(f"{op} {path}\n")
                raise fuse.FuseOSError(code)

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _own(self, full: str) -> None:
        uid, gid, _pid = fuse.fuse_get_context()
        os.lchown(full, uid, gid)

    # -- metadata -----------------------------------------------------------------------
    def getattr(self, path: str, fh: Optional[int] = None) -> Dict[str, Any]:
        st = os.lstat(self._full(path))
        keys = (
            "st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size",
            "st_uid", "st_ino", "st_blocks",
        )  # fmt: skip
        out = {k: getattr(st, k) for k in keys}
        for k in ("st_atime", "st_mtime", "st_ctime"):
            out[k + "_ns"] = getattr(st, k + "_ns")
        return out

    def readdir(self, path: str, fh: int) -> List[str]:
        self._maybe_fail("readdir", path)
        return [".", "..", *os.listdir(self._full(path))]

    def readlink(self, path: str) -> str:
        return os.readlink(self._full(path))

    def statfs(self, path: str) -> Dict[str, int]:
        sv = os.statvfs(self._full(path))
        keys = (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
            "f_flag", "f_frsize", "f_namemax",
        )  # fmt: skip
        return {k: getattr(sv, k) for k in keys}

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.lchown(self._full(path), uid, gid)
        return 0

    def utimens(self, path: str, times: Optional[Any] = None) -> int:
        os.utime(self._full(path), ns=times) if times else os.utime(self._full(path))
        return 0

    def truncate(self, path: str, length: int, fh: Optional[int] = None) -> int:
        self._maybe_fail("truncate", path)
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._full(path), length)
        return 0

    # -- namespace ----------------------------------------------------------------------
    def mkdir(self, path: str, mode: int) -> int:
        self._maybe_fail("mkdir", path)
        full = self._full(path)
        os.mkdir(full, mode)
        self._own(full)
        return 0

    def rmdir(self, path: str) -> int:
        self._maybe_fail("rmdir", path)
        os.rmdir(self._full(path))
        return 0

    def unlink(self, path: str) -> int:
        self._maybe_fail("unlink", path)
        os.unlink(self._full(path))
        return 0

    def symlink(self, target: str, source: str) -> int:
        full = self._full(target)
        os.symlink(source, full)
        self._own(full)
        return 0

    def link(self, target: str, source: str) -> int:
        os.link(self._full(source), self._full(target))
        return 0

    def rename(self, old: str, new: str) -> int:
        self._maybe_fail("rename", new)
        os.rename(self._full(old), self._full(new))
        return 0

    # -- files --------------------------------------------------------------------------
    def open(self, path: str, flags: int) -> int:
        self._maybe_fail("open", path)
        return os.open(self._full(path), flags & ~getattr(os, "O_DIRECT", 0))

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        self._maybe_fail("create", path)
        full = self._full(path)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        self._own(full)
        return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self._maybe_fail("read", path)
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._maybe_fail("write", path)
        return os.pwrite(fh, data, offset)

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
        self._maybe_fail("fallocate", path)
        os.posix_fallocate(fh, offset, size)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._maybe_fail("fsync", path)
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        self._maybe_fail("fsyncdir", path)
        return 0


def main(argv: Optional[List[str]] = None) -> int:
    backing, mountpoint, control = argv or sys.argv[1:4]
    fuse.FUSE(
        Passthrough(backing, control),
        mountpoint,
        foreground=True,
        allow_other=True,
        default_permissions=True,
        fsname="sckpt-faultfs",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
