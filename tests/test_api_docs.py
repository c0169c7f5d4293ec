"""The generated Python API reference (``scripts/api-docs``, pdoc over the docstrings)
builds, has a page per public module, and documents the doors users call."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _names(page: Path) -> set:
    return set(re.findall(r'class="name">([A-Za-z_][A-Za-z0-9_]*)<', page.read_text()))


def test_api_reference_builds_with_the_public_doors(tmp_path: Path) -> None:
    out = tmp_path / "api"
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "api-docs"), str(out)],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    pages = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
    for module in ("torch", "dcp", "hf", "lightning", "torch_data", "errors"):
        assert f"slurm_ckpt/{module}.html" in pages, pages
    top = _names(out / "slurm_ckpt.html")
    assert {"Checkpointer", "save", "should_save", "from_env", "Restored", "Saved"} <= top
    assert {"TorchCheckpointer", "restore", "save"} <= _names(out / "slurm_ckpt" / "torch.html")
    assert "CkptError" in _names(out / "slurm_ckpt" / "errors.html")
