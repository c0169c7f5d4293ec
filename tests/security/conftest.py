"""The security suite's stage: real unprivileged users, real filesystems, root running
the real hook and CLI code.

* ``ckptuser1`` is the **victim** (an ordinary user with checkpoints to protect),
  ``ckptuser2`` the **attacker** (any other user of the cluster). Both are created with
  ``useradd`` when this machine does not have them.
* The local tier is a tmpfs, the PFS a directory on a loop-mounted ext4, mode 1777 as
  on the dev cluster (users create their own directories there).
* Everything a user does runs in a real process of that user (``run_as_user``: a forked
  child with dropped privileges); everything root does is the real hook or CLI code.
* SLURM: the hooks take a :class:`Recorder` only where the test is about *what root
  decides* (drain, resume); it records, it does not pretend to be SLURM otherwise.
  Where a test is about what root *asks* SLURM (how many queries, naming what), the
  real client runs stand-in tools instead (:mod:`.fake_slurm`).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
from conftest import Mounts
from helpers.site import HookSite

from slurm_ckpt.core import manifest as manifest_mod
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.hashing import chunk_digest, combine
from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.core.names import UserIds, user_ids
from slurm_ckpt.hooks.prolog import ensure_user_dir
from slurm_ckpt.node import asuser
from slurm_ckpt.node.asuser import run_as_user
from slurm_ckpt.slurm.records import NodeInfo
from slurm_ckpt.tiers.registry import tiers_from_config

REPO = Path(__file__).resolve().parents[2]
VICTIM = "ckptuser1"
ATTACKER = "ckptuser2"
NODE = "n1"
#: A root file no user may read: if it ever shows up anywhere, root leaked it.
SECRET = b"ROOT-ONLY-SECRET-0123456789"

pytestmark = pytest.mark.root


def ids(user: str) -> UserIds:
    return user_ids(user)


@pytest.fixture(scope="session")
def users() -> Dict[str, UserIds]:
    """The victim and the attacker, as real users of this machine."""
    if os.geteuid() != 0:
        pytest.fail("the security suite runs as root (it switches to real users)")
    for user in (VICTIM, ATTACKER):
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--create-home", user], check=True)
    return {u: ids(u) for u in (VICTIM, ATTACKER)}


# --------------------------------------------------------------------------- SLURM


@dataclass
class Recorder:
    """What root asks of SLURM, recorded: drains, resumes, and which jobs (of which
    users) run on the node. For tests about what root decides, nothing else."""

    jobs: List[Tuple[str, str]] = field(default_factory=list)  # (job id, user)
    reason: Optional[str] = None
    drains: List[str] = field(default_factory=list)
    resumes: int = 0

    def node(self, name: str) -> NodeInfo:
        flags = frozenset({"DRAIN"}) if self.reason else frozenset()
        return NodeInfo(name, "IDLE", flags, self.reason)

    def drain(self, name: str, reason: str, force: bool = False) -> Optional[str]:
        if self.reason and not self.reason.startswith("slurm_ckpt:") and not force:
            return None
        self.reason = reason
        self.drains.append(reason)
        return reason

    def resume_if_ours(self, name: str) -> bool:
        if self.reason and self.reason.startswith("slurm_ckpt:"):
            self.reason = None
            self.resumes += 1
            return True
        return False

    def jobs_on_node(self, name: str) -> List[Tuple[str, str, str]]:
        return [(job, user, "RUNNING") for job, user in self.jobs]

    @property
    def drained(self) -> bool:
        return self.reason is not None


# --------------------------------------------------------------------------- the site


class Site(HookSite):
    """One test's tiers and config: a tmpfs local tier, a 1777 PFS on ext4."""

    defaults = {
        "copy": {"chunk_size": "1MiB", "streams": 2},
        "hooks": {"budget": 30, "child_timeout": "2s", "retry_backoff": "60s"},
    }

    def __init__(self, base: Path, local: Path, pfs: Path, mounts: Any) -> None:
        super().__init__(base, local, NODE)
        self.pfs, self.mounts = pfs, mounts

    def warm_tiers(self) -> Dict[str, Dict[str, Any]]:
        return {"pfs": {"kind": "posix", "root": str(self.pfs)}}


@pytest.fixture(scope="session")
def sec_pfs_mount() -> Iterator[Path]:
    """One loop-mounted ext4 for the suite's PFS roots, below a directory the job users
    can traverse (a fresh 1777 root per test: :func:`site`)."""
    base = Path(tempfile.mkdtemp(prefix="sckpt-sec-pfs-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    m = Mounts(base)
    try:
        yield m.loopfs(256, "ext4", "pfs")
    finally:
        m.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pfs(sec_pfs_mount: Path) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="pfs-", dir=sec_pfs_mount))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def site(users: Dict[str, UserIds], pfs: Path) -> Iterator[Site]:
    base = Path(tempfile.mkdtemp(prefix="sckpt-sec-", dir="/var/tmp"))
    os.chmod(base, 0o755)  # below it the job users can reach their tiers
    mounts = Mounts(base)
    try:
        local = mounts.tmpfs("64m", "local")
        os.chmod(pfs, 0o1777)
        yield Site(base, local, pfs, mounts)
    finally:
        mounts.close()
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------- users' doings


def as_user(user: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Run ``fn`` in a real process of ``user`` (its result comes back as JSON)."""
    return run_as_user(user, fn, *args, timeout=120, **kw)


def save(
    cfg: Config,
    user: str,
    key: str,
    step: int,
    nbytes: int = 4096,
    job: str = "100",
    files: int = 0,
):
    """A checkpoint written by ``user`` on the local tier (directory made as the prolog
    would), with the toolkit's own writer; ``files`` more small files (a checkpoint
    with many files, say more than a descriptor limit allows open at once)."""
    ensure_user_dir(str(cfg.tiers.local.root), ids(user))

    def write() -> int:
        w = tiers_from_config(cfg)["local"].writer(user, key, step, job=job, node=NODE)
        bufs = {"model.bin": os.urandom(nbytes), "sub/opt.bin": b"o" * 100}
        bufs.update({f"shards/s{i:05d}.bin": b"s" * 64 for i in range(files)})
        w.write_buffers(bufs)
        w.commit()
        return step

    return as_user(user, write)


def steps(cfg: Config, tier: str, user: str, key: str) -> List[int]:
    return [s.step for s in tiers_from_config(cfg)[tier].steps(user, key)]


def forged_manifest(user: str, key: str, step: int, data: bytes, **fields: Any) -> bytes:
    """The bytes of a manifest for one file ``w.bin`` holding ``data``, with ``fields``
    replaced in its body and a checksum that matches: exactly what a hostile user can
    write (the checksum proves integrity, not good intent)."""
    d = chunk_digest(data)
    good = Manifest(user, key, step, [FileEntry("w.bin", len(data), combine([d]), [d])])
    body = json.loads(good.to_bytes())
    del body["checksum"]
    for name, value in fields.items():
        if name == "files":
            body["files"] = value
        else:
            body[name] = value
    body["checksum"] = manifest_mod._checksum(body)
    return manifest_mod._serialise(body)


def plant_checkpoint(root: str, user: str, key: str, step: int, data: bytes, manifest: bytes):
    """As the current (user) process: ``<root>/<user>/<key>/step-N`` with ``w.bin`` and
    the given manifest bytes. Used inside :func:`as_user`."""
    sdir = os.path.join(root, user, key, step_dirname(step))
    os.makedirs(sdir, mode=0o700, exist_ok=True)
    with open(os.path.join(sdir, "w.bin"), "wb") as fh:
        fh.write(data)
    with open(os.path.join(sdir, "manifest.json"), "wb") as fh:
        fh.write(manifest)
    return sdir


def secret(base: Path) -> Path:
    p = base / "root-secret"
    p.write_bytes(SECRET)
    os.chmod(p, 0o600)
    return p


def tree_contains(root: Path, needle: bytes) -> bool:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            if p.is_symlink() or not p.is_file():
                continue
            try:
                if needle in p.read_bytes():
                    return True
            except OSError:
                continue
    return False


# --------------------------------------------------------------------------- the CLI


def cli(
    *args: str,
    config: Optional[Path] = None,
    env: Optional[Dict[str, str]] = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """``ckpt-slurm ARGS`` as root, in a process of its own. A root command that hangs
    fails the test at ``timeout`` instead of hanging the suite."""
    full = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    argv = [sys.executable, "-m", "slurm_ckpt.cli.main"]
    if config is not None:
        argv += ["--config", str(config)]
    return subprocess.run(
        argv + list(args), env=full, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


# --------------------------------------------------------------------------- attacks


class Stopper:
    """An attacker's process that SIGSTOPs root's children that run as its user.

    No race with a child that finishes fast: while a Stopper is on, each of root's
    children (:func:`~slurm_ckpt.node.asuser.run_as`) of that user stops, once it runs
    as the user and before its work, at a known point (``asuser.child_start_hook``): it
    connects to the attacker's socket and waits for a word. The attacker learns the
    child's pid from the kernel (``SO_PEERCRED``), lets the first ``skip`` children go
    (say, a scan child) and SIGSTOPs every later one there - with a user's rights only,
    as any process of the user may - then waits until the kernel shows it stopped.
    A context manager; on exit the attacker is killed and whatever it stopped is
    continued."""

    def __init__(self, user: str, skip: int = 0) -> None:
        self.user = ids(user)
        self.skip = skip  # let the first ``skip`` children go (say, a scan child)
        self.pid = 0
        self.dir = ""
        self.path = ""
        self._old_hook: Optional[Callable[[], None]] = None

    def __enter__(self) -> Stopper:
        u = self.user
        self.dir = tempfile.mkdtemp(prefix="sckpt-stopper-", dir="/var/tmp")
        os.chown(self.dir, u.uid, u.gid)  # 0700, the attacker's: only they connect
        self.path = os.path.join(self.dir, "attacker.sock")
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the attacker
            try:
                os.close(ready_r)
                os.setgroups([])
                os.setresgid(u.gid, u.gid, u.gid)
                os.setresuid(u.uid, u.uid, u.uid)
                self._attack(ready_w)
            finally:
                os._exit(0)
        os.close(ready_w)
        try:
            if os.read(ready_r, 1) != b"1":  # its socket listens (or it died)
                raise RuntimeError("the attacker's process did not start")
        finally:
            os.close(ready_r)
        self.pid = pid
        self._old_hook = asuser.child_start_hook
        asuser.child_start_hook = self._meet
        return self

    def _attack(self, ready: int) -> None:  # pragma: no cover - the attacker
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.path)
        srv.listen(16)
        os.write(ready, b"1")
        os.close(ready)
        held = []  # the stopped children's connections, kept open
        seen = 0
        while True:
            conn, _ = srv.accept()
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            child, _uid, _gid = struct.unpack("3i", cred)
            seen += 1
            if seen <= self.skip:
                conn.sendall(b"go")
                conn.close()
                continue
            os.kill(child, signal.SIGSTOP)
            held.append(conn)
            while _proc_state(child) not in ("T", "t", "Z", ""):
                time.sleep(0.001)  # until the kernel shows it stopped: no deadline needed

    def _meet(self) -> None:
        """In root's child, as its user: meet the attacker (the known point)."""
        if os.getuid() != self.user.uid:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.path)
            s.recv(2)  # "go"; a stopped child stays here until root kills it

    def __exit__(self, *exc: object) -> None:
        asuser.child_start_hook = self._old_hook
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat(f"/proc/{name}").st_uid == self.user.uid:
                        os.kill(int(name), signal.SIGCONT)
                except OSError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)


def _proc_state(pid: int) -> str:
    """The state letter of ``pid`` in ``/proc`` ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b") ", 1)[1][:1].decode()
    except (OSError, IndexError):
        return ""


@pytest.fixture
def no_hang() -> Iterator[Callable[[int], None]]:
    """``no_hang(seconds)``: fail the test (SIGALRM) rather than hang the suite if root
    code under attack never returns. A safety net, not a speed assertion."""

    def _raise(_sig: int, _frame: Any) -> None:
        raise TimeoutError("root code did not return: it hangs")

    old = signal.signal(signal.SIGALRM, _raise)
    try:
        yield lambda seconds: signal.alarm(seconds)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
