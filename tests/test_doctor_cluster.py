"""``ckpt-slurm doctor`` on the real dev cluster, run inside a node's mount namespace as a
compute node's admin would: clean on the good setup (hooks from ``install-hooks``, the dev
cluster's slurm.conf), and it finds a deliberately broken setting (a PrologEpilogTimeout
too short for hooks.budget, an epilog script that is not executable): exit 1 for those,
0 when clean. Also: a job learns its end time from squeue."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from helpers.cluster import DevCluster
from test_cluster_e2e import CKPT_SLURM, E2E, PY, hooked_site

from slurm_ckpt.slurm.records import parse_time

pytestmark = pytest.mark.root

NODE = "n1"


@pytest.fixture(scope="module")
def e2e(slurm_cluster: DevCluster) -> Iterator[E2E]:
    with hooked_site(E2E(slurm_cluster)) as e:
        yield e


def _doctor(e: E2E, node: str = NODE) -> Tuple[int, Dict[str, Any]]:
    pid = (e.c.state_dir / "run" / f"slurmd-{node}.pid").read_text().strip()
    env = dict(e.c.env, SLURM_CKPT_CONFIG=str(e.config))
    proc = subprocess.run(
        ["nsenter", "-t", pid, "-m", "--", str(CKPT_SLURM), "doctor", "--json", "--node", node],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _errors(doc: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [f for f in doc["findings"] if f["severity"] == "error"]


def test_doctor_is_clean_on_a_good_setup_and_finds_broken_settings(e2e: E2E) -> None:
    e, c = e2e, e2e.c
    e.ensure_hooks()
    rc, doc = _doctor(e)
    assert rc == 0 and not _errors(doc), _errors(doc)
    checks = {f["check"]: f["severity"] for f in doc["findings"]}
    for name in ("prolog_epilog_timeout", "prolog_hook", "epilog_hook", "tier_local", "tier_pfs"):
        assert checks.get(name) == "ok", (name, doc["findings"])
    # The dev cluster preempts by REQUEUE without send_user_signal: a warning, with its fix.
    assert checks.get("preempt_signal") == "warn"

    # 1. PrologEpilogTimeout shorter than hooks.budget (20 s) + the hooks' grace.
    short = e.dir / "short-timeout.conf"
    short.write_text("PrologEpilogTimeout=25\n")
    c.up(prolog=str(e.hooks / "prolog"), epilog=str(e.hooks / "epilog"), extra_conf=str(short))
    try:
        assert "PrologEpilogTimeout" in c.run(["scontrol", "show", "config"]).stdout
        rc, doc = _doctor(e)
        bad = _errors(doc)
        assert rc == 1 and [f["check"] for f in bad] == ["prolog_epilog_timeout"], bad
        assert "PrologEpilogTimeout=25" in bad[0]["message"] and bad[0]["fix"]
    finally:
        c.up(prolog=str(e.hooks / "prolog"), epilog=str(e.hooks / "epilog"))

    # 2. The epilog script is not executable (slurmd would fail it and drain the node).
    epilog = e.hooks / "epilog"
    os.chmod(epilog, 0o644)
    try:
        rc, doc = _doctor(e)
        bad = _errors(doc)
        assert rc == 1 and [f["check"] for f in bad] == ["epilog_hook"], bad
        assert "not executable" in bad[0]["message"] and bad[0]["fix"].startswith("chmod 755")
    finally:
        os.chmod(epilog, 0o755)
    rc, doc = _doctor(e)
    assert rc == 0 and not _errors(doc)


END_TIME_JOB = """
env -u SLURM_JOB_END_TIME {py} -c '
import os
from slurm_ckpt.slurm.client import job_end_time_provider
env = dict(os.environ)
env.pop("SLURM_JOB_END_TIME", None)
print("END", job_end_time_provider(os.environ["SLURM_JOB_ID"], environ=env)())
'
"""


def test_the_job_learns_its_end_time_from_squeue(e2e: E2E) -> None:
    """Without SLURM_JOB_END_TIME the Checkpointer's provider asks the controller."""
    e, c = e2e, e2e.c
    e.ensure_hooks()
    jobid = e.job(END_TIME_JOB.format(py=PY), args=["-w", "n2", "--time=7"])
    info = c.wait_job_state(jobid, "COMPLETED", timeout=120)
    lines = [ln for ln in c.job_output(jobid).splitlines() if ln.startswith("END ")]
    assert lines, c.job_output(jobid)
    got = float(lines[0].split()[1])
    start = parse_time(info["StartTime"])
    assert start is not None and abs(got - (start + 7 * 60)) <= 1.0, (got, info["StartTime"])
