"""Round 2, finding 2: a node status root signed cannot be replayed.

On a site without a PFS the node statuses are signed objects in the bucket; on sites
where users hold bucket keys a user can save one and put it back. Once, a status was
signed over its bytes only, so a saved ``pending 0`` stayed valid for ever: put back
after the epilog had published ``pending 1``, it made ``maint`` run its action while the
victim's checkpoint was on the node alone. Now each status carries a per-node sequence
number and its time, bound into the signature, and ``maint``/``guard`` take only a
status newer than the moment they saw the node's jobs gone.

Real users (the attacker's requests run in a process of theirs, with bucket keys of
their own: on this store the site's), the real SeaweedFS, root running the real
stager, epilog and ``maint``/``guard`` code; SLURM is a :class:`Recorder`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from conftest import Mounts

from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import NotReady
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger.status_store import ObjectStatusStore, status_store
from slurm_ckpt.ops import maint as maint_mod

from .conftest import ATTACKER, NODE, VICTIM, Recorder, as_user, ids, save

pytestmark = pytest.mark.root


class ObjectSite:
    """A tmpfs local tier and a fresh prefix in a bucket of the real SeaweedFS; no PFS."""

    def __init__(self, base: Path, mounts: Mounts, s3: Any) -> None:
        self.base, self.s3 = base, s3
        self.local = mounts.tmpfs("64m", "local")
        self.bucket = s3.bucket("sec-status")
        self.prefix = s3.fresh_prefix("replay")

    def cfg(self, **obj: Any) -> Config:
        return Config.from_dict(
            {
                "tiers": {
                    "local": {"root": str(self.local), "min_free": 0},
                    "object": {
                        "kind": "s3",
                        **self.s3.object_config(self.bucket, self.prefix, **obj),
                    },
                },
                "copy": {"chunk_size": "1MiB", "streams": 2},
                "hooks": {"budget": 30, "child_timeout": "5s", "retry_backoff": "60s"},
                "retention": {"keep_local": 1},
            }
        )

    @property
    def status_key(self) -> str:
        return f"{self.prefix}/.slurm_ckpt/nodes/{NODE}.json"

    def user_keys(self) -> Dict[str, str]:
        """The bucket keys the attacker holds (the precondition of the finding)."""
        return {"endpoint": self.s3.endpoint, "key": self.s3.key_id, "secret": self.s3.secret}


@pytest.fixture
def osite(users: Any, s3_server: Any) -> Iterator[ObjectSite]:
    base = Path(tempfile.mkdtemp(prefix="sckpt-sec-obj-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    mounts = Mounts(base)
    try:
        yield ObjectSite(base, mounts, s3_server)
    finally:
        mounts.close()
        shutil.rmtree(base, ignore_errors=True)


def _client(keys: Dict[str, str]) -> Any:
    import boto3
    from botocore.config import Config as BotoConfig

    return boto3.client(
        "s3",
        endpoint_url=keys["endpoint"],
        aws_access_key_id=keys["key"],
        aws_secret_access_key=keys["secret"],
        region_name="us-east-1",
        config=BotoConfig(s3={"addressing_style": "path"}),
    )


def attacker_save(keys: Dict[str, str], bucket: str, key: str, to: str) -> None:
    """As the attacker: keep a copy of root's signed status (bytes and signature)."""
    r = _client(keys).get_object(Bucket=bucket, Key=key)
    with open(to, "wb") as fh:
        fh.write(r["Body"].read())
    with open(to + ".sig", "w") as fh:
        fh.write(r["Metadata"]["slurm-ckpt-sig"])


def attacker_replay(keys: Dict[str, str], bucket: str, key: str, saved: str) -> None:
    """As the attacker: put the saved status back, signature and all."""
    with open(saved, "rb") as fh:
        blob = fh.read()
    with open(saved + ".sig") as fh:
        sig = fh.read()
    _client(keys).put_object(
        Bucket=bucket,
        Key=key,
        Body=blob,
        ContentType="application/json",
        Metadata={"slurm-ckpt-sig": sig},
    )


class _Slurm(Recorder):
    """maint's view of SLURM; ``run`` records the action it would run."""

    def __init__(self, jobs: List[Any]) -> None:
        super().__init__(jobs=jobs)
        self.cli = self
        self.ran: List[Any] = []

    def run(self, argv: Any) -> str:
        self.ran.append(argv)
        return ""

    def signal(self, *a: Any, **k: Any) -> None:
        pass


class _Stop(Exception):
    """Ends a maint run from its progress callback."""


def _maint(cfg: Config, slurm: _Slurm, on_poll: Any, timeout: float) -> None:
    with contextlib.suppress(_Stop):
        maint_mod.run_maint(
            cfg,
            [NODE],
            "firmware",
            ("slurm", ["scontrol", "reboot", NODE]),
            signal_jobs=False,
            timeout=timeout,
            poll=0.2,
            say=lambda _s: None,
            on_poll=on_poll,
        )


def test_a_replayed_pending_0_status_does_not_make_maint_act(
    osite: ObjectSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = osite.cfg()
    slow = osite.cfg(bandwidth_limit="2MB/s")  # the epilog's flush outlasts its budget
    assert isinstance(status_store(cfg), ObjectStatusStore)
    slurm = _Slurm(jobs=[("100", VICTIM)])
    monkeypatch.setattr(maint_mod, "client_factory", lambda: slurm)
    keys = osite.user_keys()
    mine = osite.base / "attacker"  # somewhere the attacker keeps things
    mine.mkdir()
    os.chown(mine, ids(ATTACKER).uid, -1)
    saved = str(mine / "saved-status")
    rounds: List[int] = []

    def scenario(waits: Any) -> None:
        """maint has drained the node and waits; meanwhile, on the node and in the
        bucket (each step done for real, between two of maint's polls):"""
        rounds.append(len(rounds))
        if len(rounds) == 2:
            # maint's first look after the replay: it read the replayed "owes nothing"
            # and sees no job; if it trusted that status it acts right after this call.
            (w,) = waits
            assert w.status_time is not None and w.pending == 0 and not w.jobs
            return
        if len(rounds) == 3:
            raise _Stop  # it did not act, and went on waiting: enough seen
        if len(rounds) != 1:
            return
        # Root publishes "n1 owes nothing" (its job has not saved yet); the attacker
        # keeps that signed status.
        stager_pass(cfg, NODE, slurm)
        as_user(ATTACKER, attacker_save, keys, osite.bucket, osite.status_key, saved)
        # The victim's job saves and ends; its epilog cannot flush in its budget and
        # publishes "n1 owes 1".
        save(cfg, VICTIM, "run", 1, nbytes=3 * 2**20)
        slurm.jobs = []
        run_epilog(slow, _env(VICTIM), budget=1.0)
        (doc,) = status_store(cfg).read()
        assert doc["pending"]["count"] == 1
        # The attacker puts the saved "owes nothing" back.
        as_user(ATTACKER, attacker_replay, keys, osite.bucket, osite.status_key, saved)

    _maint(cfg, slurm, scenario, timeout=60.0)  # raises _Stop unless maint acted
    assert slurm.ran == [], "maint acted on a replayed status"
    # guard (no ledger on this host: the node status decides) refuses the replay too.
    other = Config.from_dict({**cfg.to_dict(), "ledger": {"dir": str(osite.base / "none")}})
    with pytest.raises(NotReady):
        maint_mod.guard(other, NODE, 0.5, 0.1)
    # Not too strict: once the stager has flushed the checkpoint after the job ended
    # and published that, maint acts.
    slurm.reason = None

    def flush_then(waits: Any) -> None:
        if not any(w.fresh for w in waits):
            stager_pass(cfg, NODE, slurm)

    _maint(cfg, slurm, flush_then, timeout=30.0)
    assert slurm.ran == [["scontrol", "reboot", NODE]]


def _env(user: str) -> Any:
    from slurm_ckpt.slurm.env import HookEnv

    u = ids(user)
    return HookEnv("100", u.name, u.uid, u.gid, NODE, [NODE], 0)


def test_the_watch_takes_only_newer_statuses() -> None:
    """The rule itself: newer than the jobs' end, a sequence number above all seen."""
    from slurm_ckpt.ops.maint import StatusWatch

    w = StatusWatch()
    w.jobs_seen(NODE, True, 100.0)
    assert w.fresh(NODE, {"seq": 5, "time": 101.0}) == (False, None)  # jobs still run
    w.jobs_seen(NODE, False, 110.0)
    assert not w.fresh(NODE, {"seq": 6, "time": 109.0})[0]  # before the jobs' end
    assert not w.fresh(NODE, {"seq": 5, "time": 111.0})[0]  # a number seen before
    assert w.fresh(NODE, {"seq": 7, "time": 111.0})[0]
    fresh, why = w.fresh(NODE, {"seq": 6, "time": 112.0})  # older than one seen: replay
    assert not fresh and why and "replay" in why
    assert not w.fresh(NODE, {"time": 200.0})[0]  # no sequence number: never decides
