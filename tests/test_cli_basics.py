"""``ckpt-slurm`` skeleton: version, help, config show/check, one-line errors, exit codes."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import click
import pytest
from helpers.cli import ckpt_slurm

from slurm_ckpt import __version__
from slurm_ckpt.cli import main as main_mod
from slurm_ckpt.core.config import load_config
from slurm_ckpt.errors import NotFound, SlurmError, VerifyError

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534

GOOD = """
[tiers]
shared = ["pfs"]
[tiers.local]
root = "/local/ckpt"
[tiers.pfs]
kind = "posix"
root = "/pfs/ckpt"
bandwidth_limit = "1GB/s"
[copy]
streams = 6
"""


def assert_one_line_error(proc, code: int, *fragments: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.endswith("\n")
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckpt-slurm: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert proc.stdout == ""
    return lines[0]


@pytest.fixture
def good_config(tmp_path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(GOOD)
    return path


# --------------------------------------------------------------------------- subprocess


def test_version():
    proc = ckpt_slurm("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"ckpt-slurm {__version__}"


def test_help_lists_config():
    proc = ckpt_slurm("--help")
    assert proc.returncode == 0
    assert "Usage: ckpt-slurm" in proc.stdout
    assert "--config PATH" in proc.stdout
    assert "config" in proc.stdout


def test_config_show_json(good_config):
    proc = ckpt_slurm("--config", str(good_config), "config", "show", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    data = json.loads(proc.stdout)
    assert data == load_config(good_config).to_dict()
    assert data["copy"]["streams"] == 6
    assert data["copy"]["chunk_size"] == 64 * 2**20
    assert data["tiers"]["pfs"]["bandwidth_limit"] == 1e9
    assert data["ledger"]["dir"] == "/local/ckpt/.slurm_ckpt"
    assert data["tiers"]["object"] is None


def test_config_show_human(good_config):
    proc = ckpt_slurm("--config", str(good_config), "config", "show")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert str(good_config) in out
    for text in ("[tiers.local]", "/local/ckpt", "[copy]", "64.0MiB", "SIGUSR1", "[hooks]"):
        assert text in out


def test_config_from_env(good_config):
    proc = ckpt_slurm("config", "show", "--json", config=str(good_config))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["copy"]["streams"] == 6


def test_explicit_config_beats_env(good_config, tmp_path):
    proc = ckpt_slurm(
        "--config",
        str(good_config),
        "config",
        "check",
        "--offline",
        config=str(tmp_path / "no.toml"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ok: {good_config} (offline: file only)"


def test_config_check_ok(good_config):
    proc = ckpt_slurm("--config", str(good_config), "config", "check", "--offline")
    assert proc.returncode == 0
    assert proc.stdout == f"ok: {good_config} (offline: file only)\n"
    assert proc.stderr == ""
    # Without --offline the roots are looked at: /pfs/ckpt does not exist here.
    proc = ckpt_slurm("--config", str(good_config), "config", "check")
    assert_one_line_error(proc, 2, "tiers.pfs.root /pfs/ckpt does not exist")


def test_config_check_invalid(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[tiers.local]\nroot = "rel"\n[copy]\nstreems = 2\n')
    proc = ckpt_slurm("--config", str(path), "config", "check")
    line = assert_one_line_error(
        proc,
        2,
        "tiers.local.root: must be an absolute path",
        "did you mean 'copy.streams'?",
        "[tiers.pfs] is missing (required)",
    )
    assert line.count("; ") == 2


def test_config_show_invalid(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(GOOD + "[job]\nsignals = 'TERM'\n")
    proc = ckpt_slurm("--config", str(path), "config", "show", "--json")
    assert_one_line_error(proc, 2, "job.signals")


def test_toml_syntax_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[tiers.local]\nroot = /no/quotes\n")
    proc = ckpt_slurm("--config", str(path), "config", "check")
    assert_one_line_error(proc, 2, "TOML syntax error", "line 2")


def test_missing_config_file(tmp_path):
    proc = ckpt_slurm("--config", str(tmp_path / "nope.toml"), "config", "show")
    assert_one_line_error(proc, 2, f"no config: {tmp_path / 'nope.toml'} not found")


def test_missing_env_config_file(tmp_path):
    proc = ckpt_slurm("config", "check", config=str(tmp_path / "nope.toml"))
    assert_one_line_error(proc, 2, "not found (from SLURM_CKPT_CONFIG)")


@pytest.mark.skipif(
    os.path.exists("/etc/slurm-ckpt/config.toml"), reason="a real site config is installed"
)
def test_missing_default_config():
    proc = ckpt_slurm("config", "check")
    line = assert_one_line_error(proc, 2)
    assert line == (
        "ckpt-slurm: error: no config: /etc/slurm-ckpt/config.toml not found "
        "(set SLURM_CKPT_CONFIG or pass --config)"
    )


def test_config_is_loaded_lazily(tmp_path):
    # --help of a config-using command and --version never read the (missing) config.
    for args in (["config", "show", "--help"], ["--version"], ["--help"]):
        proc = ckpt_slurm("--config", str(tmp_path / "nope.toml"), *args)
        assert proc.returncode == 0, (args, proc.stderr)


@pytest.mark.parametrize("args", [["no-such-command"], ["config", "show", "--nope"], ["--config"]])
def test_usage_errors_are_one_line_exit_2(args):
    proc = ckpt_slurm(*args)
    line = assert_one_line_error(proc, 2)
    assert line.endswith("--help')"), line  # points at the help


def test_group_without_subcommand_shows_help():
    proc = ckpt_slurm("config")
    assert "Traceback" not in proc.stderr
    assert "show" in proc.stdout + proc.stderr
    assert "check" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- in process


def _main_exit(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main_mod.main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


@pytest.fixture
def raising_command():
    """A temporary ``_raise KIND`` command on the real group."""
    errors = {
        "notfound": NotFound("no committed checkpoint for step 7"),
        "verify": VerifyError("shard 3 of step 7:\n checksum mismatch"),
        "slurm": SlurmError("scontrol not found"),
        "eacces": PermissionError(errno.EACCES, "Permission denied", "/pfs/ckpt/x"),
        "enospc": OSError(errno.ENOSPC, "No space left on device", "/local/a", None, "/local/b"),
        "ebadf": OSError(errno.EBADF, "Bad file descriptor"),
        "interrupt": KeyboardInterrupt(),
        "bug": ValueError("a real bug"),
    }

    @click.command("_raise")
    @click.argument("kind")
    def _raise(kind):
        if kind == "status":
            return 5
        if kind == "abort":
            raise click.Abort()
        raise errors[kind]

    main_mod.cli.add_command(_raise)
    yield
    del main_mod.cli.commands["_raise"]


@pytest.mark.parametrize(
    ("kind", "code", "line"),
    [
        ("notfound", 1, "ckpt-slurm: error: no committed checkpoint for step 7"),
        ("verify", 1, "ckpt-slurm: error: shard 3 of step 7: checksum mismatch"),
        ("slurm", 3, "ckpt-slurm: error: scontrol not found"),
        ("eacces", 1, "ckpt-slurm: error: /pfs/ckpt/x: Permission denied"),
        ("enospc", 1, "ckpt-slurm: error: /local/a -> /local/b: No space left on device"),
        ("interrupt", 130, "ckpt-slurm: error: interrupted"),
        ("abort", 1, "ckpt-slurm: error: aborted"),
    ],
)
def test_main_maps_errors_to_one_line(capsys, raising_command, kind, code, line):
    got_code, out, err = _main_exit(capsys, ["_raise", kind])
    assert got_code == code
    assert out == ""
    # click echoes a newline before turning Ctrl-C into Abort; the message is one line.
    assert err.strip("\n").splitlines() == [line]


def test_main_command_status_and_bugs(capsys, raising_command):
    assert _main_exit(capsys, ["_raise", "status"])[0] == 5
    with pytest.raises(ValueError, match="a real bug"):
        main_mod.main(["_raise", "bug"])
    with pytest.raises(OSError, match="Bad file descriptor"):
        main_mod.main(["_raise", "ebadf"])


def test_main_usage_error_in_process(capsys):
    code, out, err = _main_exit(capsys, ["--bogus"])
    assert code == 2
    (line,) = err.splitlines()
    assert line.startswith("ckpt-slurm: error: No such option") and "--bogus" in line
    assert line.endswith(" (see 'ckpt-slurm --help')")


def test_main_ok_in_process(capsys, good_config):
    code, out, err = _main_exit(
        capsys, ["--config", str(good_config), "config", "check", "--offline"]
    )
    assert (code, out, err) == (0, f"ok: {good_config} (offline: file only)\n", "")


def _main_as_nobody(argv):
    """Run main(argv) in a forked child that dropped root; return (exit code, stderr)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        result = "99\nunexpected"
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            sys.stderr = io.StringIO()
            sys.stdout = io.StringIO()
            try:
                main_mod.main(argv)
            except SystemExit as exc:
                result = f"{exc.code}\n{sys.stderr.getvalue()}"
        except BaseException as exc:  # noqa: BLE001 - report anything to the parent
            result = f"98\n{type(exc).__name__}: {exc}"
        finally:
            os.write(w, result.encode())
            os._exit(0)
    os.close(w)
    with io.FileIO(r, "r") as fh:
        data = fh.readall().decode()
    os.waitpid(pid, 0)
    code, _, err = data.partition("\n")
    return int(code), err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody")
def test_unreadable_config_as_non_root():
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-cli-"))
    try:
        tmp.chmod(0o755)
        path = tmp / "config.toml"
        path.write_text(GOOD)
        path.chmod(0o000)
        code, err = _main_as_nobody(["--config", str(path), "config", "check"])
        assert code == 2
        assert err == f"ckpt-slurm: error: cannot read config {path}: permission denied\n"
    finally:
        shutil.rmtree(tmp)


#: What a quick look must not import: the heavy libraries, and for --version/--help any
#: command's modules (ops, tiers, job, node...).
HEAVY = ("torch", "numpy", "boto3", "botocore", "rich")

_IMPORTS = """
import json, sys
from slurm_ckpt.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.stderr.write(json.dumps(sorted(sys.modules)))
"""


def _modules_after(*args: str, config: Path = None) -> set:
    """The modules a fresh interpreter holds after ``ckpt-slurm ARGS`` (structural, not timed)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("SLURM_CKPT_CONFIG", None)
    if config is not None:
        env["SLURM_CKPT_CONFIG"] = str(config)
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", _IMPORTS, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return set(json.loads(proc.stderr.splitlines()[-1]))


def _top(mods: set) -> set:
    return {m.split(".")[0] for m in mods}


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_imports_nothing_but_the_package(flag):
    """``--version`` answers before click or any command module is imported."""
    mods = _modules_after(flag)
    assert not _top(mods) & {*HEAVY, "click"}, sorted(_top(mods) & {*HEAVY, "click"})
    ours = sorted(m for m in mods if m.startswith("slurm_ckpt"))
    assert ours == ["slurm_ckpt", "slurm_ckpt.cli", "slurm_ckpt.cli.main", "slurm_ckpt.errors"]


def test_help_imports_no_command_module():
    """``--help`` lists the commands from the table in slurm_ckpt.cli.app, importing none."""
    mods = _modules_after("--help")
    assert not _top(mods) & set(HEAVY), sorted(_top(mods) & set(HEAVY))
    layers = {"ops", "tiers", "job", "node", "ledger", "slurm", "hooks", "admission"}
    deep = sorted(m for m in mods if m.startswith("slurm_ckpt.") and m.split(".")[1] in layers)
    assert deep == [], deep
    commands = {m for _n, m, _a, _s in main_mod.COMMANDS}
    assert not mods & commands, sorted(mods & commands)


def test_status_json_imports_no_torch_boto3_or_rich(tmp_path):
    """``status --json`` on a site without an object tier needs none of them."""
    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[tiers.local]\nroot = "{tmp_path}/l"\nrequire_mount = false\nmin_free = 0\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{tmp_path}/p"\n'
    )
    mods = _modules_after("status", "--json", "--no-slurm", config=cfg)
    assert "slurm_ckpt.ops.status" in mods  # it did run
    assert not _top(mods) & set(HEAVY), sorted(_top(mods) & set(HEAVY))
