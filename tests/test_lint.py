"""The lint CI runs: ``ruff check`` over the repository and vulture's unused-code check
over the product. Both are real runs of the tools (from the ``dev`` extra), not mocks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: What vulture reads: the product, plus everything that uses it (so a function used only
#: by the benchmarks or the tests is used). Findings count only in PRODUCT.
VULTURE_PATHS = ["slurm_ckpt", "benchmarks", "examples", "scripts", "tests"]
PRODUCT = ("slurm_ckpt/", "benchmarks/", "examples/")
WHITELIST = "tests/vulture_whitelist.py"


def _tool(module: str) -> None:
    probe = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True)
    if probe.returncode != 0:
        pytest.fail(f"{module} is not installed: pip install -e '.[dev]' (the dev extra)")


def test_ruff_check_is_clean() -> None:
    _tool("ruff")
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_unused_code_in_the_product() -> None:
    """vulture at 60 % confidence; its false positives live in the whitelist, each with
    the reason it is used. A finding here is dead code: delete it."""
    _tool("vulture")
    r = subprocess.run(
        [sys.executable, "-m", "vulture", *VULTURE_PATHS, WHITELIST, "--min-confidence", "60"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode in (0, 3), r.stderr  # 3: vulture found something
    dead = [line for line in r.stdout.splitlines() if line.startswith(PRODUCT)]
    assert dead == [], "unused code (delete it, or whitelist a false positive):\n" + "\n".join(dead)
