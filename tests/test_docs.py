"""Every Python code block of the README and of the user-facing guides runs.

Why: a snippet that stops working is the first thing a new user meets, and nothing else
would notice. Each ```python block runs in a fresh interpreter in an empty temporary
directory, twice where it says so (a resumed run). A block preceded by a line
``<!-- not run: why -->`` is skipped *by name* here, so the reason is in the document.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The documents whose Python blocks must run (a new user copies from these).
DOCS = [
    "README.md",
    "docs/user-guide.md",
    "docs/user-guide-options.md",
    "docs/frameworks.md",
    "docs/dcp.md",
    "docs/lightning.md",
    "docs/partner.md",
    "docs/cli-laptop.md",
]
_BLOCK = re.compile(r"(?P<pre>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.S)


def _blocks() -> List[Tuple[str, str]]:
    out = []
    for doc in DOCS:
        path = REPO / doc
        if not path.exists():
            continue
        text = "\n" + path.read_text()
        for n, m in enumerate(_BLOCK.finditer(text)):
            if m.group("pre").strip().startswith("<!-- not run"):
                continue
            out.append((f"{doc}#{n}", m.group("code")))
    return out


BLOCKS = _blocks()


def test_the_readme_has_runnable_blocks() -> None:
    assert any(name.startswith("README.md#") for name, _ in BLOCKS)


def test_readme_fits_on_a_few_screens() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 160


@pytest.mark.parametrize("name,code", BLOCKS, ids=[n for n, _ in BLOCKS])
def test_block_runs(name: str, code: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path))
    env.pop("SLURM_JOB_ID", None)
    env.pop("SLURM_CKPT_CONFIG", None)
    script = tmp_path / "snippet.py"
    script.write_text(code + "\n")
    res = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, f"{name} failed:\n{res.stdout}\n{res.stderr}"
