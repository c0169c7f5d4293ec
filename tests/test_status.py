"""``ckpt-slurm status``: figures checked against a constructed PFS and node status files.

The PFS catalog is written with the real writer, node status files are published by real
ledgers, and SLURM is either the injectable snapshot (built by hand: states and drains
are inputs here, not behaviour under test) or, in the last test, the real dev cluster.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict

import pytest
from helpers import site as helper_site
from helpers.cli import ckpt_slurm, run_here

from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.core.manifest import manifest_facts as _facts
from slurm_ckpt.errors import VerifyError
from slurm_ckpt.ledger import Ledger, State, publish_status
from slurm_ckpt.node.partner_flush import mark_partner_copies
from slurm_ckpt.ops.catalog import scan_catalog
from slurm_ckpt.ops.status import (
    SlurmJob,
    SlurmNode,
    SlurmSnapshot,
    collect_status,
    no_slurm,
    query_slurm,
)
from slurm_ckpt.tiers.posix import PosixTier

if TYPE_CHECKING:  # a plain import would defeat pytest's assert rewriting of the plugin
    from helpers.cluster import DevCluster

REPO = Path(__file__).resolve().parents[1]
NB = 1000  # payload bytes per checkpoint


def write(tier: PosixTier, user: str, key: str, step: int, job: Any, node: Any = None) -> None:
    with tier.writer(user, key, step, job=job, node=node) as w:
        w.write_buffers({"model.bin": os.urandom(NB)})
        w.commit()


class Site(helper_site.Site):
    """A PFS (and cold tier) catalog, three nodes' status files, and the expected times."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, tiers=("local", "pfs", "cold"))
        self.cfg = self.load()
        pfs, cold = self.pfs, self.cold
        # alice/run1 (job 11): 100, 200, 300 committed; 400 is a commit in progress.
        for step in (100, 200, 300):
            write(pfs, "alice", "run1", step, 11, "n1")
        (tmp / "pfs/alice/run1" / step_dirname(400)).mkdir()
        write(cold, "alice", "run1", 100, 11, "n1")
        # alice/run2: 10 good, 20 with a damaged manifest (so 10 is its newest).
        write(pfs, "alice", "run2", 10, 13, "n2")
        write(pfs, "alice", "run2", 20, 13, "n2")
        mpath = tmp / "pfs/alice/run2" / step_dirname(20) / "manifest.json"
        mpath.write_bytes(mpath.read_bytes().replace(b'"size": 1000', b'"size": 1001'))
        # bob/exp (job 12, no node reports it) and carol/old (no job id at all).
        write(pfs, "bob", "exp", 5, 12)
        write(pfs, "carol", "old", 1, None)
        # The newest alice/run1 copy reached the PFS 10 s after its local commit.
        self.m300 = pfs.manifest("alice", "run1", 300)
        mfile = tmp / "pfs/alice/run1" / step_dirname(300) / "manifest.json"
        os.utime(mfile, (self.m300.wall_time + 10, self.m300.wall_time + 10))
        self.m10 = pfs.manifest("alice", "run2", 10)
        self.m5 = pfs.manifest("bob", "exp", 5)

        self.now = max(self.m300.wall_time, self.m10.wall_time, self.m5.wall_time) + 1000.0
        self.t_n1, self.t_n2 = self.now - 30.0, self.now - 60.0
        n1 = Ledger(tmp / "ledgers/n1", "n1", clock=lambda: self.t_n1)
        n1.record_local_commit("alice", "run1", 300, NB, 0, 11, True)
        n1.mark("alice", "run1", 300, "pfs", State.VERIFIED)
        n1.record_local_commit("alice", "run1", 400, NB, 1, 11, True)
        n1.record_local_commit("alice", "run1", 500, NB, 2, 11, True)
        n1.mark("alice", "run1", 500, "pfs", State.FLUSHING)
        publish_status(n1, tmp / "pfs")
        n2 = Ledger(tmp / "ledgers/n2", "n2", clock=lambda: self.t_n2)
        n2.record_local_commit("alice", "run2", 30, NB, 0, 13, True)
        n2.count_failure("flush_failed")
        publish_status(n2, tmp / "pfs")

    def slurm(self) -> SlurmSnapshot:
        return SlurmSnapshot(
            True,
            "test",
            jobs={
                "11": SlurmJob("11", "RUNNING", "alice", ("n1",)),
                "13": SlurmJob("13", "PENDING", "alice", ()),
            },
            nodes={
                "n1": SlurmNode("n1", "MIXED"),
                "n2": SlurmNode("n2", "IDLE+DRAIN", True, "maintenance by admin"),
                "n3": SlurmNode("n3", "IDLE+DRAIN", True, "slurm_ckpt: flushing 2 checkpoints"),
            },
        )

    def status(self, **kw: Any) -> Dict[str, Any]:
        query = kw.pop("query", self.slurm)
        return collect_status(self.cfg, query=query, now=self.now, **kw).to_json()


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def by_job(doc: Dict[str, Any]) -> Dict[Any, Dict[str, Any]]:
    return {(j["job"], j["user"]): j for j in doc["jobs"]}


def test_job_figures(site: Site) -> None:
    doc = site.status()
    jobs = by_job(doc)
    assert set(jobs) == {("11", "alice"), ("12", "bob"), ("13", "alice"), (None, "carol")}

    j = jobs[("11", "alice")]
    assert j["keys"] == ["run1"] and j["slurm_state"] == "RUNNING" and j["nodes"] == ["n1"]
    assert j["tiers"]["local"] == {"step": 500, "age_s": 30.0}
    assert j["tiers"]["pfs"] == {
        "step": 300,
        "age_s": round(site.now - site.m300.wall_time, 3),
        "bytes": NB,
        "checkpoints": 3,  # 100, 200, 300; the uncommitted 400 does not count
        "damaged": 0,  # 400 has no manifest, but it is young: a commit in progress
        "data_version": None,  # not recorded by these saves
        "suspect": None,  # replicas were not compared (tests/test_replicas.py)
    }
    assert j["tiers"]["cold"]["step"] == 100 and j["tiers"]["cold"]["checkpoints"] == 1
    assert j["steps_at_risk"] == 200  # 500 locally, 300 safe on the PFS
    assert j["checkpoints_at_risk"] == 2 and j["bytes_at_risk"] == 2 * NB
    assert j["in_flight"] == 1 and j["failed"] == 0
    assert j["flush_rate_bps"] == pytest.approx(NB / 10.0, rel=1e-3)  # 1000 B in 10 s
    assert j["flush_eta_s"] == pytest.approx(2 * NB / (NB / 10.0), rel=1e-3)

    # run2 is attributed to job 13 (its node reports it), the damaged step 20 is skipped
    # as the newest, and counted as damaged.
    j = jobs[("13", "alice")]
    assert j["keys"] == ["run2"] and j["slurm_state"] == "PENDING" and j["nodes"] == ["n2"]
    assert j["tiers"]["local"] == {"step": 30, "age_s": 60.0}
    assert j["tiers"]["pfs"]["step"] == 10 and j["tiers"]["pfs"]["checkpoints"] == 1
    assert j["tiers"]["pfs"]["damaged"] == 1 and doc["totals"]["damaged"] == 1
    assert j["tiers"]["cold"] is None
    assert j["steps_at_risk"] == 20 and j["bytes_at_risk"] == NB and j["checkpoints_at_risk"] == 1

    j = jobs[("12", "bob")]  # only on the PFS; SLURM no longer lists it
    assert j["slurm_state"] == "gone" and j["tiers"]["local"] is None and j["nodes"] == []
    assert j["steps_at_risk"] is None and j["bytes_at_risk"] == 0 and j["flush_eta_s"] == 0.0
    assert j["tiers"]["pfs"]["step"] == 5

    assert jobs[(None, "carol")]["slurm_state"] == "unknown"
    t = doc["totals"]
    assert t == {
        "jobs": 4,
        "nodes": 3,
        "steps_at_risk": 220,
        "checkpoints_at_risk": 3,
        "bytes_at_risk": 3 * NB,
        "in_flight": 1,
        "drained_by_us": 1,
        "damaged": 1,  # alice/run2 step 20 on the PFS
    }


def test_node_figures(site: Site) -> None:
    nodes = {n["node"]: n for n in site.status()["nodes"]}
    assert sorted(nodes) == ["n1", "n2", "n3"]
    n1 = nodes["n1"]
    assert n1["status_age_s"] == 30.0 and n1["slurm_state"] == "MIXED"
    assert n1["pending_checkpoints"] == 2 and n1["pending_bytes"] == 2 * NB
    assert n1["in_flight"] == 1 and not n1["drained_by_us"] and n1["drain_reason"] is None
    (flight,) = n1["in_flight_flushes"]
    assert flight == {
        "user": "alice",
        "key": "run1",
        "step": 500,
        "tier": "pfs",
        "bytes": NB,
        "running_s": 30.0,  # FLUSHING since the n1 clock, 30 s before "now"
    }
    # Drained by an admin: not ours, reason not shown as ours.
    assert nodes["n2"]["slurm_state"] == "IDLE+DRAIN"
    assert not nodes["n2"]["drained_by_us"] and nodes["n2"]["drain_reason"] is None
    # Drained by us, no status file (yet): listed so an operator sees why it is drained.
    n3 = nodes["n3"]
    assert n3["drained_by_us"] and n3["drain_reason"].startswith("slurm_ckpt:")
    assert n3["status_age_s"] is None and n3["pending_bytes"] == 0


def test_filters(site: Site) -> None:
    doc = site.status(user="bob")
    assert [(j["job"], j["keys"]) for j in doc["jobs"]] == [("12", ["exp"])]
    assert doc["nodes"] == [] and doc["filters"]["user"] == "bob"
    doc = site.status(job="11")
    assert [j["job"] for j in doc["jobs"]] == ["11"] and [n["node"] for n in doc["nodes"]] == ["n1"]
    doc = site.status(key="run2")
    assert [j["job"] for j in doc["jobs"]] == ["13"]
    doc = site.status(node="n1")
    assert [j["job"] for j in doc["jobs"]] == ["11"] and [n["node"] for n in doc["nodes"]] == ["n1"]
    doc = site.status(user="alice", key="run1")
    assert [j["job"] for j in doc["jobs"]] == ["11"]


def test_without_slurm_states_are_unknown(site: Site) -> None:
    doc = site.status(query=lambda: no_slurm("no SLURM here"))
    assert doc["slurm"] == {"available": False, "note": "no SLURM here"}
    assert {j["slurm_state"] for j in doc["jobs"]} == {"unknown"}
    nodes = {n["node"]: n for n in doc["nodes"]}
    assert sorted(nodes) == ["n1", "n2"]  # n3 is known only from SLURM
    assert {n["slurm_state"] for n in nodes.values()} == {"unknown"}
    # The figures that do not depend on SLURM are the same.
    assert by_job(doc)[("11", "alice")]["steps_at_risk"] == 200


def test_scan_reads_newest_committed_and_never_follows_symlinks(site: Site, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write(PosixTier("x", str(elsewhere)), "mallory", "k", 1, 1)
    os.symlink(elsewhere / "mallory", tmp_path / "pfs" / "mallory")
    os.symlink(elsewhere / "mallory" / "k", tmp_path / "pfs" / "bob" / "k2")
    heads = scan_catalog(str(tmp_path / "pfs"))
    assert sorted(heads) == [
        ("alice", "run1"),
        ("alice", "run2"),
        ("bob", "exp"),
        ("carol", "old"),
    ]
    h = heads[("alice", "run1")]
    assert (h.step, h.nbytes, h.job, h.node, h.checkpoints) == (300, NB, "11", "n1", 3)
    assert h.committed_at == pytest.approx(site.m300.wall_time + 10)
    assert sorted(scan_catalog(str(tmp_path / "pfs"), user="alice", key="run2")) == [
        ("alice", "run2")
    ]
    assert scan_catalog(str(tmp_path / "nowhere")) == {}


def test_manifest_fast_path_agrees_with_full_parse(site: Site, tmp_path: Path) -> None:
    path = tmp_path / "pfs/alice/run1" / step_dirname(100) / "manifest.json"
    data = path.read_bytes()
    full = Manifest.from_bytes(data)
    f = _facts(data)
    assert (f.user, f.key, f.step, f.wall_time, f.nbytes, f.job, f.node) == (
        full.user,
        full.key,
        full.step,
        full.wall_time,
        full.total_bytes,
        full.job,
        full.node,
    )
    # Every single-byte change outside the checksum's own digits is caught.
    start = data.index(b'"chunk_size"')
    for i in range(start, len(data), 7):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(VerifyError):
            _facts(bytes(bad))
    # Bytes the fast path does not recognise go through the full parse, which decides.
    with pytest.raises(VerifyError, match="not canonical"):
        _facts(b" " + data)


def test_cli_json_and_table(site: Site) -> None:
    r = ckpt_slurm("status", "--json", "--no-slurm", config=site.cfg_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "slurm_ckpt.status" and doc["version"] == 1
    assert doc["totals"]["jobs"] == 4 and doc["totals"]["bytes_at_risk"] == 3 * NB
    assert set(doc["jobs"][0]) == {
        "job",
        "user",
        "keys",
        "key_groups",
        "suspect",
        "slurm_state",
        "nodes",
        "tiers",
        "data_version",
        "steps_at_risk",
        "checkpoints_at_risk",
        "bytes_at_risk",
        "in_flight",
        "failed",
        "flush_rate_bps",
        "flush_eta_s",
        "problems",
        "partner",
    }
    assert doc["jobs"][0]["partner"] is None  # no partner copies in this site
    r = ckpt_slurm("status", "--no-slurm", "--job", "11", config=site.cfg_path)
    assert r.returncode == 0, r.stderr
    assert "alice/run1" in r.stdout and " 200 " in r.stdout and "bob" not in r.stdout
    r = ckpt_slurm("status", "--user", "../etc", config=site.cfg_path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ckpt-slurm: error: invalid user")


@pytest.mark.root
def test_real_slurm_job_state(site: Site, slurm_cluster: DevCluster) -> None:
    """The default query against the dev cluster: bulk squeue/sinfo, a running job."""
    c = slurm_cluster
    job = c.sbatch("sleep 300\n", user="ckptuser1")
    try:
        c.wait_job_state(job, "RUNNING", timeout=60)
        write(site.pfs, "ckptuser1", "live", 1, job)
        snap = query_slurm(env=c.env)
        assert snap.available, snap.note
        assert set(c.nodes) <= set(snap.nodes)
        doc = site.status(query=lambda: query_slurm(env=c.env), user="ckptuser1")
        (row,) = doc["jobs"]
        assert row["job"] == job and row["slurm_state"] == "RUNNING"
        assert row["nodes"] and set(row["nodes"]) <= set(c.nodes)
    finally:
        c.scancel(job)


def test_slurm_unreachable_is_unknown_not_an_error(site: Site, tmp_path: Path) -> None:
    snap = query_slurm(env={"PATH": str(tmp_path)})  # no SLURM_CONF, no controller
    assert not snap.available and snap.note
    doc = site.status(query=lambda: snap)
    assert {j["slurm_state"] for j in doc["jobs"]} == {"unknown"}


def test_partner_column_and_json(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``partner`` entry and column: null/"-" without partner copies; with them, the
    newest step that has one and the nodes holding it. A partner copy is shown, not
    counted as safe: steps_at_risk still counts from the warm tier (docs/partner.md)."""
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(site.cfg_path))
    monkeypatch.setenv("COLUMNS", "250")
    doc = site.status()
    assert [j["partner"] for j in doc["jobs"]] == [None] * 4
    code, out, err = run_here(["status", "--no-slurm", "--parsable", "--job", "11"])
    assert code == 0, err
    head, row = out.splitlines()
    fields = dict(zip(head.split("|"), row.split("|")))
    assert fields["partner_step"] == "" and fields["partner_nodes"] == ""

    # n1's steps 400 and 500 copied to n3, 500 to n4, 400 to n5: the newest with a
    # partner copy is 500, on n3 and n4. The ledgers mark them as the hooks' scan does.
    for node, steps in (("n3", (400, 500)), ("n4", (500,)), ("n5", (400,))):
        ledger = Ledger(site.base / "ledgers" / node, node, clock=lambda: site.t_n1)
        for seq, step in enumerate(steps):
            ledger.record_local_commit("alice", "run1", step, NB, seq, 11, True)
        marked = mark_partner_copies(ledger, {("alice", "run1", s): "n1" for s in steps}, node)
        assert marked == len(steps)
        publish_status(ledger, site.base / "pfs")
    doc = site.status()
    jobs = by_job(doc)
    j = jobs[("11", "alice")]
    assert j["partner"] == {"copies": 4, "step": 500, "nodes": ["n3", "n4"]}
    assert j["steps_at_risk"] == 200 and doc["totals"]["steps_at_risk"] == 220
    assert jobs[("13", "alice")]["partner"] is None  # another job's row is untouched

    code, out, err = run_here(["status", "--no-slurm", "--json", "--job", "11"])
    assert code == 0, err
    assert json.loads(out)["jobs"][0]["partner"] == j["partner"]
    code, out, err = run_here(["status", "--no-slurm", "--parsable", "--job", "11"])
    assert code == 0, err
    head, row = out.splitlines()
    fields = dict(zip(head.split("|"), row.split("|")))
    assert fields["partner_step"] == "500" and fields["partner_nodes"] == "n3,n4"
    code, out, err = run_here(["status", "--no-slurm"])
    assert code == 0, err
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.lstrip().startswith("job "))
    assert " partner " in f"{header} "
    (row11,) = [ln for ln in lines if "alice/run1" in ln]
    assert " 500@n[3-4] " in f"{row11} "
    (row13,) = [ln for ln in lines if "alice/run2" in ln]
    assert "@" not in row13


def test_step_names_found_in_one_pass_agree_with_the_one_name_parser() -> None:
    """The catalog walk finds a listing's step directories with one regular expression;
    it must accept exactly what :func:`parse_step_dirname` accepts."""
    from slurm_ckpt.core.layout import parse_step_dirname, step_numbers

    names = [
        "step-0000000005",
        "step-0000000010",
        "step-0000000007\nstep-0000000001",  # a newline in a name is not a separator
        "step-000000001",  # too short
        "step-00000000011",  # too long
        ".tmp-step-0000000003",
        "step-0000000003 ",
        "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661",  # Arabic digits
        "xstep-0000000004",
        "step-0000000004x",
        "",
        "step-9999999999",
    ]
    want = sorted((s for s in map(parse_step_dirname, names) if s is not None), reverse=True)
    assert step_numbers(names) == want == [9999999999, 10, 5]
    assert step_numbers([]) == []


def test_nesting_bound_fast_path_keeps_the_bound() -> None:
    """A manifest with few brackets is settled by counting them (no parser can nest
    deeper than its opening brackets); whatever the full scan accepts is still accepted,
    and nothing accepted nests deeper than the bound."""
    import random

    from slurm_ckpt.core import manifest_limits as ml

    def skeleton(data: bytes) -> bytes:
        return ml._STRING.sub(b"", ml._ESCAPE.sub(b"", data)).translate(None, ml._NOT_BRACKET)

    def slow(data: bytes, depth: int) -> bool:
        sk = skeleton(data)
        for _ in range(depth):
            if not sk:
                return True
            sk = ml._EMPTY_PAIR.sub(b"", sk)
        return not sk

    def deepest(data: bytes) -> int:
        level = top = 0
        for c in skeleton(data):
            level = level + 1 if c in b"{[" else max(0, level - 1)
            top = max(top, level)
        return top

    rng = random.Random(7)
    for _ in range(3000):
        data = bytes(rng.choice(b'{}[]"\\ax') for _ in range(rng.randint(0, 24)))
        for depth in (1, 3, 40):
            got = ml.nesting_within(data, depth)
            assert got or not slow(data, depth), (data, depth)
            assert not got or deepest(data) <= depth, (data, depth)
    deep = b"[" * 41 + b"]" * 41
    assert not ml.nesting_within(deep, 40) and ml.nesting_within(deep, 41)
    assert ml.nesting_within(b'{"a": "' + b"[" * 60 + b'"}', 40)  # brackets in a string
    with pytest.raises(VerifyError):
        ml.check_bytes(b'{"a": ' + b"[" * 41 + b"]" * 41 + b"}")


def test_status_json_cuts_long_strings_in_rows_and_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Rows that encode short are written as they are (in C); a long string anywhere,
    key or value, is cut as safe_json cuts it."""
    from slurm_ckpt.cli.safe_text import JSON_LIMIT
    from slurm_ckpt.cli.status import write_json

    long = "x" * (JSON_LIMIT + 10)
    doc = {
        "format": "slurm_ckpt.status",
        "notes": [long],
        "jobs": [{"user": "alice", "keys": ["run"]}, {"user": "bob", long: {"k": [long]}}],
        "filters": {"key": long},
        "empty": [],
    }
    write_json(doc)
    got = json.loads(capsys.readouterr().out)
    cut = "x" * JSON_LIMIT + "...[10 more characters]"
    assert got["notes"] == [cut] and got["filters"] == {"key": cut}
    assert got["jobs"] == [{"user": "alice", "keys": ["run"]}, {"user": "bob", cut: {"k": [cut]}}]
    assert got["empty"] == [] and got["format"] == "slurm_ckpt.status"
