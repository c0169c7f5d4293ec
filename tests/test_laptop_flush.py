"""A laptop as a first-class place to train (issue 31), as an ordinary user (ckptuser1,
with its own HOME, no SLURM, no site config, no root anywhere in the runs):

* ``Checkpointer.from_env()`` reads ``~/.config/slurm-ckpt/config.toml``, the file the
  CLI reads, and says so in a log line;
* a run killed before its flush leaves the step owed; the next run flushes it in the
  background (a laptop has no epilog), and no message mentions an epilog;
* ``flush``, ``gc`` and ``status`` take tier flags: ``gc --warm DIR`` prunes the warm
  tier, ``status --local DIR`` shows the local steps, and without ``--no-slurm`` a
  machine without SLURM gets no SLURM error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from conftest import need_root

from slurm_ckpt.tiers.posix import PosixTier

REPO = Path(__file__).resolve().parents[1]
USER = "ckptuser1"

#: The training run: from_env() with nothing but the user's config; with KILL set, the
#: process SIGKILLs itself when its first flush starts (a known point: the local copy is
#: committed, the warm copy not begun), as a laptop's lid or an OOM killer would.
RUN = r"""
import logging, os, signal, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
import numpy as np
import slurm_ckpt.core.config as core_config
core_config.DEFAULT_CONFIG_PATH = core_config.Path(sys.argv[1])  # a laptop: no site config
from slurm_ckpt import Checkpointer

kill = os.environ.get("KILL") == "1"

def on_event(name, info):
    if kill and name == "flush_start":
        print("KILLED before the flush of step", info["step"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

ckpt = Checkpointer.from_env("run", on_event=on_event, flush_policy="wait")
for step in [int(s) for s in sys.argv[2].split(",")]:
    ckpt.save({"w": np.full(1000, step, dtype=np.float32)}, step=step)
ckpt.close()
print("DONE", flush=True)
"""


@pytest.fixture
def laptop() -> Iterator[Dict[str, Path]]:
    """ckptuser1's home with ~/.config/slurm-ckpt/config.toml naming two directories."""
    need_root()
    base = Path(tempfile.mkdtemp(prefix="ckpt-laptop-flush-"))
    os.chmod(base, 0o755)
    home = base / "home"
    (home / ".config" / "slurm-ckpt").mkdir(parents=True)
    local, warm = home / "ckpt" / "local", home / "ckpt" / "warm"
    (home / ".config" / "slurm-ckpt" / "config.toml").write_text(
        f'[tiers.local]\nroot = "{local}"\nrequire_mount = false\nmin_free = 0\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{warm}"\n'  # docs/cli-laptop.md's form
    )
    for d in (local, warm):  # mkdir -p ckpt/local ckpt/warm, as the laptop guide says
        d.mkdir(parents=True, mode=0o700)
    (base / "run.py").write_text(RUN)
    subprocess.run(["chown", "-R", f"{USER}:{USER}", str(base)], check=True)
    try:
        yield {"base": base, "home": home, "local": local, "warm": warm}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_user(argv: List[str], home: Path, **env: str) -> subprocess.CompletedProcess:
    """``argv`` as ckptuser1 with only a user's environment: HOME, PATH without SLURM's
    commands, no SLURM variable, no SLURM_CKPT_CONFIG."""
    e = {
        "HOME": str(home),
        "PATH": os.path.dirname(sys.executable),  # no squeue/sinfo: a laptop
        "PYTHONPATH": str(REPO),
        "LANG": "C.UTF-8",
        **env,
    }
    return subprocess.run(
        ["runuser", "-u", USER, "--", "env", "-i", *[f"{k}={v}" for k, v in e.items()], *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(home),
    )


def ckpt_slurm(args: List[str], home: Path) -> subprocess.CompletedProcess:
    return as_user([sys.executable, "-m", "slurm_ckpt.cli.main", *args], home)


def test_a_laptop_run_killed_before_its_flush_is_flushed_by_the_next(
    laptop: Dict[str, Path],
) -> None:
    base, home, local, warm = laptop["base"], laptop["home"], laptop["local"], laptop["warm"]
    nowhere = str(base / "no-site-config.toml")
    run = [sys.executable, str(base / "run.py"), nowhere]
    cfg = home / ".config" / "slurm-ckpt" / "config.toml"

    first = as_user([*run, "100"], home, KILL="1")
    assert first.returncode == -9 or first.returncode == 137, (first.stdout, first.stderr)
    assert f"configuration: {cfg} (your own config)" in first.stdout, first.stdout
    assert "KILLED before the flush of step 100" in first.stdout
    user_local = PosixTier("local", str(local))
    user_warm = PosixTier("pfs", str(warm))
    assert [s.step for s in user_local.steps(USER, "run")] == [100]
    assert [s.step for s in user_warm.steps(USER, "run")] == []  # owed

    second = as_user([*run, "200,300,400,500,600"], home)
    out = second.stdout + second.stderr
    assert second.returncode == 0 and "DONE" in second.stdout, out
    assert "left 1 flush(es) unfinished (step(s) 100)" in out, out
    assert "epilog" not in (first.stdout + first.stderr + out).lower()
    warm_steps = [s.step for s in user_warm.steps(USER, "run")]
    assert warm_steps == [100, 200, 300, 400, 500, 600], warm_steps
    for step in warm_steps:
        user_warm.verify(USER, "run", step)  # every byte, as the flusher verified it

    # status --local DIR: the local steps (no node status on a laptop), and no SLURM
    # error without --no-slurm on a machine without SLURM.
    status = ckpt_slurm(["status", "--json", "--local", str(local), "--warm", str(warm)], home)
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    (job,) = doc["jobs"]
    assert job["tiers"]["local"]["step"] == 600 and job["tiers"]["pfs"]["step"] == 600
    assert job["steps_at_risk"] == 0
    table = ckpt_slurm(["status", "--local", str(local), "--warm", str(warm)], home)
    assert table.returncode == 0 and "SLURM" not in table.stdout + table.stderr, table
    assert "600" in table.stdout
    # status --local DIR alone (a laptop with one disk, as docs/cli-laptop.md allows): the
    # local column shows the newest local step (it ended in a KeyError traceback: no warm
    # tier, so no node-status store).
    alone = ckpt_slurm(["status", "--local", str(local)], home)
    assert alone.returncode == 0 and not alone.stderr, alone
    header, row = [ln.split() for ln in alone.stdout.splitlines()[1:3]]
    assert row[header.index("local")] == "600", alone.stdout

    # gc --warm DIR prunes the warm tier by the retention policy (keep_warm=3, plus one
    # per day), never the newest.
    gc = ckpt_slurm(["gc", "--json", "--local", str(local), "--warm", str(warm)], home)
    assert gc.returncode == 0, gc.stderr
    left = [s.step for s in user_warm.steps(USER, "run")]
    assert len(left) < len(warm_steps) and left[-3:] == [400, 500, 600], left
    assert json.loads(gc.stdout)["totals"]["deleted"] == len(warm_steps) - len(left)


def test_flush_with_tier_flags_flushes_what_a_killed_run_owes(laptop: Dict[str, Path]) -> None:
    base, home, local, warm = laptop["base"], laptop["home"], laptop["local"], laptop["warm"]
    run = [sys.executable, str(base / "run.py"), str(base / "no-site-config.toml")]
    first = as_user([*run, "7"], home, KILL="1")
    assert "KILLED before the flush of step 7" in first.stdout, (first.stdout, first.stderr)
    # --local alone names no warm tier to flush to: one line (it was an IndexError)
    alone = ckpt_slurm(["flush", "--local", str(local)], home)
    assert alone.returncode == 2 and len(alone.stderr.strip().splitlines()) == 1, alone
    assert "add --warm DIR" in alone.stderr, alone.stderr
    # nor does an archive directory: --cold is never flushed to (it was, as if warm)
    cold = home / "ckpt" / "cold"
    cold.mkdir(mode=0o700)
    shutil.chown(cold, USER, USER)
    archive = ckpt_slurm(["flush", "--local", str(local), "--cold", str(cold)], home)
    assert archive.returncode == 2 and "add --warm DIR" in archive.stderr, archive
    assert os.listdir(cold) == []
    seen = ckpt_slurm(["status", "--local", str(local), "--cold", str(cold)], home)
    assert seen.returncode == 0 and not seen.stderr, seen  # no KeyError traceback
    flush = ckpt_slurm(["flush", "--json", "--local", str(local), "--warm", str(warm)], home)
    assert flush.returncode == 0, flush.stderr
    assert [s.step for s in PosixTier("pfs", str(warm)).steps(USER, "run")] == [7]
    # The flush recorded it in the run's own ledger: the next run owes nothing.
    again = as_user([*run, "8"], home)
    assert again.returncode == 0 and "unfinished" not in again.stdout, again.stdout


def test_gc_and_flush_refuse_tier_flags_as_root(laptop: Dict[str, Path]) -> None:
    from helpers.cli import run_here

    for cmd in ("gc", "flush"):
        code, out, err = run_here([cmd, "--local", str(laptop["base"]), "--warm", "/tmp"])
        assert code == 2 and "as root" in err and len(err.strip().splitlines()) == 1, err


#: from_env() on a laptop with no configuration anywhere (no site config, no user config).
NO_CONFIG = r"""
import sys
import slurm_ckpt.core.config as core_config
core_config.DEFAULT_CONFIG_PATH = core_config.Path(sys.argv[1])  # a laptop: no site config
from slurm_ckpt import Checkpointer
from slurm_ckpt.errors import CkptError
try:
    Checkpointer.from_env("run")
except CkptError as exc:
    print("ERR", exc)
"""


def test_from_env_without_any_config_names_the_ways_out_for_a_script(
    laptop: Dict[str, Path],
) -> None:
    """Without a config, from_env()'s one error names what a training script can do: it
    said "pass --config", a flag of the command line that a script does not have."""
    base, home = laptop["base"], laptop["home"]
    (home / ".config" / "slurm-ckpt" / "config.toml").unlink()
    (base / "noconfig.py").write_text(NO_CONFIG)
    r = as_user([sys.executable, str(base / "noconfig.py"), str(base / "no-site.toml")], home)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 1 and lines[0].startswith("ERR no config: "), r
    msg = lines[0]
    assert f"no {home}/.config/slurm-ckpt/config.toml" in msg, msg
    for way in ("SLURM_CKPT_CONFIG", "config_path=", "Checkpointer(local=..., warm=..., key=...)"):
        assert way in msg, (way, msg)
    assert "--config" not in msg, msg
