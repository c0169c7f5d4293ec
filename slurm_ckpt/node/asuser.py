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
runs and its outcome - a :class:`ChildResult`: the value, or a :class:`ChildError` - goes
back through a pipe as JSON, never pickle: root must not unpickle bytes from a process the
user may have influenced. Root reads at most :data:`MAX_RESULT` bytes and checks the
shape of what came before it uses any of it (:meth:`ChildResult.from_json`; typed values
bring their own check, e.g. :meth:`~slurm_ckpt.tiers.copy.CopyResult.from_json`). No
shell, no exec.
The parent enforces a timeout by killing the child's process group (SIGKILL works on a
stopped process too). Two limits apply: ``timeout`` (in all) and ``stall_timeout`` (no
sign of life: the callable calls :func:`alive` as it makes progress, and the parent
counts each as one). A child its user stopped (``SIGSTOP``: any process of the user can
do that to it) is told apart from a slow one - :class:`ChildStopped`, the user's doing -
so that one user cannot stall root's work for everyone else.

The parent must be single-threaded when it calls :func:`run_as` (hooks and the stager
are): ``fork()`` copies only the calling thread, and a lock held by another thread would
stay locked in the child forever.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import pwd
import select
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generic, List, Optional, Sequence, Type, TypeVar, cast

from slurm_ckpt.core.procs import set_pdeathsig
from slurm_ckpt.errors import EXIT_FAILED, CkptError, TimedOut

__all__ = [
    "AsUserError",
    "AsUserTimeout",
    "ChildError",
    "ChildGarbled",
    "ChildResult",
    "ChildStopped",
    "alive",
    "decode_list",
    "decode_value",
    "run_as",
    "run_as_user",
]

#: The most root reads of one child's result (it is killed beyond).
MAX_RESULT = 64 * 2**20
#: The longest error message and exception name root keeps from a child.
MAX_ERROR_TEXT = 4096
MAX_ERROR_TYPE = 128

T = TypeVar("T")


class AsUserError(CkptError):
    """The callable failed (or died) in the child running as the user."""

    exit_code = EXIT_FAILED


class AsUserTimeout(AsUserError, TimedOut):
    """The callable did not finish within its timeout; the child was killed."""


class ChildStopped(AsUserTimeout):
    """The child ran out of time because it was stopped (SIGSTOP, ptrace) - by its user,
    the only one besides root who may signal it. The user's doing, not the node's."""

    user_caused = True
    hold_code = "stopped"


class ChildKilled(AsUserError):
    """The child died of a signal root did not send (root kills only at a deadline,
    which is :class:`AsUserTimeout`): sent by its user, the only other one who may
    signal it (SIGKILL from the user's job still on the node). Not a crash signal
    (:data:`CRASH_SIGNALS`): the child blocks those, so one its user sends does
    nothing, and a child that dies of one had a real fault of its own."""

    user_caused = True
    hold_code = "killed"


class ChildGarbled(AsUserError):
    """The child's result is not one root accepts (not JSON, another shape, a value its
    type's check refuses). Root's own child writes only well-formed results, so only
    its user - who may ptrace it, or write to its result pipe - can garble one: the
    user's doing (that checkpoint is held), never a reason to drain the node."""

    user_caused = True
    hold_code = "garbled"


#: Signals a process gets from its own fault, not from someone else.
CRASH_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS}
)


@dataclass(frozen=True)
class ChildError:
    """An exception as a child describes it to root: data, never an object (root must
    not rebuild arbitrary objects from a process its user may have influenced). Only a
    :class:`~slurm_ckpt.errors.CkptError` class known here by name comes back as itself
    (:meth:`exception`), so the facts declared on it (``user_caused``, ``hold_code``,
    ``bad_source``) are root's own class attributes, not anything the child said."""

    type: str
    message: str
    errno: Optional[int] = None
    ckpt: bool = False

    @classmethod
    def of(cls, exc: BaseException) -> ChildError:
        """How a child describes the exception it caught."""
        err = getattr(exc, "errno", None)
        return cls(
            type=type(exc).__name__,
            message=(" ".join(str(exc).split()) or type(exc).__name__)[:MAX_ERROR_TEXT],
            errno=err if isinstance(err, int) and not isinstance(err, bool) else None,
            ckpt=isinstance(exc, CkptError),
        )

    def to_json(self) -> Dict[str, Any]:
        return {"type": self.type, "message": self.message, "errno": self.errno, "ckpt": self.ckpt}

    @classmethod
    def from_json(cls, obj: Any) -> ChildError:
        """What a child sent, checked: ``ValueError`` unless it has this shape."""
        if not isinstance(obj, dict):
            raise ValueError("not an error")
        name, text, err, ckpt = (obj.get(k) for k in ("type", "message", "errno", "ckpt"))
        if not isinstance(name, str) or not name.isidentifier() or len(name) > MAX_ERROR_TYPE:
            raise ValueError("bad error type")
        if not isinstance(text, str):
            raise ValueError("bad error message")
        if err is not None and (isinstance(err, bool) or not isinstance(err, int)):
            raise ValueError("bad errno")
        if not isinstance(ckpt, bool):
            raise ValueError("bad error kind")
        return cls(name, " ".join(text.split())[:MAX_ERROR_TEXT], err, ckpt)

    def exception(self, where: str) -> CkptError:
        """The exception to raise in root: a :class:`CkptError` raised in the child comes
        back with the same class and message; anything else as :class:`AsUserError`
        (``"<where>: <Type>: <message>"``, errno kept)."""
        if self.ckpt:
            return _error_classes().get(self.type, AsUserError)(self.message)
        exc = AsUserError(f"{where}: {self.type}: {self.message}")
        if self.errno is not None:
            exc.errno = self.errno  # type: ignore[attr-defined]
        return exc


@dataclass(frozen=True)
class ChildResult(Generic[T]):
    """The outcome of one piece of work done in a child: its value, or the error it
    raised. On the wire (JSON): ``{"ok": value}`` or ``{"err": ChildError}``."""

    value: Optional[T] = None
    error: Optional[ChildError] = None

    @classmethod
    def failed(cls, exc: BaseException) -> ChildResult[T]:
        return cls(error=ChildError.of(exc))

    def unwrap(self, where: str) -> T:
        """The value, or the child's error raised here (:meth:`ChildError.exception`)."""
        if self.error is not None:
            raise self.error.exception(where)
        return cast(T, self.value)

    def to_json(self) -> Dict[str, Any]:
        if self.error is not None:
            return {"err": self.error.to_json()}
        return {"ok": self.value}  # typed values encode themselves (_encode)

    @classmethod
    def from_json(cls, obj: Any, decode: Callable[[Any], T], where: str) -> ChildResult[T]:
        """What a child sent, checked: one of the two shapes, the value through
        ``decode`` (which raises ``ValueError``/``TypeError`` on a bad one). Anything
        else is :class:`AsUserError` ("garbled"): never a traceback, never trusted."""
        try:
            if isinstance(obj, dict) and set(obj) == {"ok"}:
                return cls(value=decode(obj["ok"]))
            if isinstance(obj, dict) and set(obj) == {"err"}:
                return cls(error=ChildError.from_json(obj["err"]))
        except (ValueError, TypeError):
            pass
        raise ChildGarbled(f"{where}: garbled result from the child")


def decode_value(decode: Callable[[Any], T], value: Any, where: str) -> T:
    """A value :func:`run_as` returned, through its type's checking ``decode``;
    :class:`AsUserError` ("garbled") when it does not pass."""
    try:
        return decode(value)
    except (ValueError, TypeError):
        raise ChildGarbled(f"{where}: garbled result from the child") from None


def decode_list(decode: Callable[[Any], T], value: Any, where: str) -> List[ChildResult[T]]:
    """The per-item results of a batch child (a list of :class:`ChildResult`), each
    checked; :class:`AsUserError` ("garbled") when any does not pass."""
    if not isinstance(value, list):
        raise ChildGarbled(f"{where}: garbled result from the child")
    return [ChildResult.from_json(item, decode, where) for item in value]


def _encode(obj: Any) -> Any:
    """JSON for what ``json`` does not know: typed results encode themselves
    (``to_json``), anything else as its text."""
    to_json = getattr(obj, "to_json", None)
    return to_json() if callable(to_json) else str(obj)


#: In the child: the write end of the heartbeat pipe (None: nobody listens).
_beat_fd: Optional[int] = None
_beat_last = 0.0
_BEAT_EVERY_S = 0.2

#: A test seam, ``None`` in the product: called in every child once it runs as the user,
#: just before the callable. The security suite sets it so that a hostile user's process
#: meets each of root's children at that known point (and may stop it there) instead of
#: racing to catch it in ``/proc``. It runs with the user's rights only, so it can do
#: nothing the user could not.
child_start_hook: Optional[Callable[[], None]] = None


def alive() -> None:
    """Tell the parent this child is making progress (cheap; call it as often as you
    like, from any thread: at most one byte per 0.2 s goes out). A no-op outside a
    :func:`run_as` child with a ``stall_timeout``."""
    global _beat_last
    fd = _beat_fd
    if fd is None:
        return
    now = time.monotonic()
    if now - _beat_last < _BEAT_EVERY_S:
        return
    _beat_last = now
    with contextlib.suppress(OSError):
        os.write(fd, b".")


def _stopped(pid: int) -> bool:
    """Is any thread of ``pid`` stopped (state T) or traced (t)?"""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = [str(pid)]
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                state = fh.read().rsplit(b") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if state in (b"T", b"t"):
            return True
    return False


def _error_classes() -> Dict[str, Type[CkptError]]:
    out: Dict[str, Type[CkptError]] = {}
    todo = [CkptError]
    while todo:
        cls = todo.pop()
        out.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return out


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
    beat: Optional[int],
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
        # Before the child becomes the user (from then on the user may signal it): a
        # crash signal *sent* to it (``kill -SEGV``) stays pending, blocked, and does
        # nothing, so that it cannot pass for a fault of the child's own. A real fault
        # still kills the child with that signal: the kernel delivers a synchronous
        # SIGSEGV/SIGBUS/SIGILL/SIGFPE/SIGSYS even when it is blocked, and abort()
        # unblocks SIGABRT before it raises it.
        signal.pthread_sigmask(signal.SIG_BLOCK, CRASH_SIGNALS)
        if close_fds:
            low = 3
            for keep in sorted(fd for fd in (wfd, beat) if fd is not None):
                os.closerange(low, keep)
                low = keep + 1
            os.closerange(low, 65536)
        global _beat_fd
        _beat_fd = beat
        _drop(user, uid, gid, groups)
        # Cleared by the credential change above, so set it now; then make sure the
        # parent did not die before it took effect.
        set_pdeathsig()
        if os.getppid() != parent:
            os._exit(1)
        os.umask(umask)
        os.chdir("/")
        try:
            pw = pwd.getpwuid(uid)
            os.environ.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
        except KeyError:
            os.environ["HOME"] = "/"
        if child_start_hook is not None:
            child_start_hook()
        done: ChildResult[Any] = ChildResult(value=fn(*args, **kwargs))
        blob = json.dumps(done, default=_encode).encode()
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        code = 1
        blob = json.dumps(ChildResult.failed(exc).to_json()).encode()
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
    stall_timeout: Optional[float] = None,
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` in a child running as ``uid``/``gid``; return its
    result as JSON values (a typed result - :class:`ChildResult`, a dataclass with
    ``to_json`` - as its JSON: the caller decodes and checks it, e.g.
    :func:`decode_value`).

    ``stall_timeout``: the child is also killed once it has shown no sign of life
    (:func:`alive`) for this long; :class:`ChildStopped` when it was stopped then.

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
    brfd = bwfd = None
    if stall_timeout is not None:
        brfd, bwfd = os.pipe()
        os.set_blocking(bwfd, False)  # a child must never block on its heartbeat
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    parent = os.getpid()
    # The child must not walk (and so copy, page by page) the parent's whole heap: with
    # a large ledger in memory a collection in the child costs more than its work.
    gc.freeze()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child (covered via the parent's result)
        gc.disable()
        os.close(rfd)
        if brfd is not None:
            os.close(brfd)
        _child(wfd, bwfd, parent, user, uid, gid, groups, umask, close_fds, fn, args, kwargs)
    gc.unfreeze()
    os.close(wfd)
    if bwfd is not None:
        os.close(bwfd)
    start = time.monotonic()
    deadline = None if timeout is None else start + max(0.0, float(timeout))
    stall = None if stall_timeout is None else max(0.0, float(stall_timeout))
    last_sign = start
    chunks = []
    size = 0
    timed_out = False
    stopped = False
    watch = [rfd] + ([brfd] if brfd is not None else [])
    try:
        while True:
            now = time.monotonic()
            ends = [
                t for t in (deadline, None if stall is None else last_sign + stall) if t is not None
            ]
            wait = None if not ends else min(ends) - now
            if wait is not None and wait <= 0:
                timed_out = True
                stopped = _stopped(pid)
                break
            try:
                ready, _, _ = select.select(watch, [], [], wait)
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
            if not ready:
                continue
            if brfd is not None and brfd in ready:
                last_sign = time.monotonic()
                if not os.read(brfd, 4096):
                    watch.remove(brfd)  # the child closed it (exiting): results follow
                if rfd not in ready:
                    continue
            last_sign = time.monotonic()
            data = os.read(rfd, 1 << 20)
            if not data:
                break
            size += len(data)
            if size > MAX_RESULT:
                timed_out = False
                chunks = []
                _kill(pid)
                raise AsUserError(f"{label} as {who}: result larger than {MAX_RESULT} bytes")
            chunks.append(data)
    finally:
        os.close(rfd)
        if brfd is not None:
            os.close(brfd)
        if timed_out:
            _kill(pid)
        status = _reap(pid)
    if timed_out:
        took = time.monotonic() - start
        if stopped:
            raise ChildStopped(
                f"{label} as {who}: the child was stopped (SIGSTOP) by its user; "
                f"killed after {took:.3g}s"
            )
        if deadline is not None and time.monotonic() >= deadline:
            raise AsUserTimeout(f"{label} as {who}: timed out after {timeout:g}s")
        raise AsUserTimeout(f"{label} as {who}: no progress for {stall:g}s; killed")
    blob = b"".join(chunks)
    if not blob:
        if os.WIFSIGNALED(status):
            signum = signal.Signals(os.WTERMSIG(status))
            if signum in CRASH_SIGNALS:
                raise AsUserError(f"{label} as {who}: killed by {signum.name}")
            raise ChildKilled(f"{label} as {who}: killed by {signum.name} (not sent by root)")
        raise AsUserError(f"{label} as {who}: exited with status {os.WEXITSTATUS(status)}")
    where = f"{label} as {who}"
    try:
        msg = json.loads(blob)
    except ValueError:
        raise ChildGarbled(f"{where}: garbled result from the child") from None
    return ChildResult.from_json(msg, _as_is, where).unwrap(where)


def _as_is(value: Any) -> Any:
    return value


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
