"""Regenerate the option tables of docs/user-guide-options.md from the one definition of
the Checkpointer's options (:mod:`slurm_ckpt.job.option_table`).

Each table sits between ``<!-- options: GROUP ... -->`` and ``<!-- /options -->``; the
prose around them is the page's own. ``python scripts/options_page.py --write`` rewrites
the page; without ``--write`` it exits 1 when the page is stale (tests/test_options_table.py
asks the same of :func:`render`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from slurm_ckpt.job.option_table import GROUPS, OPTIONS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "user-guide-options.md"
_BLOCK = re.compile(
    r"(<!-- options: (?P<group>\w+)[^>]*-->\n)(?P<body>.*?)(<!-- /options -->)", re.S
)


def table(group: str) -> str:
    """The markdown table of one group: option, default, what it does."""
    if group not in GROUPS:
        raise SystemExit(f"options_page: unknown group {group!r} in {PAGE.name}")
    rows = ["| option | default | what it does |", "| --- | --- | --- |"]
    for o in OPTIONS:
        if o.group == group:
            text = o.doc or " ".join(o.help.replace("``", "`").split())
            rows.append(f"| `{o.name}` | {o.shown} | {text} |")
    return "\n".join(rows) + "\n"


def render(page: str) -> str:
    """``page`` with every generated table made from the option table."""
    return _BLOCK.sub(lambda m: m.group(1) + table(m.group("group")) + m.group(4), page)


def main(argv: list) -> int:
    text = PAGE.read_text()
    new = render(text)
    if "--write" in argv:
        if new != text:
            PAGE.write_text(new)
        return 0
    if new != text:
        print(f"{PAGE} is stale: python scripts/options_page.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
