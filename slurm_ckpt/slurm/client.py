"""One interface for the SLURM queries and updates slurm_ckpt needs.

Why one interface: hooks, the stager and the job wrapper all ask the same few questions
(when does this job end, why did it stop, how often was it requeued, is this node drained
and by whom) and make the same few changes (drain, resume, requeue, signal). Keeping them
here means one place that knows SLURM's output formats and failure modes, and one error
type (:class:`~slurm_ckpt.errors.SlurmError`, one line) for the callers.

Backends
--------
* **pyslurm**, when it imports *and* was built for the site's SLURM major.minor (PyPI's
  pyslurm builds only against the newest SLURM, so on most clusters it will not import;
  that is expected and silent). It serves read queries only; any attribute it lacks or
  error it raises falls back to the command line for that call.
* **command line** (always available where SLURM is): ``scontrol show job -o``,
  ``scontrol show node -o``, ``squeue``/``sinfo --json`` for bulk listings (22.05 has no
  ``scontrol --json``; its ``squeue --json``/``sinfo --json`` ignore filters, so they are
  used only where every entry is wanted), ``scontrol update``, ``scontrol requeue``,
  ``scancel --signal``.

Commands are run without a shell (argument vectors), with ``LC_ALL=C`` and
``SLURM_TIME_FORMAT=standard`` so that the output is parseable, and with a timeout: a
hook must never hang on an unreachable controller.

Drain reasons
-------------
Every drain slurm_ckpt makes has a reason starting with :data:`REASON_PREFIX`
(``slurm_ckpt:``). :meth:`SlurmClient.resume_if_ours` returns a node to service only while
its reason still starts with it, so a node an admin drained (for any other reason) is
never undrained by us.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from slurm_ckpt.errors import CkptError, SlurmError
from slurm_ckpt.slurm import hostlist
from slurm_ckpt.slurm.env import parse_job_id

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAINT_PREFIX",
    "REASON_PREFIX",
    "CliBackend",
    "JobInfo",
    "JobNotFound",
    "NodeInfo",
    "SlurmClient",
    "get_client",
    "parse_duration",
    "parse_oneliner",
    "parse_time",
]

REASON_PREFIX = "slurm_ckpt:"
#: Drains made by ``ckpt-slurm maint``: ours, but held for the admin's maintenance, so the
#: epilog and the stager neither overwrite nor resume them.
MAINT_PREFIX = "slurm_ckpt: maint:"
DEFAULT_TIMEOUT = 30.0
#: Where SLURM's tools live when the caller has no PATH (slurmd gives hooks none).
FALLBACK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_BACKEND = "SLURM_CKPT_SLURM_BACKEND"
_MAX_REASON = 200

#: Job states after which the job will not run again by itself.
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)


class JobNotFound(SlurmError):
    """SLURM does not (or no longer) know this job."""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class JobInfo:
    """A job as SLURM reports it. Times are epoch seconds; None when SLURM has none."""

    job_id: str
    state: str
    reason: Optional[str] = None
    name: Optional[str] = None
    user: Optional[str] = None
    restarts: int = 0
    start_time: Optional[float] = None
    end_time: Optional[float] = None
    #: Seconds; None = unlimited or unknown.
    time_limit: Optional[float] = None
    nodes: List[str] = field(default_factory=list)
    batch_host: Optional[str] = None
    requeue: Optional[bool] = None
    exit_code: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def timed_out(self) -> bool:
        """Ended (or is ending) because it hit its time limit."""
        return self.state == "TIMEOUT" or (self.reason or "") == "TimeLimit"

    @property
    def preempted(self) -> bool:
        """Preempted (SLURM requeues or cancels it per PreemptMode; not our business)."""
        return self.state == "PREEMPTED" or "preempt" in (self.reason or "").lower()

    def seconds_left(self, now: Optional[float] = None) -> Optional[float]:
        """Time until the scheduled end, or None when it has no end time."""
        if self.end_time is None:
            return None
        return self.end_time - (time.time() if now is None else now)


@dataclass(frozen=True)
class NodeInfo:
    """A node as SLURM reports it: base state (``IDLE``), flags (``DRAIN``...), reason."""

    name: str
    state: str
    flags: FrozenSet[str] = frozenset()
    reason: Optional[str] = None
    reason_user: Optional[str] = None
    reason_time: Optional[float] = None
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def drained(self) -> bool:
        """DRAIN set (draining while jobs run, or drained)."""
        return "DRAIN" in self.flags

    @property
    def reason_is_ours(self) -> bool:
        return (self.reason or "").startswith(REASON_PREFIX)

    @property
    def held_for_maint(self) -> bool:
        return (self.reason or "").startswith(MAINT_PREFIX)

    @property
    def state_string(self) -> str:
        return "+".join([self.state, *sorted(self.flags)])


# --------------------------------------------------------------------------- parsing

_KEY_RE = re.compile(r"^([A-Z][A-Za-z0-9_:/()]*)=(.*)$", re.S)
# scontrol appends "[user@time]" to a node's reason.
_REASON_TAIL_RE = re.compile(r"^(.*?)\s*\[([^\]@\s]+)@([0-9T:-]+)\]\s*$", re.S)
_TIME_UNSET = {"", "Unknown", "None", "N/A", "(null)", "0"}


def parse_oneliner(line: str) -> Dict[str, str]:
    """``scontrol show ... -o`` output -> dict.

    Fields are separated by single spaces and keys are CamelCase (``JobState=``,
    ``NodeList=``); a space-separated token that does not start with ``Key=`` continues
    the previous value (``Reason=`` of a node, ``Command=``, a job name with spaces).
    Lower-case ``word=value`` tokens inside such a value do not start a new field.
    """
    out: Dict[str, str] = {}
    key: Optional[str] = None
    for tok in line.rstrip("\n").split(" "):
        m = _KEY_RE.match(tok)
        if m and (key is None or m.group(1) not in out):
            key = m.group(1)
            out[key] = m.group(2)
        elif key is not None:
            out[key] += " " + tok
    return out


def parse_time(text: Optional[str]) -> Optional[float]:
    """``2026-11-29T08:52:04`` (local time, SLURM's standard format) -> epoch seconds."""
    if text is None or text.strip() in _TIME_UNSET:
        return None
    value = text.strip()
    if value.isdigit():
        return float(value)
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_duration(text: Optional[str]) -> Optional[float]:
    """SLURM's ``[days-]hours:minutes:seconds`` (also ``minutes:seconds``) -> seconds.

    ``UNLIMITED``, ``Partition_Limit``, ``NOT_SET`` and the like give None.
    """
    if text is None:
        return None
    value = text.strip()
    m = re.match(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$", value)
    if not m:
        return None
    days = int(m.group(1) or 0)
    parts = [int(p) for p in m.group(2, 3, 4) if p is not None]
    if m.group(1) is not None:
        while len(parts) < 3:
            parts.append(0)  # "1-2" = 1 day 2 hours
        h, mi, s = parts
    elif len(parts) == 3:
        h, mi, s = parts
    elif len(parts) == 2:
        h, mi, s = 0, parts[0], parts[1]
    else:
        h, mi, s = 0, parts[0], 0  # a bare number is minutes
    return float(((days * 24 + h) * 60 + mi) * 60 + s)


def _split_state(text: str) -> Tuple[str, FrozenSet[str]]:
    parts = [p for p in text.strip().upper().split("+") if p]
    if not parts:
        return "UNKNOWN", frozenset()
    base = parts[0].rstrip("*~#!%$@^-")
    return base, frozenset(parts[1:])


def _user_of(text: Optional[str]) -> Optional[str]:
    """``ckptuser1(1001)`` -> ``ckptuser1``."""
    if not text:
        return None
    return text.split("(", 1)[0] or None


def _nodes_of(text: Optional[str]) -> List[str]:
    if not text or text in ("(null)", "None", ""):
        return []
    try:
        return hostlist.expand(text)
    except CkptError:
        return []


def job_from_oneliner(fields: Dict[str, str]) -> JobInfo:
    """A :class:`JobInfo` from ``scontrol show job -o`` fields."""
    try:
        restarts = int(fields.get("Restarts", "0"))
    except ValueError:
        restarts = 0
    requeue = fields.get("Requeue")
    reason = fields.get("Reason")
    return JobInfo(
        job_id=fields.get("JobId", ""),
        state=fields.get("JobState", "UNKNOWN").upper(),
        reason=None if reason in (None, "None", "(null)") else reason,
        name=fields.get("JobName"),
        user=_user_of(fields.get("UserId")),
        restarts=restarts,
        start_time=parse_time(fields.get("StartTime")),
        end_time=parse_time(fields.get("EndTime")),
        time_limit=parse_duration(fields.get("TimeLimit")),
        nodes=_nodes_of(fields.get("NodeList")),
        batch_host=None if fields.get("BatchHost") in (None, "(null)") else fields["BatchHost"],
        requeue=None if requeue is None else requeue == "1",
        exit_code=fields.get("ExitCode"),
        raw=dict(fields),
    )


def node_from_oneliner(fields: Dict[str, str]) -> NodeInfo:
    """A :class:`NodeInfo` from ``scontrol show node -o`` fields."""
    state, flags = _split_state(fields.get("State", "UNKNOWN"))
    reason = fields.get("Reason")
    who = when = None
    if reason is not None:
        m = _REASON_TAIL_RE.match(reason)
        if m:
            reason, who = m.group(1), m.group(2)
            when = parse_time(m.group(3))
        reason = reason.strip() or None
    return NodeInfo(
        name=fields.get("NodeName", ""),
        state=state,
        flags=flags,
        reason=reason,
        reason_user=who,
        reason_time=when,
        raw=dict(fields),
    )


def _epoch(value: Any) -> Optional[float]:
    if isinstance(value, dict):  # newer JSON: {"set": true, "number": N}
        if not value.get("set", True):
            return None
        value = value.get("number")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def job_from_json(j: Dict[str, Any]) -> JobInfo:
    """A :class:`JobInfo` from one entry of ``squeue --json``."""
    state = j.get("job_state")
    if isinstance(state, list):
        state = state[0] if state else "UNKNOWN"
    limit = j.get("time_limit")
    limit_min = _epoch(limit)
    reason = j.get("state_reason")
    return JobInfo(
        job_id=str(j.get("job_id", "")),
        state=str(state or "UNKNOWN").upper(),
        reason=None if reason in (None, "None") else str(reason),
        name=j.get("name"),
        user=j.get("user_name"),
        restarts=int(j.get("restart_cnt") or 0),
        start_time=_epoch(j.get("start_time")),
        end_time=_epoch(j.get("end_time")),
        time_limit=None if limit_min is None else limit_min * 60.0,
        nodes=_nodes_of(j.get("nodes")),
        batch_host=j.get("batch_host") or None,
        requeue=j.get("requeue"),
        raw=j,
    )


def node_from_json(n: Dict[str, Any]) -> NodeInfo:
    """A :class:`NodeInfo` from one entry of ``sinfo --json``."""
    state = n.get("state")
    if isinstance(state, list):  # newer SLURMs: ["IDLE", "DRAIN"]
        base, flags = (state[0] if state else "UNKNOWN"), state[1:]
    else:
        base, flags = str(state or "UNKNOWN"), n.get("state_flags") or []
    reason = n.get("reason") or None
    return NodeInfo(
        name=str(n.get("name", "")),
        state=str(base).upper(),
        flags=frozenset(str(f).upper() for f in flags),
        reason=reason,
        reason_user=n.get("reason_set_by_user") or None,
        reason_time=_epoch(n.get("reason_changed_at")),
        raw=n,
    )


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _check_reason(reason: str) -> str:
    """Our drain reasons: one printable line, prefixed, bounded."""
    text = _one_line(reason)
    if not text.startswith(REASON_PREFIX):
        text = f"{REASON_PREFIX} {text}"
    text = "".join(ch for ch in text if ch.isprintable())
    return text[:_MAX_REASON]


def _check_node(node: str) -> str:
    from slurm_ckpt.core.names import validate_node

    try:
        return validate_node(node)
    except CkptError as exc:
        raise SlurmError(str(exc)) from None


_SIGNAL_RE = re.compile(r"^(?:SIG)?([A-Z][A-Z0-9]{1,15}|[0-9]{1,2})$")


# --------------------------------------------------------------------------- backends


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
            raise SlurmError(f"'{shlex.join(argv)}' reported: {_one_line(str(msg))}")
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
            start_time=_epoch(getattr(j, "start_time", None)),
            end_time=_epoch(getattr(j, "end_time", None)),
            time_limit=(
                None if getattr(j, "time_limit", None) in (None, 0) else float(j.time_limit) * 60.0
            ),
            nodes=_nodes_of(getattr(j, "nodes", None)),
            batch_host=getattr(j, "batch_host", None),
            requeue=getattr(j, "is_requeueable", None),
        )

    def node(self, node: str) -> NodeInfo:
        n = self.mod.Node.load(node)
        state, flags = _split_state(str(n.state))
        return NodeInfo(
            name=str(n.name),
            state=state,
            flags=flags,
            reason=getattr(n, "reason", None) or None,
            reason_user=getattr(n, "reason_user", None),
            reason_time=_epoch(getattr(n, "reason_time", None)),
        )


def _load_pyslurm(site_version: Callable[[], str]) -> Tuple[Optional[Any], str]:
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


# --------------------------------------------------------------------------- client


class SlurmClient:
    """Job and node queries and updates; see the module docstring."""

    def __init__(
        self,
        backend: str = "auto",
        timeout: float = DEFAULT_TIMEOUT,
        path: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        runner: Optional[Callable[..., subprocess.CompletedProcess]] = None,
    ) -> None:
        self.cli = CliBackend(timeout=timeout, path=path, env=env, runner=runner)
        choice = (os.environ.get(ENV_BACKEND) or backend or "auto").lower()
        if choice not in ("auto", "cli", "pyslurm"):
            raise SlurmError(f"unknown SLURM backend {choice!r} (use auto, cli or pyslurm)")
        self.reader: Optional[PySlurmBackend] = None
        self.backend_note = "command line"
        if choice in ("auto", "pyslurm"):
            mod, note = _load_pyslurm(self.cli.version)
            self.backend_note = note
            if mod is not None:
                self.reader = PySlurmBackend(mod)
            elif choice == "pyslurm":
                raise SlurmError(note)
            log.debug("slurm backend: %s", note)

    @property
    def backend(self) -> str:
        return "pyslurm" if self.reader is not None else "cli"

    def _read(self, what: str, *args: Any) -> Any:
        if self.reader is not None:
            try:
                return getattr(self.reader, what)(*args)
            except Exception as exc:  # noqa: BLE001 - any pyslurm trouble: ask the CLI
                log.debug("pyslurm %s%r failed (%s); using the command line", what, args, exc)
        return getattr(self.cli, what)(*args)

    # -- jobs ----------------------------------------------------------------------
    def version(self) -> str:
        """The site's SLURM version, e.g. ``"22.05.8"``."""
        return self.cli.version()

    def job(self, job_id: object) -> JobInfo:
        """One job (JobNotFound once SLURM has forgotten it)."""
        return self._read("job", parse_job_id(job_id))

    def job_state(self, job_id: object) -> Tuple[str, Optional[str]]:
        """``(state, reason)``, e.g. ``("RUNNING", None)``, ``("PENDING", "BeginTime")``.

        The reason tells a time limit (``TimeLimit``) from a preemption and the like.
        """
        info = self.job(job_id)
        return info.state, info.reason

    def end_time(self, job_id: object) -> Optional[float]:
        """When the job will be killed for its time limit (epoch), None if never.

        Unlike ``$SLURM_JOB_END_TIME`` this follows time-limit changes made by admins.
        """
        return self.job(job_id).end_time

    def restart_count(self, job_id: object) -> int:
        return self.job(job_id).restarts

    def jobs(self, user: Optional[str] = None, node: Optional[str] = None) -> List[JobInfo]:
        """Every job SLURM knows (``squeue --json``), optionally filtered."""
        out = []
        for j in self.cli.jobs():
            if user is not None and j.user != user:
                continue
            if node is not None and node not in j.nodes:
                continue
            out.append(j)
        return out

    def jobs_on_node(self, node: str) -> List[Tuple[str, str, str]]:
        """``(job id, user, state)`` of the jobs currently on ``node`` (cheap query)."""
        return self.cli.jobs_on_node(_check_node(node))

    # -- nodes ---------------------------------------------------------------------
    def node(self, node: str) -> NodeInfo:
        return self._read("node", _check_node(node))

    def nodes(self) -> List[NodeInfo]:
        return self.cli.nodes()

    def drain(self, node: str, reason: str, force: bool = False) -> Optional[str]:
        """Drain ``node``: running jobs go on, nothing new starts. Returns the reason set
        (prefixed with ``slurm_ckpt:`` if it was not).

        A node already drained by someone else (a reason not starting with
        ``slurm_ckpt:``) is left alone and None is returned, unless ``force``: replacing
        an admin's reason with ours would let :meth:`resume_if_ours` undrain it later.
        """
        text = _check_reason(reason)
        name = _check_node(node)
        if not force:
            info = self.node(name)
            if info.drained and not info.reason_is_ours:
                log.info("%s already drained by others (%r); reason left", name, info.reason)
                return None
            if info.drained and info.held_for_maint and not text.startswith(MAINT_PREFIX):
                log.info("%s is held for maintenance (%r); reason left", name, info.reason)
                return None
        self.cli.update_node(name, "state=drain", f"reason={text}")
        return text

    def resume(self, node: str) -> None:
        """Unconditional resume; prefer :meth:`resume_if_ours`."""
        self.cli.update_node(_check_node(node), "state=resume")

    def resume_if_ours(self, node: str) -> bool:
        """Resume ``node`` only if it is drained with a ``slurm_ckpt:`` reason.

        Returns True if it was resumed. A node drained by an admin (any other reason), or
        not drained at all, is left alone. The reason is read right before the update;
        SLURM has no compare-and-set, so an admin drain in that instant could be lost -
        an unavoidable, sub-second window.
        """
        info = self.node(node)
        if not info.drained or not info.reason_is_ours or info.held_for_maint:
            return False
        self.resume(node)
        return True

    # -- updates -------------------------------------------------------------------
    def requeue(self, job_id: object, hold: bool = False) -> None:
        """Requeue a (batch, requeue-able) job; it starts again with restart count + 1."""
        self.cli.requeue(parse_job_id(job_id), hold)

    def signal(
        self,
        job_id: object,
        sig: str,
        *,
        step: Optional[object] = None,
        full: bool = False,
        batch: bool = False,
    ) -> None:
        """``scancel --signal=SIG``: to every step (default), one ``step``, the batch
        shell only (``batch``) or batch shell and all steps (``full``)."""
        m = _SIGNAL_RE.match(str(sig).upper())
        if not m:
            raise SlurmError(f"invalid signal {sig!r}")
        if full and batch:
            raise SlurmError("signal: full and batch exclude each other")
        target = parse_job_id(job_id)
        if step is not None:
            if not re.match(r"^[0-9]{1,10}$", str(step)):
                raise SlurmError(f"invalid step id {step!r}")
            target = f"{target}.{step}"
        flag = "--full" if full else "--batch" if batch else None
        self.cli.signal(target, m.group(1), flag)

    def checkpointer_providers(
        self, job_id: object, warn_window: float = 600.0
    ) -> Dict[str, Callable[..., Any]]:
        """``end_time_fn``, ``job_state_fn`` and ``requeue_fn`` for the in-job
        ``Checkpointer`` (its injectable providers), backed by the controller.

        ``job_state_fn`` says *why* the job is stopping: ``"TIMEOUT"`` once SLURM says
        so, ``"TIME_LIMIT"`` while the job still runs but its end is less than
        ``warn_window`` seconds away (the moment a ``--signal=USR1@T`` warning arrives,
        SLURM still reports RUNNING), ``"PREEMPTED"`` for preemption, else SLURM's state.
        Under ``ckpt-srun`` leave the Checkpointer's own requeue off: the wrapper requeues.
        """
        jid = parse_job_id(job_id)

        def end_time_fn() -> Optional[float]:
            return self.end_time(jid)

        def job_state_fn() -> str:
            info = self.job(jid)
            if info.timed_out:
                return "TIMEOUT"
            if info.preempted:
                return "PREEMPTED"
            left = info.seconds_left()
            if info.state == "RUNNING" and left is not None and left <= warn_window:
                return "TIME_LIMIT"
            return info.state

        def requeue_fn(reason: str) -> None:
            log.warning("requeueing job %s: %s", jid, reason)
            self.requeue(jid)

        return {
            "end_time_fn": end_time_fn,
            "job_state_fn": job_state_fn,
            "requeue_fn": requeue_fn,
        }

    def config(self) -> Dict[str, str]:
        """``scontrol show config`` as a dict (``"PrologEpilogTimeout": "120"``...)."""
        return self.cli.config()

    def prolog_epilog_timeout(self) -> Optional[float]:
        """slurm.conf PrologEpilogTimeout in seconds (None: unset or unlimited)."""
        value = self.config().get("PrologEpilogTimeout", "")
        m = re.match(r"^(\d+)", value)
        if not m or int(m.group(1)) in (0, 65534, 4294967294):
            return None
        return float(m.group(1))


_default: Optional[SlurmClient] = None


def get_client(**kwargs: Any) -> SlurmClient:
    """A shared :class:`SlurmClient` (a new one when ``kwargs`` are given)."""
    global _default
    if kwargs:
        return SlurmClient(**kwargs)
    if _default is None:
        _default = SlurmClient()
    return _default
