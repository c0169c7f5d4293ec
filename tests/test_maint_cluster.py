"""``ckpt-slurm maint`` on the real dev cluster: it waits for a slow flush the epilog handed
to the stager before running its action, keeps the node drained (the stager does not
resume a maint drain), and refuses with exit 4 when the flush outlasts ``--timeout``.

Reuses the ``E2E`` helpers of test_cluster_e2e (hooks installed from the venv, a private
config and local/PFS subtree). Every wait polls SLURM, the process or the files.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Iterator

import pytest
from helpers.cluster import DevCluster
from test_cluster_e2e import CKPT_SLURM, E2E, PY, hooked_site

pytestmark = pytest.mark.root

USER = "ckptuser1"
MAINT = "slurm_ckpt: maint:"

# The maint action: records, at the moment it runs, whether the checkpoint verifies on
# the PFS (so an action run before the flush finished cannot pass the test).
MARKER = """\
import json, os, sys, time
from slurm_ckpt.tiers.posix import PosixTier
marker, root, user, key, step = sys.argv[1:6]
try:
    res = PosixTier("pfs", root).verify(user, key, int(step))
    ok, detail = bool(res.ok), str(res)
except Exception as exc:  # not there yet, half copied...
    ok, detail = False, repr(exc)
doc = {"ok": ok, "detail": detail, "nodes": os.environ.get("SLURM_CKPT_MAINT_NODES"),
       "time": time.time()}
with open(marker, "w") as f:
    json.dump(doc, f)
"""


@pytest.fixture(scope="module")
def e2e(slurm_cluster: DevCluster) -> Iterator[E2E]:
    site = E2E(slurm_cluster)
    (site.dir / "marker.py").write_text(MARKER)
    with hooked_site(site) as e:
        yield e


@pytest.fixture(autouse=True)
def _hooks_on(e2e: E2E) -> Iterator[None]:
    e2e.ensure_hooks()
    yield
    e2e.configure()


def _slow_flush(e: E2E, node: str, key: str, size: int) -> None:
    """A job on ``node`` writes one checkpoint; the capped flush does not fit the hook
    budget, so the epilog hands it to the stager and drains the node."""
    jobid = e.write_job(node, key, size, 1)
    e.c.wait_job_state(jobid, "COMPLETED", timeout=60)
    line = e.wait_hook("epilog", jobid, node)
    assert "handed" in line and "to the stager" in line, line
    e.c.wait_node_state(node, lambda s: "DRAIN" in s, timeout=30)
    reason = e.node_reason(node)
    assert reason.startswith("slurm_ckpt: flushing "), reason


def _maint(e: E2E, node: str, timeout: float, *action: str) -> subprocess.Popen:
    env = dict(e.c.env, SLURM_CKPT_CONFIG=str(e.config))
    argv = [str(CKPT_SLURM), "maint", node, "--reason", "test", "--timeout", f"{timeout}s"]
    return subprocess.Popen(
        [*argv, "--poll", "1s", "--", *action],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stager_until_flushed(e: E2E, node: str, tries: int = 5) -> str:
    out = ""
    for _ in range(tries):
        res = e.stager(node)
        out += res.stdout + res.stderr
        if res.returncode == 0 and "0 still owed" in res.stdout:
            return out
    raise AssertionError(f"stager did not finish the flush on {node}:\n{out}")


def test_maint_waits_for_the_stager_flush_then_runs_the_command(e2e: E2E) -> None:
    e = e2e
    node, key = "n2", f"maint-{e.tok}"
    marker = e.dir / "marker.json"
    # 1.5 MB at 250 kB/s: ~6 s, far over the 1 s hook budget.
    e.configure(tiers_pfs={"bandwidth_limit": "250kB/s"}, hooks={"budget": "1s"})
    proc = None
    try:
        _slow_flush(e, node, key, 1_500_000)
        assert not e.verified_on_pfs(USER, key, 1)  # not flushed yet
        proc = _maint(
            e,
            node,
            90,
            str(PY),
            str(e.dir / "marker.py"),
            str(marker),
            str(e.pfs_root),
            USER,
            key,
            "1",
        )
        # The stager must publish its status only after maint's drain began.
        e.c.wait_until(
            lambda: e.node_reason(node).startswith(MAINT) or proc.poll() is not None,
            timeout=30,
            what="maint to drain the node",
        )
        assert proc.poll() is None, proc.communicate()
        assert not marker.exists()  # still waiting for the flush
        stager_out = _stager_until_flushed(e, node)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        assert f"maint {node}: done" in out, out
        doc = json.loads(marker.read_text())
        assert doc["ok"], doc  # the action ran only once the checkpoint was on the PFS
        assert doc["nodes"] == node, doc
        assert e.verified_on_pfs(USER, key, 1)
        # The stager did not resume the node: it stays out of service for maintenance.
        assert "DRAIN" in e.c.node_state(node), stager_out
        assert e.node_reason(node) == f"{MAINT} test", e.node_reason(node)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        e.configure()
        if e.node_reason(node).startswith("slurm_ckpt:"):
            _stager_until_flushed(e, node)
            e.resume(node)


def test_maint_refuses_when_the_flush_outlasts_the_timeout(e2e: E2E) -> None:
    e = e2e
    node, key = "n3", f"late-{e.tok}"
    marker = e.dir / "never.json"
    # 1 MB at 50 kB/s: ~20 s; no stager runs while maint waits.
    e.configure(tiers_pfs={"bandwidth_limit": "50kB/s"}, hooks={"budget": "1s"})
    proc = None
    try:
        _slow_flush(e, node, key, 1_000_000)
        t0 = time.monotonic()
        proc = _maint(e, node, 3, "/bin/touch", str(marker))
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 4, out + err
        assert time.monotonic() - t0 >= 3
        assert not marker.exists()
        assert "Traceback" not in err, err
        # One error line (besides maint's own "drained ..." note), no traceback.
        lines = [ln for ln in err.splitlines() if ln.strip()]
        refusal = [ln for ln in lines if ln.startswith("ckpt-slurm: error:")]
        assert len(refusal) == 1 and "not safe after 3.0s" in refusal[0], err
        assert lines == [f"drained {node}: {MAINT} test", refusal[0]], err
        assert "waiting for" in refusal[0] and "nodes left drained" in refusal[0], err
        assert "DRAIN" in e.c.node_state(node)
        assert e.node_reason(node).startswith(MAINT), e.node_reason(node)
        assert not e.verified_on_pfs(USER, key, 1)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        # Clean up: no cap, let the stager finish the flush, return the node.
        e.configure()
        _stager_until_flushed(e, node)
        assert e.verified_on_pfs(USER, key, 1)
        if "DRAIN" in e.c.node_state(node):
            e.resume(node)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-v"]))
