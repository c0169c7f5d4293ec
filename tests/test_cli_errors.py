"""Honest errors (issue 18): each with an exact exit code and one line on stderr.

* a tier root that does not exist is a config error (2), never "no committed checkpoints"
  (0); a missing local root alone (a login node) still lists the shared tiers;
* ``drill`` calls a truncated file what ``verify`` calls it (``size A != B``);
* ``restore --parsable`` prints a parsable record; every bad ``--to`` is exit 2;
* values refused: ``-u ''``, ``verify DIR --step``, ``plan --nodes`` beyond any cluster;
* ``verify`` names files in a checkpoint directory that the manifest does not list;
* the epilog tells copies made now from checkpoints already on the warm tier;
* the same step saved twice in one run replaces this run's save without a failed flush.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, List

import numpy as np
import pytest
from helpers.cli import run_here
from helpers.site import Site
from test_checkpointer import Events, make
from test_cli_laptop import _as_nobody, _user_site
from test_hooks import area, save  # noqa: F401 - the epilog's site fixture and writer

from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.tiers.posix import PosixTier


@pytest.fixture
def site(tmp_path: Path) -> Site:
    s = Site(tmp_path)
    for step in (1, 2):
        s.write(step, user="alice", key="run", files={"w.bin": os.urandom(1000)})
    s.copy(1, user="alice", key="run")
    return s


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt-slurm: error: "), err
    return lines[0]


# --------------------------------------------------------------------------- tier roots

MISSING_ROOT_COMMANDS = [
    ["list"],
    ["list", "run", "-u", "alice"],
    ["verify", "run", "-u", "alice"],
    ["status", "--no-slurm"],
    ["restore", "run", "-u", "alice", "--to", "{base}/back"],
    ["drill", "run", "-u", "alice"],
]


@pytest.mark.parametrize("argv", MISSING_ROOT_COMMANDS, ids=lambda a: a[0])
def test_missing_tier_root_is_a_config_error(site: Site, argv: List[str]) -> None:
    cfg = site.base / "typo.toml"
    cfg.write_text(site.cfg_path.read_text().replace(str(site.roots["pfs"]), "/nonexistent/pfs"))
    code, out, err = run_here(["--config", str(cfg), *[a.format(base=site.base) for a in argv]])
    assert code == 2, (out, err)
    line = _one_line(err)
    assert "tiers.pfs.root /nonexistent/pfs does not exist" in line and out == ""
    assert not (site.base / "back").exists()


def test_missing_local_root_alone_is_a_login_node(site: Site) -> None:
    cfg = site.base / "login.toml"
    cfg.write_text(site.cfg_path.read_text().replace(str(site.roots["local"]), "/nonexistent/l"))
    code, out, err = run_here(["--config", str(cfg), "list", "run", "-u", "alice", "--json"])
    assert code == 0, err
    assert [(c["tier"], c["step"]) for c in json.loads(out)["checkpoints"]] == [("pfs", 1)]
    # Asking for the local tier alone, there: the missing root is the answer.
    code, out, err = run_here(["--config", str(cfg), "list", "--tier", "local"])
    assert code == 2 and "tiers.local.root /nonexistent/l does not exist" in _one_line(err)


# --------------------------------------------------------------------------- drill / verify


def test_drill_and_verify_name_a_truncated_file_alike(site: Site) -> None:
    victim = site.step_dir(2, user="alice") / "w.bin"
    os.truncate(victim, 500)
    flags = ["--local", str(site.roots["local"])]
    code, out, err = run_here(["verify", "run", "-u", "alice", "--json", *flags])
    assert code == 1
    [bad] = [c for c in json.loads(out)["checkpoints"] if not c["ok"]]
    assert bad["problems"] == ["w.bin: size 500 != 1000"]
    code, out, err = run_here(["drill", "run", "-u", "alice", "--json", *flags])
    assert code == 0, err  # step 1 verifies and is what a restart would use
    doc = json.loads(out)
    assert doc["step"] == 1
    assert [s["error"] for s in doc["skipped"]] == ["source w.bin: size 500 != 1000"]
    assert "I/O error" not in out


def test_verify_names_files_the_manifest_does_not_list(site: Site) -> None:
    step = site.step_dir(2, user="alice")
    (step / "notes.txt").write_text("stray")
    (step / "extra").mkdir()
    (step / "extra" / "x.bin").write_bytes(b"x")
    flags = ["--local", str(site.roots["local"])]
    code, out, err = run_here(["verify", "run", "-u", "alice", "--json", *flags])
    assert code == 1, err
    rows = {c["step"]: c for c in json.loads(out)["checkpoints"]}
    assert rows[1]["ok"] and rows[1]["state"] == "OK"
    assert rows[2]["state"] == "UNLISTED" and not rows[2]["ok"]
    assert rows[2]["problems"] == [
        "extra/: not in the manifest",
        "notes.txt: not in the manifest",
    ]
    code, out, err = run_here(["verify", str(step), "--json"])
    assert code == 1
    [row] = json.loads(out)["checkpoints"]
    assert row["state"] == "UNLISTED" and "notes.txt: not in the manifest" in row["problems"]
    shutil.rmtree(step / "extra")
    os.unlink(step / "notes.txt")
    assert run_here(["verify", str(step)])[0] == 0


# --------------------------------------------------------------------------- restore


def test_restore_parsable(site: Site) -> None:
    to = site.base / "back"
    flags = ["--local", str(site.roots["local"]), "--warm", str(site.roots["pfs"])]
    code, out, err = run_here(
        ["restore", "run", "-u", "alice", "--to", str(to), "--parsable", *flags]
    )
    assert code == 0, err
    header, record = out.splitlines()
    fields = dict(zip(header.split("|"), record.split("|")))
    assert fields["step"] == "2" and fields["tier"] == "local" and fields["bytes"] == "1000"
    assert fields["path"] == str(to / "alice" / "run" / "step-0000000002")


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ckpt-errors-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_every_bad_destination_is_a_usage_error(open_tmp: Path) -> None:
    s, home = _user_site(open_tmp)
    afile = open_tmp / "afile"
    afile.write_text("x")
    flags = ["--local", str(s.roots["local"])]
    env = {"XDG_CONFIG_HOME": str(home)}
    seen = {}
    for to in ("/nonexistent-ckpt/dir", str(afile), f"{afile}/x", "/proc/1/x"):
        code, out, err = _as_nobody(["restore", "run", "--to", to, *flags], env)
        seen[to] = code
        assert f"--to {to}: " in _one_line(err), err
    assert set(seen.values()) == {2}, seen
    code, out, err = _as_nobody(["restore", "run", "--to", str(open_tmp / "ok"), *flags], env)
    assert code == 0, err


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["list", "-u", ""], "empty user name"),
        (["verify", "run", "--user", " "], "empty user name"),
        (["verify", "{step}", "--step", "5"], "--step applies to a KEY"),
        (["verify", "{step}", "--tier", "pfs", "-u", "alice"], "--user and --tier apply"),
        (
            [
                "plan",
                "--nodes",
                "99999999999999999999",
                "--size",
                "1GB",
                "--pfs-bw",
                "1GB/s",
                "--mtbi",
                "6h",
            ],
            "at most",
        ),
    ],
)
def test_values_refused(site: Site, argv: List[str], needle: str) -> None:
    argv = [a.format(step=site.step_dir(1, user="alice")) for a in argv]
    code, out, err = run_here([*argv, "--config", str(site.cfg_path)])
    assert code == 2, (out, err)
    assert needle in _one_line(err) and out == ""


# --------------------------------------------------------------------------- epilog


def test_epilog_tells_already_flushed_apart(area: Any) -> None:  # noqa: F811 - fixture
    cfg = area.cfg()
    for step in (1, 2):
        save(cfg, "ckptuser1", "run", step)
    first = run_epilog(cfg, area.env("ckptuser1")).line()
    assert "flushed 2 (" in first and "already" not in first, first
    # The ledger forgets (as when ckpt-srun's own flush, not this node's, put them there):
    # the warm tier holds both, identical; nothing is copied and the line says so.
    shutil.rmtree(cfg.ledger.dir)
    again = run_epilog(cfg, area.env("ckptuser1")).line()
    assert "flushed 0 (0B), 2 already on the warm tier;" in again, again


# --------------------------------------------------------------------------- same step


def test_same_step_saved_twice_in_one_run(tmp_path: Path, caplog: Any) -> None:
    ev = Events(gate_on=("flush_start", 5))
    ckpt = make(tmp_path, on_event=ev, interval_steps=1)
    with caplog.at_level(logging.INFO, logger="slurm_ckpt"):
        ckpt.save({"w": np.ones(64)}, step=5)
        ev.wait_for("flush_start", 5)  # the first save's flush holds the local copy
        ckpt.save({"w": np.zeros(64)}, step=5)  # the second save of the same step
        ev.gate.set()
        stats = ckpt.close()
    text = caplog.text
    assert "older run" not in text, text
    assert "saved again in this run: replacing the earlier save" in text
    assert stats.flush_failures == 0 and stats.flushes == 2, stats
    local = PosixTier("local", str(tmp_path / "local"))
    pfs = PosixTier("pfs", str(tmp_path / "pfs"))
    user = ckpt.user
    assert pfs.manifest_bytes(user, "run", 5) == local.manifest_bytes(user, "run", 5)
    assert pfs.verify(user, "run", 5).ok


def test_missing_cold_root_is_left_out_with_a_warning(site: Site) -> None:
    """The archive is often not mounted on login nodes: the other tiers are read, and a
    warning says the cold tier was not; asking for the cold tier alone is the error."""
    cfg = site.base / "cold.toml"
    cfg.write_text(
        site.cfg_path.read_text() + '[tiers.cold]\nkind = "posix"\nroot = "/nonexistent/cold"\n'
    )
    code, out, err = run_here(["--config", str(cfg), "list", "run", "-u", "alice", "--json"])
    assert code == 0, err
    assert {c["tier"] for c in json.loads(out)["checkpoints"]} == {"local", "pfs"}
    assert err == (
        "warning: tiers.cold.root /nonexistent/cold does not exist on this node: "
        "the cold tier is not read\n"
    )
    code, out, err = run_here(["--config", str(cfg), "list", "--tier", "cold"])
    assert code == 2 and "tiers.cold.root /nonexistent/cold does not exist" in _one_line(err)
