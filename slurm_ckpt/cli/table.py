"""Listings for terminals and for scripts: one library, used by every listing command.

Formats (:func:`output_options` adds the flags, :class:`Listing` prints):

* **human** (default): a table that fits the terminal. When the rows are wider than the
  width, optional columns are dropped first (highest ``drop`` first), then cells that
  may wrap are wrapped *at spaces only*: a size (``8.0MiB``), a duration (``1h30m``), a
  node name or a path is never split, and :mod:`slurm_ckpt.core.units` prints no value
  with an inner space, so ``awk '{print $4}'`` on a row gets a whole value. If the
  minimum widths still do not fit, the line runs long rather than cutting a token.
  The width is ``$COLUMNS`` when set, else the terminal's; a pipe without ``$COLUMNS``
  gets full rows (one line each). States are coloured only on a terminal (and not with
  ``$NO_COLOR``): CORRUPT/BAD/FAILED and other errors red, warnings yellow, OK green.
* ``--noheader``: the same rows without the title, the header line and the summary.
* ``--parsable``: one record a line, fields separated by ``|``, a header line of field
  names (unless ``--noheader``), raw values: bytes as integers, durations in seconds,
  ``""`` for none, lists comma-separated, fractions to 6 decimals. A ``%`` or ``|``
  inside a value is written ``%25`` / ``%7C`` so that splitting on ``|`` is always right.
* ``--json``: the command's JSON document.

Field vocabulary, the same in ``--parsable`` headers and ``--json`` of every command:
``tier`` (local, pfs, cold), ``path`` (a checkpoint directory), ``user``, ``key``,
``step``, ``tokens``, ``bytes``, ``files``, ``state`` (OK, CORRUPT, flushed, FAILED,
busy, RUNNING, ...), ``job`` (SLURM job id), ``node``, ``nodes``, ``seconds`` (how long
an operation took), ``age_s`` (seconds since a checkpoint was committed), ``time``
(epoch seconds); other byte counts end in ``_bytes``, other durations in ``_s``, rates
in ``_bps`` (bytes per second).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, TextIO

import click

from slurm_ckpt.cli.safe_text import LINE_LIMIT, safe_text

__all__ = [
    "Column",
    "Listing",
    "OutputFormat",
    "cell_style",
    "echo_wrapped",
    "output_options",
    "parsable_value",
    "plural",
    "render_table",
    "terminal_width",
    "use_colour",
    "warn",
]

RED_STATES = frozenset(
    {"CORRUPT", "BAD", "FAILED", "ERROR", "MISSING", "INCOMPLETE", "UNREADABLE", "FOREIGN"}
)
YELLOW_STATES = frozenset({"busy", "WARNING", "pending", "gone", "unknown", "DRAIN", "DRAINED"})
GREEN_STATES = frozenset({"OK", "flushed", "RUNNING", "ready"})

_ANSI = {"red": "\x1b[31m", "yellow": "\x1b[33m", "green": "\x1b[32m", "bold": "\x1b[1m"}
_RESET = "\x1b[0m"


def plural(n: int, noun: str, plural_form: Optional[str] = None) -> str:
    """``1 job``, ``2 jobs``, ``0 checkpoints``."""
    return f"{n} {noun if n == 1 else (plural_form or noun + 's')}"


# --------------------------------------------------------------------------- environment


def terminal_width(stream: Optional[TextIO] = None) -> Optional[int]:
    """Columns to fit: ``$COLUMNS`` if set, else the terminal's; None for a pipe."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    stream = stream or sys.stdout
    try:
        if stream.isatty():
            return shutil.get_terminal_size((100, 24)).columns
    except (AttributeError, ValueError, OSError):
        pass
    return None


def use_colour(stream: Optional[TextIO] = None) -> bool:
    """Colour only on a terminal, never with ``$NO_COLOR`` or ``TERM=dumb``."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    stream = stream or sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def cell_style(text: str) -> Optional[str]:
    """The colour of a state word (``CORRUPT`` red, ``busy`` yellow, ``OK`` green)."""
    word = text.split(" ", 1)[0].split("+", 1)[0]
    if word in RED_STATES or word.upper() in RED_STATES:
        return "red"
    if word in YELLOW_STATES:
        return "yellow"
    if word in GREEN_STATES:
        return "green"
    return None


def _paint(text: str, style: Optional[str], colour: bool) -> str:
    if not colour or not style or not text.strip():
        return text
    return f"{_ANSI[style]}{text}{_RESET}"


def echo_wrapped(text: str, stream: Optional[TextIO] = None) -> None:
    """A summary line for people, wrapped at spaces to the width (never inside a token)."""
    stream = stream or sys.stdout
    width = terminal_width(stream)
    text = safe_text(" ".join(str(text).split()), LINE_LIMIT)
    lines = [text] if width is None else _wrap(text, width)
    stream.write("\n".join(lines) + "\n")
    stream.flush()


def warn(message: str) -> None:
    """A warning for people: ``warning: ...`` on stderr, yellow on a terminal."""
    label = _paint("warning:", "yellow", use_colour(sys.stderr))
    sys.stderr.write(f"{label} {safe_text(' '.join(str(message).split()), LINE_LIMIT)}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- columns


def _human_default(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) if value else "-"
    return str(value)


def parsable_value(value: Any) -> str:
    """A raw value for ``--parsable``: numbers as they are, lists comma-joined."""
    if value is None:
        text = ""
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = repr(round(value, 6)) if value != int(value) else str(int(value))
    elif isinstance(value, (list, tuple)):
        text = ",".join(parsable_value(v) for v in value)
    else:
        text = str(value)
    text = safe_text(text.replace("\n", " "), LINE_LIMIT)
    return text.replace("%", "%25").replace("|", "%7C").replace("\n", " ")


@dataclass
class Column:
    """One column: ``key`` names the field (vocabulary above), ``header`` is for people.

    ``fmt`` renders the raw value for people (default: ``-`` for None, lists with
    commas); ``drop`` > 0 marks an optional column (higher: dropped sooner when the
    table does not fit); ``wrap`` lets the cell wrap at spaces; ``style`` picks a colour
    from the rendered text (default :func:`cell_style` for ``state`` columns);
    ``parsable``/``human``: whether the column is in that format.
    """

    key: str
    header: str
    fmt: Callable[[Any], str] = _human_default
    drop: int = 0
    wrap: bool = False
    right: bool = False
    style: Optional[Callable[[str], Optional[str]]] = None
    parsable: bool = True
    human: bool = True

    def styler(self) -> Optional[Callable[[str], Optional[str]]]:
        if self.style is not None:
            return self.style
        return cell_style if self.key in ("state", "result") else None


def _tokens(text: str) -> List[str]:
    return text.split() or [""]


def _wrap(text: str, width: int) -> List[str]:
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width=width, break_long_words=False, break_on_hyphens=False) or [""]


def render_table(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    width: Optional[int],
    header: bool = True,
    colour: bool = False,
    gap: int = 2,
) -> List[str]:
    """Lay out already-rendered cells; see the module docstring for the rules."""
    cols = list(range(len(columns)))
    heads = [columns[i].header for i in cols]

    def natural(i: int) -> int:
        cells = [len(r[i]) for r in rows] + ([len(heads[i])] if header else [])
        return max(cells or [0])

    def minimum(i: int) -> int:
        if not columns[i].wrap and not (header and " " in heads[i]):
            return natural(i)
        toks = [len(t) for r in rows for t in (_tokens(r[i]) if columns[i].wrap else [r[i]])]
        if header:
            toks += [len(t) for t in _tokens(heads[i])]
        return max(toks or [0])

    widths = {i: natural(i) for i in cols}
    mins = {i: minimum(i) for i in cols}

    def total(ws: Dict[int, int]) -> int:
        return sum(ws.values()) + gap * max(len(ws) - 1, 0)

    if width is not None:
        # 1. drop optional columns (highest drop first) while even the minimum is too wide
        #    or the natural width is too wide and dropping avoids any wrapping.
        for i in sorted((i for i in cols if columns[i].drop), key=lambda i: -columns[i].drop):
            if total(widths) <= width or len(widths) == 1:
                break  # fits, or nothing would be left
            del widths[i]
            del mins[i]
        # 2. shrink wrappable columns, widest first, down to their longest token - only
        #    if that makes the table fit (wrapping that still overflows only adds lines).
        while total(widths) > width and total(mins) <= width:
            shrinkable = [i for i in widths if widths[i] > mins[i]]
            if not shrinkable:
                break
            i = max(shrinkable, key=lambda k: widths[k] - mins[k])
            widths[i] = max(mins[i], widths[i] - (total(widths) - width))
    keep = [i for i in cols if i in widths]

    out: List[str] = []

    def emit(cells: List[str], styles: List[Optional[str]]) -> None:
        wrapped = [_wrap(c, widths[i]) for c, i in zip(cells, keep)]
        height = max(len(w) for w in wrapped)
        for line_no in range(height):
            parts = []
            for pos, (w, i) in enumerate(zip(wrapped, keep)):
                text = w[line_no] if line_no < len(w) else ""
                last = pos == len(keep) - 1
                padded = text.rjust(widths[i]) if columns[i].right else text.ljust(widths[i])
                if last and not columns[i].right:
                    padded = text
                parts.append(_paint(padded, styles[pos], colour))
            out.append((" " * gap).join(parts).rstrip())

    if header:
        emit([heads[i] for i in keep], ["bold"] * len(keep))
    for r in rows:
        styles = []
        for i in keep:
            styler = columns[i].styler()
            styles.append(styler(r[i]) if styler else None)
        emit([r[i] for i in keep], styles)
    return out


# --------------------------------------------------------------------------- listing


@dataclass
class OutputFormat:
    """What ``--json``, ``--parsable`` and ``--noheader`` asked for."""

    json: bool = False
    parsable: bool = False
    noheader: bool = False

    @property
    def human(self) -> bool:
        return not self.json and not self.parsable

    @property
    def decorated(self) -> bool:
        """Titles, headers and summary lines: human output without ``--noheader``."""
        return self.human and not self.noheader


def output_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--json``, ``--parsable`` and ``--noheader``; the command gets ``out``."""

    fn = click.option(
        "--noheader",
        is_flag=True,
        help="No title, header line or summary (for scripts; sinfo/squeue style).",
    )(fn)
    fn = click.option(
        "--parsable",
        is_flag=True,
        help="One record a line, '|'-separated raw values (bytes, seconds) with a header "
        "line of field names.",
    )(fn)
    fn = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON.")(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, as_json: bool, parsable: bool, noheader: bool, **kw: Any) -> Any:
        if as_json and parsable:
            raise click.UsageError("give --json or --parsable, not both")
        return fn(*args, out=OutputFormat(as_json, parsable, noheader), **kw)

    return wrapper


class Listing:
    """Rows of raw values (dicts keyed by column key) printed in the chosen format."""

    def __init__(
        self,
        columns: Sequence[Column],
        rows: Iterable[Dict[str, Any]],
        title: Optional[str] = None,
    ) -> None:
        self.columns = list(columns)
        self.rows = list(rows)
        self.title = title

    def lines(self, fmt: OutputFormat, width: Optional[int], colour: bool = False) -> List[str]:
        """The printed lines (without newlines) of the human or parsable form."""
        if fmt.parsable:
            cols = [c for c in self.columns if c.parsable]
            out = [] if fmt.noheader else ["|".join(c.key for c in cols)]
            out += ["|".join(parsable_value(r.get(c.key)) for c in cols) for r in self.rows]
            return out
        cols = [c for c in self.columns if c.human]
        cells = [[c.fmt(r.get(c.key)) for c in cols] for r in self.rows]
        cells = [[safe_text(" ".join(str(x).split())) for x in row] for row in cells]
        body = render_table(cols, cells, width=width, header=not fmt.noheader, colour=colour)
        if self.title and not fmt.noheader:
            body = [_paint(self.title, "bold", colour), *body]
        return body

    def print(self, fmt: OutputFormat, stream: Optional[TextIO] = None) -> None:
        """Print to stdout (or ``stream``); JSON is the caller's business."""
        stream = stream or sys.stdout
        text = self.lines(fmt, terminal_width(stream), use_colour(stream))
        if text:
            stream.write("\n".join(text) + "\n")
        stream.flush()
