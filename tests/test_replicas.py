"""Replicas agree before a step counts (issue 34, item 1), on this machine.

Data-parallel replicas must hold bit-identical weights; at every save they compare the
xxh3-128 digests the save computed anyway (``Checkpointer(replicas=True)``). The cases,
with real DDP ranks over gloo (tests/replica_worker.py):

* one rank's parameter gets one bit flipped in memory between two saves: that step (and
  the later ones: the flip stays) is ``suspect``, naming that rank and its node; the
  job is told on its training thread (``on_suspect``) and stops; the restore passes over
  the suspect steps and takes the one before the flip; ``list``, ``status``, the event
  log (``replicas_suspect``) and the metrics textfile (``slurm_ckpt_suspect_steps_total``)
  show it;
* without a flip, 200 saves in a row are compared and none is ever suspect;
* the verdict itself (pure): majority, a two-way tie, HSDP's several replica sets, a
  rank that wrote nothing; and HSDP's form on a real 2 x 2 device mesh
  (``replicas=(mesh, "replicate")``: two replica sets, compared apart);
* the ``last_healthy`` pin: an automatic restore passes over the steps after it, in the
  process and, once a later manifest records it, in the next run.

The same flip on two real nodes of the SLURM dev cluster: tests/test_cluster_replicas.py.
"""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from helpers.cli import ckpt_slurm
from helpers.metrics import one_sample
from test_torch_distributed import free_port

from slurm_ckpt import Checkpointer
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.replicas import (
    ReplicaRecord,
    compare,
    not_automatic,
    suspect_of,
    verdict_meta,
)
from slurm_ckpt.errors import CkptError
from slurm_ckpt.ledger import Ledger
from slurm_ckpt.ledger.events import read_events
from slurm_ckpt.ledger.metrics import TEXTFILE_NAME, refresh_textfile

WORKER = Path(__file__).with_name("replica_worker.py")
USER = getpass.getuser()


def _rec(rank: int, digest: str, rset: int = 0, step: int = 5) -> ReplicaRecord:
    return ReplicaRecord(rank, f"n{rank}", rset, step, {"data-0000.bin": digest})


# -- the verdict ------------------------------------------------------------------------
def test_agreeing_replicas_are_not_suspect() -> None:
    v = compare(5, [_rec(r, "a" * 32) for r in range(4)])
    assert (v.suspect, v.checked, v.skipped) == (False, 1, None)


def test_the_rank_that_differs_from_the_majority_is_named() -> None:
    v = compare(5, [_rec(0, "a" * 32), _rec(1, "b" * 32), _rec(2, "a" * 32)])
    assert v.suspect and v.ranks == [1] and v.nodes == ["n1"] and v.files == ["data-0000.bin"]
    meta = verdict_meta(v)
    assert suspect_of({"replicas": meta}) == ([1], ["n1"])
    assert "rank(s) 1 on n1" in (not_automatic(5, {"replicas": meta}, 0.0, None) or "")


def test_a_tie_names_every_replica() -> None:
    v = compare(5, [_rec(0, "a" * 32), _rec(1, "b" * 32)])
    assert v.suspect and v.ranks == [0, 1]


def test_hsdp_replica_sets_are_compared_apart() -> None:
    # two shards (sets 0 and 1), two replicas each: different shards differ, as they must
    recs = [_rec(0, "a" * 32, 0), _rec(2, "a" * 32, 0), _rec(1, "c" * 32, 1), _rec(3, "c" * 32, 1)]
    v = compare(5, recs)
    assert (v.suspect, v.checked) == (False, 2)
    recs[3] = _rec(3, "d" * 32, 1)
    v = compare(5, recs)
    assert v.suspect and v.ranks == [1, 3]  # a tie inside set 1; set 0 is fine


def test_no_verdict_when_a_rank_wrote_nothing_or_saved_another_step() -> None:
    gone = ReplicaRecord(1, "n1", 0, 5, None)
    v = compare(5, [_rec(0, "a" * 32), gone])
    assert not v.suspect and "rank(s) 1 wrote no checkpoint" in (v.skipped or "")
    v = compare(5, [_rec(0, "a" * 32), _rec(1, "a" * 32, step=6)])
    assert not v.suspect and "other steps" in (v.skipped or "")


def test_a_manifest_cannot_smuggle_text_into_the_listing() -> None:
    meta = {"replicas": {"suspect": True, "ranks": [1, "x"], "nodes": ["n1", "evil\nline"]}}
    assert suspect_of(meta) == ([1], ["n1"])
    assert suspect_of({"replicas": {"suspect": "yes"}}) is None


# -- real DDP ranks ------------------------------------------------------------------------
def _job(tmp: Path, world: int, *args: str, timeout: float = 600) -> List[str]:
    """``world`` ranks of the worker, as torchrun would start them; each rank's output."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), "--local", str(tmp / "nvme"), "--warm"]
                + [str(tmp / "warm"), "--node", f"node{rank}", *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        finally:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * world, "\n=====\n".join(outs)
    return outs


def _lines(out: str, prefix: str) -> List[str]:
    return [ln for ln in out.splitlines() if ln.startswith(prefix)]


def _manifest_meta(root: Path, key: str, step: int) -> Dict:
    m = root / USER / key / f"step-{step:010d}" / "manifest.json"
    return json.loads(m.read_text())["meta"]


def _suspect_metric(textfile: Path) -> float:
    return one_sample(textfile, "slurm_ckpt_suspect_steps_total")


def test_a_flipped_bit_makes_the_step_suspect_and_the_restore_takes_the_previous(
    tmp_path: Path,
) -> None:
    prom = tmp_path / "prom"  # the site's [metrics] textfile_dir
    outs = _job(tmp_path, 3, "--key", "run", "--steps", "30", "--flip-at", "6", "--flip-rank", "1",
                "--stop-on-suspect", "--prom", str(prom))  # fmt: skip
    assert _lines(outs[1], "FLIPPED ") == ["FLIPPED step=6"]
    for out in outs:
        told = _lines(out, "SUSPECT ")
        # the job heard of it on its training thread, naming rank 1 and its node
        assert told and told[0] == "SUSPECT step=6 ranks=1 nodes=node1", out
        assert _lines(out, "STOPPED "), out  # ... and stopped (every rank at one step)
    # every rank's manifest of step 6 records the verdict; step 5 was compared and fine
    for rank in range(3):
        key = f"run.rank{rank:05d}"
        rep = _manifest_meta(tmp_path / "nvme", key, 6)["replicas"]
        assert rep["suspect"] is True and rep["ranks"] == [1] and rep["nodes"] == ["node1"]
        assert _manifest_meta(tmp_path / "nvme", key, 5)["replicas"] == {
            "checked": 1,
            "suspect": False,
        }
    # the event log has the verdict of step 6 from every rank, and no other step before it
    events = list(read_events(tmp_path / "nvme" / ".slurm_ckpt" / "events.jsonl"))
    suspect = [e for e in events if e["type"] == "replicas_suspect"]
    assert {e["node"] for e in suspect if e["step"] == 6} == {"node0", "node1", "node2"}, suspect
    for e in suspect:
        assert e["step"] >= 6 and (e["ranks"], e["nodes"]) == ([1], ["node1"]), e
    # ... and the metrics textfile the job refreshed counts them (prometheus' own parser):
    # once per step, not once per rank (every rank emitted each step's verdict).
    # Three processes rewrite one file: the last writer may have read the event summary
    # just before another rank's event, so the job's file says at least one; the same
    # textfile rebuilt now from the same ledger and events says exactly how many.
    assert _suspect_metric(prom / TEXTFILE_NAME) >= 1
    nvme = tmp_path / "nvme"
    cfg = Config.standalone(nvme, tmp_path / "warm", metrics={"textfile_dir": str(prom)})
    refresh_textfile(Ledger(nvme / ".slurm_ckpt", "node0"), cfg)
    steps = {e["step"] for e in suspect}
    assert len(suspect) >= 3 * len(steps)  # three ranks' events of each step ...
    assert _suspect_metric(prom / TEXTFILE_NAME) == len(steps)  # ... one count each
    # the restore passes over the suspect steps on every rank: the step before the flip
    outs = _job(tmp_path, 3, "--key", "run", "--restore-only")
    for out in outs:
        assert _lines(out, "RESUMED ")[0].startswith("RESUMED step=5 "), out
        assert "passing over step 6: suspect" in out
    # list says so (text: the reason column; JSON: a field), and status warns
    flags = ["--local", str(tmp_path / "nvme"), "--warm", str(tmp_path / "warm")]
    r = ckpt_slurm("list", "run", "--json", *flags)
    rows = json.loads(r.stdout)["checkpoints"]
    bad = {x["step"] for x in rows if x["suspect"]}
    assert 6 in bad and 5 not in bad, rows
    r = ckpt_slurm("list", "run.rank00000", *flags)
    line6 = next(ln for ln in r.stdout.splitlines() if " 6 " in ln and "local" in ln)
    assert "suspect: replicas differ" in line6, r.stdout
    line5 = next(ln for ln in r.stdout.splitlines() if " 5 " in ln and "local" in ln)
    assert "suspect" not in line5, r.stdout
    r = ckpt_slurm("status", "--no-slurm", *flags)
    assert "suspect: replicas differ, rank(s) 1 on node1" in r.stdout + r.stderr, r.stdout
    # ckpt-slurm restore without --step is an automatic choice too: it passes over them
    back = tmp_path / "back"
    r = ckpt_slurm("restore", "run.rank00001", "--to", str(back), "--json", *flags)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["step"] == 5, r.stdout
    assert "warning: passing over step 6: suspect: replicas differ, rank(s) 1 on node1" in r.stderr
    r = ckpt_slurm("restore", "run.rank00001", "--step", "6", "--to", str(back), "--json", *flags)
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == 6, r.stdout + r.stderr


def test_two_replicas_that_differ_are_both_named_and_the_job_can_choose_an_exception(
    tmp_path: Path,
) -> None:
    outs = _job(tmp_path, 2, "--key", "pair", "--steps", "30", "--flip-at", "3", "--flip-rank",
                "0", "--stop-on-suspect", "--raise")  # fmt: skip
    for out in outs:
        # no majority between two: nobody can tell which is right, both are named
        assert _lines(out, "RAISED ")[0] == "RAISED step=3 ranks=[0, 1]", out
        assert _lines(out, "STOPPED "), out
    got = _job(tmp_path, 2, "--key", "pair", "--restore-only")
    assert all(_lines(o, "RESUMED ")[0].startswith("RESUMED step=2 ") for o in got), got


def test_hsdp_replicate_dimension_of_a_real_device_mesh(tmp_path: Path) -> None:
    """``replicas=(device_mesh, "replicate")`` on a real 2 x 2 mesh: ranks 0 and 2 are one
    replica set, 1 and 3 the other. Rank 3's flip makes its set disagree (two replicas:
    both named); the other set is compared apart and is fine."""
    outs = _job(tmp_path, 4, "--key", "hsdp", "--steps", "30", "--flip-at", "4", "--flip-rank",
                "3", "--stop-on-suspect", "--mesh", "--hidden", "16")  # fmt: skip
    for out in outs:
        told = _lines(out, "SUSPECT ")
        assert told and told[0] == "SUSPECT step=4 ranks=1,3 nodes=node1,node3", out
    for rank in range(4):
        key = f"hsdp.rank{rank:05d}"
        rep = _manifest_meta(tmp_path / "nvme", key, 4)["replicas"]
        assert rep["suspect"] is True and rep["ranks"] == [1, 3], rep
        assert _manifest_meta(tmp_path / "nvme", key, 3)["replicas"] == {
            "checked": 2,
            "suspect": False,
        }


def test_200_saves_without_a_flip_are_never_suspect(tmp_path: Path) -> None:
    outs = _job(tmp_path, 2, "--key", "calm", "--steps", "201", "--hidden", "16")
    for out in outs:
        done = _lines(out, "DONE ")
        # every save compared (201 steps: saves at steps 1..200), none suspect
        assert done == ["DONE step=200 saves=200 checks=200 suspect_steps=0 told=0"], out
        assert "suspect" not in out.replace("suspect_steps=0", "")
    for rank in range(2):
        kdir = tmp_path / "nvme" / USER / f"calm.rank{rank:05d}"
        steps = sorted(int(d.name[5:]) for d in kdir.iterdir() if d.name.startswith("step-"))
        assert len(steps) >= 100  # --keep-local 1000: what retention left of 200
        for s in steps:
            meta = _manifest_meta(tmp_path / "nvme", f"calm.rank{rank:05d}", s)
            assert meta["replicas"] == {"checked": 1, "suspect": False}


def test_replicas_without_a_process_group_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(CkptError, match="needs torch.distributed initialised"):
        Checkpointer(local=str(tmp_path / "l"), key="k", replicas=True, install_signals=False)
    with pytest.raises(CkptError, match="replicated must be"):
        Checkpointer(local=str(tmp_path / "l"), key="k", replicated="some")
    with pytest.raises(CkptError, match="on_suspect must be"):
        Checkpointer(local=str(tmp_path / "l"), key="k", on_suspect=3)


# -- the last_healthy pin --------------------------------------------------------------------
def _ckpt(tmp: Path) -> Checkpointer:
    return Checkpointer(
        local=str(tmp / "l"), key="spiky", keep_local=20, interval_steps=1, install_signals=False
    )


def _save_five(ck: Checkpointer) -> None:
    import torch

    for step in range(1, 6):
        ck.save({"model": {"w": torch.full((4,), float(step))}}, step=step)
        ck.wait()


def test_restore_honours_the_last_healthy_pin(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path)
    _save_five(ck)
    with pytest.raises(CkptError, match="whole number"):
        ck.pin_last_healthy(-1)
    ck.pin_last_healthy(2)  # a loss spike found after step 5: 3..5 are bad
    assert ck.last_healthy == 2
    got = ck.restore()
    assert got is not None and got.step == 2 and float(got.state["model"]["w"][0]) == 2.0
    got = ck.restore(step=4)  # asked for by number: still readable
    assert got is not None and got.step == 4
    ck.close()


def test_a_later_run_honours_the_pin_a_manifest_recorded(tmp_path: Path) -> None:
    import torch

    ck = _ckpt(tmp_path)
    _save_five(ck)
    ck.pin_last_healthy(2)
    ck.save({"model": {"w": torch.full((4,), 6.0)}}, step=6)  # saved after the pin: counts
    ck.close()
    assert _manifest_meta(tmp_path / "l", "spiky", 6)["last_healthy"]["step"] == 2
    # the next run: damage step 6, and the restore must fall back past the steps the pin
    # put out (3..5: without the pin it would take 5) to 2
    blob = next((tmp_path / "l" / USER / "spiky" / "step-0000000006").rglob("data-*.bin"))
    data = bytearray(blob.read_bytes())
    data[0] ^= 1
    blob.write_bytes(bytes(data))
    ck2 = _ckpt(tmp_path)
    got = ck2.restore()
    ck2.close()
    assert got is not None and got.step == 2
    # ... and so does ckpt-slurm restore without --step (the pin from step 6's manifest)
    r = ckpt_slurm("restore", "spiky", "--to", str(tmp_path / "back"), "--json", "--local",
                   str(tmp_path / "l"))  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == 2, r.stdout + r.stderr
    assert "passing over step 5: after the last healthy step 2 (pinned)" in r.stderr, r.stderr


def test_replica_sets_from_rank_lists() -> None:
    from slurm_ckpt.job.replicas import replica_set_of

    hsdp = [[0, 2], [1, 3]]  # two shards, each replicated on two ranks
    assert [replica_set_of(hsdp, r, 4) for r in range(4)] == [0, 1, 0, 1]
    assert replica_set_of(True, 3, 4) == 0
    for spec, match in (
        ([[0, 1], [1, 2]], "two replica sets"),
        ([[0, 1]], "rank 3 is in no replica set"),
        ([[0, 9]], "not a list of ranks"),
        ("all", "must be True"),
    ):
        with pytest.raises(CkptError, match=match):
            replica_set_of(spec, 3, 4)
