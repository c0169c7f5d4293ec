"""PEP 517 build backend: setuptools, run on a private copy of the source tree.

setuptools writes ``build/`` and ``slurm_ckpt.egg-info/`` into the directory it builds
from, so ``pip install /path/to/checkout`` fails on a read-only checkout (a shared
software tree, a read-only bind mount in a container, a checkout owned by another user).
Every hook here copies the files a build needs into a temporary directory, runs the
matching :mod:`setuptools.build_meta` hook there and hands back only what pip asked for
(a wheel, an sdist, a metadata directory) in pip's own output directory. The checkout is
never written. ``build_editable`` is passed through unchanged: an editable install points
at the checkout and has to write there anyway.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, Dict, Iterator, List, Optional

from setuptools import build_meta as _st

#: Names never copied: VCS data, build outputs, caches, local virtual environments.
_SKIP = {
    ".git",
    "build",
    "dist",
    "__pycache__",
    ".venv",
    ".pytest_cache",
    ".ruff_cache",
    ".whl",
    ".gl",
}

Settings = Optional[Dict[str, Any]]


def _ignore(_dir: str, names: List[str]) -> List[str]:
    return [n for n in names if n in _SKIP or n.endswith((".egg-info", ".pyc"))]


@contextlib.contextmanager
def _private_copy() -> Iterator[str]:
    """Copy the source tree (the current directory, as PEP 517 defines it) to a temporary
    directory and work there; remove it afterwards."""
    src = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="slurm-ckpt-build-") as tmp:
        dst = os.path.join(tmp, "src")
        shutil.copytree(src, dst, ignore=_ignore, symlinks=True)
        os.chdir(dst)
        try:
            yield dst
        finally:
            os.chdir(src)


def get_requires_for_build_wheel(config_settings: Settings = None) -> List[str]:
    with _private_copy():
        return _st.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_sdist(config_settings: Settings = None) -> List[str]:
    with _private_copy():
        return _st.get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: Settings = None
) -> str:
    out = os.path.abspath(metadata_directory)
    with _private_copy():
        return _st.prepare_metadata_for_build_wheel(out, config_settings)


def build_wheel(
    wheel_directory: str,
    config_settings: Settings = None,
    metadata_directory: Optional[str] = None,
) -> str:
    out = os.path.abspath(wheel_directory)
    meta = None if metadata_directory is None else os.path.abspath(metadata_directory)
    with _private_copy():
        return _st.build_wheel(out, config_settings, meta)


def build_sdist(sdist_directory: str, config_settings: Settings = None) -> str:
    out = os.path.abspath(sdist_directory)
    with _private_copy():
        return _st.build_sdist(out, config_settings)


# Editable installs point at the checkout itself; they go to setuptools unchanged.
get_requires_for_build_editable = _st.get_requires_for_build_editable
prepare_metadata_for_build_editable = _st.prepare_metadata_for_build_editable
build_editable = _st.build_editable
