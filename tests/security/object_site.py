"""The object tier for the security suite: the suite's local tier plus a fresh prefix
in a bucket of the session's real SeaweedFS as the warm tier (no PFS), root's keys in a
root-only credentials file (the README's set-up). Import ``osite`` as a fixture."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.config_schema import SECTION_KINDS

from .conftest import ATTACKER, NODE, REPO, VICTIM, as_user


class ObjectSite:
    """The security suite's local tier plus a fresh prefix in a bucket of the real
    SeaweedFS as the warm tier (no PFS), root's keys in a root-only file."""

    def __init__(self, site: Any, s3: Any) -> None:
        self.site, self.s3 = site, s3
        self.bucket = s3.bucket("sec-object")
        self.prefix = s3.fresh_prefix("sec")
        self.creds = site.base / "root-s3-credentials"
        self.creds.write_text(
            f"[default]\naws_access_key_id = {s3.key_id}\naws_secret_access_key = {s3.secret}\n"
        )
        os.chmod(self.creds, 0o600)

    def data(self, **sections: Any) -> Dict[str, Any]:
        """The config; ``sections``: more tables (``pfs``/``cold``/``object`` go to
        ``[tiers.*]``, a ``pfs`` table making the PFS the warm tier)."""
        data: Dict[str, Any] = {
            "tiers": {
                "local": {"root": str(self.site.local), "min_free": 0},
                "object": {
                    "kind": "s3",
                    **self.s3.object_config(
                        self.bucket, self.prefix, part_size="5MiB", credentials_file=str(self.creds)
                    ),
                },
            },
            "copy": {"chunk_size": "1MiB", "streams": 2},
            "hooks": {"budget": 60, "child_timeout": "30s"},
        }
        for name, values in sections.items():
            if name in ("pfs", "cold", "object"):
                # today's form: each shared tier says its kind (the alias is not tested here)
                tier = data["tiers"].setdefault(name, {"kind": SECTION_KINDS[name]})
                tier.update(values)
            else:
                data.setdefault(name, {}).update(values)
        order = ("local", "pfs", "object", "cold")
        data["tiers"] = {n: data["tiers"][n] for n in order if n in data["tiers"]}
        return data

    def cfg(self, **sections: Any) -> Config:
        return Config.from_dict(self.data(**sections))

    def config_file(self, **sections: Any) -> Path:
        lines = []
        data = self.data(**sections)
        for tier, values in data.pop("tiers").items():
            lines.append(f"[tiers.{tier}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        for name, values in data.items():
            lines.append(f"[{name}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        path = self.site.base / "object-site.toml"
        path.write_text("\n".join(lines) + "\n")
        os.chmod(path, 0o644)
        return path

    def objects(self, below: str) -> Dict[str, bytes]:
        c = self.s3.client()
        out = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=below):
            for o in page.get("Contents", []):
                out[o["Key"]] = c.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
        return out

    def plant_victim(self) -> Dict[str, bytes]:
        """The victim's objects in the store (root's test client puts them)."""
        c = self.s3.client()
        base = f"{self.prefix}/{VICTIM}/run/step-0000000001/"
        want = {base + "model.bin": os.urandom(4096), base + "manifest.json": b"{}"}
        for k, v in want.items():
            c.put_object(Bucket=self.bucket, Key=k, Body=v)
        return want

    def root_cli(
        self, *args: str, config: Optional[Path] = None, **env: str
    ) -> subprocess.CompletedProcess:
        """The real ``ckpt-slurm ARGS`` as root, in a process of its own, with no AWS
        variables (root's keys are in the credentials file only) but ``env``."""
        full = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        full.update(PYTHONPATH=str(REPO), HOME="/root", **env)
        conf = str(config or self.config_file())
        argv = [sys.executable, "-m", "slurm_ckpt.cli.main", "--config", conf, *args]
        return subprocess.run(argv, env=full, capture_output=True, text=True, timeout=180, cwd=REPO)

    def root_flush(self, **env: str) -> subprocess.CompletedProcess:
        """``ckpt-slurm flush`` as root (:meth:`root_cli`)."""
        return self.root_cli("flush", "--json", "-w", NODE, **env)

    def user_cli(
        self, user: str, *args: str, config: Optional[Path] = None
    ) -> subprocess.CompletedProcess:
        """The real ``ckpt-slurm ARGS`` as ``user``, a process of that user, with the
        bucket keys in its environment (a site where users have keys)."""
        pw = pwd.getpwnam(user)
        full = dict(os.environ, PYTHONPATH=str(REPO), HOME=pw.pw_dir, USER=user)
        conf = str(config or self.config_file())
        argv = [sys.executable, "-m", "slurm_ckpt.cli.main", "--config", conf, *args]
        return subprocess.run(
            argv,
            env=full,
            user=pw.pw_uid,
            group=pw.pw_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=180,
            cwd="/",
        )


def _drop_models() -> None:
    """As the attacker: remove what the tests planted in its home."""
    home = os.path.expanduser("~")
    for d in (os.path.join(home, ".aws", "models"), os.path.join(home, "models")):
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(name="osite")
def osite_fixture(site: Any, s3_server: Any) -> Iterator[ObjectSite]:
    """An :class:`ObjectSite` (import ``osite_fixture`` into the test module)."""
    try:
        yield ObjectSite(site, s3_server)
    finally:
        as_user(ATTACKER, _drop_models)  # other tests' flushes of this user stay sane
