"""Partner copies (issue 21, items 1 and 2), in one process: two Checkpointers are two
"nodes" with local tiers of their own and a shared PFS; the copies travel over real TCP
on 127.0.0.1, authenticated with the job's secret.

What must hold:

1. every committed local checkpoint of a rank lands on the other node's local tier, with
   the owner's manifest byte for byte, under the owner's series key, verified, marked in
   that node's ledger as a partner copy and selected for the flush; only the newest
   ``keep_partner`` are kept there;
2. a node lost mid-job costs no checkpoint: with ``flush_every`` high the newest step of
   the lost rank is on no PFS, the surviving node's epilog flushes its partner copy, and
   a fresh pair of ranks on new nodes resumes at the newest step, bitwise;
3. nothing unauthenticated is accepted, and a copy whose bytes do not match the
   manifest is never committed (and training goes on).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
from test_checkpointer import assert_state_equal, sample_state

from slurm_ckpt import Checkpointer
from slurm_ckpt.core.config import Config
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.job.partner_net import Peer, ring_partner
from slurm_ckpt.job.partner_wire import HELLO_MAX, MAGIC
from slurm_ckpt.ledger import Ledger, State
from slurm_ckpt.ledger.node_status import node_status
from slurm_ckpt.node.work import NodeWork
from slurm_ckpt.slurm.env import HookEnv
from slurm_ckpt.slurm.records import NodeInfo
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier

KEY = "run"
JOB = "4242"


def rank_key(rank: int) -> str:
    return f"{KEY}.rank{rank:05d}"


def node(tmp: Path, name: str, rank: int, **kw: Any) -> Checkpointer:
    """One rank on its own "node": a local tier and a ledger of its own, the shared PFS."""
    for d in (tmp / name / "local", tmp / name / "ledger", tmp / "pfs"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(tmp / name / "ledger", 0o700)
    kw.setdefault("flush_every", 100)
    kw.setdefault("keep_local", 2)
    kw.setdefault("partner", True)
    return Checkpointer(
        local=tmp / name / "local",
        warm=tmp / "pfs",
        key=KEY,
        rank=rank,
        world_size=2,
        node=name,
        job=JOB,
        ledger_dir=tmp / name / "ledger",
        install_signals=False,
        end_time_fn=None,
        keep_partner=2,
        partner_dir=tmp / "rendezvous",
        partner_host="127.0.0.1",
        **kw,
    )


def states(n: int) -> List[Dict[str, Any]]:
    return [sample_state(seed) for seed in range(n)]


def save_all(ranks: List[Checkpointer], step: int, state: Dict[str, Any]) -> None:
    for r in ranks:
        r.save(state, step=step)
    for r in ranks:
        assert r.wait(flush=True)
        assert r.partner is not None and r.partner.wait_idle(60)


def local_tier(tmp: Path, name: str) -> PosixTier:
    return PosixTier("local", str(tmp / name / "local"))


def test_ring_is_over_nodes_never_within_one() -> None:
    peers = {r: Peer(r, n, "h", 1) for r, n in enumerate(["a", "a", "b", "b", "c", "c"])}
    got = {r: ring_partner(peers, r).rank for r in peers}  # type: ignore[union-attr]
    assert got == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert ring_partner({0: Peer(0, "a", "h", 1), 1: Peer(1, "a", "h", 2)}, 0) is None


def test_partner_copy_is_the_owners_checkpoint_on_the_other_node(tmp_path: Path) -> None:
    a, b = node(tmp_path, "na", 0), node(tmp_path, "nb", 1)
    try:
        st = states(3)
        for step in (1, 2, 3):
            save_all([a, b], step, st[step - 1])
        la, lb = local_tier(tmp_path, "na"), local_tier(tmp_path, "nb")
        # Each node holds its own series and the other rank's, newest keep_partner only.
        assert [i.step for i in lb.steps("root", rank_key(0))] == [2, 3]
        assert [i.step for i in la.steps("root", rank_key(1))] == [2, 3]
        for step in (2, 3):
            assert lb.manifest_bytes("root", rank_key(0), step) == la.manifest_bytes(
                "root", rank_key(0), step
            )
            assert lb.verify("root", rank_key(0), step).ok
        rec = Ledger(str(tmp_path / "nb" / "ledger"), "nb").get("root", rank_key(0), 3)
        assert rec is not None and rec.extra["partner_of"] == "na"
        assert rec.pending_flush and rec.tiers["pfs"] == State.FLUSH_PENDING
        old = Ledger(str(tmp_path / "nb" / "ledger"), "nb").get("root", rank_key(0), 1)
        assert old is not None and old.tiers["local"] == State.DELETED
        sa, sb = a.partner.stats, b.partner.stats  # type: ignore[union-attr]
        assert (sa.sent, sa.send_failures, sb.received, sb.receive_failures) == (3, 0, 3, 0)
        assert sa.partner == "rank 1 on nb" and sb.deleted == 1
    finally:
        a.close()
        b.close()


def test_node_lost_mid_job_costs_no_checkpoint(tmp_path: Path) -> None:
    a, b = node(tmp_path, "na", 0), node(tmp_path, "nb", 1)
    st = states(3)
    for step in (1, 2, 3):
        save_all([a, b], step, st[step - 1])
    pfs = PosixTier("pfs", str(tmp_path / "pfs"))
    # flush_every=100: only the first save went to the PFS.
    assert [i.step for i in pfs.steps("root", rank_key(0))] == [1]
    # Node na is lost: its disk with it (its ranks never close).
    a.partner.close(0)  # type: ignore[union-attr]
    a._pipeline.finish(0)  # stop its threads without the flush close() would make
    shutil.rmtree(tmp_path / "na" / "local")
    b.close()  # the surviving rank ends (its own newest is flushed as usual)
    # The epilog of nb, as SLURM runs it when the job ends there.
    cfg = Config.from_dict(
        {
            "tiers": {
                "local": {"root": str(tmp_path / "nb" / "local"), "min_free": 0},
                "pfs": {"kind": "posix", "root": str(tmp_path / "pfs")},
            },
            "ledger": {"dir": str(tmp_path / "nb" / "ledger")},
            "hooks": {"budget": 60},
        }
    )
    rep = run_epilog(cfg, HookEnv(JOB, "root", 0, 0, "nb", ["na", "nb"], 0))
    assert not rep.flush.failed, rep.line()
    assert [i.step for i in pfs.steps("root", rank_key(0))] == [1, 2, 3]
    assert pfs.verify("root", rank_key(0), 3).ok
    led = Ledger(str(tmp_path / "nb" / "ledger"), "nb")
    rec = led.get("root", rank_key(0), 3)
    assert rec is not None and rec.tiers["pfs"] == State.VERIFIED
    assert rec.extra["partner_of"] == "na"
    job = node_status(led)["jobs"][JOB]
    assert (job["partner_copies"], job["latest_partner_step"]) == (2, 3)
    # Root's own ledger, rebuilt from a scan of the tier, knows them as partner copies
    # too (their manifests name another node).
    fresh = Config.from_dict({**cfg.to_dict(), "ledger": {"dir": str(tmp_path / "nb-root")}})
    work = NodeWork(fresh, "nb")
    work.reconcile()
    marks = {(r.key, r.step): r.extra.get("partner_of") for r in work.ledger.records("root", None)}
    assert marks == {
        (rank_key(0), 2): "na",
        (rank_key(0), 3): "na",
        (rank_key(1), 2): None,
        (rank_key(1), 3): None,
    }
    # The requeued job on two new nodes resumes at the newest step, bitwise.
    c, d = node(tmp_path, "nc", 0, partner=False), node(tmp_path, "nd", 1, partner=False)
    try:
        for r in (c, d):
            got = r.restore()
            assert got is not None and got.step == 3 and got.tier == "pfs"
            assert_state_equal(st[2], got.state)
    finally:
        c.close()
        d.close()


def test_unauthenticated_peer_is_refused(tmp_path: Path) -> None:
    a, b = node(tmp_path, "na", 0), node(tmp_path, "nb", 1)
    try:
        with socket.create_connection(("127.0.0.1", b.partner.port), timeout=30) as s:  # type: ignore[union-attr]
            # a client hello (no launch tag, no series) whose MAC is made without the secret
            hello = MAGIC + os.urandom(16) + (1).to_bytes(4, "big") + bytes(8) + os.urandom(32)
            assert len(hello) < HELLO_MAX
            s.sendall(hello)
            assert s.recv(64) == b""  # hung up on, nothing said
        assert b.partner.stats.refused == 1  # type: ignore[union-attr]
        assert local_tier(tmp_path, "nb").keys("root") == [] or rank_key(0) not in (
            local_tier(tmp_path, "nb").keys("root")
        )
        secret = tmp_path / "rendezvous" / "root" / f"{KEY}.{JOB}.0" / "secret"
        assert (secret.stat().st_mode & 0o777) == 0o600
    finally:
        a.close()
        b.close()


def test_corrupt_source_is_never_committed_and_training_goes_on(tmp_path: Path) -> None:
    a, b = node(tmp_path, "na", 0), node(tmp_path, "nb", 1)
    try:
        st = states(2)
        save_all([a, b], 1, st[0])
        la, lb = local_tier(tmp_path, "na"), local_tier(tmp_path, "nb")
        lb.delete("root", rank_key(0), 1)
        m = la.manifest("root", rank_key(0), 1)
        big = max(m.files, key=lambda e: e.size)
        path = Path(la.step_path("root", rank_key(0), 1)) / big.path
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        a.partner.offer(1)  # type: ignore[union-attr]
        assert a.partner.wait_idle(60)  # type: ignore[union-attr]
        assert a.partner.stats.send_failures == 1  # type: ignore[union-attr]
        assert [i.step for i in lb.steps("root", rank_key(0))] == []
        save_all([a, b], 2, st[1])  # training and partner copies go on
        assert [i.step for i in lb.steps("root", rank_key(0))] == [2]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("world", [1])
def test_one_rank_has_no_partner(tmp_path: Path, world: int) -> None:
    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    c = Checkpointer(
        local=tmp_path / "l",
        warm=tmp_path / "p",
        key=KEY,
        rank=0,
        world_size=world,
        install_signals=False,
        end_time_fn=None,
        partner=True,
    )
    try:
        assert c.partner is None
        c.save(sample_state(0), step=1)
    finally:
        c.close()


def test_a_rank_whose_partner_closed_first_closes_at_once(tmp_path: Path) -> None:
    """Ranks end in any order. Rank 1 closes (withdraws its address) before rank 0 has
    ever looked its partner up; rank 0's last save then has no partner to go to, and its
    close() must end at once, not after the rendezvous timeout (300 s; the fault
    campaign saw one-minute job ends from this)."""
    import threading

    r0, r1 = node(tmp_path, "na", 0), node(tmp_path, "nb", 1)
    r1.close()
    assert r0.partner is not None
    r0.partner.wait_idle(60)
    r0.save(sample_state(1), step=1)
    assert r0.wait(flush=False)
    closer = threading.Thread(target=r0.close)
    closer.start()
    closer.join(60)  # a bound far below the 300 s the sender would wait without the fix
    assert not closer.is_alive(), "close() waited for a partner that had already closed"
    assert [i.step for i in local_tier(tmp_path, "na").steps(r0.user, rank_key(0))] == [1]


class _Slurm:
    """What the stager asks SLURM, answered from a dict of node states (the partner
    stager's decision is about the owner's state only; the cluster tests run real SLURM)."""

    def __init__(self, states: Dict[str, str]) -> None:
        self.states = states

    def node(self, name: str) -> NodeInfo:
        return NodeInfo(name, self.states[name])

    def node_table(self, timeout: Any = None) -> Dict[str, NodeInfo]:
        return {n: NodeInfo(n, s) for n, s in self.states.items()}

    def jobs_on_node(self, _node: str) -> List[Any]:
        return []


def _two_nodes_saved_three_steps(tmp_path: Path) -> PosixTier:
    """Ranks 0 (node na) and 1 (node nb), each the other's partner, save steps 1-3 and
    close; returns the PFS they flush to."""
    a, b = node(tmp_path, "na", 0), node(tmp_path, "nb", 1)
    try:
        st = states(3)
        for step in (1, 2, 3):
            save_all([a, b], step, st[step - 1])
    finally:
        a.close()
        b.close()
    return PosixTier("pfs", str(tmp_path / "pfs"))


def test_the_partner_stager_leaves_a_live_owners_copies_and_learns_they_were_flushed(
    tmp_path: Path,
) -> None:
    """Issue 28: the stager defers a live owner's partner copies, as the epilog does (two
    nodes writing one step to the PFS at once would copy it twice), does not count them
    against its node, and records them verified once the owner has flushed them."""
    pfs = _two_nodes_saved_three_steps(tmp_path)
    cfg = Config.from_dict(
        {
            "tiers": {
                "local": {
                    "root": str(tmp_path / "nb" / "local"),
                    "min_free": 0,
                    "require_mount": False,
                },
                "pfs": {"kind": "posix", "root": str(tmp_path / "pfs")},
            },
            "ledger": {"dir": str(tmp_path / "nb" / "ledger")},
        }
    )
    owner_copies = [s for s in (2, 3) if s not in [i.step for i in pfs.steps("root", rank_key(0))]]
    assert owner_copies, "the owner's newest steps must not be on the PFS yet"
    rep = stager_pass(cfg, "nb", _Slurm({"na": "IDLE", "nb": "IDLE"}))
    flushed = {r.ident for r in rep.flush.results}
    assert rep.healthy, rep.line()
    pending = Ledger(str(tmp_path / "nb" / "ledger"), "nb").pending_flush("root", rank_key(0))
    assert {r.step for r in pending} >= set(owner_copies)  # owed, and left to their owner
    assert not any(i[1] == rank_key(0) for i in flushed), rep.line()
    assert rep.backlog == 0, rep.line()  # left to their owner: no reason to stay drained
    assert [i.step for i in pfs.steps("root", rank_key(0))] != [1, 2, 3]
    # The owner's node flushes its own (its hooks), then the partner's next pass learns it.
    la = local_tier(tmp_path, "na")
    for step in owner_copies:
        copy_checkpoint(la, pfs, "root", rank_key(0), step)
    rep = stager_pass(cfg, "nb", _Slurm({"na": "IDLE", "nb": "IDLE"}))
    assert rep.healthy and rep.backlog == 0, rep.line()
    assert not any(r.ident[1] == rank_key(0) for r in rep.flush.results), rep.line()
    led = Ledger(str(tmp_path / "nb" / "ledger"), "nb")
    for step in owner_copies:
        rec = led.get("root", rank_key(0), step)
        assert rec is not None and rec.tiers["pfs"] == State.VERIFIED
    # An owner SLURM says is DOWN: its partner copies are the partner's to flush.
    pfs.delete("root", rank_key(0), 3)
    led.mark("root", rank_key(0), 3, "pfs", State.FLUSH_PENDING)
    rep = stager_pass(cfg, "nb", _Slurm({"na": "DOWN", "nb": "IDLE"}))
    assert (("root", rank_key(0), 3)) in {r.ident for r in rep.flush.results if r.ok}
    assert pfs.verify("root", rank_key(0), 3).ok


_EPILOG = """
import json, sys
from slurm_ckpt.core.config import Config
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.slurm.env import HookEnv
cfg = Config.from_dict(json.loads(sys.argv[1]))
rep = run_epilog(cfg, HookEnv(sys.argv[2], "root", 0, 0, "na", ["na", "nb"], 0))
print(rep.line())
"""


def _node_cfg(tmp: Path, name: str) -> Dict[str, Any]:
    local = {"root": str(tmp / name / "local"), "min_free": 0, "require_mount": False}
    return {
        "tiers": {"local": local, "pfs": {"kind": "posix", "root": str(tmp / "pfs")}},
        "ledger": {"dir": str(tmp / name / "ledger")},
        "hooks": {"budget": 60},
    }


def _wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    """Until ``path`` exists (the other side reached its pause), or it died/took 60 s."""
    end = time.monotonic() + 60
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > end:
            out, err = proc.communicate()
            pytest.fail(f"the epilog never reached its pause: {out} {err}")
        time.sleep(0.01)


def test_the_owners_epilog_and_the_partners_stager_copy_one_step_at_once(tmp_path: Path) -> None:
    """Issue 28: SLURM cannot be asked (no client), so the owner's epilog and the
    partner node's stager both flush the same steps to one PFS. The epilog is stopped
    just before it publishes its copy (a pause at ``commit:dirs-synced``, in its child
    running as the owner) while the stager copies and commits the same step; then it goes
    on. Every step committed stays, verifies, and both nodes' ledgers agree with the PFS."""
    pfs = _two_nodes_saved_three_steps(tmp_path)
    # The owner's job died before its own flush of step 3: its epilog owes it; the
    # partner node holds a partner copy of it (and of step 2), owed too.
    pfs.delete("root", rank_key(0), 3)
    Ledger(str(tmp_path / "na" / "ledger"), "na").mark(
        "root", rank_key(0), 3, "pfs", State.FLUSH_PENDING
    )
    shutil.rmtree(tmp_path / "na" / "local" / "root" / rank_key(1))  # only step 3 is owed
    ours = [2, 3]
    assert {i.step for i in local_tier(tmp_path, "nb").steps("root", rank_key(0))} == {2, 3}
    pause = tmp_path / "pause"
    env = dict(
        os.environ,
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        SLURM_CKPT_PAUSE_AT="commit:dirs-synced",
        SLURM_CKPT_PAUSE_FILE=str(pause),
    )
    epilog = subprocess.Popen(
        [sys.executable, "-c", _EPILOG, json.dumps(_node_cfg(tmp_path, "na")), JOB],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(Path(str(pause) + ".paused"), epilog)
        srep = stager_pass(Config.from_dict(_node_cfg(tmp_path, "nb")), "nb")
    finally:
        Path(str(pause) + ".go").touch()
        out, err = epilog.communicate(timeout=120)
    assert epilog.returncode == 0, err
    listed = {i.step for i in pfs.steps("root", rank_key(0))}
    assert set(ours) <= listed, f"committed step lost: {sorted(listed)} ({out})"
    assert not srep.flush.failed, srep.line()
    assert "failed" not in out, out
    # The epilog lost the race to commit step 3 and found the very same step there.
    assert "flushed 0 (0B), 1 already on the warm tier" in out, out
    for step in sorted(listed):
        assert pfs.verify("root", rank_key(0), step).ok
    for name in ("na", "nb"):
        led = Ledger(str(tmp_path / name / "ledger"), name)
        for rec in led.records("root", rank_key(0)):
            if rec.tiers.get("pfs") == State.VERIFIED:  # every ledger agrees with the PFS
                assert rec.step in listed, f"{name} says step {rec.step} is on the PFS"
        for step in ours if name == "nb" else [3]:
            rec = led.get("root", rank_key(0), step)
            assert rec is not None and rec.tiers.get("pfs") == State.VERIFIED, (name, rec, out)
    left = [n for n in os.listdir(tmp_path / "pfs" / "root" / rank_key(0)) if n.startswith(".")]
    assert [n for n in left if not n.startswith(".lock-")] == []


def test_roots_flush_and_ckpt_sruns_flush_leave_a_live_owners_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: root's ``ckpt-slurm flush`` (:func:`flush_node`) and ckpt-srun's flush
    after the step (:func:`flush_series`) leave a live owner's partner copies to its node,
    as the epilog and the stager do; an owner SLURM says is DOWN has them flushed here."""
    from slurm_ckpt.ops.flush_cmd import flush_node, flush_series

    pfs = _two_nodes_saved_three_steps(tmp_path)
    owner_copies = [s for s in (2, 3) if s not in [i.step for i in pfs.steps("root", rank_key(0))]]
    assert owner_copies, "the owner's newest steps must not be on the PFS yet"
    held = [i.step for i in local_tier(tmp_path, "nb").steps("root", rank_key(0))]
    assert set(owner_copies) <= set(held)  # nb holds partner copies of them
    cfg = Config.from_dict(_node_cfg(tmp_path, "nb"))
    # ckpt-srun's flush on nb, inside the job (na is one of its nodes): left to na.
    monkeypatch.setenv("SLURM_JOB_ID", JOB)
    monkeypatch.setenv("SLURMD_NODENAME", "nb")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "na,nb")
    lines = flush_series(cfg, "root", KEY, 60)
    for step in owner_copies:
        assert f"rank00000 step {step}: partner copy, left to its owner's node" in lines, lines
    assert not any(ln.startswith("rank00000") and "flushed" in ln for ln in lines), lines
    assert [i.step for i in pfs.steps("root", rank_key(0))] == [
        s for s in (1, 2, 3) if s not in owner_copies
    ]
    # Root's flush on nb, na alive: left to na, counted as such, not copied from here.
    summary = flush_node(cfg, "nb", client=_Slurm({"na": "IDLE", "nb": "IDLE"}))
    assert summary.left_to_owners >= len(owner_copies), summary.to_dict()
    assert [i.step for i in pfs.steps("root", rank_key(0))] == [
        s for s in (1, 2, 3) if s not in owner_copies
    ]
    # na DOWN: nb holds the only copies; root's flush copies them.
    summary = flush_node(cfg, "nb", client=_Slurm({"na": "DOWN", "nb": "IDLE"}))
    assert summary.left_to_owners == 0, summary.to_dict()
    assert [i.step for i in pfs.steps("root", rank_key(0))] == [1, 2, 3]
    for step in owner_copies:
        assert pfs.verify("root", rank_key(0), step).ok
