"""The schema of the site configuration: one frozen dataclass per TOML section, each field
tagged with its kind (path, size, duration, bandwidth, ...) and bounds.

:mod:`slurm_ckpt.core.config` reads, validates and prints configurations against it;
adding a key is adding a field here (and documenting it in ``etc/config.toml``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from slurm_ckpt.core.units import format_bytes, format_duration

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ENV_CONFIG",
    "LEDGER_SUBDIR",
    "PFS",
    "AdmissionConfig",
    "ColdTierConfig",
    "CopyConfig",
    "HooksConfig",
    "JobConfig",
    "LedgerConfig",
    "LocalTierConfig",
    "ManifestsConfig",
    "MetricsConfig",
    "ObjectTierConfig",
    "PartnerConfig",
    "PfsTierConfig",
    "RetentionConfig",
    "TiersConfig",
]

DEFAULT_CONFIG_PATH = Path("/etc/slurm-ckpt/config.toml")
ENV_CONFIG = "SLURM_CKPT_CONFIG"
LEDGER_SUBDIR = ".slurm_ckpt"
STANDALONE_SOURCE = "<standalone>"

PathLike = Union[str, "os.PathLike[str]"]

# Field kinds understood by the generic section parser (stored in field metadata).
KIND_PATH = "path"  # absolute path -> Path
KIND_BOOL = "bool"
KIND_INT = "int"  # integer >= metadata["min"]
KIND_SIZE = "size"  # bytes (int), "64MiB" or a number
KIND_DURATION = "duration"  # seconds (float), "6h" or a number
KIND_BANDWIDTH = "bandwidth"  # bytes/s (float), "500MB/s" or a number; 0 = no limit
KIND_STR = "str"
KIND_URL = "url"  # http:// or https://
KIND_PREFIX = "prefix"  # relative object-key prefix
KIND_BUCKET = "bucket"  # an S3 bucket name
KIND_SIGNALS = "signals"  # list of signal names -> tuple of "SIGxxx"
KIND_AUTO = "auto"  # the string "auto" or unset
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
PREFIX_RE = re.compile(r"^[A-Za-z0-9._/-]*$")
KIND_EXAMPLES = {KIND_SIZE: "64MiB", KIND_DURATION: "6h", KIND_BANDWIDTH: "500MB/s"}
KIND_BASE_UNITS = {KIND_SIZE: "bytes", KIND_DURATION: "seconds", KIND_BANDWIDTH: "bytes per second"}


def field_of(
    kind: str,
    default: Any = dataclasses.MISSING,
    *,
    minimum: float = 0,
    optional: bool = False,
    old: Optional[str] = None,
) -> Any:
    """A dataclass field carrying its config kind (and lower bound) as metadata. ``old``:
    the key's former name, still read for one release (a deprecation warning)."""
    meta = {"kind": kind, "min": minimum, "optional": optional, "old": old}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class LocalTierConfig:
    """``[tiers.local]``: node-local fast storage (NVMe, local SSD)."""

    root: Path = field_of(KIND_PATH)
    #: Refuse a local root that lives on the root filesystem ("/") unless False.
    require_mount: bool = field_of(KIND_BOOL, True)
    #: Bytes that must stay free on the local tier; older checkpoints are evicted first.
    min_free: int = field_of(KIND_SIZE, 10 * 2**30)


@dataclass(frozen=True)
class PfsTierConfig:
    """``[tiers.pfs]``: the shared parallel filesystem (Lustre, GPFS, BeeGFS, NFS)."""

    root: Path = field_of(KIND_PATH)
    #: Cap on flush bandwidth in bytes per second; None = unlimited.
    bandwidth_limit: Optional[float] = field_of(KIND_BANDWIDTH, None, optional=True)


@dataclass(frozen=True)
class ObjectTierConfig:
    """``[tiers.object]``: an S3-compatible object store (:mod:`slurm_ckpt.tiers.s3`).

    Without ``[tiers.pfs]`` it is the warm tier (every flush goes there); with one,
    verified PFS checkpoints go on to it (one per ``every``; 0 = each of them).
    Credentials come from the standard AWS environment variables or ``profile``.
    """

    endpoint: str = field_of(KIND_URL)
    bucket: str = field_of(KIND_BUCKET)
    prefix: str = field_of(KIND_PREFIX, "")
    region: str = field_of(KIND_STR, "us-east-1")
    #: A named profile of ~/.aws/credentials; None = the environment (or default chain).
    profile: Optional[str] = field_of(KIND_STR, None, optional=True)
    #: Root's keys for the hooks: a root-only file in the ~/.aws/credentials format
    #: (section ``profile``, else ``default``). Whoever cannot read it (a job) uses the
    #: environment or ``profile`` instead.
    credentials_file: Optional[Path] = field_of(KIND_PATH, None, optional=True)
    #: Multipart part size (S3 needs >= 5 MiB): a copy splits larger hash chunks into
    #: whole fractions of about this size, else rounds it to whole chunks.
    part_size: int = field_of(KIND_SIZE, 16 * 2**20, minimum=5 * 2**20)
    #: Parts uploaded / ranges downloaded in parallel.
    concurrency: int = field_of(KIND_INT, 8, minimum=1)
    #: Cap on the bandwidth into the store in bytes per second; None = unlimited.
    bandwidth_limit: Optional[float] = field_of(KIND_BANDWIDTH, None, optional=True)
    #: With a PFS: copy one verified PFS checkpoint per this many seconds on (0 = all).
    every: float = field_of(KIND_DURATION, 0.0)


@dataclass(frozen=True)
class ColdTierConfig:
    """``[tiers.cold]``: the archive (an HDD array, a tape-backed HSM): history.

    Checkpoints age into it from the warm tier: one per ``every`` (the oldest verified
    of each window), each verified there before the warm tier may drop it; kept for
    ``keep_for``, pinned ones forever.
    """

    root: Path = field_of(KIND_PATH)
    bandwidth_limit: Optional[float] = field_of(KIND_BANDWIDTH, None, optional=True)
    every: float = field_of(KIND_DURATION, 86400.0, minimum=1e-9)
    keep_for: float = field_of(KIND_DURATION, 30 * 86400.0, minimum=1e-9)


#: The name of the ``[tiers.pfs]`` section and of the tier built from it: a POSIX
#: parallel filesystem (Lustre, GPFS, BeeGFS, NFS) specifically. The *warm* tier (where
#: every flush goes) is this one when configured, else the object store:
#: :attr:`TiersConfig.warm`. Code that means the warm tier says ``warm``, never ``PFS``.
PFS = "pfs"


@dataclass(frozen=True)
class TiersConfig:
    """``[tiers]``: local is required, and a warm tier: pfs, or object (a site without
    a parallel filesystem), or both; cold is optional."""

    local: LocalTierConfig
    pfs: Optional[PfsTierConfig] = None
    object: Optional[ObjectTierConfig] = None
    cold: Optional[ColdTierConfig] = None
    #: ``[tiers] shared``: the shared tiers in flush order, the first the warm tier
    #: (empty: the configured ones in :data:`SHARED_ORDER`, as before).
    shared: Tuple[str, ...] = ()
    #: ``kind`` of each configured section, as ``(name, kind)`` pairs (empty: each
    #: section's alias kind, :data:`SECTION_KINDS`).
    kinds: Tuple[Tuple[str, str], ...] = ()

    @property
    def shared_tiers(self) -> Tuple[str, ...]:
        """The configured shared tiers in flush order: the first is the warm tier. A
        section taken away since (``dataclasses.replace(tiers, pfs=None)``: a command
        that reads the local tier alone) is left out."""
        order = self.shared or SHARED_ORDER
        return tuple(n for n in order if getattr(self, n) is not None)

    @property
    def warm(self) -> str:
        """The tier every flush goes to: the first shared tier (``pfs`` when there is
        one, else ``object``)."""
        shared = self.shared_tiers
        return shared[0] if shared else SHARED_ORDER[0]

    def kind_of(self, name: str) -> str:
        """The kind of tier ``name`` (``posix``, ``s3``): what builds it
        (:mod:`slurm_ckpt.tiers.registry`)."""
        return dict(self.kinds).get(name, SECTION_KINDS[name])


@dataclass(frozen=True)
class RetentionConfig:
    """``[retention]``: how many checkpoints each tier keeps."""

    #: Newest checkpoints kept on the local tier.
    keep_local: int = field_of(KIND_INT, 2, minimum=1)
    #: Every Mth local checkpoint is flushed (copied) to the warm tier.
    flush_every: int = field_of(KIND_INT, 1, minimum=1)
    #: Newest checkpoints kept on the warm tier (the PFS, or the object store).
    keep_warm: int = field_of(KIND_INT, 3, minimum=1, old="keep_pfs")
    #: Additionally keep one warm-tier checkpoint per this many seconds; 0 disables.
    keep_warm_every: float = field_of(KIND_DURATION, 86400.0, old="keep_pfs_every")

    @property
    def keep_pfs(self) -> int:
        """Deprecated name of :attr:`keep_warm` (one release)."""
        return self.keep_warm

    @property
    def keep_pfs_every(self) -> float:
        """Deprecated name of :attr:`keep_warm_every` (one release)."""
        return self.keep_warm_every


@dataclass(frozen=True)
class CopyConfig:
    """``[copy]``: the parallel copy engine used for flushes and staging."""

    streams: int = field_of(KIND_INT, 4, minimum=1)
    chunk_size: int = field_of(KIND_SIZE, 64 * 2**20, minimum=1)
    buffer_size: int = field_of(KIND_SIZE, 16 * 2**20, minimum=1)


@dataclass(frozen=True)
class JobConfig:
    """``[job]``: when a running job checkpoints and how it reacts to signals."""

    interval_tokens: Optional[int] = field_of(KIND_INT, None, minimum=1, optional=True)
    interval_steps: Optional[int] = field_of(KIND_INT, None, minimum=1, optional=True)
    interval_seconds: Optional[float] = field_of(KIND_DURATION, None, minimum=1e-9, optional=True)
    #: "auto": derive the period from ``mtbi`` and the measured checkpoint cost.
    interval: Optional[str] = field_of(KIND_AUTO, None, optional=True)
    #: Mean time between interruptions (node failure, preemption), for interval = "auto".
    mtbi: float = field_of(KIND_DURATION, 86400.0, minimum=1e-9)
    signals: Tuple[str, ...] = field_of(KIND_SIGNALS, ("SIGTERM", "SIGUSR1", "SIGUSR2"))
    max_consecutive_failures: int = field_of(KIND_INT, 3, minimum=1)
    #: Host memory for staging tensors before writing; 0 = choose automatically.
    staging_memory_limit: int = field_of(KIND_SIZE, 0)


@dataclass(frozen=True)
class HooksConfig:
    """``[hooks]``: SLURM prolog/epilog behaviour."""

    #: Time the prolog/epilog may spend; must stay below SLURM's PrologEpilogTimeout.
    budget: float = field_of(KIND_DURATION, 100.0, minimum=1e-9)
    #: Free space the prolog requires on the local tier; None = skip the check.
    expected_checkpoint_size: Optional[int] = field_of(KIND_SIZE, None, optional=True)
    #: On a requeued job, copy the newest PFS checkpoint to the local tier in the prolog.
    stage_on_requeue: bool = field_of(KIND_BOOL, False)
    #: A child running as a user (scan, flush, delete) that shows no progress for this
    #: long is killed and its work retried later (a user can SIGSTOP their own processes).
    child_timeout: float = field_of(KIND_DURATION, 60.0, minimum=1e-3)
    #: A flush child gets at most 10 x child_timeout + size / min_flush_rate in all.
    min_flush_rate: float = field_of(KIND_BANDWIDTH, 10e6, minimum=1.0)
    #: First wait before a failed flush is tried again (doubling, at most 1 hour).
    retry_backoff: float = field_of(KIND_DURATION, 60.0, minimum=1e-3)
    #: After this many failed flushes in a row a checkpoint no longer keeps its node
    #: drained (it is still retried, and reported by status).
    max_retries: int = field_of(KIND_INT, 5, minimum=1)
    #: The prolog frees local space from users with no job on the node: their debris and
    #: unflushable leftovers, then checkpoints already safe on the PFS.
    reclaim_departed: bool = field_of(KIND_BOOL, True)


@dataclass(frozen=True)
class LedgerConfig:
    """``[ledger]``: where the checkpoint ledger lives (default ``<local root>/.slurm_ckpt``)."""

    dir: Path = field_of(KIND_PATH)


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: optional exporters."""

    #: node_exporter textfile collector directory; None = no textfile metrics.
    textfile_dir: Optional[Path] = field_of(KIND_PATH, None, optional=True)
    #: Directory for JSON-lines event logs (events-<node>.jsonl); None = the ledger dir.
    events_dir: Optional[Path] = field_of(KIND_PATH, None, optional=True)


@dataclass(frozen=True)
class ManifestsConfig:
    """``[manifests]``: bounds every manifest root reads must keep (a hostile one
    cannot exhaust root's stack, memory or time; see
    :mod:`slurm_ckpt.core.manifest_limits`). A manifest past one is damage."""

    max_bytes: int = field_of(KIND_SIZE, 16 * 2**20, minimum=4096)
    #: Brackets deep, the whole document (``meta`` itself may nest 32 levels).
    max_depth: int = field_of(KIND_INT, 40, minimum=8)
    #: File entries (payload files) in one checkpoint.
    max_entries: int = field_of(KIND_INT, 100_000, minimum=1)


@dataclass(frozen=True)
class AdmissionConfig:
    """``[admission]``: how many nodes may flush to the shared tier at once, cluster-wide.

    The slots live on the PFS itself (``dir``, default ``<tiers.pfs.root>/.slurm_ckpt/
    slots``), root-owned; see :mod:`slurm_ckpt.admission`. With neither cap set
    there is no cap, and only the jitter applies.
    """

    #: At most this many nodes flush at once; unset = no cap on the count.
    max_nodes: Optional[int] = field_of(KIND_INT, None, minimum=1, optional=True)
    #: At most this much flush bandwidth in total (sum of the holders' rates); 0 = none.
    max_bandwidth: Optional[float] = field_of(KIND_BANDWIDTH, None, optional=True)
    #: Each flush starts after a random delay in [0, jitter): aligned saves spread out.
    jitter: float = field_of(KIND_DURATION, 0.0)
    #: A slot whose holder stops renewing it is free again this long after the last renewal.
    lease: float = field_of(KIND_DURATION, 60.0, minimum=1e-3)
    #: How often a waiting flusher looks at the queue again.
    poll: float = field_of(KIND_DURATION, 1.0, minimum=1e-3)
    #: Longest wait for a slot of a flusher that has no budget of its own (stager, CLI).
    max_wait: float = field_of(KIND_DURATION, 300.0, minimum=1e-3)
    #: Where the slots live; unset = ``<tiers.pfs.root>/.slurm_ckpt/slots`` (a site
    #: without a PFS sets it to a root-owned directory every node mounts).
    dir: Optional[Path] = field_of(KIND_PATH, None, optional=True)

    @property
    def enabled(self) -> bool:
        """True when a cap is set (slots are taken); jitter applies either way."""
        return self.max_nodes is not None or self.max_bandwidth is not None


@dataclass(frozen=True)
class PartnerConfig:
    """``[partner]``: a copy of every rank's committed local checkpoint on a partner
    node's local tier (:mod:`slurm_ckpt.job.partner`), so one lost node loses nothing."""

    #: Copy each committed local checkpoint to the next node of the job (a ring).
    enabled: bool = field_of(KIND_BOOL, False)
    #: Bandwidth cap of the partner copies (per sending rank); 0 = no limit.
    bandwidth: Optional[float] = field_of(KIND_BANDWIDTH, None, optional=True)
    #: Newest partner copies of each series kept on the partner node's local tier.
    keep_partner: int = field_of(KIND_INT, 2, minimum=1)
    #: Rendezvous directory every node of a job mounts (addresses and the job secret go
    #: below it); unset = ``<tiers.pfs.root>/<user>/.slurm_ckpt-partner``.
    dir: Optional[Path] = field_of(KIND_PATH, None, optional=True)
    #: Address the receiver listens on; unset = every interface.
    bind: Optional[str] = field_of(KIND_STR, None, optional=True)
    #: A checkpoint on a node whose manifest names another node (a partner copy) is
    #: left to that node's own hooks while SLURM says it is alive, but for at most this
    #: long after this node's ledger first recorded it: then this node flushes it too
    #: (the owner may have lost its own copy, or the name may be made up). 0 = at once.
    owner_grace: float = field_of(KIND_DURATION, 3600.0, minimum=0.0)


TIER_CLASSES = {
    "local": LocalTierConfig,
    PFS: PfsTierConfig,
    "object": ObjectTierConfig,
    "cold": ColdTierConfig,
}
#: The config's alias table: today's section names and the kind each one's keys
#: describe. ``[tiers.pfs]`` without ``kind`` reads as ``kind = "posix"``, and so on
#: (one release, with a deprecation warning naming the new form). A section may name
#: another kind that reads the same keys (``[tiers.cold] kind = "archive"``); the kinds
#: themselves, what builds a tier of each and which keys it reads, live in
#: :mod:`slurm_ckpt.tiers.registry`.
SECTION_KINDS = {"local": "posix", PFS: "posix", "object": "s3", "cold": "posix"}
#: The object store's section (the warm tier of a site without a PFS).
OBJECT_SECTION = "object"
#: The shared tiers in the one order the flush and aging engines support: a flush goes
#: to the first configured, aging goes down the list.
SHARED_ORDER = (PFS, "object", "cold")
#: The ``[tiers]`` key that lists the shared tiers (the rest of ``[tiers]`` are tables).
SHARED_KEY = "shared"
SECTION_CLASSES = {
    "retention": RetentionConfig,
    "copy": CopyConfig,
    "job": JobConfig,
    "hooks": HooksConfig,
    "ledger": LedgerConfig,
    "metrics": MetricsConfig,
    "admission": AdmissionConfig,
    "manifests": ManifestsConfig,
    "partner": PartnerConfig,
}
TOP_KEYS = ["tiers", *SECTION_CLASSES]


# --------------------------------------------------------------------------- output


def _value_out(kind: str, value: Any, human: bool) -> Any:
    if value is None:
        return None
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    if human:
        if kind == KIND_SIZE:
            return format_bytes(value)
        if kind == KIND_BANDWIDTH:
            return format_bytes(value) + "/s"
        if kind == KIND_DURATION:
            return format_duration(value)
    return value


def section_to_dict(obj: Any, human: bool = False) -> Dict[str, Any]:
    """A section as plain data; ``human`` writes sizes, rates and durations with units."""
    return {
        f.name: _value_out(f.metadata.get("kind", ""), getattr(obj, f.name), human)
        for f in dataclasses.fields(obj)
    }


def tiers_to_dict(tiers: TiersConfig, human: bool = False) -> Dict[str, Any]:
    """``[tiers]`` in the current form: each configured section with its ``kind``, and
    ``shared`` (the shared tiers in flush order)."""
    out: Dict[str, Any] = {}
    for name in TIER_CLASSES:
        section = getattr(tiers, name)
        out[name] = (
            None
            if section is None
            else {"kind": tiers.kind_of(name), **section_to_dict(section, human)}
        )
    out[SHARED_KEY] = list(tiers.shared_tiers)
    return out
