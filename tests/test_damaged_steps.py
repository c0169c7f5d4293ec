"""Broken checkpoints are never silent (issue 11, items 1-3).

* every kind of damaged step - CORRUPT (truncated or tampered manifest, a symlink in a
  step's place), INCOMPLETE (no manifest, old), UNREADABLE (permission), FOREIGN
  (another series' manifest) - is reported by ``verify KEY`` (exit 1), ``list``, ``gc``
  (and reclaimed by policy) and counted by ``status``;
* ``verify PATH`` works on a copy anywhere, says it was moved, and has distinct messages
  for a missing path, a symlink, a permission problem, a relative path;
* ``config check`` looks at the tier roots.

Real directories and files; the permission cases run the CLI in a child that dropped
root (root reads everything).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

import pytest
from helpers import site as helper_site
from helpers.cli import run_here

from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.ops.damage import COMMIT_GRACE_S, scan_series
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier

NOBODY = 65534
USER, KEY = "alice", "run"


def as_nobody(argv: List[str]) -> Tuple[int, str, str]:
    """``ckpt-slurm ARGV`` in a forked child running as nobody: (code, stdout, stderr)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        result = {"code": 99, "out": "", "err": "child failed"}
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code, out, err = run_here(argv)
            result = {"code": code, "out": out, "err": err}
        except BaseException as exc:  # noqa: BLE001 - report anything to the parent
            result["err"] = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(w, json.dumps(result).encode())
            os._exit(0)
    os.close(w)
    with io.FileIO(r, "r") as fh:
        data = json.loads(fh.readall().decode())
    os.waitpid(pid, 0)
    return data["code"], data["out"], data["err"]


class Site(helper_site.Site):
    """alice/run on the local and PFS tiers: steps 1-3 good; 4..8 damaged on the PFS."""

    def __init__(self, base: Path) -> None:
        super().__init__(base)
        self.cfg = self.cfg_path
        for step in (1, 2, 3):
            self.put(self.local, USER, KEY, step)
            self.copy(step, user=USER, key=KEY)

    def put(self, tier: PosixTier, user: str, key: str, step: int) -> None:
        self.write(
            step, user=user, key=key, tier=tier.name, files={"w.bin": os.urandom(3000)}, tokens=step
        )

    def step_dir(self, step: int, tier: str = "pfs") -> Path:  # type: ignore[override]
        return super().step_dir(step, user=USER, key=KEY, tier=tier)

    def damage(self) -> None:
        """The four kinds (and a symlink) next to the good steps on the PFS."""
        # 4: truncated manifest, 5: tampered manifest (a size changed).
        for step in (4, 5):
            self.put(self.pfs, USER, KEY, step)
        m4 = self.step_dir(4) / "manifest.json"
        m4.write_bytes(m4.read_bytes()[:100])
        m5 = self.step_dir(5) / "manifest.json"
        m5.write_bytes(m5.read_bytes().replace(b'"size": 3000', b'"size": 3001'))
        # 6: a commit that never finished (no manifest, old).
        self.step_dir(6).mkdir()
        (self.step_dir(6) / "w.bin").write_bytes(b"x")
        old = os.stat(self.step_dir(6)).st_mtime - 2 * COMMIT_GRACE_S
        os.utime(self.step_dir(6), (old, old))
        # 7: another series' checkpoint moved here (FOREIGN).
        self.put(self.pfs, USER, "other", 7)
        os.rename(self.base / "pfs" / USER / "other" / step_dirname(7), self.step_dir(7))
        # 8: a symlink where a step directory belongs (never followed).
        os.symlink(self.step_dir(1), self.step_dir(8))


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Site:
    s = Site(tmp_path)
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(s.cfg))
    return s


def _states(rows: List[dict]) -> dict:
    return {(r["tier"], r["step"]): r["state"] for r in rows}


# --------------------------------------------------------------------------- scan


def test_scan_sorts_every_step_directory(site: Site) -> None:
    site.damage()
    # a young step directory without a manifest is a commit in progress: not damage
    site.step_dir(9).mkdir()
    good, damaged = scan_series(site.pfs, USER, KEY)
    assert [s.step for s in good] == [1, 2, 3]
    got = {d.step: (d.state, d.reason) for d in damaged}
    assert got[4][0] == "CORRUPT" and "manifest" in got[4][1]
    assert got[5][0] == "CORRUPT" and "checksum" in got[5][1]
    assert got[6] == ("INCOMPLETE", "no manifest: the commit never finished")
    assert got[7] == ("FOREIGN", f"manifest belongs to {USER}/other step 7")
    assert got[8] == ("CORRUPT", f"{step_dirname(8)} is a symlink")
    assert 9 not in got


# --------------------------------------------------------------------------- verify KEY


def test_verify_key_reports_each_damaged_step_and_exits_1(site: Site) -> None:
    assert run_here(["verify", KEY, "-u", USER])[0] == 0
    site.damage()
    code, out, err = run_here(["verify", KEY, "-u", USER, "--json"])
    assert code == 1, err
    doc = json.loads(out)
    assert doc["ok"] is False
    states = _states(doc["checkpoints"])
    assert {k: v for k, v in states.items() if k[0] == "pfs"} == {
        ("pfs", 1): "OK",
        ("pfs", 2): "OK",
        ("pfs", 3): "OK",
        ("pfs", 4): "CORRUPT",
        ("pfs", 5): "CORRUPT",
        ("pfs", 6): "INCOMPLETE",
        ("pfs", 7): "FOREIGN",
        ("pfs", 8): "CORRUPT",
    }
    bad = [r for r in doc["checkpoints"] if not r["ok"]]
    assert all(r["problems"] and r["path"] for r in bad)
    # --step narrows to one, damaged or not; the local tier alone is fine.
    assert run_here(["verify", KEY, "-u", USER, "--step", "7"])[0] == 1
    assert run_here(["verify", KEY, "-u", USER, "--tier", "local"])[0] == 0
    # Human output: the state and the reason, one line per step.
    code, out, _ = run_here(["verify", KEY, "-u", USER, "--tier", "pfs"])
    assert code == 1 and "FOREIGN" in out and "INCOMPLETE" in out and "symlink" in out


def test_verify_key_with_only_damage_is_not_not_found(site: Site) -> None:
    site.put(site.pfs, USER, "broken", 1)
    m = site.base / "pfs" / USER / "broken" / step_dirname(1) / "manifest.json"
    m.write_bytes(b"{")
    code, out, err = run_here(["verify", "broken", "-u", USER, "--parsable"])
    assert code == 1, err
    assert out.splitlines()[1].split("|")[:4] == ["pfs", USER, "broken", "1"]
    assert "CORRUPT" in out.splitlines()[1]


def test_payload_corruption_and_unreadable_payload(site: Site) -> None:
    with open(site.step_dir(2, "local") / "w.bin", "r+b") as fh:
        fh.write(b"\x00\x01")
    code, out, _ = run_here(["verify", KEY, "-u", USER, "--tier", "local", "--json"])
    assert code == 1 and _states(json.loads(out)["checkpoints"])[("local", 2)] == "CORRUPT"


# --------------------------------------------------------------------------- list


def test_list_shows_damaged_steps(site: Site) -> None:
    site.damage()
    code, out, err = run_here(["list", KEY, "-u", USER, "--json"])
    assert code == 1, err
    states = _states(json.loads(out)["checkpoints"])
    assert states[("pfs", 3)] == "committed" and states[("local", 1)] == "committed"
    assert [states[("pfs", s)] for s in (4, 5, 6, 7, 8)] == [
        "CORRUPT",
        "CORRUPT",
        "INCOMPLETE",
        "FOREIGN",
        "CORRUPT",
    ]
    code, out, err = run_here(["list", KEY, "-u", USER])
    assert code == 1 and "FOREIGN" in out and "warning: 5 damaged steps" in err
    # The series listing counts them.
    code, out, _ = run_here(["list", "-u", USER, "--parsable"])
    rows = [dict(zip(out.splitlines()[0].split("|"), x.split("|"))) for x in out.splitlines()[1:]]
    pfs_run = next(r for r in rows if r["tier"] == "pfs" and r["key"] == KEY)
    assert pfs_run["damaged"] == "5" and pfs_run["steps"] == "3" and code == 1


# --------------------------------------------------------------------------- gc


def test_gc_reports_and_reclaims_damaged_steps_by_policy(site: Site) -> None:
    site.damage()
    # Newer than every good step: 4-8 are all newer than step 3, so nothing may be
    # reclaimed yet (the series' newest verified checkpoint is older).
    code, out, err = run_here(["gc", "-u", USER, "-k", KEY, "--json"])
    (s,) = [x for x in json.loads(out)["series"] if x["tier"] == "pfs"]
    assert {d["step"]: d["state"] for d in s["damaged"]} == {
        4: "CORRUPT",
        5: "CORRUPT",
        6: "INCOMPLETE",
        7: "FOREIGN",
        8: "CORRUPT",
    }
    assert s["reclaimed"] == [] and code == 1  # damage left in place is a finding
    # A newer good checkpoint: now the corrupt-manifest and incomplete ones go, the
    # FOREIGN one and the symlink stay (reported).
    for step in (10, 11):
        site.put(site.local, USER, KEY, step)
        copy_checkpoint(site.local, site.pfs, USER, KEY, step)
    code, out, err = run_here(["gc", "-u", USER, "-k", KEY, "--dry-run", "--json"])
    (s,) = [x for x in json.loads(out)["series"] if x["tier"] == "pfs"]
    assert s["reclaim"] == [4, 5, 6] and s["reclaimed"] == []
    assert site.step_dir(4).exists()  # dry run
    code, out, err = run_here(["gc", "-u", USER, "-k", KEY])
    assert code == 1, err  # 7 and 8 are left: a finding
    assert not site.step_dir(4).exists() and not site.step_dir(5).exists()
    assert not site.step_dir(6).exists()
    assert site.step_dir(7).is_dir() and site.step_dir(8).is_symlink()
    assert site.step_dir(1).is_dir()  # the symlink's target was not touched
    assert "FOREIGN" in err and "left in place" in err
    assert "damaged 5, reclaimed 3" in out


# --------------------------------------------------------------------------- status


def test_status_counts_damaged_steps(site: Site) -> None:
    for step in (4, 5):
        site.put(site.pfs, USER, KEY, step)
    (site.step_dir(5) / "manifest.json").write_bytes(b"{")
    site.step_dir(6).mkdir()
    old = os.stat(site.step_dir(6)).st_mtime - 2 * COMMIT_GRACE_S
    os.utime(site.step_dir(6), (old, old))
    code, out, err = run_here(["status", "--no-slurm", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    (job,) = doc["jobs"]
    assert job["tiers"]["pfs"]["step"] == 4 and job["tiers"]["pfs"]["damaged"] == 2
    assert doc["totals"]["damaged"] == 2
    code, out, err = run_here(["status", "--no-slurm"])
    assert "2 damaged step directories" in err


# --------------------------------------------------------------------------- verify PATH


def test_verify_path_anywhere_and_moved(site: Site, tmp_path: Path, monkeypatch) -> None:
    elsewhere = tmp_path / "scratch" / "copy-of-2"
    shutil.copytree(site.step_dir(2, "local"), elsewhere)
    code, out, err = run_here(["verify", str(elsewhere), "--json"])
    assert code == 0, err
    (row,) = json.loads(out)["checkpoints"]
    assert row["state"] == "OK" and row["bytes"] == 3000 and row["moved"] is True
    assert row["origin"] == f"{USER}/{KEY}/{step_dirname(2)}"
    assert any(p.startswith(f"moved: this is {USER}/{KEY} step 2") for p in row["problems"])
    # In its own place: not moved. A relative path works too.
    monkeypatch.chdir(site.step_dir(2, "local").parent)
    code, out, _ = run_here(["verify", f"./{step_dirname(2)}", "--json"])
    (row,) = json.loads(out)["checkpoints"]
    assert code == 0 and row["moved"] is False and row["step"] == 2
    # A flipped byte in the copy.
    with open(elsewhere / "w.bin", "r+b") as fh:
        fh.write(b"\xff\xff")
    code, out, _ = run_here(["verify", str(elsewhere)])
    assert code == 1 and "CORRUPT" in out


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "no such file or directory"),
        (lambda p: os.symlink("/tmp", p), "is a symlink (to /tmp); symlinks are never followed"),
        (lambda p: p.write_text("x"), "not a directory"),
        (lambda p: p.mkdir(), "no manifest.json: not a committed checkpoint"),
    ],
    ids=["missing", "symlink", "file", "no-manifest"],
)
def test_verify_path_problems_have_distinct_messages(tmp_path: Path, make, message) -> None:
    target = tmp_path / "step-0000000001"
    make(target)
    code, out, err = run_here(["--config", "/nonexistent.toml", "verify", str(target)])
    assert code == 1 and out == ""
    assert err.splitlines() == [f"ckpt-slurm: error: {target}: {message}"] or (
        len(err.splitlines()) == 1 and message in err
    ), err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody")
def test_permission_problems_read_as_such(site: Site) -> None:
    base = Path(tempfile.mkdtemp(prefix="ckpt-perm-"))
    try:
        os.chmod(base, 0o755)
        private = base / "private"
        private.mkdir(mode=0o700)
        inner = private / step_dirname(1)
        shutil.copytree(site.step_dir(1, "local"), inner)
        code, out, err = as_nobody(["verify", str(inner)])
        assert code == 1 and "permission denied" in err and "CORRUPT" not in err + out, err
        # A directory nobody may open, with a manifest nobody may read.
        shared = base / "shared" / step_dirname(1)
        shutil.copytree(site.step_dir(1, "local"), shared)
        os.chmod(base / "shared", 0o755)
        os.chmod(shared, 0o755)
        os.chmod(shared / "manifest.json", 0o600)
        code, out, err = as_nobody(["verify", str(shared)])
        assert code == 1 and "manifest.json: permission denied" in err, err
        # Payload unreadable: UNREADABLE, not CORRUPT.
        os.chmod(shared / "manifest.json", 0o644)
        os.chmod(shared / "w.bin", 0o600)
        code, out, err = as_nobody(["verify", str(shared), "--parsable"])
        assert code == 1, err
        assert out.splitlines()[1].split("|")[6] == "UNREADABLE", out
        # An unreadable step directory in a series: UNREADABLE, listed and verified.
        tier = base / "tier"
        (tier / "nobody" / "run").mkdir(parents=True)
        shutil.copytree(site.step_dir(1, "local"), tier / "nobody" / "run" / step_dirname(1))
        for root, dirs, files in os.walk(tier):
            for name in dirs + files:
                os.chown(os.path.join(root, name), NOBODY, NOBODY)
        os.chmod(tier / "nobody" / "run" / step_dirname(1), 0o000)
        cfg = base / "c.toml"
        (base / "p").mkdir()  # a missing tier root is a config error, not an empty tier
        cfg.write_text(
            f'[tiers.local]\nroot = "{tier}"\n[tiers.pfs]\nkind = "posix"\nroot = "{base / "p"}"\n'
        )
        os.chmod(cfg, 0o644)
        code, out, err = as_nobody(["--config", str(cfg), "verify", "run", "--json"])
        assert code == 1, err
        (row,) = json.loads(out)["checkpoints"]
        assert row["state"] == "UNREADABLE" and "permission denied" in row["problems"][0]
    finally:
        for root, dirs, _files in os.walk(base):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o755)
        shutil.rmtree(base)


# --------------------------------------------------------------------------- config check


def _cfg(tmp: Path, local: str, pfs: str, extra: str = "") -> Path:
    p = tmp / "check.toml"
    p.write_text(
        f'[tiers]\nshared = ["pfs"]\n[tiers.local]\nroot = "{local}"\nrequire_mount = false\n'
        f'min_free = 0\n{extra}[tiers.pfs]\nkind = "posix"\nroot = "{pfs}"\n'
    )
    return p


def test_config_check_looks_at_the_roots(tmp_path: Path) -> None:
    local, pfs = tmp_path / "local", tmp_path / "pfs"
    local.mkdir()
    pfs.mkdir()
    ok = _cfg(tmp_path, str(local), str(pfs))
    assert run_here(["config", "check", "--config", str(ok)]) == (0, f"ok: {ok}\n", "")

    cases = [
        (str(local), str(tmp_path / "absent"), "tiers.pfs.root", "does not exist"),
        (str(local), str(tmp_path / "file"), "tiers.pfs.root", "is not a directory"),
        (str(local), str(tmp_path / "link"), "tiers.pfs.root", "is a symlink"),
        (str(local), str(tmp_path / "open"), "tiers.pfs.root", "writable by others"),
        (str(local), str(tmp_path / "owned"), "tiers.pfs.root", "owned by uid 1234"),
    ]
    (tmp_path / "file").write_text("x")
    os.symlink(pfs, tmp_path / "link")
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    (tmp_path / "owned").mkdir()
    os.chown(tmp_path / "owned", 1234, 1234)
    for lroot, proot, key, what in cases:
        cfg = _cfg(tmp_path, lroot, proot)
        code, out, err = run_here(["config", "check", "--config", str(cfg)])
        assert code == 2 and out == "", (proot, err)
        (line,) = err.splitlines()
        assert key in line and what in line, line
        # --offline: syntax and values only.
        assert run_here(["config", "check", "--offline", "--config", str(cfg)])[0] == 0
    # Sticky and world-writable (a shared scratch root): fine.
    os.chmod(tmp_path / "open", 0o1777)
    cfg = _cfg(tmp_path, str(local), str(tmp_path / "open"))
    assert run_here(["config", "check", "--config", str(cfg)])[0] == 0
    # A missing local root is a warning (a login node has none), not an error.
    cfg = _cfg(tmp_path, str(tmp_path / "nolocal"), str(pfs))
    code, out, err = run_here(["config", "check", "--config", str(cfg)])
    assert code == 0 and "warning:" in err and "does not exist on this node" in err
    # require_mount: a plain directory on the root filesystem is refused (as by the prolog).
    cfg = tmp_path / "mount.toml"
    cfg.write_text(
        f'[tiers]\nshared = ["pfs"]\n[tiers.local]\nroot = "{local}"\nmin_free = 0\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{pfs}"\n'
    )
    code, out, err = run_here(["config", "check", "--config", str(cfg)])
    if os.stat(local).st_dev == os.stat("/").st_dev:
        assert code == 2 and "not a mount of its own" in err
    else:  # tmp is a mount of its own here
        assert code == 0, err
    # Free space below min_free: a warning.
    cfg = (
        _cfg(tmp_path, str(local), str(pfs))
        .read_text()
        .replace("min_free = 0", 'min_free = "8EiB"')
    )
    (tmp_path / "full.toml").write_text(cfg)
    code, out, err = run_here(["config", "check", "--config", str(tmp_path / "full.toml")])
    assert code == 0 and "below the 8.0EiB the prolog requires" in err


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
