"""Two nodes' real hooks flush one partner copy at once (issue 28, the two-writer race).

A partner copy is the owner's checkpoint on another node's local tier, so two nodes hold
the same step, and both may flush it to the warm tier at the same time:

* the owner's epilog and the partner node's stager, when SLURM cannot say whether the
  owner's node is alive (each then flushes rather than risk the only copy);
* two epilogs (a job on both nodes ends; the SLURM query about the owner fails).

Here the real hook code runs as root (two long-lived processes, one per node, each with
its own local tier and ledger), over a real user's checkpoints (tmpfs local tiers, a
tmpfs warm tier of mode 1777). One hook is stopped at a known point of its first copy
(a crash point turned into a pause, in its child running as the user: mid copy, all
written, about to commit, just committed); the other runs to the end, retention
included; then the first goes on. Both orders, every pause point, 20 rounds each.

After the second hook and again at the end of each round:

* no committed step is ever deleted: what is on the warm tier verifies and is the
  owner's checkpoint byte for byte, and at the end every step is there;
* every step is on the warm tier (verified) or still on a node: retention never
  deleted the only good copy;
* what each node's ledger records VERIFIED on the warm tier is there (at the end: every
  step, in both ledgers);
* each step was copied by exactly one of the two hooks and found there by the other,
  nothing failed, no node is drained, and no writer's work area is left behind.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from conftest import Mounts
from test_hooks import _ensure_users, ids

from slurm_ckpt.core.manifest import MANIFEST_NAME
from slurm_ckpt.hooks.prolog import ensure_user_dir
from slurm_ckpt.ledger import Ledger, State
from slurm_ckpt.node.asuser import run_as_user
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("hook_race_worker.py"))
USER, KEY, JOB = "ckptuser1", "run", "4242"
OWNER, PARTNER = "na", "nb"
STEPS = (1, 2, 3)
ROUNDS = 20
#: Where the stopped hook's first copy stands while the other hook runs: its files
#: created, one file complete, all written and synced, its manifest written (about to
#: commit), committed (the other hook then finds the step there).
PAUSES = [
    "copy:files-created",
    "copy:file-synced",
    "commit:dirs-synced",
    "commit:manifest",
    "commit:renamed",
]
WAIT_S = 60.0


class Hooks:
    """One node's hooks: a root process that runs the epilog or a stager pass on request
    (:mod:`hook_race_worker`)."""

    def __init__(self, name: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        for var in ("SLURM_CKPT_PAUSE_AT", "SLURM_CKPT_PAUSE_FILE", "SLURM_CKPT_CRASH_AT"):
            env.pop(var, None)
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, WORKER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def send(self, req: Dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def answered(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return bool(ready)

    def answer(self) -> Dict[str, Any]:
        if not self.answered(WAIT_S):
            pytest.fail(f"{self.name}'s hook did not finish in {WAIT_S:.0f} s")
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            pytest.fail(f"{self.name}'s hook process died (exit {self.proc.wait()})")
        out: Dict[str, Any] = json.loads(line)
        assert "error" not in out, f"{self.name}: {out.get('trace') or out['error']}"
        return out

    def call(self, req: Dict[str, Any]) -> Dict[str, Any]:
        self.send(req)
        return self.answer()

    def wait_paused(self, pause: Path) -> None:
        """Until this node's hook stands at its pause; a hook that finishes (or dies)
        without reaching it fails the round: the order was not the one asked for."""
        marker = Path(str(pause) + ".paused")
        for _ in range(int(WAIT_S / 0.01)):
            if marker.exists():
                return
            if self.answered(0.01):
                pytest.fail(f"{self.name}'s hook never reached its pause: {self.answer()}")
        pytest.fail(f"{self.name}'s hook did not reach its pause in {WAIT_S:.0f} s")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Round:
    """One round's world: two nodes' tmpfs local tiers and ledgers, a tmpfs warm tier;
    the owner's checkpoints (written as the user on its node) and their partner copies
    (byte for byte, on the other node)."""

    def __init__(self, base: Path, mounts: Mounts) -> None:
        self.base = base
        self.local = {n: mounts.tmpfs("8m", f"local-{n}") for n in (OWNER, PARTNER)}
        self.warm = mounts.tmpfs("16m", "warm")
        os.chmod(self.warm, 0o1777)  # users make their own directories, as on a PFS
        self.manifests: Dict[int, bytes] = {}
        u = ids(USER)
        for n in (OWNER, PARTNER):
            ensure_user_dir(str(self.local[n]), u)
        src, dst = str(self.local[OWNER]), str(self.local[PARTNER])

        def save_and_copy() -> None:
            own, partner = PosixTier("local", src), PosixTier("local", dst)
            for step in STEPS:
                w = own.writer(USER, KEY, step, job=JOB, node=OWNER, chunk_size=4096)
                w.write_buffers(
                    {"model.bin": os.urandom(5 * 4096 + step), "optim/state.bin": b"o" * 700}
                )
                w.commit()
                copy_checkpoint(own, partner, USER, KEY, step)  # the partner copy

        run_as_user(USER, save_and_copy)
        for step in STEPS:
            self.manifests[step] = PosixTier("local", src).manifest_bytes(USER, KEY, step)
            assert PosixTier("local", dst).manifest_bytes(USER, KEY, step) == self.manifests[step]

    def cfg(self, node: str) -> Dict[str, Any]:
        return {
            "tiers": {
                "local": {"root": str(self.local[node]), "min_free": 0},
                "pfs": {"kind": "posix", "root": str(self.warm)},
            },
            "ledger": {"dir": str(self.base / f"ledger-{node}")},
            "copy": {"chunk_size": "4KiB", "streams": 2},
            "retention": {"keep_local": 1},
            "hooks": {"budget": 30},
        }

    def request(self, hook: str, node: str, slurm: str = "none") -> Dict[str, Any]:
        return {
            "hook": hook,
            "cfg": self.cfg(node),
            "node": node,
            "nodes": [OWNER, PARTNER],
            "job": JOB,
            "user": USER,
            "slurm": slurm,
        }

    # -- what is where ------------------------------------------------------------
    def warm_steps(self) -> List[int]:
        return [i.step for i in PosixTier("pfs", str(self.warm)).steps(USER, KEY)]

    def local_steps(self, node: str) -> List[int]:
        return [i.step for i in PosixTier("local", str(self.local[node])).steps(USER, KEY)]

    def verified_in_ledger(self, node: str) -> List[int]:
        led = Ledger(str(self.base / f"ledger-{node}"), node)
        return sorted(r.step for r in led.records(USER, KEY) if r.state("pfs") is State.VERIFIED)

    def work_areas(self) -> List[str]:
        d = self.warm / USER / KEY
        names = os.listdir(d) if d.is_dir() else []
        return sorted(n for n in names if n.startswith((".partial-", ".tmp-", ".trash-")))

    def check(self, where: str, final: bool) -> None:
        """The invariants of the module docstring (``final``: both hooks are done)."""
        warm = PosixTier("pfs", str(self.warm))
        on_warm = self.warm_steps()
        for step in on_warm:
            rep = warm.verify(USER, KEY, step)
            assert rep.ok, f"{where}: step {step} on the warm tier: {rep.summary()}"
            assert warm.manifest_bytes(USER, KEY, step) == self.manifests[step], where
        held = set(on_warm) | set(self.local_steps(OWNER)) | set(self.local_steps(PARTNER))
        assert held >= set(STEPS), f"{where}: steps {sorted(set(STEPS) - held)} are nowhere"
        for node in (OWNER, PARTNER):
            said = self.verified_in_ledger(node)
            assert set(said) <= set(on_warm), f"{where}: {node}'s ledger says {said} verified"
            if final:
                assert said == list(STEPS), f"{where}: {node}'s ledger: {said} verified"
        if final:
            assert on_warm == list(STEPS), f"{where}: committed steps lost: {on_warm}"
            assert self.work_areas() == [], where
            for node in (OWNER, PARTNER):  # keep_local 1: the older ones were flushed
                assert self.local_steps(node) == [STEPS[-1]], (where, node)
        # A step's manifest is never found moved aside (uncommitted) by a race.
        d = self.warm / USER / KEY
        for name in os.listdir(d) if d.is_dir() else []:
            if name.startswith("step-"):
                assert (d / name / MANIFEST_NAME).exists(), f"{where}: {name} uncommitted"


@pytest.fixture
def base() -> Iterator[Path]:
    _ensure_users()
    path = Path(tempfile.mkdtemp(prefix="sckpt-race-", dir="/var/tmp"))
    os.chmod(path, 0o755)  # the users reach their tiers below it
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def nodes() -> Iterator[Dict[str, Hooks]]:
    hooks = {n: Hooks(n) for n in (OWNER, PARTNER)}
    try:
        yield hooks
    finally:
        for h in hooks.values():
            h.close()


def _race(
    base: Path,
    nodes: Dict[str, Hooks],
    rnd: int,
    stopped: Tuple[str, str],
    other: Tuple[str, str],
    slurm: str,
) -> None:
    """One round: ``stopped`` = (hook, node) paused at its copy's pause point while
    ``other`` runs to the end; then it goes on. Checks the invariants at both points."""
    label = PAUSES[rnd % len(PAUSES)]
    rbase = base / f"round-{rnd}"
    rbase.mkdir()
    os.chmod(rbase, 0o755)
    mounts = Mounts(rbase)
    try:
        world = Round(rbase, mounts)
        where = f"round {rnd}: {stopped[0]} on {stopped[1]} stopped at {label}"
        # The pause's marker files are made by the child, as the user.
        (rbase / "pause").mkdir()
        os.chown(rbase / "pause", ids(USER).uid, ids(USER).gid)
        pause = rbase / "pause" / "at"
        req = dict(world.request(*stopped, slurm=slurm), pause=label, pause_file=str(pause))
        nodes[stopped[1]].send(req)
        nodes[stopped[1]].wait_paused(pause)
        try:
            fast = nodes[other[1]].call(world.request(*other, slurm=slurm))
            world.check(f"{where}, after {other[0]} on {other[1]}", final=False)
        finally:
            Path(str(pause) + ".go").touch()
        late = nodes[stopped[1]].answer()
        world.check(where, final=True)
        for rep in (fast, late):
            assert rep["failed"] == 0 and rep["backlog"] == 0, (where, rep["line"])
            assert rep["drained"] is None, (where, rep["line"])
        # Each step was copied by one hook and found committed by the other.
        for step in STEPS:
            got = sorted(
                status
                for rep in (fast, late)
                for ident, status, _err in rep["results"]
                if tuple(ident) == (USER, KEY, step)
            )
            assert got == ["already", "flushed"], (where, step, fast["line"], late["line"])
    finally:
        mounts.close()


def test_the_owners_epilog_stopped_while_the_partners_stager_flushes(base, nodes) -> None:
    for rnd in range(ROUNDS):
        _race(base, nodes, rnd, ("epilog", OWNER), ("stager", PARTNER), slurm="none")


def test_the_partners_stager_stopped_while_the_owners_epilog_flushes(base, nodes) -> None:
    for rnd in range(ROUNDS):
        _race(base, nodes, rnd, ("stager", PARTNER), ("epilog", OWNER), slurm="none")


def test_two_epilogs_when_slurm_cannot_say_the_owner_lives(base, nodes) -> None:
    """Both epilogs of a two-node job: the partner's would leave the copy to a live owner,
    but SLURM fails (the query, and the drain): both flush, in either order."""
    for rnd in range(ROUNDS):
        first, second = (OWNER, PARTNER) if rnd % 2 == 0 else (PARTNER, OWNER)
        _race(base, nodes, rnd, ("epilog", first), ("epilog", second), slurm="failing")
