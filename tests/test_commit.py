"""The checkpoint format and its atomic, verified commit on real filesystems."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurm_ckpt.core.commit import AlreadyCommitted
from slurm_ckpt.core.hashing import hash_buffer
from slurm_ckpt.core.manifest import FORMAT_VERSION, Manifest
from slurm_ckpt.core.names import validate_key, validate_relpath
from slurm_ckpt.errors import InvalidName, NotFound, VerifyError
from slurm_ckpt.tiers.posix import PosixTier


def save(tier: PosixTier, step: int, files: dict, key: str = "run", **kw) -> Manifest:
    with tier.writer("alice", key, step, **kw) as w:
        w.write_buffers(files)
        return w.commit()


def test_manifest_records_identity_sizes_and_hashes(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path))
    data = {"model.bin": os.urandom(5000), "opt/adam.bin": os.urandom(70_000)}
    m = save(tier, 7, data, tokens=123, job="42", node="n1", meta={"lr": 0.1})
    doc = json.loads((tmp_path / "alice/run/step-0000000007/manifest.json").read_text())
    assert doc["format_version"] == FORMAT_VERSION
    assert (doc["step"], doc["tokens"], doc["job"], doc["node"]) == (7, 123, "42", "n1")
    assert (doc["user"], doc["key"]) == ("alice", "run")
    assert doc["wall_time"] > 0
    files = {f["path"]: f for f in doc["files"]}
    assert set(files) == set(data)
    for path, blob in data.items():
        assert files[path]["size"] == len(blob)
        assert files[path]["hash"] == hash_buffer(blob, m.chunk_size)[0]
    assert m.total_bytes == 75_000


def test_small_chunks_and_streams_give_same_hash(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path), chunk_size=4096, streams=3)
    blob = os.urandom(3 * 4096 + 17)
    with tier.writer("alice", "run", 1) as w:
        w.write_buffers({"a": blob})
        with w.open_stream("b") as s:
            for i in range(0, len(blob), 1000):
                s.write(blob[i : i + 1000])
        m = w.commit()
    assert m.file("a").hash == m.file("b").hash
    assert len(m.file("a").chunks) == 4
    assert tier.verify("alice", "run", 1).ok


def test_reader_lists_only_committed(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path))
    save(tier, 1, {"a": b"1"})
    # A writer that never commits leaves nothing listable, and cleans up on exit.
    with pytest.raises(RuntimeError), tier.writer("alice", "run", 2) as w:
        w.write_buffers({"a": b"2"})
        raise RuntimeError("training crashed")
    # A step directory without manifest (crash between rename and manifest) is not listed.
    (tmp_path / "alice/run/step-0000000003").mkdir()
    (tmp_path / "alice/run/step-0000000003/a").write_bytes(b"3")
    assert [s.step for s in tier.steps("alice", "run")] == [1]
    assert sorted(os.listdir(tmp_path / "alice/run")) == ["step-0000000001", "step-0000000003"]
    # The next writer of step 3 clears that debris and commits.
    save(tier, 3, {"a": b"3!"})
    assert [s.step for s in tier.steps("alice", "run")] == [1, 3]


def test_committed_step_is_never_overwritten(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path))
    save(tier, 1, {"a": b"first"})
    with pytest.raises(AlreadyCommitted):
        save(tier, 1, {"a": b"second"})
    assert (tmp_path / "alice/run/step-0000000001/a").read_bytes() == b"first"
    assert tier.verify("alice", "run", 1).ok


def test_private_modes(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path))
    save(tier, 1, {"a": b"x"})
    step = tmp_path / "alice/run/step-0000000001"
    for p in (tmp_path / "alice", tmp_path / "alice/run", step):
        assert p.stat().st_mode & 0o777 == 0o700
    assert (step / "a").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "key", ["", "..", ".hidden", "-x", "a/b", "a\x00b", "a\nb", "run\n", "x" * 200, "caf\u00e9"]
)
def test_bad_keys_rejected(key: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidName) as exc:
        validate_key(key)
    assert "\n" not in str(exc.value)
    with pytest.raises(InvalidName):
        PosixTier("local", str(tmp_path)).writer("alice", key, 1)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "name",
    [
        "/etc/passwd",
        "../x",
        "a/../../x",
        "a//b",
        "./a",
        "a\x01",
        "a\\b",
        "",
        "manifest.json",
        ".tmp-x",
        "a/.partial-y",
    ],
)
def test_bad_file_names_rejected(name: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidName):
        validate_relpath(name)
    tier = PosixTier("local", str(tmp_path))
    with pytest.raises(InvalidName), tier.writer("alice", "run", 1) as w:
        w.write_buffers({name: b"x"})
    assert tier.steps("alice", "run") == []


def test_good_names_accepted() -> None:
    assert validate_key("llama-70b_run.3+x@site=1") == "llama-70b_run.3+x@site=1"
    assert validate_relpath("rank-0/model/layer.0.bin") == "rank-0/model/layer.0.bin"


@pytest.mark.parametrize("step", [-1, 10**10, 1.5, True])
def test_bad_steps_rejected(step: object, tmp_path: Path) -> None:
    with pytest.raises(InvalidName):
        PosixTier("local", str(tmp_path)).writer("alice", "run", step)  # type: ignore[arg-type]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x20]))


@pytest.mark.parametrize("kind", ["tmpfs", "ext4", "xfs"])
def test_every_single_byte_corruption_is_detected_on_every_tier(kind: str, mounts) -> None:
    root = (
        mounts.tmpfs("8m") if kind == "tmpfs" else mounts.loopfs(300 if kind == "xfs" else 16, kind)
    )
    tier = PosixTier(kind, str(root), chunk_size=64)
    save(tier, 1, {"prev": b"p" * 10})
    save(tier, 2, {"w.bin": os.urandom(150), "sub/o.bin": os.urandom(70), "e": b""})
    step_dir = root / "alice/run/step-0000000002"
    targets = [step_dir / "w.bin", step_dir / "sub/o.bin", step_dir / "manifest.json"]
    checked = 0
    for path in targets:
        size = path.stat().st_size
        for off in range(size):
            _flip(path, off)
            rep = tier.verify("alice", "run", 2)
            assert not rep.ok, f"flip of byte {off} of {path.name} went unnoticed"
            # The listing never offers a step whose manifest is damaged, and restore-style
            # selection falls back to the previous step whenever step 2 is damaged.
            best, _ = tier.latest_verified("alice", "run")
            assert best is not None and best.step == 1
            _flip(path, off)
            checked += 1
        assert tier.verify("alice", "run", 2).ok
    assert checked > 500


def test_truncation_extension_deletion_and_symlinks_detected(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path))
    save(tier, 1, {"a": os.urandom(1000), "b": os.urandom(10)})
    d = tmp_path / "alice/run/step-0000000001"
    orig = (d / "a").read_bytes()
    os.truncate(d / "a", 999)
    assert "size 999 != 1000" in tier.verify("alice", "run", 1).summary()
    (d / "a").write_bytes(orig + b"x")
    assert not tier.verify("alice", "run", 1).ok
    (d / "a").write_bytes(orig)
    assert tier.verify("alice", "run", 1).ok
    (d / "b").unlink()
    assert "b:" in tier.verify("alice", "run", 1).summary()
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789")
    os.symlink(secret, d / "b")
    rep = tier.verify("alice", "run", 1)
    assert not rep.ok and "symbolic link" in rep.summary()


def test_manifest_for_other_checkpoint_is_rejected(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path))
    save(tier, 1, {"a": b"x"})
    save(tier, 2, {"a": b"x"})
    d = tmp_path / "alice/run"
    (d / "step-0000000002/manifest.json").write_bytes(
        (d / "step-0000000001/manifest.json").read_bytes()
    )
    assert [s.step for s in tier.steps("alice", "run")] == [1]
    with pytest.raises(VerifyError):
        tier.manifest("alice", "run", 2)
    with pytest.raises(NotFound):
        tier.manifest("alice", "run", 9)


def test_delete_and_sweep(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path))
    save(tier, 1, {"a": b"x"})
    d = tmp_path / "alice/run"
    (d / ".tmp-step-0000000002-999999999-abcd").mkdir()  # writer pid that cannot exist
    (d / ".trash-old").mkdir()
    (d / ".partial-step-0000000005").mkdir()
    removed = tier.sweep("alice", "run")
    assert sorted(removed) == [".tmp-step-0000000002-999999999-abcd", ".trash-old"]
    assert (d / ".partial-step-0000000005").exists()
    tier.delete("alice", "run", 1)
    assert tier.steps("alice", "run") == []
    assert not any(n.startswith("step-") for n in os.listdir(d))


@pytest.mark.parametrize("buffer_size", [4096, 5000])
def test_ranges_longer_than_the_io_buffer(tmp_path: Path, buffer_size: int) -> None:
    """Chunks span many I/O buffers (and not a whole number of them): verify and copy
    must loop over pieces correctly."""
    from slurm_ckpt.tiers.copy import copy_checkpoint

    a = PosixTier("local", str(tmp_path / "a"), chunk_size=3 * 4096 + 7, buffer_size=buffer_size)
    b = PosixTier("pfs", str(tmp_path / "b"), buffer_size=buffer_size)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    blob = os.urandom(10 * 4096 + 123)
    save(a, 1, {"big.bin": blob})
    assert a.verify("alice", "run", 1).ok
    copy_checkpoint(a, b, "alice", "run", 1)
    assert b.verify("alice", "run", 1).ok
    assert (tmp_path / "b/alice/run/step-0000000001/big.bin").read_bytes() == blob
