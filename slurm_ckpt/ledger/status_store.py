"""Where nodes publish their status (what they owe the warm tier) for login nodes to read:
on the PFS, or, on a site without one, in the object store's bucket.

``ckpt-slurm status``, ``maint`` and ``guard`` read node statuses; the hooks publish them
(:meth:`~slurm_ckpt.node.work.NodeWork.publish`). They go through a :class:`StatusStore`
made by :func:`status_store`:

* **a site with a PFS** (:class:`PosixStatusStore`): ``<pfs root>/.slurm_ckpt/nodes/
  <node>.json``, exactly as :mod:`slurm_ckpt.ledger.node_status` writes and reads them
  (root-owned directories and files, opened without following links: its safety is that
  module's, untouched here);
* **a site whose warm tier is the object store** (:class:`ObjectStatusStore`): objects
  ``<prefix>/.slurm_ckpt/nodes/<node>.json`` in the bucket (no user's prefix can collide:
  user names never start with a dot).

Trust in the bucket
-------------------
``maint`` reboots a node when its status says nothing is left to flush, so a status must
be root's. An object has no owner to check, and on some sites users hold keys to the
bucket for their jobs' own flushes. So root *signs* each status: an HMAC-SHA256 of its
bytes, keyed by a key derived from root's secret access key (the compute nodes' bucket
credentials are root's), stored in the object's metadata. A reader recomputes it with its
own credentials and takes only statuses that match: root on a login node with the site's
credentials reads them all; a forged one (or one written with other keys) is skipped with
a note, like an untrusted file on the PFS. A user whose keys are not the site's sees no
node statuses (``status`` then shows the tiers' catalogs and SLURM only). Sites must not
give users the site's own keys.

A signature alone does not stop a replay: a user with bucket keys can save a status root
signed (``pending 0``) and put it back after root published a newer one (``pending 1``).
So the signature binds the node's name, the status's sequence number and its time
(``v2``, :func:`signed_message`), and the readers that decide (``maint``, ``guard``) take
only a status newer than the moment they saw the node's jobs gone, with a sequence
number above every one seen before (:mod:`slurm_ckpt.ops.maint`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol

from slurm_ckpt.core.config import LEDGER_SUBDIR, Config
from slurm_ckpt.core.config_schema import OBJECT_SECTION
from slurm_ckpt.core.names import validate_node
from slurm_ckpt.errors import CkptError, TierError
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.node_status import (
    publish_status,
    published_status,
    read_node_statuses,
    status_seq,
)

log = logging.getLogger(__name__)

__all__ = [
    "ObjectStatusStore",
    "PosixStatusStore",
    "StatusStore",
    "read_statuses",
    "status_store",
]

NODES_SUBDIR = "nodes"
SIG_META = "slurm-ckpt-sig"
_MAX_STATUS_BYTES = 4 * 1024 * 1024
_KEY_LABEL = b"slurm_ckpt node status v1"
_MESSAGE_LABEL = b"slurm_ckpt node status v2"


class StatusStore(Protocol):
    """Where node statuses are published and read (see the module docstring)."""

    #: Where, for messages (a path or an ``s3://`` URL).
    where: str

    def publish(self, ledger: Ledger, extra: Optional[Dict[str, Any]] = None) -> str:
        """Write ``ledger``'s node status (root); returns where it went."""
        ...

    def read(self, problems: Optional[List[str]] = None) -> List[Dict[str, Any]]:
        """Every trusted node status, sorted by node; what was skipped goes to
        ``problems`` (and the log)."""
        ...


class PosixStatusStore:
    """Node statuses in ``<root>/.slurm_ckpt/nodes`` (the PFS root)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.where = str(self.root / LEDGER_SUBDIR / NODES_SUBDIR)

    def publish(self, ledger: Ledger, extra: Optional[Dict[str, Any]] = None) -> str:
        return str(publish_status(ledger, self.root, extra))

    def read(self, problems: Optional[List[str]] = None) -> List[Dict[str, Any]]:
        return read_node_statuses(self.root, problems)


def _signing_key(secret: str) -> bytes:
    return hmac.new(secret.encode(), _KEY_LABEL, hashlib.sha256).digest()


def signed_message(node: str, seq: int, time: float, blob: bytes) -> bytes:
    """What is signed: the node, the sequence number, the time and the status's bytes,
    each bound explicitly (a status is valid only as that node's, with that number, from
    that moment: never as another node's, never as a newer one)."""
    head = json.dumps([node, seq, repr(float(time))], separators=(",", ":")).encode()
    return b"\n".join((_MESSAGE_LABEL, head, blob))


def sign(secret: str, blob: bytes) -> str:
    """The signature of a status's bytes under the credentials' ``secret``: over
    :func:`signed_message` of its node, ``seq`` and ``time`` (a blob that is not a
    status with those is signed as bytes alone, which no reader accepts)."""
    try:
        doc = json.loads(blob)
        message = signed_message(doc["node"], doc["seq"], doc["time"], blob)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        message = blob
    return hmac.new(_signing_key(secret), message, hashlib.sha256).hexdigest()


class ObjectStatusStore:
    """Node statuses as signed objects ``<prefix>/.slurm_ckpt/nodes/<node>.json`` in the
    object tier's bucket (see the module docstring). ``tier`` is an
    :class:`~slurm_ckpt.tiers.s3.S3Tier`; ``secret`` the secret access key statuses are
    signed and checked with (default: this process's credentials)."""

    def __init__(self, tier: Any, secret: Optional[str] = None) -> None:
        self.tier = tier
        self.prefix = f"{tier.base}{LEDGER_SUBDIR}/{NODES_SUBDIR}/"
        self.where = f"s3://{tier.bucket}/{self.prefix}"
        self._secret = secret

    def secret(self) -> Optional[str]:
        if self._secret is None:
            creds = self.tier.client.resolved() or {}
            self._secret = creds.get("aws_secret_access_key") or ""
        return self._secret or None

    def publish(self, ledger: Ledger, extra: Optional[Dict[str, Any]] = None) -> str:
        secret = self.secret()
        if secret is None:
            raise TierError(f"{self.where}: no object-store credentials to sign the status")
        doc = published_status(ledger, extra)
        blob = json.dumps(doc, separators=(",", ":"), default=str).encode()
        key = self.prefix + f"{validate_node(ledger.node)}.json"
        self.tier.request(
            "put_object",
            f"s3://{self.tier.bucket}/{key}",
            Key=key,
            Body=blob,
            ContentType="application/json",
            Metadata={SIG_META: sign(secret, blob)},
        )
        return f"s3://{self.tier.bucket}/{key}"

    def read(self, problems: Optional[List[str]] = None) -> List[Dict[str, Any]]:
        notes: List[str] = [] if problems is None else problems
        secret = self.secret()
        if secret is None:
            _skip(notes, f"{self.where}: no object-store credentials: node statuses not read")
            return []
        try:
            listing = list(self.tier.list_objects(self.prefix))
        except CkptError as exc:
            _skip(notes, f"cannot list node statuses in {self.where}: {exc}")
            return []
        out = []
        for obj in listing:
            key = obj.get("Key", "")
            name = key[len(self.prefix) :]
            if "/" in name or not name.endswith(".json") or name.startswith("."):
                continue
            doc = self._read_one(key, name, int(obj.get("Size", 0)), secret, notes)
            if doc is not None:
                out.append(doc)
        out.sort(key=lambda d: d["node"])
        return out

    def _read_one(
        self, key: str, name: str, size: int, secret: str, notes: List[str]
    ) -> Optional[Dict[str, Any]]:
        where = f"s3://{self.tier.bucket}/{key}"
        if size > _MAX_STATUS_BYTES:
            _skip(notes, f"skipping node status {where}: too large ({size} bytes)")
            return None
        try:
            r = self.tier.request("get_object", where, Key=key)
            blob = r["Body"].read(_MAX_STATUS_BYTES + 1)
        except (CkptError, OSError) as exc:
            _skip(notes, f"skipping node status {where}: {exc}")
            return None
        sig = str((r.get("Metadata") or {}).get(SIG_META, ""))
        if len(blob) > _MAX_STATUS_BYTES:
            _skip(notes, f"skipping node status {where}: too large")
            return None
        try:
            doc = json.loads(blob)
        except (ValueError, UnicodeDecodeError, RecursionError):
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("time"), (int, float)):
            doc = None
        if doc is None or status_seq(doc) is None or not isinstance(doc.get("node"), str):
            _skip(notes, f"skipping node status {where}: not signed by root's credentials")
            return None
        message = signed_message(doc["node"], doc["seq"], doc["time"], blob)
        good = hmac.new(_signing_key(secret), message, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sig, good):
            _skip(notes, f"skipping node status {where}: not signed by root's credentials")
            return None
        if doc["node"] != name[: -len(".json")]:
            _skip(notes, f"skipping node status {where}: not the status of that node")
            return None
        return doc


def _skip(notes: List[str], text: str) -> None:
    log.warning("%s", text)
    notes.append(text)


def read_statuses(where: Any, problems: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Node statuses from a :class:`StatusStore`, or from a PFS root given as a path."""
    store = where if hasattr(where, "read") else PosixStatusStore(Path(where))
    return store.read(problems)


def status_store(cfg: Config) -> StatusStore:
    """The node-status store of this site: on the PFS when there is one, else in the
    object tier's bucket (see the module docstring)."""
    if cfg.tiers.pfs is not None:
        return PosixStatusStore(Path(cfg.tiers.pfs.root))
    from slurm_ckpt.tiers.registry import tiers_from_config

    tier = tiers_from_config(cfg)[OBJECT_SECTION]
    return ObjectStatusStore(tier)
