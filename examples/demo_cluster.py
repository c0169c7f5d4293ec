#!/usr/bin/env python3
"""The cluster demo: a real training job preempted on a real SLURM cluster, and resumed.

Run as root (``scripts/demo`` runs it after ``scripts/setup``). It tells, as it goes:

1. brings up the dev cluster (``scripts/dev-cluster``: 3 nodes, each with its own
   node-local disk, one shared PFS, partitions ``low``/``high`` where ``high`` preempts
   ``low`` by requeue) with the slurm_ckpt site hooks installed by
   ``ckpt-slurm install-hooks``; the site config lives under the dev-cluster state
   directory: local tier = the node-local disk, PFS tier = a directory on the PFS;
2. submits ``examples/train_tiny.py`` (PyTorch, AdamW, LR schedule, RNG and data position
   all checkpointed through ``slurm_ckpt.Checkpointer``) under ``ckpt-srun`` as the
   unprivileged ``ckptuser1`` in ``low``, and waits for its first checkpoint;
3. preempts it with a ``high`` job: SLURM sends SIGTERM, the trainer saves at the next
   step, the epilog flushes, SLURM requeues the job under the same id;
4. shows the restart: the step it resumed from, the tier it read, the steps lost;
5. waits for the end and compares the final weights with an uninterrupted run (bitwise);
6. prints ``ckpt-slurm status``.

Why a copy of the trainer: the job user must be able to read it (a checkout under
``/root`` is not readable), and next to the copy there is no ``slurm_ckpt`` source tree,
so the job imports the package installed in the venv - the same code the hooks run.

The cluster is left running with the demo's hooks, for ``ckpt-slurm status`` and friends
(``eval "$(scripts/dev-cluster env)"``; the config is printed at the end).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, NoReturn, Optional, TypeVar

REPO = Path(__file__).resolve().parents[1]
DEV_CLUSTER = REPO / "scripts" / "dev-cluster"
VENV = Path(os.environ.get("SLURM_CKPT_VENV", "/opt/slurm-ckpt/venv"))
PY = VENV / "bin" / "python"
CKPT_SLURM = VENV / "bin" / "ckpt-slurm"
CKPT_SRUN = VENV / "bin" / "ckpt-srun"
KEY = "tiny-demo"
USER, OTHER = "ckptuser1", "ckptuser2"
# Small and slow on purpose: about 10 s of training per run on a 2-core machine, so that
# the preemption lands in the middle of it.
STEPS, INTERVAL, SLEEP = 100, 10, 0.1

T0 = time.monotonic()
T = TypeVar("T")


def say(msg: str = "") -> None:
    """One line of the narrative, with the time since the start."""
    stamp = f"[{time.monotonic() - T0:5.1f}s] " if msg else ""
    print(f"{stamp}{msg}", flush=True)


def detail(text: str) -> None:
    """Indented evidence (log lines, command output) under a narrative line."""
    for line in text.rstrip("\n").splitlines():
        print(f"           | {line}", flush=True)


def fail(msg: str) -> NoReturn:
    print(f"demo_cluster: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def run(
    argv: List[str],
    env: Optional[Dict[str, str]] = None,
    user: Optional[str] = None,
    cwd: Optional[Path] = None,
    check: bool = True,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """A command (as ``user`` via runuser, which keeps our environment)."""
    if user is not None:
        argv = ["runuser", "-u", user, "--", *argv]
    proc = subprocess.run(
        argv,
        env=env,
        cwd=None if cwd is None else str(cwd),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        fail(f"{shlex.join(argv)} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc


def wait_for(pred: Callable[[], Optional[T]], timeout: float, what: str) -> T:
    """Poll ``pred`` (5 times a second) until it returns something; that value."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


class Cluster:
    """The dev cluster as seen from the host: paths and a client environment."""

    def __init__(self) -> None:
        self.env: Dict[str, str] = {}
        self.refresh()

    def refresh(self) -> None:
        out = run(["bash", str(DEV_CLUSTER), "env"]).stdout
        exported = {}
        for line in out.splitlines():
            if line.startswith("export "):
                k, _, v = line[len("export ") :].partition("=")
                exported[k] = shlex.split(v)[0] if v else ""
        self.state = Path(exported["DEV_CLUSTER_DIR"])
        self.local_path = Path(exported["DEV_CLUSTER_LOCAL_PATH"])
        self.pfs = Path(exported["DEV_CLUSTER_PFS_PATH"])
        self.nodes = [f"n{i}" for i in range(1, int(exported["DEV_CLUSTER_NODES"]) + 1)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        env.update(exported)
        self.env = env

    def up(self, prolog: Optional[Path] = None, epilog: Optional[Path] = None) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEV_CLUSTER_")}
        if prolog and epilog:
            env.update(DEV_CLUSTER_PROLOG=str(prolog), DEV_CLUSTER_EPILOG=str(epilog))
        proc = run(["bash", str(DEV_CLUSTER), "up"], env=env, timeout=900)
        self.refresh()
        return proc.stderr

    def is_up(self) -> bool:
        return run(["bash", str(DEV_CLUSTER), "status"], check=False).returncode == 0

    def job(self, jobid: str) -> Dict[str, str]:
        """``scontrol -o show job`` as a dict ({} once SLURM forgot the job)."""
        proc = run(["scontrol", "-o", "show", "job", jobid], env=self.env, check=False)
        info: Dict[str, str] = {}
        key = None
        for tok in proc.stdout.strip().split(" ") if proc.returncode == 0 else []:
            k, eq, v = tok.partition("=")
            if eq and k.replace("/", "").replace(":", "").isalnum():
                key, info[k] = k, v
            elif key is not None:
                info[key] += " " + tok
        return info

    def node_reason(self, node: str) -> str:
        proc = run(["sinfo", "-h", "-n", node, "-o", "%E"], env=self.env, check=False)
        return proc.stdout.strip()


def config_text(local_root: Path, pfs_root: Path) -> str:
    return f"""\
# slurm_ckpt site config of the cluster demo (examples/demo_cluster.py)
[tiers.local]
root = "{local_root}"   # each node's own disk (a different filesystem on each node)
min_free = "32MiB"

[tiers.pfs]
root = "{pfs_root}"     # shared by all nodes

[retention]
keep_local = 2

[hooks]
budget = "30s"

[copy]
chunk_size = "4MiB"
streams = 2
"""


def batch_script(demo: Path, cfg: Path) -> str:
    train = demo / "examples" / "train_tiny.py"
    out = demo / "out"
    return f"""\
#!/bin/bash
#SBATCH --job-name={KEY}
#SBATCH --partition=low
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}/{KEY}-%j.out
export SLURM_CKPT_CONFIG={cfg}
echo "RUN job=$SLURM_JOB_ID restart=${{SLURM_RESTART_COUNT:-0}} node=$SLURMD_NODENAME"
exec {CKPT_SRUN} --key {KEY} --warn 0 -- -n1 \\
    {PY} {train} --key {KEY} --steps {STEPS} --interval-steps {INTERVAL} \\
    --sleep-per-step {SLEEP} --quiet-steps \\
    --progress-file {out}/{KEY}.progress --digest-out {out}/{KEY}.digest
"""


def clean_previous_run(c: Cluster, pfs_root: Path) -> None:
    """A rerun starts from scratch: no old job, checkpoint or drain of the demo's."""
    run(["scancel", "-u", USER, "-n", KEY], env=c.env, check=False)
    wait_for(
        lambda: (
            None
            if run(["squeue", "-h", "-u", USER, "-n", KEY], env=c.env, check=False).stdout.strip()
            else True
        ),
        60,
        "old demo jobs to leave the queue",
    )
    shutil.rmtree(pfs_root / USER / KEY, ignore_errors=True)
    for node in c.nodes:
        shutil.rmtree(c.state / "nodes" / node / "nvme" / USER / KEY, ignore_errors=True)
        if c.node_reason(node).startswith("slurm_ckpt:"):
            run(["scontrol", "update", f"nodename={node}", "state=resume"], env=c.env)


def hook_lines(log: Path, jobid: str) -> List[str]:
    try:
        text = log.read_text()
    except FileNotFoundError:
        return []
    return [ln for ln in text.splitlines() if f" job {jobid}: " in ln and " job " in ln]


def main() -> int:
    if os.geteuid() != 0:
        fail("run as root: the dev cluster needs packages, mounts and daemons")
    for exe in (PY, CKPT_SLURM, CKPT_SRUN):
        if not exe.exists():
            fail(f"{exe} missing: run scripts/setup first")

    say("== slurm_ckpt on a real SLURM cluster: preemption, requeue, resume ==")
    c = Cluster()
    if not c.is_up():
        say("starting the dev cluster (first time: installs SLURM and munge)")
        c.up()
    demo = c.state / "demo"
    for d in (demo, demo / "examples", demo / "hooks"):
        d.mkdir(mode=0o755, exist_ok=True)
    out = demo / "out"
    out.mkdir(mode=0o755, exist_ok=True)
    shutil.chown(out, USER, USER)
    cfg = demo / "config.toml"
    pfs_root = c.pfs / "slurm-ckpt-demo"
    cfg.write_text(config_text(c.local_path, pfs_root))
    log = demo / "hooks.log"
    res = run(
        [
            str(CKPT_SLURM),
            "install-hooks",
            "--dest",
            str(demo / "hooks"),
            "--config",
            str(cfg),
            "--log-file",
            str(log),
        ],
        env=c.env,
    )
    say("site hooks installed (ckpt-slurm install-hooks):")
    detail(res.stdout)
    c.up(demo / "hooks" / "prolog", demo / "hooks" / "epilog")
    pfs_root.mkdir(exist_ok=True)
    os.chmod(pfs_root, 0o1777)
    say(
        f"cluster up: nodes {','.join(c.nodes)}; local tier {c.local_path} (per node), "
        f"PFS tier {pfs_root}; config {cfg}"
    )
    clean_previous_run(c, pfs_root)

    # The trainer, readable by the job user, importing the installed package.
    train = demo / "examples" / "train_tiny.py"
    shutil.copyfile(REPO / "examples" / "train_tiny.py", train)
    os.chmod(train, 0o644)
    for f in out.iterdir():
        f.unlink()
    # The uninterrupted reference, outside SLURM, while the cluster job runs.
    ref_dir = demo / "reference"
    ref_dir.mkdir(mode=0o755, exist_ok=True)
    ref = subprocess.Popen(
        [
            str(PY),
            str(train),
            "--no-ckpt",
            "--key",
            KEY,
            "--steps",
            str(STEPS),
            "--quiet-steps",
            "--digest-out",
            str(ref_dir / "digest"),
        ],
        cwd=str(ref_dir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )

    script = demo / "train.sbatch"
    script.write_text(batch_script(demo, cfg))
    os.chmod(script, 0o644)
    jobid = run(["sbatch", "--parsable", str(script)], env=c.env, user=USER, cwd=out).stdout
    jobid = jobid.strip().split(";")[0]
    output = out / f"{KEY}-{jobid}.out"
    say(f"{USER} submitted job {jobid} to 'low': ckpt-srun -> train_tiny.py, {STEPS} steps,")
    say(f"  a checkpoint every {INTERVAL} steps (local first, then verified onto the PFS)")

    def text() -> str:
        try:
            return output.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def epilogs(n: int) -> Optional[List[str]]:
        lines = [ln for ln in hook_lines(log, jobid) if " epilog " in ln]
        return lines if len(lines) >= n else None

    def job_alive_then(pattern: str) -> Callable[[], Optional[re.Match]]:
        def check() -> Optional[re.Match]:
            m = re.search(pattern, text(), re.M)
            if m is None and c.job(jobid).get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT"):
                fail(f"job {jobid} ended: {c.job(jobid).get('JobState')}\n{text()}")
            return m

        return check

    wait_for(job_alive_then(r"^RUN job=\d+ restart=0 node=(\S+)$"), 120, "the job to start")
    node = re.search(r"^RUN job=\d+ restart=0 node=(\S+)$", text(), re.M).group(1)  # type: ignore[union-attr]
    say(f"job {jobid} is running on {node}")
    m = wait_for(job_alive_then(r"^COMMITTED step=(\d+)$"), 120, "the first checkpoint")
    say(f"checkpoint of step {m.group(1)} committed on {node}'s local disk")
    m = wait_for(job_alive_then(r"^FLUSHED step=(\d+)$"), 60, "the first flush")
    say(f"... and copied, verified, to the PFS (step {m.group(1)})")

    high = run(
        ["sbatch", "--parsable", "-p", "high", "-w", node, "--exclusive", "--wrap", "sleep 2"],
        env=c.env,
        user=OTHER,
        cwd=c.state / "jobs",
    ).stdout.strip()
    say(f"{OTHER} submits job {high} to 'high', asking for all of {node}: it preempts {jobid}")

    def requeued() -> Optional[Dict[str, str]]:
        info = c.job(jobid)
        if info.get("Restarts") == "1" and info.get("JobState") == "PENDING":
            return info
        return None

    info = wait_for(requeued, 60, f"job {jobid} to be requeued")
    m = re.search(r"^PREEMPTED step=(\d+)$", text(), re.M)
    saved = m.group(1) if m else "?"
    say(f"SIGTERM reached the trainer: it saved step {saved} at once and exited")
    for ln in text().splitlines():
        if "DUE TO PREEMPTION" in ln or ln.startswith(("PREEMPTED", "ckpt-srun: flush")):
            detail(ln)
    epilog = wait_for(lambda: epilogs(1), 60, "the epilog")[0]
    say("the epilog ran on the node (nothing may stay only on a node's disk):")
    detail(epilog.split(": ", 1)[-1])
    say(
        f"SLURM requeued it: still job {info['JobId']}, Restarts={info['Restarts']}, "
        f"state {info['JobState']} (reason {info.get('Reason')})"
    )

    m = wait_for(job_alive_then(r"^RUN job=(\d+) restart=1 node=(\S+)$"), 120, "the restart")
    say(f"job {m.group(1)} restarted (restart 1) on {m.group(2)}")
    r = wait_for(
        job_alive_then(r"^RESUMED step=(\d+) reached=(\S+) lost=(\S+) tier=(\S+) "),
        120,
        "the resume",
    )
    step, reached, lost, tier = r.groups()
    where = "the node's local disk (no PFS read)" if tier == "local" else "the PFS"
    say(f"RESUMED from step {step}, read from tier '{tier}' = {where}")
    say(f"  the first run had reached step {reached}: steps lost = {lost}")

    def finished() -> Optional[Dict[str, str]]:
        info = c.job(jobid)
        state = info.get("JobState")
        if state in ("FAILED", "CANCELLED", "TIMEOUT"):
            fail(f"job {jobid} ended {state}:\n{text()}")
        return info if state == "COMPLETED" else None

    wait_for(finished, 180, f"job {jobid} to finish")
    d = re.search(r"^DONE step=(\d+) digest=([0-9a-f]+)$", text(), re.M)
    if d is None:
        fail(f"no DONE line in the output:\n{text()}")
    ref.wait(timeout=300)
    want = (ref_dir / "digest").read_text().strip()
    say(f"job {jobid} COMPLETED at step {d.group(1)}")
    say(f"  weights digest  {d.group(2)[:32]}...")
    say(f"  uninterrupted   {want[:32]}...  (same run without SLURM or checkpoints)")
    say(f"  bitwise equal: {'YES' if d.group(2) == want else 'NO'}")
    wait_for(lambda: epilogs(2), 60, "the last epilog")

    # Its tables are as wide as a terminal; captured here, tell it how wide to be.
    width = max(120, shutil.get_terminal_size((120, 24)).columns)
    env = dict(c.env, COLUMNS=str(width))
    status = run([str(CKPT_SLURM), "--config", str(cfg), "status"], env=env, check=False)
    say("ckpt-slurm status:")
    print(status.stdout.rstrip() or status.stderr.rstrip(), flush=True)
    say(f"done in {time.monotonic() - T0:.0f}s. The cluster stays up with the demo's hooks:")
    say(f'  eval "$({DEV_CLUSTER} env)"; export SLURM_CKPT_CONFIG={cfg}')
    say(f"  {CKPT_SLURM} list {KEY} --user {USER} --tier pfs")
    say(f"  the job's whole output: {output}")
    return 0 if d.group(2) == want else 1


if __name__ == "__main__":
    sys.exit(main())
