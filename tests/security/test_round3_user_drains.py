"""Round 3, issue 28 B: drains a user could still cause.

Each cause is built for real by the attacker (``ckptuser2``) on their own things; root
runs the real epilog and stager over it. Each once kept the node drained; now none does:

* a ``flock`` the owner holds on their own step lock file (``.lock-step-N``): root's
  copy once blocked on it until it was killed for "no progress", a real fault; now it
  waits a bounded time and the checkpoint is held (``locked``);
* a *different* committed checkpoint of the same step already in the owner's own PFS
  directory (malice, or a node back with an older unflushed step): once a real fault;
  now held (``conflict``);
* SIGSEGV or SIGABRT sent by the owner's job to root's flush child: once taken for a
  crash of the child, a real fault; now the child blocks them (they do nothing) and the
  flush goes through. A real fault of the child (a bad memory access, ``abort()``) still
  kills it and still counts as one.

The held ones are reported (an event, the node status ``status`` shows) and retried
after their backoff; the other user's checkpoint in the same pass is flushed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import struct
import time
from typing import Any, Callable, Iterator

import pytest

from slurm_ckpt.core.layout import lock_name
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.node.asuser import AsUserError, ChildKilled, run_as_user
from slurm_ckpt.tiers.registry import tiers_from_config

from .conftest import (
    ATTACKER,
    VICTIM,
    Recorder,
    Site,
    Stopper,
    as_user,
    ids,
    save,
    steps,
)
from .test_round2_user_failures import _check_held


@pytest.fixture
def lock_holder(site: Site) -> Iterator[Callable[[Any], None]]:
    """``hold(cfg)``: a process of the attacker's holds ``flock(LOCK_EX)`` on their own
    ``evil/.lock-step-1`` from then on (until the test ends) - the lock is theirs, the
    file below their own directory. Returns once the lock is held."""
    pids = []

    def hold(cfg: Any) -> None:
        path = os.path.join(str(cfg.tiers.local.root), ATTACKER, "evil", lock_name(1))
        u = ids(ATTACKER)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the attacker
            try:
                import fcntl

                os.close(ready_r)
                os.setgroups([])
                os.setresgid(u.gid, u.gid, u.gid)
                os.setresuid(u.uid, u.uid, u.uid)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(ready_w, b"1")
                signal.pause()
            finally:
                os._exit(0)
        os.close(ready_w)
        try:
            assert os.read(ready_r, 1) == b"1", "the attacker did not get the lock"
        finally:
            os.close(ready_r)
        pids.append(pid)

    yield hold
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_step_lock_the_owner_holds_never_keeps_a_node_drained(
    site: Site, lock_holder: Callable[[Any], None]
) -> None:
    cfg = site.cfg()
    save(cfg, VICTIM, "good", 1, job="200")
    save(cfg, ATTACKER, "evil", 1, job="100")
    lock_holder(cfg)
    slurm = Recorder()
    rep = run_epilog(cfg, site.env(ATTACKER, job="100"), slurm)
    _check_held(site, cfg, slurm, rep, "locked")
    [res] = [r for r in rep.flush.results if r.ident == (ATTACKER, "evil", 1)]
    assert "lock file is held" in (res.error or ""), res


def test_a_different_checkpoint_of_the_step_on_the_pfs_never_keeps_a_node_drained(
    site: Site,
) -> None:
    """The attacker's own PFS directory already holds a different, newer step 1 of the
    series (written there directly, as they may): root must not overwrite it, and the
    node must not stay drained for it."""
    cfg = site.cfg()
    save(cfg, VICTIM, "good", 1, job="200")
    save(cfg, ATTACKER, "evil", 1, job="100")

    def newer_on_pfs() -> None:
        w = tiers_from_config(cfg)["pfs"].writer(ATTACKER, "evil", 1, job="999", node="n9")
        w.write_buffers({"model.bin": b"another timeline" * 64})
        w.commit()

    as_user(ATTACKER, newer_on_pfs)
    t = tiers_from_config(cfg)
    mine, theirs = (t[n].manifest(ATTACKER, "evil", 1) for n in ("local", "pfs"))
    assert theirs.wall_time > mine.wall_time  # newer: root must not replace it
    slurm = Recorder()
    rep = run_epilog(cfg, site.env(ATTACKER, job="100"), slurm)
    _check_held(site, cfg, slurm, rep, "conflict")
    [res] = [r for r in rep.flush.results if r.ident == (ATTACKER, "evil", 1)]
    assert "different checkpoint with this step" in (res.error or ""), res
    # Root overwrote nothing: the PFS still has the attacker's other timeline.
    pfs = tiers_from_config(cfg)["pfs"]
    assert pfs.manifest(ATTACKER, "evil", 1).job == "999"


class Signaller(Stopper):
    """An attacker's process that sends ``sig`` to root's children running as its user,
    at the known point of :class:`Stopper` (once the child runs as the user, before its
    work), but the first ``skip``; it waits until the kernel shows the signal pending
    in the child or the child dead, then lets it go on. ``sent`` counts the signals
    sent (read back from the attacker's directory)."""

    def __init__(self, user: str, sig: int, skip: int = 0) -> None:
        super().__init__(user, skip)
        self.sig = sig

    def _attack(self, ready: int) -> None:  # pragma: no cover - the attacker
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.path)
        srv.listen(16)
        os.write(ready, b"1")
        os.close(ready)
        seen = 0
        while True:
            conn, _ = srv.accept()
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            child = struct.unpack("3i", cred)[0]
            seen += 1
            if seen > self.skip:
                os.kill(child, self.sig)
                with open(os.path.join(self.dir, "sent"), "a") as fh:
                    fh.write(f"{child}\n")
                while not _pending_or_gone(child, self.sig):
                    time.sleep(0.001)  # until the kernel shows it: no deadline needed
            with contextlib.suppress(OSError):
                conn.sendall(b"go")
            conn.close()

    @property
    def sent(self) -> int:
        try:
            with open(os.path.join(self.dir, "sent")) as fh:
                return len(fh.read().split())
        except OSError:
            return 0

    def __exit__(self, *exc: object) -> None:
        self._sent = self.sent
        super().__exit__(*exc)


def _pending_or_gone(pid: int, sig: int) -> bool:
    """Is ``sig`` pending (blocked) in ``pid``, or is ``pid`` dead (or a zombie)?"""
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
    except OSError:
        return True
    if fields.get("State", "").strip().startswith(("Z", "X")):
        return True
    bit = 1 << (sig - 1)
    return any(int(fields.get(k, "0").strip() or "0", 16) & bit for k in ("SigPnd", "ShdPnd"))


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT], ids=["SIGSEGV", "SIGABRT"])
def test_a_crash_signal_the_owner_sends_to_roots_child_never_drains(site: Site, sig: int) -> None:
    cfg = site.cfg()
    save(cfg, VICTIM, "good", 1, job="200")
    save(cfg, ATTACKER, "evil", 1, job="100")
    slurm = Recorder()
    with Signaller(ATTACKER, sig, skip=1) as attacker:  # the scan child goes free
        rep = run_epilog(cfg, site.env(ATTACKER, job="100"), slurm)
    assert attacker._sent >= 1  # the flush child got the signal
    assert steps(cfg, "pfs", VICTIM, "good") == [1]
    # The signal did nothing: the owner's checkpoint is flushed too, nothing drained.
    assert steps(cfg, "pfs", ATTACKER, "evil") == [1], rep.line()
    assert rep.backlog == (0, 0) and not slurm.drained, (rep.line(), slurm.drains)


def _segfault() -> None:
    ctypes.string_at(0)  # a real fault: a read at address 0


@pytest.mark.parametrize(
    "fault, name", [(_segfault, "SIGSEGV"), (os.abort, "SIGABRT")], ids=["segv", "abort"]
)
def test_a_real_fault_of_the_child_is_still_a_fault(
    users: Any, fault: Callable[[], None], name: str
) -> None:
    """The blocked crash signals do not hide the child's own faults: still a real
    failure (not :class:`ChildKilled`, the user's doing)."""
    with pytest.raises(AsUserError, match=f"killed by {name}") as err:
        run_as_user(VICTIM, fault, timeout=60)
    assert not isinstance(err.value, ChildKilled) and not err.value.user_caused


def test_a_scan_that_hangs_costs_the_other_users_only_its_share(site: Site) -> None:
    """The first user's scan child (``ckptuser1`` sorts first) is stopped by its own
    user and, with a long stall limit, would hold root until the scan time is spent:
    the other user's new checkpoint, not in the ledger yet, would then not even be
    seen. Each user's scan gets an even share of the scan time left instead."""
    cfg = site.cfg(hooks={"budget": 20, "child_timeout": "60s"})
    save(cfg, VICTIM, "hog", 1, job="50")
    save(cfg, ATTACKER, "new", 1, job="100")
    slurm = Recorder()
    with Stopper(VICTIM):  # every child of ckptuser1, the scan first
        rep = run_epilog(cfg, site.env(ATTACKER, job="100"), slurm)
    assert steps(cfg, "pfs", ATTACKER, "new") == [1], rep.line()
    assert rep.seconds <= 20, rep.line()
