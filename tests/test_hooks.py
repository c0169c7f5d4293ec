"""Root-side hooks on real filesystems (tmpfs local tier, a directory PFS), no SLURM:
privilege dropping, prolog checks and repairs, epilog flush/hand-off/retention, the
stager, symlink and hard-link attacks, privacy between users, the hook scripts, and the
ckpt-srun requeue policy. The SLURM side is in test_cluster_e2e.py."""

from __future__ import annotations

import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest
from click.testing import CliRunner
from conftest import Mounts, need_root

from slurm_ckpt.cli import hooks_cmds
from slurm_ckpt.cli.main import cli as ckpt_cli
from slurm_ckpt.cli.main import main as ckpt_main
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import UserIds, user_ids
from slurm_ckpt.errors import CkptError, InvalidName, TierError
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.prolog import PrologFailed, ensure_user_dir, run_prolog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger import State
from slurm_ckpt.node.asuser import (
    AsUserError,
    AsUserTimeout,
    ChildGarbled,
    ChildStopped,
    decode_list,
    decode_value,
    run_as,
    run_as_user,
)
from slurm_ckpt.node.flush_engine import HANDED_TO_STAGER
from slurm_ckpt.node.guard import check_local_tier, ensure_ledger_dir
from slurm_ckpt.node.work import NodeWork
from slurm_ckpt.ops import install as install_mod
from slurm_ckpt.ops.srun import resolve_key
from slurm_ckpt.slurm.env import HookEnv
from slurm_ckpt.slurm.requeue import requeue_reason, stop_cause
from slurm_ckpt.tiers.copy import CopyResult
from slurm_ckpt.tiers.registry import tiers_from_config

pytestmark = pytest.mark.root
USERS = ("ckptuser1", "ckptuser2")
REPO = Path(__file__).resolve().parents[1]


def _ensure_users() -> None:
    need_root()
    for u in USERS:
        try:
            pwd.getpwnam(u)
        except KeyError:
            subprocess.run(["useradd", "--create-home", u], check=True)


def ids(user: str) -> UserIds:
    return user_ids(user)


class Area:
    """A tmpfs local tier, a PFS directory, a config; all reachable by the job users."""

    def __init__(self, base: Path, mounts: Mounts) -> None:
        self.base = base
        self.mounts = mounts  # below base (0755): reachable by the job users
        self.local = mounts.tmpfs("64m", "local")
        self.pfs = base / "pfs"
        self.pfs.mkdir()
        os.chmod(self.pfs, 0o1777)  # users create their own directories, like a real PFS
        self.overrides: Dict[str, Any] = {}

    def cfg(self, **sections: Any) -> Config:
        data: Dict[str, Any] = {
            "tiers": {
                "local": {"root": str(self.local), "min_free": 0},
                "pfs": {"kind": "posix", "root": str(self.pfs)},
            },
            "copy": {"chunk_size": "1MiB", "streams": 2},
            "hooks": {"budget": 30},
        }
        for name, values in sections.items():
            if name in ("local", "pfs"):
                data["tiers"][name].update(values)
            else:
                data.setdefault(name, {}).update(values)
        return Config.from_dict(data)

    def env(self, user: str, job: str = "100", restart: int = 0, node: str = "n1") -> HookEnv:
        u = ids(user)
        return HookEnv(job, u.name, u.uid, u.gid, node, [node], restart)


@pytest.fixture
def area() -> Iterator[Area]:
    _ensure_users()
    base = Path(tempfile.mkdtemp(prefix="sckpt-hooks-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    m = Mounts(base)
    try:
        yield Area(base, m)
    finally:
        m.close()
        shutil.rmtree(base, ignore_errors=True)


def _save(cfg: Config, user: str, key: str, step: int, nbytes: int = 4096, job: str = "100"):
    def write() -> int:
        tier = tiers_from_config(cfg)["local"]
        w = tier.writer(user, key, step, job=job)
        w.write_buffers({"model.bin": os.urandom(nbytes), "sub/opt.bin": b"o" * 100})
        w.commit()
        return step

    return run_as_user(user, write)


def save(cfg: Config, user: str, key: str, step: int, nbytes: int = 4096, job: str = "100"):
    """Write a checkpoint as ``user`` (its directory prepared as the prolog would)."""
    ensure_user_dir(str(cfg.tiers.local.root), ids(user))
    return _save(cfg, user, key, step, nbytes, job)


def pfs_steps(cfg: Config, user: str, key: str) -> list:
    return [s.step for s in tiers_from_config(cfg)["pfs"].steps(user, key)]


def local_steps(cfg: Config, user: str, key: str) -> list:
    return [s.step for s in tiers_from_config(cfg)["local"].steps(user, key)]


def secret_file(area: Area) -> Path:
    p = area.base / "root-secret"
    p.write_bytes(b"TOP-SECRET-ROOT-DATA")
    os.chmod(p, 0o600)
    return p


def assert_untouched(p: Path) -> None:
    st = p.stat()
    assert p.read_bytes() == b"TOP-SECRET-ROOT-DATA"
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)


def tree_contains(root: Path, needle: bytes) -> bool:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            if not p.is_symlink() and needle in p.read_bytes():
                return True
    return False


# --------------------------------------------------------------------------- asuser


def test_run_as_drops_privileges_completely() -> None:
    _ensure_users()
    u = ids("ckptuser1")

    def probe() -> Dict[str, Any]:
        try:
            os.setuid(0)
            regained = True
        except PermissionError:
            regained = False
        return {
            "res": list(os.getresuid()),
            "gres": list(os.getresgid()),
            "groups": os.getgroups(),
            "cwd": os.getcwd(),
            "umask": os.umask(0),
            "home": os.environ["HOME"],
            "regained": regained,
        }

    got = run_as(u.uid, u.gid, probe, user=u.name)
    assert got["res"] == [u.uid] * 3 and got["gres"] == [u.gid] * 3
    assert 0 not in got["groups"] and got["cwd"] == "/" and got["umask"] == 0o077
    assert got["home"] == pwd.getpwnam("ckptuser1").pw_dir and got["regained"] is False
    with pytest.raises(AsUserError, match="PermissionError"):
        run_as_user("ckptuser1", Path("/etc/shadow").read_bytes)


def test_run_as_passes_errors_back_as_one_line() -> None:
    _ensure_users()

    def tier_fail() -> None:
        raise TierError("pfs:/x: no space\nleft on device")

    with pytest.raises(TierError) as err:
        run_as_user("ckptuser1", tier_fail)
    assert str(err.value) == "pfs:/x: no space left on device"

    with pytest.raises(AsUserError) as err2:
        run_as_user("ckptuser1", os.listdir, "/root", what="list")
    assert "list as ckptuser1: PermissionError" in str(err2.value)
    assert err2.value.errno == 13  # type: ignore[attr-defined]
    with pytest.raises(AsUserError, match="killed by SIGKILL"):
        run_as_user("ckptuser1", lambda: os.kill(os.getpid(), 9))
    with pytest.raises(AsUserError, match="invalid uid"):
        run_as(-1, 0, print)


def _is_fifo(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def _forge(blob: bytes) -> None:
    """In the child, as the user: write ``blob`` to root's result pipe (the one fd above
    2 left open) and exit - what a user who ptraces their own child could send."""
    fds = [int(n) for n in os.listdir("/proc/self/fd") if int(n) > 2]
    (fd,) = [n for n in fds if _is_fifo(n)]
    os.write(fd, blob)
    os._exit(0)


def test_a_forged_child_result_is_refused_as_garbled_never_trusted() -> None:
    """Root reads a child's result as untrusted data: only the two shapes, a typed value
    only as its type's check allows, an error only as a known class by name."""
    _ensure_users()
    good = CopyResult(3, nbytes=10, copied_bytes=10, seconds=0.5)
    got = run_as_user("ckptuser1", lambda: good)  # typed values travel as their JSON
    assert decode_value(CopyResult.from_json, got, "flush") == good
    forged = {
        "extra key": b'{"ok": 1, "err": {}}',
        "bad error type": b'{"err": {"type": "os.system(1)", "message": "x", "errno": null, '
        b'"ckpt": true}}',
        "not json": b"\x80\x81",
    }
    for blob in forged.values():
        with pytest.raises(ChildGarbled, match="garbled result from the child") as garbled:
            run_as_user("ckptuser1", _forge, blob)
        # only the user can garble their child's result: held, never a drain
        assert garbled.value.user_caused and garbled.value.hold_code == "garbled"
    bad = dict(good.to_json(), copied_bytes=-1)
    for value in (bad, dict(good.to_json(), already_present="yes"), [good.to_json()], None):
        with pytest.raises(AsUserError, match="flush: garbled"):
            decode_value(CopyResult.from_json, value, "flush")
    with pytest.raises(AsUserError, match="garbled"):
        decode_list(CopyResult.from_json, {"ok": good.to_json()}, "flush")
    # An error comes back as root's own class of that name (its declared facts), and a
    # message of any length is cut to one bounded line.
    blob = (
        b'{"err": {"type": "ChildStopped", "message": "' + b"x " * 10000 + b'", '
        b'"errno": null, "ckpt": true}}'
    )
    with pytest.raises(ChildStopped) as err:
        run_as_user("ckptuser1", _forge, blob)
    assert err.value.user_caused and len(str(err.value)) <= 4096


def test_run_as_timeout_kills_the_whole_child_group(tmp_path: Path) -> None:
    _ensure_users()
    pidfile = Path(tempfile.mkdtemp(dir="/var/tmp")) / "pid"
    os.chmod(pidfile.parent, 0o777)

    def spawn_and_hang() -> None:
        p = subprocess.Popen(["/bin/sleep", "3600"])
        pidfile.write_text(str(p.pid))
        time.sleep(60)

    t0 = time.monotonic()
    with pytest.raises(AsUserTimeout, match="timed out after 1s"):
        run_as_user("ckptuser1", spawn_and_hang, timeout=1)
    assert time.monotonic() - t0 < 5
    grandchild = int(pidfile.read_text())
    try:  # a pidfd turns readable once the process has died: a wait, not a poll
        fd = os.pidfd_open(grandchild)
    except ProcessLookupError:
        pass  # dead and reaped already
    else:
        try:
            ready, _, _ = select.select([fd], [], [], 60)  # a safety net, far below 3600
        finally:
            os.close(fd)
        if not ready:
            os.kill(grandchild, signal.SIGKILL)
            pytest.fail(f"grandchild {grandchild} survived the timeout")
    shutil.rmtree(pidfile.parent, ignore_errors=True)


# --------------------------------------------------------------------------- prolog


def test_user_dir_created_owned_0700_and_idempotent(area: Area) -> None:
    root = str(area.local)
    u = ids("ckptuser1")
    assert ensure_user_dir(root, u) == "created"
    st = os.lstat(area.local / "ckptuser1")
    assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid) == (u.uid, u.gid)
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert ensure_user_dir(root, u) == "ok"
    os.chmod(area.local / "ckptuser1", 0o755)
    assert ensure_user_dir(root, u) == "fixed mode"
    assert stat.S_IMODE(os.lstat(area.local / "ckptuser1").st_mode) == 0o700


def test_user_dir_planted_symlink_or_foreign_dir_is_moved_aside(area: Area) -> None:
    root = area.local
    secret = secret_file(area)
    u = ids("ckptuser1")
    # Another user (or the user) planted a symlink where the prolog will chown/chmod.
    os.symlink(secret, root / "ckptuser1")
    what = ensure_user_dir(str(root), u)
    assert what.startswith("replaced a symbolic link")
    assert_untouched(secret)
    assert stat.S_ISDIR(os.lstat(root / "ckptuser1").st_mode)
    # ckptuser2 pre-created ckptuser1's directory (e.g. to read what lands there).
    shutil.rmtree(root / "ckptuser1")
    v = ids("ckptuser2")
    os.mkdir(root / "ckptuser1", 0o777)
    os.chown(root / "ckptuser1", v.uid, v.gid)
    assert "owned by uid" in ensure_user_dir(str(root), u)
    st = os.lstat(root / "ckptuser1")
    assert st.st_uid == u.uid and stat.S_IMODE(st.st_mode) == 0o700
    aside = [n for n in os.listdir(root) if n.startswith(".slurm_ckpt-quarantine-ckptuser1")]
    assert len(aside) == 2  # kept, never deleted


def test_user_dir_just_made_by_another_prolog_is_taken_over_not_moved_aside(
    area: Area,
) -> None:
    """Two jobs of one user start on a node at once: one prolog's mkdir leaves root's
    directory for a moment before its fchown. The other prolog must take it over; moving
    it aside made the first prolog's open fail (ENOENT) and drained the node (CI, stop 38:
    "prolog: .../ckptuser1: no such file or directory")."""
    root = area.local
    u = ids("ckptuser1")
    os.mkdir(root / "ckptuser1", 0o700)  # root's, as a concurrent prolog's mkdir left it
    assert ensure_user_dir(str(root), u) == "ok"
    st = os.lstat(root / "ckptuser1")
    assert (st.st_uid, st.st_gid) == (u.uid, u.gid) and stat.S_IMODE(st.st_mode) == 0o700
    assert not [n for n in os.listdir(root) if n.startswith(".slurm_ckpt-quarantine-")]


def test_a_node_scan_during_another_prolog_reports_no_squat(area: Area) -> None:
    """The other side of that race: a hook scanning the local tier while a prolog's fresh
    directory is still root's skips it quietly (nothing of the user's is in it yet) and
    reports no squat; a directory of another user is still refused and reported."""
    cfg = area.cfg()
    root = area.local
    os.mkdir(root / "ckptuser1", 0o700)  # root's: a prolog's mkdir before its chown
    work = NodeWork(cfg, "n1")
    assert "ckptuser1" not in [u.name for u in work.local_users()]
    assert work.refused == []
    os.chown(root / "ckptuser1", ids("ckptuser2").uid, ids("ckptuser2").gid)
    work.local_users()
    assert [(r["user"], r["code"]) for r in work.refused] == [("ckptuser1", "squatted")]


def _prolog_user_dir(root: str, u: UserIds, go: Any, out: Any) -> None:
    go.wait()
    try:
        ensure_user_dir(root, u)
        out.put("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put(f"{type(exc).__name__}: {exc}")


def test_prologs_of_one_user_racing_on_a_fresh_node_all_succeed(area: Area) -> None:
    """The same race with real processes: 6 prologs of one user released at once on a
    node where the user has no directory yet, 40 rounds. Every prolog succeeds, one
    directory results (the user's, 0700), and nothing is moved aside."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    u = ids("ckptuser1")
    for rnd in range(40):
        root = area.local / f"r{rnd}"
        root.mkdir()
        go, out = ctx.Barrier(6), ctx.Queue()
        procs = [
            ctx.Process(target=_prolog_user_dir, args=(str(root), u, go, out)) for _ in range(6)
        ]
        for p in procs:
            p.start()
        got = [out.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        assert got == ["ok"] * 6, (rnd, got)
        assert os.listdir(root) == ["ckptuser1"], (rnd, os.listdir(root))
        st = os.lstat(root / "ckptuser1")
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (u.uid, 0o700)


def test_ledger_dir_must_be_roots(area: Area) -> None:
    led = area.local / ".slurm_ckpt"
    v = ids("ckptuser2")
    os.mkdir(led, 0o777)
    os.chown(led, v.uid, v.gid)
    os.symlink("/etc/passwd", led / "ledger.lock")  # would be truncated by FileLock
    ensure_ledger_dir(led)
    st = os.lstat(led)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o755 and not os.listdir(led)
    assert any(n.startswith(".slurm_ckpt.untrusted-") for n in os.listdir(area.local))


def test_local_tier_checks(area: Area) -> None:
    cfg = area.cfg(local={"root": str(area.base / "nope")})
    with pytest.raises(PrologFailed, match=r"local tier root .*/nope does not exist"):
        check_local_tier(cfg)
    on_root = area.base / "plain"
    on_root.mkdir()
    assert os.stat(on_root).st_dev == os.stat("/").st_dev
    with pytest.raises(PrologFailed, match="on the root filesystem"):
        check_local_tier(area.cfg(local={"root": str(on_root)}))
    check_local_tier(area.cfg(local={"root": str(on_root), "require_mount": False}))
    small = area.mounts.tmpfs("4m", "small")
    cfg = area.cfg(
        local={"root": str(small), "min_free": "1MiB"}, hooks={"expected_checkpoint_size": "2MiB"}
    )
    with pytest.raises(PrologFailed) as err:
        check_local_tier(cfg)
    msg = str(err.value)
    assert "free, need 7.0MiB" in msg and "expected_checkpoint_size 2.0MiB x" in msg


def test_prolog_fails_cleanly_on_a_full_tier(area: Area) -> None:
    small = area.mounts.tmpfs("4m", "full")
    cfg = area.cfg(local={"root": str(small)})
    with open(small / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    with pytest.raises(PrologFailed) as err:
        run_prolog(cfg, area.env("ckptuser1"))
    assert "write probe" in str(err.value) and "no space left on device" in str(err.value)
    assert "\n" not in str(err.value)


def test_prolog_rescues_what_an_earlier_job_left(area: Area) -> None:
    cfg = area.cfg()
    save(cfg, "ckptuser2", "old", 5, job="90")
    rep = run_prolog(cfg, area.env("ckptuser1", job="91"))
    assert rep.rescue.flushed == [("ckptuser2", "old", 5)]
    assert pfs_steps(cfg, "ckptuser2", "old") == [5]
    st = os.lstat(area.pfs / "ckptuser2")
    assert st.st_uid == ids("ckptuser2").uid and stat.S_IMODE(st.st_mode) == 0o700
    assert (area.local / "ckptuser1").is_dir()
    again = run_prolog(cfg, area.env("ckptuser1", job="91"))  # idempotent
    assert again.user_dir == "ok" and not again.rescue.flushed


def test_prolog_stages_newest_pfs_checkpoint_on_requeue(area: Area) -> None:
    cfg = area.cfg(hooks={"stage_on_requeue": True})
    save(cfg, "ckptuser1", "train", 3, job="77")
    save(cfg, "ckptuser1", "train", 4, job="77")
    run_epilog(cfg, area.env("ckptuser1", job="77"))
    for step in (3, 4):
        tiers_from_config(cfg)["local"].delete("ckptuser1", "train", step)
    assert local_steps(cfg, "ckptuser1", "train") == []
    rep = run_prolog(cfg, area.env("ckptuser1", job="77", restart=1))
    assert rep.staged == "train step 4"
    assert local_steps(cfg, "ckptuser1", "train") == [4]
    assert tiers_from_config(cfg)["local"].verify("ckptuser1", "train", 4).ok
    no = run_prolog(cfg, area.env("ckptuser1", job="78", restart=1))
    assert no.staged is None  # another job: nothing of its own on the PFS


# --------------------------------------------------------------------------- epilog


def test_epilog_flushes_and_retention_never_drops_unflushed(area: Area) -> None:
    cfg = area.cfg(retention={"keep_local": 1})
    for step in (1, 2, 3):
        save(cfg, "ckptuser1", "run", step)
    # ckptuser2 squats ckptuser1's PFS directory: flushing into it must be refused.
    squat = area.pfs / "ckptuser1"
    squat.mkdir(0o777)
    os.chown(squat, ids("ckptuser2").uid, -1)
    rep = run_epilog(cfg, area.env("ckptuser1"))
    assert len(rep.flush.failed) == 3 and "squatted" in rep.flush.failed[0][1]
    assert rep.deleted == 0 and local_steps(cfg, "ckptuser1", "run") == [1, 2, 3]
    assert rep.backlog == (0, 0)  # another user's doing: held, the node is not drained
    shutil.rmtree(squat)
    rep = run_epilog(cfg, area.env("ckptuser1"))
    assert len(rep.flush.flushed) == 3 and rep.deleted == 2 and rep.backlog == (0, 0)
    assert pfs_steps(cfg, "ckptuser1", "run") == [1, 2, 3]
    assert local_steps(cfg, "ckptuser1", "run") == [3]
    pfs = tiers_from_config(cfg)["pfs"]
    assert all(pfs.verify("ckptuser1", "run", s).ok for s in (1, 2, 3))
    led = NodeWork(cfg, "n1").ledger
    assert led.get("ckptuser1", "run", 1).tiers == {"local": State.DELETED, "pfs": State.VERIFIED}
    status = area.pfs / ".slurm_ckpt" / "nodes" / "n1.json"
    assert b'"node":"n1"' in status.read_bytes()


def test_slow_flush_is_handed_to_the_stager(area: Area) -> None:
    cfg = area.cfg(pfs={"bandwidth_limit": "4MB/s"}, hooks={"budget": 1.5})
    for step in (1, 2):
        save(cfg, "ckptuser1", "big", step, nbytes=4_000_000)
    rep = run_epilog(cfg, area.env("ckptuser1"))
    assert rep.flush.handed and rep.backlog[0] >= 1 and rep.seconds < 3
    led = NodeWork(cfg, "n1").ledger
    handed = [led.get(*i) for i in rep.flush.handed]
    assert all(
        r.state("pfs") is State.FLUSH_PENDING and r.error == HANDED_TO_STAGER for r in handed
    )
    assert local_steps(cfg, "ckptuser1", "big") == [1, 2]
    srep = stager_pass(cfg, "n1")
    assert srep.backlog == 0 and not srep.flush.failed
    assert pfs_steps(cfg, "ckptuser1", "big") == [1, 2]


# --------------------------------------------------------------------------- security


def _plant(cfg: Config, user: str, key: str, step: int, target: Path, how: str) -> None:
    step_dir = Path(tiers_from_config(cfg)["local"].step_path(user, key, step))
    victim = step_dir / "model.bin"
    if how == "symlink":

        def swap() -> None:
            os.unlink(victim)
            os.symlink(target, victim)

        run_as_user(user, swap)
    else:  # a hard link (possible where fs.protected_hardlinks = 0): made by root here
        os.unlink(victim)
        os.link(target, victim)


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_planted_links_never_make_root_read_write_or_delete(area: Area, how: str) -> None:
    secret = (area.local / "root-secret") if how == "hardlink" else secret_file(area)
    if how == "hardlink":  # same filesystem as the checkpoint
        secret.write_bytes(b"TOP-SECRET-ROOT-DATA")
        os.chmod(secret, 0o600)
    cfg = area.cfg(retention={"keep_local": 1})
    save(cfg, "ckptuser1", "evil", 1)
    run_epilog(cfg, area.env("ckptuser1"))  # step 1 flushed: retention may delete it later
    save(cfg, "ckptuser1", "evil", 2)
    _plant(cfg, "ckptuser1", "evil", 1, secret, how)  # flushed one: retention target
    _plant(cfg, "ckptuser1", "evil", 2, secret, how)  # unflushed one: flush target
    rep = run_epilog(cfg, area.env("ckptuser1"))
    assert rep.flush.failed
    reason = rep.flush.failed[0][1]
    assert ("hard links" in reason) if how == "hardlink" else ("not a regular file" in reason)
    assert rep.backlog == (0, 0)  # marked BAD: a user cannot keep a node drained
    for _ in range(2):  # held: not tried again before its backoff, never drained for
        srep = stager_pass(cfg, "n1")
        rep = run_epilog(cfg, area.env("ckptuser1"))
        assert srep.backlog == 0 and rep.backlog == (0, 0) and not srep.flush.failed
        assert_untouched(secret)
    assert not tree_contains(area.pfs, b"TOP-SECRET")
    assert pfs_steps(cfg, "ckptuser1", "evil") == [1]
    # A symlinked key directory or user directory is not followed either.
    os.symlink("/etc", area.local / "ckptuser1" / "etc-key")
    rep = run_epilog(cfg, area.env("ckptuser1"))
    assert not (area.pfs / "ckptuser1" / "etc-key").exists()
    assert_untouched(secret)


def test_users_cannot_read_each_others_checkpoints(area: Area) -> None:
    cfg = area.cfg()
    save(cfg, "ckptuser1", "private", 1)
    run_epilog(cfg, area.env("ckptuser1"))
    assert pfs_steps(cfg, "ckptuser1", "private") == [1]
    for tier in (area.local, area.pfs):
        step = tier / "ckptuser1" / "private" / "step-0000000001" / "model.bin"
        for fn in (lambda s=step: os.listdir(s.parents[2]), step.read_bytes):
            with pytest.raises(AsUserError, match="PermissionError"):
                run_as_user("ckptuser2", fn)
        for p in (step.parents[2], step.parents[1], step.parent):
            assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(step).st_mode) == 0o600


# --------------------------------------------------------------------------- scripts


class _FakeClient:
    def __init__(self, limit: Optional[float]) -> None:
        self.limit = limit

    def prolog_epilog_timeout(self) -> Optional[float]:
        return self.limit


def test_install_hooks(
    area: Area, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    conf = area.base / "site.toml"
    conf.write_text(
        f'[tiers.local]\nroot = "{area.local}"\n[tiers.pfs]\nkind = "posix"\nroot = "{area.pfs}"\n'
        '[hooks]\nbudget = "40s"\n'
    )
    monkeypatch.setattr(hooks_cmds, "_client", lambda timeout=10.0: _FakeClient(120.0))
    dest = area.base / "hooks"
    res = CliRunner().invoke(
        ckpt_cli, ["install-hooks", "--dest", str(dest), "--config", str(conf)]
    )
    assert res.exit_code == 0, res.output
    exe = install_mod.ckpt_slurm_path()
    assert os.path.isabs(exe) and os.access(exe, os.X_OK)
    for kind in ("prolog", "epilog"):
        p = dest / kind
        text = p.read_text()
        assert stat.S_IMODE(p.stat().st_mode) == 0o755
        assert f"CKPT_SLURM={exe}\n" in text and f"SLURM_CKPT_CONFIG={conf}\n" in text
        assert "BUDGET=40 " in text and "LIMIT=45 " in text and "export PATH=/" in text
        subprocess.run(["bash", "-n", str(p)], check=True)
    # The stager's unit runs the same ckpt-slurm and config as the hooks (an upgrade to a
    # new venv moves both; the shipped unit hard-codes /opt/slurm-ckpt/venv).
    unit = (dest / "slurm-ckpt-stager.service").read_text()
    assert f"\nExecStart={exe} stager --interval 30\n" in unit, unit
    assert f"\nEnvironment=SLURM_CKPT_CONFIG={conf}\n" in unit, unit
    assert "stager unit for this installation" in res.output
    assert "does not exist" not in res.output  # both roots are there
    # A root missing on the installing node: installed all the same (it may be a login
    # node), but said, since every prolog on a node without it refuses the job.
    gone = area.base / "no-such-local"
    conf2 = area.base / "site2.toml"
    conf2.write_text(conf.read_text().replace(str(area.local), str(gone)))
    res = CliRunner().invoke(
        ckpt_cli, ["install-hooks", "--dest", str(dest), "--config", str(conf2)]
    )
    assert res.exit_code == 0, res.output
    assert f"warning: the local tier's root {gone} does not exist on this node" in res.output
    assert str(area.pfs) not in res.output.split("warning:", 1)[1]
    monkeypatch.setattr(hooks_cmds, "_client", lambda timeout=10.0: _FakeClient(45.0))
    with pytest.raises(SystemExit) as ex:
        ckpt_main(["install-hooks", "--dest", str(dest), "--config", str(conf)])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ckpt-slurm: error: ") and "PrologEpilogTimeout=45s" in err


def test_repo_hooks_are_the_rendered_defaults() -> None:
    for kind in ("prolog", "epilog"):
        p = REPO / "hooks" / kind
        assert p.read_text() == install_mod.render_hook(kind), f"regenerate hooks/{kind}"
        assert os.access(p, os.X_OK)


def test_hook_script_timeout_drains_and_logs(area: Area) -> None:
    fake = area.base / "fake-ckpt-slurm"
    fake.write_text("#!/bin/sh\necho starting\nexec /bin/sleep 60\n")
    fake.chmod(0o755)
    logf = area.base / "hooks.log"
    script = area.base / "epilog"
    script.write_text(
        install_mod.render_hook("epilog", str(fake), "/nonexistent.toml", 0.2, str(logf))
    )
    script.chmod(0o755)
    t0 = time.monotonic()
    proc = subprocess.run([str(script)], env={}, capture_output=True, timeout=30)
    assert proc.returncode == 0  # an epilog that timed out drains with our reason
    assert time.monotonic() - t0 < install_mod.GRACE_S + 5
    log = logf.read_text()
    assert "starting" in log and "slurm_ckpt: epilog timed out after 5.2s" in log


# --------------------------------------------------------------------------- srun policy


def test_ckpt_srun_requeue_policy() -> None:
    def decide(state, reason, restarts, max_requeues, *, warned=True, terminated=False, **kw):
        cause = stop_cause(state, reason, warned=warned, terminated=terminated)
        return requeue_reason(cause, restarts=restarts, max_requeues=max_requeues, **kw)

    assert decide("RUNNING", None, 0, 5)
    assert decide("RUNNING", None, 5, 5) is None  # cap
    assert decide("COMPLETING", None, 0, 5) is None
    assert decide("RUNNING", "Preempted", 0, 5) is None
    assert decide("RUNNING", None, 0, 5, enabled=False) is None
    assert decide("RUNNING", None, 0, 5, warned=False) is None  # finished
    # SLURM requeues preemptions itself
    assert decide("RUNNING", None, 0, 5, terminated=True) is None
    # The in-job library asks the same rule with the job's state as the cause.
    assert requeue_reason("TIMEOUT") and requeue_reason("PREEMPTED") is None


def test_ckpt_srun_key() -> None:
    assert resolve_key("run-1", {}) == "run-1"
    assert resolve_key(None, {"SLURM_CKPT_KEY": "a", "SLURM_JOB_NAME": "b"}) == "a"
    assert resolve_key(None, {"SLURM_JOB_NAME": "llama", "SLURM_JOB_ID": "9"}) == "llama"
    assert resolve_key(None, {"SLURM_JOB_NAME": "my job", "SLURM_JOB_ID": "9"}) == "job-9"
    with pytest.raises(InvalidName):
        resolve_key("../x", {})
    assert issubclass(InvalidName, CkptError)


def test_stager_daemon_passes_until_sigterm(area: Area) -> None:
    cfg_file = area.base / "stager.toml"
    cfg_file.write_text(
        f'[tiers.local]\nroot = "{area.local}"\nmin_free = 0\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{area.pfs}"\n'
    )
    save(area.cfg(), "ckptuser1", "daemon", 1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurm_ckpt.cli.main", "--config", str(cfg_file), "stager"]
        + ["--interval", "200ms", "--no-slurm", "--node", "n7"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(2)]  # two passes
        assert lines[0].startswith("stager on n7: flushed 1 ") and "0 still owed" in lines[0]
        assert lines[1].startswith("stager on n7: flushed 0 (0B); 0 still owed")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()
        proc.wait()
    assert pfs_steps(area.cfg(), "ckptuser1", "daemon") == [1]
