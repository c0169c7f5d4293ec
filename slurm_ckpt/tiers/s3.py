"""The object tier: checkpoints in an S3-compatible object store, through boto3.

Implements :class:`~slurm_ckpt.tiers.base.Tier`. A checkpoint ``user/key/step`` is the
set of objects ``<prefix>/<user>/<key>/step-NNNNNNNNNN/<relpath>`` plus
``.../manifest.json``, uploaded last (:mod:`slurm_ckpt.tiers.s3_write`): the manifest's
existence is the commit, so a listing (which looks only for manifests) shows complete
checkpoints only, and a reader checks every chunk it reads against the manifest. The
user is part of every key, so root's hooks, which flush as the job user, can only ever
put a user's data under that user's prefix.

Transfers: uploads are multipart, one part per hash chunk (or a few), ``concurrency``
parts in flight, each with a CRC32 the store verifies; downloads are ranged GETs in
parallel (:class:`S3Source`), every byte hashed against the manifest by whoever reads it
(the copy engine, verify, restore). Failures are one-line errors (wrong credentials, an
unreachable endpoint, a full store answering HTTP 500), never a traceback.
"""

from __future__ import annotations

import os
import pwd
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException
from typing import Any, Dict, Iterator, List, Optional, Tuple

import botocore.exceptions as bexc

from slurm_ckpt.core.chunks import PIECE, BandwidthLimiter
from slurm_ckpt.core.hashing import DEFAULT_CHUNK_SIZE
from slurm_ckpt.core.layout import parse_step_dirname, step_dirname
from slurm_ckpt.core.lease import LEASE_FILE
from slurm_ckpt.core.manifest import DAMAGED_MANIFEST_NAME, MANIFEST_NAME, Manifest
from slurm_ckpt.core.names import validate_key, validate_user
from slurm_ckpt.core.progress import ProgressFn
from slurm_ckpt.core.verify import VerifyReport, verify_sources
from slurm_ckpt.errors import CkptError, InvalidName, NotFound, TierError, VerifyError
from slurm_ckpt.tiers.base import StepInfo
from slurm_ckpt.tiers.s3_client import ClientFactory, read_body_into, s3_error, step_lock
from slurm_ckpt.tiers.s3_write import S3Writer, crc32_b64

__all__ = ["MIN_PART", "S3Reader", "S3Source", "S3Tier"]

#: S3's smallest part (all but the last part of a multipart upload).
MIN_PART = 5 * 2**20


class S3Tier:
    """One object-store tier (see the module docstring)."""

    kind = "s3"

    def __init__(
        self,
        name: str,
        *,
        endpoint: str,
        bucket: str,
        prefix: str = "",
        region: str = "us-east-1",
        profile: Optional[str] = None,
        part_size: int = 16 * 2**20,
        concurrency: int = 8,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        bandwidth: Optional[float] = None,
        buffer_size: int = PIECE,
        credentials: Optional[Dict[str, str]] = None,
        min_part: int = MIN_PART,
        credentials_file: Optional[str] = None,
        sealed_for: Optional[Tuple[Any, str]] = None,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.base = f"{self.prefix}/" if self.prefix else ""
        self.part_size = part_size
        self.min_part = min_part
        self.streams = concurrency
        self.chunk_size = chunk_size
        self.buffer_size = buffer_size
        self.limiter = BandwidthLimiter(bandwidth) if bandwidth else None
        #: The step lock is node-local and short (:func:`.s3_client.step_lock`): it waits
        #: without a bound, whatever a caller sets here.
        self.lock_wait: Optional[float] = None
        # sealed_for: (root's sealed botocore session, owner): root's owner child, whose
        # every request must stay below <prefix>/<owner>/ (tiers.s3_seal).
        sealed = None
        if sealed_for is not None:
            sealed = (sealed_for[0], bucket, f"{self.base}{validate_user(sealed_for[1])}/")
        self.client = ClientFactory(
            endpoint, region, profile, concurrency * 2 + 4, credentials, credentials_file, sealed
        )

    def __repr__(self) -> str:
        return f"S3Tier({self.name!r}, {self.endpoint!r}, {self.bucket!r}, {self.prefix!r})"

    # -- names -------------------------------------------------------------------------
    def series_prefix(self, user: str, key: str) -> str:
        return f"{self.base}{validate_user(user)}/{validate_key(key)}/"

    def step_prefix(self, user: str, key: str, step: int) -> str:
        return f"{self.series_prefix(user, key)}{step_dirname(step)}/"

    def object_key(self, user: str, key: str, step: int, relpath: str) -> str:
        return self.step_prefix(user, key, step) + relpath

    def where(self, user: str, key: str, step: Optional[int] = None) -> str:
        tail = f"/{step_dirname(step)}" if step is not None else ""
        return f"{self.name}:s3://{self.bucket}/{self.base}{user}/{key}{tail}"

    def location(self, user: str, key: str, step: Optional[int] = None) -> str:
        """The series or step as a URL (for listings)."""
        if step is None:
            return f"s3://{self.bucket}/{self.series_prefix(user, key)}"
        return f"s3://{self.bucket}/{self.step_prefix(user, key, step)}"

    def step_path(self, user: str, key: str, step: int) -> str:
        """The step's location as a URL (what ``list`` prints as its path)."""
        return f"s3://{self.bucket}/{self.step_prefix(user, key, step)}"

    def part_len(self, chunk_size: int, split: bool = False) -> int:
        """The part size for a manifest chunk size: about ``part_size`` and at least
        ``min_part`` (S3's minimum). A whole number of chunks; or, with ``split`` (a copy,
        where each chunk arrives front to back from one thread) and chunks of at least
        twice ``part_size``, a whole fraction of one chunk: smaller parts keep more
        requests in flight and leave a shorter tail at the end of an upload."""
        if split and chunk_size >= 2 * self.part_size:
            d = max(1, round(chunk_size / self.part_size))
            while d > 1 and (chunk_size % d or chunk_size // d < self.min_part):
                d -= 1
            return chunk_size // d
        k = max(1, round(self.part_size / chunk_size), -(-self.min_part // chunk_size))
        return k * chunk_size

    # -- requests ----------------------------------------------------------------------
    def _call(self, op: str, where: str, **kw: Any) -> Any:
        try:
            return getattr(self.client(), op)(Bucket=self.bucket, **kw)
        except (bexc.ClientError, bexc.BotoCoreError, OSError) as exc:
            raise s3_error(exc, where, self.endpoint) from None

    #: One request about the bucket (boto3's ``op``), any failure one line; for the few
    #: objects that are not checkpoints (:mod:`slurm_ckpt.ledger.status_store`).
    request = _call

    def list_objects(
        self, prefix: str, delimiter: Optional[str] = None
    ) -> Iterator[Dict[str, Any]]:
        """Every object below ``prefix`` (or, with a delimiter, ``{"Prefix": ...}`` for
        each common prefix too)."""
        kw: Dict[str, Any] = {"Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        while True:
            page = self._call("list_objects_v2", f"{self.name}:s3://{self.bucket}/{prefix}", **kw)
            yield from page.get("CommonPrefixes", [])
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            kw["ContinuationToken"] = page["NextContinuationToken"]

    def delete_keys(self, keys: List[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            if batch:
                r = self._call("delete_objects", self.where("?", "?"), Delete={"Objects": batch})
                errs = r.get("Errors") or []
                if errs:
                    raise TierError(
                        f"s3://{self.bucket}/{errs[0].get('Key')}: not deleted "
                        f"({errs[0].get('Code')})"
                    )

    def uploads(self, prefix: str) -> List[Dict[str, Any]]:
        """Multipart uploads in progress below ``prefix``."""
        out: List[Dict[str, Any]] = []
        kw: Dict[str, Any] = {"Prefix": prefix}
        while True:
            page = self._call("list_multipart_uploads", f"s3://{self.bucket}/{prefix}", **kw)
            out.extend(page.get("Uploads", []))
            if not page.get("IsTruncated"):
                return out
            kw["KeyMarker"] = page.get("NextKeyMarker")
            kw["UploadIdMarker"] = page.get("NextUploadIdMarker")

    def abort_uploads(self, prefix: str, older_than: Optional[float] = None) -> List[str]:
        """Abort multipart uploads below ``prefix`` (started before ``older_than``)."""
        done = []
        for u in self.uploads(prefix):
            started = u.get("Initiated")
            if older_than is not None and started is not None and started.timestamp() > older_than:
                continue
            self._call("abort_multipart_upload", u["Key"], Key=u["Key"], UploadId=u["UploadId"])
            done.append(u["Key"])
        return done

    # -- checks ------------------------------------------------------------------------
    def check(self, write: bool = False) -> None:
        """The bucket exists and the credentials are accepted (and, with ``write``, a
        probe object can be written and removed)."""
        self._call("head_bucket", f"{self.name}:s3://{self.bucket}")
        if write:
            probe = f"{self.base}.probe-{time.time_ns()}"
            self._call(
                "put_object",
                f"{self.name}:s3://{self.bucket}/{probe}",
                Key=probe,
                Body=b"",
                ChecksumCRC32=crc32_b64(b""),
            )
            self._call("delete_object", probe, Key=probe)

    def check_user(self, user: str) -> None:
        validate_user(user)
        self.check()

    # -- root's questions (tiers/base.py) ----------------------------------------------
    def directory(self) -> None:
        """An object store has no directories to walk: its listing shows committed steps."""
        return None

    def guard_user(self, user: str, uid: int) -> None:
        """The store has no owners: only a process that *is* ``user`` (uid ``uid``) may
        write under that user's prefix (root's children become the owner first, with
        root's sealed session: :mod:`slurm_ckpt.tiers.s3_seal`). TierError if not."""
        try:
            known: Optional[int] = pwd.getpwnam(user).pw_uid
        except KeyError:
            known = None
        if known != uid or os.geteuid() != uid:
            raise TierError(
                f"{self.where(user, '*')}: this process (uid {os.geteuid()}) is not {user} "
                f"(uid {known if known is not None else '?'}); refusing to write under "
                "that user's prefix"
            )

    def guard_step(self, user: str, key: str, step: int, uid: int) -> None:
        """Nothing to check: an object store has no links nor owners, and every byte read
        from it is hashed against the manifest."""

    def committed_manifest(self, user: str, key: str, step: int) -> Optional[bytes]:
        try:
            return self.manifest_bytes(user, key, step)
        except CkptError:
            return None

    def free_bytes(self) -> Optional[int]:
        return None  # an object store does not say

    # -- writing and reading -----------------------------------------------------------
    def writer(
        self, user: str, key: str, step: int, *, copy_of: Optional[Manifest] = None, **kw: Any
    ) -> S3Writer:
        return S3Writer(self, user, key, step, copy_of=copy_of, **kw)

    def reader(self, user: str, key: str, step: int) -> S3Reader:
        return S3Reader(self, user, key, step)

    def source(self, user: str, key: str, step: int, relpath: str) -> S3Source:
        """One payload object open for ranged reads (VerifyError when it is missing)."""
        okey = self.object_key(user, key, step, relpath)
        where = f"{self.where(user, key, step)}/{relpath}"
        try:
            head = self._call("head_object", where, Key=okey)
        except NotFound:
            raise VerifyError(f"{where}: missing") from None
        return S3Source(self, okey, int(head["ContentLength"]), where)

    # -- listing -----------------------------------------------------------------------
    def users(self) -> List[str]:
        return sorted(self._children(self.base, validate_user))

    def keys(self, user: str) -> List[str]:
        return sorted(self._children(f"{self.base}{validate_user(user)}/", validate_key))

    def _children(self, prefix: str, check: Any) -> List[str]:
        out = []
        for item in self.list_objects(prefix, "/"):
            p = item.get("Prefix")
            if p is None:
                continue
            name = p[len(prefix) :].rstrip("/")
            try:
                check(name)
            except InvalidName:
                continue
            out.append(name)
        return out

    def series(self) -> Iterator[Tuple[str, str]]:
        for user in self.users():
            for key in self.keys(user):
                yield user, key

    def steps(self, user: str, key: str) -> List[StepInfo]:
        """Committed checkpoints, oldest first: every ``step-N/manifest.json`` below the
        series that parses, checks and names this very step (read in parallel)."""
        prefix = self.series_prefix(user, key)
        found: List[int] = []
        for obj in self.list_objects(prefix):
            rest = obj["Key"][len(prefix) :]
            name, _, tail = rest.partition("/")
            step = parse_step_dirname(name)
            if step is not None and tail == MANIFEST_NAME:
                found.append(step)
        if not found:
            return []

        def one(step: int) -> Optional[StepInfo]:
            try:
                return StepInfo(self.name, user, key, step, self.manifest(user, key, step))
            except (VerifyError, NotFound):
                return None

        with ThreadPoolExecutor(min(self.streams, len(found), 16), "ckpt-s3-list") as pool:
            infos = [i for i in pool.map(one, found) if i is not None]
        return sorted(infos, key=lambda s: s.step)

    def manifest_bytes(self, user: str, key: str, step: int) -> bytes:
        okey = self.object_key(user, key, step, MANIFEST_NAME)
        where = self.where(user, key, step)
        try:
            r = self._call("get_object", where, Key=okey)
            return r["Body"].read()
        except NotFound:
            raise NotFound(f"{where}: no such checkpoint") from None
        except (bexc.BotoCoreError, OSError) as exc:
            raise s3_error(exc, where, self.endpoint) from None

    def manifest(self, user: str, key: str, step: int) -> Manifest:
        where = self.where(user, key, step)
        m = Manifest.from_bytes(self.manifest_bytes(user, key, step), where)
        if (m.user, m.key, m.step) != (user, key, step):
            raise VerifyError(f"{where}: manifest belongs to {m.user}/{m.key}/step {m.step}")
        return m

    def verify(
        self, user: str, key: str, step: int, progress: Optional[ProgressFn] = None
    ) -> VerifyReport:
        """Ranged GETs of every chunk, in parallel, each hashed against the manifest."""
        where = self.where(user, key, step)
        try:
            m = self.manifest(user, key, step)
        except VerifyError as exc:
            return VerifyReport(where, step, False, problems=[str(exc)])
        return verify_sources(
            lambda e: self.source(user, key, step, e.path),
            m,
            where,
            self.streams,
            None,
            self.buffer_size,
            progress,
        )

    # -- the series' lease record ------------------------------------------------------
    def read_lease(self, user: str, key: str) -> Optional[bytes]:
        """The series' lease record (:mod:`slurm_ckpt.core.lease`), or None."""
        okey = self.series_prefix(user, key) + LEASE_FILE
        where = f"{self.where(user, key)}/{LEASE_FILE}"
        try:
            return self._call("get_object", where, Key=okey)["Body"].read(65537)
        except NotFound:
            return None
        except (bexc.BotoCoreError, OSError) as exc:
            raise s3_error(exc, where, self.endpoint) from None

    def write_lease(self, user: str, key: str, data: bytes) -> None:
        """Replace the series' lease record (one PUT: atomic on an object store)."""
        okey = self.series_prefix(user, key) + LEASE_FILE
        where = f"{self.where(user, key)}/{LEASE_FILE}"
        self._call("put_object", where, Key=okey, Body=data, ChecksumCRC32=crc32_b64(data))

    # -- locking, deleting, sweeping -----------------------------------------------------
    def lock(self, user: str, key: str, step: int, wait: bool = True) -> Any:
        ident = f"{self.endpoint}|{self.bucket}|{self.step_prefix(user, key, step)}"
        return step_lock(ident, wait)

    def uncommit(self, user: str, key: str, step: int, expect: bytes) -> bool:
        """Take a committed checkpoint found damaged out of the listing (see
        :meth:`PosixTier.uncommit`): the manifest is kept as ``manifest.json.damaged``
        and the manifest object deleted, only while it is still ``expect``."""
        try:
            if self.manifest_bytes(user, key, step) != expect:
                return False
        except NotFound:
            return False
        where = self.where(user, key, step)
        aside = self.object_key(user, key, step, DAMAGED_MANIFEST_NAME)
        self._call("put_object", where, Key=aside, Body=expect)
        self._call("delete_object", where, Key=self.object_key(user, key, step, MANIFEST_NAME))
        return True

    def uncommitted(self, user: str, key: str, step: int) -> bool:
        """Was this step found damaged and uncommitted here (and not written again)?"""
        where = self.where(user, key, step)
        try:
            self._call(
                "head_object", where, Key=self.object_key(user, key, step, DAMAGED_MANIFEST_NAME)
            )
        except NotFound:
            return False
        return True

    def delete(self, user: str, key: str, step: int) -> None:
        """The manifest first (the checkpoint stops counting), then every other object."""
        prefix = self.step_prefix(user, key, step)
        with self.lock(user, key, step):
            mkey = prefix + MANIFEST_NAME
            self._call("delete_object", self.where(user, key, step), Key=mkey)
            self.delete_keys([o["Key"] for o in self.list_objects(prefix)])
            self.abort_uploads(prefix)

    def sweep(
        self, user: str, key: str, max_age_s: float = 3600.0, partials: bool = False
    ) -> List[str]:
        """Debris of crashed writers: uploads and objects of steps without a manifest,
        older than ``max_age_s`` (or all of them with ``partials``)."""
        prefix = self.series_prefix(user, key)
        cutoff = None if partials else time.time() - max_age_s
        by_step: Dict[str, List[Dict[str, Any]]] = {}
        for obj in self.list_objects(prefix):
            name = obj["Key"][len(prefix) :].partition("/")[0]
            by_step.setdefault(name, []).append(obj)
        removed: List[str] = []
        for name, objs in sorted(by_step.items()):
            if parse_step_dirname(name) is None:
                continue
            if any(o["Key"].endswith("/" + MANIFEST_NAME) for o in objs):
                continue
            if cutoff is not None and any(o["LastModified"].timestamp() > cutoff for o in objs):
                continue
            self.delete_keys([o["Key"] for o in objs])
            removed.append(name)
        for k in self.abort_uploads(prefix, cutoff):
            removed.append("upload:" + k[len(prefix) :])
        return removed

    # -- tests -------------------------------------------------------------------------
    def corrupt_for_tests(self, user: str, key: str, step: int, relpath: str, offset: int) -> None:
        """Replace one stored object by a copy with one bit flipped (a store that
        returns other bytes than it was given). For tests only."""
        okey = self.object_key(user, key, step, relpath)
        data = bytearray(self._call("get_object", okey, Key=okey)["Body"].read())
        data[offset] ^= 0x01
        self._call("put_object", okey, Key=okey, Body=bytes(data))


class S3Source:
    """One object open for ranged reads: each :meth:`readinto` is one ranged GET."""

    def __init__(self, tier: S3Tier, obj_key: str, size: int, where: str) -> None:
        self.tier, self.key, self.size, self.where = tier, obj_key, size, where

    def readinto(self, buf: memoryview, offset: int) -> int:
        n = min(len(buf), self.size - offset)
        if n <= 0:
            return 0
        try:
            r = self.tier.client().get_object(
                Bucket=self.tier.bucket, Key=self.key, Range=f"bytes={offset}-{offset + n - 1}"
            )
            body = r["Body"]
            try:
                got = read_body_into(body, buf, n)
            finally:
                body.close()
        except (bexc.ClientError, bexc.BotoCoreError, OSError, HTTPException) as exc:
            err = s3_error(exc, self.where, self.tier.endpoint)
            if isinstance(err, NotFound):
                raise VerifyError(f"{self.where}: missing") from None
            raise err from None
        return got

    def fileno(self) -> Optional[int]:
        return None

    def close(self) -> None:
        pass


class S3Reader:
    """A committed checkpoint in the store, open for reading."""

    def __init__(self, tier: S3Tier, user: str, key: str, step: int) -> None:
        self.tier, self.user, self.key, self.step = tier, user, key, step
        self.where = tier.where(user, key, step)
        self.manifest_bytes = tier.manifest_bytes(user, key, step)
        self.manifest = Manifest.from_bytes(self.manifest_bytes, self.where)
        if (self.manifest.user, self.manifest.key, self.manifest.step) != (user, key, step):
            raise VerifyError(f"{self.where}: manifest names another checkpoint")

    def open(self, relpath: str) -> S3Source:
        try:
            self.manifest.file(relpath)
        except KeyError:
            raise CkptError(f"{self.where}: {relpath} is not in the manifest") from None
        return self.tier.source(self.user, self.key, self.step, relpath)

    def close(self) -> None:
        pass

    def __enter__(self) -> S3Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
