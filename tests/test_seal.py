"""``ckpt-slurm seal DIR`` and ``verify DIR`` on checkpoints other tools wrote (issue 34,
item 2): stock DCP ``FileSystemWriter`` output, a plain HF Trainer's ``checkpoint-N``, a
Lightning ``dirpath`` and an Orbax-style step directory are sealed, one byte is flipped,
and ``verify`` names the file and the chunk's byte range; a directory still being
written (a DCP save held mid-shard, a file open for writing, a tool's own signs) is
refused; bad input gets one line.

Real torch and transformers (CPU, tiny models built here, no hub download) run in
tests/seal_worker.py; ``ckpt-slurm`` runs in a fresh interpreter, as from a shell.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, List

import pytest
from helpers.cli import ckpt_slurm

from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.ops.seal import (
    SealRefused,
    detect_format,
    seal_dir,
    step_from_name,
    unfinished,
)

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "seal_worker.py"
CHUNK = 64 * 2**10  # --chunk-size 64KiB: a flipped byte is placed within 64 KiB


def worker(*args: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run(
        [sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def bad_range(size: int, offset: int, chunk: int = CHUNK) -> str:
    start = offset // chunk * chunk
    return f"bytes {start}-{min(start + chunk, size)}"


def problem_lines(stdout: str) -> List[str]:
    return [line for line in stdout.splitlines() if line.startswith("CORRUPT: ")]


def test_dcp_sealed_then_a_flipped_byte_is_named(tmp_path: Path) -> None:
    d = tmp_path / "dcp" / "step-3"
    worker("dcp", str(d))
    names = sorted(os.listdir(d))
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names), names

    r = ckpt_slurm("seal", str(d), "--key", "my-run", "--chunk-size", "64KiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"sealed {d} (dcp): {len(names)} files"), r.stdout
    m = Manifest.from_bytes((d / "manifest.json").read_bytes())
    assert (m.key, m.step, m.meta["sealed"], m.chunk_size) == ("my-run", 3, "dcp", CHUNK)
    assert sorted(f.path for f in m.files) == names
    assert m.user == pwd.getpwuid(os.getuid()).pw_name

    ok = ckpt_slurm("verify", str(d))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "moved" not in ok.stdout  # sealed in place: where its tool put it
    worker("dcp-load", str(d))  # our manifest.json does not disturb DCP's reader

    shard = max((d / n for n in names if n.endswith(".distcp")), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    assert size > 2 * CHUNK
    offset = size // 2 + 17
    flip(shard, offset)
    bad = ckpt_slurm("verify", str(d))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert problem_lines(bad.stdout) == [
        f"CORRUPT: {shard.name}: content hash mismatch ({bad_range(size, offset)})"
    ], bad.stdout


def test_hf_checkpoint_sealed_then_a_flipped_byte_is_named(tmp_path: Path) -> None:
    out = tmp_path / "out"
    worker("hf", str(out))
    d = out / "checkpoint-2"
    assert (d / "trainer_state.json").is_file() and (d / "model.safetensors").is_file()

    r = ckpt_slurm("seal", str(d), "--chunk-size", "64KiB", "--json")
    assert r.returncode == 0, r.stderr
    assert '"format": "hf"' in r.stdout and '"step": 2' in r.stdout, r.stdout
    assert ckpt_slurm("verify", str(d)).returncode == 0

    weights = d / "model.safetensors"
    size = weights.stat().st_size
    offset = size - 5  # the last chunk: its range ends at the file's size
    flip(weights, offset)
    bad = ckpt_slurm("verify", str(d))
    assert bad.returncode == 1
    assert problem_lines(bad.stdout) == [
        f"CORRUPT: model.safetensors: content hash mismatch ({bad_range(size, offset)})"
    ], bad.stdout

    # Sealing again is refused: the manifest is never replaced.
    again = ckpt_slurm("seal", str(d))
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr.splitlines() == [
        f"ckpt-slurm: error: {d}: already sealed (manifest.json is there): "
        f"check it with ckpt-slurm verify {d}"
    ]


def test_lightning_dirpath_sealed_a_ckpt_file_points_there(tmp_path: Path) -> None:
    """Lightning writes single ``.ckpt`` files: the directory that holds them (the
    ModelCheckpoint's ``dirpath``) is what is sealed."""
    d = tmp_path / "checkpoints"
    worker("lightning", str(d))
    ckpts = sorted(p.name for p in d.iterdir())
    assert len(ckpts) == 2 and all(n.endswith(".ckpt") for n in ckpts), ckpts
    one_error(
        ckpt_slurm("seal", str(d / ckpts[-1])),
        f"{d / ckpts[-1]}: is a file: seal the directory that holds it",
        f"ckpt-slurm seal {d}",
    )
    r = ckpt_slurm("seal", str(d), "--step", "4", "--chunk-size", "64KiB")
    assert r.returncode == 0 and r.stdout.startswith(f"sealed {d} (lightning): 2 files"), r
    assert ckpt_slurm("verify", str(d)).returncode == 0
    last = d / ckpts[-1]
    size = last.stat().st_size
    flip(last, 100)
    # Lightning goes on writing into its dirpath: a new file is named too.
    (d / "epoch=9-step=99.ckpt").write_bytes(b"later")
    bad = ckpt_slurm("verify", str(d))
    assert bad.returncode == 1
    assert problem_lines(bad.stdout) == [
        f"CORRUPT: {last.name}: content hash mismatch ({bad_range(size, 100)})",
        "CORRUPT: epoch=9-step=99.ckpt: not in the manifest",
    ], bad.stdout


def orbax_step(d: Path) -> Path:
    """An Orbax step directory as orbax-checkpoint's CheckpointManager leaves it once the
    save is done (renamed from ``1000.orbax-checkpoint-tmp-*``): the step's metadata, one
    item (``default``) in the OCDBT layout (tensorstore's manifest and data files below
    per-process directories, an item-level ``d/`` left empty), and a legacy zarr array
    (dot-files such as ``.zarray``). Orbax (JAX) is not installed here: the layout is
    built by hand."""
    item = d / "default"
    for sub in ("ocdbt.process_0/d", "array_metadatas", "d", "params.dense.kernel"):
        (item / sub).mkdir(parents=True, exist_ok=True)
    (d / "_CHECKPOINT_METADATA").write_text('{"item_handlers": {"default": "PyTree"}}')
    (item / "_METADATA").write_text('{"tree_metadata": {}}')
    (item / "_sharding").write_text("{}")
    (item / "manifest.ocdbt").write_bytes(os.urandom(120))
    (item / "ocdbt.process_0" / "manifest.ocdbt").write_bytes(os.urandom(200))
    (item / "ocdbt.process_0" / "d" / ("7f" * 16)).write_bytes(os.urandom(5 * CHUNK + 77))
    (item / "array_metadatas" / "process_0").write_text("[]")
    (item / "params.dense.kernel" / ".zarray").write_text('{"zarr_format": 2}')
    (item / "params.dense.kernel" / "0.0").write_bytes(os.urandom(3000))
    return item / "ocdbt.process_0" / "d" / ("7f" * 16)


def test_orbax_step_sealed_then_a_flipped_byte_is_named(tmp_path: Path) -> None:
    d = tmp_path / "orbax" / "1000"
    data = orbax_step(d)
    files = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    r = ckpt_slurm("seal", str(d), "--chunk-size", "64KiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"sealed {d} (orbax): {len(files)} files"), r.stdout
    m = Manifest.from_bytes((d / "manifest.json").read_bytes())
    assert (m.step, m.meta["sealed"]) == (1000, "orbax")
    assert sorted(f.path for f in m.files) == files  # nested files and dot-files too
    ok = ckpt_slurm("verify", str(d))  # the empty default/d/ holds no bytes: not a finding
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (d / "default" / "d" / "later").write_bytes(b"x")  # a file dropped in since: named
    later = ckpt_slurm("verify", str(d))
    assert later.returncode == 1 and "default/d/: not in the manifest" in later.stdout, later
    (d / "default" / "d" / "later").unlink()

    size = data.stat().st_size
    offset = 2 * CHUNK + 3
    flip(data, offset)
    bad = ckpt_slurm("verify", str(d))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    rel = data.relative_to(d)
    assert problem_lines(bad.stdout) == [
        f"CORRUPT: {rel}: content hash mismatch ({bad_range(size, offset)})"
    ], bad.stdout


def one_error(r: subprocess.CompletedProcess, *fragments: str) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("ckpt-slurm: error: "), line
    for f in fragments:
        assert f in line, line
    return line


def complete_dir(d: Path) -> None:
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(os.urandom(100_000))
    (d / "config.json").write_text("{}")


def test_a_file_open_for_writing_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "run" / "step-7"
    complete_dir(d)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, str(WORKER), "append", str(d / "log.bin")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        r = ckpt_slurm("seal", str(d))
        one_error(r, f"{d}: still being written: log.bin is open for writing by process {p.pid}")
        assert not (d / "manifest.json").exists()
    finally:
        p.communicate("", timeout=60)
    assert p.returncode == 0
    # The writer is done: the same directory seals and verifies.
    assert ckpt_slurm("seal", str(d)).returncode == 0
    assert ckpt_slurm("verify", str(d)).returncode == 0


def test_a_dcp_save_in_progress_is_refused(tmp_path: Path) -> None:
    """A stock DCP ``FileSystemWriter`` held in the middle of its shard (seal_worker.py
    ``dcp-paused``): the seal is refused and writes nothing; once the save is done the
    same directory seals, verifies, and DCP loads it."""
    d = tmp_path / "dcp" / "step-4"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, str(WORKER), "dcp-paused", str(d)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "writing\n"
        assert any(n.endswith(".distcp") for n in os.listdir(d)), os.listdir(d)
        one_error(
            ckpt_slurm("seal", str(d)),
            f"{d}: still being written: DCP shards without .metadata (DCP writes .metadata last)",
        )
        assert not (d / "manifest.json").exists()
    finally:
        p.communicate("go\n", timeout=300)
    assert p.returncode == 0
    assert ".metadata" in os.listdir(d)
    assert ckpt_slurm("seal", str(d)).returncode == 0
    assert ckpt_slurm("verify", str(d)).returncode == 0


def test_a_reader_is_no_writer(tmp_path: Path) -> None:
    """A process that has a file open for reading only (a data loader, a verify in
    another shell) does not stop the seal; the same file open for writing does."""
    d = tmp_path / "step-2"
    complete_dir(d)
    with open(d / "weights.bin", "rb") as rd, open(d / "config.json", "ab") as wr:
        reader = subprocess.Popen(["sleep", "600"], stdin=rd)
        writer = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=wr)
    try:
        one_error(
            ckpt_slurm("seal", str(d)),
            f"config.json is open for writing by process {writer.pid}",
        )
        writer.kill()
        writer.wait()
        assert ckpt_slurm("seal", str(d)).returncode == 0  # the reader is still there
        assert reader.poll() is None
    finally:
        for p in (reader, writer):
            p.kill()
            p.wait()


def test_many_files_are_hashed_in_batches(tmp_path: Path, monkeypatch: Any) -> None:
    """More files than are kept open at once (BATCH_FILES): all sealed, all verify."""
    import slurm_ckpt.ops.seal as seal_mod
    from slurm_ckpt.ops.verify_path import verify_path

    monkeypatch.setattr(seal_mod, "BATCH_FILES", 2)
    d = tmp_path / "many"
    (d / "sub").mkdir(parents=True)
    for i in range(5):
        (d / "sub" / f"f{i}.bin").write_bytes(os.urandom(1000 + i))
    done = seal_dir(str(d), key="k", step=7)
    assert len(done.manifest.files) == 5 and done.manifest.step == 7
    res = verify_path(str(d))
    assert res.report.ok and not res.moved, res.report.problems


def test_formats_and_steps_from_names() -> None:
    assert detect_format("step-3", {".metadata", "__0_0.distcp"}) == "dcp"
    assert detect_format("step-3", {"__0.metadata", "__0_0.distcp"}) == "dcp"
    assert unfinished("step-3", "dcp", {"__0.metadata", "__0_0.distcp"}) is None
    assert unfinished("step-3", "dcp", {".metadata", "__0_0.distcp", "__1_0.distcp"}) is None
    assert detect_format("checkpoint-500", {"model.safetensors", "trainer_state.json"}) == "hf"
    assert detect_format("1000", {"_CHECKPOINT_METADATA", "default"}) == "orbax"
    assert detect_format("checkpoints", {"epoch=0-step=2.ckpt", "last.ckpt"}) == "lightning"
    assert detect_format("export", {"model.pt"}) == "dir"
    assert [step_from_name(n) for n in ("checkpoint-500", "step_0042", "1000", "final")] == [
        500,
        42,
        1000,
        0,
    ]


def test_a_file_changing_while_hashed_is_refused(tmp_path: Path) -> None:
    """A writer that opens, writes and closes between our two listings (no descriptor
    for the /proc scan to see): the second listing, or the file's own fstat, tells."""
    d = tmp_path / "step-1"
    complete_dir(d)
    (d / "big.bin").write_bytes(os.urandom(3 * CHUNK))
    grown: List[int] = []

    def write_more(_n: int) -> None:
        if not grown:  # the first hashed chunk: hashing has begun
            with open(d / "big.bin", "ab") as fh:
                fh.write(b"more")
            grown.append(1)

    with pytest.raises(SealRefused, match=r"still being written: big.bin changed while"):
        seal_dir(str(d), chunk_size=CHUNK, streams=1, progress=write_more)
    assert grown and not (d / "manifest.json").exists()


@pytest.mark.parametrize(
    ("make", "why"),
    [
        ("dcp-no-metadata", "DCP shards without .metadata (DCP writes .metadata last)"),
        ("dcp-metadata-tmp", "DCP is writing its metadata (.metadata.tmp is there)"),
        ("dcp-rank-metadata", "DCP shards of rank 1 without its __1.metadata (written last)"),
        ("hf-no-state", "no trainer_state.json (the HF Trainer writes it last)"),
        ("orbax-tmp", "an Orbax temporary directory"),
        ("orbax-root", "an Orbax temporary directory inside it (2000.orbax-checkpoint-tmp-9)"),
    ],
)
def test_a_format_still_saving_is_refused(tmp_path: Path, make: str, why: str) -> None:
    if make.startswith("dcp"):
        d = tmp_path / "step-5"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"shard")
        if make == "dcp-metadata-tmp":
            (d / ".metadata.tmp").write_bytes(b"half")
        if make == "dcp-rank-metadata":  # no collectives: each rank writes __R.metadata
            (d / "__0.metadata").write_bytes(b"rank 0 done")
            (d / "__1_0.distcp").write_bytes(b"rank 1 still writing")
    elif make == "hf-no-state":
        d = tmp_path / "checkpoint-500"
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"weights")
    elif make == "orbax-tmp":
        d = tmp_path / "1000.orbax-checkpoint-tmp-1712"
        d.mkdir()
        (d / "_CHECKPOINT_METADATA").write_text("{}")
    else:  # an Orbax root: step 1000 done, step 2000 being written
        d = tmp_path / "orbax"
        for step in ("1000", "2000.orbax-checkpoint-tmp-9"):
            (d / step).mkdir(parents=True)
            (d / step / "_CHECKPOINT_METADATA").write_text("{}")
    one_error(ckpt_slurm("seal", str(d)), f"{d}: still being written: {why}")
    assert not (d / "manifest.json").exists()


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory other users can reach (pytest's tmp_path is root's, mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="seal-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_bad_input_one_line(tmp_path: Path, open_tmp: Path, run_as: Callable[..., Any]) -> None:
    one_error(ckpt_slurm("seal", str(tmp_path / "nope")), "no such file or directory")
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    one_error(ckpt_slurm("seal", str(f)), f"{f}: not a directory")
    ckpt = tmp_path / "epoch=1-step=20.ckpt"
    ckpt.write_bytes(b"x")
    one_error(ckpt_slurm("seal", str(ckpt)), "seal the directory that holds it", str(tmp_path))
    (tmp_path / "link").symlink_to(tmp_path)
    one_error(ckpt_slurm("seal", str(tmp_path / "link")), "symlinks are never followed")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_error(ckpt_slurm("seal", str(empty)), "no files to seal")
    fifo = tmp_path / "with-fifo"
    complete_dir(fifo)
    os.mkfifo(fifo / "pipe")
    one_error(ckpt_slurm("seal", str(fifo)), "pipe: not a regular file")
    linked = tmp_path / "linked"
    complete_dir(linked)
    os.link(linked / "weights.bin", tmp_path / "elsewhere.bin")
    one_error(ckpt_slurm("seal", str(linked)), "weights.bin has 2 hard links")
    r = ckpt_slurm("seal", str(fifo), "--key", "../x")
    assert r.returncode == 2 and "invalid key" in r.stderr and len(r.stderr.splitlines()) == 1

    # No permission: a directory of root's, sealed by another user.
    private = open_tmp / "private"
    complete_dir(private)
    os.chmod(private, 0o700)
    r = run_as([sys.executable, "-m", "slurm_ckpt.cli.main", "seal", str(private)], "ckptuser1")
    one_error(r, f"{private}: permission denied (run as its owner or root)")
    assert not (private / "manifest.json").exists()
    # Writable by everyone, but root's: a manifest of ckptuser1 there would not verify.
    shared = open_tmp / "shared"
    complete_dir(shared)
    os.chmod(shared, 0o777)
    r = run_as([sys.executable, "-m", "slurm_ckpt.cli.main", "seal", str(shared)], "ckptuser1")
    one_error(r, f"{shared}: owned by uid 0: seal it as its owner or root")
    # A crashed seal's temporary manifest: named, with what to do.
    crashed = tmp_path / "crashed"
    complete_dir(crashed)
    (crashed / ".manifest.json.tmp-123-abcd").write_text("half")
    one_error(ckpt_slurm("seal", str(crashed)), "a seal that was interrupted: remove it")
    # Another tool's manifest.json is never replaced.
    foreign = tmp_path / "foreign"
    complete_dir(foreign)
    (foreign / "manifest.json").write_text('{"files": []}')
    one_error(ckpt_slurm("seal", str(foreign)), "holds a manifest.json that is not slurm_ckpt's")
    assert (foreign / "manifest.json").read_text() == '{"files": []}'


def test_root_seals_a_users_directory_as_that_user(open_tmp: Path) -> None:
    """The manifest is the owner's, like the files it describes (verify reads only
    manifests owned by the directory's owner)."""
    pw = pwd.getpwnam("ckptuser1")
    d = open_tmp / "checkpoint-40"
    complete_dir(d)
    (d / "trainer_state.json").write_text("{}")
    for p in (d, *d.iterdir()):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    r = ckpt_slurm("seal", str(d))
    assert r.returncode == 0, r.stderr
    st = (d / "manifest.json").stat()
    assert (st.st_uid, st.st_mode & 0o777) == (pw.pw_uid, 0o644)
    m = Manifest.from_bytes((d / "manifest.json").read_bytes())
    assert (m.user, m.step, m.meta["sealed"]) == ("ckptuser1", 40, "hf")
    assert ckpt_slurm("verify", str(d)).returncode == 0
