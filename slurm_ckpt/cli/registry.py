"""Every ``ckpt-slurm`` command in one table: where it lives, its summary, its examples,
and whether it is an admin command or a user command.

Why one table: ``--help`` lists the commands without importing them (each command's
module may import torch, boto3 or rich), the help groups admin commands apart, the user
commands take tier flags and the per-user config (:mod:`.sources`), and every command has
examples that README and ``--help`` share. Kept in four registries, a new command had to
be added four times and a missed one failed only in a test; here it is one entry.

Adding a command: write a module that defines a click command or group (take global
state with ``@pass_state`` from :mod:`slurm_ckpt.cli.output`, never import
:mod:`.app`), then add one :class:`CommandSpec` to :data:`REGISTRY`. Its ``summary`` must
be the command's own first sentence (tests/test_cli_help.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Tuple

__all__ = ["REGISTRY", "CommandSpec", "SubSpec", "admin_names", "examples", "user_paths"]


@dataclass(frozen=True)
class SubSpec:
    """A subcommand of a group command (``config show``)."""

    name: str
    examples: Tuple[str, ...] = ()
    user: bool = False


@dataclass(frozen=True)
class CommandSpec:
    """One top-level command.

    ``module``/``attr`` name the click command, imported when it runs; ``summary`` is what
    ``ckpt-slurm --help`` lists; ``examples`` (the first the simplest) become its "Examples"
    epilog; ``admin`` lists it apart (root, SLURM hooks, node maintenance); ``user``: it
    acts on the caller's own checkpoints, so it takes tier flags and the per-user config.
    """

    name: str
    module: str
    attr: str
    summary: str
    examples: Tuple[str, ...] = ()
    admin: bool = False
    user: bool = False
    subcommands: Tuple[SubSpec, ...] = ()


REGISTRY: Tuple[CommandSpec, ...] = (
    CommandSpec(
        "config",
        "slurm_ckpt.cli.app",
        "config_group",
        "Show or check the site configuration.",
        examples=(
            "ckpt-slurm config check",
            "ckpt-slurm config show --json",
        ),
        subcommands=(
            SubSpec(
                "show",
                examples=(
                    "ckpt-slurm config show",
                    "ckpt-slurm --config ./site.toml config show --json",
                ),
                user=True,
            ),
            SubSpec(
                "check",
                examples=(
                    "ckpt-slurm config check",
                    "ckpt-slurm config check --offline --config ./site.toml",
                ),
                user=True,
            ),
        ),
    ),
    CommandSpec(
        "plan",
        "slurm_ckpt.cli.plan",
        "plan",
        "Size the checkpoint, time each tier and choose how often to save.",
        examples=(
            "ckpt-slurm plan --params 70e9 --local-bw 3GB/s --pfs-bw 500MB/s --mtbi 6h --max-loss "
            "30min",
            "ckpt-slurm plan --size 350GB --pfs-bw 2GB/s --mtbi 1-00:00:00 --parsable",
        ),
    ),
    CommandSpec(
        "list",
        "slurm_ckpt.cli.catalog",
        "list_cmd",
        "List the committed checkpoints of KEY on each tier, or (no KEY) your series.",
        examples=(
            "ckpt-slurm list",
            "ckpt-slurm list my-run",
            "ckpt-slurm list my-run -u alice --tier warm --parsable",
            "ckpt-slurm list my-run --local ./ckpt/local --warm ./ckpt/pfs   (no site config)",
        ),
        user=True,
    ),
    CommandSpec(
        "verify",
        "slurm_ckpt.cli.catalog",
        "verify_cmd",
        "Re-hash every byte of TARGET (a KEY, or a checkpoint directory anywhere) against its "
        "manifest.",
        examples=(
            "ckpt-slurm verify my-run",
            "ckpt-slurm verify my-run --step 4000 --tier warm",
            "ckpt-slurm verify /lustre/checkpoints/alice/my-run/step-0000004000",
            "ckpt-slurm verify my-run --local ./ckpt/local   (no site config)",
        ),
        user=True,
    ),
    CommandSpec(
        "prolog",
        "slurm_ckpt.cli.hooks_cmds",
        "prolog_cmd",
        "SLURM Prolog (root, every node of the job): prepare the local tier or refuse.",
        examples=(
            "Prolog=/etc/slurm/ckpt-hooks/prolog   (slurm.conf; the script runs: ckpt-slurm "
            "prolog --budget 100s)",
        ),
        admin=True,
    ),
    CommandSpec(
        "epilog",
        "slurm_ckpt.cli.hooks_cmds",
        "epilog_cmd",
        "SLURM Epilog (root, every node of the job): flush the job's checkpoints.",
        examples=(
            "Epilog=/etc/slurm/ckpt-hooks/epilog   (slurm.conf; the script runs: ckpt-slurm "
            "epilog --budget 100s)",
        ),
        admin=True,
    ),
    CommandSpec(
        "stager",
        "slurm_ckpt.cli.hooks_cmds",
        "stager_cmd",
        "Per-node daemon: finish flushes the epilog handed off, then resume the node (only if its "
        "drain reason is still ours).",
        examples=(
            "systemctl enable --now slurm-ckpt-stager",
            "ckpt-slurm stager --once",
        ),
        admin=True,
    ),
    CommandSpec(
        "install-hooks",
        "slurm_ckpt.cli.hooks_cmds",
        "install_hooks_cmd",
        "Write DEST/prolog and DEST/epilog calling this ckpt-slurm with that config.",
        examples=(
            "ckpt-slurm install-hooks --dest /etc/slurm/ckpt-hooks --config "
            "/etc/slurm-ckpt/config.toml",
        ),
        admin=True,
    ),
    CommandSpec(
        "status",
        "slurm_ckpt.cli.status",
        "status_cmd",
        "Checkpoints per job and flush backlog per node, as seen from the shared tiers and SLURM.",
        examples=(
            "ckpt-slurm status",
            "ckpt-slurm status -u alice",
            "ckpt-slurm status -w 'gpu-[001-004]' --nodes",
            "ckpt-slurm status --parsable --noheader | awk -F'|' '$9 > 0'",
        ),
        user=True,
    ),
    CommandSpec(
        "gc",
        "slurm_ckpt.cli.gc",
        "gc_cmd",
        "Apply retention on the PFS (and cold) tiers: keep the newest retention.keep_warm "
        "checkpoints that verify now, one per retention.keep_warm_every, and pinned ones.",
        examples=(
            "ckpt-slurm gc --dry-run",
            "ckpt-slurm gc -u alice -k my-run --json",
        ),
        user=True,
    ),
    CommandSpec(
        "maint",
        "slurm_ckpt.cli.maint",
        "maint_cmd",
        "Drain NODELIST, wait until its jobs are gone and every checkpoint is flushed to the PFS, "
        "then reboot it, reserve it, or run COMMAND (after --, without a shell).",
        examples=(
            "ckpt-slurm maint 'gpu-[001-004]' --reason 'firmware' --signal-jobs --reboot",
            "ckpt-slurm maint gpu-007 --reason 'disk swap' --timeout 2h -- /usr/local/sbin/swap",
        ),
        admin=True,
    ),
    CommandSpec(
        "guard",
        "slurm_ckpt.cli.maint",
        "guard_cmd",
        "Exit 0 when this node has no checkpoint waiting for the PFS, else exit 4.",
        examples=(
            "ckpt-slurm guard",
            "ckpt-slurm guard --wait 5min && /sbin/reboot",
        ),
        admin=True,
    ),
    CommandSpec(
        "flush",
        "slurm_ckpt.cli.flush_cli",
        "flush_cmd",
        "Flush this node's checkpoints to the PFS now (root: every user's, as that user; "
        "otherwise your own).",
        examples=(
            "ckpt-slurm flush",
            "ckpt-slurm flush -j 123456 --wait",
        ),
        user=True,
    ),
    CommandSpec(
        "seal",
        "slurm_ckpt.cli.seal_cmd",
        "seal_cmd",
        "Seal a checkpoint directory another tool wrote (DCP, HF checkpoint-N, Lightning's "
        "dirpath, Orbax): write our manifest into it, last and atomically.",
        examples=(
            "ckpt-slurm seal out/checkpoint-500",
            "ckpt-slurm seal /scratch/alice/dcp/step-2000 --key my-run",
            "ckpt-slurm seal lightning_logs/version_0/checkpoints --step 1200",
        ),
    ),
    CommandSpec(
        "adopt",
        "slurm_ckpt.cli.seal_cmd",
        "adopt_cmd",
        "Adopt a sealed directory into one of your series, as a step flush, gc and restore look "
        "after.",
        examples=(
            "ckpt-slurm adopt out/checkpoint-500 --key my-run",
            "ckpt-slurm adopt /scratch/alice/dcp/step-2000 --key my-run --tier warm",
            "ckpt-slurm adopt out/checkpoint-500 --key my-run --local ./ckpt/local   (no site "
            "config)",
        ),
        user=True,
    ),
    CommandSpec(
        "report",
        "slurm_ckpt.cli.report_cmd",
        "report_cmd",
        "A series' life on this node: saves, flushes to the warm tier, failures, and the steps at "
        "risk over time (what a node loss would have cost at each moment).",
        examples=(
            "ckpt-slurm report my-run --png my-run.png",
            "ckpt-slurm report my-run --local ./ckpt/local --json   (no site config)",
        ),
        user=True,
    ),
    CommandSpec(
        "goodput",
        "slurm_ckpt.cli.goodput_cmd",
        "goodput_cmd",
        "Measured goodput of a job run under ckpt-srun: productive time against wall time, steps "
        "recomputed, and per node loss the detection, recovery, restore and back-to-training "
        "times, from the job's timeline on the warm tier.",
        examples=(
            "ckpt-slurm goodput 123456",
            "ckpt-slurm goodput 123456 --json",
        ),
        user=True,
    ),
    CommandSpec(
        "drill",
        "slurm_ckpt.cli.drill",
        "drill_cmd",
        "Recovery drill: copy the checkpoint a restart would use into scratch space, verify and "
        "load it, and report the time to the weights and to the full state.",
        examples=(
            "ckpt-slurm drill my-run",
            "ckpt-slurm drill my-run -u alice --json",
        ),
        user=True,
    ),
    CommandSpec(
        "doctor",
        "slurm_ckpt.cli.doctor",
        "doctor_cmd",
        "Check SLURM and site settings against this node's measured save and flush times: signal "
        "lead, KillWait, PrologEpilogTimeout, preemption signals and requeue, USR1, free space, "
        "the hook scripts, the tier roots.",
        examples=(
            "ckpt-slurm doctor",
            "ckpt-slurm doctor --signal-lead 300s --json",
        ),
        admin=True,
    ),
    CommandSpec(
        "restore",
        "slurm_ckpt.cli.restore_cmd",
        "restore_cmd",
        "Copy a checkpoint of KEY from the fastest tier holding it (or --tier) into DIR, every "
        "byte checked against its manifest; a copy that does not verify is skipped for the next "
        "tier.",
        examples=(
            "ckpt-slurm restore my-run --to /scratch/alice/restore",
            "ckpt-slurm restore my-run --tier cold --step 4000 --to /scratch/alice/3-days-ago",
            "ckpt-slurm restore my-run --local ./ckpt/local --warm ./ckpt/pfs --to ./back",
        ),
        user=True,
    ),
)


def admin_names() -> Tuple[str, ...]:
    """The admin commands, listed apart in ``--help``."""
    return tuple(c.name for c in REGISTRY if c.admin)


def examples() -> Dict[str, Tuple[str, ...]]:
    """Examples per command path, as ``ckpt-slurm`` shows it (``"config show"``)."""
    out: Dict[str, Tuple[str, ...]] = {}
    for c in REGISTRY:
        if c.examples:
            out[c.name] = c.examples
        for s in c.subcommands:
            if s.examples:
                out[f"{c.name} {s.name}"] = s.examples
    return out


def user_paths() -> FrozenSet[Tuple[str, ...]]:
    """The user commands, as their words after ``ckpt-slurm``."""
    paths = {(c.name,) for c in REGISTRY if c.user}
    paths |= {(c.name, s.name) for c in REGISTRY for s in c.subcommands if s.user}
    return frozenset(paths)
