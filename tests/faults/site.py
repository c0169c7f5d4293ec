"""One campaign run's world: nodes with local tiers, a PFS, the site hooks, the trainer.

Every run gets fresh filesystems (tmpfs, loop-mounted ext4/xfs, or the fault-injecting
FUSE filesystem), its own site config per node (each node's local tier is a different
mount, as on a cluster), and the hooks installed by ``ckpt-slurm install-hooks`` - the
scripts slurmd would run. The hooks run here as root with the environment slurmd gives
them, and talk to the real dev cluster: a node that must stay out of service is really
drained there (``slurm_ckpt:`` reason), and the stager really resumes it. The trainer
(:mod:`tests.faults.worker`) runs as an unprivileged user.

Everything runs the package installed in ``$SLURM_CKPT_VENV`` (what the cluster's jobs
and hooks run), like the other cluster tests.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

from slurm_ckpt.core.config_schema import SECTION_KINDS
from slurm_ckpt.errors import NotFound, TierError, VerifyError
from slurm_ckpt.tiers.posix import PosixTier

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SLURM_CKPT_VENV", "/opt/slurm-ckpt/venv"))
PY = VENV / "bin" / "python"
CKPT_SLURM = VENV / "bin" / "ckpt-slurm"
USER = "ckptuser1"
#: ``[hooks] retry_backoff`` of every run (s): the campaign's stager passes after a fault
#: is healed stand for the stager's passes once the backoff (60 s by default) is over, so
#: it only has to be short; the passes wait it out (:meth:`~tests.faults.campaign.Run.stager`).
RETRY_BACKOFF_S = 0.25
HERE = Path(__file__).resolve().parent

CLOCK_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
/* Shifts CLOCK_REALTIME of Python processes by the double in $CLOCKJUMP_FILE (mmapped,
   so a jump shows at once). Monotonic clocks never jump on a real machine: untouched. */
static volatile double *off;
static int ready, active;
static int (*real_cg)(clockid_t, struct timespec *);
static void init(void) {
    if (ready) return;
    real_cg = dlsym(RTLD_NEXT, "clock_gettime");
    char exe[512];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = 0;
    active = strstr(exe, "python") != NULL;
    const char *p = getenv("CLOCKJUMP_FILE");
    if (active && p) {
        int fd = open(p, O_RDONLY);
        if (fd >= 0) {
            void *m = mmap(0, 8, PROT_READ, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED) off = m;
            close(fd);
        }
    }
    ready = 1;
}
int clock_gettime(clockid_t c, struct timespec *ts) {
    init();
    int r = real_cg(c, ts);
    if (r == 0 && off && (c == CLOCK_REALTIME || c == CLOCK_REALTIME_COARSE)) {
        long long t = ts->tv_sec * 1000000000LL + ts->tv_nsec + (long long)(*off * 1e9);
        ts->tv_sec = t / 1000000000LL;
        ts->tv_nsec = t % 1000000000LL;
    }
    return r;
}
int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int r = clock_gettime(CLOCK_REALTIME, &ts);
    if (tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    return r;
}
time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
"""


class Worker:
    """The campaign trainer in a subprocess (as the job user), its lines read live."""

    def __init__(self, argv: List[str], env: Dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=str(cwd),
            user=USER,
            group=USER,
            extra_groups=[],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: List[str] = []
        self._q: queue.Queue[Optional[str]] = queue.Queue()
        self._done = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def _pump(self, timeout: float) -> bool:
        """Take one line (False at end of output)."""
        if self._done:
            return False
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            return True
        if line is None:
            self._done = True
            return False
        self.lines.append(line)
        return True

    def wait_for(self, pattern: str, timeout: float = 60.0) -> Optional[re.Match[str]]:
        """The first line (seen so far or next) matching ``pattern``; None if the process
        ends first."""
        rx = re.compile(pattern)
        seen = 0
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines[seen:]:
                m = rx.match(line)
                if m:
                    return m
            seen = len(self.lines)
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for /{pattern}/:\n{self.tail()}")
            if not self._pump(0.2) and seen == len(self.lines):
                return None

    def steps(self, tag: str) -> List[int]:
        out = []
        for line in self.lines:
            if line.startswith(tag + " step="):
                out.append(int(line.split("=", 1)[1].split()[0]))
        return out

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def finish(self, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        while self._pump(max(0.05, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                self.kill()
                break
        try:
            return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])


class FaultSite:
    """Nodes, a PFS and the hooks for one run; :meth:`close` undoes every mount."""

    def __init__(self, cluster_env: Dict[str, str], slurm_nodes: List[str], tag: str) -> None:
        self.cluster_env = cluster_env
        self.slurm_nodes = list(slurm_nodes)
        self.base = Path(tempfile.mkdtemp(prefix=f"sckpt-faults-{tag}-", dir="/var/tmp"))
        os.chmod(self.base, 0o755)
        self.out = self.base / "out"
        self.out.mkdir()
        shutil.chown(self.out, USER, USER)
        self.worker_py = self.base / "worker.py"
        shutil.copyfile(HERE / "worker.py", self.worker_py)
        os.chmod(self.worker_py, 0o644)
        self.log = self.base / "hooks.log"
        self._mounts: List[Path] = []
        self._images: List[Path] = []
        self._fuse: List[subprocess.Popen] = []
        self.local: Dict[str, Path] = {}
        self.pfs: Optional[Path] = None
        self.pfs_backing: Optional[Path] = None
        self.fuse_control: Dict[str, Path] = {}
        self.sections: Dict[str, Dict[str, Any]] = {}
        self.clock_file: Optional[Path] = None
        self.clock_lib: Optional[Path] = None
        self.job_seq = 0
        self.downed: Set[str] = set()

    # -- filesystems --------------------------------------------------------------------
    def _mountpoint(self, name: str) -> Path:
        mp = self.base / name
        mp.mkdir()
        return mp

    def tmpfs(self, name: str, size: str = "64m") -> Path:
        mp = self._mountpoint(name)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mp)], check=True
        )
        self._mounts.append(mp)
        return mp

    def loopfs(self, name: str, size_mb: int, fstype: str = "ext4") -> Path:
        img = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".img", dir="/var/tmp")[1])
        self._images.append(img)
        with open(img, "wb") as fh:
            fh.truncate(size_mb * 2**20)
        mkfs = {"ext4": ["mkfs.ext4", "-q", "-F", "-m", "0"], "xfs": ["mkfs.xfs", "-q", "-f"]}
        subprocess.run([*mkfs[fstype], str(img)], check=True, capture_output=True)
        mp = self._mountpoint(name)
        subprocess.run(["mount", "-o", "loop", str(img), str(mp)], check=True)
        self._mounts.append(mp)
        return mp

    def fusefs(self, name: str, backing: Path) -> Path:
        """The fault-injecting FUSE filesystem over ``backing``; rules via
        :meth:`fuse_rules`."""
        mp = self._mountpoint(name)
        control = self.base / f"{name}.control.json"
        control.write_text(json.dumps({"rules": []}))
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.fusefs", str(backing), str(mp), str(control)],
            cwd=str(REPO),
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._fuse.append(proc)
        deadline = time.monotonic() + 20
        while not os.path.ismount(mp):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"FUSE filesystem did not mount at {mp}")
            time.sleep(0.05)
        self._mounts.append(mp)
        self.fuse_control[name] = control
        return mp

    def fuse_rules(self, name: str, rules: List[Dict[str, Any]], seed: int = 0) -> None:
        path = self.fuse_control[name]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rules": rules, "seed": seed}))
        os.replace(tmp, path)

    def fuse_hits(self, name: str) -> int:
        hits = Path(str(self.fuse_control[name]) + ".hits")
        try:
            return len(hits.read_text().splitlines())
        except FileNotFoundError:
            return 0

    def add_node(self, kind: str = "tmpfs", size_mb: int = 64) -> str:
        """A node (named after a dev-cluster node, for drains) with its local tier."""
        node = self.slurm_nodes[len(self.local)]
        if kind == "tmpfs":
            self.local[node] = self.tmpfs(f"local-{node}", f"{size_mb}m")
        elif kind == "loop":
            self.local[node] = self.loopfs(f"local-{node}", size_mb)
        elif kind == "fuse":
            backing = self.tmpfs(f"local-{node}-backing", f"{size_mb}m")
            self.local[node] = self.fusefs(f"local-{node}", backing)
        else:
            raise ValueError(kind)
        return node

    def set_pfs(self, kind: str = "loop", size_mb: int = 64) -> Path:
        if kind == "loop":
            self.pfs = self.loopfs("pfs", size_mb)
        elif kind == "fuse":
            self.pfs_backing = self.loopfs("pfs-backing", size_mb)
            os.chmod(self.pfs_backing, 0o1777)
            self.pfs = self.fusefs("pfs", self.pfs_backing)
        else:
            raise ValueError(kind)
        os.chmod(self.pfs, 0o1777)
        return self.pfs

    def wipe_local(self, node: str) -> None:
        """The node's disk is replaced: everything on it is gone."""
        root = self.local[node]
        for entry in os.listdir(root):
            if entry != "lost+found":
                p = root / entry
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

    def clock(self, offset_s: float) -> None:
        """Shift the wall clock of every Python process of the run (see CLOCK_SHIM)."""
        if self.clock_file is None:
            self.clock_file = self.base / "clock"
            self.clock_file.write_bytes(struct.pack("d", 0.0))
            os.chmod(self.clock_file, 0o644)
            src = self.base / "clockjump.c"
            src.write_text(CLOCK_SHIM)
            self.clock_lib = self.base / "libclockjump.so"
            subprocess.run(
                ["gcc", "-shared", "-fPIC", "-O2", "-o", str(self.clock_lib), str(src), "-ldl"],
                check=True,
                capture_output=True,
            )
            os.chmod(self.clock_lib, 0o755)
        with open(self.clock_file, "r+b") as fh:
            fh.write(struct.pack("d", float(offset_s)))

    # -- configuration and hooks --------------------------------------------------------
    def config_path(self, node: str) -> Path:
        return self.base / f"config-{node}.toml"

    def configure(self, **sections: Dict[str, Any]) -> None:
        """Write every node's config: defaults, then ``sections`` (``tiers_pfs={...}``)."""
        for name, values in sections.items():
            self.sections.setdefault(name.replace("_", "."), {}).update(values)
        assert self.pfs is not None
        for node, local in self.local.items():
            data: Dict[str, Dict[str, Any]] = {
                "tiers.local": {"root": str(local), "min_free": "1MiB"},
                "tiers.pfs": {"root": str(self.pfs)},
                "hooks": {
                    "budget": "8s",
                    "stage_on_requeue": False,
                    "retry_backoff": f"{RETRY_BACKOFF_S}s",
                },
                "retention": {"keep_local": 2},
                "copy": {"chunk_size": "256KiB", "streams": 2},
            }
            for name, values in self.sections.items():
                data.setdefault(name, {}).update(values)
            for name, values in data.items():  # today's form: a shared tier says its kind
                tier = name.partition(".")[2] if name.startswith("tiers.") else ""
                if tier in SECTION_KINDS and tier != "local":
                    values.setdefault("kind", SECTION_KINDS[tier])
            text = "".join(
                f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in values.items())
                for name, values in data.items()
            )
            path = self.config_path(node)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            hooks = self.base / f"hooks-{node}"
            if not hooks.exists():
                self.install_hooks(hooks, path)

    def install_hooks(self, dest: Path, config: Path) -> None:
        """Write the prolog and epilog that ``ckpt-slurm install-hooks --dest DEST --config
        CONFIG --log-file LOG`` writes, with the function it renders them with and the
        budget of the config (loaded, so a broken one fails here as it would there).
        In-process: the command costs a Python start (~0.3 s) per node and run, and
        its own checks (trust, PrologEpilogTimeout) have their own tests."""
        from slurm_ckpt.core.config import load_config
        from slurm_ckpt.ops.install import render_hook

        budget = load_config(config).hooks.budget
        dest.mkdir(mode=0o755)
        for kind in ("prolog", "epilog"):
            script = dest / kind
            script.write_text(
                render_hook(kind, str(CKPT_SLURM), str(config), budget, str(self.log))
            )
            os.chmod(script, 0o755)

    def hook_env(self, node: str, job: str, restart: int = 0) -> Dict[str, str]:
        import pwd

        pw = pwd.getpwnam(USER)
        env = dict(self.cluster_env)
        env.update(
            SLURM_JOB_ID=str(job),
            SLURM_JOB_USER=USER,
            SLURM_JOB_UID=str(pw.pw_uid),
            SLURM_JOB_GID=str(pw.pw_gid),
            SLURMD_NODENAME=node,
            SLURM_NODELIST=node,
            SLURM_JOB_RESTART_COUNT=str(restart),
            SLURM_CKPT_CONFIG=str(self.config_path(node)),
        )
        if self.clock_lib is not None:
            env.update(LD_PRELOAD=str(self.clock_lib), CLOCKJUMP_FILE=str(self.clock_file))
        return env

    def new_job(self) -> str:
        self.job_seq += 1
        return str(900000 + self.job_seq)

    def hook(self, kind: str, node: str, job: str, restart: int = 0) -> subprocess.Popen:
        """Start the installed prolog/epilog script as slurmd would (own session, so a
        test can kill the whole hook)."""
        return subprocess.Popen(
            [str(self.base / f"hooks-{node}" / kind)],
            env=self.hook_env(node, job, restart),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def run_hook(self, kind: str, node: str, job: str, restart: int = 0) -> int:
        proc = self.hook(kind, node, job, restart)
        return proc.wait(timeout=120)

    def run_hooks(self, kind: str, nodes: List[str], job: str, restart: int = 0) -> List[int]:
        """The hook on each of ``nodes`` at once, as the slurmd of each node of an
        allocation runs its own; returns their exit statuses once all are done."""
        procs = [self.hook(kind, node, job, restart) for node in nodes]
        return [proc.wait(timeout=120) for proc in procs]

    def stager(self, node: str) -> subprocess.Popen:
        env = self.hook_env(node, "1")
        return subprocess.Popen(
            [str(CKPT_SLURM), "stager", "--once", "--node", node],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def worker(self, node: str, job: str, key: str, restart: int = 0, **args: Any) -> Worker:
        progress = args.pop("progress", None) or self.progress(key)
        argv = [
            str(PY), str(self.worker_py),
            "--config", str(self.config_path(node)),
            "--key", key,
            "--job", job,
            "--node", node,
            "--progress", str(progress),
        ]  # fmt: skip
        crash_at, crash_log = args.pop("crash_at", None), args.pop("crash_log", None)
        extra_env: Dict[str, str] = args.pop("env", None) or {}  # e.g. ckpt-srun's relaunch
        for k, v in args.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": "/tmp",
            "SLURM_JOB_ID": job,
            "SLURM_RESTART_COUNT": str(restart),
            "SLURM_CKPT_CONFIG": str(self.config_path(node)),
        }
        if crash_at is not None:  # SIGKILL at the N-th crash point (slurm_ckpt.core.faults)
            env.update(SLURM_CKPT_CRASH_AT=str(crash_at), SLURM_CKPT_CRASH_LOG=str(crash_log))
        env.update(extra_env)
        if self.clock_lib is not None:
            env.update(LD_PRELOAD=str(self.clock_lib), CLOCKJUMP_FILE=str(self.clock_file))
        return Worker(argv, env, self.out)

    def progress(self, key: str) -> Path:
        return self.out / f"{key}.progress"

    def reached(self, key: str) -> int:
        try:
            return int(json.loads(self.progress(key).read_text())["step"])
        except (OSError, ValueError, KeyError):
            return 0

    # -- SLURM --------------------------------------------------------------------------
    def scontrol(self, *args: str) -> str:
        proc = subprocess.run(
            ["scontrol", *args], env=self.cluster_env, capture_output=True, text=True, timeout=60
        )
        return proc.stdout

    def node_reason(self, node: str) -> Optional[str]:
        """The drain reason if the node is drained, else None."""
        out = self.scontrol("-o", "show", "node", node)
        state = re.search(r"\bState=(\S+)", out)
        if not state or "DRAIN" not in state.group(1):
            return None
        m = re.search(r"\bReason=(.*?)(?: \S+=|$)", out)
        return m.group(1) if m else ""

    def resume(self, node: str) -> None:
        self.scontrol("update", f"nodename={node}", "state=resume")

    def node_down(self, node: str) -> None:
        """The node is lost: SLURM marks it DOWN (what a partner's epilog asks before it
        flushes a partner copy, node/partner_flush.py); :meth:`close` resumes it."""
        self.scontrol("update", f"nodename={node}", "state=down", "reason=fault campaign: lost")
        self.downed.add(node)

    # -- tiers --------------------------------------------------------------------------
    def tiers(self) -> Dict[str, PosixTier]:
        """``local:<node>`` for each node, and ``pfs``."""
        out = {f"local:{n}": PosixTier("local", str(p)) for n, p in self.local.items()}
        assert self.pfs is not None
        out["pfs"] = PosixTier("pfs", str(self.pfs))
        return out

    def verified(self, tier: PosixTier, key: str) -> Dict[int, bool]:
        """Listed steps of ``key`` on ``tier`` -> whether each verifies now."""
        out: Dict[int, bool] = {}
        try:
            steps = [s.step for s in tier.steps(USER, key)]
        except (NotFound, TierError, OSError):
            return out
        for step in steps:
            try:
                out[step] = bool(tier.verify(USER, key, step).ok)
            except NotFound:
                continue  # deleted between listing and verifying
            except (VerifyError, TierError, OSError):
                out[step] = False
        return out

    # -- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        for node in self.local:
            if node in self.downed or (self.node_reason(node) or "").startswith("slurm_ckpt:"):
                self.resume(node)
        for mp in reversed(self._mounts):
            if self.fuse_control.get(mp.name) is not None:
                subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
            elif subprocess.run(["umount", str(mp)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(mp)], capture_output=True)
        for proc in self._fuse:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for img in self._images:
            img.unlink(missing_ok=True)
        shutil.rmtree(self.base, ignore_errors=True)


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps(str(v))
