"""The torch.distributed.checkpoint backend, for users: ``ckpt.dcp_writer()`` and
``ckpt.dcp_reader()`` hand these out (see docs/dcp.md).

A package of its own above the job floor, beside :mod:`slurm_ckpt.hf` and
:mod:`slurm_ckpt.lightning`, because it is the part that imports torch: the writer
(:mod:`~slurm_ckpt.dcp.storage`), the loader (:mod:`~slurm_ckpt.dcp.reading`, with
ranged reads in :mod:`~slurm_ckpt.dcp.ranged` and the opening of one part file in
:mod:`~slurm_ckpt.dcp.part_file`), the metadata (:mod:`~slurm_ckpt.dcp.meta`) and
non-tensor values (:mod:`~slurm_ckpt.dcp.values`). The job floor keeps what is torch-free:
the ledger and flush of each rank's part series (:mod:`slurm_ckpt.job.dcp_series`), and
the Checkpointer's two doors, which import this package only when called."""

from __future__ import annotations

from slurm_ckpt.dcp.storage import SlurmDcpReader, SlurmDcpWriter, select_step

__all__ = ["SlurmDcpReader", "SlurmDcpWriter", "select_step"]
