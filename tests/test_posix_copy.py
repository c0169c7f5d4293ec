"""The POSIX tier's file copy (slurm_ckpt/tiers/posix_copy.py), on this machine's real
filesystem: a file placed by clone or copy holds exactly the source's bytes, across many
pieces and for an empty file, and the answer "cloned" matches what FICLONE did."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_ckpt.tiers.posix_copy import clone_or_copy, copy_fd, reflink


def _pair(tmp_path: Path, data: bytes) -> tuple:
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    return src, dst


@pytest.mark.parametrize("size", [0, 1, 4096 * 3 + 17])
def test_copy_fd_copies_every_piece(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    src, dst = _pair(tmp_path, data)
    try:
        copy_fd(src, dst, piece=4096)  # many pieces: the loop's offsets are exercised
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes() == data


def test_clone_or_copy_says_whether_it_cloned(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    src, dst = _pair(tmp_path, data)
    probe = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        can_clone = reflink(src, probe)  # what this filesystem does (tmpfs: no, btrfs: yes)
        assert clone_or_copy(src, dst, piece=8192) is can_clone
    finally:
        for fd in (src, dst, probe):
            os.close(fd)
    assert (tmp_path / "dst").read_bytes() == data
