"""The cases that already held, kept as regressions: symlinks planted at every level,
directories swapped for symlinks while root works, path traversal in names, and
user-chosen text on its way into ``scontrol``. Root never reads, copies, chmods, chowns
or deletes through them, and never passes user text to SLURM.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import time
from pathlib import Path
from typing import Any, Callable, List

import pytest

from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.prolog import run_prolog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.registry import tiers_from_config

from .conftest import (
    ATTACKER,
    NODE,
    SECRET,
    VICTIM,
    Recorder,
    Site,
    as_user,
    cli,
    ids,
    save,
    steps,
    tree_contains,
)


def _secret_dir(site: Site) -> Path:
    """A root-only directory holding a root-only file: what the links point at."""
    d = site.base / "root-only"
    d.mkdir(mode=0o700, exist_ok=True)
    (d / "model.bin").write_bytes(SECRET)
    os.chmod(d / "model.bin", 0o600)
    (d / "manifest.json").write_bytes(SECRET)
    return d


def _untouched(d: Path) -> None:
    st = os.lstat(d)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
    for name in ("model.bin", "manifest.json"):
        f = d / name
        assert f.read_bytes() == SECRET and os.lstat(f).st_uid == 0


def _plant(cfg: Any, levels: List[str], target: str) -> None:
    """As the attacker, in their own trees: a symlink at each of ``levels`` (each in a
    series of its own, ``evil-<level>``, so that one does not hide another)."""
    local, pfs = str(cfg.tiers.local.root), str(cfg.tiers.pfs.root)
    for level in levels:
        kdir = os.path.join(local, ATTACKER, f"evil-{level}")
        sdir = os.path.join(kdir, step_dirname(1))
        if level == "pfs-user":
            os.symlink(target, os.path.join(pfs, ATTACKER))
        elif level == "key":
            os.symlink(target, os.path.join(local, ATTACKER, "evil-linked"))
        elif level == "step":
            os.symlink(target, os.path.join(kdir, step_dirname(7)))
        else:
            name = "model.bin" if level == "payload" else "manifest.json"
            os.unlink(os.path.join(sdir, name))
            os.symlink(os.path.join(target, name), os.path.join(sdir, name))


@pytest.mark.parametrize(
    "levels", [["key", "step", "payload", "manifest"], ["pfs-user"]], ids=["local", "pfs"]
)
def test_symlinks_at_every_level_are_never_followed(site: Site, levels: List[str]) -> None:
    cfg = site.cfg(retention={"keep_local": 1})
    conf = site.config_file(retention={"keep_local": 1})
    secret = _secret_dir(site)
    save(cfg, VICTIM, "good", 1)
    for level in levels:
        save(cfg, ATTACKER, f"evil-{level}", 1)
    as_user(ATTACKER, _plant, cfg, levels, str(secret))
    rep = run_epilog(cfg, site.env(ATTACKER), Recorder())
    stager_pass(cfg, NODE, Recorder())
    run_prolog(cfg, site.env(ATTACKER, job="101"), Recorder())
    for args in (["gc"], ["verify", "evil-step", "-u", ATTACKER], ["list"], ["status"]):
        r = cli(*args, "--no-slurm" if args == ["status"] else "--json", config=conf)
        assert "Traceback" not in r.stderr and SECRET.decode() not in r.stdout + r.stderr
    _untouched(secret)
    assert not tree_contains(site.pfs, SECRET)
    assert steps(cfg, "pfs", VICTIM, "good") == [1]
    assert rep.backlog == (0, 0)


class _Swapper:
    """The attacker's process: swaps their key directory for a symlink to a root-only
    directory and back, as fast as it can, while root works."""

    def __init__(self, kdir: str, target: str) -> None:
        self.kdir, self.target = kdir, target

    def __enter__(self) -> _Swapper:
        u = ids(ATTACKER)
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the attacker
            try:
                os.setgroups([])
                os.setresgid(u.gid, u.gid, u.gid)
                os.setresuid(u.uid, u.uid, u.uid)
                aside = self.kdir + ".real"
                while True:
                    try:
                        os.rename(self.kdir, aside)
                        os.symlink(self.target, self.kdir)
                        os.unlink(self.kdir)
                        os.rename(aside, self.kdir)
                    except OSError:
                        time.sleep(0.0005)
            finally:
                os._exit(0)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def test_directories_swapped_for_symlinks_during_root_work(site: Site, no_hang: Callable) -> None:
    cfg = site.cfg(retention={"keep_local": 1})
    secret = _secret_dir(site)
    save(cfg, VICTIM, "good", 1)
    for step in (1, 2, 3):
        save(cfg, ATTACKER, "evil", step)
    kdir = str(site.local / ATTACKER / "evil")
    no_hang(180)
    with _Swapper(kdir, str(secret)):
        for _ in range(3):
            run_epilog(cfg, site.env(ATTACKER), Recorder())
            stager_pass(cfg, NODE, Recorder())
    _untouched(secret)
    assert not tree_contains(site.pfs, SECRET)
    assert steps(cfg, "pfs", VICTIM, "good") == [1]
    if os.path.islink(kdir):
        os.unlink(kdir)
    if os.path.isdir(kdir + ".real"):
        if os.path.isdir(kdir):
            # Root's work made the key directory anew (a step lock) in a window of the
            # swap: a real directory, nothing of the secret in it (checked above).
            assert not os.path.islink(kdir) and not tree_contains(Path(kdir), SECRET)
            shutil.rmtree(kdir)
        os.rename(kdir + ".real", kdir)


def test_traversal_in_names_is_refused(site: Site) -> None:
    conf = site.config_file()
    for args in (
        ["list", "../../etc"],
        ["list", "-u", "../root"],
        ["status", "--user", "../etc"],
        ["gc", "--key", "a/../../b"],
    ):
        r = cli(*args, config=conf, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (args, r.stderr)
        assert r.stderr.startswith("ckpt-slurm: error: ")
    cfg = site.cfg()

    def odd_names(local: str) -> None:
        base = os.path.join(local, ATTACKER)
        os.makedirs(os.path.join(base, "..evil", "step-0000000001"))
        os.makedirs(os.path.join(base, "k", "step-../"), exist_ok=True)
        os.makedirs(os.path.join(base, "k", "step-1"))

    save(cfg, ATTACKER, "k", 2)
    as_user(ATTACKER, odd_names, str(site.local))
    run_epilog(cfg, site.env(ATTACKER), Recorder())
    assert steps(cfg, "pfs", ATTACKER, "k") == [2]
    assert sorted(os.listdir(site.pfs / ATTACKER)) == ["k"]


def test_no_user_text_reaches_scontrol(site: Site) -> None:
    """A failure nobody chose (the PFS full) with the attacker's names all over it: the
    drain reason SLURM gets is counts and sizes and where to look, nothing else."""
    site.pfs = site.mounts.tmpfs("1m", "pfs-tiny")
    os.chmod(site.pfs, 0o1777)
    cfg = site.cfg()
    save(cfg, ATTACKER, "x=1+reason=pwned", 1, nbytes=1_500_000, job="1 State=RESUME")
    slurm = Recorder()
    rep = run_epilog(cfg, site.env(ATTACKER), slurm)
    assert rep.flush.failed and slurm.drains
    for reason in slurm.drains:
        assert re.fullmatch(
            r"slurm_ckpt: flushing \d+ checkpoints? \([0-9.]+[KMGTP]?i?B\)"
            r"(; \d+ failing)?; see ckpt-slurm status",
            reason,
        ), reason


def test_a_copy_never_lands_in_another_users_tree(site: Site) -> None:
    """The copy engine commits as the owner, below the owner's own directory: a
    manifest naming another user is refused, not written there."""
    cfg = site.cfg()
    save(cfg, ATTACKER, "evil", 1)

    def copy_as_victim_named() -> str:
        t = tiers_from_config(cfg)
        try:
            copy_checkpoint(t["local"], t["pfs"], VICTIM, "evil", 1)
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__
        return "copied"

    assert as_user(ATTACKER, copy_as_victim_named) != "copied"
    assert not (site.pfs / VICTIM).exists()
