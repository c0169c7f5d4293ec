"""The CLI on a user's own checkpoints without a site config (issue 18, laptop mode).

* tier flags ``--local DIR [--warm DIR] [--cold DIR]`` (``--pfs``: the old name of
  ``--warm``) on ``list``, ``verify``, ``restore``, ``drill``, ``status`` and
  ``config check``;
* a per-user config (``$XDG_CONFIG_HOME/slurm-ckpt/config.toml``), read by a non-root
  user's user commands when the site has none; ``config check`` accepts its user-owned
  roots, while root keeps refusing them (and never reads a user's config).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
from conftest import need_root
from helpers.cli import ckpt_slurm, run_here
from helpers.site import Site

NOBODY = 65534


@pytest.fixture
def laptop(tmp_path: Path) -> Site:
    """A user's two directories with two checkpoints, the older one copied to 'pfs'."""
    s = Site(tmp_path / "me")
    for step in (1, 2):
        s.write(step, user="alice", key="run", files={"w.bin": os.urandom(3000)})
    s.copy(1, user="alice", key="run")
    return s


def _flags(s: Site, *tiers: str) -> List[str]:
    out: List[str] = []
    for t in tiers or ("local", "warm"):
        out += [f"--{t}", str(s.roots["pfs" if t in ("warm", "pfs") else t])]
    return out


def test_tier_flags_list_verify_restore_drill(laptop: Site, tmp_path: Path) -> None:
    f = _flags(laptop)
    r = ckpt_slurm("list", "run", "-u", "alice", "--json", *f)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["checkpoints"]
    assert sorted((x["tier"], x["step"]) for x in rows) == [("local", 1), ("local", 2), ("pfs", 1)]
    # A local tier alone is enough (a laptop with one disk).
    r = ckpt_slurm("list", "run", "-u", "alice", "--json", *_flags(laptop, "local"))
    assert r.returncode == 0, r.stderr
    assert {x["tier"] for x in json.loads(r.stdout)["checkpoints"]} == {"local"}
    assert ckpt_slurm("verify", "run", "-u", "alice", *f).returncode == 0
    back = tmp_path / "back"
    r = ckpt_slurm("restore", "run", "-u", "alice", "--tier", "pfs", "--to", str(back), *f)
    assert r.returncode == 0, r.stderr
    assert (back / "alice" / "run").is_dir()
    r = ckpt_slurm("drill", "run", "-u", "alice", "--json", *f)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 2
    r = ckpt_slurm("status", "--no-slurm", "-u", "alice", "--json", *f)
    assert r.returncode == 0, r.stderr
    r = ckpt_slurm("config", "check", *f)
    assert (r.returncode, r.stdout.strip()) == (0, "ok: <tier flags>"), r.stderr


def test_the_old_pfs_flag_still_names_the_warm_directory(laptop: Site) -> None:
    old = ckpt_slurm("list", "run", "-u", "alice", "--json", *_flags(laptop, "local", "pfs"))
    new = ckpt_slurm("list", "run", "-u", "alice", "--json", *_flags(laptop))
    assert old.returncode == 0 and new.returncode == 0, old.stderr + new.stderr
    rows = [
        {(x["tier"], x["step"], x["path"]) for x in json.loads(r.stdout)["checkpoints"]}
        for r in (old, new)
    ]
    assert rows[0] == rows[1] and ("pfs", 1) in {(t, s) for t, s, _ in rows[0]}


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["list", "--warm", "{pfs}"], "--warm needs --local DIR too"),
        (["list", "--pfs", "{pfs}"], "--warm needs --local DIR too"),  # the old name
        (["list", "--local", "{base}/absent"], "does not exist"),
        (["list", "--local", "{base}/c.toml"], "is a file"),
        (["list", "--local", "{local}", "--config", "{base}/c.toml"], "not both"),
        (["--config", "", "list"], "--config: empty path"),
        (["list", "--config", ""], "--config: empty path"),
        (["gc", "--local", "{local}"], "as root"),  # root works on the site's tiers only
        (["flush", "--local", "{local}"], "as root"),
        (["maint", "n1", "--local", "{local}"], "No such option"),  # root-run: site only
        # --tier warm without a warm tier: said in the words typed (it said "pfs")
        (["list", "run", "--tier", "warm", "--local", "{local}"], "warm: the warm tier is not"),
        (["verify", "run", "--tier", "warm", "--local", "{local}"], "with --warm DIR"),
        (["restore", "run", "--tier", "warm", "--to", "{base}/b", "--local", "{local}"], "warm:"),
    ],
)
def test_tier_flag_errors(laptop: Site, argv: List[str], needle: str) -> None:
    subst = {"pfs": laptop.roots["pfs"], "local": laptop.roots["local"], "base": laptop.base}
    code, out, err = run_here([a.format(**subst) for a in argv])
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def _as_nobody(argv: List[str], env: Dict[str, str], no_site: bool = True) -> Tuple[int, str, str]:
    """``ckpt-slurm argv`` in a forked child that became nobody, with ``env`` set and (when
    ``no_site``) the site config path pointing where nothing is: a laptop."""
    need_root()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        result = ["99", "", "unexpected"]
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.environ.pop("SLURM_CKPT_CONFIG", None)
            os.environ.update(env)
            import slurm_ckpt.cli.sources as sources
            import slurm_ckpt.core.config as core_config

            if no_site:  # this child only: a host with a real site config reads as none
                nowhere = Path(env["XDG_CONFIG_HOME"]) / "no-site.toml"
                sources.DEFAULT_CONFIG_PATH = core_config.DEFAULT_CONFIG_PATH = nowhere
            code, out, err = run_here(argv)
            result = [str(code), out, err]
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            result = ["98", "", f"{type(exc).__name__}: {exc}"]
        finally:
            os.write(w, json.dumps(result).encode())
            os._exit(0)
    os.close(w)
    with io.FileIO(r, "r") as fh:
        data = fh.readall().decode()
    os.waitpid(pid, 0)
    code, out, err = json.loads(data)
    return int(code), out, err


def _user_site(tmp_path: Path) -> Tuple[Site, Path]:
    """nobody's own tiers and config file ($XDG_CONFIG_HOME/slurm-ckpt/config.toml)."""
    home = tmp_path / "home"
    cfgdir = home / "slurm-ckpt"
    cfgdir.mkdir(parents=True)
    s = Site(tmp_path / "tiers", config_name="site-shape.toml")
    s.write(7, user="nobody", key="run")
    (cfgdir / "config.toml").write_text(s.cfg_path.read_text())
    for p in (tmp_path, home, cfgdir, cfgdir / "config.toml", s.base, *s.roots.values()):
        os.chown(p, NOBODY, NOBODY)
    for dirpath, dirnames, filenames in os.walk(s.base):
        for n in dirnames + filenames:
            os.chown(os.path.join(dirpath, n), NOBODY, NOBODY)
    os.chmod(tmp_path, 0o755)
    return s, home


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temporary directory nobody can reach (pytest's tmp_path sits below a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="ckpt-laptop-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_user_config_for_user_commands(open_tmp: Path) -> None:
    tmp_path = open_tmp
    s, home = _user_site(tmp_path)
    env = {"XDG_CONFIG_HOME": str(home), "HOME": str(tmp_path)}
    code, out, err = _as_nobody(["list", "run", "--json"], env)
    assert code == 0, err
    assert [(c["tier"], c["step"]) for c in json.loads(out)["checkpoints"]] == [("local", 7)]
    # config check accepts the user's own roots (owned by the user, not root) ...
    code, out, err = _as_nobody(["config", "check"], env)
    assert code == 0, err
    assert out.strip() == f"ok: {home}/slurm-ckpt/config.toml"
    assert "not root" not in err and "root must not use it: config" not in err
    # ... and as tier flags too.
    code, out, err = _as_nobody(["config", "check", "--local", str(s.roots["local"])], env)
    assert (code, out.strip()) == (0, "ok: <tier flags>"), err
    # Without a site config and without a user config: one line naming every way out.
    os.unlink(home / "slurm-ckpt" / "config.toml")
    code, out, err = _as_nobody(["list"], env)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--local DIR" in err and str(home / "slurm-ckpt" / "config.toml") in err


def test_root_keeps_requiring_a_root_owned_site_config(
    open_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_root()
    s, home = _user_site(open_tmp)
    user_cfg = home / "slurm-ckpt" / "config.toml"
    # Root checking that same file as a site config: refused, the roots are not root's.
    code, out, err = run_here(["config", "check", "--config", str(user_cfg)])
    assert code == 2 and "not root" in err, (out, err)
    # Root never reads a user's config, even with XDG_CONFIG_HOME pointing at it.
    import slurm_ckpt.cli.sources as sources
    import slurm_ckpt.core.config as core_config

    for mod in (sources, core_config):  # a host with a real site config reads as none
        monkeypatch.setattr(mod, "DEFAULT_CONFIG_PATH", open_tmp / "no-site.toml")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.delenv("SLURM_CKPT_CONFIG", raising=False)
    code, out, err = run_here(["list"])
    assert code == 2 and "no config" in err, err
    assert str(user_cfg) not in err
    # A root-run command run by nobody with a user config present does not take it
    # (gc and flush do: as a user they work on that user's own checkpoints).
    code, out, err = _as_nobody(["guard"], {"XDG_CONFIG_HOME": str(home)})
    assert code == 2 and "no config" in err, err


def test_config_check_never_tells_a_user_to_give_their_venv_to_root(
    open_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ckpt-slurm installed in a venv that someone other than root owns (a user's home):
    the advice is a root-owned install for the hooks, never ``chown root`` of the user's
    home or venv (which the old text gave)."""
    from slurm_ckpt.core.config import Config
    from slurm_ckpt.ops import install
    from slurm_ckpt.ops.config_check import check_trust

    home = open_tmp / "home" / "newbie"
    exe = home / "venv" / "bin" / "ckpt-slurm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/usr/bin/python3\n")
    for d in (open_tmp / "home", home, home / "venv", home / "venv" / "bin", exe):
        os.chown(d, 65534, 65534)  # nobody's, as a user's own install is
    monkeypatch.setattr(install, "ckpt_slurm_path", lambda: str(exe))
    local = open_tmp / "local"
    local.mkdir()
    found = [f.text for f in check_trust(Config.standalone(local))]
    assert len(found) == 1 and "root-owned venv" in found[0], found
    assert "chown root" not in found[0] and "/home/newbie" in found[0], found


def test_tier_warm_names_the_warm_tier(laptop: Site, tmp_path: Path) -> None:
    """One vocabulary: ``--tier warm`` works where ``--tier pfs`` does (list, verify,
    restore), whatever the warm tier's kind."""
    f = _flags(laptop)
    r = ckpt_slurm("list", "run", "-u", "alice", "--tier", "warm", "--json", *f)
    assert r.returncode == 0, r.stderr
    assert [(x["tier"], x["step"]) for x in json.loads(r.stdout)["checkpoints"]] == [("pfs", 1)]
    assert ckpt_slurm("verify", "run", "-u", "alice", "--tier", "warm", *f).returncode == 0
    back = tmp_path / "back"
    r = ckpt_slurm("restore", "run", "-u", "alice", "--tier", "warm", "--to", str(back), *f)
    assert r.returncode == 0 and "step 1 " in r.stdout, r.stdout
    assert " from the warm tier " in r.stdout and "pfs" not in r.stdout.split(" to ")[0], r.stdout
    # verify's table says warm too, as list's does (JSON keeps the tier's name, and a role)
    r = ckpt_slurm("verify", "run", "-u", "alice", *f)
    assert r.returncode == 0, r.stderr
    tiers = {ln.split()[0] for ln in r.stdout.splitlines()[2:] if ln.strip()}
    assert tiers == {"local", "warm"}, r.stdout
    r = ckpt_slurm("verify", "run", "-u", "alice", "--json", *f)
    roles = {(c["tier"], c["role"]) for c in json.loads(r.stdout)["checkpoints"]}
    assert roles == {("local", "local"), ("pfs", "warm")}, roles
    # a step the warm tier lacks: the error names the tier as the user did
    r = ckpt_slurm(
        "restore", "run", "-u", "alice", "--tier", "warm", "--step", "2", "--to", str(back), *f
    )
    assert r.returncode == 1 and r.stderr.strip().endswith("at step 2 on the warm tier"), r.stderr


def test_a_users_key_finds_its_ranks_series(tmp_path: Path) -> None:
    """A two-rank job saves ``run.rank00000`` and ``run.rank00001``: ``list run`` and
    ``verify run`` find both under the user's own key (they found nothing)."""
    import numpy as np

    from slurm_ckpt import Checkpointer

    local, warm = tmp_path / "nvme", tmp_path / "pfs"
    for rank in (0, 1):
        c = Checkpointer(local=str(local), warm=str(warm), key="run", rank=rank, world_size=2)
        c.save({"w": np.full(64, rank, dtype=np.float32)}, step=3)
        c.close()
    f = ["--local", str(local), "--warm", str(warm)]
    r = ckpt_slurm("list", "run", "--json", *f)
    assert r.returncode == 0, r.stderr
    got = sorted({(x["tier"], x["key"], x["step"]) for x in json.loads(r.stdout)["checkpoints"]})
    assert got == [
        ("local", "run.rank00000", 3),
        ("local", "run.rank00001", 3),
        ("pfs", "run.rank00000", 3),
        ("pfs", "run.rank00001", 3),
    ], got
    r = ckpt_slurm("verify", "run", "--json", *f)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["checkpoints"]) == 4, r.stdout
    # restore takes one series: the user's key names its ranks' series, in one line
    r = ckpt_slurm("restore", "run", "--to", str(tmp_path / "back"), *f)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "it is saved per rank (run.rank00000, run.rank00001)" in lines[0], lines
    assert "ckpt-slurm restore run.rank00000" in lines[0], lines
    r = ckpt_slurm("drill", "run", "--json", *f)  # rank 0's series: what its restart reads
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["ok"], doc["step"], doc["key"]) == (True, 3, "run.rank00000"), doc


def test_status_heads_the_warm_tier_warm(laptop: Site) -> None:
    """One vocabulary on the screen too: the warm tier's column is headed ``warm`` (it
    said ``pfs``), while JSON keeps the tier's own field names."""
    r = ckpt_slurm("status", "-u", "alice", *_flags(laptop))
    assert r.returncode == 0, r.stderr
    header = next(ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("job "))
    assert " warm " in f"{header} " and " pfs " not in f"{header} ", header


def test_status_on_a_workstation_with_an_unconfigured_slurm_client(
    laptop: Site, tmp_path: Path
) -> None:
    """SLURM's commands installed but no cluster behind them (no slurm.conf): that is a
    workstation, not an error to print under every status. Any other SLURM failure is
    still reported."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def fake(message: str) -> None:
        for cmd in ("squeue", "sinfo", "scontrol"):
            p = bin_dir / cmd
            p.write_text(f"#!/bin/sh\necho '{cmd}: error: {message}' >&2\nexit 1\n")
            p.chmod(0o755)

    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    fake("Could not establish a configuration source")
    r = ckpt_slurm("status", "-u", "alice", *_flags(laptop), env=env)
    assert r.returncode == 0, r.stderr
    assert "SLURM" not in r.stdout and "error" not in r.stdout + r.stderr, r.stdout
    assert "1 job," in r.stdout
    fake("Unable to contact slurm controller (connect failure)")
    r = ckpt_slurm("status", "-u", "alice", *_flags(laptop), env=env)
    assert r.returncode == 0, r.stderr
    assert "SLURM: " in r.stdout and "Unable to contact slurm controller" in r.stdout, r.stdout


def test_a_users_key_finds_its_dcp_parts(tmp_path: Path) -> None:
    """A DCP job's parts are ``run.dcp.rankNNNNN``: ``list run``, ``verify run``,
    ``drill run`` and ``status`` find them under the user's key (drill found nothing)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from slurm_ckpt import Checkpointer

    local, warm = tmp_path / "nvme", tmp_path / "pfs"
    c = Checkpointer(local=str(local), warm=str(warm), key="run", install_signals=False)
    model = torch.nn.Linear(4, 2)
    with warnings.catch_warnings():  # torch: "no process group: saving in one process"
        warnings.simplefilter("ignore", UserWarning)
        for step in (1, 2):
            dcp.save({"model": model.state_dict()}, storage_writer=c.dcp_writer(step=step))
    c.close()
    f = ["--local", str(local), "--warm", str(warm)]
    r = ckpt_slurm("list", "run", "--json", *f)
    assert r.returncode == 0, r.stderr
    got = sorted({(x["role"], x["key"], x["step"]) for x in json.loads(r.stdout)["checkpoints"]})
    assert got == [(t, "run.dcp.rank00000", s) for t in ("local", "warm") for s in (1, 2)], got
    r = ckpt_slurm("verify", "run", "--json", *f)
    assert r.returncode == 0 and len(json.loads(r.stdout)["checkpoints"]) == 4, r.stdout
    r = ckpt_slurm("drill", "run", "--json", *f)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["ok"], doc["step"], doc["key"]) == (True, 2, "run.dcp.rank00000"), doc
    r = ckpt_slurm("status", "--json", "-k", "run", *f)
    assert r.returncode == 0, r.stderr
    assert [g["key"] for g in json.loads(r.stdout)["jobs"][0]["key_groups"]] == ["run"], r.stdout
