"""Validation of every name that becomes part of a path.

Keys, user names, node names and payload file names come from users, job environments
and directory listings; root-run hooks build paths from them. A name that could climb out
of its directory (``..``, ``/``), hide (leading dot), or confuse logs (control characters)
is rejected here, once, before any path is built.
"""

from __future__ import annotations

import os
import pwd
import re
import unicodedata
from dataclasses import dataclass

from slurm_ckpt.errors import InvalidName

_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,127}")
_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_NODE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")
_COMPONENT_BAD = re.compile(r"[\x00-\x1f\x7f\\]")
MAX_RELPATH = 1024
MAX_COMPONENT = 255
#: Names the toolkit keeps for itself inside a checkpoint or key directory.
RESERVED_PREFIXES = (".tmp-", ".partial-", ".trash-", ".lock-", ".slurm_ckpt")


def validate_key(key: str) -> str:
    """A key is one path component naming a training run (defaults to the job id)."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise InvalidName(
            f"invalid key {key!r}: use 1-128 letters, digits and ._+=@- , not starting with . or -"
        )
    return key


#: A rank's series of a multi-rank job (``KEY.rank00003``) or its DCP part
#: (``KEY.dcp.rank00003``): one run, so ``status`` and ``list`` group it under ``KEY``
#: and the suspect-steps metric counts a step of it once, not once per rank.
_RANK_SERIES = re.compile(r"^(.+?)(?:\.dcp)?\.rank[0-9]{5}$")


def base_key(key: str) -> str:
    """The user's key of a series: ``KEY`` for ``KEY.rankNNNNN`` and
    ``KEY.dcp.rankNNNNN``, the key itself otherwise."""
    m = _RANK_SERIES.match(key)
    return m.group(1) if m else key


def validate_user(user: str) -> str:
    """A user name as it appears on the cluster (POSIX portable set)."""
    if not isinstance(user, str) or not _USER_RE.fullmatch(user) or user in (".", ".."):
        raise InvalidName(f"invalid user name {user!r}")
    return user


def validate_node(node: str) -> str:
    """A SLURM node name (used as a file name for per-node status)."""
    if not isinstance(node, str) or not _NODE_RE.fullmatch(node):
        raise InvalidName(f"invalid node name {node!r}")
    return node


def node_name(host: str) -> str:
    """A host name as a node name :func:`validate_node` accepts (the one node-name rule):
    the short name, odd characters replaced, ``"localhost"`` when nothing usable is left.

    ``gpu-node17.cluster.example`` -> ``gpu-node17``. For names that come from the
    machine (``gethostname``), not from a user: those are validated, never repaired.
    """
    short = (host or "").strip().split(".", 1)[0]
    short = _NODE_BAD.sub("_", short).lstrip("._-")[:128]
    return short if _NODE_RE.fullmatch(short) else "localhost"


#: Characters a name may not hold beyond C0/DEL: C1 controls (U+0080-U+009F: U+009B
#: is a CSI to many terminals), format characters (bidi overrides such as U+202E,
#: zero-width ones), line/paragraph separators, surrogates, private use. Root prints
#: these names; they must read as what they are.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co"})


def _shows_as_is(ch: str) -> bool:
    return ch.isascii() or unicodedata.category(ch) not in _HIDDEN_CATEGORIES


def validate_relpath(path: str) -> str:
    """A payload file path relative to its checkpoint directory, '/'-separated.

    Rejects absolute paths, empty, ``.`` or ``..`` components, control characters,
    backslashes and the toolkit's reserved names, so that joining it under a checkpoint
    directory can only ever name something inside that directory.
    """
    if not isinstance(path, str) or not path or len(path) > MAX_RELPATH:
        raise InvalidName(f"invalid file name {path!r}")
    if path.startswith("/"):
        raise InvalidName(f"invalid file name {path!r}: absolute paths are not allowed")
    if _COMPONENT_BAD.search(path) or (
        not path.isascii() and not all(_shows_as_is(c) for c in path)
    ):
        raise InvalidName(
            f"invalid file name {path!r}: control or format characters (C0, C1, bidi, "
            "zero-width), line separators, or backslash"
        )
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise InvalidName(f"invalid file name {path!r}: empty, '.' or '..' component")
        if len(part.encode()) > MAX_COMPONENT:
            raise InvalidName(f"invalid file name {path!r}: component too long")
        if part.startswith(RESERVED_PREFIXES):
            raise InvalidName(f"invalid file name {path!r}: reserved name")
    if parts[0] == "manifest.json" or parts[0].startswith(".manifest"):
        raise InvalidName(f"invalid file name {path!r}: reserved for the manifest")
    return path


def current_user() -> str:
    """The name of the real uid running this process (not ``$USER``, which anyone can set:
    tier directories are owned by uids, so the name must match the uid)."""
    try:
        return validate_user(pwd.getpwuid(os.getuid()).pw_name)
    except KeyError:
        raise InvalidName(f"uid {os.getuid()} has no passwd entry") from None


@dataclass(frozen=True)
class UserIds:
    """A local user: name, uid, primary gid."""

    name: str
    uid: int
    gid: int


def user_ids(name: str) -> UserIds:
    """The one passwd lookup by name: a validated user name to its ids; InvalidName when
    this node does not know the user (a job's user must be known where it runs)."""
    validate_user(name)
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise InvalidName(f"user {name!r} is not known on this node") from None
    return UserIds(pw.pw_name, pw.pw_uid, pw.pw_gid)
