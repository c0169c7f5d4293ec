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
    if name == "README.md#0":  # the quick start says what happened (issue 31: it was silent)
        assert re.search(r"^\d+ saves, \d+ flushed to .*, newest step \d+", res.stdout, re.M), (
            res.stdout
        )


#: Every page a user or admin reads (the README and docs/).
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_docs_carry_no_internal_notes() -> None:
    """Issue 31: seven pages carried "For the lead: ... fold in" notes. docs/ is for users
    and admins; a note for the developers belongs in the commit or the issue."""
    found = [
        f"{p.name}: {ln.strip()[:80]}"
        for p in PAGES
        for ln in p.read_text().splitlines()
        if re.search(r"for the lead|fold (it |this |them )?in\b", ln, re.I)
    ]
    assert not found, found


def test_examples_use_the_current_words() -> None:
    """The examples a user copies say ``--warm`` (``--pfs`` is its old name, accepted for
    one release) and write the tiers' current config form: a shared tier's section names
    its ``kind`` (the old form still loads, and ``config check`` then warns)."""
    import tomllib

    old_flag = re.compile(r"--pfs(?![-\w])")
    blocks = [
        (p.name, m.group("lang"), m.group("code"))
        for p in PAGES
        for m in re.finditer(r"```(?P<lang>\w*)\n(?P<code>.*?)\n```", p.read_text(), re.S)
    ]
    assert not [(n, c) for n, lang, c in blocks if lang != "toml" and old_flag.search(c)]
    tomls = [(n, tomllib.loads(c)) for n, lang, c in blocks if lang == "toml"]
    assert any(n == "cli-laptop.md" for n, _ in tomls)  # the laptop's own config
    kindless = [
        (n, name)
        for n, doc in tomls
        for name, section in doc.get("tiers", {}).items()
        if name != "local" and isinstance(section, dict) and "kind" not in section
    ]
    assert not kindless, kindless


def test_nothing_says_to_install_from_pypi() -> None:
    """slurm-ckpt is not on PyPI (issue 31: ``pip install slurm-ckpt`` finds nothing, and
    the name is unclaimed): no page and no message may send a user there, extras
    included; they install from a checkout or a wheel (README, "Install")."""
    from_index = re.compile(r"pip install ['\"]?slurm[-_]ckpt\b")
    sources = [*PAGES, *sorted((REPO / "slurm_ckpt").rglob("*.py"))]
    found = [
        f"{p.relative_to(REPO)}: {ln.strip()[:90]}"
        for p in sources
        for ln in p.read_text().splitlines()
        if from_index.search(ln)
    ]
    assert not found, found
