"""What a Checkpointer counts: :class:`CheckpointStats`, the counters and last durations
of its saves, local writes and flushes (``ckpt.stats``, ``close()``'s return value).

The pipeline (:mod:`slurm_ckpt.job.pipeline`) and the lazy snapshot update them; logs,
metrics, benchmarks and tests read a copy. Apart from the pipeline because it is the
public record of what happened, not the machinery that makes it happen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["CheckpointStats"]


@dataclass
class CheckpointStats:
    """Counters and last durations, for logs, metrics and tests (a copy: a snapshot)."""

    saves: int = 0
    committed: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    sync_writes: int = 0
    flushes: int = 0
    flush_failures: int = 0
    flush_skipped: int = 0
    left_to_epilog: int = 0
    stall_s: float = 0.0
    wait_s: float = 0.0
    bytes_written: int = 0
    bytes_flushed: int = 0
    last_snapshot_s: Optional[float] = None
    last_stall_s: Optional[float] = None
    last_local_s: Optional[float] = None
    last_flush_s: Optional[float] = None
    last_step: Optional[int] = None
    last_flushed_step: Optional[int] = None
    last_error: Optional[str] = None
    #: Lazy snapshots: how often and how long training waited for a drain to end (the
    #: optimizer step's extra wait), and the last drain's background copy time.
    snapshot_waits: int = 0
    snapshot_wait_s: float = 0.0
    last_drain_s: Optional[float] = None
    #: The RAM tier (``ram=``, docs/in-job-recovery.md): snapshots committed in memory,
    #: copies the partner kept, snapshots superseded before their copy (replication
    #: could not keep up) or not taken (no buffer or memory), failed copies, and the
    #: interval in use (every N ``ram_save()`` calls).
    ram_snapshots: int = 0
    ram_replicated: int = 0
    ram_behind: int = 0
    ram_not_taken: int = 0
    ram_replica_failures: int = 0
    ram_every: Optional[int] = None
    #: Saves whose digests the replicas compared (``replicas=``), and those they did not
    #: agree on (recorded ``suspect``).
    replica_checks: int = 0
    suspect_steps: int = 0
