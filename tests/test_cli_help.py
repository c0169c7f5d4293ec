"""Help and discoverability (issue 11, item 7): admin commands apart, whole summaries, an
example for every command, ``--config`` in any position, ``ckpt-srun --version`` its
own, ``list`` without a KEY."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Tuple

import click
import pytest
from helpers.cli import run_here

from slurm_ckpt import __version__
from slurm_ckpt.cli import main as main_mod
from slurm_ckpt.cli import srun as srun_mod
from slurm_ckpt.cli.help import ADMIN_COMMANDS, EXAMPLES, short_help
from slurm_ckpt.tiers.posix import PosixTier


def all_commands() -> List[Tuple[str, click.Command]]:
    out = []
    for name, cmd in main_mod.cli.all_commands().items():
        out.append((name, cmd))
        if isinstance(cmd, click.Group):
            out += [(f"{name} {sub}", c) for sub, c in cmd.commands.items()]
    return out


def test_top_level_help_groups_admin_commands_and_cuts_nothing() -> None:
    code, out, err = run_here(entry=main_mod.main, argv=["--help"])
    assert code == 0 and err == ""
    user_part, _, admin_part = out.partition("Admin commands")
    assert admin_part, out
    names = set(main_mod.cli.all_commands())
    for name in names:
        in_admin = any(line.split()[:1] == [name] for line in admin_part.splitlines())
        in_user = any(line.split()[:1] == [name] for line in user_part.splitlines())
        assert in_admin == (name in ADMIN_COMMANDS) and in_user != in_admin, name
    listing = out.partition("Commands:")[2]
    assert "..." not in listing  # no summary cut short
    for name, cmd in main_mod.cli.all_commands().items():  # each summary is its whole sentence
        assert " ".join(short_help(cmd).split()) in " ".join(listing.split()), name
    assert "Exit status: 0 ok, 1 failed operation" in " ".join(out.split())


@pytest.mark.parametrize(("path", "cmd"), all_commands(), ids=[p for p, _ in all_commands()])
def test_every_command_has_an_example_and_takes_config(path: str, cmd: click.Command) -> None:
    assert EXAMPLES.get(path), f"no example for {path}"
    code, out, err = run_here(entry=main_mod.main, argv=[*path.split(), "--help"])
    assert code == 0, err
    assert "Examples:" in out and EXAMPLES[path][0] in out
    if not isinstance(cmd, click.Group):
        assert "--config" in out  # accepted after the subcommand too


def test_config_after_the_subcommand_wins(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        '[tiers]\nshared = ["pfs"]\n[tiers.local]\nroot = "/l"\n'
        '[tiers.pfs]\nkind = "posix"\nroot = "/p"\n'
    )
    code, out, err = run_here(
        entry=main_mod.main, argv=["config", "check", "--offline", "--config", str(good)]
    )
    assert (code, out, err) == (0, f"ok: {good} (offline: file only)\n", "")
    code, out, err = run_here(
        entry=main_mod.main,
        argv=[
            "--config",
            str(tmp_path / "nope.toml"),
            "config",
            "check",
            "--offline",
            "--config",
            str(good),
        ],
    )
    assert (code, out) == (0, f"ok: {good} (offline: file only)\n"), err


def test_ckpt_srun_answers_version_and_help_itself() -> None:
    code, out, err = run_here(entry=srun_mod.main, argv=["--version"])
    assert (code, out.strip()) == (0, f"ckpt-srun {__version__}"), err
    code, out, err = run_here(entry=srun_mod.main, argv=["--help"])
    assert code == 0 and out.startswith("Usage: ckpt-srun") and "exec ckpt-srun" in out


def test_list_without_key_lists_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for d in ("local", "pfs"):
        (tmp_path / d).mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[tiers.local]\nroot = "{tmp_path / "local"}"\nrequire_mount = false\nmin_free = 0\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{tmp_path / "pfs"}"\n'
    )
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(cfg))
    local = PosixTier("local", str(tmp_path / "local"))
    for user, key, steps in (("alice", "run-a", (1, 2)), ("bob", "run-b", (7,))):
        for step in steps:
            with local.writer(user, key, step) as w:
                w.write_buffers({"x.bin": b"x" * 100})
                w.commit()
    code, out, err = run_here(entry=main_mod.main, argv=["list", "--parsable"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "tier|user|key|steps|step|bytes|age_s|damaged|path"
    rows = [dict(zip(lines[0].split("|"), line.split("|"))) for line in lines[1:]]
    if os.geteuid() == 0:  # root: every user's series
        got = {(r["user"], r["key"], r["steps"], r["step"]) for r in rows}
        assert got == {("alice", "run-a", "2", "2"), ("bob", "run-b", "1", "7")}
    code, out, err = run_here(
        entry=main_mod.main, argv=["list", "-u", "bob", "--parsable", "--noheader"]
    )
    assert code == 0 and [line.split("|")[:5] for line in out.splitlines()] == [
        ["local", "bob", "run-b", "1", "7"]
    ]
    code, out, err = run_here(entry=main_mod.main, argv=["list", "-u", "carol"])
    assert code == 0 and out == "no committed checkpoints of carol\n", err


def test_shell_completion_is_clicks_and_completes_commands() -> None:
    """docs/cli.md: `eval "$(_CKPT_SLURM_COMPLETE=bash_source ckpt-slurm)"`."""
    import os
    import subprocess
    import sys

    exe = os.path.join(os.path.dirname(sys.executable), "ckpt-slurm")
    src = subprocess.run(
        [exe],
        env={**os.environ, "_CKPT_SLURM_COMPLETE": "bash_source"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert src.returncode == 0 and "_ckpt_slurm_completion()" in src.stdout, src
    env = {
        **os.environ,
        "_CKPT_SLURM_COMPLETE": "bash_complete",
        "COMP_WORDS": "ckpt-slurm st",
        "COMP_CWORD": "1",
    }
    got = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=60)
    assert got.stdout.split() == ["plain,stager", "plain,status"], got


def test_other_operating_systems_get_one_line() -> None:
    import pytest

    from slurm_ckpt.core.platform import require_supported_os
    from slurm_ckpt.errors import CkptError

    require_supported_os("linux")
    for other in ("darwin", "win32", "freebsd13"):
        with pytest.raises(CkptError, match="runs on Linux only"):
            require_supported_os(other)


def test_listed_summaries_are_the_commands_own() -> None:
    """``--help`` lists the summaries kept in the command table (so that it imports no
    command module); each must be the command's own first sentence, whole."""
    loaded = main_mod.cli.all_commands()
    for name, _module, _attr, summary in main_mod.COMMANDS:
        assert summary == short_help(loaded[name]), name


def test_every_command_is_registered_with_examples_and_the_index_is_current() -> None:
    """One registration per command, beside it (``@register``, slurm_ckpt/cli/registry.py):
    every command and subcommand the application has is registered, with examples, and
    the index ``--help`` reads (command_index.py) is what the registrations generate."""
    from slurm_ckpt.cli import command_index, registry

    regs = registry.declared()
    paths = {name for name, _c in all_commands()}
    assert sorted(regs) == sorted(paths)
    assert [p for p, (reg, _c) in regs.items() if not reg.examples] == []
    text = Path(command_index.__file__).read_text()
    assert registry.render_index() == text, "stale: python -m slurm_ckpt.cli.registry --write"


def test_a_registration_without_examples_fails_when_its_module_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from slurm_ckpt.cli import registry
    from slurm_ckpt.cli.registry import register

    monkeypatch.setattr(registry, "_DECLARED", {})  # the application's stay untouched
    for bad in ((), ("",), ("  ",)):
        with pytest.raises(ValueError, match="at least one example"):
            register("new-command", examples=bad)
    cmd = click.Command("twice")
    register("twice-test", examples=("ckpt-slurm twice-test",))(cmd)
    with pytest.raises(ValueError, match="registered twice"):
        register("twice-test", examples=("ckpt-slurm twice-test",))(click.Command("other"))
