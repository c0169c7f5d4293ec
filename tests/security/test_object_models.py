"""Finding 1 of the second round: root's flush child, which becomes the owner and holds
root's object-store keys, must read nothing the user controls for its S3 client.

The attacker has no S3 keys of its own. It plants a botocore *service model* whose
``ListObjectsV2`` lists the victim's prefix and whose ``PutObject`` writes a key of the
victim's, either in ``~/.aws/models`` (botocore's customer data path) or in a directory
named by ``AWS_DATA_PATH``, then leaves a checkpoint for root to flush. Root runs the
real ``ckpt-slurm flush`` (a process of its own, with the README's ``credentials_file``
set-up: root's keys in a root-only file, none in the environment) against the real
SeaweedFS. The victim's objects must be untouched, and the attacker's checkpoint lands
under the attacker's own prefix (the flush ran, with botocore's own model).

On the code before the fix both tests failed: the victim's objects were gone (the
resume step of the attacker's upload listed them through the hostile model and deleted
them with root's keys) - see docs/security-object.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict
from urllib.parse import quote

import pytest

from .conftest import ATTACKER, NODE, VICTIM, as_user, save
from .object_site import ObjectSite, osite_fixture  # noqa: F401 - the fixture

pytestmark = pytest.mark.root


def hostile_model(victim_prefix: str, victim_key: str) -> Dict[str, Any]:
    """botocore's own S3 model, with ListObjectsV2 listing ``victim_prefix`` and
    PutObject writing ``victim_key`` whatever the caller asks for."""
    from botocore.loaders import Loader

    model = Loader(
        extra_search_paths=[Loader.BUILTIN_DATA_PATH], include_default_search_paths=False
    ).load_service_model("s3", "service-2")
    ops = model["operations"]
    ops["ListObjectsV2"]["http"]["requestUri"] = "/{Bucket}?list-type=2&prefix=" + quote(
        victim_prefix, safe=""
    )
    shape = model["shapes"][ops["ListObjectsV2"]["input"]["shape"]]
    shape["members"]["Prefix"]["locationName"] = "x-ignored"
    ops["PutObject"]["http"]["requestUri"] = "/{Bucket}/" + quote(victim_key) + "?x-id=PutObject"
    return model


def plant_model(model_dir: str, model: Dict[str, Any]) -> str:
    """As the attacker: the model at ``<model_dir>/s3/2006-03-01/service-2.json``."""
    d = os.path.join(model_dir, "s3", "2006-03-01")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "service-2.json"), "w") as fh:
        json.dump(model, fh)
    return d


def _attack(osite: ObjectSite, model_dir_of: Any, **env: str) -> None:
    victim = osite.plant_victim()
    victim_prefix = f"{osite.prefix}/{VICTIM}/"
    model = hostile_model(victim_prefix, sorted(victim)[0])
    cfg = osite.cfg()
    save(cfg, ATTACKER, "evil", 1, job="990101")
    as_user(ATTACKER, lambda: plant_model(model_dir_of(), model))
    r = osite.root_flush(**env)
    assert osite.objects(victim_prefix) == victim, (
        "root's flush child touched the victim's objects through the attacker's model: "
        f"rc={r.returncode} {r.stdout[-2000:]} {r.stderr[-2000:]}"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    done = json.loads(r.stdout)["flushed"]
    assert [(d["user"], d["key"], d["step"]) for d in done] == [(ATTACKER, "evil", 1)]
    mine = osite.objects(f"{osite.prefix}/{ATTACKER}/evil/step-0000000001/")
    assert sorted(k.rsplit("/", 1)[1] for k in mine) == ["manifest.json", "model.bin", "opt.bin"]


def test_hostile_models_in_the_attackers_home_change_nothing_root_sends(
    osite: ObjectSite,
) -> None:
    """``~attacker/.aws/models`` (botocore's customer data path)."""
    _attack(osite, lambda: os.path.join(os.path.expanduser("~"), ".aws", "models"))


def test_a_hostile_aws_data_path_changes_nothing_root_sends(osite: ObjectSite) -> None:
    """``AWS_DATA_PATH`` in root's environment naming a directory the attacker writes
    (a wrapper's leaked variable, ``sudo`` keeping it): root's clients ignore it."""
    home = Path(os.path.expanduser(f"~{ATTACKER}"))
    _attack(osite, lambda: str(home / "models"), AWS_DATA_PATH=str(home / "models"))


def test_the_guard_refuses_every_request_that_leaves_the_owners_prefix(
    osite: ObjectSite, tmp_path: Path
) -> None:
    """Defence in depth behind the sealed session: a client of root's owner child whose
    model *is* hostile (as if one got in anyway), and direct requests for keys outside
    the owner's prefix. The guard sees each request as built and signed and refuses it
    before it is sent; the victim's objects stay as they were, the owner's own requests
    go through."""
    import botocore.session
    from botocore.loaders import Loader

    from slurm_ckpt.tiers.s3_client import boto_config
    from slurm_ckpt.tiers.s3_seal import ScopeViolation, install_guard

    victim = osite.plant_victim()
    victim_prefix = f"{osite.prefix}/{VICTIM}/"
    mine = f"{osite.prefix}/{ATTACKER}/"
    models = tmp_path / "models"
    plant_model(str(models), hostile_model(victim_prefix, sorted(victim)[0]))
    session = botocore.session.Session()
    session.register_component(
        "data_loader",
        Loader(extra_search_paths=[str(models), Loader.BUILTIN_DATA_PATH]),
    )
    s3 = osite.s3

    def client(sess: Any) -> Any:
        c = sess.create_client(
            "s3",
            endpoint_url=s3.endpoint,
            config=boto_config("us-east-1", 4),
            aws_access_key_id=s3.key_id,
            aws_secret_access_key=s3.secret,
        )
        return install_guard(c, s3.endpoint, osite.bucket, mine)

    bad, good = client(session), client(botocore.session.Session())
    b = osite.bucket
    refused = [
        lambda: bad.list_objects_v2(Bucket=b, Prefix=mine),
        lambda: bad.put_object(Bucket=b, Key=mine + "k/step-0000000001/x", Body=b"x"),
        lambda: good.put_object(Bucket=b, Key=sorted(victim)[0], Body=b"x"),
        lambda: good.put_object(Bucket=b, Key=mine + "../" + VICTIM + "/run/x", Body=b"x"),
        lambda: good.delete_object(Bucket=b, Key=sorted(victim)[1]),
        lambda: good.delete_objects(
            Bucket=b, Delete={"Objects": [{"Key": mine + "a"}, {"Key": sorted(victim)[1]}]}
        ),
        lambda: good.list_objects_v2(Bucket=b, Prefix=osite.prefix + "/"),
        lambda: good.list_multipart_uploads(Bucket=b, Prefix=victim_prefix),
        lambda: good.copy_object(Bucket=b, Key=mine + "c", CopySource=f"{b}/{sorted(victim)[1]}"),
        lambda: good.delete_bucket(Bucket=b),
    ]
    for i, call in enumerate(refused):
        with pytest.raises(ScopeViolation):
            call()
            pytest.fail(f"request {i} was sent")
    assert osite.objects(victim_prefix) == victim
    good.put_object(Bucket=b, Key=mine + "k/step-0000000001/x", Body=b"ok")
    got = good.list_objects_v2(Bucket=b, Prefix=mine + "k/")
    assert [o["Key"] for o in got["Contents"]] == [mine + "k/step-0000000001/x"]
    good.delete_objects(Bucket=b, Delete={"Objects": [{"Key": mine + "k/step-0000000001/x"}]})
    assert osite.objects(mine) == {}


@pytest.mark.parametrize("hook", ["epilog", "stager"])
def test_the_epilog_and_the_stager_send_nothing_a_hostile_model_asks_for(
    osite: ObjectSite, hook: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root's real epilog (the attacker's job ended) and the stager's first pass, with
    the attacker's model in ``~/.aws/models`` and named by ``AWS_DATA_PATH`` in root's
    environment: the victim's objects stay as they were, the attacker's checkpoint is
    flushed under its own prefix."""
    from slurm_ckpt.hooks.epilog import run_epilog
    from slurm_ckpt.hooks.stager import stager_pass

    victim = osite.plant_victim()
    victim_prefix = f"{osite.prefix}/{VICTIM}/"
    model = hostile_model(victim_prefix, sorted(victim)[0])
    cfg = osite.cfg()
    save(cfg, ATTACKER, "evil", 1, job="990103")
    home = os.path.expanduser(f"~{ATTACKER}")
    for d in (os.path.join(home, ".aws", "models"), os.path.join(home, "models")):
        as_user(ATTACKER, plant_model, d, model)
    monkeypatch.setenv("AWS_DATA_PATH", os.path.join(home, "models"))
    if hook == "epilog":
        flush = run_epilog(cfg, osite.site.env(ATTACKER, job="990103")).flush
    else:
        flush = stager_pass(cfg, NODE, client=None).flush
    assert osite.objects(victim_prefix) == victim
    assert flush.flushed == [(ATTACKER, "evil", 1)], flush.failed
    mine = osite.objects(f"{osite.prefix}/{ATTACKER}/evil/step-0000000001/")
    assert sorted(k.rsplit("/", 1)[1] for k in mine) == ["manifest.json", "model.bin", "opt.bin"]
