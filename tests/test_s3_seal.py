"""The request guard of root's owner children (:mod:`slurm_ckpt.tiers.s3_seal`), on
requests the real botocore builds and signs: every operation a flush makes passes for
keys below the owner's prefix, and everything else is refused before it is sent.

Nothing is sent in these tests: a second ``before-send`` handler, after the guard,
stops each admitted request (``Sent``), so no server is needed; the end-to-end checks
against the real SeaweedFS with real users are in ``tests/security/test_object_models.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, List

import pytest

from slurm_ckpt.tiers.s3_client import boto_config
from slurm_ckpt.tiers.s3_seal import (
    ScopeViolation,
    builtin_loader,
    install_guard,
    plain_session,
    sealed_session,
)

ENDPOINT = "http://127.0.0.1:9"
BUCKET = "ckpt"
MINE = "site/alice/"


class Sent(Exception):
    """The request got past the guard (and is stopped here, unsent)."""


@pytest.fixture(scope="module")
def client() -> Any:
    session = sealed_session(ENDPOINT, "us-east-1", boto_config("us-east-1", 4))
    c = session.create_client(
        "s3",
        endpoint_url=ENDPOINT,
        config=boto_config("us-east-1", 4),
        aws_access_key_id="k",
        aws_secret_access_key="s",
    )
    install_guard(c, ENDPOINT, BUCKET, MINE)

    def stop(**_kw: Any) -> None:
        raise Sent()

    c.meta.events.register("before-send.s3", stop, unique_id="test-stop")
    return c


def _calls(c: Any, key: str, prefix: str) -> List[Callable[[], Any]]:
    b = BUCKET
    return [
        lambda: c.put_object(Bucket=b, Key=key, Body=b"x"),
        lambda: c.get_object(Bucket=b, Key=key, Range="bytes=0-3"),
        lambda: c.head_object(Bucket=b, Key=key),
        lambda: c.delete_object(Bucket=b, Key=key),
        lambda: c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": key}]}),
        lambda: c.list_objects_v2(Bucket=b, Prefix=prefix, Delimiter="/"),
        lambda: c.create_multipart_upload(Bucket=b, Key=key),
        lambda: c.upload_part(Bucket=b, Key=key, UploadId="u", PartNumber=1, Body=b"x"),
        lambda: c.complete_multipart_upload(
            Bucket=b,
            Key=key,
            UploadId="u",
            MultipartUpload={"Parts": [{"ETag": '"e"', "PartNumber": 1}]},
        ),
        lambda: c.abort_multipart_upload(Bucket=b, Key=key, UploadId="u"),
        lambda: c.list_multipart_uploads(Bucket=b, Prefix=prefix),
    ]


def test_every_flush_operation_passes_below_the_owners_prefix(client: Any) -> None:
    for i, call in enumerate(_calls(client, MINE + "run/step-0000000001/model.bin", MINE)):
        with pytest.raises(Sent):
            call()
            pytest.fail(f"call {i} returned")


@pytest.mark.parametrize(
    "key,prefix",
    [
        ("site/bob/run/step-0000000001/model.bin", "site/bob/"),
        ("site/alice/../bob/run/x", "site/alice/../bob/"),
        ("site/alice//x", "site/"),
        ("site/alicex/run/x", "site/alicex/"),
        ("other/alice/x", ""),
    ],
)
def test_every_flush_operation_is_refused_outside_it(client: Any, key: str, prefix: str) -> None:
    for i, call in enumerate(_calls(client, key, prefix)):
        with pytest.raises(ScopeViolation):
            call()
            pytest.fail(f"call {i} was sent")


def test_other_operations_buckets_and_mixed_deletes_are_refused(client: Any) -> None:
    b, mine = BUCKET, MINE + "k"
    refused = [
        lambda: client.head_bucket(Bucket=b),
        lambda: client.delete_bucket(Bucket=b),
        lambda: client.list_objects(Bucket=b, Prefix=MINE),
        lambda: client.copy_object(Bucket=b, Key=mine, CopySource=f"{b}/site/bob/x"),
        lambda: client.put_object(Bucket="other", Key=mine, Body=b"x"),
        lambda: client.delete_objects(
            Bucket=b, Delete={"Objects": [{"Key": mine}, {"Key": "site/bob/x"}]}
        ),
        lambda: client.put_bucket_policy(Bucket=b, Policy="{}"),
    ]
    for i, call in enumerate(refused):
        with pytest.raises(ScopeViolation):
            call()
            pytest.fail(f"call {i} was sent")


def test_no_client_loads_a_model_from_a_data_path_or_the_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_DATA_PATH`` and a config file's ``data_path`` are never searched, by the
    sealed session nor by a process's own (:func:`plain_session`)."""
    hostile = tmp_path / "models"
    (hostile / "s3" / "2006-03-01").mkdir(parents=True)
    (hostile / "s3" / "2006-03-01" / "service-2.json").write_text(json.dumps({"bad": 1}))
    conf = tmp_path / "config"
    conf.write_text(f"[default]\ndata_path = {hostile}\n")
    monkeypatch.setenv("AWS_DATA_PATH", str(hostile))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(conf))
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile-anywhere")
    builtin = builtin_loader().search_paths
    assert builtin == [os.path.join(os.path.dirname(__import__("botocore").__file__), "data")]
    for session in (
        sealed_session(ENDPOINT, "us-east-1", boto_config("us-east-1", 4)),
        plain_session(),
    ):
        assert session.get_component("data_loader").search_paths == builtin
    sealed = sealed_session(ENDPOINT, "us-east-1", boto_config("us-east-1", 4))
    assert sealed.get_scoped_config() == {}  # neither the file nor the profile
    assert sealed.get_credentials() is None  # no chain: only keys given explicitly
