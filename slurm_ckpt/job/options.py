"""The Checkpointer's keyword options as one typed object, and the Config they become.

``Checkpointer(local=..., warm=..., key=..., interval_tokens=..., ...)`` takes a site
config (or the tier paths: ``local`` alone is laptop mode) plus keyword-only options.
Options that are site settings (intervals, retention, staging memory, bandwidth, ledger
directory) are folded into a :class:`~slurm_ckpt.core.config.Config` through
:meth:`Config.from_dict`, so they are checked with the same one-line errors as the config
file; the rest (identity, providers, callbacks) stay here. The options themselves (names,
types, defaults, groups, help) are defined once, in :mod:`slurm_ckpt.job.option_table`.
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Dict, Optional, Type, TypeVar, Union

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.config_schema import PFS, STANDALONE_SOURCE
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.option_table import UNSET, option_rows

__all__ = ["FLUSH_POLICIES", "OPTION_NAMES", "UNSET", "Options", "RamOptions", "build_config"]

PathLike = Union[str, "os.PathLike[str]"]
FLUSH_POLICIES = ("skip", "wait")
_O = TypeVar("_O", bound="_OptionChecks")


_INTERVALS = ("interval_tokens", "interval_steps", "interval_seconds", "interval")


@dataclass(frozen=True)
class RamOptions:
    """The RAM tier (docs/in-job-recovery.md): the newest ``keep`` snapshots of this
    rank's state stay in host memory, hashed like any checkpoint, and (with partner
    copies on) are replicated into the partner rank's memory.

    ``every``: take one every N calls of ``Checkpointer.ram_save()`` (N >= 1), or
    ``"auto"``: as often as ``budget`` allows, the interval chosen at run time from the
    measured cost of a snapshot and its copy against the measured step time.
    ``budget``: the share of step time the RAM tier may cost in ``"auto"`` (0.02: 2 %).
    ``keep``: snapshots kept per series, for this rank and for the partner it holds for
    (memory: ``keep + 1`` buffer sets of the state's size each).
    ``replicate``: send them to the partner (needs ``partner=True``).
    ``bandwidth``: cap on the replication, bytes/s (0 or None: none).
    """

    every: Union[int, str] = "auto"
    budget: float = 0.02
    keep: int = 1
    replicate: bool = True
    bandwidth: Optional[float] = None

    def validate(self) -> RamOptions:
        every = self.every
        if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise CkptError(f'ram: every must be a whole number >= 1 or "auto", got {every!r}')
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 1:
            raise CkptError(f"ram: budget must be a share of step time in (0, 1], got {b!r}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise CkptError(f"ram: keep must be a whole number >= 1, got {self.keep!r}")
        bw = self.bandwidth
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or bw < 0):
            raise CkptError(f"ram: bandwidth must be bytes/s >= 0, got {bw!r}")
        return self


def ram_options(value: Any) -> Optional[RamOptions]:
    """``ram=``: None/False (off), True (the defaults) or a :class:`RamOptions`."""
    if value is None or value is False:
        return None
    if value is True:
        return RamOptions()
    if not isinstance(value, RamOptions):
        raise CkptError(f"ram must be True, False or a RamOptions, got {type(value).__name__}")
    return value.validate()


class _OptionChecks:
    """The checks of :class:`Options`; its fields come from the option table."""

    def validate(self: _O) -> _O:
        """One-line errors for values no config check sees (the identity, the policy)."""
        ram_options(self.ram)
        if self.replicated not in ("weights", "all"):
            raise CkptError(f'replicated must be "weights" or "all", got {self.replicated!r}')
        if (
            self.on_suspect is not None
            and self.on_suspect != "raise"
            and not callable(self.on_suspect)
        ):
            raise CkptError(
                f'on_suspect must be a function or "raise", got {type(self.on_suspect).__name__}'
            )
        if self.flush_policy not in FLUSH_POLICIES:
            raise CkptError(
                f"flush_policy must be one of {FLUSH_POLICIES}, got {self.flush_policy!r}"
            )
        return self

    @classmethod
    def from_kwargs(cls: Type[_O], kwargs: Dict[str, Any]) -> _O:
        """Options from keyword arguments; an unknown one is a one-line error."""
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise CkptError(f"Checkpointer: unknown option {name!r}{hint}")
        return cls(**kwargs).validate()


#: Every keyword option of :class:`~slurm_ckpt.job.checkpointer.Checkpointer`, one field
#: per row of :mod:`slurm_ckpt.job.option_table` (name, type, default, in its order);
#: ``Checkpointer.from_env(**options)`` checks its own through :meth:`from_kwargs`.
Options = make_dataclass(
    "Options",
    [(o.name, o.kind, field(default=o.default)) for o in option_rows()],
    bases=(_OptionChecks,),
)
Options.__module__ = __name__  # make_dataclass's module= is Python 3.12's
Options.__doc__ = (
    "Every keyword option of the Checkpointer, as :mod:`slurm_ckpt.job.option_table` "
    "defines them (that table's help says what each does)."
)


#: Deprecated option names (kept one release: the warm tier was once called "pfs" even
#: where it is an object store) and the names that replaced them.
DEPRECATED_ALIASES = {"pfs": "warm", "pfs_bandwidth": "warm_bandwidth"}


def resolve_aliases(warm: Optional[PathLike], opts: Options) -> Optional[PathLike]:
    """Fold the deprecated ``pfs=``/``pfs_bandwidth=`` into ``warm``/``warm_bandwidth``
    (a warning each; both names at once is a one-line error). Returns the warm root."""
    values: Dict[str, Any] = {"warm": warm, "warm_bandwidth": opts.warm_bandwidth}
    for old, new in DEPRECATED_ALIASES.items():
        value = getattr(opts, old)
        if value is None:
            continue
        if values[new] is not None:
            raise CkptError(f"Checkpointer: give {new}= or its old name {old}=, not both")
        warnings.warn(
            f"Checkpointer: {old}= is deprecated, say {new}=", DeprecationWarning, stacklevel=3
        )
        values[new] = value
        setattr(opts, old, None)
    opts.warm_bandwidth = values["warm_bandwidth"]
    return values["warm"]


#: The option names in declaration order: ``Checkpointer.__init__`` lists exactly these as
#: keyword-only parameters, with the same defaults (tests/test_api_surface.py holds it).
OPTION_NAMES = tuple(f.name for f in fields(Options))


def _tier_path(name: str, value: Any) -> Optional[str]:
    """A tier directory argument: a path (``~`` expanded, as a shell would), or one line
    naming the argument (``local=5`` raised a TypeError from deep inside before)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise CkptError(
            f"Checkpointer: {name}= must be a directory path (str or pathlib.Path), "
            f"not {type(value).__name__}"
        )
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise CkptError(f"Checkpointer: {name}= must be a non-empty directory path")
    return os.path.expanduser(text)


def build_config(
    config: Optional[Config], local: Optional[PathLike], warm: Optional[PathLike], opts: Options
) -> Config:
    """One validated Config from a config (or the tier paths) plus the option overrides.

    Going through :meth:`Config.from_dict` means keyword arguments are checked with the
    same one-line errors as the site config file. An interval given here replaces all the
    config's interval settings (the config's "every 50M tokens" must not linger beside a
    job's "every 500 steps").

    ``warm`` is a directory: the root of the ``[tiers.pfs]`` tier (a parallel filesystem,
    or any shared directory). ``warm_bandwidth`` caps the configured warm tier, whichever
    it is (``[tiers.pfs]``, or ``[tiers.object]`` on a site without a PFS).
    """
    local, warm = _tier_path("local", local), _tier_path("warm", warm)
    if config is not None and not isinstance(config, Config):
        raise CkptError(
            f"Checkpointer: config= must be a slurm_ckpt Config, not {type(config).__name__} "
            "(a file: Checkpointer.from_env(config_path=...))"
        )
    if config is None:
        if local is None:
            raise CkptError("Checkpointer: give local= (and warm= for a warm tier), or config=")
        # local= alone is laptop mode: one tier, no flushes (STANDALONE_SOURCE allows it)
        base = Config.standalone(local, warm).to_dict()
        source = STANDALONE_SOURCE
    else:
        base = config.to_dict()
        source = config.source
        if local is not None:
            base["tiers"]["local"]["root"] = os.path.abspath(os.fspath(local))
        if warm is not None:
            if base["tiers"].get(PFS) is None:
                raise CkptError("Checkpointer: warm= (a directory) needs a [tiers.pfs] site")
            base["tiers"][PFS]["root"] = os.path.abspath(os.fspath(warm))
    if opts.ledger_dir is not None:
        base["ledger"]["dir"] = os.path.abspath(os.fspath(opts.ledger_dir))
    if opts.warm_bandwidth is not None:
        shared = base["tiers"].get("shared") or []  # the warm tier first (to_dict says)
        section = shared[0] if shared else None
        if section is None:
            raise CkptError("Checkpointer: warm_bandwidth= needs a warm tier (warm=)")
        base["tiers"][section]["bandwidth_limit"] = opts.warm_bandwidth
    job = {
        "interval_tokens": opts.interval_tokens,
        "interval_steps": opts.interval_steps,
        "interval_seconds": opts.interval_seconds,
        "interval": opts.interval,
        "mtbi": opts.mtbi,
        "signals": None if opts.signals is None else list(opts.signals),
        "max_consecutive_failures": opts.max_consecutive_failures,
        "staging_memory_limit": opts.staging_memory_limit,
    }
    if any(job.get(k) is not None for k in _INTERVALS):
        for k in _INTERVALS:
            base["job"][k] = None
    retention = {"keep_local": opts.keep_local, "flush_every": opts.flush_every}
    partner = {
        "enabled": opts.partner,
        "keep_partner": opts.keep_partner,
        "bandwidth": opts.partner_bandwidth,
        "dir": None if opts.partner_dir is None else os.path.abspath(os.fspath(opts.partner_dir)),
    }
    for section, values in (("job", job), ("retention", retention), ("partner", partner)):
        for k, v in values.items():
            if v is not None:
                base[section][k] = v
    return Config.from_dict(base, source)
