"""``ckpt-slurm``'s click application, loaded by :mod:`slurm_ckpt.cli.main` when a command
needs it (``ckpt-slurm --version`` alone never imports this module, nor click).

:func:`run` runs the click group :data:`cli` and turns every
:class:`~slurm_ckpt.errors.CkptError`, every user-caused :class:`OSError` (EACCES, ENOSPC,
...) and Ctrl-C into one line ``ckpt-slurm: error: <message>`` on stderr plus an exit code
(the error's ``exit_code``; 1 for OSError; 130 for Ctrl-C). Click usage errors become one
line too (``ckpt-slurm: error: <message> (see 'ckpt-slurm CMD --help')``), exit code 2.
Anything else is a bug and shows its traceback. The exit codes are those of
:mod:`slurm_ckpt.errors` (``EXIT_*``), the one table README.md shows.

``--config PATH`` is accepted before or after the subcommand (``_register`` adds it to
every command), and ``--help`` groups the admin commands apart (:mod:`.help`).

Commands are imported only when they run (or their own ``--help`` is asked for): the group
is a :class:`LazyGroup` and ``ckpt-slurm --help`` lists each command by the summary kept in
:data:`COMMANDS` (a test checks that it is the command's own first sentence), so neither
``--help`` nor one command pays for every other command's imports (torch, boto3, rich).

Adding a command: define it with its ``@register`` (examples, admin or user command;
:mod:`slurm_ckpt.cli.registry`) beside it, then regenerate the index
(``python -m slurm_ckpt.cli.registry --write``).
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import click

from slurm_ckpt import __version__
from slurm_ckpt.cli.help import ExamplesGroup, GroupedHelp, attach_examples
from slurm_ckpt.cli.output import (
    PROG,
    CliState,
    oserror_message,
    pass_state,
    print_config,
    print_error,
    print_json,
)
from slurm_ckpt.cli.registry import register, summaries
from slurm_ckpt.core.platform import require_supported_os
from slurm_ckpt.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CkptError,
)

#: Commands attached to :data:`cli` besides ``config`` (defined here), as ``(name, module,
#: attribute, summary)``, from the index of their registrations
#: (:mod:`slurm_ckpt.cli.registry`): listed without importing them.
COMMANDS: List[Tuple[str, str, str, str]] = [
    (name, module, attr, summary)
    for name, (module, attr, summary) in summaries().items()
    if module != __name__
]

#: OSError numbers that a user or the site causes (permissions, full or read-only disks,
#: wrong paths). They get one line; any other OSError is treated as a bug (traceback).
USER_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EACCES",
        "EPERM",
        "ENOSPC",
        "EDQUOT",
        "EROFS",
        "ENOENT",
        "ENOTDIR",
        "EISDIR",
        "EEXIST",
        "ENOTEMPTY",
        "ENAMETOOLONG",
        "ELOOP",
        "EXDEV",
        "EMFILE",
        "ENFILE",
        "EIO",
        "ESTALE",
        "ETIMEDOUT",
        "EBUSY",
    )
    if hasattr(errno, name)
)

CONFIG_HELP = (
    "Config file (default: $SLURM_CKPT_CONFIG, else /etc/slurm-ckpt/config.toml; user "
    "commands without one: ~/.config/slurm-ckpt/config.toml)."
)


class LazyGroup(GroupedHelp):
    """The ``ckpt-slurm`` group: a command's module is imported when the command is
    resolved (to run it or show its help), then wired (tier flags, ``--config``,
    examples) once. ``--help`` lists the summaries of :attr:`lazy` without importing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: name -> (module, attribute, summary) of the commands not imported yet.
        self.lazy: Dict[str, Tuple[str, str, str]] = {}

    def list_commands(self, ctx: click.Context) -> List[str]:
        return sorted(set(self.commands) | set(self.lazy))

    def get_command(self, ctx: Optional[click.Context], cmd_name: str) -> Optional[click.Command]:
        cmd = self.commands.get(cmd_name)
        if cmd is None and cmd_name in self.lazy:
            module, attr, _summary = self.lazy.pop(cmd_name)
            cmd = getattr(importlib.import_module(module), attr)
            _wire(cmd)
            self.add_command(cmd, cmd_name)
        return cmd

    def command_summary(self, ctx: click.Context, name: str) -> Optional[str]:
        if name in self.lazy:
            return self.lazy[name][2]
        return super().command_summary(ctx, name)

    def all_commands(self) -> Dict[str, click.Command]:
        """Every command, imported (for tests and documentation checks)."""
        for name in list(self.lazy):
            self.get_command(None, name)
        return dict(self.commands)


@click.group(
    name=PROG,
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(
    __version__, "--version", "-V", prog_name=PROG, message="%(prog)s %(version)s"
)
@click.option(
    "--config",
    "config_path",
    metavar="PATH",
    default=None,
    help=CONFIG_HELP,
)
@click.pass_context
def cli(ctx: click.Context, config_path: Optional[str]) -> None:
    """Fast, verified, tiered checkpoints for long training jobs on SLURM clusters.

    Exit status: 0 ok, 1 failed operation or a finding (corrupt checkpoint, failed
    flush), 2 usage or configuration error, 3 SLURM unreachable, 4 not ready (maint,
    guard), 130 interrupted.
    """
    ctx.obj = CliState(config_path)


# --------------------------------------------------------------------------- config


@register(
    "config",
    examples=(
        "ckpt-slurm config check",
        "ckpt-slurm config show --json",
    ),
)
@click.group("config", cls=ExamplesGroup)
def config_group() -> None:
    """Show or check the site configuration."""


@register(
    "config show",
    examples=(
        "ckpt-slurm config show",
        "ckpt-slurm --config ./site.toml config show --json",
    ),
    user=True,
)
@config_group.command("show")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON (bytes, seconds).")
@pass_state
def config_show(state: CliState, as_json: bool) -> None:
    """Print the effective configuration, every default filled in."""
    cfg = state.config
    if as_json:
        print_json(cfg.to_dict())
    else:
        print_config(cfg)


@register(
    "config check",
    examples=(
        "ckpt-slurm config check",
        "ckpt-slurm config check --offline --config ./site.toml",
    ),
    user=True,
)
@config_group.command("check")
@click.option(
    "--offline", is_flag=True, help="Check the file alone (syntax, values), not this node."
)
@pass_state
def config_check(state: CliState, offline: bool) -> None:
    """Validate the configuration and, unless --offline, the tier roots on this node.

    The roots must exist, be directories (not symlinks), be owned by root and not be
    writable by others (unless sticky); the local root must be a mount of its own when
    required and have min_free free. A missing local root and low free space are
    warnings (stderr); anything else exits 2 with one line. A user's own config (their
    file, or tier flags; not as root) may have roots owned by that user.
    """
    import warnings

    from slurm_ckpt.cli.table import warn
    from slurm_ckpt.errors import ConfigError
    from slurm_ckpt.ops.config_check import ERROR, check_roots, own_config

    # A deprecated form still loads; this is the command that says what to write instead
    # (Python hides DeprecationWarnings from a command line by default).
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", DeprecationWarning)
        cfg = state.config
    for w in seen:
        if issubclass(w.category, DeprecationWarning):
            warn(f"deprecated: {w.message}")
    if not offline:
        findings = check_roots(cfg, owner=own_config(cfg))
        errors = [f.text for f in findings if f.level == ERROR]
        if errors:
            raise ConfigError(f"{cfg.source}: " + "; ".join(errors))
        for f in findings:
            warn(f.text)
    click.echo(f"ok: {cfg.source}" + (" (offline: file only)" if offline else ""))


# --------------------------------------------------------------------------- wiring


def _set_config(ctx: click.Context, _param: click.Parameter, value: Optional[str]) -> None:
    """``--config`` given after the subcommand: it wins over one given before."""
    if value is not None:
        state = ctx.find_object(CliState)
        if state is None:
            state = ctx.ensure_object(CliState)
        state.set_config_path(value)


def _add_config_option(cmd: click.Command) -> None:
    """Accept ``--config`` after the subcommand too (unless it has its own)."""
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _add_config_option(sub)
        return
    if any("--config" in getattr(p, "opts", ()) for p in cmd.params):
        return
    cmd.params.append(
        click.Option(
            ["--config"],
            metavar="PATH",
            default=None,
            expose_value=False,
            callback=_set_config,
            help=CONFIG_HELP,
        )
    )


#: Help of the tier flags (user commands without a site config, :mod:`.sources`).
TIER_FLAG_HELP = {
    "local": "The local tier's directory (a Checkpointer's local=), instead of a config file.",
    "warm": "The warm tier's directory (a Checkpointer's warm=); with --local. "
    "--pfs: its old name (deprecated).",
    "cold": "The cold (archive) tier's directory; with --local.",
}


def _set_tier_root(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> None:
    """``--local/--warm/--cold DIR`` of a user command: the tiers without a config file."""
    if value is not None:
        state = ctx.find_object(CliState) or ctx.ensure_object(CliState)
        state.set_tier_root(str(param.name), value)


def _add_tier_flags(cmd: click.Command, words: Tuple[str, ...] = ()) -> None:
    """Give the user commands (:data:`slurm_ckpt.cli.sources.USER_COMMANDS`) tier flags."""
    from slurm_ckpt.cli.sources import TIER_FLAGS, is_user_command

    words = (*words, cmd.name or "")
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _add_tier_flags(sub, words)
        return
    if not is_user_command(words):
        return
    for flags, tier in TIER_FLAGS:
        cmd.params.append(
            click.Option(
                [*flags, tier],
                metavar="DIR",
                default=None,
                expose_value=False,
                callback=_set_tier_root,
                type=click.Path(exists=True, file_okay=False, resolve_path=False),
                help=TIER_FLAG_HELP[tier],
            )
        )


def _wire(cmd: click.Command) -> None:
    """Give one top-level command its tier flags, ``--config`` after it, and examples."""
    _add_tier_flags(cmd)
    _add_config_option(cmd)
    attach_examples(cmd)


def _register() -> None:
    """Attach ``config`` and list every command of :data:`COMMANDS` (imported on use)."""
    _wire(config_group)
    cli.add_command(config_group)
    for name, module_name, attr, summary in COMMANDS:
        cli.lazy[name] = (module_name, attr, summary)


_register()


def _quiet_stdout() -> None:
    """After EPIPE on stdout, point it at /dev/null so the interpreter's flush is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover
        pass


def _click_error(exc: click.ClickException) -> int:
    """Print a click error as one line (help for a bare group); return its exit code."""
    no_args = getattr(click.exceptions, "NoArgsIsHelpError", None)
    if no_args is not None and isinstance(exc, no_args):
        exc.show()  # the help text of a group called without a subcommand
        return exc.exit_code
    message = exc.format_message()
    if isinstance(exc, click.UsageError):
        ctx = exc.ctx
        path = ctx.command_path if ctx is not None else PROG
        print_error(f"{message.rstrip('.')} (see '{path} --help')")
        return EXIT_USAGE
    print_error(message)
    return exc.exit_code


def run(argv: Optional[Sequence[str]] = None) -> int:
    """Run :data:`cli` on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    code = 0
    try:
        require_supported_os()
        rv = cli.main(
            args=list(argv) if argv is not None else None,
            prog_name=PROG,
            standalone_mode=False,
        )
        # --help/--version return click's exit code; a command may return an int status.
        code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
    except CkptError as exc:
        print_error(exc)
        code = exc.exit_code
    except click.exceptions.Abort as exc:
        # click turns Ctrl-C into Abort; a declined confirmation is a plain Abort.
        if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
            print_error("interrupted")
            code = EXIT_INTERRUPTED
        else:
            print_error("aborted")
            code = EXIT_FAILED
    except click.ClickException as exc:
        code = _click_error(exc)
    except click.exceptions.Exit as exc:  # pragma: no cover - click returns it instead
        code = exc.exit_code
    except KeyboardInterrupt:
        print_error("interrupted")
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        code = EXIT_FAILED
    except OSError as exc:
        if exc.errno not in USER_ERRNOS:
            raise
        print_error(oserror_message(exc))
        code = EXIT_FAILED
    return code
