"""Output for terminals and scripts (issue 11, item 5), and progress (item 6).

* at 80 columns ``status``, ``list`` and ``verify`` split no token: every value of the
  data appears whole, and no line is longer than 80 characters;
* ``--parsable`` records split on ``|`` into exactly the header's fields, with raw
  numbers equal to the ``--json`` document's;
* ``--noheader`` prints the records only; colours only on a terminal;
* the table layout never splits a token, whatever the cells and the width (hypothesis);
* the operations' ``progress=`` callbacks count every byte exactly once.

A real site: tier directories, checkpoints written by the real writer, node status files
published by real ledgers; SLURM is the injectable snapshot of ``status``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from helpers import site as helper_site
from helpers.cli import run_here
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.table import Column, Listing, OutputFormat, parsable_value, render_table
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.ledger import Ledger, State, publish_status
from slurm_ckpt.ops import status as status_mod
from slurm_ckpt.ops.status import SlurmJob, SlurmNode, SlurmSnapshot
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier

USER = "alice"
KEY = "llama-70b-pretrain"
NODE = "gpu-node-017"
JOB = "4242424"


class Site(helper_site.Site):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.tmp = tmp
        self.cfg = self.cfg_path
        for step in (1000, 2000, 3000):
            files = {"model.bin": os.urandom(9000 * step // 1000), "opt.bin": b"x"}
            self.write(
                step, user=USER, key=KEY, files=files, tokens=step * 4_000_000, job=JOB, node=NODE
            )
        self.copy(1000, user=USER, key=KEY)
        self.copy(2000, user=USER, key=KEY)
        led = Ledger(tmp / "ledger", NODE)
        led.record_local_commit(USER, KEY, 3000, 27001, 0, int(JOB), True)
        led.record_local_commit(USER, KEY, 2000, 18001, 0, int(JOB), True)
        led.mark(USER, KEY, 2000, "pfs", State.VERIFIED)
        publish_status(led, tmp / "pfs")

    def corrupt(self, step: int) -> None:
        path = Path(self.local.step_path(USER, KEY, step)) / "model.bin"
        with open(path, "r+b") as fh:
            fh.write(b"\xff\xfe")

    def snapshot(self) -> SlurmSnapshot:
        return SlurmSnapshot(
            True,
            "test",
            jobs={JOB: SlurmJob(JOB, "RUNNING", USER, (NODE,))},
            nodes={
                NODE: SlurmNode(
                    NODE,
                    "MIXED+DRAIN",
                    True,
                    "slurm_ckpt: flushing 1 checkpoint (26.4KiB) before the maintenance window",
                )
            },
        )


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Site:
    s = Site(tmp_path)
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(s.cfg))
    monkeypatch.setattr(status_mod, "slurm_query", s.snapshot)
    monkeypatch.delenv("NO_COLOR", raising=False)
    return s


def _words(text: str) -> set:
    return set(text.split())


def _assert_fits(text: str, width: int = 80) -> None:
    for line in text.splitlines():
        assert len(line) <= width, (len(line), line)


# --------------------------------------------------------------------------- 80 columns


def test_status_at_80_columns_splits_no_token(site: Site, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_here(["status"])
    assert code == 0, err
    _assert_fits(out)
    words = _words(out)
    # The examples: "unknow/n", "gpu-no/de-017" must not happen.
    for token in (JOB, f"{USER}/{KEY}", "RUNNING", NODE, "3000", "2000", "MIXED+DRAIN"):
        assert token in words, (token, out)
    assert format_bytes(27001) in words  # at risk: the one checkpoint not on the PFS
    # The drain reason is a wrapped cell: each of its words is whole.
    for word in [
        "slurm_ckpt:",
        "flushing",
        "1",
        "checkpoint",
        "(26.4KiB)",
        "before",
        "the",
        "maintenance",
    ]:
        assert word in words, (word, out)
    assert "1 job," in out and "1 jobs" not in out  # plural rule


def test_list_at_80_columns_splits_no_token(site: Site, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_here(["list", KEY, "-u", USER])
    assert code == 0, err
    _assert_fits(out)
    words = _words(out)
    doc = json.loads(run_here(["list", KEY, "-u", USER, "--json"])[1])
    for row in doc["checkpoints"]:
        # the table names the tier in the vocabulary (warm, not pfs); JSON keeps both
        for token in (row["role"], str(row["step"]), format_bytes(row["bytes"]), JOB, NODE):
            assert token in words, (token, out)
        assert row["role"] == ("warm" if row["tier"] == "pfs" else row["tier"])
    assert "pfs" not in words
    code, out, err = run_here(["list", "-u", USER])  # the series listing
    assert code == 0, err
    _assert_fits(out)
    assert {KEY, USER, "local", "warm", "3000", "2000"} <= _words(out)  # warm, not pfs


def test_verify_at_80_columns_splits_no_token(site: Site, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    site.corrupt(3000)
    code, out, err = run_here(["verify", KEY, "-u", USER])
    assert code == 1, err
    _assert_fits(out)
    words = _words(out)
    doc = json.loads(run_here(["verify", KEY, "-u", USER, "--json"])[1])
    for row in doc["checkpoints"]:
        # the table names the tier as users do (local, warm, cold): JSON's role
        for token in (row["role"], str(row["step"]), format_bytes(row["bytes"]), row["state"]):
            assert token in words, (token, out)
        for problem in row["problems"]:
            for word in problem.split():
                assert word in words, (word, out)
    assert "CORRUPT" in words and "OK" in words


def test_pipes_get_whole_rows(site: Site, monkeypatch) -> None:
    """No $COLUMNS and not a terminal: one line per record, however long."""
    monkeypatch.delenv("COLUMNS", raising=False)
    code, out, _ = run_here(["list", KEY, "-u", USER, "--noheader"])
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 5  # 3 local + 2 pfs, no title, no header
    assert all(line.split()[-1].startswith(str(site.tmp)) for line in lines)  # path kept
    assert "\x1b[" not in out  # no colour in a pipe


# --------------------------------------------------------------------------- --parsable


def _parsable(argv: List[str]) -> Tuple[List[str], List[Dict[str, str]]]:
    code, out, err = run_here([*argv, "--parsable"])
    assert code in (0, 1), err
    lines = out.splitlines()
    header = lines[0].split("|")
    rows = []
    for line in lines[1:]:
        fields = line.split("|")
        assert len(fields) == len(header), (header, line)
        rows.append(dict(zip(header, fields)))
    return header, rows


def test_parsable_list_and_verify_match_json(site: Site) -> None:
    header, rows = _parsable(["list", KEY, "-u", USER])
    assert header[:4] == ["tier", "user", "key", "step"] and "bytes" in header
    doc = json.loads(run_here(["list", KEY, "-u", USER, "--json"])[1])
    assert len(rows) == len(doc["checkpoints"]) == 5
    for got, want in zip(rows, doc["checkpoints"]):
        assert int(got["bytes"]) == want["bytes"]  # raw bytes, not "26.4KiB"
        assert int(got["step"]) == want["step"] and got["job"] == JOB and got["node"] == NODE
        assert got["path"] == want["path"]
        assert float(got["age_s"]) >= 0
    site.corrupt(3000)
    header, rows = _parsable(["verify", KEY, "-u", USER])
    assert {"tier", "step", "bytes", "seconds", "state", "path"} <= set(header)
    assert {(r["tier"], r["step"], r["state"]) for r in rows if r["state"] != "OK"} == {
        ("local", "3000", "CORRUPT")
    }


def test_parsable_status_jobs_and_nodes(site: Site) -> None:
    header, rows = _parsable(["status"])
    (row,) = rows
    assert row["job"] == JOB and row["user"] == USER and row["key"] == KEY
    assert row["state"] == "RUNNING" and row["nodes"] == NODE
    assert int(row["local_step"]) == 3000 and int(row["pfs_step"]) == 2000
    assert int(row["bytes_at_risk"]) == 27001 and int(row["checkpoints_at_risk"]) == 1
    assert int(row["steps_at_risk"]) == 1000  # step 3000 local, 2000 safe on the PFS
    header, rows = _parsable(["status", "--nodes"])
    (node,) = rows
    assert node["node"] == NODE and node["state"] == "MIXED+DRAIN"
    assert int(node["pending_bytes"]) == 27001 and "maintenance window" in node["drain_reason"]
    # Node lists select: one that does not match leaves no record.
    assert _parsable(["status", "-w", "gpu-node-[001-016]"])[1] == []
    assert len(_parsable(["status", "-w", "gpu-node-[001-017],other"])[1]) == 1


def test_parsable_gc_and_noheader(site: Site) -> None:
    header, rows = _parsable(["gc", "--dry-run"])
    assert header == [
        "tier",
        "user",
        "key",
        "checkpoints",
        "keep",
        "delete",
        "bytes",
        "corrupt",
        "pinned",
        "damaged_steps",
        "reclaim",
    ]
    assert rows == [
        {
            "tier": "pfs",
            "user": USER,
            "key": KEY,
            "checkpoints": "2",
            "keep": "1000,2000",
            "delete": "",
            "bytes": "0",
            "corrupt": "",
            "pinned": "",
            "damaged_steps": "",
            "reclaim": "",
        }
    ]
    code, out, _ = run_here(["gc", "--dry-run", "--parsable", "--noheader"])
    assert out.splitlines() == [f"pfs|{USER}|{KEY}|2|1000,2000||0||||"]


def test_parsable_escapes_the_separator() -> None:
    assert parsable_value("a|b%c") == "a%7Cb%25c"
    assert parsable_value([1, 2]) == "1,2" and parsable_value(None) == ""
    assert parsable_value(2.0) == "2" and parsable_value(0.1234567) == "0.123457"


# --------------------------------------------------------------------------- colour


def test_colour_only_for_terminals() -> None:
    rows = [{"step": 1, "state": "OK"}, {"step": 2, "state": "CORRUPT"}]
    listing = Listing([Column("step", "step"), Column("state", "result")], rows)
    plain = "\n".join(listing.lines(OutputFormat(), width=None, colour=False))
    assert "\x1b[" not in plain
    coloured = listing.lines(OutputFormat(), width=None, colour=True)
    assert "\x1b[31mCORRUPT" in coloured[2] and "\x1b[32mOK" in coloured[1]


# --------------------------------------------------------------------------- layout


_token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-./[]", min_size=1, max_size=14)
_cell = st.lists(_token, min_size=0, max_size=5).map(" ".join)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.lists(st.lists(_cell, min_size=n, max_size=n), min_size=1, max_size=6),
            st.lists(st.booleans(), min_size=n, max_size=n),
            st.lists(st.integers(0, 3), min_size=n, max_size=n),
        )
    ),
    st.integers(10, 120),
)
def test_layout_never_splits_a_token(data, width: int) -> None:
    rows, wraps, drops = data
    cols = [Column(str(i), f"H{i}", wrap=w, drop=d) for i, (w, d) in enumerate(zip(wraps, drops))]
    lines = render_table(cols, rows, width=width, header=True)
    words = set(" ".join(lines).split())
    kept = {c.header for c in cols} & words
    assert (
        "H0" in kept or cols[0].drop
    )  # a mandatory column is never dropped (headers: upper case, cells: lower)
    for row in rows:
        for col, cell in zip(cols, row):
            if col.header in kept:
                for tok in cell.split():
                    assert tok in words, (tok, lines)
    mins = sum(
        max([len(t) for r in rows for t in (r[i].split() if c.wrap else [r[i]])] + [len(c.header)])
        for i, c in enumerate(cols)
        if c.header in kept
    ) + 2 * (len(kept) - 1)
    if mins <= width:
        assert all(len(line) <= width for line in lines), lines


# --------------------------------------------------------------------------- progress


def test_progress_callbacks_count_every_byte(site: Site, tmp_path: Path) -> None:
    seen: List[int] = []
    rep = site.local.verify(USER, KEY, 3000, progress=seen.append)
    assert rep.ok and sum(seen) == rep.nbytes == 27001
    dst = PosixTier("other", str(tmp_path / "other"), chunk_size=4096)
    (tmp_path / "other").mkdir()
    seen.clear()
    res = copy_checkpoint(site.local, dst, USER, KEY, 3000, progress=seen.append)
    assert sum(seen) == res.nbytes == 27001
    seen.clear()
    again = copy_checkpoint(site.local, dst, USER, KEY, 3000, progress=seen.append)
    assert again.already_present and sum(seen) == 27001  # counted as done at once
    with ByteProgress("test", total=100, enabled=False) as bar:
        bar.advance(40)
        bar.advance(60)
    assert bar.done == 100


def test_progress_bar_on_stderr_when_forced(site: Site, monkeypatch) -> None:
    """A bar (forced: tests have no terminal) goes to stderr; stdout stays the table."""
    monkeypatch.setenv("SLURM_CKPT_PROGRESS", "1")
    code, out, err = run_here(["verify", KEY, "-u", USER, "--parsable"])
    assert code == 0
    assert out.splitlines()[0].startswith("tier|")
    assert all("|" in line for line in out.splitlines())


def test_restore_feeds_its_bytes_to_a_progress_bar(site: Site, monkeypatch, tmp_path) -> None:
    """``ckpt-slurm restore`` advances a bar (stderr, on a terminal) by every byte it
    copies and verifies; it showed nothing, for minutes on a large checkpoint. stdout
    keeps its one line."""
    from slurm_ckpt.cli import restore_cmd

    bars = []

    class Recording(ByteProgress):
        def __enter__(self) -> Recording:
            bars.append(self)
            return super().__enter__()

    monkeypatch.setattr(restore_cmd, "ByteProgress", Recording)
    code, out, err = run_here(["restore", KEY, "-u", USER, "--to", str(tmp_path / "back")])
    assert code == 0, err
    assert out.startswith(f"restored {USER}/{KEY} step "), out
    assert len(bars) == 1 and bars[0].description == f"restore {KEY}: copy + verify"
    assert bars[0].done > 0, bars[0].done
    # its total is known once the copy is picked: the bar has a percentage and an ETA
    assert bars[0].total == bars[0].done, (bars[0].total, bars[0].done)
