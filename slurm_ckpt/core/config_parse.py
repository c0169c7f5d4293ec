"""Parsing one section of the site configuration: each key's value converted by its kind,
unknown keys named with a suggestion, former key names read for one release.

:mod:`slurm_ckpt.core.config` assembles the whole :class:`~slurm_ckpt.core.config.Config`
from these sections and adds the checks that span sections; the keys, their kinds and
limits are declared in :mod:`slurm_ckpt.core.config_schema`. Every function here appends
to, or raises with, messages that name the file and the key, so that the caller can report
all problems of a file at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import signal
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from slurm_ckpt.core.config_schema import (
    BUCKET_RE,
    KIND_AUTO,
    KIND_BANDWIDTH,
    KIND_BASE_UNITS,
    KIND_BOOL,
    KIND_BUCKET,
    KIND_DURATION,
    KIND_EXAMPLES,
    KIND_INT,
    KIND_PATH,
    KIND_PREFIX,
    KIND_SIGNALS,
    KIND_SIZE,
    KIND_STR,
    KIND_URL,
    PREFIX_RE,
    SECTION_CLASSES,
    TIER_CLASSES,
)
from slurm_ckpt.core.units import parse_bandwidth, parse_duration, parse_size
from slurm_ckpt.errors import CkptError

__all__ = [
    "MAX_CONFIG_INT",
    "all_keys",
    "convert_value",
    "parse_section",
    "type_name",
    "unknown_key",
]

#: The largest whole number a config value may hold (a signed 64-bit integer: what the
#: ledger and the manifest can store; anything larger is a typo, not a setting).
MAX_CONFIG_INT = 2**63 - 1


def type_name(value: Any) -> str:
    """How a TOML user would call the type of *value* ("an integer", "a table"), for
    messages that say what was found instead of what was expected."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    return type(value).__name__


def unknown_key(
    src: str, prefix: str, key: str, allowed: List[str], elsewhere: Optional[Dict[str, str]] = None
) -> str:
    """The message for an unknown *key* under *prefix* ("" for a top-level section): with
    the closest allowed name, or else where a key of that name lives (*elsewhere*), since a
    typo or a key in the wrong section is the usual cause."""
    where = f"{prefix}.{key}" if prefix else key
    what = "key" if prefix else "section"
    msg = f"{src}: unknown {what} '{where}'"
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    if close:
        hint = f"{prefix}.{close[0]}" if prefix else close[0]
        return f"{msg} (did you mean '{hint}'?)"
    if elsewhere and key in elsewhere:
        return f"{msg} (did you mean '{elsewhere[key]}'?)"
    return msg


def all_keys() -> Dict[str, str]:
    """Bare key name -> its full dotted name, to point at misplaced keys."""
    out: Dict[str, str] = {}
    for tier, cls in TIER_CLASSES.items():
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f"tiers.{tier}.{f.name}")
    for sec, cls in SECTION_CLASSES.items():
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f"{sec}.{f.name}")
    return out


def convert_value(kind: str, value: Any, key: str, minimum: float) -> Any:
    """Convert one value; raise ValueError with a message starting at the key."""
    if kind == KIND_PATH:
        if not isinstance(value, (str, os.PathLike)) or isinstance(value, bool):
            raise ValueError(f"{key}: expected a path string, got {type_name(value)}")
        text = os.fspath(value)
        if not text:
            raise ValueError(f"{key}: must not be empty")
        if "\x00" in text:
            raise ValueError(f"{key}: contains a NUL byte")
        if not os.path.isabs(text):
            raise ValueError(f"{key}: must be an absolute path, got {text!r}")
        return Path(os.path.normpath(text))
    if kind == KIND_BOOL:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false, got {type_name(value)} {value!r}")
        return value
    if kind == KIND_INT:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {type_name(value)} {value!r}")
        if value < minimum:
            raise ValueError(f"{key}: must be at least {int(minimum)}, got {value}")
        if value > MAX_CONFIG_INT:  # e.g. keep_local = 99999999999999999999999
            raise ValueError(f"{key}: must be at most {MAX_CONFIG_INT}, got {value}")
        return value
    if kind in (KIND_SIZE, KIND_DURATION, KIND_BANDWIDTH):
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(
                f"{key}: expected a number or a string such as {KIND_EXAMPLES[kind]}, "
                f"got {type_name(value)}"
            )
        try:
            if kind == KIND_SIZE:
                out: Any = parse_size(value, key)
            elif kind == KIND_DURATION:
                out = parse_duration(value, key)
            else:
                if isinstance(value, (int, float)) and value == 0:
                    return None
                if isinstance(value, str) and value.strip() in ("0", "0/s", "0B/s"):
                    return None
                out = parse_bandwidth(value, key)
        except CkptError as exc:
            hint = ""
            if "has no unit" in str(exc):  # a quoted bare number: say what unquoted means
                hint = f" (an unquoted TOML number is {KIND_BASE_UNITS[kind]})"
            raise ValueError(str(exc) + hint) from None
        if out < minimum or (minimum > 0 and out <= 0):
            if kind == KIND_SIZE:
                raise ValueError(f"{key}: must be at least {int(minimum)} bytes, got {value!r}")
            raise ValueError(f"{key}: must be positive, got {value!r}")
        return out
    if kind == KIND_STR:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {type_name(value)}")
        if not value.strip():
            raise ValueError(f"{key}: must not be empty")
        return value
    if kind == KIND_URL:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a URL string, got {type_name(value)}")
        if not value.startswith(("http://", "https://")) or len(value.split("://", 1)[1]) == 0:
            raise ValueError(f"{key}: expected an http:// or https:// URL, got {value!r}")
        return value
    if kind == KIND_BUCKET:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {type_name(value)}")
        if not BUCKET_RE.match(value) or ".." in value:
            raise ValueError(
                f"{key}: not a bucket name (3-63 of a-z, 0-9, '.', '-'), got {value!r}"
            )
        return value
    if kind == KIND_PREFIX:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {type_name(value)}")
        if value.startswith("/") or ".." in value.split("/") or not PREFIX_RE.match(value):
            raise ValueError(f"{key}: must be a relative key prefix without '..', got {value!r}")
        return value
    if kind == KIND_SIGNALS:
        if not isinstance(value, (list, tuple)):
            raise ValueError(
                f'{key}: expected an array of signal names such as ["SIGTERM"], '
                f"got {type_name(value)}"
            )
        names: List[str] = []
        for item in value:
            if not isinstance(item, str):
                raise ValueError(f'{key}: expected signal names such as "SIGUSR1", got {item!r}')
            name = item.strip().upper()
            if not name.startswith("SIG"):
                name = "SIG" + name
            if name in ("SIGKILL", "SIGSTOP"):
                raise ValueError(f"{key}: {name} cannot be caught")
            if not isinstance(getattr(signal, name, None), signal.Signals):
                raise ValueError(f"{key}: unknown signal {item!r}")
            if name not in names:
                names.append(name)
        return tuple(names)
    if kind == KIND_AUTO:
        if value != "auto":
            raise ValueError(
                f'{key}: expected "auto" or no value, got {value!r} '
                "(use job.interval_seconds for a fixed period)"
            )
        return value
    raise AssertionError(f"unknown config kind {kind}")  # pragma: no cover


def parse_section(
    cls: type,
    data: Any,
    src: str,
    prefix: str,
    problems: List[str],
    extra_defaults: Optional[Dict[str, Any]] = None,
) -> Any:
    """Build one section dataclass from a mapping, appending problems; None on failure."""
    if not isinstance(data, Mapping):
        problems.append(f"{src}: {prefix}: expected a table [{prefix}], got {type_name(data)}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    renamed = {f.metadata["old"]: f.name for f in fields.values() if f.metadata.get("old")}
    kwargs: Dict[str, Any] = {}
    ok = True
    elsewhere = all_keys()
    for key, value in data.items():
        if key in renamed:  # a former name, read for one release
            new = renamed[key]
            if data.get(new) is not None:
                problems.append(f"{src}: {prefix}.{key} is the old name of {new}: give one")
                ok = False
                continue
            warnings.warn(
                f"{src}: {prefix}.{key} is deprecated, say {prefix}.{new}",
                DeprecationWarning,
                stacklevel=2,
            )
            key = new
        if key not in fields:
            problems.append(unknown_key(src, prefix, str(key), list(fields), elsewhere))
            ok = False
            continue
        if value is None:
            continue  # None = unset (only reachable from dicts; TOML has no null)
        meta = fields[key].metadata
        try:
            kwargs[key] = convert_value(meta["kind"], value, f"{prefix}.{key}", meta["min"])
        except ValueError as exc:
            problems.append(f"{src}: {exc}")
            ok = False
    for name, value in (extra_defaults or {}).items():
        kwargs.setdefault(name, value)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in kwargs and data.get(name) is None:
            problems.append(f"{src}: {prefix}.{name} is missing (required)")
            ok = False
    if not ok:
        return None
    return cls(**kwargs)
