"""Run a Python callable as another user (the job's user), from root.

Why: prolog, epilog and stager run as root over directories that users write. Whatever
root does there - list, read, copy, delete - a user could try to redirect with a symlink
or hard link planted at the right moment. Doing the work *as that user* takes the
question off the table: the kernel then applies the user's own permissions, so the worst a
planted link can achieve is access the user already has. Root itself only creates the
per-user directory, checks ownership, and keeps the ledger.

How: ``fork()``; in the child ``setgroups``/``initgroups``, ``setgid``, ``setuid`` (real,
effective and saved ids; checked afterwards, and regaining root must fail), parent-death
signal, ``umask``, ``chdir("/")``, inherited file descriptors closed; then the callable
runs and its result (JSON, never pickle: root must not unpickle bytes from a process the
user may have influenced) or a one-line error goes back through a pipe. No shell, no exec.
The parent enforces a timeout by killing the child's process group.

The parent must be single-threaded when it calls :func:`run_as` (hooks and the stager
are): ``fork()`` copies only the calling thread, and a lock held by another thread would
stay locked in the child forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import pwd
import select
import signal
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence, Type

from slurm_ckpt.errors import CkptError, TimedOut

__all__ = ["AsUserError", "AsUserTimeout", "run_as", "run_as_user"]

_PR_SET_PDEATHSIG = 1
_MAX_RESULT = 64 * 2**20


class AsUserError(CkptError):
    """The callable failed (or died) in the child running as the user."""

    exit_code = 1


class AsUserTimeout(AsUserError, TimedOut):
    """The callable did not finish within its timeout; the child was killed."""


def _error_classes() -> Dict[str, Type[CkptError]]:
    out: Dict[str, Type[CkptError]] = {}
    todo = [CkptError]
    while todo:
        cls = todo.pop()
        out.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return out


def _set_pdeathsig() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _drop(user: Optional[str], uid: int, gid: int, groups: Optional[Sequence[int]]) -> None:
    """Become ``uid``/``gid`` for good (real, effective and saved ids)."""
    if groups is not None:
        os.setgroups(list(groups))
    elif user is not None:
        os.initgroups(user, gid)
    else:
        os.setgroups([gid])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise AsUserError(f"could not switch to uid {uid} gid {gid}")
    if uid != 0:
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise AsUserError(f"privileges not dropped: uid {uid} could regain root")


def _child(
    wfd: int,
    parent: int,
    user: Optional[str],
    uid: int,
    gid: int,
    groups: Optional[Sequence[int]],
    umask: int,
    close_fds: bool,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Dict[str, Any],
) -> None:
    code = 0
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        if close_fds:
            os.closerange(3, wfd)
            os.closerange(wfd + 1, 65536)
        _drop(user, uid, gid, groups)
        # Cleared by the credential change above, so set it now; then make sure the
        # parent did not die before it took effect.
        _set_pdeathsig()
        if os.getppid() != parent:
            os._exit(1)
        os.umask(umask)
        os.chdir("/")
        try:
            pw = pwd.getpwuid(uid)
            os.environ.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
        except KeyError:
            os.environ["HOME"] = "/"
        result = fn(*args, **kwargs)
        blob = json.dumps({"ok": result}, default=str).encode()
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        code = 1
        err = {
            "type": type(exc).__name__,
            "message": " ".join(str(exc).split()) or type(exc).__name__,
            "errno": getattr(exc, "errno", None),
            "ckpt": isinstance(exc, CkptError),
        }
        blob = json.dumps({"err": err}).encode()
    try:
        view = memoryview(blob)
        while view:
            n = os.write(wfd, view)
            view = view[n:]
    except OSError:
        code = 2
    os._exit(code)


def run_as(
    uid: int,
    gid: int,
    fn: Callable[..., Any],
    *args: Any,
    user: Optional[str] = None,
    groups: Optional[Sequence[int]] = None,
    timeout: Optional[float] = None,
    umask: int = 0o077,
    close_fds: bool = True,
    what: Optional[str] = None,
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` in a child running as ``uid``/``gid``; return its
    JSON-serialisable result.

    Supplementary groups: ``groups`` if given, else the user's (``initgroups``) when
    ``user`` is given, else only ``gid``. A :class:`~slurm_ckpt.errors.CkptError` raised in
    the child is raised again here with the same class and message; any other exception
    becomes :class:`AsUserError` (``"<what> as <user>: <Type>: <message>"``), an
    ``OSError`` keeps its errno in ``.errno``. After ``timeout`` seconds the child's process
    group is killed and :class:`AsUserTimeout` is raised.
    """
    if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
        raise AsUserError(f"invalid uid {uid!r}")
    if isinstance(gid, bool) or not isinstance(gid, int) or gid < 0:
        raise AsUserError(f"invalid gid {gid!r}")
    label = what or getattr(fn, "__name__", "task")
    who = user or f"uid {uid}"
    rfd, wfd = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child (covered via the parent's result)
        os.close(rfd)
        _child(wfd, parent, user, uid, gid, groups, umask, close_fds, fn, args, kwargs)
    os.close(wfd)
    deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
    chunks = []
    size = 0
    timed_out = False
    try:
        while True:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                timed_out = True
                break
            try:
                ready, _, _ = select.select([rfd], [], [], wait)
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
            if not ready:
                continue
            data = os.read(rfd, 1 << 20)
            if not data:
                break
            size += len(data)
            if size > _MAX_RESULT:
                timed_out = False
                chunks = []
                _kill(pid)
                raise AsUserError(f"{label} as {who}: result larger than {_MAX_RESULT} bytes")
            chunks.append(data)
    finally:
        os.close(rfd)
        if timed_out:
            _kill(pid)
        status = _reap(pid)
    if timed_out:
        raise AsUserTimeout(f"{label} as {who}: timed out after {timeout:g}s")
    blob = b"".join(chunks)
    if not blob:
        if os.WIFSIGNALED(status):
            sig = signal.Signals(os.WTERMSIG(status)).name
            raise AsUserError(f"{label} as {who}: killed by {sig}")
        raise AsUserError(f"{label} as {who}: exited with status {os.WEXITSTATUS(status)}")
    try:
        msg = json.loads(blob)
    except ValueError:
        raise AsUserError(f"{label} as {who}: garbled result from the child") from None
    if isinstance(msg, dict) and "ok" in msg:
        return msg["ok"]
    err = msg.get("err") if isinstance(msg, dict) else None
    if not isinstance(err, dict):
        raise AsUserError(f"{label} as {who}: garbled result from the child")
    name = str(err.get("type", "Error"))
    text = str(err.get("message", ""))
    if err.get("ckpt"):
        cls = _error_classes().get(name, AsUserError)
        raise cls(text)
    exc = AsUserError(f"{label} as {who}: {name}: {text}")
    if isinstance(err.get("errno"), int):
        exc.errno = err["errno"]  # type: ignore[attr-defined]
    raise exc


def _kill(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        with contextlib.suppress(OSError):
            target()


def _reap(pid: int) -> int:
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return status
        except InterruptedError:  # pragma: no cover
            continue
        except OSError as exc:  # pragma: no cover - reaped elsewhere
            if exc.errno == errno.ECHILD:
                return 0
            raise


def run_as_user(user: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """:func:`run_as` for a user name (uid, gid and groups from the passwd database)."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise AsUserError(f"unknown user {user!r}") from None
    return run_as(pw.pw_uid, pw.pw_gid, fn, *args, user=pw.pw_name, **kwargs)
