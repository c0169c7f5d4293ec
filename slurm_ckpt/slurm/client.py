"""One interface for the SLURM queries and updates slurm_ckpt needs.

Why one interface: hooks, the stager, the job wrapper and the in-job library all ask the
same few questions (when does this job end, why did it stop, how often was it requeued,
is this node drained and by whom) and make the same few changes (drain, resume, requeue,
signal). Keeping them here means one place that knows SLURM's failure modes, and one
error type (:class:`~slurm_ckpt.errors.SlurmError`, one line) for the callers. Output
formats are :mod:`slurm_ckpt.slurm.records`; how SLURM is reached is
:mod:`slurm_ckpt.slurm.backends`.

Drain reasons
-------------
Every drain slurm_ckpt makes has a reason starting with
:data:`~slurm_ckpt.slurm.records.REASON_PREFIX` (``slurm_ckpt:``).
:meth:`SlurmClient.resume_if_ours` returns a node to service only while its reason still
starts with it, so a node an admin drained (for any other reason) is never undrained by us.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from slurm_ckpt.core.names import validate_node
from slurm_ckpt.errors import CkptError, SlurmError
from slurm_ckpt.slurm.backends import (
    DEFAULT_TIMEOUT,
    ENV_BACKEND,
    CliBackend,
    PySlurmBackend,
    load_pyslurm,
)
from slurm_ckpt.slurm.env import parse_job_id
from slurm_ckpt.slurm.records import (
    MAINT_PREFIX,
    REASON_PREFIX,
    JobInfo,
    NodeInfo,
    parse_oneliner,
)

log = logging.getLogger(__name__)

__all__ = ["SlurmClient", "get_client"]

_MAX_REASON = 200


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
    try:
        return validate_node(node)
    except CkptError as exc:
        raise SlurmError(str(exc)) from None


_SIGNAL_RE = re.compile(r"^(?:SIG)?([A-Z][A-Z0-9]{1,15}|[0-9]{1,2})$")


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
            mod, note = load_pyslurm(self.cli.version)
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

    def node_table(self, timeout: Optional[float] = None) -> Dict[str, NodeInfo]:
        """Every node SLURM knows, by name, from ONE query (``scontrol show node -o``),
        waited on for at most ``timeout`` seconds (default: the client's). What root asks
        about many nodes at once - the owners of the partner copies on a node - it asks
        this way: one query per hook whatever the number of names, so names a user
        writes into manifests cost root nothing (a name not in the table is a node
        SLURM does not know)."""
        return {n.name: n for n in self.cli.all_nodes(timeout) if n.name}

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

    def partitions(self) -> List[Dict[str, str]]:
        """``scontrol show partition -o``: one dict per partition (``PartitionName``,
        ``GraceTime``, ``PreemptMode``, ``Default``...), for ``ckpt-slurm doctor``."""
        out = self.cli.run(["scontrol", "show", "partition", "-o"])
        return [parse_oneliner(ln) for ln in out.splitlines() if ln.startswith("PartitionName=")]

    def prolog_epilog_timeout(self) -> Optional[float]:
        """slurm.conf PrologEpilogTimeout in seconds (None: unset or unlimited)."""
        value = self.config().get("PrologEpilogTimeout", "")
        m = re.match(r"^(\d+)", value)
        if not m or int(m.group(1)) in (0, 65534, 4294967294):
            return None
        return float(m.group(1))


#: How long an end time asked of the controller is reused (should_save runs every step).
END_TIME_CACHE_S = 60.0


def job_end_time_provider(
    job_id: Optional[object],
    environ: Optional[Dict[str, str]] = None,
    client: Optional[SlurmClient] = None,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[], Optional[float]]:
    """The job's end time (epoch seconds), for the Checkpointer's deadline.

    ``SLURM_JOB_END_TIME`` where SLURM sets it (>= 21.08); otherwise the controller,
    ``squeue -h -o %e -j JOB``, asked at most once per :data:`END_TIME_CACHE_S` (a time
    limit an admin extends is followed within that), failures included (a controller that
    does not answer costs one query a minute, not one per training step). None without a
    job id or an answer.
    """
    from slurm_ckpt.slurm.env import job_end_time
    from slurm_ckpt.slurm.records import parse_time

    env = os.environ if environ is None else environ
    cache: Dict[str, Any] = {"at": None, "value": None}

    def end_time() -> Optional[float]:
        value = job_end_time(env)
        if value is not None or job_id is None:
            return value
        now = clock()
        if cache["at"] is not None and now - cache["at"] < END_TIME_CACHE_S:
            return cache["value"]
        cache["at"] = now
        try:
            jid = parse_job_id(job_id)
            cli = (client or SlurmClient(backend="cli", timeout=10.0)).cli
            out = cli.run(["squeue", "-h", "-o", "%e", "-j", jid]).strip().splitlines()
            cache["value"] = parse_time(out[0]) if out else None
        except (CkptError, IndexError) as exc:
            log.debug("end time of job %s not known: %s", job_id, exc)
            cache["value"] = None
        return cache["value"]

    return end_time


_default: Optional[SlurmClient] = None


def get_client(**kwargs: Any) -> SlurmClient:
    """A shared :class:`SlurmClient` (a new one when ``kwargs`` are given)."""
    global _default
    if kwargs:
        return SlurmClient(**kwargs)
    if _default is None:
        _default = SlurmClient()
    return _default
