"""The torch.distributed.checkpoint backend, for users: ``ckpt.dcp_writer()`` and
``ckpt.dcp_reader()`` hand these out (see docs/dcp.md). The code lives in the job layer
(:mod:`slurm_ckpt.job.dcp_storage`), which the Checkpointer facade calls."""

from __future__ import annotations

from slurm_ckpt.job.dcp_storage import SlurmDcpReader, SlurmDcpWriter, select_step

__all__ = ["SlurmDcpReader", "SlurmDcpWriter", "select_step"]
