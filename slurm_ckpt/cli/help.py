"""``ckpt-slurm --help``: user and admin commands apart, whole summaries, an example each.

:class:`GroupedHelp` is the click group class of ``ckpt-slurm``. Its command list has two
sections: commands for everyone, and the admin commands (root, usually run by SLURM or
systemd on compute nodes: :data:`ADMIN_COMMANDS`). Summaries are the first sentence of a
command's help, never cut with "...". :func:`attach_examples` gives every command an
"Examples" epilog from :data:`EXAMPLES` (one place, so README and ``--help`` agree and a
test can check that none is missing).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import click

__all__ = ["ADMIN_COMMANDS", "EXAMPLES", "GroupedHelp", "attach_examples", "short_help"]

#: Root-side commands, listed apart from the user commands.
ADMIN_COMMANDS = ("prolog", "epilog", "stager", "install-hooks", "maint", "guard", "doctor")

#: Examples per command path (as ``ckpt-slurm`` shows them), the first one the simplest.
EXAMPLES: Dict[str, List[str]] = {
    "config": ["ckpt-slurm config check", "ckpt-slurm config show --json"],
    "config show": ["ckpt-slurm config show", "ckpt-slurm --config ./site.toml config show --json"],
    "config check": [
        "ckpt-slurm config check",
        "ckpt-slurm config check --offline --config ./site.toml",
    ],
    "status": [
        "ckpt-slurm status",
        "ckpt-slurm status -u alice",
        "ckpt-slurm status -w 'gpu-[001-004]' --nodes",
        "ckpt-slurm status --parsable --noheader | awk -F'|' '$9 > 0'",
    ],
    "list": [
        "ckpt-slurm list",
        "ckpt-slurm list my-run",
        "ckpt-slurm list my-run -u alice --tier warm --parsable",
        "ckpt-slurm list my-run --local ./ckpt/local --warm ./ckpt/pfs   (no site config)",
    ],
    "verify": [
        "ckpt-slurm verify my-run",
        "ckpt-slurm verify my-run --step 4000 --tier warm",
        "ckpt-slurm verify /lustre/checkpoints/alice/my-run/step-0000004000",
        "ckpt-slurm verify my-run --local ./ckpt/local   (no site config)",
    ],
    "seal": [
        "ckpt-slurm seal out/checkpoint-500",
        "ckpt-slurm seal /scratch/alice/dcp/step-2000 --key my-run",
        "ckpt-slurm seal lightning_logs/version_0/checkpoints --step 1200",
    ],
    "adopt": [
        "ckpt-slurm adopt out/checkpoint-500 --key my-run",
        "ckpt-slurm adopt /scratch/alice/dcp/step-2000 --key my-run --tier warm",
        "ckpt-slurm adopt out/checkpoint-500 --key my-run --local ./ckpt/local   (no site config)",
    ],
    "gc": ["ckpt-slurm gc --dry-run", "ckpt-slurm gc -u alice -k my-run --json"],
    "flush": ["ckpt-slurm flush", "ckpt-slurm flush -j 123456 --wait"],
    "drill": ["ckpt-slurm drill my-run", "ckpt-slurm drill my-run -u alice --json"],
    "goodput": ["ckpt-slurm goodput 123456", "ckpt-slurm goodput 123456 --json"],
    "report": [
        "ckpt-slurm report my-run --png my-run.png",
        "ckpt-slurm report my-run --local ./ckpt/local --json   (no site config)",
    ],
    "restore": [
        "ckpt-slurm restore my-run --to /scratch/alice/restore",
        "ckpt-slurm restore my-run --tier cold --step 4000 --to /scratch/alice/3-days-ago",
        "ckpt-slurm restore my-run --local ./ckpt/local --warm ./ckpt/pfs --to ./back",
    ],
    "plan": [
        "ckpt-slurm plan --params 70e9 --local-bw 3GB/s --pfs-bw 500MB/s --mtbi 6h "
        "--max-loss 30min",
        "ckpt-slurm plan --size 350GB --pfs-bw 2GB/s --mtbi 1-00:00:00 --parsable",
    ],
    "prolog": [
        "Prolog=/etc/slurm/ckpt-hooks/prolog   (slurm.conf; the script runs: "
        "ckpt-slurm prolog --budget 100s)"
    ],
    "epilog": [
        "Epilog=/etc/slurm/ckpt-hooks/epilog   (slurm.conf; the script runs: "
        "ckpt-slurm epilog --budget 100s)"
    ],
    "stager": ["systemctl enable --now slurm-ckpt-stager", "ckpt-slurm stager --once"],
    "install-hooks": [
        "ckpt-slurm install-hooks --dest /etc/slurm/ckpt-hooks --config /etc/slurm-ckpt/config.toml"
    ],
    "maint": [
        "ckpt-slurm maint 'gpu-[001-004]' --reason 'firmware' --signal-jobs --reboot",
        "ckpt-slurm maint gpu-007 --reason 'disk swap' --timeout 2h -- /usr/local/sbin/swap",
    ],
    "guard": ["ckpt-slurm guard", "ckpt-slurm guard --wait 5min && /sbin/reboot"],
    "doctor": ["ckpt-slurm doctor", "ckpt-slurm doctor --signal-lead 300s --json"],
}


def short_help(cmd: click.Command) -> str:
    """The command's first sentence, whole (click would cut it at 45 characters)."""
    if cmd.short_help:
        return " ".join(cmd.short_help.split())
    text = (cmd.help or "").partition("\n\n")[0]
    words = [w for w in text.split() if w != "\b"]
    for i, word in enumerate(words):
        if word.endswith(".") and (i == len(words) - 1 or not words[i + 1][0].islower()):
            return " ".join(words[: i + 1])
    return " ".join(words)


class GroupedHelp(click.Group):
    """A click group whose help lists user commands and admin commands apart."""

    def command_summary(self, ctx: click.Context, name: str) -> Optional[str]:
        """The line ``--help`` lists for ``name`` (None: not listed). A group that imports
        its commands lazily answers from its table instead, without importing them."""
        cmd = self.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            return None
        return short_help(cmd)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        user: List[Tuple[str, str]] = []
        admin: List[Tuple[str, str]] = []
        for name in self.list_commands(ctx):
            summary = self.command_summary(ctx, name)
            if summary is None:
                continue
            (admin if name in ADMIN_COMMANDS else user).append((name, summary))
        if user:
            with formatter.section("Commands"):
                formatter.write_dl(user)
        if admin:
            with formatter.section("Admin commands (root; SLURM hooks and node maintenance)"):
                formatter.write_dl(admin)


class ExamplesGroup(click.Group):
    """A sub-group (``config``) with whole summaries, like :class:`GroupedHelp`."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, short_help(cmd)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _epilog(lines: List[str]) -> str:
    # "\b" keeps click from re-flowing the example lines into one paragraph.
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


def attach_examples(cmd: click.Command, path: str = "") -> None:
    """Set the "Examples" epilog of ``cmd`` and its subcommands from :data:`EXAMPLES`."""
    name = f"{path} {cmd.name}".strip()
    if name in EXAMPLES and not cmd.epilog:
        cmd.epilog = _epilog(EXAMPLES[name])
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            attach_examples(sub, name)
