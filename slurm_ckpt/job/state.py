"""Training state <-> checkpoint files, without pickle.

Why not ``torch.save``: it pickles, so loading a checkpoint runs code chosen by whoever
wrote the file, and it serialises through a single stream. Here a state (a nested dict of
tensors, numpy arrays, bytes and JSON-able values) becomes

* ``index.json``: the tree with every non-tensor value inline and, for each tensor-like
  leaf, its kind, dtype, shape and where its raw bytes live (blob, offset, nbytes);
* a few large ``data-NNNN.bin`` blobs holding the raw bytes back to back (64-byte
  aligned), at most ~1 GiB each. Top-level keys that hold model weights (``model``,
  ``weights``, ... see :data:`WEIGHT_KEYS`) are packed into their own blob(s) first, so a
  restore can read the weights before the optimizer state.

Loading is safe on untrusted files: the index is plain JSON; dtypes come from a whitelist;
shapes, offsets and sizes are checked against each other and against the blob sizes
recorded in the (self-checked) manifest; no byte range may overlap another. Reading a
state back from any tier is :mod:`slurm_ckpt.job.state_reader`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from slurm_ckpt.errors import CkptError, VerifyError

__all__ = [
    "ALIGN",
    "BLOB_TARGET",
    "GROUP_REST",
    "GROUP_WEIGHTS",
    "INDEX_NAME",
    "WEIGHT_KEYS",
    "TensorLeaf",
    "flatten",
    "index_bytes",
    "layout",
    "leaf_bytes",
    "parse_index",
    "unflatten",
]

FORMAT = "slurm_ckpt.state"
VERSION = 1
#: ``meta.state_format`` of a checkpoint that ``save()`` wrote (an index and blobs).
STATE_FORMAT = "slurm_ckpt.state/1"
INDEX_NAME = "index.json"
#: Tensor offsets inside a blob are multiples of this (lets readers view any dtype).
ALIGN = 64
#: A blob is closed once it would grow past this; a bigger tensor gets a blob of its own.
BLOB_TARGET = 1 << 30
#: Top-level keys whose values are model weights: stored in their own blob(s), read first.
WEIGHT_KEYS = frozenset(
    {"model", "models", "weights", "module", "params", "parameters", "model_state", "ema"}
)
GROUP_WEIGHTS = "weights"
GROUP_REST = "rest"
GROUPS = (GROUP_WEIGHTS, GROUP_REST)
BLOB_RE = re.compile(r"^data-[0-9]{4,6}\.bin$")
MAX_INDEX_BYTES = 512 * 2**20
MAX_DEPTH = 400
MAX_NDIM = 64

#: The torch dtypes a checkpoint may hold, with their item sizes (known without torch,
#: so that an index can be checked on a machine that has no torch).
TORCH_DTYPES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}
_KINDS = ("torch", "numpy", "bytes", "bytearray")


class TensorLeaf(NamedTuple):
    """One array-like leaf: display path, dtype string, shape, and the source object."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    buffer: Any


def group_of(key: object) -> str:
    """The blob group of a top-level key: weights are kept apart so they can be read first."""
    if isinstance(key, str) and (key.lower() in WEIGHT_KEYS or key.lower().startswith("model")):
        return GROUP_WEIGHTS
    return GROUP_REST


# --------------------------------------------------------------------------- dtypes


def _torch() -> Any:
    """torch if the process can import it (never imported just to look at a state)."""
    mod = sys.modules.get("torch")
    if mod is not None:
        return mod
    try:
        import torch
    except ImportError:
        return None
    return torch


def _is_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _torch_dtype(name: str) -> Any:
    """The torch dtype of a whitelisted name. Raises :class:`CkptError` (not
    VerifyError: the checkpoint is fine, this process is not) when torch is missing or
    too old for it."""
    torch = _torch()
    if torch is None:
        raise CkptError(f"the checkpoint holds torch.{name} tensors: install torch to load it")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CkptError(f"the checkpoint holds torch.{name} tensors: this torch lacks that dtype")
    return dt


def _numpy_dtype(name: object) -> np.dtype:
    """A plain numeric numpy dtype from its ``dtype.str``; ValueError for anything else."""
    if not isinstance(name, str) or len(name) > 8:
        raise ValueError(f"dtype {name!r} not allowed")
    try:
        dt = np.dtype(name)
    except TypeError:
        raise ValueError(f"dtype {name!r} not allowed") from None
    if dt.kind not in "biufc" or dt.hasobject or dt.fields is not None or dt.subdtype:
        raise ValueError(f"dtype {name!r} not allowed")
    if dt.str != name:
        raise ValueError(f"dtype {name!r} not in canonical form")
    return dt


def _itemsize(kind: str, dtype: str) -> int:
    if kind == "torch":
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype {dtype!r} not allowed")
        return TORCH_DTYPES[dtype]
    if kind == "numpy":
        return _numpy_dtype(dtype).itemsize
    if dtype != "uint8":
        raise ValueError(f"dtype {dtype!r} not allowed for {kind}")
    return 1


# --------------------------------------------------------------------------- flatten


def flatten(state: Any) -> Tuple[Dict[str, Any], List[TensorLeaf]]:
    """Split ``state`` into a JSON-able index and its array-like leaves (not copied).

    Leaves: ``torch.Tensor`` (strided, any whitelisted dtype, any device), numpy arrays
    and numpy scalars of numeric dtypes, ``bytes``/``bytearray``. Everything else must be
    JSON-able: dicts (str or int keys), lists, tuples (kept as tuples), str, int, float,
    bool, None. Anything else raises ``TypeError`` naming its path. The index gets its
    byte layout from :func:`layout`.
    """
    tensors: List[TensorLeaf] = []
    entries: List[Dict[str, Any]] = []

    def leaf(obj: Any, path: str, group: str) -> Dict[str, Any]:
        if _is_tensor(obj):
            if obj.layout != sys.modules["torch"].strided:
                raise TypeError(f"state {path}: only dense (strided) tensors, got {obj.layout}")
            if obj.device.type == "meta":
                raise TypeError(f"state {path}: a meta tensor has no data")
            dtype = str(obj.dtype).split(".", 1)[-1]
            if dtype not in TORCH_DTYPES:
                raise TypeError(f"state {path}: tensor dtype {obj.dtype} is not supported")
            shape = tuple(int(s) for s in obj.shape)
            entry = {"kind": "torch", "dtype": dtype, "shape": list(shape)}
            nbytes = obj.numel() * obj.element_size()
        elif isinstance(obj, (np.ndarray, np.generic)):
            arr = np.asarray(obj)
            try:
                dt = _numpy_dtype(arr.dtype.str)
            except ValueError:
                raise TypeError(f"state {path}: numpy dtype {arr.dtype} is not supported") from None
            shape = tuple(int(s) for s in arr.shape)
            entry = {"kind": "numpy", "dtype": dt.str, "shape": list(shape)}
            if isinstance(obj, np.generic):
                entry["scalar"] = True
                obj = arr
            nbytes = arr.nbytes
        else:  # bytes / bytearray
            kind = "bytearray" if isinstance(obj, bytearray) else "bytes"
            shape = (len(obj),)
            entry = {"kind": kind, "dtype": "uint8", "shape": [len(obj)]}
            nbytes = len(obj)
        entry.update(name=path, nbytes=int(nbytes), group=group)
        entries.append(entry)
        tensors.append(TensorLeaf(path, entry["dtype"], shape, obj))
        return {"tensor": len(tensors) - 1}

    def enc(obj: Any, path: str, group: str, depth: int) -> Dict[str, Any]:
        if depth > MAX_DEPTH:
            raise TypeError(f"state {path}: nested deeper than {MAX_DEPTH} levels")
        # Leaves first: np.float64 is also a float, and must come back as np.float64.
        if isinstance(obj, (bytes, bytearray, np.ndarray, np.generic)) or _is_tensor(obj):
            return leaf(obj, path, group)
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return {"value": obj}
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"state {path or '/'}: key {k!r} must be a str (or int)")
                items.append([k, enc(v, f"{path}/{k}", group, depth + 1)])
            return {"dict": items}
        if isinstance(obj, (list, tuple)):
            tag = "tuple" if isinstance(obj, tuple) else "list"
            return {tag: [enc(v, f"{path}[{i}]", group, depth + 1) for i, v in enumerate(obj)]}
        raise TypeError(
            f"state {path or '/'}: {type(obj).__name__} is not supported (use tensors, "
            "numpy arrays, bytes, dicts, lists and JSON values)"
        )

    if isinstance(state, dict):
        items, groups = [], []
        for k, v in state.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"state /: key {k!r} must be a str (or int)")
            g = group_of(k)
            items.append([k, enc(v, f"/{k}", g, 1)])
            groups.append(g)
        tree: Dict[str, Any] = {"dict": items, "groups": groups}
    else:
        tree = enc(state, "", GROUP_REST, 0)
    index = {"format": FORMAT, "version": VERSION, "tree": tree, "tensors": entries, "blobs": []}
    return index, tensors


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def layout(
    index: Dict[str, Any], blob_target: int = BLOB_TARGET, align: int = ALIGN
) -> List[Dict[str, Any]]:
    """Assign every leaf a blob and an aligned offset (weights first); returns the blobs.

    Deterministic: the same state structure gives the same layout, so staging buffers
    can be reused from one save to the next.
    """
    blobs: List[Dict[str, Any]] = []
    for group in GROUPS:
        cur: Optional[Dict[str, Any]] = None
        for e in index["tensors"]:
            if e["group"] != group:
                continue
            n = e["nbytes"]
            if cur is None or (cur["nbytes"] and _align(cur["nbytes"], align) + n > blob_target):
                cur = {"name": f"data-{len(blobs):04d}.bin", "group": group, "nbytes": 0}
                blobs.append(cur)
            off = _align(cur["nbytes"], align)
            e["blob"], e["offset"] = cur["name"], off
            cur["nbytes"] = off + n
    index["blobs"] = blobs
    return blobs


def index_bytes(index: Dict[str, Any]) -> bytes:
    """The on-disk form of the index (compact, ASCII: odd keys stay byte-exact)."""
    return json.dumps(index, separators=(",", ":"), ensure_ascii=True).encode()


def leaf_bytes(obj: Any) -> memoryview:
    """A contiguous, host-resident byte view of a leaf (copies only if it must:
    non-contiguous, on a GPU, or with a lazy conj/neg bit)."""
    if _is_tensor(obj):
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        t = t.contiguous()
        return memoryview(t.reshape(-1).view(sys.modules["torch"].uint8).numpy())
    if isinstance(obj, (np.ndarray, np.generic)):
        arr = np.ascontiguousarray(obj)
        return memoryview(arr.reshape(-1).view(np.uint8))
    return memoryview(obj).cast("B")


# --------------------------------------------------------------------------- index checks


def _bad(where: str, why: str) -> VerifyError:
    return VerifyError(f"{where}: malformed state index ({why})")


def _int_ok(x: object, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def parse_index(data: bytes, blob_sizes: Mapping[str, int], where: str = "index") -> Dict[str, Any]:
    """Parse and check an index against the real blob sizes; VerifyError if anything is off.

    Guarantees for the loader: every leaf's dtype is whitelisted, ``nbytes`` equals
    ``prod(shape) * itemsize``, its byte range lies inside its blob and overlaps no other,
    every tensor reference in the tree is valid and belongs to the group of its top-level
    key (so a partial load never meets a leaf it did not read).
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _bad(where, "not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(where, "not a slurm_ckpt state index")
    if doc.get("version") != VERSION:
        raise _bad(where, f"unsupported version {doc.get('version')!r}")
    blobs, tensors = doc.get("blobs"), doc.get("tensors")
    if not isinstance(blobs, list) or not isinstance(tensors, list):
        raise _bad(where, "blobs/tensors missing")
    blob_group: Dict[str, str] = {}
    blob_len: Dict[str, int] = {}
    for b in blobs:
        if not isinstance(b, dict):
            raise _bad(where, "blob entry")
        name, group, nbytes = b.get("name"), b.get("group"), b.get("nbytes")
        if not isinstance(name, str) or not BLOB_RE.match(name) or name in blob_group:
            raise _bad(where, f"blob name {name!r}")
        if group not in GROUPS or not _int_ok(nbytes):
            raise _bad(where, f"blob {name}")
        if blob_sizes.get(name) != nbytes:
            on_disk = blob_sizes.get(name)
            raise _bad(where, f"blob {name}: {nbytes!r} bytes in index, {on_disk!r} on disk")
        blob_group[name], blob_len[name] = group, nbytes
    ranges: Dict[str, List[Tuple[int, int]]] = {n: [] for n in blob_group}
    for i, e in enumerate(tensors):
        if not isinstance(e, dict):
            raise _bad(where, f"tensor {i}")
        kind, dtype, shape = e.get("kind"), e.get("dtype"), e.get("shape")
        blob, off, nbytes = e.get("blob"), e.get("offset"), e.get("nbytes")
        if kind not in _KINDS or not isinstance(dtype, str):
            raise _bad(where, f"tensor {i}: kind {kind!r}")
        if not isinstance(e.get("name"), str) or e.get("group") not in GROUPS:
            raise _bad(where, f"tensor {i}: name or group")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(_int_ok(s) for s in shape)
        ):
            raise _bad(where, f"tensor {i}: shape")
        if kind in ("bytes", "bytearray") and len(shape) != 1:
            raise _bad(where, f"tensor {i}: bytes shape")
        if kind == "numpy" and "scalar" in e and (e["scalar"] is not True or shape):
            raise _bad(where, f"tensor {i}: scalar")
        try:
            itemsize = _itemsize(kind, dtype)
        except ValueError as exc:
            raise _bad(where, f"tensor {i}: {exc}") from None
        if not _int_ok(nbytes) or nbytes != math.prod(shape) * itemsize:
            raise _bad(where, f"tensor {i}: nbytes does not match shape and dtype")
        if blob not in blob_group or blob_group[blob] != e["group"] or not _int_ok(off):
            raise _bad(where, f"tensor {i}: blob or offset")
        if off + nbytes > blob_len[blob]:
            raise _bad(where, f"tensor {i}: bytes {off}-{off + nbytes} outside {blob}")
        if nbytes:
            ranges[blob].append((off, off + nbytes))
    for name, rs in ranges.items():
        rs.sort()
        for (_, end), (start, _) in zip(rs, rs[1:]):
            if start < end:
                raise _bad(where, f"overlapping byte ranges in {name}")
    _check_tree(doc.get("tree"), tensors, where)
    return doc


def _check_tree(tree: Any, tensors: List[Dict[str, Any]], where: str) -> None:
    def walk(node: Any, group: Optional[str], depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _bad(where, "nested too deep")
        if not isinstance(node, dict) or len(node) != 1:
            raise _bad(where, "tree node")
        ((tag, val),) = node.items()
        if tag == "value":
            if val is not None and not isinstance(val, (bool, int, float, str)):
                raise _bad(where, "value")
        elif tag == "tensor":
            if not _int_ok(val) or val >= len(tensors):
                raise _bad(where, "tensor reference")
            if group is not None and tensors[val]["group"] != group:
                raise _bad(where, "tensor outside its group")
        elif tag == "dict":
            if not isinstance(val, list):
                raise _bad(where, "dict")
            for item in val:
                if not isinstance(item, list) or len(item) != 2:
                    raise _bad(where, "dict item")
                if isinstance(item[0], bool) or not isinstance(item[0], (str, int)):
                    raise _bad(where, "dict key")
                walk(item[1], group, depth + 1)
        elif tag in ("list", "tuple"):
            if not isinstance(val, list):
                raise _bad(where, tag)
            for v in val:
                walk(v, group, depth + 1)
        else:
            raise _bad(where, f"tree tag {tag!r}")

    if isinstance(tree, dict) and "groups" in tree:
        items, groups = tree.get("dict"), tree.get("groups")
        if (
            set(tree) != {"dict", "groups"}
            or not isinstance(items, list)
            or not isinstance(groups, list)
            or len(items) != len(groups)
            or not all(g in GROUPS for g in groups)
        ):
            raise _bad(where, "root")
        for item, g in zip(items, groups):
            if not isinstance(item, list) or len(item) != 2:
                raise _bad(where, "dict item")
            if isinstance(item[0], bool) or not isinstance(item[0], (str, int)):
                raise _bad(where, "dict key")
            walk(item[1], g, 1)
    else:
        walk(tree, GROUP_REST, 0)


# --------------------------------------------------------------------------- unflatten


def _from_raw(entry: Dict[str, Any], buf: Any) -> Any:
    """A leaf from raw bytes (copied once into fresh memory: the caller keeps ``buf``)."""
    kind, shape = entry["kind"], tuple(entry["shape"])
    raw = memoryview(buf).cast("B")
    if kind == "bytes":
        return bytes(raw)
    if kind == "bytearray":
        return bytearray(raw)
    if kind == "numpy":
        arr = np.frombuffer(raw, dtype=np.uint8).view(_numpy_dtype(entry["dtype"])).reshape(shape)
        arr = arr.copy()
        return arr[()] if entry.get("scalar") else arr
    torch = _torch()
    dt = _torch_dtype(entry["dtype"])
    out = torch.empty(shape, dtype=dt)
    if raw.nbytes:
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
    return out


def unflatten(
    index: Dict[str, Any], buffers: Sequence[Any], groups: Optional[Sequence[str]] = None
) -> Any:
    """Rebuild the state from an index and its leaves.

    ``buffers[i]`` is either the finished leaf (a tensor, array or bytes, used as is) or
    raw bytes (turned into the leaf of ``index["tensors"][i]``). With ``groups`` only the
    top-level keys of those groups are rebuilt (the leaves of the others may be None).
    """
    entries = index["tensors"]
    cache: Dict[int, Any] = {}

    def get(i: int) -> Any:
        if i not in cache:
            b = buffers[i]
            e = entries[i]
            if _is_tensor(b) or isinstance(b, (np.ndarray, np.generic)):
                cache[i] = b
            elif isinstance(b, (bytes, bytearray)) and e["kind"] in ("bytes", "bytearray"):
                cache[i] = b if type(b).__name__ == e["kind"] else _from_raw(e, b)
            else:
                cache[i] = _from_raw(e, b)
        return cache[i]

    def dec(node: Dict[str, Any]) -> Any:
        ((tag, val),) = ((k, v) for k, v in node.items() if k != "groups")
        if tag == "value":
            return val
        if tag == "tensor":
            return get(val)
        if tag == "dict":
            return {k: dec(v) for k, v in val}
        if tag == "tuple":
            return tuple(dec(v) for v in val)
        return [dec(v) for v in val]

    tree = index["tree"]
    if "groups" in tree:
        wanted = set(GROUPS if groups is None else groups)
        return {k: dec(v) for (k, v), g in zip(tree["dict"], tree["groups"]) if g in wanted}
    if groups is not None and GROUP_REST not in groups:
        return None
    return dec(tree)


# --------------------------------------------------------------------------- reading


def view_leaf(entry: Dict[str, Any], mm: Any) -> Any:
    """A leaf as a view into its blob's mapping: no copy, and the view keeps ``mm`` alive.

    Each torch view (``torch.frombuffer``) has a storage of exactly its own bytes, so
    ``torch.save`` of one restored tensor writes that tensor, not the whole blob."""
    kind, shape = entry["kind"], tuple(entry["shape"])
    off, n = entry["offset"], entry["nbytes"]
    if kind in ("bytes", "bytearray"):
        raw = memoryview(mm)[off : off + n]
        return bytes(raw) if kind == "bytes" else bytearray(raw)
    if kind == "numpy":
        dt = _numpy_dtype(entry["dtype"])
        count = n // dt.itemsize if dt.itemsize else 0
        if count:
            arr = np.frombuffer(mm, dtype=dt, count=count, offset=off).reshape(shape)
        else:
            arr = np.empty(shape, dtype=dt)
        return arr[()] if entry.get("scalar") else arr
    torch = _torch()
    dt = _torch_dtype(entry["dtype"])
    if not n:
        return torch.empty(shape, dtype=dt)
    count = n // _itemsize(kind, entry["dtype"])
    return torch.frombuffer(mm, dtype=dt, count=count, offset=off).view(shape)
