"""The Tier contract: what every tier must do, run on every kind in ``conftest.KINDS``.

commit (manifest last, commit-on-close, abort on error), list (only committed steps,
series), read (ranged reads equal what was written), verify (catches one flipped byte),
crash midway (a killed writer or copy leaves nothing listed; the copy resumes), delete
(manifest first), lock (exclusive per step), and copies between two tiers of the kind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Dict

import pytest

from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.errors import CkptError, NotFound
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.copy import SourceCorrupt, copy_checkpoint

from .conftest import CHUNK

FORK = mp.get_context("fork")
USER, KEY = "alice", "run"


def payload(step: int) -> Dict[str, bytes]:
    rnd = __import__("random").Random(step)
    return {
        "model.bin": rnd.randbytes(3 * CHUNK + 123),  # several chunks, ragged end
        "optim/state.bin": rnd.randbytes(CHUNK),  # exactly one chunk, in a subdirectory
        "empty": b"",
    }


def save(tier: Tier, step: int, **meta) -> Manifest:
    with tier.writer(USER, KEY, step, **meta) as w:
        w.write_buffers(payload(step))
    return tier.manifest(USER, KEY, step)


def read_all(tier: Tier, step: int) -> Dict[str, bytes]:
    out = {}
    with tier.reader(USER, KEY, step) as r:
        for e in r.manifest.files:
            src = r.open(e.path)
            try:
                buf = bytearray(e.size)
                view = memoryview(buf)
                pos = 0
                while pos < e.size:
                    n = src.readinto(view[pos : pos + 50_000], pos)
                    assert n > 0
                    pos += n
                out[e.path] = bytes(buf)
            finally:
                src.close()
    return out


# --------------------------------------------------------------------------- commit


def test_commit_on_close_lists_reads_and_verifies(make_tier) -> None:
    tier = make_tier("a")
    m = save(tier, 7, tokens=70, job="123")
    assert [s.step for s in tier.steps(USER, KEY)] == [7]
    assert (m.user, m.key, m.step, m.tokens, m.job) == (USER, KEY, 7, 70, "123")
    assert read_all(tier, 7) == payload(7)
    assert tier.verify(USER, KEY, 7).ok
    assert Manifest.from_bytes(tier.manifest_bytes(USER, KEY, 7)) == m
    assert (USER, KEY) in set(tier.series())
    assert tier.users() == [USER] and tier.keys(USER) == [KEY]


def test_an_exception_aborts_and_nothing_is_listed(make_tier) -> None:
    tier = make_tier("a")
    with pytest.raises(RuntimeError), tier.writer(USER, KEY, 1) as w:
        w.write_buffers(payload(1))
        raise RuntimeError("training crashed")
    assert tier.steps(USER, KEY) == []
    with pytest.raises(NotFound):
        tier.manifest_bytes(USER, KEY, 1)
    save(tier, 1)  # the same step can be written afterwards
    assert [s.step for s in tier.steps(USER, KEY)] == [1]


def test_a_committed_step_is_never_overwritten(make_tier) -> None:
    tier = make_tier("a")
    before = save(tier, 3)
    with pytest.raises(CkptError), tier.writer(USER, KEY, 3) as w:
        w.write_buffers({"x": b"other"})
    assert tier.manifest(USER, KEY, 3) == before


def test_verify_finds_one_flipped_byte(make_tier) -> None:
    src = make_tier("a")
    save(src, 5)
    dst = make_tier("b")
    copy_checkpoint(src, dst, USER, KEY, 5)
    # Flip one byte of the committed copy through a second writer-less path: a copy of
    # the checkpoint with a damaged byte must fail verification on any tier.
    corrupt_one_byte(dst, 5, "model.bin", CHUNK + 7)
    rep = dst.verify(USER, KEY, 5)
    assert not rep.ok and "model.bin" in rep.summary()


def test_a_copy_found_damaged_is_uncommitted_and_flushed_again(make_tier) -> None:
    """Issue 28: a warm copy that rots after it was verified stops counting (its manifest
    moved aside, nothing deleted) and the next copy of the good one replaces it."""
    src, dst = make_tier("a"), make_tier("b")
    save(src, 5)
    copy_checkpoint(src, dst, USER, KEY, 5)
    good = dst.manifest_bytes(USER, KEY, 5)
    corrupt_one_byte(dst, 5, "model.bin", CHUNK + 7)
    assert not dst.verify(USER, KEY, 5).ok
    assert not dst.uncommit(USER, KEY, 5, b"{}")  # not the manifest found damaged: kept
    assert [s.step for s in dst.steps(USER, KEY)] == [5]
    assert dst.uncommit(USER, KEY, 5, good)
    assert dst.steps(USER, KEY) == [] and not dst.uncommit(USER, KEY, 5, good)
    with pytest.raises(NotFound):
        dst.manifest_bytes(USER, KEY, 5)
    res = copy_checkpoint(src, dst, USER, KEY, 5)  # the good copy, flushed again
    assert not res.already_present and res.copied_bytes == res.nbytes
    assert dst.manifest_bytes(USER, KEY, 5) == good and dst.verify(USER, KEY, 5).ok
    assert read_all(dst, 5) == payload(5)


def corrupt_one_byte(tier: Tier, step: int, relpath: str, offset: int) -> None:
    """Damage a committed payload file the way a disk would (kind-specific access: a tier
    of directories through its root, any other through its test door)."""
    dirs = tier.directory()
    if dirs is not None:
        path = os.path.join(dirs.root, USER, KEY, f"step-{step:010d}", relpath)
        with open(path, "r+b") as fh:
            fh.seek(offset)
            b = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([b[0] ^ 0x01]))
        return
    tier.corrupt_for_tests(USER, KEY, step, relpath, offset)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- list, delete


def test_delete_removes_the_manifest_first_and_the_rest(make_tier) -> None:
    tier = make_tier("a")
    for s in (1, 2, 3):
        save(tier, s)
    tier.delete(USER, KEY, 2)
    assert [s.step for s in tier.steps(USER, KEY)] == [1, 3]
    with pytest.raises(NotFound):
        tier.manifest(USER, KEY, 2)
    tier.delete(USER, KEY, 2)  # idempotent
    assert read_all(tier, 3) == payload(3)


def test_lock_is_exclusive_per_step(make_tier) -> None:
    tier = make_tier("a")
    save(tier, 1)
    with tier.lock(USER, KEY, 1) as got:
        assert got
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # another process must not get it
            with tier.lock(USER, KEY, 1, wait=False) as other:
                os.write(w, b"1" if other else b"0")
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"0"
        os.waitpid(pid, 0)
        os.close(r)
    with tier.lock(USER, KEY, 1, wait=False) as again:
        assert again
    with tier.lock(USER, KEY, 2, wait=False) as other_step:  # per step
        assert other_step


# --------------------------------------------------------------------------- copies


def test_copy_is_verified_identical_and_idempotent(make_tier) -> None:
    src, dst = make_tier("a"), make_tier("b")
    save(src, 4)
    res = copy_checkpoint(src, dst, USER, KEY, 4)
    assert not res.already_present and res.copied_bytes == src.manifest(USER, KEY, 4).total_bytes
    assert dst.manifest_bytes(USER, KEY, 4) == src.manifest_bytes(USER, KEY, 4)
    assert dst.verify(USER, KEY, 4).ok and read_all(dst, 4) == payload(4)
    again = copy_checkpoint(src, dst, USER, KEY, 4)
    assert again.already_present and again.copied_bytes == 0


def test_a_corrupt_source_is_never_propagated(make_tier) -> None:
    src, dst = make_tier("a"), make_tier("b")
    save(src, 9)
    corrupt_one_byte(src, 9, "optim/state.bin", 3)
    with pytest.raises(SourceCorrupt):
        copy_checkpoint(src, dst, USER, KEY, 9)
    assert dst.steps(USER, KEY) == []


def test_a_different_checkpoint_of_the_step_is_refused_or_replaced_when_older(make_tier) -> None:
    src, dst = make_tier("a"), make_tier("b")
    save(dst, 2)  # an older timeline's step 2
    save(src, 2)  # written later: another checkpoint of the same step
    with pytest.raises(CkptError, match="different checkpoint"):
        copy_checkpoint(src, dst, USER, KEY, 2)
    copy_checkpoint(src, dst, USER, KEY, 2, replace_older=True)
    assert dst.manifest_bytes(USER, KEY, 2) == src.manifest_bytes(USER, KEY, 2)
    # ...but never a newer one.
    newer = make_tier("c")
    save(newer, 2)
    with pytest.raises(CkptError, match="different checkpoint"):
        copy_checkpoint(src, newer, USER, KEY, 2, replace_older=True)


# --------------------------------------------------------------------------- crashes


def _die_mid_copy(src: Tier, dst: Tier) -> None:
    """Copy, and die (no cleanup at all) once the first payload file is complete."""
    with src.reader(USER, KEY, 6) as r:
        w = dst.writer(USER, KEY, 6, copy_of=r.manifest)
        w.resumable()
        e = next(f for f in r.manifest.files if f.path == "model.bin")
        sink = w.file(e.path, e.size)
        src_file = r.open(e.path)
        buf = bytearray(e.size)
        src_file.readinto(memoryview(buf), 0)
        for off in range(0, e.size, CHUNK):
            sink.write(memoryview(buf)[off : off + CHUNK], off)
        sink.finish()
        os._exit(0)  # SIGKILL-like: no abort, no commit


def _die_mid_write(tier: Tier) -> None:
    w = tier.writer(USER, KEY, 8)
    w.write_buffers({"model.bin": payload(8)["model.bin"]})
    os._exit(0)


def test_a_killed_writer_leaves_nothing_listed(make_tier) -> None:
    tier = make_tier("a")
    p = FORK.Process(target=_die_mid_write, args=(tier,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert tier.steps(USER, KEY) == []
    tier.sweep(USER, KEY)
    save(tier, 8)
    assert tier.verify(USER, KEY, 8).ok


def test_a_killed_copy_leaves_nothing_listed_and_resumes(make_tier) -> None:
    src, dst = make_tier("a"), make_tier("b")
    save(src, 6)
    p = FORK.Process(target=_die_mid_copy, args=(src, dst))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert dst.steps(USER, KEY) == []
    res = copy_checkpoint(src, dst, USER, KEY, 6)
    assert res.resumed_files == 1  # model.bin was complete and is kept
    assert res.copied_bytes == src.manifest(USER, KEY, 6).total_bytes - len(payload(6)["model.bin"])
    assert dst.verify(USER, KEY, 6).ok and read_all(dst, 6) == payload(6)


# --------------------------------------------------------------------------- lease record


def test_the_series_lease_record_round_trips_and_is_never_a_step(make_tier) -> None:
    """``read_lease``/``write_lease`` (slurm_ckpt/job/lease.py's warm-tier record): None
    before, the bytes written after, replaced whole; never listed as a step or a series,
    and kept by the sweep."""
    t = make_tier("warm")
    assert t.read_lease(USER, KEY) is None
    t.write_lease(USER, KEY, b'{"generation": 1}\n')
    save(t, 3)
    t.write_lease(USER, KEY, b'{"generation": 2}\n')
    assert t.read_lease(USER, KEY) == b'{"generation": 2}\n'
    assert [s.step for s in t.steps(USER, KEY)] == [3]
    assert t.keys(USER) == [KEY]
    t.sweep(USER, KEY, max_age_s=0, partials=True)
    assert t.read_lease(USER, KEY) == b'{"generation": 2}\n'
