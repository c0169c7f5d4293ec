"""The SLURM environment of a hook (prolog/epilog) or a job, parsed and validated: the
toolkit's one reader of SLURM variables (hooks, the batch wrapper, the in-job library).

Root-run hooks build paths (``<local root>/<user>/``) and switch to uids taken from these
variables, so every value is checked before use: names through
:mod:`slurm_ckpt.core.names`, ids as plain decimal numbers in range, host lists through
:mod:`slurm_ckpt.slurm.hostlist`. A missing or malformed variable is one
:class:`~slurm_ckpt.errors.SlurmError` line naming the variable, never a traceback and
never a silently wrong default.

slurmd gives prolog and epilog ``SLURM_JOB_ID``, ``SLURM_JOB_USER``, ``SLURM_JOB_UID``,
``SLURM_JOB_GID``, ``SLURMD_NODENAME``, ``SLURM_NODELIST``, ``SLURM_JOB_RESTART_COUNT``,
``SLURM_SCRIPT_CONTEXT`` (``prolog_slurmd``/``epilog_slurmd``) and, in the epilog,
``SLURM_JOB_EXIT_CODE`` (checked on 22.05). Jobs see ``SLURM_JOB_ID``,
``SLURM_JOB_USER``, ``SLURMD_NODENAME``, ``SLURM_JOB_NODELIST``, ``SLURM_RESTART_COUNT``
(only once requeued), ``SLURM_JOB_END_TIME`` (newer SLURMs), ``SLURM_STEP_ID`` ...
"""

from __future__ import annotations

import os
import pwd
import re
import socket
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Tuple

from slurm_ckpt.core.names import node_name, validate_node, validate_user
from slurm_ckpt.errors import CkptError, SlurmError
from slurm_ckpt.slurm import hostlist

__all__ = [
    "HookEnv",
    "JobEnv",
    "hook_env",
    "job_end_time",
    "job_env",
    "parse_job_id",
    "replica_rank",
    "resolve_rank",
    "slurmd_nodename",
    "this_node",
]

_JOB_ID_RE = re.compile(r"^[1-9][0-9]{0,9}$")
_INT_RE = re.compile(r"^-?[0-9]{1,10}$")
#: uids/gids above this are refused (nobody is 65534; 2**31-1 keeps clear of (uid_t)-1).
MAX_ID = 2**31 - 2


def parse_job_id(value: object, what: str = "job id") -> str:
    """A SLURM job id as a string of digits (``"12345"``); array/het suffixes refused."""
    text = str(value).strip() if value is not None else ""
    if not _JOB_ID_RE.match(text):
        raise SlurmError(f"invalid {what} {value!r}: expected a positive number")
    return text


def _get(env: Mapping[str, str], name: str, required: bool) -> Optional[str]:
    value = env.get(name)
    if value is None or value.strip() == "":
        if required:
            raise SlurmError(f"${name} is not set (not running under SLURM?)")
        return None
    return value.strip()


def _int(env: Mapping[str, str], name: str, required: bool, lo: int, hi: int) -> Optional[int]:
    text = _get(env, name, required)
    if text is None:
        return None
    if not _INT_RE.match(text):
        raise SlurmError(f"${name}={text!r}: expected a whole number")
    value = int(text)
    if not lo <= value <= hi:
        raise SlurmError(f"${name}={value}: out of range {lo}..{hi}")
    return value


def _name(env: Mapping[str, str], name: str, required: bool, check) -> Optional[str]:  # noqa: ANN001
    text = _get(env, name, required)
    if text is None:
        return None
    try:
        return check(text)
    except CkptError as exc:
        raise SlurmError(f"${name}: {exc}") from None


def _nodes(env: Mapping[str, str], *names: str) -> List[str]:
    for name in names:
        text = _get(env, name, False)
        if text is None:
            continue
        try:
            return [validate_node(n) for n in hostlist.expand(text)]
        except CkptError as exc:
            raise SlurmError(f"${name}: {exc}") from None
    return []


@dataclass(frozen=True)
class HookEnv:
    """What slurmd tells a prolog/epilog about the job it runs for."""

    job_id: str
    user: str
    uid: int
    gid: int
    node: str
    nodes: List[str] = field(default_factory=list)
    restart_count: int = 0
    context: Optional[str] = None
    exit_code: Optional[int] = None

    @property
    def is_requeue(self) -> bool:
        """The job has run before (requeued after preemption, time limit, node failure)."""
        return self.restart_count > 0


def hook_env(environ: Optional[Mapping[str, str]] = None, check_passwd: bool = True) -> HookEnv:
    """Parse and validate a prolog/epilog environment.

    With ``check_passwd`` the user must exist locally with exactly that uid: a hook that
    creates directories for uid N under the name of user M would hand one user's files
    to another.
    """
    env = os.environ if environ is None else environ
    job_id = parse_job_id(_get(env, "SLURM_JOB_ID", True), "$SLURM_JOB_ID")
    user = _name(env, "SLURM_JOB_USER", True, validate_user)
    uid = _int(env, "SLURM_JOB_UID", True, 0, MAX_ID)
    gid = _int(env, "SLURM_JOB_GID", False, 0, MAX_ID)
    node = _name(env, "SLURMD_NODENAME", True, validate_node)
    assert user is not None and uid is not None and node is not None
    if check_passwd or gid is None:
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            raise SlurmError(f"job user {user!r} is not known on this node (passwd)") from None
        if pw.pw_uid != uid:
            raise SlurmError(f"$SLURM_JOB_UID={uid} does not match user {user!r} (uid {pw.pw_uid})")
        if gid is None:
            gid = pw.pw_gid
    restart = _int(env, "SLURM_JOB_RESTART_COUNT", False, 0, 10**9)
    if restart is None:
        restart = _int(env, "SLURM_RESTART_COUNT", False, 0, 10**9)
    exit_code = _int(env, "SLURM_JOB_EXIT_CODE", False, -(2**31), 2**31 - 1)
    context = _get(env, "SLURM_SCRIPT_CONTEXT", False)
    if context is not None and not re.match(r"^[a-z_]{1,32}$", context):
        raise SlurmError(f"$SLURM_SCRIPT_CONTEXT={context!r}: unexpected value")
    return HookEnv(
        job_id=job_id,
        user=user,
        uid=uid,
        gid=gid,
        node=node,
        nodes=_nodes(env, "SLURM_NODELIST", "SLURM_JOB_NODELIST"),
        restart_count=restart or 0,
        context=context,
        exit_code=exit_code,
    )


@dataclass(frozen=True)
class JobEnv:
    """What a batch script or task learns about its job from the environment.

    ``job_id`` is None outside SLURM (``job_env(required=False)``): the in-job library
    works on plain directories too.
    """

    job_id: Optional[str] = None
    user: Optional[str] = None
    node: Optional[str] = None
    nodes: List[str] = field(default_factory=list)
    restart_count: int = 0
    step_id: Optional[str] = None
    end_time: Optional[float] = None
    name: Optional[str] = None
    #: ``SLURM_PROCID``: this task's rank in its step.
    procid: Optional[int] = None
    #: Tasks of the step this process runs in (``SLURM_STEP_NUM_TASKS``, else
    #: ``SLURM_NTASKS``): the number of checkpoint shards is the number of processes
    #: that actually write one, and a batch script running one Python process sees the
    #: allocation's ``SLURM_NTASKS`` but is a step of one.
    ntasks: Optional[int] = None

    @property
    def in_slurm(self) -> bool:
        return self.job_id is not None

    @property
    def nnodes(self) -> int:
        return len(self.nodes) or 1


def job_env(environ: Optional[Mapping[str, str]] = None, required: bool = True) -> JobEnv:
    """Parse the environment of a process inside a SLURM job (batch script or task).

    The one reader of a job's SLURM variables, for the batch wrapper and the in-job
    library alike. Outside a job: SlurmError, or with ``required=False`` an empty
    :class:`JobEnv`. A malformed variable is a one-line SlurmError naming it.
    """
    env = os.environ if environ is None else environ
    raw_id = _get(env, "SLURM_JOB_ID", False) or _get(env, "SLURM_JOBID", False)
    if raw_id is None:
        if required:
            raise SlurmError("$SLURM_JOB_ID is not set (not running inside a SLURM job)")
        return JobEnv()
    job_id = parse_job_id(raw_id, "$SLURM_JOB_ID")
    end = _int(env, "SLURM_JOB_END_TIME", False, 0, 2**40)
    step = _get(env, "SLURM_STEP_ID", False)
    if step is not None and not re.match(r"^[0-9]{1,10}$", step):
        step = None  # "batch"/"extern" steps have no number; not needed then
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS", False, 1, 10**7)
    if ntasks is None:
        ntasks = _int(env, "SLURM_NTASKS", False, 1, 10**7)
    return JobEnv(
        job_id=job_id,
        user=_name(env, "SLURM_JOB_USER", False, validate_user),
        node=_name(env, "SLURMD_NODENAME", False, validate_node),
        nodes=_nodes(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
        restart_count=_int(env, "SLURM_RESTART_COUNT", False, 0, 10**9) or 0,
        step_id=step,
        end_time=float(end) if end else None,
        name=_get(env, "SLURM_JOB_NAME", False),
        procid=_int(env, "SLURM_PROCID", False, 0, 10**7),
        ntasks=ntasks,
    )


def job_end_time(environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """``SLURM_JOB_END_TIME`` (epoch seconds) if set and sane, else None.

    The default deadline provider of the Checkpointer: SLURM >= 21.08 exports it in the
    job environment. It is not updated when an admin extends the time limit; the SLURM
    client's provider asks the controller instead.
    """
    env = os.environ if environ is None else environ
    try:
        end = _int(env, "SLURM_JOB_END_TIME", False, 0, 2**40)
    except SlurmError:
        return None
    return float(end) if end else None


def resolve_rank(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Tuple[int, int]:
    """``(rank, world_size)``: explicit arguments, else ``RANK``/``WORLD_SIZE`` (torchrun),
    else ``SLURM_PROCID`` and the step's task count, else ``(0, 1)``."""
    env = os.environ if environ is None else environ
    if world_size is None:
        world_size = _int(env, "WORLD_SIZE", False, 1, 10**7)
        if world_size is not None and rank is None:
            rank = _int(env, "RANK", False, 0, 10**7)
    if world_size is None:
        senv = job_env(env, required=False)
        if senv.ntasks is not None and senv.procid is not None:
            world_size = senv.ntasks
            if rank is None:
                rank = senv.procid
    if world_size is None:
        world_size = 1
    if rank is None:
        rank = 0
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CkptError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise CkptError(f"rank must be a whole number in 0..{world_size - 1}, got {rank!r}")
    return rank, world_size


def replica_rank(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the launcher made this process other than the job's first rank
    (``RANK``, ``SLURM_PROCID``, ``LOCAL_RANK`` or ``NODE_RANK`` set and not 0). Why: a
    framework that writes each checkpoint whole from global rank 0 (Lightning) has every
    rank build the same one-part series; the others only restore, and must not be taken
    for a second writer of it (:mod:`slurm_ckpt.job.lease`)."""
    env = os.environ if environ is None else environ
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"):
        text = (env.get(name) or "").strip()
        if _INT_RE.match(text) and int(text) != 0:
            return True
    return False


def this_node(node: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    """This node's SLURM name: ``node`` (an admin's ``--node``: validated), else
    ``$SLURMD_NODENAME`` (SLURM's own name for it, short; validated: a drain must name
    the node SLURM knows), else the host name under the one node-name rule
    (:func:`slurm_ckpt.core.names.node_name`, as the event log and the Checkpointer
    name the node)."""
    if node:
        return validate_node(node)
    slurmd = slurmd_nodename(environ)
    if slurmd is not None:
        return validate_node(slurmd.split(".")[0])
    return node_name(socket.gethostname())


def slurmd_nodename(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``$SLURMD_NODENAME`` as slurmd set it (unvalidated: the caller validates), or None
    outside slurmd's hooks and jobs."""
    env = os.environ if environ is None else environ
    return (env.get("SLURMD_NODENAME") or "").strip() or None
