"""The S3 side of the object tier: one boto3 client per process, error translation, and
the node-local step locks.

boto3 speaks the protocol (signing, retries, connection pools); nothing here signs a
request by hand. What this module adds is what the rest of the toolkit expects of any
tier: every failure becomes one line a user can act on (:func:`s3_error`), and copies
and deletes of one step are serialised on this node (:func:`step_lock`), as the POSIX
tier does with flock.
"""

from __future__ import annotations

import configparser
import errno
import fcntl
import hashlib
import os
import pwd
import socket
import stat
import tempfile
import threading
from contextlib import contextmanager, suppress
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple

import botocore.exceptions as bexc

from slurm_ckpt.errors import CkptError, NotFound, TierError, VerifyError
from slurm_ckpt.tiers.base import RangeSource

__all__ = [
    "FULL_HINT",
    "ClientFactory",
    "ObjectStore",
    "resolve_credentials",
    "s3_error",
    "step_lock",
]

#: What SeaweedFS (and other stores) answer a write with when their disks are full: a
#: plain HTTP 500 ("failed to find writable volumes" is only in the server's log).
FULL_HINT = (
    "the object store failed the write with HTTP 500 (a full store answers so: no "
    "writable volumes); nothing was committed, the flush is retried later"
)
_AUTH_CODES = {
    "SignatureDoesNotMatch",
    "InvalidAccessKeyId",
    "InvalidSecurity",
    "InvalidToken",
    "ExpiredToken",
    "AccessDenied",
    "AllAccessDisabled",
    "403",
}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound", "NoSuchUpload"}


def _code(exc: bexc.ClientError) -> str:
    err = exc.response.get("Error", {}) if isinstance(exc.response, dict) else {}
    return str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


def _status(exc: bexc.ClientError) -> int:
    try:
        return int(exc.response["ResponseMetadata"]["HTTPStatusCode"])
    except (KeyError, TypeError, ValueError):
        return 0


def s3_error(
    exc: BaseException, where: str, endpoint: str = "", writing: bool = False
) -> CkptError:
    """One clear line for any failure of a request about ``where`` (``writing``: an
    upload, where an HTTP 500 most likely means a full store)."""
    if isinstance(exc, CkptError):
        return exc
    if isinstance(exc, bexc.ClientError):
        code = _code(exc)
        status = _status(exc)
        if code in _AUTH_CODES:
            return TierError(
                f"{where}: access denied by {endpoint or 'the object store'} ({code}): wrong "
                "credentials? (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or [tiers.object] profile)"
            )
        if code == "NoSuchBucket":
            return TierError(f"{where}: the bucket does not exist on {endpoint or 'the store'}")
        if code in _MISSING_CODES:
            return NotFound(f"{where}: no such object")
        if code in ("BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"):
            return VerifyError(f"{where}: the store received other bytes than sent ({code})")
        if status >= 500 or code in ("InternalError", "ServiceUnavailable", "SlowDown"):
            if writing:
                return TierError(f"{where}: {FULL_HINT} ({code})")
            return TierError(
                f"{where}: the object store failed the request ({code}, HTTP {status})"
            )
        msg = exc.response.get("Error", {}).get("Message", "") if exc.response else ""
        return TierError(f"{where}: S3 error {code}: {msg}".rstrip(": "))
    if isinstance(exc, bexc.NoCredentialsError):
        return TierError(
            f"{where}: no S3 credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or a "
            "profile in [tiers.object])"
        )
    if isinstance(exc, bexc.ProfileNotFound):
        return TierError(f"{where}: {exc}")
    if isinstance(exc, (bexc.EndpointConnectionError, bexc.ConnectionClosedError)):
        return TierError(f"{where}: cannot reach the object store at {endpoint}")
    if isinstance(exc, (bexc.ReadTimeoutError, bexc.ConnectTimeoutError)):
        return TierError(f"{where}: the object store at {endpoint} timed out")
    if isinstance(exc, bexc.BotoCoreError):
        return TierError(f"{where}: {exc}")
    if isinstance(exc, OSError):
        return TierError(f"{where}: {exc.strerror or exc}")
    return TierError(f"{where}: {type(exc).__name__}: {exc}")


def _boto3_session() -> Any:
    """A botocore session factory (``profile_name=``), imported on first use: botocore
    takes a fifth of a second to import, which every ``ckpt-slurm`` command and every
    job paid for when it was loaded with the module, on sites that have no object tier
    at all. Its models come from botocore's installed data only
    (:func:`~slurm_ckpt.tiers.s3_seal.plain_session`): never ``AWS_DATA_PATH`` nor
    ``~/.aws/models``."""
    from slurm_ckpt.tiers.s3_seal import plain_session

    return lambda profile_name=None: plain_session(profile_name)


def boto_config(region: str, pool: int) -> Any:
    """The client configuration every object-tier client uses."""
    from botocore.config import Config as BotoConfig  # see _boto3_session

    # botocore >= 1.36 would otherwise ask for and check a CRC of every response
    # (another pass over each downloaded byte, in Python's thread) and add one of its own
    # to requests: our parts carry the CRC32 we computed as they filled, and every byte
    # read is hashed against the manifest anyway. Older botocore (boto3 >= 1.28 is
    # allowed) has neither option and adds neither checksum.
    checksums = {
        name: "when_required"
        for name in ("request_checksum_calculation", "response_checksum_validation")
        if name in BotoConfig.OPTION_DEFAULTS
    }
    return BotoConfig(
        region_name=region,
        max_pool_connections=pool,
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        # Integrity is ours (xxh3 per chunk from the manifest) plus the store's CRC32
        # check of every part, so the SigV4 payload hash would be a third pass.
        s3={"addressing_style": "path", "payload_signing_enabled": False},
        **checksums,
    )


#: Clients this process inherited over ``fork()``, kept referenced until it exits. Their
#: connection pools hold the parent's sockets; a child that closed its inherited fds
#: (:func:`~slurm_ckpt.node.asuser.run_as`) has since reused those fd numbers for files
#: of its own, and dropping the old client would close the sockets' numbers - a lock
#: file's, say, whose own close then fails with EBADF (gc's aging copies as the owner
#: did exactly that, every time).
_INHERITED: List[Any] = []


class ClientFactory:
    """A botocore S3 client for this process, built on first use and again after a fork
    (connection pools must not be shared with a child).

    ``sealed``: ``(session, bucket, scope)`` in root's owner children - the session root
    built before the fork (:func:`~slurm_ckpt.tiers.s3_seal.sealed_session`: nothing of
    the user's is read) and every request checked to stay below ``scope`` before it is
    sent (:func:`~slurm_ckpt.tiers.s3_seal.install_guard`)."""

    def __init__(
        self,
        endpoint: str,
        region: str = "us-east-1",
        profile: Optional[str] = None,
        pool: int = 16,
        credentials: Optional[Dict[str, str]] = None,
        credentials_file: Optional[str] = None,
        sealed: Optional[Tuple[Any, str, str]] = None,
    ) -> None:
        self.sealed = sealed
        self.endpoint = endpoint
        self.region = region
        self.profile = profile
        self.pool = pool
        self.credentials = credentials
        self.credentials_file = credentials_file
        self._lock = threading.Lock()
        self._client: Any = None
        self._pid = -1

    def __call__(self) -> Any:
        pid = os.getpid()
        if self._client is None or self._pid != pid:
            with self._lock:
                if self._client is None or self._pid != pid:
                    if self._client is not None:
                        _INHERITED.append(self._client)  # never closed here: see there
                    self._client = self._build()
                    self._pid = pid
        return self._client

    def resolved(self) -> Optional[Dict[str, str]]:
        """The credentials this factory's clients use (explicit, the credentials file,
        or boto3's chain), frozen; None when there are none."""
        return self.credentials or resolve_credentials(self.profile, self.credentials_file)

    def _build(self) -> Any:
        cfg = boto_config(self.region, self.pool)
        if self.sealed is not None:
            from slurm_ckpt.tiers.s3_seal import install_guard

            session, bucket, scope = self.sealed
            client = session.create_client(
                "s3", endpoint_url=self.endpoint, config=cfg, **dict(self.credentials or {})
            )
            return install_guard(client, self.endpoint, bucket, scope)
        explicit = self.credentials or read_credentials_file(self.credentials_file, self.profile)
        session_cls = _boto3_session()
        try:
            session = session_cls(profile_name=None if explicit else self.profile)
        except bexc.BotoCoreError as exc:
            raise s3_error(exc, "object tier", self.endpoint) from None
        kw = dict(explicit or {})
        try:
            return session.create_client("s3", endpoint_url=self.endpoint, config=cfg, **kw)
        except bexc.BotoCoreError as exc:
            raise s3_error(exc, "object tier", self.endpoint) from None


def read_credentials_file(
    path: Optional[str], profile: Optional[str] = None
) -> Optional[Dict[str, str]]:
    """Keys from a credentials file (``~/.aws/credentials`` format, section ``profile``
    or ``default``); None when there is no such file, or this process may not read it
    (a job reading root's file), or it has no keys in that section."""
    if not path:
        return None
    parser = configparser.RawConfigParser()
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="utf-8") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            parser.read_string(fh.read(1 << 20))
    except (OSError, UnicodeDecodeError, configparser.Error):
        return None
    section = profile or "default"
    if not parser.has_section(section):
        return None
    sec = parser[section]
    if not sec.get("aws_access_key_id") or not sec.get("aws_secret_access_key"):
        return None
    out = {
        "aws_access_key_id": sec["aws_access_key_id"].strip(),
        "aws_secret_access_key": sec["aws_secret_access_key"].strip(),
    }
    if sec.get("aws_session_token"):
        out["aws_session_token"] = sec["aws_session_token"].strip()
    return out


def resolve_credentials(
    profile: Optional[str] = None, credentials_file: Optional[str] = None
) -> Optional[Dict[str, str]]:
    """This process's S3 credentials (``credentials_file`` when it can read it, else the
    environment, ``profile``, boto3's default chain), frozen into the keyword arguments
    of :meth:`boto3.session.Session.client`; None when there are none (or the profile is
    missing: the client reports it when used)."""
    got = read_credentials_file(credentials_file, profile)
    if got is not None:
        return got
    session_cls = _boto3_session()
    try:
        creds = session_cls(profile_name=profile).get_credentials()
    except bexc.BotoCoreError:
        return None
    if creds is None:
        return None
    frozen = creds.get_frozen_credentials()
    out = {"aws_access_key_id": frozen.access_key, "aws_secret_access_key": frozen.secret_key}
    if frozen.token:
        out["aws_session_token"] = frozen.token
    return out


def _private(path: str, uid: int) -> str:
    """``path``, made if missing: a directory of ``uid`` (never a symlink) that no other
    user may write; TierError if it is anything else (another user made it first)."""
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
        raise TierError(f"lock directory {path}: not a private directory of uid {uid}")
    return path


def _home_locks(uid: int) -> Optional[str]:
    """``<home>/.cache/slurm-ckpt/locks-<host>`` of ``uid``'s passwd home (not ``$HOME``:
    root's child as the user and the user's job must find the same directory), or None
    when the home is not a directory of that user that only they may write. Below a
    directory only the user writes, no other user can squat a name (a world-writable
    ``/tmp`` lets anyone take ``/tmp/slurm-ckpt-locks-<uid>`` first). ``<host>``: a home
    shared by the nodes holds each node's locks apart (they serialise one node)."""
    try:
        home = pwd.getpwuid(uid).pw_dir
        st = os.lstat(home)
    except (KeyError, OSError):
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
        return None
    host = socket.gethostname().split(".")[0] or "node"
    path = home
    try:
        for part in (".cache", "slurm-ckpt", f"locks-{host}"):
            path = _private(os.path.join(path, part), uid)
    except (OSError, TierError):
        return None  # read-only or full home, a .cache the group may write: /tmp then
    return path


def _lock_dir() -> str:
    """A directory only this uid can write, for lock files (never a symlink): root's
    ``/run/slurm-ckpt``; a user's below their own home (:func:`_home_locks`), else
    ``<tmp>/slurm-ckpt-locks-<uid>``."""
    uid = os.geteuid()
    if uid == 0 and os.path.isdir("/run"):
        return _private("/run/slurm-ckpt", uid)
    if uid != 0:
        got = _home_locks(uid)
        if got is not None:
            return got
    return _private(os.path.join(tempfile.gettempdir(), f"slurm-ckpt-locks-{uid}"), uid)


@contextmanager
def step_lock(ident: str, wait: bool = True) -> Iterator[bool]:
    """Exclusive node-local lock on one object-store step (flock on a private file).

    An object store has no locks; copies and deletes of a step are serialised on this
    node, which is where the flushes of a node's checkpoints run."""
    name = "s3-" + hashlib.sha256(ident.encode()).hexdigest()[:32] + ".lock"
    d = _lock_dir()
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    except OSError as exc:
        raise TierError(f"lock {d}/{name}: {exc.strerror}") from None
    finally:
        os.close(dfd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)


class ObjectStore(Protocol):
    """What the object tier's writer (:mod:`.s3_write`) asks of its tier
    (:class:`~slurm_ckpt.tiers.s3.S3Tier`): named here, below both, so that the writer's
    module does not import the tier's and the tier's imports the writer's (no circle)."""

    name: str
    bucket: str
    endpoint: str
    client: ClientFactory
    streams: int
    chunk_size: int

    def where(self, user: str, key: str, step: Optional[int] = None) -> str: ...

    def part_len(self, chunk_size: int, split: bool = False) -> int: ...

    def object_key(self, user: str, key: str, step: int, relpath: str) -> str: ...

    def step_prefix(self, user: str, key: str, step: int) -> str: ...

    def list_objects(
        self, prefix: str, delimiter: Optional[str] = None
    ) -> Iterator[Dict[str, Any]]: ...

    def delete_keys(self, keys: List[str]) -> None: ...

    def abort_uploads(self, prefix: str, older_than: Optional[float] = None) -> List[str]: ...

    def source(self, user: str, key: str, step: int, relpath: str) -> RangeSource: ...

    def manifest_bytes(self, user: str, key: str, step: int) -> bytes: ...
