"""``[tiers]`` of the site config: each tier's section, its ``kind``, and the ordered
list of shared tiers whose first is the warm tier.

The current form names the kind of each tier and the shared tiers in flush order::

    [tiers]
    shared = ["pfs", "object"]      # the first is the warm tier: every flush goes there
    [tiers.local]
    kind = "posix"
    root = "/nvme/ckpt"
    [tiers.pfs]
    kind = "posix"
    root = "/lustre/ckpt"
    [tiers.object]
    kind = "s3"
    endpoint = "https://s3.example.org"
    bucket = "ckpt"

``shared`` may be left out: it is then the configured shared tiers in the one order
this release supports (:data:`~slurm_ckpt.core.config_schema.SHARED_ORDER`); ``kind`` of
the local tier may be left out too (it is always a POSIX directory). Today's form (the
shared sections without ``kind``) still loads for one release: each section name reads as
an alias of its kind (:data:`~slurm_ckpt.core.config_schema.SECTION_KINDS`), and a
DeprecationWarning names the new form. What builds a tier of each kind is the business
of :mod:`slurm_ckpt.tiers.registry`; this module only reads the file (the core layer
knows no tier).
"""

from __future__ import annotations

import json
import re
import warnings
from typing import Any, Dict, List, Mapping, Tuple

from slurm_ckpt.core.config_parse import parse_section, type_name, unknown_key
from slurm_ckpt.core.config_schema import (
    OBJECT_SECTION,
    PFS,
    SECTION_KINDS,
    SHARED_KEY,
    SHARED_ORDER,
    STANDALONE_SOURCE,
    TIER_CLASSES,
)

__all__ = ["parse_tiers"]

#: The key of a tier section that names its kind.
KIND_KEY = "kind"
#: How a kind is spelled (the registry knows which exist).
KIND_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


def parse_tiers(
    tiers_raw: Any, src: str, problems: List[str]
) -> Tuple[Dict[str, Any], Tuple[str, ...], Tuple[Tuple[str, str], ...]]:
    """The tier sections of ``[tiers]`` (name -> section object), the shared tiers in
    flush order and each section's kind; every problem appended to ``problems`` as one
    line."""
    tiers_objs: Dict[str, Any] = {}
    if tiers_raw is None:
        problems.append(f"{src}: [tiers.local] is missing (required)")
        problems.append(f"{src}: [tiers.pfs] is missing (required)")
        return tiers_objs, (), ()
    if not isinstance(tiers_raw, Mapping):
        problems.append(f"{src}: tiers: expected a table, got {type_name(tiers_raw)}")
        return tiers_objs, (), ()
    for key in tiers_raw:
        if key not in TIER_CLASSES and key != SHARED_KEY:
            problems.append(unknown_key(src, "tiers", str(key), [*TIER_CLASSES, SHARED_KEY]))
    old_form = False
    kinds: Dict[str, str] = {}
    for name, cls in TIER_CLASSES.items():
        raw = tiers_raw.get(name)
        if raw is None:
            # Library use on a laptop (Checkpointer(local=...) alone, no site file)
            # may have no warm tier; a site always has one.
            no_warm_ok = src == STANDALONE_SOURCE
            if name == "local" or (
                name == PFS and tiers_raw.get(OBJECT_SECTION) is None and not no_warm_ok
            ):
                hint = (
                    f" (or [tiers.{OBJECT_SECTION}] for a site without one)" if name == PFS else ""
                )
                problems.append(f"{src}: [tiers.{name}] is missing (required){hint}")
            continue
        kinds[name] = SECTION_KINDS[name]
        if isinstance(raw, Mapping) and KIND_KEY in raw:
            raw = dict(raw)
            kinds[name] = _check_kind(raw.pop(KIND_KEY), name, src, problems)
        elif name != "local":
            old_form = True
        tiers_objs[name] = parse_section(cls, raw, src, f"tiers.{name}", problems)
    configured = tuple(n for n in SHARED_ORDER if tiers_objs.get(n) is not None)
    shared = configured
    if SHARED_KEY in tiers_raw:
        shared = _check_shared(tiers_raw[SHARED_KEY], configured, src, problems)
    if old_form and configured and src != STANDALONE_SOURCE:
        warnings.warn(f"{src}: {_new_form(configured)}", DeprecationWarning, stacklevel=3)
    return tiers_objs, shared, tuple(sorted(kinds.items()))


def _check_kind(kind: Any, name: str, src: str, problems: List[str]) -> str:
    """A kind's spelling; whether such a kind exists, and reads this section's keys, is
    the registry's to say (:func:`slurm_ckpt.tiers.registry.kind_problems`)."""
    want = SECTION_KINDS[name]
    if not isinstance(kind, str) or not KIND_RE.match(kind):
        problems.append(f'{src}: tiers.{name}.kind: expected a kind name such as "{want}"')
        return want
    return kind


def _check_shared(
    value: Any, configured: Tuple[str, ...], src: str, problems: List[str]
) -> Tuple[str, ...]:
    """``[tiers] shared``: a list naming exactly the configured shared tiers, in the
    order the flush and aging engines support (:data:`SHARED_ORDER`)."""
    want = json.dumps(list(configured))
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"{src}: tiers.shared: expected a list of tier names, e.g. {want}")
        return configured
    for name in value:
        if name not in SHARED_ORDER:
            problems.append(
                f"{src}: tiers.shared: {name!r} is not a shared tier "
                f"(one of: {', '.join(SHARED_ORDER)})"
            )
            return configured
        if name not in configured:
            problems.append(f"{src}: tiers.shared: {name!r} has no [tiers.{name}] section")
            return configured
    if len(set(value)) != len(value) or set(value) != set(configured):
        problems.append(f"{src}: tiers.shared: list every configured shared tier once: {want}")
        return configured
    if tuple(value) != configured:
        problems.append(
            f"{src}: tiers.shared: {json.dumps(value)} is not an order this release supports: "
            f"{want} (the warm tier first, then down to the coldest)"
        )
        return configured
    return tuple(value)


def _new_form(configured: Tuple[str, ...]) -> str:
    kinds = ", ".join(f'kind = "{SECTION_KINDS[n]}" in [tiers.{n}]' for n in configured)
    return (
        "[tiers] sections without kind are deprecated (read as aliases for one "
        f"release); say [tiers] shared = {json.dumps(list(configured))} and {kinds}"
    )
