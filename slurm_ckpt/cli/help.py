"""``ckpt-slurm --help``: user and admin commands apart, whole summaries, an example each.

:class:`GroupedHelp` is the click group class of ``ckpt-slurm``. Its command list has two
sections: commands for everyone, and the admin commands (root, usually run by SLURM or
systemd on compute nodes: :data:`ADMIN_COMMANDS`). Summaries are the first sentence of a
command's help, never cut with "...". :func:`attach_examples` gives every command an
"Examples" epilog from :data:`EXAMPLES` (declared beside each command with its
``@register``, :mod:`slurm_ckpt.cli.registry`, and read from the generated index, so
README and ``--help`` agree and a test can check that none is missing).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import click

from slurm_ckpt.cli.registry import admin_names, examples, short_help

__all__ = ["ADMIN_COMMANDS", "EXAMPLES", "GroupedHelp", "attach_examples", "short_help"]

#: Root-side commands, listed apart from the user commands (:mod:`.registry`).
ADMIN_COMMANDS = admin_names()

#: Examples per command path (as ``ckpt-slurm`` shows them), the first one the simplest;
#: declared beside each command (:func:`slurm_ckpt.cli.registry.register`).
EXAMPLES: Dict[str, Tuple[str, ...]] = examples()


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


def _epilog(lines: Sequence[str]) -> str:
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
