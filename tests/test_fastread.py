"""The restore reader: direct reads into huge-page memory, verified chunk by chunk, with
every fallback (page cache, no O_DIRECT, refused alignment) giving the same bytes."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, List

import numpy as np
import pytest
import torch

import slurm_ckpt.core.fastread as fr
from slurm_ckpt.core.hashing import hash_buffer
from slurm_ckpt.core.manifest import FileEntry
from slurm_ckpt.errors import VerifyError
from slurm_ckpt.job import Checkpointer

CHUNK = 1 << 20
# around the alignment and chunk boundaries, and more than one chunk
SIZES = [0, 1, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 12345]


def write(path: Path, size: int, seed: int = 0) -> FileEntry:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    h, chunks = hash_buffer(data, CHUNK)
    return FileEntry(path.name, size, h, chunks)


def read(path: Path, entry: FileEntry, **kw: Any) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        (mm,) = fr.read_files([fr.ReadJob(path.name, entry, fd)], CHUNK, **kw)
    finally:
        os.close(fd)
    return bytes(memoryview(mm)[: entry.size])


def evict(path: Path) -> None:
    """Drop this file's pages from the page cache (so the next read is a device read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached(path: Path) -> Any:
    fd = os.open(path, os.O_RDONLY)
    try:
        return fr._CACHESTAT.cached(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)


@pytest.fixture
def ext4(mounts: Any) -> Path:
    return mounts.loopfs(64, "ext4")


@pytest.mark.parametrize("size", SIZES)
def test_every_path_reads_the_same_bytes(ext4: Path, size: int, monkeypatch: Any) -> None:
    path = ext4 / "blob"
    entry = write(path, size, seed=size)
    want = path.read_bytes()
    evict(path)
    assert read(path, entry, streams=4) == want  # direct reads (cache evicted)
    assert read(path, entry, streams=1) == want
    path.read_bytes()
    assert read(path, entry) == want  # from the page cache
    monkeypatch.setattr(fr, "_O_DIRECT", 0)
    evict(path)
    assert read(path, entry) == want  # buffered only


def test_a_cold_read_bypasses_the_page_cache(ext4: Path) -> None:
    path = ext4 / "blob"
    entry = write(path, 3 * CHUNK + 5)
    evict(path)
    assert cached(path) is False
    read(path, entry)
    # O_DIRECT: the bytes went to our memory, not through the cache
    assert cached(path) is False


def test_a_cached_chunk_is_copied_not_read_again(ext4: Path, monkeypatch: Any) -> None:
    path = ext4 / "blob"
    entry = write(path, 2 * CHUNK)
    path.read_bytes()
    assert cached(path) is True
    direct: List[int] = []
    real = fr._read_direct
    monkeypatch.setattr(
        fr,
        "_read_direct",
        lambda *a: direct.append(a[4]) or real(*a),  # type: ignore[func-returns-value]
    )
    read(path, entry)
    assert direct == []
    evict(path)
    read(path, entry)
    assert sorted(direct) == [0, CHUNK]


def test_without_cachestat_cold_chunks_still_go_direct(ext4: Path, monkeypatch: Any) -> None:
    path = ext4 / "blob"
    entry = write(path, CHUNK + 7)
    monkeypatch.setattr(fr._CACHESTAT, "fn", None)
    evict(path)
    assert read(path, entry) == path.read_bytes()


def test_a_refused_direct_read_falls_back_to_buffered(ext4: Path, monkeypatch: Any) -> None:
    path = ext4 / "blob"
    entry = write(path, 2 * CHUNK + 1)
    calls = []

    def refuse(*a: Any) -> int:
        calls.append(a)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fr, "_read_direct", refuse)
    evict(path)
    fds = sorted(os.listdir("/proc/self/fd"))
    assert read(path, entry, streams=1) == path.read_bytes()
    assert len(calls) == 1  # refused once, then buffered for the rest of the file
    assert sorted(os.listdir("/proc/self/fd")) == fds  # the direct descriptor is closed


def test_tmpfs_reads_without_direct_io(mounts: Any) -> None:
    path = mounts.tmpfs("16m") / "blob"
    entry = write(path, 2 * CHUNK + 3)
    assert read(path, entry) == path.read_bytes()


@pytest.mark.parametrize("where", [0, CHUNK + 3, 3 * CHUNK + 12344])
def test_a_flipped_byte_anywhere_is_caught(ext4: Path, where: int) -> None:
    path = ext4 / "blob"
    entry = write(path, 3 * CHUNK + 12345)
    data = bytearray(path.read_bytes())
    data[where] ^= 0x40
    path.write_bytes(bytes(data))
    evict(path)
    with pytest.raises(VerifyError, match="content hash mismatch"):
        read(path, entry)


def test_wrong_size_and_inconsistent_manifest(ext4: Path) -> None:
    path = ext4 / "blob"
    entry = write(path, CHUNK + 1)
    os.truncate(path, CHUNK)
    with pytest.raises(VerifyError, match="size"):
        read(path, entry)
    entry = write(path, CHUNK + 1)
    bad = FileEntry(entry.path, entry.size, "0" * 32, entry.chunks)
    with pytest.raises(VerifyError, match="manifest hash inconsistent"):
        read(path, bad)


def test_cancel_stops_between_chunks(ext4: Path) -> None:
    path = ext4 / "blob"
    entry = write(path, 4 * CHUNK)
    with pytest.raises(InterruptedError):
        read(path, entry, cancelled=lambda: True)


def test_memory_is_huge_page_advised_and_has_room_to_round_up() -> None:
    mm = fr.alloc(5 * 2**20 + 1)
    assert len(mm) % (2 * 2**20) == 0 and len(mm) >= 5 * 2**20 + 1 + fr.DIO_ALIGN
    small = fr.alloc(0)
    assert len(small) >= fr.DIO_ALIGN


# -------------------------------------------------------------- restored objects as views


def test_restored_tensors_are_independent_views(tmp_path: Path) -> None:
    """Leaves are views of the blob memory: each keeps it alive, torch.save of one writes
    only its own bytes, and all of them are writable (an optimizer updates in place)."""
    state = {
        "model": {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5)},
        "optimizer": {"n": np.arange(7, dtype=np.int16), "s": np.float64(2.5), "raw": b"xy"},
    }
    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    ckpt = Checkpointer(local=tmp_path / "l", warm=tmp_path / "p", key="k", install_signals=False)
    ckpt.save(state, step=1)
    ckpt.close()
    again = Checkpointer(local=tmp_path / "l", warm=tmp_path / "p", key="k", install_signals=False)
    got = again.restore()
    again.close()
    a = got.state["model"]["a"]
    b = got.state["model"]["b"]
    n = got.state["optimizer"]["n"]
    assert got.state["optimizer"]["s"] == 2.5 and got.state["optimizer"]["raw"] == b"xy"
    del got
    assert torch.equal(a, state["model"]["a"]) and torch.equal(b, state["model"]["b"])
    assert a.untyped_storage().nbytes() == 4000
    out = tmp_path / "a.pt"
    torch.save(a, out)
    assert out.stat().st_size < 4000 + 2000
    a.add_(1)
    b.mul_(2)
    n += 1
    assert a[0] == 1 and b.sum() == 30 and n.tolist() == list(range(1, 8))
