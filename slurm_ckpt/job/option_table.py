"""The Checkpointer's constructor options, defined once: name, type, default, group,
one line of help for ``help(Checkpointer)`` and the longer text of the options page.

Why one table: the options used to be written four times (the signature, the
``Options`` dataclass, the docstring and docs/user-guide-options.md), and the four
drifted. From this table come :class:`~slurm_ckpt.job.options.Options` (its fields, in
this order, with these defaults), the options section of the Checkpointer's docstring
(:func:`docstring_section`) and the tables of the options page
(``python scripts/options_page.py --write``; tests/test_options_table.py fails when the
page is stale). ``Checkpointer.__init__`` keeps its explicit keyword-only parameters for
IDEs and ``help()``; tests/test_api_surface.py holds them equal to this table (names,
defaults, order).

No logic lives here: this is data, importable by the facade, the docs script and the
tests alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from slurm_ckpt.core.config import Config

__all__ = ["GROUPS", "OPTIONS", "UNSET", "Opt", "docstring_section", "option_rows"]

PathLike = Union[str, "os.PathLike[str]"]


class _Unset:
    """The default of ``end_time_fn``: SLURM's end time (None would mean no deadline)."""

    def __repr__(self) -> str:  # what help() and an IDE show as the default
        return "<SLURM's end time>"


#: "Not given" where None means something (``end_time_fn=None``: no deadline at all).
UNSET: Any = _Unset()


@dataclass(frozen=True)
class Opt:
    """One row: ``name``, its type ``kind`` (an annotation), ``default``, ``group`` (a
    key of :data:`GROUPS`), ``help`` (one line in ``help(Checkpointer)``, continued
    lines indented), ``shown`` (the default as the options page says it) and ``doc``
    (the page's text; defaults to ``help``). ``option`` is False for the tier paths,
    the key and ``config``: the Checkpointer's own arguments, not :class:`Options`."""

    name: str
    kind: Any
    default: Any
    group: str
    help: str
    shown: str = "none"
    doc: str = ""
    option: bool = True


#: group -> its heading in ``help(Checkpointer)``; in this order. The options page has one
#: table per group (but ``deprecated``: its "Old names" table lists more than options).
GROUPS: Dict[str, str] = {
    "where": "Where:",
    "when": "When to save (the first one reached; none anywhere: every 50M tokens):",
    "retention": "Retention and resources:",
    "partner": "Partner copies and the RAM tier (docs/partner.md; the site's ``[partner]``):",
    "identity": "Identity (defaults from the environment):",
    "slurm": "SLURM integration and callbacks:",
    "replicas": 'Replicas agree (docs/user-guide.md, "Replicas agree"):',
    "deprecated": "Deprecated aliases (one release, a DeprecationWarning):",
}

_Rate = Optional[Union[float, str]]

OPTIONS: Tuple[Opt, ...] = (
    # ---------------------------------------------------------------- where
    Opt("local", Optional[PathLike], None, "where",
        "node-local tier root (made, mode 0700, when missing in standalone use).",
        "(required without `config`)",
        "node-local tier root (NVMe, a laptop's disk). Standalone, a missing root is "
        "created, owned by you, mode 0700.", option=False),
    Opt("warm", Optional[PathLike], None, "where",
        "warm tier root (a PFS or shared directory); without it nothing is flushed.",
        "none",
        "warm tier root (a parallel filesystem or any shared directory). Without it "
        "(laptop mode) nothing is flushed and retention keeps the newest `keep_local`.",
        option=False),
    Opt("key", Optional[str], None, "where",
        "the checkpoint series (one per training run), required.",
        "(required; `from_env`: `$SLURM_CKPT_KEY`, else the job id)",
        "the checkpoint series, one per training run.", option=False),
    Opt("config", Optional[Config], None, "where",
        "a site :class:`Config` instead of ``local``/``warm``.",
        "none",
        "a site `Config` instead of `local`/`warm`; a missing tier root is then an error "
        "(the admin's to fix).", option=False),
    # ---------------------------------------------------------------- when to save
    Opt("interval_tokens", Optional[int], None, "when",
        "save every N tokens (pass ``tokens=`` to should_save).", "none",
        "save every N tokens (pass `tokens=` to `should_save`)."),
    Opt("interval_steps", Optional[int], None, "when", "save every N steps.", "none"),
    Opt("interval_seconds", _Rate, None, "when",
        'save every N seconds (a number or "30min").', "none",
        'save every N seconds (`600` or `"10min"`).'),
    Opt("interval", Optional[str], None, "when",
        '"auto": Young/Daly\'s optimum from the measured stall and ``mtbi``.', "none",
        '`"auto"`: Young/Daly\'s optimum from the measured save stall and `mtbi`.'),
    Opt("mtbi", _Rate, None, "when",
        'mean time between interruptions for ``interval="auto"`` (e.g. "6h").',
        "site config",
        'mean time between interruptions, for `interval="auto"` (`"6h"`).'),
    Opt("signals", Optional[Sequence[Union[str, int]]], None, "when",
        "preemption signals that trigger a save (default SIGTERM, SIGUSR1, SIGUSR2).",
        "SIGTERM, SIGUSR1, SIGUSR2 (and SIGINT without SLURM)",
        "signals that ask for a save at the next step boundary; `from_env` adds the one "
        "ckpt-srun relays (`$SLURM_CKPT_SIGNAL`). Outside a SLURM job (no "
        "`$SLURM_JOB_ID`) SIGINT is added unless you pass `signals=`: the first Ctrl-C "
        "saves at the next step boundary, a second interrupts at once."),
    # ---------------------------------------------------------------- retention
    Opt("keep_local", Optional[int], None, "retention",
        "newest checkpoints kept on the local tier.", "2",
        "newest checkpoints kept on the local tier (1 .. 2**63-1)."),
    Opt("flush_every", Optional[int], None, "retention",
        "every Mth checkpoint is copied to the warm tier.", "1",
        "every Mth checkpoint is copied to the warm tier (the preemption save and the "
        "last one always are)."),
    Opt("flush_policy", str, "skip", "retention",
        '"skip" (a newer save replaces a queued flush) or "wait" (save waits).',
        '`"skip"`',
        '`"skip"`: a newer save replaces a flush still queued; `"wait"`: the save waits '
        "for it."),
    Opt("max_consecutive_failures", Optional[int], None, "retention",
        "failed saves in a row before save() raises.", "3",
        "failed saves in a row before `save()`/`should_save()` raise `CheckpointFailed`."),
    Opt("staging_memory_limit", Optional[Union[int, str]], None, "retention",
        'cap on the snapshot buffers (bytes or "8GiB").', "site config",
        'cap on the snapshot buffers (`"8GiB"`); a state that does not fit is written '
        "synchronously."),
    Opt("warm_bandwidth", _Rate, None, "retention",
        'cap on flush bandwidth (bytes/s or "500MB/s").', "unlimited",
        'cap on flush bandwidth to the warm tier (`"500MB/s"`): the `[tiers.pfs]` one, '
        "or `[tiers.object]` on a site without a PFS; needs a warm tier."),
    Opt("ledger_dir", Optional[PathLike], None, "retention",
        "where the node ledger lives.", "`<local>/.slurm_ckpt` standalone",
        "where the node ledger (the tiers' cache) lives."),
    # ---------------------------------------------------------------- partner, RAM
    Opt("partner", Optional[bool], None, "partner",
        "copy each committed checkpoint to the next node of the job (True/False).",
        "the site's `[partner] enabled` (off)",
        "copy each committed checkpoint to the next node of the job "
        "([partner copies](partner.md))."),
    Opt("keep_partner", Optional[int], None, "partner",
        "newest partner copies kept per rank series on the partner's disk.",
        "`[partner] keep_partner` (2)",
        "newest partner copies kept per rank series on the partner's local tier."),
    Opt("partner_bandwidth", _Rate, None, "partner",
        'cap on the partner copies (bytes/s or "1GB/s").', "unlimited",
        'cap on the partner copies (`"1GB/s"`), apart from the flush\'s.'),
    Opt("partner_dir", Optional[PathLike], None, "partner",
        "rendezvous directory every node of the job mounts (addresses, secret).",
        "`<tiers.pfs.root>/<user>/.slurm_ckpt-partner`",
        "rendezvous directory every node of the job mounts (addresses, the job's secret)."),
    Opt("partner_host", Optional[str], None, "partner",
        "the address other nodes reach this rank's partner server at.", "every interface"),
    Opt("ram", Any, None, "partner",
        "the RAM tier, ``True`` or a ``RamOptions`` (docs/in-job-recovery.md): snapshots\n"
        "  in memory by ``ram_save()``, replicated into the partner's memory.",
        "off",
        'the RAM tier: `True` or `RamOptions(every="auto", budget=0.02, keep=1)`; '
        "snapshots taken by `ckpt.ram_save()` stay in host memory and are replicated into "
        "the partner's memory ([in-job recovery](in-job-recovery.md))."),
    # ---------------------------------------------------------------- identity
    Opt("rank", Optional[int], None, "identity",
        "this process's rank (RANK, else SLURM_PROCID).",
        "`RANK`, else `SLURM_PROCID`, else 0",
        "this process's rank; each rank saves its own shard."),
    Opt("world_size", Optional[int], None, "identity",
        "number of ranks (WORLD_SIZE, else the step's task count).",
        "`WORLD_SIZE`, else the step's task count, else 1", "number of ranks."),
    Opt("user", Optional[str], None, "identity",
        "owner of the checkpoints (the current user).", "the current user",
        "owner of the checkpoints."),
    Opt("node", Optional[str], None, "identity", "node name (the host name).",
        "the host name (`from_env`: `SLURMD_NODENAME`)", "node name recorded in manifests."),
    Opt("job", Optional[Union[str, int]], None, "identity",
        "SLURM job id, recorded in manifests and the ledger.",
        "none (`from_env`: `SLURM_JOB_ID`)",
        "SLURM job id recorded in manifests and the ledger."),
    Opt("takeover", bool, False, "identity",
        "take the key over from a writer that looks alive but is known dead (a\n"
        '  hung process, a node given up; docs/user-guide.md, "One writer per key").',
        "`False`",
        "take the key over from a writer that still looks alive but is known dead (a hung "
        "process, a node given up); that writer can commit nothing afterwards. See the user "
        'guide, "One writer per key".'),
    # ---------------------------------------------------------------- SLURM, callbacks
    Opt("install_signals", bool, True, "slurm",
        "install handlers for ``signals`` (False: you call nothing else).", "True",
        "install handlers for `signals` (they only set a flag)."),
    Opt("requeue", bool, False, "slurm",
        "requeue the job after a save caused by the time limit.", "False"),
    Opt("requeue_fn", Optional[Callable[[str], None]], None, "slurm",
        "``fn(reason)`` that requeues (default: scontrol requeue).", "`scontrol requeue`",
        "`fn(reason)` that requeues the job."),
    Opt("job_state_fn", Optional[Callable[[], Optional[str]]], None, "slurm",
        "``fn() -> state`` of the job (why the signal came).", "none",
        "`fn() -> state`: the job's state, to tell a time limit from a preemption."),
    Opt("end_time_fn", Optional[Callable[[], Optional[float]]], UNSET, "slurm",
        "``fn() -> epoch`` of the job's end (default SLURM_JOB_END_TIME).",
        "`SLURM_JOB_END_TIME` (or squeue)",
        "`fn() -> epoch` of the job's end; `None`: no deadline. The last save comes "
        "before it."),
    Opt("kill_wait_s", float, 30.0, "slurm",
        "seconds between SIGTERM and SIGKILL (SLURM's KillWait).", "30"),
    Opt("signal_lead_s", Optional[float], None, "slurm",
        "seconds before the end at which the warning signal comes.", "none",
        "seconds before the end at which the warning signal comes (`--signal=USR1@N`)."),
    Opt("agree", Optional[Callable[[int], int]], None, "slurm",
        "``fn(value) -> min over ranks`` for restore (default torch.distributed).",
        "torch.distributed min all-reduce",
        "`fn(value) -> min over ranks`, so all ranks restore one step."),
    Opt("on_event", Optional[Callable[[str, Dict[str, Any]], None]], None, "slurm",
        "``fn(name, info)``, called from background threads too: keep it quick,\n"
        "  never call the Checkpointer from it.",
        "none",
        "`fn(name, info)` for progress events; called from background threads: keep it "
        "quick and never call the Checkpointer from it."),
    # ---------------------------------------------------------------- replicas
    Opt("replicas", Any, None, "replicas",
        "the ranks holding the same state compare their digests at each save\n"
        "  (True: every rank, DDP; a list of rank lists; a process group; (mesh, dim)).",
        "none (off)",
        "which ranks hold the same state and compare their digests at each save: `True` "
        "(every rank: DDP), a list of rank lists (HSDP: `[[0, 2], [1, 3]]`), a process "
        'group of this rank\'s replicas, or `(device_mesh, "dim")`. Needs '
        "torch.distributed initialised before the Checkpointer."),
    Opt("replicated", str, "weights", "replicas",
        '"weights" (the model\'s blobs) or "all" (every file) must be identical.',
        '`"weights"`',
        "which files must be identical: the model's blobs (top-level keys such as "
        '`model`), or `"all"` (every file: the whole state is replicated, RNG and data '
        "position included)."),
    Opt("on_suspect", Any, None, "replicas",
        '``fn(verdict)`` called on the training thread, or "raise" (raises\n'
        "  :class:`~slurm_ckpt.job.replicas.SuspectStep` there) when a step is suspect: in\n"
        "  the next save() (every rank in the same one), wait() or close().",
        "none (logged, an event)",
        "`fn(verdict)`, called on the training thread in the next `save()` (every rank in "
        'the same one, before it saves), `wait()` or `close()`, or `"raise"`: '
        "`slurm_ckpt.SuspectStep` is raised there."),
    # ---------------------------------------------------------------- deprecated
    Opt("pfs", Optional[PathLike], None, "deprecated", "the old name of ``warm``."),
    Opt("pfs_bandwidth", _Rate, None, "deprecated", "the old name of ``warm_bandwidth``."),
)  # fmt: skip


def option_rows() -> List[Opt]:
    """The rows that are :class:`~slurm_ckpt.job.options.Options` fields, in order."""
    return [o for o in OPTIONS if o.option]


def docstring_section() -> str:
    """The options part of ``help(Checkpointer)``: a heading per group, one line per
    option (``name: help``), indented as the class docstring is."""
    lines: List[str] = []
    for group, heading in GROUPS.items():
        rows = [o for o in OPTIONS if o.group == group]
        if not rows:
            continue
        lines.append(f"    {heading}")
        for o in rows:
            first, *rest = o.help.split("\n")
            lines.append(f"      {o.name}: {first}")
            lines.extend(f"      {r}" for r in rest)
    return "\n".join(lines) + "\n"
