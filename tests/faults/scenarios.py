"""The campaign's scenarios: which fault strikes, where and when (seeded random timing).

Each scenario is a ``setup(site) -> params`` (filesystems and config of the run) and a
``body(run)`` that drives jobs through :class:`~tests.faults.campaign.Run`, whose steps
check the invariants. Every body ends with :meth:`Run.finish`: the training must complete
and equal the uninterrupted run, whatever happened on the way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from tests.faults.campaign import Run
from tests.faults.site import USER, FaultSite

Setup = Callable[[FaultSite], Dict[str, Any]]
Body = Callable[[Run], None]
SCENARIOS: Dict[str, Tuple[Setup, Body]] = {}
#: One checkpoint (two 256 KiB arrays plus index and manifest), for filling disks.
CKPT_BYTES = 2 * (1 << 18) + 8192


def scenario(name: str, setup: Optional[Setup] = None) -> Callable[[Body], Body]:
    def deco(body: Body) -> Body:
        SCENARIOS[name] = (setup or plain, body)
        return body

    return deco


def plain(site: FaultSite, **config: Dict[str, Any]) -> Dict[str, Any]:
    site.add_node("tmpfs")
    site.set_pfs("loop", 64)
    site.configure(**config)
    return {}


def node0(run: Run) -> str:
    return next(iter(run.site.local))


def random_step(run: Run, lo: int = 1, span: int = 3) -> int:
    """A step a little ahead of where the trainer is (span intervals at most)."""
    here = run.site.reached(run.key)
    return min(run.steps - 1, here + run.rng.randint(lo, max(lo, span * run.interval)))


def interrupted_job(run: Run, node: str, sig: int = signal.SIGKILL, **kw: Any) -> set:
    """Start (or restart) the trainer, interrupt it at a random step, run the epilog."""
    w = run.start(node, **kw)
    if run.wait_step(w, random_step(run)):
        run.interrupt(w, sig)
    return run.end_job(node, w)


def descendants(pid: int) -> List[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    kids = [int(x) for x in fh.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


# --------------------------------------------------------------------------- kills


@scenario("trainer-sigkill")
def trainer_sigkill(run: Run) -> None:
    node = node0(run)
    for _ in range(run.rng.randint(1, 3)):
        owed = interrupted_job(run, node)
        if owed:
            run.stager(node, owed)
    run.finish(node)


@scenario("trainer-sigterm")
def trainer_sigterm(run: Run) -> None:
    node = node0(run)
    for _ in range(run.rng.randint(1, 2)):
        owed = interrupted_job(run, node, signal.SIGTERM)
        if owed:
            run.stager(node, owed)
    run.finish(node)


@scenario("persist-or-flush-sigkill")
def background_io_sigkill(run: Run) -> None:
    """The trainer dies (SIGKILL) at a random crash point of its background threads: in
    the middle of writing a checkpoint locally or of copying one to the PFS."""
    node = node0(run)
    log = run.site.out / "crash.log"
    for _ in range(run.rng.randint(1, 2)):
        target = run.rng.randint(1, 160)
        w = run.start(node, crash_at=target, crash_log=log)
        rc = w.finish()
        if rc == -signal.SIGKILL:
            label = log.read_text().splitlines()[-1].split()[1]
            run.fault(
                "persist SIGKILL"
                if label.startswith(("writer", "commit"))
                else "flush SIGKILL"
                if label.startswith("copy")
                else f"SIGKILL at {label}"
            )
            run.restart += 1
            run.graceful = False
        owed = run.end_job(node, w)
        if owed:
            run.stager(node, owed)
        if rc == 0:
            return
    run.finish(node)


def slow_pfs(site: FaultSite, bandwidth: str = "1MB/s", budget: str = "2s") -> Dict[str, Any]:
    return plain(
        site,
        tiers_pfs={"bandwidth_limit": bandwidth},
        hooks={"budget": budget},
        retention={"flush_every": 1000},
    )


@scenario("epilog-sigkill", lambda s: slow_pfs(s, "500kB/s", "20s"))
def epilog_sigkill(run: Run) -> None:
    """SIGKILL of the epilog while it copies (slow PFS): either of the tool alone (the
    hook script drains the node with our reason) or of the whole hook (as slurmd does at
    PrologEpilogTimeout). The stager daemon finishes the work."""
    node = node0(run)
    w = run.start(node)
    if run.wait_step(w, random_step(run, run.interval * 2, 4)):
        run.interrupt(w)
    w.finish()
    run.tracker.observe("job end")
    committed = run.tracker.committed_local(node, run.key)
    assert run.job is not None
    hook = run.site.hook("epilog", node, run.job, run.restart)
    time.sleep(run.rng.uniform(0.2, 2.0))
    if hook.poll() is None:
        # the hook script -> timeout -> ckpt-slurm -> its copies running as the user
        inner = [p for p in descendants(hook.pid) if _is_python(p)]
        pick = run.rng.random()
        if inner and pick < 0.4:
            os.kill(inner[0], signal.SIGKILL)
            run.fault("epilog SIGKILL (ckpt-slurm)")
        elif len(inner) > 1 and pick < 0.7:
            os.kill(run.rng.choice(inner[1:]), signal.SIGKILL)
            run.fault("epilog SIGKILL (its copy, as the user)")
        else:
            os.killpg(hook.pid, signal.SIGKILL)
            run.fault("epilog SIGKILL (whole hook)")
    hook.wait()
    run.tracker.observe("after killed epilog")
    run.stager(node, committed)
    run.finish(node)


def _is_python(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().startswith(("python", "ckpt-slurm"))
    except OSError:
        return False


@scenario("stager-sigkill", lambda s: slow_pfs(s, "1MB/s", "1s"))
def stager_sigkill(run: Run) -> None:
    """The epilog hands the backlog to the stager (slow PFS, 1 s budget); the stager is
    SIGKILLed mid-pass and started again."""
    node = node0(run)
    w = run.start(node)
    if run.wait_step(w, random_step(run, run.interval * 2, 4)):
        run.interrupt(w)
    owed = run.end_job(node, w)
    run.stager(node, owed, kill_after=run.rng.uniform(0.2, 2.0))
    run.finish(node)


@scenario("slow-pfs", lambda s: slow_pfs(s, "800kB/s", "2s"))
def slow_pfs_body(run: Run) -> None:
    """Flushes lag behind saves (0.8 MB/s for ~0.5 MB per checkpoint, one every 0.1 s):
    skipped flushes, the epilog hands off, the stager finishes."""
    node = node0(run)
    run.fault("bandwidth-capped PFS")
    for _ in range(run.rng.randint(1, 2)):
        owed = interrupted_job(run, node, run.rng.choice([signal.SIGKILL, signal.SIGTERM]))
        if owed:
            run.stager(node, owed)
    run.finish(node)


# --------------------------------------------------------------------------- disks


def _fill(root: Path, leave: int) -> Path:
    """Fill a filesystem (as root) until ``leave`` bytes are free."""
    filler = root / f".filler-{os.getpid()}"
    st = os.statvfs(root)
    size = max(0, st.f_bavail * st.f_frsize - leave)
    with open(filler, "wb") as fh:
        chunk = b"\0" * (1 << 20)
        while size > 0:
            try:
                size -= fh.write(chunk[: min(size, len(chunk))])
            except OSError:
                break
    return filler


def _enospc(run: Run, where: str) -> None:
    node = node0(run)
    root = run.site.local[node] if where == "local" else run.site.pfs
    assert root is not None
    w = run.start(node)
    filler = None
    if run.wait_step(w, random_step(run, 2, 2)):
        filler = _fill(root, run.rng.randint(0, int(CKPT_BYTES * 1.5)))
        run.fault(f"ENOSPC on the {where} tier")
        run.wait_step(w, random_step(run, 2, 3))
        if w.proc.poll() is None:
            run.interrupt(w, run.rng.choice([signal.SIGKILL, signal.SIGTERM]))
    owed = run.end_job(node, w)
    if filler is not None:
        filler.unlink()
    if owed:
        run.stager(node, owed)
    run.finish(node)


@scenario("enospc-local", lambda s: _disk(s, local="loop", local_mb=12))
def enospc_local(run: Run) -> None:
    _enospc(run, "local")


@scenario("enospc-pfs", lambda s: _disk(s, pfs_mb=24))
def enospc_pfs(run: Run) -> None:
    _enospc(run, "pfs")


def _disk(
    site: FaultSite, local: str = "tmpfs", local_mb: int = 64, pfs: str = "loop", pfs_mb: int = 64
) -> Dict[str, Any]:
    site.add_node(local, local_mb)
    site.set_pfs(pfs, pfs_mb)
    site.configure(tiers_local={"min_free": 0})
    return {}


def _eio(run: Run, where: str) -> None:
    node = node0(run)
    name = f"local-{node}" if where == "local" else "pfs"
    ops = ["write", "fsync", "create", "rename", "mkdir", "read", "fallocate"]
    w = run.start(node)
    if run.wait_step(w, random_step(run, 2, 2)):
        chosen = run.rng.sample(ops, run.rng.randint(1, 3))
        prob = run.rng.choice([0.05, 0.3, 1.0])
        seed = run.rng.randint(0, 9)
        run.site.fuse_rules(name, [{"ops": chosen, "errno": 5, "prob": prob}], seed)
        run.wait_step(w, random_step(run, 2, 3))
        if w.proc.poll() is None:
            run.interrupt(w, run.rng.choice([signal.SIGKILL, signal.SIGTERM]))
        # Reads come back for the epilog (a disk that cannot be read at all when the job
        # ends has nothing left to save, and the checker must read the tiers); the
        # failing writes, syncs and renames stay.
        writes = [op for op in chosen if op != "read"]
        run.site.fuse_rules(name, [{"ops": writes, "errno": 5, "prob": prob}] if writes else [])
    w.finish()
    owed = run.end_job(node, w)
    run.site.fuse_rules(name, [])
    if owed:
        run.stager(node, owed)
    if where == "local" and run.rng.random() < 0.5:
        # The restart's reads of local checkpoints fail: it must take the PFS copies.
        before = run.site.fuse_hits(name)
        run.site.fuse_rules(name, [{"ops": ["read"], "match": "/step-", "errno": 5}])
        run.tracker.unreadable.add(f"local:{node}")
        run.graceful = False  # with its local copy unreadable, a restart may lose work
        w = run.start(node)
        run.site.fuse_rules(name, [])
        run.fault("EIO on restore reads", run.site.fuse_hits(name) - before)
        run.tracker.unreadable.discard(f"local:{node}")
        run.restart += 1
        w.finish()
        done = w.wait_for(r"^DONE ", 1) is not None
        owed = run.end_job(node, w)
        if owed:
            run.stager(node, owed)
        if done:
            run.fault(f"EIO on the {where} tier", before)
            return
    run.fault(f"EIO on the {where} tier", run.site.fuse_hits(name))
    run.finish(node)


@scenario("eio-local", lambda s: _disk(s, local="fuse"))
def eio_local(run: Run) -> None:
    _eio(run, "local")


@scenario("eio-pfs", lambda s: _disk(s, pfs="fuse"))
def eio_pfs(run: Run) -> None:
    _eio(run, "pfs")


# --------------------------------------------------------------------------- damage


@scenario("damage")
def damage(run: Run) -> None:
    """Bit flips and truncation in committed files (payload, index or manifest) of a
    random step, on one tier or on every tier, between two jobs."""
    node = node0(run)
    for _ in range(run.rng.randint(1, 2)):
        owed = interrupted_job(run, node, run.rng.choice([signal.SIGKILL, signal.SIGTERM]))
        if owed:
            run.stager(node, owed)
        snap = run.tracker.observe("before damage")[run.key]
        tiers = {tid: [s for s, ok in steps.items() if ok] for tid, steps in snap.items()}
        steps = sorted({s for v in tiers.values() for s in v})
        if not steps:
            continue
        step = run.rng.choice(steps[-2:])
        holders = [t for t, v in tiers.items() if step in v]
        where = [run.rng.choice(holders)] if run.rng.random() < 0.6 else holders
        for tid in where:
            _damage_one(run, tid, step)
        if step == steps[-1] and set(where) == set(holders):
            run.graceful = False  # every copy of the newest step is damaged: work is lost
    run.finish(node)


def _damage_one(run: Run, tid: str, step: int) -> None:
    tier = run.site.tiers()[tid]
    sdir = Path(tier.root) / USER / run.key / f"step-{step:010d}"
    files = sorted(p for p in sdir.rglob("*") if p.is_file())
    victim = run.rng.choice(files)
    size = victim.stat().st_size
    if run.rng.random() < 0.5 and size:
        with open(victim, "r+b") as fh:
            pos = run.rng.randrange(size)
            fh.seek(pos)
            b = fh.read(1)
            fh.seek(pos)
            fh.write(bytes([b[0] ^ (1 << run.rng.randrange(8))]))
        run.fault("bit flip")
    else:
        os.truncate(victim, run.rng.randrange(size) if size else 0)
        run.fault("truncation")
    run.tracker.damaged.add((tid, run.key, step))


# --------------------------------------------------------------------------- ordering


def two_nodes(site: FaultSite, **config: Dict[str, Any]) -> Dict[str, Any]:
    site.add_node("tmpfs")
    site.add_node("tmpfs")
    site.set_pfs("loop", 64)
    site.configure(**config)
    return {}


@scenario("same-key", two_nodes)
def same_key(run: Run) -> None:
    """A second job starts on another node with the key a live job is training (a sweep
    that kept the default key, a job launched twice): one writer per series, so the
    second stops at construction with one line naming the first, through the lease the
    first keeps on the shared warm tier, and touches nothing. The first goes on, may be
    killed, and a restart loads an intact state."""
    a, b = list(run.site.local)
    run.fault("two jobs, one key")
    # Slow steps (10 s in all): the first is still training when the second, started
    # after its first save, gets to construction, even on a loaded machine.
    wa = run.start(a, sleep=0.25)
    job_a = run.job
    if run.wait_step(wa, 1):  # the first has saved: its lease is on the warm tier
        run.start(b, new_job=True, refused=True, holder=wa)
    run.job = job_a
    if run.rng.random() < 0.5 and run.wait_step(wa, random_step(run)):
        wa.kill(signal.SIGKILL)
    wa.finish()
    run.tracker.observe("the job ended")
    run.end_job(a, wa)
    run.restart += 1
    run.graceful = False
    run.finish(a)


@scenario(
    "requeue-racing-epilog",
    lambda s: two_nodes(s, tiers_pfs={"bandwidth_limit": "2MB/s"}, retention={"flush_every": 1000}),
)
def requeue_racing_epilog(run: Run) -> None:
    """The job dies on node A; SLURM requeues it onto node B while A's epilog is still
    copying A's checkpoints to the PFS (slow PFS): B must never see a half-copied step,
    and nothing A held may be lost."""
    a, b = list(run.site.local)
    w = run.start(a)
    if run.wait_step(w, random_step(run, 2 * run.interval, 4)):
        run.interrupt(w)
    w.finish()
    run.tracker.observe("job end on A")
    committed = run.tracker.committed_local(a, run.key)
    assert run.job is not None
    epilog = run.site.hook("epilog", a, run.job, run.restart - 1)
    time.sleep(run.rng.uniform(0.0, 1.0))
    run.fault("requeue racing the epilog")
    run.site.run_hook("prolog", b, run.job, run.restart)
    wb = run.site.worker(
        b,
        run.job,
        run.key,
        run.restart,
        steps=run.steps,
        interval=run.interval,
        size=run.size,
        seed=run.seed,
        sleep=run.sleep,
    )
    m = wb.wait_for(r"^(START fresh|RESUMED step=(\d+) tier=\S+ digest=(\S+))$", 60)
    if m is not None and m.group(2) is not None:
        got = int(m.group(2))
        run.check(m.group(3) == run.ref[got], f"I1 racing restart loaded a wrong state at {got}")
        run.result.restarts += 1
        run.result.lost.append(max(0, run.site.reached(run.key) - got))
    epilog.wait(timeout=120)
    run.tracker.check_flushed(a, run.key, committed, "after the racing epilog on A")  # I3
    wb.finish(timeout=300)
    run.end_job(b, wb)
    run.tracker.observe("after both")
    missing = run.tracker.unflushed(a, run.key, committed)
    if missing:
        run.stager(a, committed)
    run.finish(b)


@scenario("stale-locks")
def stale_locks(run: Run) -> None:
    """Locks and temp files left by dead processes: a root process and a user process
    that held the ledger and step locks die by SIGKILL with temp files half written; a
    killed copy leaves a .partial-step on the PFS. Hooks and the restart go on."""
    node = node0(run)
    owed = interrupted_job(run, node)
    if owed:
        run.stager(node, owed)
    _plant_stale(run, node)
    owed = interrupted_job(run, node)
    if owed:
        run.stager(node, owed)
    run.finish(node)


_HOLDER = """\
import os, signal, sys, fcntl
from filelock import FileLock
for path in sys.argv[1:]:
    if path.endswith(".lock") or "/.lock-" in path:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    else:
        with open(path, "wb") as fh:
            fh.write(b"half written")
print("held", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _plant_stale(run: Run, node: str) -> None:
    from slurm_ckpt.core.layout import lock_name, partial_dirname
    from tests.faults.site import PY

    local = run.site.local[node]
    udir = local / USER
    steps = sorted(run.tracker.committed_local(node, run.key)) or [0]
    key_dir = udir / run.key
    as_root = [
        str(local / ".slurm_ckpt" / "ledger.lock"),
        str(local / ".slurm_ckpt" / f"ledger.json.tmp-{os.getpid()}-dead"),
    ]
    as_user = [
        str(udir / ".slurm_ckpt" / "ledger.lock"),
        str(key_dir / lock_name(steps[-1])),
        str(udir / ".slurm_ckpt" / f"ledger.json.tmp-{os.getpid()}-dead"),
    ]
    holder = run.site.base / "holder.py"
    holder.write_text(_HOLDER)
    os.chmod(holder, 0o644)
    for paths, user in ((as_root, None), (as_user, USER)):
        paths = [p for p in paths if Path(p).parent.is_dir()]
        subprocess.run(
            [str(PY), str(holder), *paths], user=user, capture_output=True, timeout=60, check=False
        )
    pfs_key = Path(str(run.site.pfs)) / USER / run.key
    if pfs_key.is_dir():
        part = pfs_key / partial_dirname(steps[-1] + run.interval)
        part.mkdir(exist_ok=True)
        (part / "junk.bin").write_bytes(os.urandom(1000))
        for p in (part, part / "junk.bin"):
            os.chown(p, *_ids())
    run.fault("stale locks and temp files of dead processes")


def _ids() -> Tuple[int, int]:
    import pwd

    pw = pwd.getpwnam(USER)
    return pw.pw_uid, pw.pw_gid


@scenario("clock-jump")
def clock_jump(run: Run) -> None:
    """The wall clock jumps (forwards by an hour or a day, back by an hour or five
    minutes) under the trainer and the hooks, once or twice."""
    node = node0(run)
    run.site.clock(0.0)
    for _ in range(run.rng.randint(1, 2)):
        w = run.start(node)
        if run.wait_step(w, random_step(run)):
            run.site.clock(run.rng.choice([3600.0, 86400.0, -3600.0, -300.0]))
            run.fault("clock jump")
            if run.wait_step(w, random_step(run)):
                run.interrupt(w, run.rng.choice([signal.SIGKILL, signal.SIGTERM]))
        owed = run.end_job(node, w)
        if owed:
            run.stager(node, owed)
    run.finish(node)


@scenario("node-loss", lambda s: two_nodes(s, retention={"flush_every": 3}))
def node_loss(run: Run) -> None:
    """Node A dies mid-job (no epilog); its disk is gone, or survives and A's prolog
    rescues it when A comes back. The restart on node B resumes at the newest step that
    verifies anywhere it can read (the PFS)."""
    a, b = list(run.site.local)
    w = run.start(a)
    if run.wait_step(w, random_step(run, 2 * run.interval, 4)):
        run.interrupt(w)
    w.finish()
    run.tracker.observe("node A lost")
    if run.rng.random() < 0.5:
        run.site.wipe_local(a)
        run.tracker.lost_tiers.add(f"local:{a}")
        run.fault("node loss (disk lost)")
    else:
        run.fault("node loss (disk survives)")
        committed = run.tracker.committed_local(a, run.key)
        run.site.run_hook("prolog", a, run.site.new_job(), 0)  # the next job on A
        run.tracker.observe("after A's prolog")
        run.check(
            not run.tracker.unflushed(a, run.key, committed),
            f"prolog on {a} did not rescue {sorted(committed)}",
        )
    run.finish(b)


# The partner-copy and in-job recovery scenarios register themselves.
from tests.faults import partner_scenarios, recovery_scenarios  # noqa: E402, F401
