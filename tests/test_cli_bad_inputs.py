"""Bad input to ``ckpt-slurm`` and ``ckpt-srun``: the exact exit code, one line on stderr,
never a traceback (issue 11, "Must show": a table of at least 60 bad inputs).

The codes are the table of :mod:`slurm_ckpt.errors`: 1 a finding or failed operation,
2 usage or configuration, 3 SLURM unreachable. Every case runs the real entry point
(:func:`slurm_ckpt.cli.main.main` / :func:`slurm_ckpt.cli.srun.main`) in this process,
against a real (small) site: directories for the tiers and a config file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Tuple

import pytest
from helpers.cli import run_here
from helpers.site import Site

from slurm_ckpt.cli import main as main_mod
from slurm_ckpt.cli import srun as srun_mod
from slurm_ckpt.errors import EXIT_CODES, EXIT_FAILED, EXIT_SLURM, EXIT_USAGE

PLAN = ["plan", "--params", "70e9", "--pfs-bw", "500MB/s", "--mtbi", "6h"]
SIZED = ["plan", "--pfs-bw", "500MB/s", "--mtbi", "6h", "--size"]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Tier directories, a valid config (via $SLURM_CKPT_CONFIG), no SLURM in reach."""
    cfg = Site(tmp_path, config_name="config.toml").cfg_path
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(cfg))
    for var in list(os.environ):
        if var.startswith("SLURM_") and var != "SLURM_CKPT_CONFIG":
            monkeypatch.delenv(var)
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no scontrol, no srun: SLURM unreachable
    monkeypatch.chdir(tmp_path)
    (tmp_path / "__0_0.distcp").write_bytes(b"a DCP shard whose .metadata is not written yet")
    return tmp_path


def bad_config(site: Path, line: str) -> Path:
    path = site / "bad.toml"
    path.write_text(
        f'[tiers.local]\nroot = "{site / "local"}"\nrequire_mount = false\n{line}\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{site / "pfs"}"\n'
    )
    return path


# (argv, exit code, a fragment of the error line)
CASES: List[Tuple[List[str], int, str]] = [
    # --- click usage errors: one line, exit 2, a pointer to --help
    (["no-such-command"], EXIT_USAGE, "No such command"),
    (["list", "--bogus"], EXIT_USAGE, "--bogus"),
    (["--config"], EXIT_USAGE, "--config"),
    (["verify"], EXIT_USAGE, "TARGET"),
    (["config", "show", "--nope"], EXIT_USAGE, "--nope"),
    (["install-hooks"], EXIT_USAGE, "--dest"),
    (["list", "run", "--json", "--parsable"], EXIT_USAGE, "not both"),
    (["verify", "run", "--step", "x"], EXIT_USAGE, "--step"),
    # --- job ids, node lists, names
    (["status", "-j", "abc"], EXIT_USAGE, "job id"),
    (["status", "--job", "12.3"], EXIT_USAGE, "job id"),
    (["flush", "--job", "abc"], EXIT_USAGE, "job id"),
    (["flush", "-j", "0"], EXIT_USAGE, "job id"),
    (["status", "-w", "n[1-3"], EXIT_USAGE, "unbalanced"),
    (["status", "--node", "n[3-1]"], EXIT_USAGE, "backwards"),
    (["status", "-w", "bad node"], EXIT_USAGE, "--node"),
    (["guard", "-w", "n[1-3]"], EXIT_USAGE, "names 3 nodes"),
    (["flush", "--node", "a,b"], EXIT_USAGE, "names 2 nodes"),
    (["stager", "--node", "n[1-2]"], EXIT_USAGE, "names 2 nodes"),
    (["maint", "n[1-", "--reason", "x", "--reboot"], EXIT_USAGE, "unbalanced"),
    (["status", "-u", "../etc"], EXIT_USAGE, "invalid user"),
    (["status", "-k", "bad/key"], EXIT_USAGE, "invalid key"),
    (["list", "../etc"], EXIT_USAGE, "invalid key"),
    (["list", "run", "-u", "bad/user"], EXIT_USAGE, "invalid user"),
    (["verify", "run", "--user", "bad/user"], EXIT_USAGE, "invalid user"),
    (["gc", "-k", "../x"], EXIT_USAGE, "invalid key"),
    (["gc", "--user", "a b"], EXIT_USAGE, "invalid user"),
    (["drill", "../x"], EXIT_USAGE, "invalid key"),
    (["list", "run", "--tier", "tape"], EXIT_USAGE, "--tier"),
    (["list", "run", "--tier", "cold"], EXIT_USAGE, "not configured"),
    (["drill", "run", "--scratch", "/nonexistent/dir"], EXIT_USAGE, "not a directory"),
    # --- units: bare numbers, overflow, ambiguity, malformed durations
    (["plan", "--size", "350", "--pfs-bw", "500", "--mtbi", "6"], EXIT_USAGE, "no unit"),
    ([*SIZED, "350"], EXIT_USAGE, "350B, 350MB or 350MiB"),
    ([*SIZED, "1e400"], EXIT_USAGE, "too large"),
    ([*SIZED, "1e400GB"], EXIT_USAGE, "too large"),
    ([*SIZED, "64M"], EXIT_USAGE, "ambiguous"),
    ([*SIZED, "-5GB"], EXIT_USAGE, "negative"),
    ([*SIZED, "5 parsecs"], EXIT_USAGE, "--size"),
    (["plan", "--params", "70e9", "--pfs-bw", "500", "--mtbi", "6h"], EXIT_USAGE, "500MB/s"),
    (["plan", "--params", "70e9", "--pfs-bw", "1e400GB/s", "--mtbi", "6h"], EXIT_USAGE, "large"),
    (["plan", "--params", "70e9", "--pfs-bw", "500MB/s", "--mtbi", "6"], EXIT_USAGE, "6min"),
    (["plan", "--params", "70e9", "--pfs-bw", "1GB/s", "--mtbi", "1e400h"], EXIT_USAGE, "large"),
    (["plan", "--params", "70e9", "--pfs-bw", "1GB/s", "--mtbi", "5m5m"], EXIT_USAGE, "largest"),
    (["plan", "--params", "70e9", "--pfs-bw", "1GB/s", "--mtbi", "1-25"], EXIT_USAGE, "below 24"),
    (["plan", "--params", "70e9", "--pfs-bw", "1GB/s", "--mtbi", "6:61:00"], EXIT_USAGE, "60"),
    (
        ["plan", "--params", "70e9", "--pfs-bw", "1GB/s", "--mtbi", "6 fortnights"],
        EXIT_USAGE,
        "unit",
    ),
    ([*PLAN, "--max-loss", "soon"], EXIT_USAGE, "--max-loss"),
    ([*PLAN, "--stall", "-20s"], EXIT_USAGE, "negative"),
    ([*PLAN, "--plot", "plan.txt"], EXIT_USAGE, "cannot draw a .txt"),
    ([*PLAN, "--plot", "/nonexistent/dir/plan.png"], EXIT_USAGE, "does not exist"),
    (["plan", "--params", "70e9"], EXIT_USAGE, "--pfs-bw is required"),
    (
        ["plan", "--params", "7e9", "--size", "1GB", "--pfs-bw", "1GB/s", "--mtbi", "6h"],
        2,
        "not both",
    ),
    ([*PLAN, "--nodes", "0"], EXIT_USAGE, "--nodes"),
    ([*PLAN, "--precision", "fp8"], EXIT_USAGE, "--precision"),
    (["plan", "--params", "lots", "--pfs-bw", "1GB/s", "--mtbi", "6h"], EXIT_USAGE, "--params"),
    (["guard", "--wait", "5"], EXIT_USAGE, "5s, 5min or 5h"),
    (["guard", "--wait", "soon"], EXIT_USAGE, "--wait"),
    (["guard", "--wait", "1e400s"], EXIT_USAGE, "too large"),
    (["maint", "n1", "--reason", "x", "--timeout", "20", "--reboot"], EXIT_USAGE, "no unit"),
    (["maint", "n1", "--reason", "x", "--poll", "1ms", "--reboot"], EXIT_USAGE, "at least"),
    (["stager", "--interval", "5"], EXIT_USAGE, "no unit"),
    (["stager", "--interval", "10ms"], EXIT_USAGE, "at least"),
    (["prolog", "--budget", "soon"], EXIT_USAGE, "--budget"),
    (["epilog", "--budget", "-5"], EXIT_USAGE, "--budget"),
    # --- maint arguments
    (["maint", "n1", "--reason", "x"], EXIT_USAGE, "exactly one action"),
    (["maint", "n1", "--reason", " ", "--reboot"], EXIT_USAGE, "--reason"),
    # --- hooks outside SLURM: the same code for prolog and epilog
    (["prolog"], EXIT_USAGE, "prolog: bad SLURM job environment: $SLURM_JOB_ID is not set"),
    (["epilog"], EXIT_USAGE, "epilog: bad SLURM job environment: $SLURM_JOB_ID is not set"),
    # --- findings: exit 1
    (["verify", "nosuchkey"], EXIT_FAILED, "no committed checkpoint"),
    (["list", "nosuchkey"], EXIT_FAILED, "no committed checkpoint"),
    (["verify", "/tmp/not-a-step"], EXIT_FAILED, "/tmp/not-a-step: no such file or directory"),
    (["drill", "nosuchkey"], EXIT_FAILED, "no restorable checkpoint"),
    (["seal", "/tmp/no-such-seal-dir"], EXIT_FAILED, "no-such-seal-dir: no such file or"),
    (["seal", "config.toml"], EXIT_FAILED, "config.toml: not a directory"),
    (["seal", "."], EXIT_FAILED, "still being written: DCP shards without .metadata"),
    (["seal"], EXIT_USAGE, "DIR"),
    (["seal", ".", "--step", "-1"], EXIT_USAGE, "--step"),
    (["seal", ".", "--chunk-size", "1KiB"], EXIT_USAGE, "--chunk-size"),
    (["seal", ".", "--key", "a/b"], EXIT_USAGE, "invalid key"),
    # --- SLURM out of reach: exit 3
    (["maint", "n1", "--reason", "x", "--reboot"], EXIT_SLURM, "scontrol"),
]


@pytest.mark.parametrize(("argv", "code", "fragment"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_exit_code_and_one_line(site: Path, argv, code, fragment) -> None:
    got, out, err = run_here(entry=main_mod.main, argv=argv)
    assert got == code, (got, out, err)
    assert "Traceback" not in err and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckpt-slurm: error: "), err
    assert fragment in lines[0], err


CONFIG_CASES = [
    ("min_free = 1e400", "min_free: inf is too large"),
    ('min_free = "1e400GB"', "too large (at most 8EiB)"),
    ('min_free = "1000"', "'1000' has no unit: write 1000B, 1000MB or 1000MiB"),
    ('min_free = "10G"', "ambiguous"),
    ('[retention]\nkeep_warm_every = "6"', "retention.keep_warm_every: '6' has no unit"),
    ("[retention]\nkeep_warm_every = 1e400", "keep_warm_every: inf is too large"),
    ('[retention]\nkeep_warm_every = "1-25:00"', "below 24"),
    ("min_free = -1", "negative"),
    ('min_free = "1 GiB GiB"', "expected a size"),
    ("min_fre = 5", "did you mean"),
    ("root = /no/quotes", "TOML syntax error"),
]


@pytest.mark.parametrize(("line", "fragment"), CONFIG_CASES)
@pytest.mark.parametrize("where", ["before", "after"])
def test_bad_config_is_exit_2_one_line(site: Path, line: str, fragment: str, where: str) -> None:
    path = bad_config(site, line)
    argv = ["--config", str(path), "config", "check"]
    if where == "after":  # --config is accepted after the subcommand too
        argv = ["config", "check", "--config", str(path)]
    got, out, err = run_here(entry=main_mod.main, argv=argv)
    assert got == EXIT_USAGE, (got, out, err)
    (only,) = err.splitlines()
    assert only.startswith(f"ckpt-slurm: error: {path}") and fragment in only, only


def test_missing_config_in_any_position(site: Path) -> None:
    for argv in (
        ["--config", "/nonexistent.toml", "status"],
        ["status", "--config", "/nonexistent.toml"],
        ["list", "run", "--config", "/nonexistent.toml"],
    ):
        got, out, err = run_here(entry=main_mod.main, argv=argv)
        assert got == EXIT_USAGE and out == ""
        assert err.splitlines() == ["ckpt-slurm: error: no config: /nonexistent.toml not found"], (
            argv
        )


SRUN_CASES: List[Tuple[List[str], int, str]] = [
    (["--warn", "2", "--", "true"], EXIT_USAGE, "2s, 2min or 2h"),
    (["--warn", "soon", "--", "true"], EXIT_USAGE, "--warn"),
    (["--flush-timeout", "5", "--", "true"], EXIT_USAGE, "no unit"),
    (["--signal", "KILL", "--", "true"], EXIT_USAGE, "uncatchable"),
    (["--max-requeues", "-1", "--", "true"], EXIT_USAGE, "--max-requeues"),
    (["--key", "../x", "--", "true"], EXIT_USAGE, "invalid key"),
    (["--key", "k", "--", "true"], EXIT_USAGE, "SLURM_JOB_ID"),  # not inside a job: usage
]


@pytest.mark.parametrize(("argv", "code", "fragment"), SRUN_CASES)
def test_ckpt_srun_bad_input(site: Path, argv, code, fragment) -> None:
    got, out, err = run_here(entry=srun_mod.main, argv=argv)
    assert got == code, (got, out, err)
    assert "Traceback" not in err and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("ckpt-srun: error: "), err
    assert fragment in err


def test_the_table_is_big_and_covers_the_codes() -> None:
    assert len(CASES) + len(CONFIG_CASES) * 2 + len(SRUN_CASES) >= 60
    assert len(CASES) >= 60
    assert {c for _a, c, _f in CASES} == {EXIT_USAGE, EXIT_FAILED, EXIT_SLURM}
    assert set(EXIT_CODES) == {0, 1, 2, 3, 4, 130}


def test_good_inputs_take_units(site: Path) -> None:
    """The other side: the forms the tool prints, SLURM's forms, and units on every flag."""
    for mtbi in ("6h", "1h30m", "1d00h", "6:00:00", "1-00:00:00", "1-06", "90min", "2.5h"):
        got, out, err = run_here(
            entry=main_mod.main,
            argv=["plan", "--size", "1GB", "--pfs-bw", "1GB/s", "--mtbi", mtbi, "--parsable"],
        )
        assert got == 0 and err == "", (mtbi, err)
    got, out, err = run_here(entry=main_mod.main, argv=["guard", "-w", "n1", "--wait", "5min"])
    assert got == 0 and "nothing known" in out, err
