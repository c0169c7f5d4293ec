"""Finding 7 of the second round: another user could squat the object client's lock
directory for non-root processes, ``<tmp>/slurm-ckpt-locks-<uid>``, and so stop the
owner's own flushes and restores from the object tier.

Now a user's lock directory lies below that user's own home
(``~/.cache/slurm-ckpt/locks-<host>``, from the passwd home, so root's child as the user
and the user's job agree), where no other user can make a name. The attacker, a real
second user, squats the old ``/tmp`` name (mode 0777, its own); the victim's own
``ckpt-slurm flush`` to the object store and ``ckpt-slurm restore --tier object`` then
work, and root's flush of another checkpoint of the victim too.

On the code before the fix the victim's flush failed: "lock directory
/tmp/slurm-ckpt-locks-<uid>: not a private directory of uid <uid>".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import ATTACKER, NODE, VICTIM, as_user, ids, save
from .object_site import ObjectSite, osite_fixture  # noqa: F401 - the fixture

pytestmark = pytest.mark.root


@pytest.fixture
def squat() -> Iterator[Path]:
    """The attacker's directory at the victim's old lock path (made by the attacker,
    0777, before the victim ever used it)."""
    path = Path(tempfile.gettempdir()) / f"slurm-ckpt-locks-{ids(VICTIM).uid}"
    shutil.rmtree(path, ignore_errors=True)

    def make() -> None:
        os.mkdir(path, 0o777)
        os.chmod(path, 0o777)

    as_user(ATTACKER, make)
    assert path.stat().st_uid == ids(ATTACKER).uid
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_squatted_tmp_lock_directory_stops_no_flush_or_restore(
    osite: ObjectSite, squat: Path
) -> None:
    cfg = osite.cfg()
    save(cfg, VICTIM, "run", 1, job="990201")
    r = osite.user_cli(VICTIM, "flush", "--json", "-w", NODE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [d["step"] for d in json.loads(r.stdout)["flushed"]] == [1], r.stdout
    dest = osite.site.base / "restored"
    dest.mkdir()
    os.chown(dest, ids(VICTIM).uid, ids(VICTIM).gid)
    r = osite.user_cli(VICTIM, "restore", "run", "--tier", "object", "--to", str(dest), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert (doc["tier"], doc["step"]) == ("object", 1)
    assert (dest / VICTIM / "run" / "step-0000000001" / "model.bin").stat().st_size == 4096
    # Root's child as the victim takes its locks in the same (home) directory.
    save(cfg, VICTIM, "run", 2, job="990202")
    r = osite.root_flush()
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert 2 in [d["step"] for d in doc["flushed"]] and not doc["failed"], r.stdout
    # Nothing of the victim's went into the attacker's directory.
    assert os.listdir(squat) == []
    home = Path(os.path.expanduser(f"~{VICTIM}"))
    locks = list((home / ".cache" / "slurm-ckpt").glob("locks-*"))
    assert len(locks) == 1 and locks[0].stat().st_uid == ids(VICTIM).uid
    assert locks[0].stat().st_mode & 0o777 == 0o700
    assert as_user(VICTIM, lambda: sorted(os.listdir(str(locks[0]))))  # its lock files
