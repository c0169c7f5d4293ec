"""Every ``ckpt-slurm`` command registers itself beside its definition, once: its
examples and its audience in one :func:`register` decorator; its summary is its own
docstring's first sentence::

    @register("status", examples=("ckpt-slurm status", ...), user=True)
    @click.command("status")
    def status_cmd(...):
        \"\"\"Checkpoints per job and flush backlog per node, ...\"\"\"

``admin``: listed apart in ``--help`` (root, SLURM hooks, node maintenance); ``user``: it
acts on the caller's own checkpoints, so it takes tier flags and the per-user config. A
subcommand registers by its path (``register("config show", ...)``).

Why an index beside the registrations: ``ckpt-slurm --help`` lists every command, and the
group finds a command's module, without importing any command module (each may import
torch, boto3 or rich; tests/test_cli_basics.py checks). :mod:`.command_index` is that
index, generated from the registrations by ``python -m slurm_ckpt.cli.registry --write``;
tests/test_cli_help.py fails when it is stale, and a registration without examples fails
when its module is imported. So adding a command is: write it with its ``@register``,
then regenerate the index.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Sequence, Tuple, TypeVar

from slurm_ckpt.cli import command_index

if TYPE_CHECKING:  # click is imported by the command modules, not by the index's readers
    import click

__all__ = [
    "Registration",
    "admin_names",
    "declared",
    "examples",
    "register",
    "render_index",
    "short_help",
    "summaries",
    "user_paths",
]

C = TypeVar("C", bound="click.Command")


@dataclass(frozen=True)
class Registration:
    """One command path's declaration (module docstring)."""

    path: str
    examples: Tuple[str, ...]
    admin: bool = False
    user: bool = False


#: What the imported command modules registered: path -> (registration, click command).
_DECLARED: Dict[str, Tuple[Registration, click.Command]] = {}


def register(
    path: str, *, examples: Sequence[str], admin: bool = False, user: bool = False
) -> Callable[[C], C]:
    """Declare the command below as ``ckpt-slurm PATH`` (module docstring)."""
    if not examples or not all(isinstance(e, str) and e.strip() for e in examples):
        raise ValueError(f"ckpt-slurm {path}: register it with at least one example")

    def declare(cmd: C) -> C:
        if path in _DECLARED and _DECLARED[path][1] is not cmd:
            raise ValueError(f"ckpt-slurm {path}: registered twice")
        _DECLARED[path] = (Registration(path, tuple(examples), admin, user), cmd)
        return cmd

    return declare


# --------------------------------------------------------------------------- the index


def admin_names() -> Tuple[str, ...]:
    """The admin commands, listed apart in ``--help``."""
    return command_index.ADMIN


def examples() -> Dict[str, Tuple[str, ...]]:
    """Examples per command path, as ``ckpt-slurm`` shows it (``"config show"``)."""
    return dict(command_index.EXAMPLES)


def user_paths() -> FrozenSet[Tuple[str, ...]]:
    """The user commands, as their words after ``ckpt-slurm``."""
    return frozenset(tuple(p.split()) for p in command_index.USER)


def summaries() -> Dict[str, Tuple[str, str, str]]:
    """Top-level commands: name -> (module, attribute, summary), none imported."""
    return dict(command_index.COMMANDS)


# --------------------------------------------------------------------------- generation


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


def declared() -> Dict[str, Tuple[Registration, click.Command]]:
    """Every registration, by importing every module of :mod:`slurm_ckpt.cli` (for the
    generator and the tests; never on a command's path)."""
    import importlib
    import pkgutil

    import slurm_ckpt.cli as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    return dict(_DECLARED)


def _index_data() -> Tuple[Dict[str, Tuple[str, str, str]], List[Registration]]:
    regs = declared()
    commands: Dict[str, Tuple[str, str, str]] = {}
    for path, (_reg, cmd) in sorted(regs.items()):
        if " " in path:
            continue
        module = sys.modules[cmd.callback.__module__ if cmd.callback else ""]
        attr = next(a for a, v in vars(module).items() if v is cmd)
        commands[path] = (module.__name__, attr, short_help(cmd))
    return commands, [reg for _p, (reg, _c) in sorted(regs.items())]


def render_index() -> str:
    """The text of :mod:`.command_index` for the registrations (formatted by ruff)."""
    commands, regs = _index_data()
    lines = [
        '"""Generated by ``python -m slurm_ckpt.cli.registry --write`` from the commands\'',
        "``@register`` declarations (:mod:`slurm_ckpt.cli.registry`): do not edit; regenerate.",
        '"""',
        "",
        "# ruff: noqa: E501 (generated: the summaries are kept whole, one string each)",
        "",
        "#: Top-level commands: name -> (module, attribute, summary).",
        f"COMMANDS = {commands!r}",
        "#: Admin commands, listed apart in ``--help``.",
        f"ADMIN = {tuple(r.path for r in regs if r.admin)!r}",
        "#: User commands (tier flags, the per-user config), as command paths.",
        f"USER = {tuple(r.path for r in regs if r.user)!r}",
        "#: Examples per command path, the first the simplest.",
        f"EXAMPLES = { {r.path: r.examples for r in regs}!r}",
        "",
    ]
    text = "\n".join(lines)
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", "command_index.py", "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


if __name__ == "__main__":  # pragma: no cover - the generator
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m slurm_ckpt.cli.registry --write")
    # Run as __main__: the command modules register into the imported module, not this one.
    from slurm_ckpt.cli import registry

    Path(command_index.__file__).write_text(registry.render_index())
