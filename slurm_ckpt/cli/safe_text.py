"""The one place root's output makes user text safe for a terminal.

Root runs ``ckpt-slurm`` over every user's data: a ``data_version``, a file name, a
``job`` label, a reason quoting a path. Printed raw, such text can drive the reader's
terminal (ESC/OSC/BEL sequences, the C1 CSI ``U+009B``), make a line read backwards
(bidi overrides such as ``U+202E``), hide characters (zero-width format characters) or
flood a screen (a 1 MB value as one line). Every printer of :mod:`slurm_ckpt.cli`
(tables, ``--parsable``, warnings, errors, summary lines, JSON) sends its text through
:func:`safe_text` or :func:`safe_json`:

* control (C0, DEL, C1), format (bidi, zero-width), line/paragraph separator,
  surrogate, private-use and unassigned characters are escaped as ``\\xNN``,
  ``\\uNNNN`` or ``\\UNNNNNNNN`` (visible, and nothing a terminal acts on);
* a value longer than its limit is cut, saying how much was left out.

JSON is escaped by ``json.dumps`` itself (``ensure_ascii``); :func:`safe_json` only cuts
its long strings.
"""

from __future__ import annotations

import unicodedata
from typing import Any

__all__ = ["CELL_LIMIT", "JSON_LIMIT", "LINE_LIMIT", "is_unsafe", "safe_json", "safe_text"]

#: One table cell, parsable field or summary value.
CELL_LIMIT = 512
#: One message line (errors, warnings, hook reports).
LINE_LIMIT = 2048
#: One string inside a JSON document (scripts get more, but not a megabyte).
JSON_LIMIT = 4096

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})
_SAFE_ASCII = frozenset(chr(c) for c in range(0x20, 0x7F))


def is_unsafe(ch: str) -> bool:
    """Whether one character must not reach a terminal as it is."""
    return ch not in _SAFE_ASCII and unicodedata.category(ch) in _UNSAFE_CATEGORIES


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def safe_text(value: Any, limit: int = CELL_LIMIT, *, keep_newlines: bool = False) -> str:
    """``value`` as text a terminal shows and never obeys, at most about ``limit``
    characters of it (the cut says how many more there were).

    ``keep_newlines``: a multi-line message keeps its line breaks (each line is still
    cleaned); otherwise a newline is escaped like any other control character.
    """
    text = value if isinstance(value, str) else str(value)
    more = len(text) - limit
    if more > 0:
        text = text[:limit]
    if not text.isascii() or not text.isprintable():
        text = "".join(
            _escape(c) if is_unsafe(c) and not (keep_newlines and c == "\n") else c for c in text
        )
    if more > 0:
        text += f"...[{more} more characters]"
    return text


def safe_json(obj: Any, limit: int = JSON_LIMIT) -> Any:
    """``obj`` with every string longer than ``limit`` cut (keys included); the rest is
    left to ``json.dumps(ensure_ascii=True)``, which escapes every non-ASCII character."""
    if isinstance(obj, str):
        more = len(obj) - limit
        return obj if more <= 0 else obj[:limit] + f"...[{more} more characters]"
    if isinstance(obj, dict):
        return {safe_json(k, limit): safe_json(v, limit) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [safe_json(v, limit) for v in obj]
    return obj
