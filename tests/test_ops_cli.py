"""Operator commands: ``drill``, ``flush``, ``guard``, ``maint`` (issue "Operator CLI" 2-4).

Real directories, real uid switching (root tests), a fake SLURM client for ``maint``'s
logic; the real-cluster ``maint`` test is in the last section.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest
from helpers import site as helper_site
from helpers.cli import run_here

from slurm_ckpt.ledger import Ledger, State, publish_status
from slurm_ckpt.node.asuser import run_as_user
from slurm_ckpt.ops import maint as maint_mod
from slurm_ckpt.tiers.posix import PosixTier

USER = "ckptuser1"


class Site(helper_site.Site):
    """The helper site, with paths under /var/tmp readable by the job user, a 1777 PFS
    root, and the user's local directory made by root as the prolog would."""

    def __init__(self, base: Path) -> None:
        super().__init__(
            base, config_name="config.toml", extra='[copy]\nchunk_size = "1MiB"\nstreams = 2\n'
        )
        self.config = self.cfg_path

    @property
    def local(self) -> Path:  # type: ignore[override]
        return self.roots["local"]

    @property
    def pfs(self) -> Path:  # type: ignore[override]
        return self.roots["pfs"]

    def cli(self, *argv: str) -> Tuple[int, str, str]:
        return run_here(["--config", str(self.config), *argv])


def _need_user() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", USER], check=True)


@pytest.fixture
def site() -> Iterator[Site]:
    _need_user()
    base = Path(tempfile.mkdtemp(prefix="sckpt-ops-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    site = Site(base)
    os.chmod(site.pfs, 0o1777)
    pw = pwd.getpwnam(USER)
    (site.local / USER).mkdir(mode=0o700)
    os.chown(site.local / USER, pw.pw_uid, pw.pw_gid)
    os.chmod(site.config, 0o644)
    try:
        yield site
    finally:
        shutil.rmtree(base, ignore_errors=True)


def state_for(step: int) -> Dict[str, Any]:
    return {
        "model": {"w": np.full(4096, step, dtype=np.float32)},
        "optimizer": {"m": np.arange(8192, dtype=np.float64) * step, "step": step},
    }


def _save_with_checkpointer(local: str, pfs: str, steps: List[int], torch: bool = False) -> None:
    from slurm_ckpt.job import Checkpointer

    ckpt = Checkpointer(local=local, warm=pfs, key="run", install_signals=False, end_time_fn=None)
    for s in steps:
        st: Dict[str, Any] = state_for(s)
        if torch:
            import torch as t

            st = {"model": {"w": t.full((64,), float(s))}, "optimizer": {"step": s}}
        ckpt.save(st, step=s, tokens=10 * s)
        assert ckpt.wait()
    ckpt.close()


def _write_plain(local: str, steps: List[int], job: str = "77") -> None:
    tier = PosixTier("local", local)
    for s in steps:
        w = tier.writer(USER, "plain", s, job=job)
        w.write_buffers({"w.bin": os.urandom(50_000)})
        w.commit()


def _as_user(fn: Any, *args: Any) -> Any:
    return run_as_user(USER, fn, *args, timeout=120)


# --------------------------------------------------------------------------- drill


def _drill_child(config: str) -> List[Any]:
    return list(run_here(["--config", config, "drill", "run", "--json"]))


def test_drill_as_user_picks_what_a_restart_picks(site: Site) -> None:
    _as_user(_save_with_checkpointer, str(site.local), str(site.pfs), [1, 2])
    code, out, err = _as_user(_drill_child, str(site.config))
    assert code == 0, err
    rep = json.loads(out)
    assert rep["ok"] and rep["step"] == 2 and rep["tier"] == "local", rep
    assert rep["payload"] == "state" and rep["tensors"] >= 2
    assert 0 < rep["time_to_weights_s"] <= rep["time_to_full_state_s"]
    # The scratch copy lived in the user's own directory and is gone again.
    assert not [n for n in os.listdir(site.local / USER) if n.startswith(".slurm_ckpt-drill")]
    # Corrupt the newest local copy: the drill skips it, as a restart would.
    blob = next((site.local / USER / "run" / "step-0000000002").rglob("data-*.bin"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    code, out, err = _as_user(_drill_child, str(site.config))
    rep = json.loads(out)
    assert code == 0 and rep["ok"], err
    assert any(s["tier"] == "local" and s["step"] == 2 for s in rep["skipped"]), rep
    assert (rep["step"], rep["tier"]) in ((2, "pfs"), (1, "local"), (1, "pfs"))


def test_drill_as_root_for_a_user_and_nothing_restorable(site: Site) -> None:
    _as_user(_write_plain, str(site.local), [3])
    code, out, err = site.cli("drill", "plain", "--user", USER, "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["ok"] and rep["step"] == 3 and rep["payload"] == "files", rep
    assert not [n for n in os.listdir(site.local) if n.startswith(".slurm_ckpt-drill")]
    scratch = site.base / "scratch"
    scratch.mkdir()
    code, out, err = site.cli("drill", "plain", "--user", USER, "--scratch", str(scratch))
    assert code == 0 and "time to full state" in out, err
    assert os.listdir(scratch) == []
    code, out, err = site.cli("drill", "nothing", "--user", USER)
    assert code == 1 and out == ""
    assert err.strip() == f"ckpt-slurm: error: no restorable checkpoint for {USER}/nothing"
    code, out, _ = site.cli("drill", "nothing", "--user", USER, "--json")
    assert code == 1 and json.loads(out)["ok"] is False


def test_drill_loads_torch_state(site: Site) -> None:
    pytest.importorskip("torch")
    local, pfs = site.base / "tl", site.base / "tp"
    local.mkdir()
    pfs.mkdir()
    _save_with_checkpointer(str(local), str(pfs), [5], torch=True)
    conf = site.base / "t.toml"
    conf.write_text(
        f'[tiers.local]\nroot = "{local}"\nrequire_mount = false\nmin_free = 0\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{pfs}"\n'
    )
    code, out, err = run_here(["--config", str(conf), "drill", "run", "--json"])
    assert code == 0, err
    rep = json.loads(out)
    assert rep["ok"] and rep["step"] == 5 and rep["load"] == "torch", rep


# --------------------------------------------------------------------------- flush


def _flush_child(config: str) -> List[Any]:
    return list(run_here(["--config", config, "flush", "--node", "tnode", "--json"]))


def test_flush_as_user_copies_own_checkpoints(site: Site) -> None:
    _as_user(_write_plain, str(site.local), [1, 2])
    code, out, err = _as_user(_flush_child, str(site.config))
    assert code == 0, err
    rep = json.loads(out)
    assert [f["step"] for f in rep["flushed"]] == [1, 2] and rep["ok"], rep
    pfs = site.tier("pfs")
    assert [s.step for s in pfs.steps(USER, "plain")] == [1, 2]
    assert all(pfs.verify(USER, "plain", s).ok for s in (1, 2))
    code, out, _ = _as_user(_flush_child, str(site.config))
    assert code == 0 and json.loads(out)["flushed"] == []


def test_flush_as_root_flushes_as_each_owner(site: Site) -> None:
    _as_user(_write_plain, str(site.local), [4])
    code, out, err = site.cli("flush", "--node", "tnode", "--job", "77", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert [(f["user"], f["step"]) for f in rep["flushed"]] == [(USER, 4)], rep
    pfs = site.tier("pfs")
    assert pfs.verify(USER, "plain", 4).ok
    # Written as the owner, not as root.
    step_dir = site.pfs / USER / "plain" / "step-0000000004"
    assert step_dir.stat().st_uid == pwd.getpwnam(USER).pw_uid
    rec = Ledger(site.local / ".slurm_ckpt", "tnode").get(USER, "plain", 4)
    assert rec is not None and rec.state("pfs") is State.VERIFIED
    code, out, err = site.cli("flush", "--node", "tnode")
    assert code == 0 and "flushed 0 checkpoints" in out, err


def test_flush_reports_failures_with_exit_1(site: Site) -> None:
    _as_user(_write_plain, str(site.local), [6])
    blob = site.local / USER / "plain" / "step-0000000006" / "w.bin"
    data = bytearray(blob.read_bytes())
    data[10] ^= 1
    blob.write_bytes(bytes(data))
    code, out, err = _as_user(_flush_child, str(site.config))
    rep = json.loads(out)
    assert code == 1 and rep["failed"] and rep["failed"][0]["step"] == 6, (out, err)


# --------------------------------------------------------------------------- guard


def test_guard_exit_codes_from_ledger_and_pfs_status(site: Site) -> None:
    ldir = site.local / ".slurm_ckpt"
    code, out, _ = site.cli("guard", "--node", "g1")
    assert code == 0 and "nothing known" in out
    led = Ledger(ldir, "g1")
    led.record_local_commit(USER, "run", 1, 123, 0, "9", selected_for_flush=True)
    t0 = time.monotonic()
    code, out, err = site.cli("guard", "--node", "g1", "--wait", "0.5s", "--poll", "100ms")
    assert code == 4 and out == "" and time.monotonic() - t0 >= 0.5
    assert err.startswith("ckpt-slurm: error: guard g1: 1 checkpoint (")
    assert err.count("\n") == 1
    led.mark(USER, "run", 1, "pfs", State.VERIFIED)
    code, out, _ = site.cli("guard", "--node", "g1")
    assert code == 0 and "nothing waiting" in out
    # No local ledger for this node name: its status file on the PFS decides.
    other = Ledger(site.base / "other-ledger", "g2")
    other.record_local_commit(USER, "run", 2, 10, 0, "9", selected_for_flush=True)
    shutil.rmtree(ldir)
    publish_status(other, site.pfs)
    code, _, err = site.cli("guard", "--node", "g2")
    assert code == 4 and "PFS status" in err


# --------------------------------------------------------------------------- maint (fake SLURM)


class FakeNode:
    def __init__(self, drained: bool, reason: Optional[str]) -> None:
        self.drained, self.reason = drained, reason

    @property
    def reason_is_ours(self) -> bool:
        return (self.reason or "").startswith("slurm_ckpt:")


class FakeCli:
    def __init__(self) -> None:
        self.ran: List[List[str]] = []

    def run(self, argv: List[str]) -> str:
        self.ran.append(list(argv))
        return ""


class FakeSlurm:
    def __init__(self, jobs: List[List[str]]) -> None:
        self.nodes: Dict[str, FakeNode] = {}
        self.jobs_seq = jobs  # jobs on every node, one entry per poll (last one repeats)
        self.signals: List[Tuple[str, str, bool]] = []
        self.cli = FakeCli()
        self.drains: List[Tuple[str, str]] = []
        self.on_poll: Any = None

    def node(self, n: str) -> FakeNode:
        return self.nodes.setdefault(n, FakeNode(False, None))

    def drain(self, n: str, reason: str) -> Optional[str]:
        info = self.node(n)
        if info.drained and not info.reason_is_ours:
            return None
        self.drains.append((n, reason))
        self.nodes[n] = FakeNode(True, reason)
        return reason

    def jobs_on_node(self, n: str) -> List[Tuple[str, str, str]]:
        if self.on_poll is not None:
            self.on_poll()
        jobs = self.jobs_seq.pop(0) if len(self.jobs_seq) > 1 else self.jobs_seq[0]
        return [(j, "u", "RUNNING") for j in jobs]

    def signal(self, job: str, sig: str, full: bool = False) -> None:
        self.signals.append((job, sig, full))


def test_maint_waits_for_jobs_and_fresh_status_then_acts(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSlurm([["11"], ["11"], []])
    monkeypatch.setattr(maint_mod, "client_factory", lambda: fake)
    led = Ledger(site.base / "led", "m1")
    led.record_local_commit(USER, "run", 1, 10, 0, "11", selected_for_flush=True)
    publish_status(led, site.pfs)  # older than the drain: must not count
    polls = {"n": 0}

    def poll() -> None:
        polls["n"] += 1
        if polls["n"] == 2:  # the epilog replaced our reason ...
            fake.nodes["m1"] = FakeNode(True, "slurm_ckpt: flushing 1 checkpoint (10 B)")
        if polls["n"] == 4:  # ... the stager flushed, published and resumed the node
            led.mark(USER, "run", 1, "pfs", State.VERIFIED)
            publish_status(led, site.pfs)
            fake.nodes["m1"] = FakeNode(False, None)

    fake.on_poll = poll
    marker = site.base / "did-it"
    code, out, err = site.cli(
        "maint", "m1", "--reason", "kernel update", "--signal-jobs", "--timeout", "20s",
        "--poll", "50ms", "--", "touch", str(marker),
    )  # fmt: skip
    assert code == 0, err
    assert marker.exists() and "maint m1: done" in out
    assert fake.signals == [("11", "USR1", True)]
    assert polls["n"] >= 5
    reason = "slurm_ckpt: maint: kernel update"
    assert all(r == reason for _n, r in fake.drains) and len(fake.drains) >= 3
    assert fake.nodes["m1"].drained and fake.nodes["m1"].reason == reason


def test_maint_timeout_refuses_with_exit_4_and_stays_drained(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSlurm([[]])
    monkeypatch.setattr(maint_mod, "client_factory", lambda: fake)
    marker = site.base / "did-it"
    code, out, err = site.cli(
        "maint", "m[1-2]", "--reason", "x", "--timeout", "300ms", "--poll", "50ms",
        "--", "touch", str(marker),
    )  # fmt: skip
    assert code == 4 and not marker.exists() and "maint m1" not in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("ckpt-slurm: error: maint: not safe")
    assert "no node status on the PFS yet" in last and "left drained" in last
    assert all(fake.nodes[n].reason == "slurm_ckpt: maint: x" for n in ("m1", "m2"))


@pytest.mark.parametrize(
    "args, want",
    [
        (["--reboot"], ["scontrol", "reboot", "ASAP", "nextstate=resume", "m[1-2]"]),
        (
            ["--reservation", "mw"],
            [
                "scontrol", "create", "reservation", "ReservationName=mw", "Nodes=m[1-2]",
                "StartTime=now", "Duration=infinite", "Users=root", "Flags=MAINT,IGNORE_JOBS",
            ],
        ),
    ],
)  # fmt: skip
def test_maint_slurm_actions(
    site: Site, monkeypatch: pytest.MonkeyPatch, args: List[str], want: List[str]
) -> None:
    fake = FakeSlurm([[]])
    monkeypatch.setattr(maint_mod, "client_factory", lambda: fake)
    for n in ("m1", "m2"):
        led = Ledger(site.base / f"led-{n}", n)
        publish_status(led, site.pfs)
    # statuses must be newer than the drain: publish again from inside the first poll
    fake.on_poll = lambda: [publish_status(Ledger(site.base / f"led-{n}", n), site.pfs)
                            for n in ("m1", "m2")]  # fmt: skip
    code, _, err = site.cli("maint", "m[1-2]", "--reason", "r", "--poll", "50ms", *args)
    assert code == 0, err
    assert fake.cli.ran == [want]


def test_maint_needs_exactly_one_action(site: Site) -> None:
    code, _, err = site.cli("maint", "m1", "--reason", "r")
    assert code == 2 and "exactly one action" in err
    code, _, err = site.cli("maint", "m1", "--reason", "r", "--reboot", "--", "true")
    assert code == 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
