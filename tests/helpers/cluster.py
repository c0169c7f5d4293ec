"""Session-wide SLURM dev cluster (``scripts/dev-cluster``) for tests.

Use it from a test module with::

    pytest_plugins = ("helpers.cluster",)  # registers the `slurm_cluster` fixture

    if TYPE_CHECKING:  # importing it for real would precede, and defeat, its
        from helpers.cluster import DevCluster  # assertion rewriting as a plugin

    def test_something(slurm_cluster):
        jobid = slurm_cluster.sbatch("#!/bin/bash\\nhostname\\n", user="ckptuser1",
                                     extra_args=["-w", "n2"])
        info = slurm_cluster.wait_job_state(jobid, "COMPLETED", timeout=30)

The fixture brings the cluster up once per session (idempotent: reuses a running one)
and leaves it running afterwards (set ``DEV_CLUSTER_TEARDOWN=1`` to stop it at the end).
All waits poll Slurm; nothing sleeps for a fixed time.

What a test sees (defaults; see ``scripts/dev-cluster`` for the DEV_CLUSTER_* knobs):

* nodes ``n1..n3`` (``DEV_CLUSTER_NODES``), partitions ``low`` (default, PriorityTier=1)
  and ``high`` (PriorityTier=10) over all of them; ``high`` preempts ``low`` by REQUEUE;
* ``local_path``: the node-local "NVMe" path as jobs see it (same path on every node,
  a different filesystem on each); ``local_root(node)``: the host-side path of that
  node's filesystem;
* ``pfs_root``: the shared PFS (own xfs/ext4 filesystem, mode 1777), same path on the
  host and in jobs;
* users ``ckptuser1`` and ``ckptuser2`` for unprivileged jobs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "dev-cluster"
JOB_USERS = ("ckptuser1", "ckptuser2")
HOOK_VARS = (
    "DEV_CLUSTER_PROLOG",
    "DEV_CLUSTER_EPILOG",
    "DEV_CLUSTER_REBOOT_PROGRAM",
    "DEV_CLUSTER_EXTRA_CONF",
)

# Job states after which a job will not change by itself (a requeue-able job that hits
# NODE_FAIL or preemption goes back to PENDING instead, so those are not listed).
FINAL_JOB_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "DEADLINE", "BOOT_FAIL"}
)

# The job's Reason when its launch failed and SLURM requeued it held: it stays PENDING
# until an admin releases it, so a wait for it to run or finish can fail at once.
HELD_FOR_FAILURE = frozenset({"launch_failed_requeued_held"})

StatePredicate = Union[str, Iterable[str], Callable[[str], bool]]


class ClusterCommandError(AssertionError):
    """A cluster command failed; the message carries its output."""


def _parse_scontrol_oneliner(line: str) -> Dict[str, str]:
    """One ``scontrol -o show job|node`` line -> dict. Fields are ``Key=Value`` separated
    by single spaces; a token without ``Key=`` continues the previous value (a Reason or
    path with spaces)."""
    out: Dict[str, str] = {}
    key = None
    for tok in line.strip().split(" "):
        if "=" in tok and tok.split("=", 1)[0].replace("/", "").replace(":", "").isalnum():
            key, val = tok.split("=", 1)
            out[key] = val
        elif key is not None:  # a value that contained spaces (e.g. Reason=..., Command=...)
            out[key] += " " + tok
    return out


def _matcher(want: StatePredicate) -> Callable[[str], bool]:
    if callable(want):
        return want
    wanted = {want} if isinstance(want, str) else set(want)
    wanted = {w.upper() for w in wanted}
    return lambda state: state.upper() in wanted


class DevCluster:
    """Handle on the dev cluster; see the module docstring."""

    def __init__(self, script: Path = SCRIPT, base_env: Optional[Dict[str, str]] = None):
        self.script = Path(script)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.last_up_output = ""
        self._load_env()

    # ------------------------------------------------------------- lifecycle --
    def _script(
        self, *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        """Run ``dev-cluster ARGS`` (with the session's environment unless ``env``)."""
        proc = subprocess.run(
            ["bash", str(self.script), *args],
            env=self.base_env if env is None else env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise ClusterCommandError(
                f"dev-cluster {' '.join(args)} failed (rc={proc.returncode}):\n"
                f"{proc.stdout}{proc.stderr}"
            )
        return proc

    def _load_env(self) -> None:
        """Read paths from ``dev-cluster env`` (what the last ``up`` recorded)."""
        out = self._script("env").stdout
        exported: Dict[str, str] = {}
        for line in out.splitlines():
            if line.startswith("export "):
                key, _, val = line[len("export ") :].partition("=")
                exported[key] = shlex.split(val)[0] if val else ""
        self.exported = exported
        self.conf = Path(exported["SLURM_CONF"])
        self.state_dir = Path(exported["DEV_CLUSTER_DIR"])
        self.pfs_root = Path(exported["DEV_CLUSTER_PFS_PATH"])
        self.local_path = Path(exported["DEV_CLUSTER_LOCAL_PATH"])
        self.nodes: List[str] = [f"n{i}" for i in range(1, int(exported["DEV_CLUSTER_NODES"]) + 1)]
        self.jobs_dir = self.state_dir / "jobs"
        env = {
            k: v
            for k, v in self.base_env.items()
            # Never let an outer SLURM job's or user's SLURM_*/SBATCH_* settings leak in.
            if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_"))
        }
        env.update(exported)
        path = env.get("PATH", "")
        for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin"):
            if d not in path.split(":"):
                path = f"{path}:{d}" if path else d
        env["PATH"] = path
        self.env: Dict[str, str] = env

    def up(
        self,
        *,
        prolog: Optional[str] = None,
        epilog: Optional[str] = None,
        reboot_program: Optional[str] = None,
        extra_conf: Optional[str] = None,
        **settings: str,
    ) -> DevCluster:
        """(Re)run ``dev-cluster up``; no-op if nothing changed, else ~3 s of restart
        (running jobs survive it).

        ``prolog``/``epilog``/``reboot_program``/``extra_conf`` hold for this call only:
        one not passed is removed from slurm.conf. Hooks must be absolute paths of
        executables that nodes can see (e.g. under ``jobs_dir`` or the repo); they run
        as root inside the node, with its local path and the PFS mounted. Other keyword
        args become DEV_CLUSTER_* shape settings (``nodes="4"``, ``cpus="8"``...) which
        the script records: they stick for later calls until set again."""
        env = {k: v for k, v in self.base_env.items() if k not in HOOK_VARS}
        env.update({f"DEV_CLUSTER_{k.upper()}": str(v) for k, v in settings.items()})
        for var, val in zip(HOOK_VARS, (prolog, epilog, reboot_program, extra_conf)):
            if val is not None:
                env[var] = str(val)
        self.last_up_output = self._script("up", env=env, timeout=600).stderr
        self._load_env()
        return self

    def down(self) -> None:
        self._script("down")

    def power_off(self, node: str, wipe_local: bool = False) -> None:
        """Kill ``node`` (its slurmd and every process on it, SIGKILL) and leave it off;
        ``wipe_local``: its local disk is lost too. See ``dev-cluster power-off``."""
        self._script("power-off", node, *(["--wipe-local"] if wipe_local else []))

    def reboot_node(self, node: str, wipe_local: bool = False) -> None:
        """Start ``node`` again (or power-cycle it): a fresh slurmd that reports a boot."""
        self._script("reboot-node", node, *(["--wipe-local"] if wipe_local else []))

    def slurmd_running(self, node: str) -> bool:
        """Whether ``node``'s slurmd runs. A node powered off is dead at once, while
        SLURM lists it as it was until ``SlurmdTimeout`` passes (``power-off`` removes
        the pid file; ``reboot-node`` writes it again)."""
        try:
            pid = int((self.state_dir / "run" / f"slurmd-{node}.pid").read_text().split()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            return False
        return True

    def slurmd_timeout_s(self) -> int:
        """The controller's SlurmdTimeout now (``scontrol show config``), in seconds."""
        out = self.run(["scontrol", "show", "config"]).stdout
        m = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", out, re.M)
        assert m, "no SlurmdTimeout in scontrol show config"
        return int(m.group(1))

    @contextmanager
    def slurmd_timeout(self, seconds: int) -> Iterator[None]:
        """Inside the block, slurmctld declares a silent node DOWN after ``seconds``
        (slurm.conf's ``SlurmdTimeout=`` line rewritten, ``scontrol reconfigure``); after
        it, slurm.conf is the very text it was (``dev-cluster up`` still finds nothing
        changed) and reconfigured again. Every job sees the short timeout meanwhile: hold
        the cluster lock."""
        before = self.conf.read_text()
        short, n = re.subn(
            r"^SlurmdTimeout=\d+$", f"SlurmdTimeout={int(seconds)}", before, flags=re.M
        )
        assert n == 1, f"{self.conf}: no single SlurmdTimeout= line"
        self.conf.write_text(short)
        try:
            self.run(["scontrol", "reconfigure"])
            self.wait_until(
                lambda: self.slurmd_timeout_s() == int(seconds),
                timeout=60,
                what=f"SlurmdTimeout={seconds} in force",
            )
            yield
        finally:
            self.conf.write_text(before)
            self.run(["scontrol", "reconfigure"], check=False)

    def status(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(self.script), "status"],
            env=self.base_env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    # --------------------------------------------------------------- paths --
    def local_root(self, node: str) -> Path:
        """Host-side path of ``node``'s local NVMe (what jobs on it see at local_path)."""
        if node not in self.nodes:
            raise ValueError(f"unknown node {node!r} (have {self.nodes})")
        return self.state_dir / "nodes" / node / "nvme"

    def log_path(self, daemon: str) -> Path:
        """``slurmctld`` or ``slurmd-n1`` ... -> its log file."""
        return self.state_dir / "log" / f"{daemon}.log"

    # ------------------------------------------------------------ commands --
    def run(
        self,
        args: Union[str, Sequence[str]],
        user: Optional[str] = None,
        check: bool = True,
        timeout: float = 60,
        input: Optional[str] = None,
        cwd: Optional[Union[str, Path]] = None,
    ) -> subprocess.CompletedProcess:
        """Run a (slurm client) command with the cluster env, as root or as ``user``.

        ``cwd`` defaults to the world-writable jobs dir, so a job's default
        ``slurm-%j.out`` lands there whoever submits it."""
        argv = shlex.split(args) if isinstance(args, str) else list(args)
        if user is not None:
            # runuser (not su) keeps our environment (SLURM_CONF...) and sets HOME/USER.
            argv = ["runuser", "-u", user, "--", *argv]
        proc = subprocess.run(
            argv,
            env=self.env,
            cwd=str(cwd or self.jobs_dir),
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise ClusterCommandError(
                f"{shlex.join(argv)} failed (rc={proc.returncode})\n"
                f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

    def sbatch(
        self,
        script_text: str,
        user: Optional[str] = None,
        extra_args: Sequence[str] = (),
        cwd: Optional[Union[str, Path]] = None,
    ) -> str:
        """Submit ``script_text`` (a ``#!/bin/bash`` line is added if missing); return the
        job id. Output goes to ``<jobs_dir>/slurm-<id>.out`` unless ``extra_args`` set
        ``-o``; :meth:`job_output` reads it either way."""
        if not script_text.startswith("#!"):
            script_text = "#!/bin/bash\n" + script_text
        proc = self.run(
            ["sbatch", "--parsable", *extra_args], user=user, input=script_text, cwd=cwd
        )
        return proc.stdout.strip().split(";")[0]

    def scancel(self, *jobids: str, signal: Optional[str] = None) -> None:
        args = ["scancel"] + ([f"--signal={signal}"] if signal else []) + [str(j) for j in jobids]
        self.run(args)

    # -------------------------------------------------------------- queries --
    def job_info(self, jobid: Union[str, int]) -> Optional[Dict[str, str]]:
        """``scontrol -o show job`` as a dict, or None if Slurm no longer knows the job."""
        proc = self.run(["scontrol", "-o", "show", "job", str(jobid)], check=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            return None
        return _parse_scontrol_oneliner(proc.stdout.splitlines()[0])

    def job_state(self, jobid: Union[str, int]) -> Optional[str]:
        info = self.job_info(jobid)
        return None if info is None else info.get("JobState")

    def job_output(self, jobid: Union[str, int]) -> str:
        """Contents of the job's stdout file ('' if not created yet)."""
        info = self.job_info(jobid)
        path = (
            Path(info["StdOut"])
            if info and info.get("StdOut")
            else self.jobs_dir / f"slurm-{jobid}.out"
        )
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def node_info(self, node: str) -> Dict[str, str]:
        proc = self.run(["scontrol", "-o", "show", "node", node])
        return _parse_scontrol_oneliner(proc.stdout.splitlines()[0])

    def node_state(self, node: str) -> str:
        """scontrol's state, e.g. ``IDLE``, ``MIXED``, ``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``."""
        return self.node_info(node)["State"]

    def drain_reasons(self) -> str:
        """``node: reason`` of every drained or down node, for a failure message."""
        proc = self.run(["sinfo", "-h", "-R", "-o", "%N: %E"], check=False)
        return "; ".join(proc.stdout.split("\n")).strip("; ") or "none"

    def sinfo_states(self) -> Dict[str, str]:
        """node -> sinfo's compact state (``idle``, ``idle*``, ``mix``, ``drain``...)."""
        proc = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
        return dict(line.split() for line in proc.stdout.splitlines() if line.strip())

    # ---------------------------------------------------------------- waits --
    def wait_node_state(
        self,
        node: str,
        predicate_or_state: StatePredicate,
        timeout: float = 60,
        interval: float = 0.2,
    ) -> str:
        """Poll until the node's state matches; return it.

        A string (or several) matches scontrol's State (``IDLE``, ``IDLE+DRAIN``...) or
        sinfo's compact state (``idle``, ``idle*``, ``drain``...), case-insensitively.
        A callable gets scontrol's State string."""
        match = _matcher(predicate_or_state)
        deadline = time.monotonic() + timeout
        last = ("?", "?")
        while True:
            state = self.node_state(node)
            compact = self.sinfo_states().get(node, "?")
            last = (state, compact)
            if match(state) or (not callable(predicate_or_state) and match(compact)):
                return state
            if time.monotonic() >= deadline:
                info = self.node_info(node)
                raise AssertionError(
                    f"node {node}: state {last[0]} ({last[1]}) after {timeout}s, wanted "
                    f"{predicate_or_state!r}; reason={info.get('Reason')!r}"
                )
            time.sleep(interval)

    def wait_job_state(
        self,
        jobid: Union[str, int],
        states: StatePredicate,
        timeout: float = 60,
        interval: float = 0.2,
        fail_fast: bool = True,
    ) -> Dict[str, str]:
        """Poll ``scontrol show job`` until JobState matches ``states`` (a state, several,
        or a predicate on the state string); return the job's info dict.

        With ``fail_fast`` a job that reaches a final state not wanted (COMPLETED, FAILED,
        CANCELLED, ...), or is held after a failed launch, fails at once, with its output
        (and the reason its node was drained) in the message."""
        match = _matcher(states)
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(jobid)
            state = info.get("JobState", "?") if info else "<unknown job>"
            if info is not None and match(state):
                return info
            final = info is not None and state in FINAL_JOB_STATES
            # A job whose launch failed (its prolog drained the node) waits held for an
            # admin: it will not move on its own, so waiting out the timeout hides why.
            final = final or (info is not None and info.get("Reason") in HELD_FOR_FAILURE)
            if (fail_fast and final) or time.monotonic() >= deadline:
                reason = info.get("Reason") if info else None
                if reason in HELD_FOR_FAILURE:
                    reason = f"{reason}; drained: {self.drain_reasons()}"
                raise AssertionError(
                    f"job {jobid}: state {state} (reason {reason}) "
                    f"{'is final' if final else f'after {timeout}s'}, wanted {states!r}\n"
                    f"--- output ---\n{self.job_output(jobid)[-2000:]}"
                )
            time.sleep(interval)

    def wait_until(
        self,
        predicate: Callable[[], object],
        timeout: float = 60,
        interval: float = 0.2,
        what: str = "condition",
    ) -> object:
        """Poll ``predicate`` until it returns something truthy; return that."""
        deadline = time.monotonic() + timeout
        while True:
            val = predicate()
            if val:
                return val
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(interval)


@contextmanager
def at_least_nodes(cluster: DevCluster, count: int) -> Iterator[DevCluster]:
    """The cluster with at least ``count`` nodes while the block runs: a module whose jobs
    need more nodes than the session's shape adds them, and puts the shape back at the end
    so that the modules after it see the cluster they expect."""
    shape = len(cluster.nodes)
    if shape < count:
        cluster.up(nodes=str(count))
    try:
        yield cluster
    finally:
        if shape < count:
            cluster.up(nodes=str(shape))


def start_cluster() -> DevCluster:
    if os.geteuid() != 0:
        pytest.fail(
            "the SLURM dev cluster needs root (packages, mounts, daemons): run the suite as root"
        )
    cluster = DevCluster()
    # The first start takes DEV_CLUSTER_* (hooks included) from the environment as is.
    cluster.last_up_output = cluster._script("up", timeout=600).stderr
    cluster._load_env()
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[DevCluster]:
    """The running dev cluster (brought up once per session, left up afterwards)."""
    cluster = start_cluster()
    yield cluster
    if os.environ.get("DEV_CLUSTER_TEARDOWN") == "1":
        cluster.down()
