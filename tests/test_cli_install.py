"""Installing without PyPI: ``pip install`` from a checkout that cannot be written.

A shared software tree, a checkout owned by another user or a read-only bind mount into a
container: setuptools writes ``build/`` and ``slurm_ckpt.egg-info/`` into the tree and
fails there (pypa/setuptools#3237). The build backend is hatchling, which writes nothing
into the tree. The test installs a read-only bind mount of this checkout into a fresh virtual
environment (no network: ``--no-deps --no-build-isolation``, the dependencies come from the
project's venv through a ``.pth`` file) and runs the installed ``ckpt-slurm``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import need_root
from helpers.cli import REPO


def _files(tree: Path) -> list:
    """Every file of the checkout that git knows (tracked, or new and not ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    return [p for p in out.decode().split("\0") if p and (tree / p).is_file()]


def test_pip_install_from_read_only_checkout(mounts, tmp_path: Path) -> None:
    need_root()
    src = tmp_path / "src"
    for rel in _files(REPO):
        dst = src / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes((REPO / rel).read_bytes())
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(ro)], check=True)
    mounts.mounted.append(ro)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
    probe = subprocess.run(["touch", str(ro / "probe")], capture_output=True, text=True)
    assert probe.returncode != 0 and "Read-only" in probe.stderr  # root cannot write it
    before = sorted(p.relative_to(src) for p in src.rglob("*"))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "project-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_USER")}
    r = subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "--no-index",
            str(ro),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before  # nothing written
    installed = Path(purelib, "slurm_ckpt")
    assert (installed / "cli" / "main.py").is_file()
    assert (installed / "py.typed").is_file()  # typed package (PEP 561)
    v = subprocess.run(
        [str(venv / "bin" / "ckpt-slurm"), "--version"], capture_output=True, text=True, env=env
    )
    assert (v.returncode, v.stdout.strip()) == (0, "ckpt-slurm 0.1.0"), v.stderr
    where = subprocess.run(
        [str(py), "-c", "import slurm_ckpt; print(slurm_ckpt.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    ).stdout.strip()
    assert where == str(installed / "__init__.py")
