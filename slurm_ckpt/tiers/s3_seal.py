"""botocore with nothing a user controls: the sealed session of root's owner children,
the built-in-only model loader of every client, and the guard that checks every request
root's keys sign before it leaves the process.

Why: root's flush child becomes the checkpoint's owner and holds root's object-store
keys. botocore reads *service models* from a search path: ``AWS_DATA_PATH``, the
``data_path`` of the config file, and ``~/.aws/models`` (its "customer data path", fixed
from ``HOME`` when :mod:`botocore.loaders` is first imported). A model there may say
that ``ListObjectsV2`` lists another user's prefix, or that ``PutObject`` writes another
key: the child would then list, delete or overwrite other users' objects with root's
keys. So:

* every client's loader searches botocore's own installed data only
  (:func:`builtin_loader`), whoever runs it;
* root builds the owner children's session before it forks (:func:`sealed_session`):
  no config file, no credentials file, no profile, no credential chain (only the keys
  root lends), the S3 model and endpoint rules loaded into the session's caches in root;
* each owner child's client carries :func:`install_guard`: a ``before-send`` hook (it
  sees the request as built and signed, just before it is sent) that admits only the
  S3 operations the flusher uses, on the configured endpoint and bucket, and only keys
  (and list prefixes, and the keys of a multi-object delete) below ``<prefix>/<owner>/``.
  Whatever a model, a handler or a bug made of a request, one that leaves the owner's
  prefix is refused, never sent.
"""

from __future__ import annotations

import os
from typing import Any, Dict, FrozenSet, List, Optional, Tuple
from urllib.parse import parse_qsl, unquote, urlsplit
from xml.etree import ElementTree

from slurm_ckpt.errors import TierError

__all__ = [
    "OWNER_OPERATIONS",
    "ScopeViolation",
    "builtin_loader",
    "check_request",
    "install_guard",
    "plain_session",
    "sealed_session",
]

#: The S3 operations a flush, a local delete's check and a prolog's staging make in a
#: child running as the owner (writes, resumes, reads, verification, cleanup).
OWNER_OPERATIONS: FrozenSet[str] = frozenset(
    {
        "PutObject",
        "GetObject",
        "HeadObject",
        "DeleteObject",
        "DeleteObjects",
        "ListObjectsV2",
        "CreateMultipartUpload",
        "UploadPart",
        "CompleteMultipartUpload",
        "AbortMultipartUpload",
        "ListMultipartUploads",
    }
)

#: Per operation: HTTP method, whether the URL names an object key, the query
#: parameters the request may carry (``None``: any value) and those it must carry.
_SHAPES: Dict[str, Tuple[str, bool, FrozenSet[str], FrozenSet[str]]] = {
    "PutObject": ("PUT", True, frozenset({"x-id"}), frozenset()),
    "GetObject": ("GET", True, frozenset({"x-id", "partNumber"}), frozenset()),
    "HeadObject": ("HEAD", True, frozenset({"partNumber"}), frozenset()),
    "DeleteObject": ("DELETE", True, frozenset({"x-id"}), frozenset()),
    "DeleteObjects": ("POST", False, frozenset({"delete"}), frozenset({"delete"})),
    "ListObjectsV2": (
        "GET",
        False,
        frozenset(
            {
                "list-type",
                "prefix",
                "delimiter",
                "continuation-token",
                "start-after",
                "max-keys",
                "encoding-type",
                "fetch-owner",
            }
        ),
        frozenset({"list-type", "prefix"}),
    ),
    "CreateMultipartUpload": ("POST", True, frozenset({"uploads", "x-id"}), frozenset({"uploads"})),
    "UploadPart": (
        "PUT",
        True,
        frozenset({"partNumber", "uploadId", "x-id"}),
        frozenset({"partNumber", "uploadId"}),
    ),
    "CompleteMultipartUpload": ("POST", True, frozenset({"uploadId"}), frozenset({"uploadId"})),
    "AbortMultipartUpload": (
        "DELETE",
        True,
        frozenset({"uploadId", "x-id"}),
        frozenset({"uploadId"}),
    ),
    "ListMultipartUploads": (
        "GET",
        False,
        frozenset(
            {
                "uploads",
                "prefix",
                "delimiter",
                "key-marker",
                "upload-id-marker",
                "max-uploads",
                "encoding-type",
            }
        ),
        frozenset({"uploads", "prefix"}),
    ),
}

#: Bytes of a DeleteObjects body the guard parses at most (1000 keys of 1 KiB, S3's own
#: limits, and the XML around them).
_MAX_DELETE_BODY = 2 * 2**20


class ScopeViolation(TierError):
    """A request of root's owner child that would leave the owner's prefix (or is not
    one the flusher makes): refused before it was sent."""


def builtin_loader() -> Any:
    """A botocore loader that searches botocore's installed data only: no
    ``AWS_DATA_PATH``, no config ``data_path``, no ``~/.aws/models``."""
    from botocore.loaders import Loader

    return Loader(extra_search_paths=[Loader.BUILTIN_DATA_PATH], include_default_search_paths=False)


def plain_session(profile: Optional[str] = None) -> Any:
    """A botocore session for this process's own use (root's own, or a user's own
    process): its config, credentials and profile as botocore finds them, but models
    from botocore's installed data only."""
    import botocore.session

    session = botocore.session.Session(profile=profile)
    session.register_component("data_loader", builtin_loader())
    return session


def sealed_session(endpoint: str, region: str, config: Any) -> Any:
    """Root, before it forks owner children: a botocore session that reads no file and
    no variable of anyone's for its configuration, credentials or models, with the S3
    model, endpoint rules and partitions already loaded (a throw-away client is built
    here, in root, so the children's clients find everything in the session's caches).
    Its clients take credentials only as explicit arguments."""
    import botocore.session
    from botocore.credentials import CredentialResolver

    # No variable names these (a profile of root's environment must not send the session
    # looking for a config file it does not read), no file holds them.
    session = botocore.session.Session(
        session_vars={
            "profile": (None, None, None, None),
            "config_file": (None, None, os.devnull, None),
            "credentials_file": (None, None, os.devnull, None),
            "data_path": (None, None, None, None),
        }
    )
    session.register_component("data_loader", builtin_loader())
    session.register_component("credential_provider", CredentialResolver([]))
    session.get_scoped_config()  # the (empty) config, parsed and cached now
    session.create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        config=config,
        aws_access_key_id="warm-up",
        aws_secret_access_key="warm-up",
    )
    return session


def _origin(url: str) -> Tuple[str, str, Optional[int]]:
    """Scheme, host and port of ``url`` (the scheme's default port filled in)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is None:
        port = {"http": 80, "https": 443}.get(scheme)
    return scheme, (parts.hostname or "").lower(), port


def _under(key: str, scope: str) -> bool:
    """Is ``key`` below ``scope`` (``<prefix>/<owner>/``), with no segment a server
    could resolve elsewhere (``.``, ``..``, empty)?"""
    if not key.startswith(scope) or len(key) > 1024:
        return False
    segments = key.split("/")
    inner = segments[:-1] if key.endswith("/") else segments
    return all(s not in ("", ".", "..") for s in inner) and "\\" not in key


def _delete_keys(body: Any) -> Optional[List[str]]:
    """The keys of a DeleteObjects body, or None when it cannot be read."""
    if isinstance(body, str):
        body = body.encode()
    if not isinstance(body, (bytes, bytearray)) or len(body) > _MAX_DELETE_BODY:
        return None
    if b"<!DOCTYPE" in body or b"<!ENTITY" in body:
        return None
    try:
        root = ElementTree.fromstring(bytes(body))
    except ElementTree.ParseError:
        return None
    keys = []
    for el in root.iter():
        if el.tag.rsplit("}", 1)[-1] == "Key":
            keys.append(el.text or "")
    return keys


def check_request(
    op: str, request: Any, endpoint: str, bucket: str, scope: str, allowed: FrozenSet[str]
) -> None:
    """Refuse (:class:`ScopeViolation`) a built request that is not an allowed
    operation of the expected shape on ``endpoint``/``bucket`` with every key it names
    below ``scope``. Raised before anything is sent."""

    def refuse(why: str) -> None:
        raise ScopeViolation(
            f"object tier: refused to send {op or 'a request'} ({why}); only "
            f"s3://{bucket}/{scope}* may be touched by this flush"
        )

    if op not in allowed or op not in _SHAPES:
        refuse("not an operation the flusher makes")
    method, has_key, may, must = _SHAPES[op]
    if str(request.method).upper() != method:
        refuse(f"HTTP method {request.method}")
    if _origin(request.url) != _origin(endpoint):
        refuse("another endpoint")
    parts = urlsplit(request.url)
    head = urlsplit(endpoint).path.rstrip("/") + "/" + bucket
    path = parts.path
    if path != head and not path.startswith(head + "/"):
        refuse("another bucket")
    key = unquote(path[len(head) + 1 :])
    query = parse_qsl(parts.query, keep_blank_values=True)
    names = [k for k, _ in query]
    if len(set(names)) != len(names) or not set(names) <= may or not must <= set(names):
        refuse("unexpected query parameters")
    for name in request.headers:
        if str(name).lower().startswith("x-amz-copy-source"):
            refuse("a server-side copy")
    if has_key:
        if not _under(key, scope):
            refuse("a key outside the owner's prefix")
        return
    if key:
        refuse("an object key on a bucket operation")
    if "prefix" in must and not _under(dict(query)["prefix"], scope):
        refuse("a listing outside the owner's prefix")
    if op == "DeleteObjects":
        keys = _delete_keys(request.body)
        if not keys or not all(_under(k, scope) for k in keys):
            refuse("a key outside the owner's prefix")


def install_guard(
    client: Any,
    endpoint: str,
    bucket: str,
    scope: str,
    allowed: FrozenSet[str] = OWNER_OPERATIONS,
) -> Any:
    """Check every request of ``client`` (:func:`check_request`) as the last thing
    before it is sent (botocore's ``before-send``, after building and signing)."""

    def guard(request: Any, event_name: str = "", **_kw: Any) -> None:
        op = event_name.rsplit(".", 1)[-1] if event_name.count(".") >= 2 else ""
        check_request(op, request, endpoint, bucket, scope, allowed)

    client.meta.events.register("before-send.s3", guard, unique_id="slurm-ckpt-scope")
    return client
