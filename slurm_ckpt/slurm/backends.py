"""How the client reaches SLURM: its command-line tools, or pyslurm when it matches.

* **command line** (always available where SLURM is): ``scontrol show job -o``,
  ``scontrol show node -o``, ``squeue``/``sinfo --json`` for bulk listings (22.05 has no
  ``scontrol --json``; its ``squeue --json``/``sinfo --json`` ignore filters, so they are
  used only where every entry is wanted), ``scontrol update``, ``scontrol requeue``,
  ``scancel --signal``. Commands run without a shell (argument vectors), with
  ``LC_ALL=C`` and ``SLURM_TIME_FORMAT=standard`` so that the output is parseable, and
  with a timeout: a hook must never hang on an unreachable controller.
* **pyslurm**, when it imports *and* was built for the site's SLURM major.minor (PyPI's
  pyslurm builds only against the newest SLURM, so on most clusters it will not import;
  that is expected and silent). It serves read queries only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from slurm_ckpt.errors import SlurmError
from slurm_ckpt.slurm.records import (
    JobInfo,
    JobNotFound,
    NodeInfo,
    epoch_seconds,
    job_from_json,
    job_from_oneliner,
    node_from_json,
    node_from_oneliner,
    nodes_of,
    parse_oneliner,
    split_state,
)

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT", "ENV_BACKEND", "CliBackend", "PySlurmBackend", "load_pyslurm"]

DEFAULT_TIMEOUT = 30.0
#: Where SLURM's tools live when the caller has no PATH (slurmd gives hooks none).
FALLBACK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_BACKEND = "SLURM_CKPT_SLURM_BACKEND"


class CliBackend:
    """SLURM through its command-line tools (every operation)."""

    name = "cli"

    def __init__(
        self,
        timeout: float = DEFAULT_TIMEOUT,
        path: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        runner: Optional[Callable[..., subprocess.CompletedProcess]] = None,
    ) -> None:
        self.timeout = float(timeout)
        base = dict(os.environ if env is None else env)
        # An explicit path is used alone (tests, odd installs); otherwise the caller's PATH
        # plus the usual system directories (slurmd starts hooks without any PATH).
        if path:
            self.path = path
        elif base.get("PATH"):
            self.path = f"{base['PATH']}:{FALLBACK_PATH}"
        else:
            self.path = FALLBACK_PATH
        base["PATH"] = self.path
        base["LC_ALL"] = "C"
        base["SLURM_TIME_FORMAT"] = "standard"
        # Our queries must not be shaped by a user's SQUEUE_FORMAT & co.
        for name in list(base):
            if name.startswith(("SQUEUE_", "SINFO_", "SCONTROL_")):
                del base[name]
        self.env = base
        self._runner = runner or subprocess.run
        self._exe: Dict[str, str] = {}

    def _which(self, tool: str) -> str:
        if tool not in self._exe:
            found = shutil.which(tool, path=self.env["PATH"])
            if found is None:
                raise SlurmError(f"SLURM command '{tool}' not found (is SLURM installed?)")
            self._exe[tool] = found
        return self._exe[tool]

    def run(self, argv: Sequence[str], timeout: Optional[float] = None) -> str:
        """Run one SLURM tool; its stdout, or one-line SlurmError."""
        cmd = shlex.join(argv)
        exe = self._which(argv[0])
        limit = self.timeout if timeout is None else float(timeout)
        try:
            proc = self._runner(
                [exe, *argv[1:]],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=limit,
                env=self.env,
            )
        except subprocess.TimeoutExpired:
            raise SlurmError(
                f"'{cmd}' timed out after {limit:g}s (is slurmctld reachable?)"
            ) from None
        except OSError as exc:
            raise SlurmError(f"cannot run '{cmd}': {exc.strerror or exc}") from None
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines()]
            lines = [ln for ln in lines if ln]
            detail = lines[-1] if lines else f"exit status {proc.returncode}"
            # "scontrol: error: Invalid job id specified" -> "Invalid job id specified"
            detail = re.sub(r"^[a-z]+: (error|fatal): ", "", detail)
            if "Invalid job id" in detail:
                raise JobNotFound(f"'{cmd}' failed: {detail}")
            raise SlurmError(f"'{cmd}' failed: {detail}")
        return proc.stdout

    # -- queries -------------------------------------------------------------------
    def version(self) -> str:
        out = self.run(["scontrol", "--version"]).strip()
        m = re.search(r"(\d+\.\d+(?:\.\d+)?)", out)
        if not m:
            raise SlurmError(f"cannot parse SLURM version from {out!r}")
        return m.group(1)

    def job(self, job_id: str) -> JobInfo:
        out = self.run(["scontrol", "show", "job", "-o", job_id])
        lines = [ln for ln in out.splitlines() if ln.startswith("JobId=")]
        if not lines:
            raise JobNotFound(f"job {job_id}: not known to SLURM")
        return job_from_oneliner(parse_oneliner(lines[0]))

    def jobs(self) -> List[JobInfo]:
        return [job_from_json(j) for j in self._json(["squeue", "--json"]).get("jobs", [])]

    def jobs_on_node(self, node: str) -> List[Tuple[str, str, str]]:
        """``(job id, user, state)`` of jobs holding resources on ``node``."""
        out = self.run(
            [
                "squeue",
                "-h",
                "-w",
                node,
                "-t",
                "RUNNING,COMPLETING,CONFIGURING,SUSPENDED,STOPPED",
                "-o",
                "%A|%u|%T",
            ]
        )
        rows = []
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0].isdigit():
                rows.append((parts[0], parts[1], parts[2]))
        return rows

    def node(self, node: str) -> NodeInfo:
        out = self.run(["scontrol", "show", "node", "-o", node])
        lines = [ln for ln in out.splitlines() if ln.startswith("NodeName=")]
        if not lines:
            raise SlurmError(f"node {node}: not known to SLURM")
        return node_from_oneliner(parse_oneliner(lines[0]))

    def nodes(self) -> List[NodeInfo]:
        return [node_from_json(n) for n in self._json(["sinfo", "--json"]).get("nodes", [])]

    def all_nodes(self, timeout: Optional[float] = None) -> List[NodeInfo]:
        """Every node, from one ``scontrol show node -o`` (no JSON plugin needed)."""
        out = self.run(["scontrol", "show", "node", "-o"], timeout=timeout)
        return [
            node_from_oneliner(parse_oneliner(ln))
            for ln in out.splitlines()
            if ln.startswith("NodeName=")
        ]

    def config(self) -> Dict[str, str]:
        out = self.run(["scontrol", "show", "config"])
        conf: Dict[str, str] = {}
        for line in out.splitlines():
            if " = " in line:
                k, v = line.split(" = ", 1)
                conf[k.strip()] = v.strip()
        return conf

    def _json(self, argv: List[str]) -> Dict[str, Any]:
        out = self.run(argv)
        try:
            data = json.loads(out)
        except ValueError:
            raise SlurmError(f"'{shlex.join(argv)}' did not print JSON") from None
        if not isinstance(data, dict):
            raise SlurmError(f"'{shlex.join(argv)}' printed unexpected JSON")
        errors = data.get("errors") or []
        if errors:
            first = errors[0]
            msg = first
            if isinstance(first, dict):
                msg = first.get("error") or first.get("description")
            raise SlurmError(f"'{shlex.join(argv)}' reported: {msg}")
        return data

    # -- updates -------------------------------------------------------------------
    def update_node(self, node: str, *settings: str) -> None:
        self.run(["scontrol", "update", f"nodename={node}", *settings])

    def requeue(self, job_id: str, hold: bool = False) -> None:
        self.run(["scontrol", "requeuehold" if hold else "requeue", job_id])

    def signal(self, target: str, sig: str, flag: Optional[str] = None) -> None:
        argv = ["scancel", f"--signal={sig}"]
        if flag:
            argv.append(flag)
        self.run([*argv, target])


class PySlurmBackend:
    """Read queries through pyslurm (only when built for this SLURM); see module doc."""

    name = "pyslurm"

    def __init__(self, module: Any) -> None:
        self.mod = module

    def job(self, job_id: str) -> JobInfo:
        j = self.mod.Job.load(int(job_id))
        state = str(j.state).upper()
        return JobInfo(
            job_id=str(j.id),
            state=state,
            reason=getattr(j, "state_reason", None) or None,
            name=getattr(j, "name", None),
            user=getattr(j, "user_name", None),
            restarts=int(getattr(j, "requeue_count", None) or getattr(j, "restart_cnt", 0) or 0),
            start_time=epoch_seconds(getattr(j, "start_time", None)),
            end_time=epoch_seconds(getattr(j, "end_time", None)),
            time_limit=(
                None if getattr(j, "time_limit", None) in (None, 0) else float(j.time_limit) * 60.0
            ),
            nodes=nodes_of(getattr(j, "nodes", None)),
            batch_host=getattr(j, "batch_host", None),
            requeue=getattr(j, "is_requeueable", None),
        )

    def node(self, node: str) -> NodeInfo:
        n = self.mod.Node.load(node)
        state, flags = split_state(str(n.state))
        return NodeInfo(
            name=str(n.name),
            state=state,
            flags=flags,
            reason=getattr(n, "reason", None) or None,
            reason_user=getattr(n, "reason_user", None),
            reason_time=epoch_seconds(getattr(n, "reason_time", None)),
        )


def load_pyslurm(site_version: Callable[[], str]) -> Tuple[Optional[Any], str]:
    """``(module, note)``: pyslurm if it imports and matches the site's SLURM major.minor."""
    try:
        import pyslurm  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError (libslurm), anything
        return None, f"pyslurm unavailable ({type(exc).__name__}); using the command line"
    ver = None
    for attr in ("version", "__version__"):
        v = getattr(pyslurm, attr, None)
        try:
            ver = v() if callable(v) else v
        except Exception:  # noqa: BLE001
            ver = None
        if ver:
            break
    try:
        site = site_version()
    except SlurmError as exc:
        return None, f"pyslurm not used: cannot learn the site's SLURM version ({exc})"
    mm = ".".join(str(ver or "").split(".")[:2])
    if not ver or mm != ".".join(site.split(".")[:2]):
        return None, f"pyslurm {ver} does not match SLURM {site}; using the command line"
    return pyslurm, f"pyslurm {ver} matches SLURM {site}"
