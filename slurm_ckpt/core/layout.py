"""Where checkpoints live on a tier: ``<root>/<user>/<key>/step-<NNNNNNNNNN>/``.

Steps are zero-padded to ten digits so that a plain ``ls`` sorts them. Names starting with
a dot inside a key directory are the toolkit's own work areas and are never listed:
``.tmp-*`` (a writer filling a new checkpoint), ``.partial-*`` (a copy in progress, named
by step and by its writer - ``.partial-step-N.<host>.<pid>.<rand>`` - so that two nodes
copying one step to a shared tier never share a work area, and the same node's next copy
can still find and resume it), ``.trash-*`` (a deletion in progress).
"""

from __future__ import annotations

import re
from typing import Iterable, List, Optional, Tuple

from slurm_ckpt.errors import InvalidName

STEP_DIGITS = 10
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
PARTIAL_PREFIX = ".partial-"
TRASH_PREFIX = ".trash-"
LOCK_PREFIX = ".lock-"
_STEP_RE = re.compile(r"^step-([0-9]{10})$")
MAX_STEP = 10**STEP_DIGITS - 1


def step_dirname(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise InvalidName(f"invalid step {step!r}: must be an integer 0..{MAX_STEP}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dirname(name: str) -> Optional[int]:
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


#: Step directory names among NUL-separated names (a file name never holds a NUL).
_STEP_IN_LIST = re.compile(r"(?:\A|\x00)step-([0-9]{10})(?=\x00|\Z)")


def step_numbers(names: Iterable[str]) -> List[int]:
    """The steps of the step directory names among ``names``, newest first: what
    :func:`parse_step_dirname` accepts, found by one regular-expression pass over the
    whole listing (a catalog walk lists every series' directory)."""
    return sorted(map(int, _STEP_IN_LIST.findall("\0".join(names))), reverse=True)


def partial_dirname(step: int, writer: Optional[str] = None) -> str:
    """``.partial-step-N`` (a copy's work area by the step alone, as older versions named
    it), or with ``writer`` that writer's own: ``.partial-step-N.<writer>``."""
    base = PARTIAL_PREFIX + step_dirname(step)
    return base if writer is None else f"{base}.{writer}"


def parse_partial_dirname(name: str) -> Optional[Tuple[int, Optional[str]]]:
    """``(step, writer)`` of a copy's work area (``writer`` None for the old name by step
    alone), or None for any other name."""
    if not name.startswith(PARTIAL_PREFIX):
        return None
    rest = name[len(PARTIAL_PREFIX) :]
    base, dot, writer = rest.partition(".")
    step = parse_step_dirname(base)
    if step is None or (dot and not writer):
        return None
    return step, (writer if dot else None)


def lock_name(step: int) -> str:
    return LOCK_PREFIX + step_dirname(step)
