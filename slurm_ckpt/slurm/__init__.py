"""slurm layer: talking to SLURM (queries, drain/resume, requeue, signals), host lists,
and the validated hook/job environment. Imports only core and errors, so hooks and the
job wrapper can use it without the job library."""

from slurm_ckpt.slurm.client import SlurmClient, get_client
from slurm_ckpt.slurm.env import HookEnv, JobEnv, hook_env, job_env
from slurm_ckpt.slurm.hostlist import compress, expand
from slurm_ckpt.slurm.records import REASON_PREFIX, JobInfo, JobNotFound, NodeInfo

__all__ = [
    "REASON_PREFIX",
    "HookEnv",
    "JobEnv",
    "JobInfo",
    "JobNotFound",
    "NodeInfo",
    "SlurmClient",
    "compress",
    "expand",
    "get_client",
    "hook_env",
    "job_env",
]
