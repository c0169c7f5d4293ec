"""Small helpers shared by every ``ckpt-slurm`` command module.

* :class:`CliState` / :data:`pass_state`: the global options (``--config``) and the lazily
  loaded :class:`~slurm_ckpt.core.config.Config`. Command modules import these from here,
  never from :mod:`slurm_ckpt.cli.main` (which imports them).
* :func:`print_json`, :func:`console`, :func:`print_table`: JSON for scripts, rich for people.
* :func:`error_line`, :func:`print_error`, :func:`oserror_message`: the one-line error format
  ``ckpt-slurm: error: <message>`` on stderr.

``rich`` is imported only when something is actually printed with it, so that ``--version``,
``--help`` and JSON output stay fast.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import click

from slurm_ckpt.cli.safe_text import LINE_LIMIT, safe_json, safe_text

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

    from slurm_ckpt.core.config import Config

PROG = "ckpt-slurm"


# --------------------------------------------------------------------------- state


class CliState:
    """Global options of one ``ckpt-slurm`` invocation (stored in ``ctx.obj``)."""

    def __init__(self, config_path: Optional[str] = None) -> None:
        self.config_path = config_path
        #: Tier flags of a user command (``{"local": DIR, ...}``, :mod:`.sources`).
        self.tier_roots: dict = {}
        self._config: Optional[Config] = None

    @property
    def config(self) -> Config:
        """The configuration, loaded and validated on first use (ConfigError if bad): the
        site's, or for user commands tier flags or the user's own (:mod:`.sources`)."""
        if self._config is None:
            from slurm_ckpt.cli.sources import command_words, load_cli_config

            words = command_words(click.get_current_context(silent=True))
            self._config = load_cli_config(self.config_path, self.tier_roots, words)
        return self._config

    def set_config_path(self, path: str) -> None:
        """``--config PATH`` given after the subcommand: it wins over one given before,
        and a configuration loaded already (from the earlier one) is dropped."""
        self.config_path = path
        self._config = None

    def set_tier_root(self, role: str, root: str) -> None:
        """A tier flag (``--local/--warm/--cold DIR``): the tiers without a config file;
        a configuration loaded already is dropped, so that the flag counts."""
        self.tier_roots[role] = root
        self._config = None


#: Decorator for commands: ``@pass_state`` passes the :class:`CliState` as first argument.
pass_state = click.make_pass_decorator(CliState, ensure=True)


# --------------------------------------------------------------------------- output


def print_json(obj: Any) -> None:
    """Write ``obj`` as indented JSON plus a newline to stdout (paths etc. via ``str``)."""
    sys.stdout.write(json.dumps(safe_json(obj), indent=2, default=str) + "\n")
    sys.stdout.flush()


_consoles: dict = {}


def console(stderr: bool = False) -> Console:
    """A shared rich console on stdout (or stderr); plain text when not a terminal."""
    key = "err" if stderr else "out"
    if key not in _consoles:
        from rich.console import Console

        _consoles[key] = Console(stderr=stderr, highlight=False, soft_wrap=True)
    return _consoles[key]


def render_value(value: Any) -> str:
    """A config-ish value as text for people: ``unset``, ``true``, ``a, b``."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) if value else "(none)"
    return str(value)


def print_table(
    title: str, rows: Iterable[Sequence[Any]], headers: Optional[Sequence[str]] = None
) -> None:
    """Print a small key/value (or headed) table; cells go through :func:`render_value`.

    Laid out by :func:`slurm_ckpt.cli.table.render_table`: fits the terminal by wrapping
    at spaces, never inside a token.
    """
    from slurm_ckpt.cli.table import Column, render_table, terminal_width, use_colour

    cells = [[safe_text(" ".join(render_value(c).split())) for c in row] for row in rows]
    names = list(headers or ("key", "value"))
    columns = [Column(str(i), name, wrap=i > 0) for i, name in enumerate(names)]
    colour = use_colour(sys.stdout)
    lines = render_table(
        columns,
        cells,
        width=terminal_width(sys.stdout),
        header=headers is not None,
        colour=colour,
    )
    title_line = f"\x1b[1m{title}\x1b[0m" if colour else title
    sys.stdout.write("\n".join([title_line, *lines]) + "\n")
    sys.stdout.flush()


def print_config(cfg: Config) -> None:
    """The effective configuration for people: one table per section, units formatted."""
    data = cfg.to_dict(human=True)
    click.echo(f"config: {cfg.source}\n")
    for tier, values in data["tiers"].items():
        if isinstance(values, list):  # [tiers] shared: the shared tiers in flush order
            click.echo(f"[tiers] {tier} = {', '.join(values) or '(none)'}\n")
            continue
        if values is None:
            click.echo(f"[tiers.{tier}] not configured")
        else:
            print_table(f"[tiers.{tier}]", values.items())
        click.echo()
    for section, values in data.items():
        if section != "tiers":
            print_table(f"[{section}]", values.items())
            click.echo()


# --------------------------------------------------------------------------- errors


def error_line(message: object) -> str:
    """``ckpt-slurm: error: <message>`` with the message squeezed onto one line."""
    text = safe_text(" ".join(str(message).split()), LINE_LIMIT) or "unknown error"
    return f"{PROG}: error: {text}"


def print_error(message: object) -> None:
    """Write :func:`error_line` to stderr; never raises (stderr may be gone)."""
    try:
        sys.stderr.write(error_line(message) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # pragma: no cover - closed or broken stderr
        pass


def oserror_message(exc: OSError) -> str:
    """``/path: Permission denied`` (or ``src -> dst: ...``) from an OSError."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is not None and exc.filename2 is not None:
        return f"{exc.filename} -> {exc.filename2}: {reason}"
    if exc.filename is not None:
        return f"{exc.filename}: {reason}"
    return reason
