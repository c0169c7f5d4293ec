"""click parameter types for values with units, node lists and job ids.

Every ``ckpt-slurm`` and ``ckpt-srun`` option that takes a duration, size, rate, node
list or job id uses one of these, so that the grammar of :mod:`slurm_ckpt.core.units`
(and SLURM's host lists) holds on every command line, and a bad value is a click usage
error: one line, exit status 2 (:data:`slurm_ckpt.errors.EXIT_USAGE`).

Bare numbers: :data:`DURATION`, :data:`SIZE` and :data:`RATE` refuse ``--wait 5`` (is it
seconds, minutes or hours?) with the fix in the message (``write 5s, 5min or 5h``). The
only exception is :data:`SECONDS_COMPAT` for ``prolog/epilog --budget``, which hook
scripts installed by earlier versions call with a plain number of seconds.
"""

from __future__ import annotations

from typing import Any, Optional

import click

from slurm_ckpt.errors import CkptError

__all__ = [
    "DURATION",
    "JOB_ID",
    "NODE",
    "NODELIST",
    "RATE",
    "SECONDS_COMPAT",
    "SIZE",
    "USER",
    "Duration",
    "JobId",
    "NodeList",
    "UserName",
]


class Duration(click.ParamType):
    """``90s``, ``5min``, ``1h30m``, ``1-00:00:00`` -> seconds (float)."""

    name = "duration"

    def __init__(self, minimum: float = 0.0, bare_seconds: bool = False) -> None:
        self.minimum = minimum
        self.bare_seconds = bare_seconds

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "DURATION"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Any) -> float:
        from slurm_ckpt.core.units import parse_duration

        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)  # a default given in seconds
        else:
            text = str(value)
            try:
                if self.bare_seconds and text.strip().replace(".", "", 1).isdigit():
                    seconds = parse_duration(float(text), _what(param))
                else:
                    seconds = parse_duration(text, _what(param))
            except CkptError as exc:
                self.fail(_strip_what(str(exc), param), param, ctx)
        if seconds < self.minimum:
            from slurm_ckpt.core.units import format_duration

            least = format_duration(self.minimum)
            self.fail(f"must be at least {least}, got {value!r}", param, ctx)
        return seconds


class _Size(click.ParamType):
    """``64MiB``, ``10GB`` -> bytes (int)."""

    name = "size"

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "SIZE"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Any) -> int:
        from slurm_ckpt.core.units import parse_size

        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return parse_size(str(value), _what(param))
        except CkptError as exc:
            self.fail(_strip_what(str(exc), param), param, ctx)


class _Rate(click.ParamType):
    """``500MB/s``, ``3GB/s`` -> bytes per second (float)."""

    name = "rate"

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "RATE"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Any) -> float:
        from slurm_ckpt.core.units import parse_bandwidth

        if isinstance(value, float):
            return value
        try:
            return parse_bandwidth(str(value), _what(param))
        except CkptError as exc:
            self.fail(_strip_what(str(exc), param), param, ctx)


class NodeList(click.ParamType):
    """A SLURM host list (``n[1-3]``, ``a,b``, ``gpu-[01-04,07]``) -> node names.

    ``single``: exactly one node (``--node`` of the commands that act on the node they
    run on); a list that expands to more is refused with the count.
    """

    name = "nodelist"

    def __init__(self, single: bool = False) -> None:
        self.single = single

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "NODE" if self.single else "NODELIST"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Any) -> Any:
        if isinstance(value, list):
            return value
        from slurm_ckpt.core.names import validate_node
        from slurm_ckpt.slurm import hostlist

        text = str(value).strip()
        try:
            nodes = hostlist.expand(text)
            if not nodes:
                raise CkptError(f"empty node list {text!r}")
            for n in nodes:
                validate_node(n)
        except CkptError as exc:
            self.fail(str(exc), param, ctx)
        except ValueError as exc:  # hostlist syntax
            self.fail(f"bad node list {text!r}: {exc}", param, ctx)
        if self.single:
            if len(nodes) != 1:
                self.fail(
                    f"{text!r} names {len(nodes)} nodes; this command acts on one node "
                    "(the one it runs on)",
                    param,
                    ctx,
                )
            return nodes[0]
        return nodes


class JobId(click.ParamType):
    """A SLURM job id (digits): ``flush --job abc`` is a usage error, not a SLURM error."""

    name = "jobid"

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "JOBID"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Any) -> str:
        text = str(value).strip()
        if not text.isdigit() or not text.isascii() or int(text) <= 0:
            self.fail(f"expected a SLURM job id (a positive number), got {value!r}", param, ctx)
        return str(int(text))


class UserName(click.ParamType):
    """A user name (``-u``): ``-u ''`` is refused, not taken as "no user given"."""

    name = "user"

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "USER"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Any) -> str:
        from slurm_ckpt.core.names import validate_user

        text = str(value)
        if not text.strip():
            from slurm_ckpt.errors import UsageError

            raise UsageError(f"{_what(param)}: empty user name (leave it out for yourself)")
        return validate_user(text)  # InvalidName: "invalid user name ..." (exit 2)


def _what(param: Optional[click.Parameter]) -> str:
    if param is None:
        return "value"
    opts = getattr(param, "opts", None) or [param.name or "value"]
    return max(opts, key=len)


def _strip_what(message: str, param: Optional[click.Parameter]) -> str:
    """``--wait: '5' has no unit`` -> ``'5' has no unit`` (click names the option)."""
    prefix = _what(param) + ": "
    return message[len(prefix) :] if message.startswith(prefix) else message


DURATION = Duration()
#: ``--budget``: a duration, or (what older installed hook scripts pass) plain seconds.
SECONDS_COMPAT = Duration(bare_seconds=True)
SIZE = _Size()
RATE = _Rate()
NODELIST = NodeList()
NODE = NodeList(single=True)
JOB_ID = JobId()
USER = UserName()
