"""Any number of writers of one step on a shared tier is safe (issue 28).

A partner copy can be flushed by two nodes at once: the owner's epilog and the partner
node's stager, or two epilogs when a SLURM query fails. Here two real processes copy the
same checkpoint, each from its own source tier (the owner's local tier, the partner's),
to one shared warm tier. One of them is stopped at a known point of its copy (a crash
point turned into a pause), the other runs to the end, then the first goes on: every
order of the two that matters, 20 rounds. No committed step may be lost, the committed
step verifies, each writer reports the step done (one copied it, the other found it
there), and each removed only its own work area.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

from slurm_ckpt.core.layout import parse_partial_dirname, partial_dirname, step_dirname
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.s3 import S3Tier

REPO = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("race_worker.py"))
CHUNK = 4096
STEP = 5
#: Where the first writer stops while the second runs: mid copy (its files created,
#: one file complete), all written, its manifest written (the instant before it commits).
PAUSES = ["copy:files-created", "copy:file-synced", "commit:dirs-synced", "commit:manifest"]
ROUNDS = 20
WAIT_S = 60.0


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("SLURM_CKPT_CRASH_AT", None)
    return env


def _payload(seed: int) -> dict:
    return {
        "model.bin": bytes((seed * 7 + i) % 251 for i in range(6 * CHUNK + 123)),
        "optim/state.bin": bytes((seed * 13 + i) % 241 for i in range(3 * CHUNK)),
        "meta.json": json.dumps({"seed": seed}).encode(),
    }


def _save(tier: PosixTier, step: int, seed: int) -> None:
    with tier.writer("alice", "run", step, tokens=step) as w:
        w.write_buffers(_payload(seed))


def _start_paused(src: Path, dst: Path, label: str) -> subprocess.Popen:
    """A writer that is stopped at ``label`` when this returns (it said so)."""
    p = subprocess.Popen(
        [sys.executable, WORKER, str(src), str(dst), str(STEP), label],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([p.stdout], [], [], WAIT_S)
    if not ready:
        p.kill()
        p.wait()
        pytest.fail(f"writer never reached {label}")
    line = p.stdout.readline().strip()  # type: ignore[union-attr]
    if line != "paused":
        out, err = p.communicate(timeout=WAIT_S)
        pytest.fail(f"writer did not pause at {label}: {line} {out} {err}")
    return p


def _run(src: Path, dst: Path) -> dict:
    r = subprocess.run(
        [sys.executable, WORKER, str(src), str(dst), str(STEP)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _resume(p: subprocess.Popen) -> dict:
    out, err = p.communicate("go\n", timeout=WAIT_S)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _work_areas(root: Path) -> List[str]:
    d = root / "alice" / "run"
    return sorted(n for n in os.listdir(d) if n.startswith((".partial-", ".tmp-", ".trash-")))


@pytest.fixture()
def tiers(mounts):
    owner = mounts.tmpfs("8m", "owner")
    partner = mounts.tmpfs("8m", "partner")
    warm = mounts.tmpfs("32m", "warm")
    a = PosixTier("local", str(owner), chunk_size=CHUNK, streams=2)
    b = PosixTier("local", str(partner), chunk_size=CHUNK, streams=2)
    _save(a, STEP, 1)
    copy_checkpoint(a, b, "alice", "run", STEP)  # the partner copy: byte for byte
    assert a.manifest_bytes("alice", "run", STEP) == b.manifest_bytes("alice", "run", STEP)
    return owner, partner, warm


def test_two_writers_of_one_step_never_lose_the_commit(tiers) -> None:
    owner, partner, warm_base = tiers
    want = PosixTier("local", str(owner)).manifest_bytes("alice", "run", STEP)
    for rnd in range(ROUNDS):
        label = PAUSES[rnd % len(PAUSES)]
        first, second = (owner, partner) if rnd % 2 == 0 else (partner, owner)
        dst = warm_base / f"round-{rnd}"
        dst.mkdir()
        warm = PosixTier("pfs", str(dst), chunk_size=CHUNK)
        slow = _start_paused(first, dst, label)
        fast = _run(second, dst)
        assert fast == {"present": False}, f"round {rnd} ({label}): {fast}"
        assert warm.manifest_bytes("alice", "run", STEP) == want
        late = _resume(slow)
        listed = [s.step for s in warm.steps("alice", "run")]
        assert listed == [STEP], f"round {rnd} ({label}): committed step lost ({late})"
        # The writer that lost the race found the very same checkpoint committed: done.
        assert late == {"present": True}, f"round {rnd} ({label}): {late}"
        assert warm.manifest_bytes("alice", "run", STEP) == want
        rep = warm.verify("alice", "run", STEP)
        assert rep.ok, f"round {rnd} ({label}): {rep.summary()}"
        assert _work_areas(dst) == [], f"round {rnd} ({label})"


def test_a_different_checkpoint_of_the_step_is_a_conflict_and_nothing_is_deleted(tiers) -> None:
    owner, partner, warm_base = tiers
    other = PosixTier("local", str(partner), chunk_size=CHUNK)
    other.delete("alice", "run", STEP)
    _save(other, STEP, 2)  # another run's step 5: other bytes, another manifest
    theirs = other.manifest_bytes("alice", "run", STEP)
    for rnd, label in enumerate(["copy:file-synced", "commit:manifest"]):
        dst = warm_base / f"conflict-{rnd}"
        dst.mkdir()
        warm = PosixTier("pfs", str(dst), chunk_size=CHUNK)
        slow = _start_paused(owner, dst, label)
        assert _run(partner, dst) == {"present": False}
        late = _resume(slow)
        assert [s.step for s in warm.steps("alice", "run")] == [STEP], f"lost ({late})"
        assert warm.manifest_bytes("alice", "run", STEP) == theirs
        assert late.get("error") == "StepConflict", late
        assert "conflict" in late["message"]
        assert warm.verify("alice", "run", STEP).ok
        assert _work_areas(dst) == []


def test_a_node_resumes_its_own_dead_copy_and_leaves_other_nodes_work_areas(tiers) -> None:
    owner, _partner, warm_root = tiers
    src = PosixTier("local", str(owner), chunk_size=CHUNK)
    warm = PosixTier("pfs", str(warm_root), chunk_size=CHUNK)
    key = warm_root / "alice" / "run"
    key.mkdir(parents=True)
    # A copy by another node, maybe alive: never touched by this node's copy.
    foreign = partial_dirname(STEP, "othernode.4242.0badc0de")
    (key / foreign).mkdir()
    (key / foreign / "model.bin").write_bytes(b"theirs")
    # A copy by this node whose process is gone, with one complete file: resumed.
    p = subprocess.Popen(
        [sys.executable, WORKER, str(owner), str(warm_root), str(STEP), "copy:file-synced"],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([p.stdout], [], [], WAIT_S)
    assert ready and p.stdout.readline().strip() == "paused"  # type: ignore[union-attr]
    p.kill()
    p.wait()
    mine: Optional[str] = None
    for name in _work_areas(warm_root):
        parsed = parse_partial_dirname(name)
        assert parsed is not None and parsed[0] == STEP
        if name != foreign:
            mine = name
    assert mine is not None and mine.startswith(partial_dirname(STEP) + ".")
    res = copy_checkpoint(src, warm, "alice", "run", STEP)
    assert res.resumed_files >= 1 and not res.already_present
    assert warm.verify("alice", "run", STEP).ok
    assert _work_areas(warm_root) == [foreign]
    assert (key / foreign / "model.bin").read_bytes() == b"theirs"
    # Sweeping old partials finds every writer's work area (and the old name by step).
    (key / partial_dirname(STEP + 1)).mkdir()
    assert sorted(warm.sweep("alice", "run", partials=True)) == sorted(
        [foreign, partial_dirname(STEP + 1)]
    )
    assert _work_areas(warm_root) == []
    assert (key / step_dirname(STEP) / "manifest.json").exists()


def test_two_writers_of_one_step_on_the_object_tier(tiers, s3_server) -> None:
    """The same on the object tier: writers share object names there, so a writer that
    loses (or fails) must delete nothing; the one that commits second counts it done."""
    owner, partner, _warm = tiers
    want = PosixTier("local", str(owner)).manifest_bytes("alice", "run", STEP)
    bucket = s3_server.bucket("race")
    for rnd, label in enumerate(["copy:file-synced", "s3:before-manifest"] * 2):
        where = {"endpoint": s3_server.endpoint, "bucket": bucket}
        where["prefix"] = s3_server.fresh_prefix(f"race{rnd}")
        spec = "s3:" + json.dumps(where)
        dst = S3Tier("object", chunk_size=CHUNK, **where)
        first, second = (owner, partner) if rnd % 2 == 0 else (partner, owner)
        slow = _start_paused(first, spec, label)  # type: ignore[arg-type]
        assert _run(second, spec) == {"present": False}  # type: ignore[arg-type]
        late = _resume(slow)
        assert [s.step for s in dst.steps("alice", "run")] == [STEP], f"lost ({late})"
        assert late == {"present": True}, f"round {rnd} ({label}): {late}"
        assert dst.manifest_bytes("alice", "run", STEP) == want
        assert dst.verify("alice", "run", STEP).ok
