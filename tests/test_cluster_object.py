"""The issue's cluster test for a site without a parallel filesystem: on the real dev
cluster, a site config with ``[tiers.local]`` and ``[tiers.object]`` (the session's
SeaweedFS) and no ``[tiers.pfs]``. The real trainer (``examples/train_tiny.py`` under
``ckpt-srun``, as ``test_cluster_train.py`` runs it) is preempted on one node, requeued
by SLURM (same job id) and moved to another node, whose disk holds nothing of the series:
it resumes from the object store, loses no step, and ends with weights bitwise equal to
an uninterrupted run.

Credentials as a site would have them: the hooks (root) take root's keys from a root-only
file named by the config (``tiers.object.credentials_file``); the job has keys of its own
in its environment (SeaweedFS's ``weed mini`` knows one identity, so here they are the
same keys: on a real site they would be the user's). The hooks' node statuses land,
signed, in the bucket, and ``ckpt-slurm status`` (root, on the host) reads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from helpers.cluster import DevCluster
from helpers.site import write_config
from test_cluster_e2e import CKPT_SLURM, hooked_site
from test_cluster_train import STEPS, USER, TrainSite

from slurm_ckpt.core.config import Config, load_config
from slurm_ckpt.tiers.registry import tiers_from_config

pytestmark = pytest.mark.root


class ObjectSite(TrainSite):
    """The trainer's site, with the object store as its warm tier and no PFS."""

    def __init__(self, cluster: DevCluster, s3: Any) -> None:
        self.s3 = s3
        self.bucket = s3.bucket("cluster")
        self.prefix = s3.fresh_prefix("cluster")
        secret_dir = Path(tempfile.mkdtemp(prefix="sckpt-s3keys-", dir="/var/tmp"))
        os.chmod(secret_dir, 0o700)
        self.root_keys = secret_dir / "credentials"
        self.root_keys.write_text(
            f"[default]\naws_access_key_id = {s3.key_id}\naws_secret_access_key = {s3.secret}\n"
        )
        os.chmod(self.root_keys, 0o600)
        super().__init__(cluster)

    def configure(self, local_root: Optional[str] = None, **sections: Dict[str, object]) -> Config:
        o = self.s3.object_config(self.bucket, self.prefix)
        data: Dict[str, Dict[str, object]] = {
            "tiers.local": {"root": local_root or str(self.local_root), "min_free": "16MiB"},
            "tiers.object": {
                "endpoint": o["endpoint"],
                "bucket": o["bucket"],
                "prefix": o["prefix"],
                "part_size": "5MiB",
                "concurrency": 4,
                "credentials_file": str(self.root_keys),
            },
            "hooks": {"budget": "30s", "stage_on_requeue": False},
            "retention": {"keep_local": 2},
            "copy": {"chunk_size": "1MiB", "streams": 2},
        }
        for name, values in sections.items():
            data.setdefault(name.replace("_", "."), {}).update(values)
        return write_config(self.config, data)

    def job(self, body: str, user: str = USER, args: List[str] = ()) -> str:
        """The job's own keys in its environment (see the module docstring)."""
        keys = (
            f"export AWS_ACCESS_KEY_ID={self.s3.key_id}\n"
            f"export AWS_SECRET_ACCESS_KEY={self.s3.secret}\n"
            "export AWS_DEFAULT_REGION=us-east-1\n"
        )
        return super().job(keys + body, user=user, args=args)

    def object_tier(self) -> Any:
        return tiers_from_config(load_config(self.config))["object"]


@pytest.fixture(scope="module")
def osite(slurm_cluster: DevCluster, s3_server: Any) -> Iterator[ObjectSite]:
    s = ObjectSite(slurm_cluster, s3_server)
    s.start_reference()
    try:
        with hooked_site(s):
            yield s
    finally:
        if s._ref is not None and s._ref.poll() is None:
            s._ref.kill()
            s._ref.wait()
        subprocess.run(["rm", "-rf", str(s.root_keys.parent)], check=False)


def test_no_pfs_preempted_requeued_on_another_node_resumes_from_the_object_store(
    osite: ObjectSite,
) -> None:
    t = osite
    t.ensure_hooks()
    key = f"s3moved-{t.tok}"
    with t.preempted_and_moved(key, timeout=240) as (victim, run):
        out = run.text
        assert "DUE TO PREEMPTION" in out, out
        [saved] = run.preempted
        [res] = run.resumed
        assert res["tier"] == "object", out  # n3's disk has nothing of this series
        assert res["step"] == saved and res["reached"] == str(saved), out
        assert res["lost"] == "0", out
        assert run.done == [(STEPS, t.reference_digest())], out
        epilog = t.wait_hook("epilog", victim, "n3")
        assert "drained" not in epilog or "not drained" in epilog, epilog

        tier = t.object_tier()
        steps = [s.step for s in tier.steps(USER, key)]
        assert saved in steps and STEPS in steps, steps
        for step in (saved, STEPS):
            assert tier.verify(USER, key, step).ok, step
        # Only the owner's prefix and the signed node statuses are in the bucket.
        top = {
            o["Key"][len(t.prefix) + 1 :].split("/")[0] for o in tier.list_objects(t.prefix + "/")
        }
        assert top == {USER, ".slurm_ckpt"}, top

        # ckpt-slurm status on the host (root, the config's credentials file): the job's
        # newest step in the object store, nothing at risk, the nodes' signed statuses.
        r = subprocess.run(
            [str(CKPT_SLURM), "status", "--json", "--no-slurm", "-k", key],
            env=dict(t.c.env, SLURM_CKPT_CONFIG=str(t.config)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["warm_tier"] == "object" and doc["pfs_root"] is None, doc
        (job,) = doc["jobs"]
        assert job["tiers"]["object"]["step"] == STEPS, job
        assert job["steps_at_risk"] == 0 and job["bytes_at_risk"] == 0, job
        assert {"n2", "n3"} <= set(job["nodes"]), job
