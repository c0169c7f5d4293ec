"""The campaign's partner-copy scenarios (issue 21, item 5): node losses with partner
copies on.

A job of two ranks, one per "node" (A and B), with partner copies on (the ring A -> B ->
A, real TCP on 127.0.0.1, the job secret in the PFS rendezvous directory) and
``flush_every`` high, so the newest step is usually on no PFS: it lives on the owner's
disk and, as a partner copy, on the other node's. Every rank trains the same trajectory,
so each shard a restart loads is checked bit for bit against the uninterrupted run.

A lost node: its trainer is SIGKILLed (SLURM then kills the other rank), its disk is
gone, and SLURM marks it DOWN - which is what a partner's epilog asks before it flushes
the lost owner's partner copy (``node/partner_flush.py``). The requeued job runs both
ranks on a third node C (a node set that holds none of the old copies: only the PFS
serves it), resumes, and must finish equal to the uninterrupted run.

Checked besides I1-I4: I5 (:meth:`Tracker.check_node_loss`) - a single node loss loses at
most the steps since the newest step whose partner copy was committed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

from tests.faults.campaign import SLEEP, Run
from tests.faults.scenarios import _damage_one, scenario
from tests.faults.site import USER, FaultSite, Worker

WORLD = 2
KEYS = [f"run.rank{r:05d}" for r in range(WORLD)]


def partner_site(site: FaultSite, bandwidth: Optional[str] = None) -> Dict[str, Any]:
    """Three nodes (A and B run the job, C takes the requeue), a PFS, partner copies on."""
    for _ in range(3):
        site.add_node("tmpfs")
    site.set_pfs("loop", 64)
    partner: Dict[str, Any] = {"enabled": True, "keep_partner": 2}
    if bandwidth:
        partner["bandwidth"] = bandwidth
    site.configure(partner=partner, retention={"flush_every": 4})
    # 60 steps at 0.05 s: time for the ring to form and partner copies to flow before
    # the fault (the requeued job after it trains at the campaign's pace, finish_ranks)
    return {"keys": KEYS, "steps": 60, "sleep": 0.05}


def _progress(run: Run, rank: int) -> Path:
    return run.site.out / f"{run.key}.r{rank}.progress"


def _reached(run: Run) -> int:
    """The furthest step any rank completed (the work a loss may cost)."""
    best = 0
    for r in range(WORLD):
        with contextlib.suppress(OSError, ValueError, KeyError):
            best = max(best, int(json.loads(_progress(run, r).read_text())["step"]))
    return best


def start_ranks(
    run: Run,
    placement: List[str],
    bound: Optional[int] = None,
    when: str = "",
    sleep: Optional[float] = None,
) -> List[Worker]:
    """Prolog on each node of ``placement`` (rank r on ``placement[r]``), then the ranks.
    Checks that they agree, resume at the newest complete verified step they can read
    (I4), load the saved state (I1) and - after a single node loss - lose no more than
    I5 allows (``bound``). ``sleep``: the trainers' pause per step (default the run's)."""
    first = run.job is None
    if first:
        run.job = run.site.new_job()
    assert run.job is not None
    run.site.run_hooks("prolog", list(dict.fromkeys(placement)), run.job, run.restart)
    run.tracker.observe(f"before start on {','.join(placement)}")
    readable = [f"local:{n}" for n in dict.fromkeys(placement)] + ["pfs"]
    expected = run.tracker.newest_complete(readable)
    reached = _reached(run)
    workers = []
    for rank, node in enumerate(placement):
        workers.append(
            run.site.worker(
                node, run.job, run.key, run.restart,
                steps=run.steps, interval=run.interval, size=run.size, seed=run.seed,
                sleep=run.sleep if sleep is None else sleep, rank=rank, world_size=WORLD,
                partner_host="127.0.0.1", progress=_progress(run, rank),
            )
        )  # fmt: skip
    got: Set[Optional[int]] = set()
    for rank, w in enumerate(workers):
        m = w.wait_for(r"^(START fresh|RESUMED step=(\d+) tier=(\S+) digest=(\S+))$", 120)
        if m is None:
            run.check(False, f"rank {rank} exited before starting:\n{w.tail()}")
            continue
        step = None if m.group(2) is None else int(m.group(2))
        got.add(step)
        if step is not None:
            run.check(
                m.group(4) == run.ref[step],
                f"I1 restart of rank {rank}: state loaded for step {step} differs from the saved",
            )
    if not first:
        run.check(len(got) == 1, f"I4 ranks resumed at different steps {sorted(got, key=str)}")
        step = min((s or 0) for s in got) if got else None
        run.check(
            got == {expected},
            f"I4 restart {when}: resumed at {sorted(got, key=str)}, newest complete verified "
            f"step readable {expected}",
        )
        if bound is not None:
            run.tracker.check_node_loss(step, bound, reached, when)
        run.result.notes.append(
            f"restart {when}: reached {reached}, I5 bound {bound}, resumed at "
            f"{sorted(got, key=str)} (newest complete on the PFS now: "
            f"{run.tracker.newest_complete(['pfs'])})"
        )
        run.result.restarts += 1
        run.result.lost.append(max(0, reached - (step or 0)))
    return workers


def lose_node(run: Run, workers: List[Worker], lost: List[str], placement: List[str]) -> None:
    """The job's node(s) ``lost`` die mid-job: their ranks die first, then SLURM kills
    the others; every listing is checked (I1) before the lost disks go, then SLURM marks
    the lost nodes DOWN."""
    order = sorted(range(len(workers)), key=lambda r: placement[r] not in lost)
    for r in order:
        workers[r].kill(signal.SIGKILL)
    for w in workers:
        w.finish()
    run.fault("trainer SIGKILL", len(workers))
    run.restart += 1
    run.graceful = False
    run.tracker.observe(f"node(s) {','.join(lost)} lost")
    run.result.notes.append(
        f"loss of {','.join(lost)} at step {_reached(run)}: newest complete on the PFS "
        f"{run.tracker.newest_complete(['pfs'])}"
    )


def wipe(run: Run, nodes: List[str]) -> None:
    for node in nodes:
        run.site.wipe_local(node)
        run.tracker.lost_tiers.add(f"local:{node}")
        run.site.node_down(node)


def epilog(run: Run, node: str) -> None:
    """The epilog of a surviving node; afterwards every checkpoint it held is on the PFS
    (I3), the lost owner's partner copies included - or the stager finishes."""
    committed = {k: run.tracker.committed_local(node, k) for k in KEYS}
    assert run.job is not None
    run.site.run_hook("epilog", node, run.job, run.restart)
    run.tracker.observe(f"after epilog on {node}")
    owed = False
    for key in KEYS:
        if not run.tracker.check_flushed(node, key, committed[key], f"after epilog on {node}"):
            owed = True
    if owed:
        run.result.drains += 1
        run.key, saved = KEYS[0], run.key
        try:
            for key in KEYS:
                run.key = key
                run.stager(node, committed[key])
        finally:
            run.key = saved


def finish_ranks(run: Run, node: str, bound: Optional[int], when: str) -> None:
    """The requeued job: both ranks on ``node`` until the training completes; the final
    state must equal the uninterrupted run's. No fault strikes it: it trains at the
    campaign's pace (SLEEP), not the slower one the ring needed to form before the fault."""
    workers = start_ranks(run, [node, node], bound, when, sleep=SLEEP)
    for rank, w in enumerate(workers):
        w.finish(timeout=300)
        done = w.wait_for(r"^DONE step=(\d+) digest=(\S+)$", 1)
        run.check(
            done is not None
            and int(done.group(1)) == run.steps
            and done.group(2) == run.ref[run.steps],
            f"rank {rank}: final state differs from the uninterrupted run:\n{w.tail()}",
        )
    run.tracker.observe(f"job end on {node}")
    assert run.job is not None
    run.site.run_hook("epilog", node, run.job, run.restart)
    run.tracker.observe(f"after epilog on {node}")


def _run_until_fault(run: Run, a: str, b: str) -> List[Worker]:
    """Start the job on A and B; return once partner copies flow (the first one is
    committed on the partner) and a random number of steps more have passed."""
    workers = start_ranks(run, [a, b])
    m = workers[0].wait_for(r"^(PARTNERED|DONE) step=(\d+)", 120)
    if m is None or m.group(1) != "PARTNERED":
        run.check(False, f"no partner copy before the job ended:\n{workers[0].tail()}")
    target = min(run.steps - 1, _reached(run) + run.rng.randint(1, 3 * run.interval))
    deadline = time.monotonic() + 60
    while _reached(run) < target and time.monotonic() < deadline:
        if any(w.proc.poll() is not None for w in workers):
            break
        time.sleep(0.01)
    return workers


def _lose_first_node(run: Run, a: str, b: str) -> Optional[int]:
    """Train until the fault point, then lose node ``a`` with its disk while its partner
    ``b`` survives; returns the newest step whose every shard survives on ``b`` or the
    PFS (I5's bound)."""
    workers = _run_until_fault(run, a, b)
    lose_node(run, workers, [a], [a, b])
    bound = run.tracker.surviving({f"local:{b}", "pfs"})
    wipe(run, [a])
    run.fault("node loss (partner survives)")
    return bound


@scenario("partner-node-loss", partner_site)
def partner_node_loss(run: Run) -> None:
    """Node A is lost mid-job with its disk; its partner B survives. B's epilog flushes
    A's partner copies (A is DOWN); the requeued job resumes at the newest step whose
    partner copy was committed, or newer (I5)."""
    a, b, c = list(run.site.local)
    bound = _lose_first_node(run, a, b)
    epilog(run, b)
    finish_ranks(run, c, bound, f"after losing {a}")


@scenario("partner-both-lost", partner_site)
def partner_both_lost(run: Run) -> None:
    """A and its partner B are both lost with their disks (no epilog anywhere): the
    requeued job falls back to the newest step complete and verified on the PFS, and
    loads nothing wrong (I1)."""
    a, b, c = list(run.site.local)
    workers = _run_until_fault(run, a, b)
    lose_node(run, workers, [a, b], [a, b])
    warm = run.tracker.surviving({"pfs"})
    wipe(run, [a, b])
    run.fault("node loss (partner lost too)")
    finish_ranks(run, c, warm, f"after losing {a} and {b}")


@scenario("partner-corrupt", partner_site)
def partner_corrupt(run: Run) -> None:
    """A bit flip (or truncation) in one of B's partner copies of A's shard, then A is
    lost: the damaged copy is never flushed nor restored; the restart falls back to the
    newest step intact everywhere (I5 over the intact copies)."""
    a, b, c = list(run.site.local)
    workers = _run_until_fault(run, a, b)
    lose_node(run, workers, [a], [a, b])
    snap = run.tracker.last[KEYS[0]].get(f"local:{b}", {})
    steps = sorted(s for s, ok in snap.items() if ok)
    if steps:
        step = run.rng.choice(steps[-2:])
        run.key, saved = KEYS[0], run.key
        try:
            _damage_one(run, f"local:{b}", step)  # records the damage (I1 knows)
        finally:
            run.key = saved
        run.fault("partner copy damaged")
    bound = run.tracker.surviving({f"local:{b}", "pfs"})
    wipe(run, [a])
    run.fault("node loss (partner survives)")
    epilog(run, b)
    finish_ranks(run, c, bound, f"after losing {a} (damaged partner copy)")


def partner_slow(site: FaultSite) -> Dict[str, Any]:
    # 2 MB/s for 0.5 MB per shard: a partner copy is on the wire most of the time
    return partner_site(site, "2MB/s")


@scenario("partner-copy-killed", partner_slow)
def partner_copy_killed(run: Run) -> None:
    """A node is lost while partner copies are on the wire (capped bandwidth): its
    sender and its receiver die mid-transfer. No partial partner copy is listed on
    either disk (I1, checked before the lost disk goes); the survivor's epilog flushes
    what it holds and the restart resumes at the newest committed partner step (I5)."""
    a, b, c = list(run.site.local)
    workers = _run_until_fault(run, a, b)
    lost = run.rng.choice([a, b])
    survivor = b if lost == a else a
    lose_node(run, workers, [lost], [a, b])
    if _partials(run.site, survivor):
        run.fault("half-received partner copy at the loss")
    bound = run.tracker.surviving({f"local:{survivor}", "pfs"})
    wipe(run, [lost])
    run.fault("node loss during a partner copy")
    epilog(run, survivor)
    finish_ranks(run, c, bound, f"after losing {lost} mid-copy")


def _partials(site: FaultSite, node: str) -> bool:
    root = site.local[node] / USER
    return any(
        p.name.startswith(".") and "step-" in p.name
        for key in KEYS
        if (root / key).is_dir()
        for p in (root / key).iterdir()
    )


@scenario("partner-spare-lost", partner_site)
def partner_spare_lost(run: Run) -> None:
    """Node A is lost; the step is relaunched inside the allocation on the survivor B
    plus the spare C (``ckpt-srun --spares``): rank 0 on C fetches its shard from B's
    partner copy. C dies during that recovery (before its rank resumed, or just after),
    with its disk. No half-fetched copy is ever listed on C (I1, checked before its disk
    goes); with no spare left the job is requeued onto B, whose epilog first flushes
    what it holds, and resumes no older than the newest step whose every shard survived
    on B or the PFS (I5 for the second loss, I4 and I1 as always)."""
    a, b, c = list(run.site.local)
    first = _lose_first_node(run, a, b)
    assert run.job is not None
    # ckpt-srun relaunches the step in the same allocation: no requeue (the restart count
    # stays), SLURM_CKPT_RELAUNCH=1 (a new launch: a new ring; a rank on a spare fetches).
    inside = run.restart - 1
    reached = _reached(run)
    # The ranks agree on the step as torch.distributed's jobs do (a min over the ranks):
    # without it a rank sees only steps whose every shard is on one tier it can read.
    agree_dir = run.site.out / f"{run.key}.agree.{run.restart}"
    agree_dir.mkdir()
    shutil.chown(agree_dir, USER, USER)
    run.site.run_hook("prolog", c, run.job, inside)  # the spare's, at the job's start
    relaunched = [
        run.site.worker(
            node, run.job, run.key, inside,
            steps=run.steps, interval=run.interval, size=run.size, seed=run.seed,
            sleep=run.sleep, rank=rank, world_size=WORLD, partner_host="127.0.0.1",
            progress=_progress(run, rank), agree_dir=agree_dir,
            env={"SLURM_CKPT_RELAUNCH": "1", "CAMPAIGN_LOG": "1"},
        )
        for rank, node in enumerate([c, b])
    ]  # fmt: skip
    run.result.restarts += 1
    # The spare dies while its rank fetches and restores, or right after it resumed.
    if run.rng.random() < 0.5:
        m = relaunched[0].wait_for(r"^(START fresh|RESUMED step=(\d+) tier=(\S+) digest=(\S+))$")
        if m is None:
            run.check(False, f"rank 0 on the spare exited before starting:\n{relaunched[0].tail()}")
        elif m.group(2) is not None:
            run.check(
                m.group(4) == run.ref[int(m.group(2))],
                f"I1 relaunch on the spare: state loaded for step {m.group(2)} differs",
            )
            run.check(
                int(m.group(2)) >= (first or 0),
                f"I5 relaunch on the spare: resumed at {m.group(2)}, the newest step "
                f"whose every shard survived on {b} or the PFS was {first}:\n"
                f"{relaunched[0].tail()}\n{relaunched[1].tail()}",
            )
            run.result.notes.append(f"spare {c} resumed at {m.group(2)} from {m.group(3)}")
            run.result.lost.append(max(0, reached - int(m.group(2))))
    else:
        time.sleep(run.rng.uniform(0.0, 0.5))
    lose_node(run, relaunched, [c], [c, b])
    run.restart = inside + 1  # the requeue that follows is the job's first
    if _partials(run.site, c):
        run.fault("half-fetched copy on the spare at its loss")
    bound = run.tracker.surviving({f"local:{b}", "pfs"})
    wipe(run, [c])
    run.fault("spare lost during recovery")
    epilog(run, b)  # no spare left: the job ends on B and is requeued
    finish_ranks(run, b, bound, f"after losing {a}, then the spare {c}")
