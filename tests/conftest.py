"""Shared fixtures: real filesystems (tmpfs and loop-mounted ext4/xfs) for tiers.

Tests run as root (as CI does) because they mount filesystems and switch users; a test
that needs root fails with a clear message instead of skipping, since a skip would hide
that the rule it checks was never exercised.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, List, Tuple

import pytest

#: The dev-cluster fixture (``slurm_cluster``) and the S3 server (``s3_server``),
#: registered once for every test module.
pytest_plugins = ("helpers.cluster", "helpers.s3")

REPO = Path(__file__).resolve().parents[1]
#: cgroup v1 block-I/O throttling (caps a loop device's bandwidth, see Mounts.loopfs).
BLKIO = Path("/sys/fs/cgroup/blkio")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("this test mounts filesystems and switches users: run the suite as root")


class Mounts:
    """Mounts made by one test, undone at teardown (lazy unmount if still busy)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.mounted: List[Path] = []
        self.images: List[Path] = []
        self.throttled: List[Tuple[Path, str]] = []

    def tmpfs(self, size: str = "4m", name: str = "tmpfs") -> Path:
        need_root()
        mnt = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.base))
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)], check=True
        )
        self.mounted.append(mnt)
        return mnt

    def loopfs(
        self, size_mb: int = 64, fstype: str = "ext4", name: str = "loop", bps: int = 0
    ) -> Path:
        """A fresh loop-mounted filesystem; with ``bps`` its device reads and writes at
        most that many bytes per second (the kernel's blkio throttle: an HDD-like disk)."""
        need_root()
        img = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".img", dir="/var/tmp")[1])
        self.images.append(img)
        with open(img, "wb") as fh:
            fh.truncate(size_mb * 2**20)
        mkfs = {"ext4": ["mkfs.ext4", "-q", "-F"], "xfs": ["mkfs.xfs", "-q", "-f"]}[fstype]
        subprocess.run(mkfs + [str(img)], check=True, capture_output=True)
        mnt = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.base))
        subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
        self.mounted.append(mnt)
        if bps:
            self._throttle(mnt, bps)
        return mnt

    def _throttle(self, mnt: Path, bps: int) -> None:
        dev = subprocess.run(
            ["findmnt", "-no", "SOURCE", str(mnt)], capture_output=True, text=True, check=True
        ).stdout.strip()
        rdev = os.stat(dev).st_rdev
        majmin = f"{os.major(rdev)}:{os.minor(rdev)}"
        for op in ("read", "write"):
            knob = BLKIO / f"blkio.throttle.{op}_bps_device"
            if not knob.exists():
                pytest.fail(f"no {knob}: cannot cap the bandwidth of {dev}")
            knob.write_text(f"{majmin} {bps}")
            self.throttled.append((knob, majmin))

    def close(self) -> None:
        for knob, majmin in self.throttled:  # before the loop device is given back
            with contextlib.suppress(OSError):
                knob.write_text(f"{majmin} 0")
        self.throttled.clear()
        for mnt in reversed(self.mounted):
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        for img in self.images:
            img.unlink(missing_ok=True)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Mounts]:
    m = Mounts(tmp_path)
    try:
        yield m
    finally:
        m.close()


@pytest.fixture(scope="session")
def pfs_ext4() -> Iterator[Path]:
    """One loop-mounted ext4 'PFS' shared by the tests of a session (cleaned per test)."""
    base = Path(tempfile.mkdtemp(prefix="pfs-session-", dir="/var/tmp"))
    m = Mounts(base)
    try:
        yield m.loopfs(256, "ext4", "pfs")
    finally:
        m.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pfs(pfs_ext4: Path) -> Iterator[Path]:
    d = pfs_ext4 / f"t{os.getpid()}-{len(os.listdir(pfs_ext4))}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def run_as() -> Callable[..., subprocess.CompletedProcess]:
    """Run a command as an unprivileged user (root bypasses permission checks)."""

    def _run(args: List[str], user: str = "nobody", **kw: object) -> subprocess.CompletedProcess:
        need_root()
        env = dict(os.environ, PYTHONPATH=str(REPO), HOME="/tmp")
        return subprocess.run(args, user=user, env=env, capture_output=True, text=True, **kw)

    return _run


def in_child_as(uid: int, gid: int, fn: Callable[[], object]) -> object:
    """Run ``fn`` in a forked child with dropped privileges; return its result or raise
    its exception text. (A subprocess as 'nobody' cannot start Python from /root/.pyenv.)"""
    import pickle

    need_root()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = ("err", f"{type(exc).__name__}: {exc}")
        with os.fdopen(w, "wb") as fh:
            pickle.dump(out, fh)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    kind, val = pickle.loads(data)
    if kind == "err":
        raise RuntimeError(val)
    return val


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Every test that uses the dev cluster carries the ``cluster`` marker, so that
    ``-m "not cluster"`` selects the rest (deselected tests are not skips: they were not
    asked for)."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped test is not a passed one: the run fails if anything was skipped (set
    SLURM_CKPT_ALLOW_SKIPS=1 to explore locally, never in CI)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped and not os.environ.get("SLURM_CKPT_ALLOW_SKIPS"):
        reporter.write_line(
            f"FAILED: {len(skipped)} test(s) skipped; a skip is not a pass "
            "(run as root with scripts/test so that everything runs)",
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
