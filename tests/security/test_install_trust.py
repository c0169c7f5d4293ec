"""Attack 9: what root runs and reads at every job end must be root's alone.

* ``install-hooks`` kept a 0777 destination: a user replaced ``epilog`` and root ran it;
* a world-writable config passed ``config check``, ``install-hooks`` and the hooks: a
  user set ``ledger.dir`` and root renamed a root-owned directory aside and wrote there;
* ``--log-file`` in a sticky public directory followed a user's symlink.

Now each is refused (exit 2, one line saying what to fix), like ``sudo`` or ``sshd``
refuse files a user could have changed; the hook scripts append to their log with
``O_NOFOLLOW``.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
from pathlib import Path
from typing import Dict

import pytest

from slurm_ckpt.errors import ConfigError
from slurm_ckpt.ops import install as install_mod

from .conftest import ATTACKER, VICTIM, Site, cli, ids


def _hook_env(site: Site, job: str = "100") -> Dict[str, str]:
    """A job environment as slurmd sets it, for a node that does not exist, and a real
    SLURM client pointed at nothing: a controller on a closed local port (a drain
    attempt fails at once; no real node is touched)."""
    conf = site.base / "slurm.conf"
    conf.write_text(
        "ClusterName=nowhere\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\n"
        "MessageTimeout=1\n"
    )
    u = pwd.getpwnam(VICTIM)
    return {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_USER": VICTIM,
        "SLURM_JOB_UID": str(u.pw_uid),
        "SLURM_JOB_GID": str(u.pw_gid),
        "SLURMD_NODENAME": "sec-no-such-node",
        "SLURM_SCRIPT_CONTEXT": "epilog_slurmd",
        "SLURM_CONF": str(conf),
    }


def test_hooks_directory_writable_by_others_is_refused(site: Site) -> None:
    conf = site.config_file()
    for mode, owner in ((0o777, 0), (0o755, ids(ATTACKER).uid)):
        dest = site.base / f"hooks-{mode:o}-{owner}"
        dest.mkdir()
        os.chmod(dest, mode)
        os.chown(dest, owner, -1)
        r = cli("install-hooks", "--dest", str(dest), "--config", str(conf))
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.startswith("ckpt-slurm: error: refusing") and r.stderr.count("\n") == 1
        assert "hooks directory" in r.stderr and "fix" in r.stderr
        assert os.listdir(dest) == []  # nothing written where a user could replace it
    # Below a directory a user owns (they could rename the hooks directory away).
    theirs = site.base / "theirs"
    theirs.mkdir()
    os.chown(theirs, ids(ATTACKER).uid, -1)
    r = cli("install-hooks", "--dest", str(theirs / "hooks"), "--config", str(conf))
    assert r.returncode == 2 and not (theirs / "hooks").exists()
    # A root-only destination: installed.
    good = site.base / "hooks-ok"
    r = cli("install-hooks", "--dest", str(good), "--config", str(conf))
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.lstat(good / "epilog").st_mode) == 0o755


def test_a_config_users_can_write_is_refused_everywhere(site: Site) -> None:
    precious = site.base / "root-owned"
    precious.mkdir(mode=0o700)
    (precious / "keep").write_text("root's")
    # The attacker's choice: root's ledger in a directory of root's.
    conf = site.config_file(ledger={"dir": str(precious)})
    os.chmod(conf, 0o666)
    r = cli("config", "check", config=conf)
    assert r.returncode == 2 and "config" in r.stderr and "writable by others" in r.stderr
    r = cli("install-hooks", "--dest", str(site.base / "hooks"), "--config", str(conf))
    assert r.returncode == 2 and not (site.base / "hooks").exists()
    for hook in ("epilog", "prolog"):
        r = cli(hook, config=conf, env=_hook_env(site))
        assert r.returncode == 2, r.stdout + r.stderr
        assert "refusing" in r.stderr and r.stderr.count("ckpt-slurm: error") == 1
    r = cli("stager", "--once", "--no-slurm", "-w", "n1", config=conf)
    assert r.returncode == 2 and "refusing" in r.stderr
    assert sorted(os.listdir(precious)) == ["keep"]  # never renamed, never written
    assert not [n for n in os.listdir(site.base) if ".untrusted-" in n]
    # The same file, root's again: accepted.
    os.chmod(conf, 0o644)
    assert cli("config", "check", config=conf).returncode == 0
    # A config below a directory a user owns is just as bad.
    theirs = site.base / "theirs"
    theirs.mkdir()
    os.chown(theirs, ids(ATTACKER).uid, -1)
    conf2 = site.config_file(theirs / "site.toml")
    r = cli("config", "check", config=conf2)
    assert r.returncode == 2 and str(theirs) in r.stderr


def test_log_file_in_a_public_directory_is_refused(site: Site) -> None:
    conf = site.config_file()
    public = site.base / "public"
    public.mkdir()
    os.chmod(public, 0o1777)  # sticky, like /tmp
    r = cli(
        "install-hooks",
        "--dest",
        str(site.base / "hooks"),
        "--config",
        str(conf),
        "--log-file",
        str(public / "hooks.log"),
    )
    assert r.returncode == 2 and "log file" in r.stderr
    # ... and so is a symlink a user planted there for it.
    shadow = site.base / "shadow"
    shadow.write_text("root only\n")
    os.chmod(shadow, 0o600)

    def plant(path: str, target: str) -> None:
        os.symlink(target, path)

    from .conftest import as_user

    as_user(ATTACKER, plant, str(public / "hooks.log"), str(shadow))
    with pytest.raises(ConfigError, match="log file"):
        install_mod.install_hooks(
            site.base / "hooks", str(conf), str(public / "hooks.log"), client=None
        )
    assert shadow.read_text() == "root only\n"


def test_hook_script_never_logs_through_a_symlink(site: Site) -> None:
    """Even where a symlink got there (protected_symlinks=0, a careless admin), the hook
    script appends with O_NOFOLLOW: the target is never written."""
    fake = site.base / "fake-ckpt-slurm"
    fake.write_text("#!/bin/sh\necho hello from the hook\n")
    fake.chmod(0o755)
    precious = site.base / "precious"
    precious.write_text("keep\n")
    log = site.base / "hooks.log"
    log.symlink_to(precious)
    script = site.base / "epilog"
    script.write_text(install_mod.render_hook("epilog", str(fake), "/x.toml", 5, str(log)))
    script.chmod(0o755)
    proc = subprocess.run([str(script)], env={}, capture_output=True, timeout=60)
    assert proc.returncode == 0
    assert precious.read_text() == "keep\n" and log.is_symlink()
    log.unlink()
    proc = subprocess.run([str(script)], env={}, capture_output=True, timeout=60)
    assert "hello from the hook" in log.read_text()
    st = os.lstat(log)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022


def test_an_executable_users_can_change_is_refused(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = site.config_file()
    bindir = site.base / "bin"
    bindir.mkdir()
    exe = bindir / "ckpt-slurm"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    os.chmod(bindir, 0o777)  # anyone may replace it
    monkeypatch.setattr(install_mod, "ckpt_slurm_path", lambda: str(exe))
    with pytest.raises(ConfigError, match="ckpt-slurm executable"):
        install_mod.install_hooks(site.base / "hooks", str(conf), client=None)
    os.chmod(bindir, 0o755)
    os.chown(exe, ids(ATTACKER).uid, -1)  # the file itself a user's
    with pytest.raises(ConfigError, match="owned by uid"):
        install_mod.install_hooks(site.base / "hooks", str(conf), client=None)
    os.chown(exe, 0, -1)
    done = install_mod.install_hooks(site.base / "hooks", str(conf), client=None)
    assert done.exe == str(exe) and Path(done.scripts[1]).exists()
