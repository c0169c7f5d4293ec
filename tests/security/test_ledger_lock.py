"""Attack 3: a user holds ``flock(LOCK_EX)`` on root's ``ledger.lock`` (flock works on a
read-only descriptor), so that every root writer of the ledger times out and the
victim's epilog fails with their checkpoint unflushed. Root's lock files must be ones no
user can open, and an old world-readable one must stop mattering."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from typing import Any, Callable

import pytest

from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.ledger import LOCK_NAME, State
from slurm_ckpt.ledger.events import EventLog

from .conftest import ATTACKER, NODE, VICTIM, Recorder, Site, ids, save, steps


class _Holder:
    """The attacker's process: opens ``path`` read-only and holds LOCK_EX on it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pid = 0

    def __enter__(self) -> _Holder:
        u = ids(ATTACKER)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the attacker
            os.close(r)
            try:
                os.setgroups([])
                os.setresgid(u.gid, u.gid, u.gid)
                os.setresuid(u.uid, u.uid, u.uid)
                fd = os.open(self.path, os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(w, b"1")
                time.sleep(300)
            except OSError as exc:
                os.write(w, f"0{exc.strerror}".encode())
            os._exit(0)
        os.close(w)
        self.pid = pid
        self.answer = os.read(r, 200).decode()
        os.close(r)
        return self

    @property
    def holds(self) -> bool:
        return self.answer == "1"

    def __exit__(self, *exc: Any) -> None:
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)


def test_an_old_readable_lock_held_by_a_user_no_longer_blocks_root(
    site: Site, no_hang: Callable
) -> None:
    cfg = site.cfg()
    save(cfg, VICTIM, "run", 1)
    led_dir = cfg.ledger.dir
    led_dir.mkdir(mode=0o755, exist_ok=True)
    old = led_dir / LOCK_NAME
    old.write_bytes(b"")  # as an older version left it: 0644, anyone may open it
    os.chmod(old, 0o644)
    no_hang(120)
    with _Holder(str(old)) as holder:
        assert holder.holds  # the attack works on the old file...
        slurm = Recorder()
        t0 = time.monotonic()
        rep = run_epilog(cfg, site.env(VICTIM), slurm, budget=20)
        took = time.monotonic() - t0
    # ... but root replaced it, so the epilog flushed within its budget.
    assert steps(cfg, "pfs", VICTIM, "run") == [1] and took < 20
    assert rep.backlog == (0, 0) and not slurm.drained
    assert site.ledger(cfg).get(VICTIM, "run", 1).state("pfs") is State.VERIFIED
    st = os.lstat(old)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0


def test_root_lock_files_cannot_even_be_opened_by_users(site: Site) -> None:
    cfg = site.cfg()
    save(cfg, VICTIM, "run", 1)
    run_epilog(cfg, site.env(VICTIM))
    EventLog.from_config(cfg, NODE).emit("hook", hook="test")
    locks = [cfg.ledger.dir / LOCK_NAME, cfg.ledger.dir / "events.jsonl.lock"]
    for path in locks:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        with _Holder(str(path)) as holder:
            assert not holder.holds and "ermission denied" in holder.answer
    # The ledger directory itself is root's: no user can plant a lock file there.
    st = os.lstat(cfg.ledger.dir)
    assert st.st_uid == 0 and not st.st_mode & 0o022


@pytest.mark.parametrize("what", ["symlink", "fifo"])
def test_a_planted_lock_file_is_replaced_not_followed(site: Site, what: str) -> None:
    cfg = site.cfg()
    save(cfg, VICTIM, "run", 1)
    led_dir = cfg.ledger.dir
    led_dir.mkdir(mode=0o755, exist_ok=True)
    target = site.base / "precious"
    target.write_bytes(b"keep me")
    lock = led_dir / LOCK_NAME
    if what == "symlink":
        lock.symlink_to(target)
    else:
        os.mkfifo(lock)
    run_epilog(cfg, site.env(VICTIM))
    assert steps(cfg, "pfs", VICTIM, "run") == [1]
    assert target.read_bytes() == b"keep me"
    assert stat.S_ISREG(os.lstat(lock).st_mode)
