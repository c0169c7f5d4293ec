"""One real S3 server per test session: SeaweedFS (``scripts/s3-server``) on 127.0.0.1.

Its data directory is a loop-mounted ext4 of its own (no reserved blocks), so a test can
fill the store's disk for real (:meth:`S3Server.full_disk`) and give the space back.
The credentials are exported into this process's environment (the standard AWS
variables), where boto3 and the CLI subprocesses of the tests find them.

Tests use one bucket each (:meth:`S3Server.bucket`) or a fresh prefix in a shared one:
SeaweedFS gives each bucket volumes of its own, and the disk is small.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Dict, Iterator

import boto3
import pytest
from botocore.config import Config as BotoConfig

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "s3-server"
DISK_MB = int(os.environ.get("S3_TEST_DISK_MB", "1536"))


class S3Server:
    """The running server: endpoint, credentials, its data mount, and helpers."""

    def __init__(self, state: Path, data: Path, env: Dict[str, str]) -> None:
        self.state, self.data, self.env = state, data, env
        self.endpoint = env["S3_ENDPOINT"]
        self.key_id = env["AWS_ACCESS_KEY_ID"]
        self.secret = env["AWS_SECRET_ACCESS_KEY"]
        self._buckets: set = set()
        self.script_env: Dict[str, str] = {}

    def client(self, secret: str = "") -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.key_id,
            aws_secret_access_key=secret or self.secret,
            region_name="us-east-1",
            config=BotoConfig(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def bucket(self, name: str = "ckpt-tests") -> str:
        if name not in self._buckets:
            c = self.client()
            with suppress(c.exceptions.BucketAlreadyOwnedByYou):
                c.create_bucket(Bucket=name)
            self._buckets.add(name)
        return name

    @staticmethod
    def fresh_prefix(tag: str = "t") -> str:
        return f"{tag}-{uuid.uuid4().hex[:10]}"

    def object_config(self, bucket: str, prefix: str, **extra: Any) -> Dict[str, Any]:
        """A ``[tiers.object]`` table for this server."""
        return {"endpoint": self.endpoint, "bucket": bucket, "prefix": prefix, **extra}

    @contextmanager
    def full_disk(self) -> Iterator[None]:
        """The store's disk filled to the last block for the duration (as root)."""
        filler = self.data / "filler"
        try:
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                st = os.statvfs(self.data)
                bulk = st.f_bavail * st.f_frsize - 16 * 2**20
                if bulk > 0:
                    os.posix_fallocate(fd, 0, bulk)  # no data written: fast
                    os.lseek(fd, bulk, os.SEEK_SET)
                for piece in (2**20, 4096):  # then the last blocks
                    buf = b"\0" * piece
                    while True:
                        try:
                            os.write(fd, buf)
                        except OSError:
                            break
                os.fsync(fd)
            finally:
                os.close(fd)
            assert os.statvfs(self.data).f_bavail == 0, "the store's disk is not full"
            yield
        finally:
            filler.unlink(missing_ok=True)
            # Volumes that ran out of space stay read-only and the server's count of free
            # volume slots is the one it had when full: a restart (data kept) resets both.
            self.restart()
            self.wait_writable()

    def restart(self) -> None:
        for cmd in ("stop", "start"):
            r = subprocess.run(
                ["bash", str(SCRIPT), cmd],
                env=self.script_env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode == 0, f"s3-server {cmd}: {r.stdout}{r.stderr}"

    def wait_writable(self, timeout: float = 120.0) -> float:
        """Wait until the store takes writes again (it learns of freed space from its
        volume server's heartbeats); returns the seconds waited."""
        c = self.client()
        bucket = self.bucket("probe")
        t0 = time.monotonic()
        while True:
            try:
                c.put_object(Bucket=bucket, Key="probe", Body=b"x" * 4096)
                return time.monotonic() - t0
            except Exception:  # noqa: BLE001 - any failure: not writable yet
                if time.monotonic() - t0 > timeout:
                    raise
                time.sleep(1.0)


def _venv() -> str:
    return sys.prefix


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """Start SeaweedFS for this session (on a loop mount of its own) and stop it after."""
    if os.geteuid() != 0:
        pytest.fail("the S3 tests mount the store's disk: run the suite as root")
    state = Path(tempfile.mkdtemp(prefix="s3-session-", dir="/var/tmp"))
    img = state / "disk.img"
    data = state / "data"
    data.mkdir()
    with open(img, "wb") as fh:
        fh.truncate(DISK_MB * 2**20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(data)], check=True)
    env = dict(
        os.environ,
        SLURM_CKPT_VENV=_venv(),
        S3_SERVER_DIR=str(state / "server"),
        S3_SERVER_DATA=str(data),
    )
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    started = False
    try:
        r = subprocess.run(
            ["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120
        )
        if r.returncode != 0:
            pytest.fail(f"scripts/s3-server start failed: {r.stdout}{r.stderr}")
        started = True
        envfile = r.stdout.strip().splitlines()[-1]
        values = dict(line.split("=", 1) for line in Path(envfile).read_text().split())
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            os.environ[k] = values[k]
        server = S3Server(state, data, values)
        server.script_env = env
        yield server
    finally:
        if started:
            subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=120)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if subprocess.run(["umount", str(data)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(data)], capture_output=True)
        subprocess.run(["rm", "-rf", str(state)], capture_output=True)
