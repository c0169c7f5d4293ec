"""Non-tensor items of a DCP checkpoint stored as data, never as a pickle.

DCP hands every non-tensor value of a state dict (an epoch counter, a loss history in an
``io.BytesIO`` as PyTorch's own e2e tests keep it, ``np.random.get_state()``, Python's
``random.getstate()``) to the storage writer as a ``torch.save`` pickle, and its own
reader unpickles that with ``weights_only=False``: whoever can write a checkpoint runs
code in every job that loads it. Our reader refuses such pickles; so that what a job
saves also loads, the writer stores these values in a format of its own instead: a JSON
tree of tagged nodes plus raw buffers for bytes, ``io.BytesIO`` contents, tensors and
numpy arrays. Loading it builds only those types; nothing is looked up by name except
a ``torch.dtype`` and a numpy dtype from a checked string.

What cannot be stored so (a user's class, an object array, a namedtuple) raises
:class:`Unstorable`, which names where in the item the value sits; the writer then falls
back to the pickle only when ``weights_only=True`` takes it (classes the user registered
with ``torch.serialization.add_safe_globals``), and otherwise fails the save at once.
"""

from __future__ import annotations

import collections
import io
import json
import re
import struct
import sys
from typing import Any, List

import torch

from slurm_ckpt.errors import VerifyError

__all__ = ["MAGIC", "Unstorable", "decode_value", "encode_value", "is_value"]

MAGIC = b"SLURM_CKPT_VALUE/1\n"
#: Nesting deeper than this is refused (a hostile document must not exhaust the stack).
MAX_DEPTH = 200
_LEN = struct.Struct("<Q")
#: numpy dtype strings accepted on load: byte order, kind (no objects), size, unit.
_NP_DTYPE = re.compile(r"^[<>|=]?[biufcmMSUV]\d{0,4}(\[[a-zA-Z]{1,3}\])?$")


class Unstorable(TypeError):
    """A value of a type the value format does not hold; ``where`` is its path inside
    the item (``""``: the item itself), ``what`` its type's name."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{what} at {where or 'the item itself'}")
        self.where, self.what = where, what


def _np() -> Any:
    """numpy when it is imported (a numpy value exists only then); None otherwise."""
    return sys.modules.get("numpy")


class _Encoder:
    def __init__(self) -> None:
        self.blobs: List[bytes] = []
        self.size = 0

    def blob(self, data: Any) -> List[int]:
        b = bytes(data)
        at = self.size
        self.blobs.append(b)
        self.size += len(b)
        return [at, len(b)]

    def node(self, obj: Any, where: str, depth: int) -> List[Any]:
        if depth > MAX_DEPTH:
            raise Unstorable(where, f"nesting deeper than {MAX_DEPTH}")
        t = type(obj)
        if obj is None:
            return ["none"]
        if t is bool:
            return ["bool", obj]
        if t is int:
            return ["int", str(obj)]
        if t is float:
            return ["float", obj.hex()]
        if t is complex:
            return ["complex", obj.real.hex(), obj.imag.hex()]
        if t is str:
            return ["str", obj]
        if t is bytes:
            return ["bytes", *self.blob(obj)]
        if t is bytearray:
            return ["bytearray", *self.blob(obj)]
        if t is io.BytesIO:
            return ["bytesio", *self.blob(obj.getbuffer()), obj.tell()]
        if t is list or t is tuple:
            tag = "list" if t is list else "tuple"
            return [tag, [self.node(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]]
        if t is torch.Size:
            return ["size", [int(v) for v in obj]]
        if t is dict or t is collections.OrderedDict:
            tag = "dict" if t is dict else "odict"
            return [
                tag,
                [
                    [
                        self.node(k, f"{where}.<key>", depth + 1),
                        self.node(v, f"{where}[{k!r}]", depth + 1),
                    ]
                    for k, v in obj.items()
                ],
            ]
        if isinstance(obj, torch.Tensor) and t in (torch.Tensor, torch.nn.Parameter):
            return self.tensor(obj, where)
        if t is torch.dtype:
            return ["dtype", str(obj).replace("torch.", "")]
        np = _np()
        if np is not None:
            if t is np.ndarray and not obj.dtype.hasobject and obj.dtype.fields is None:
                raw = obj.tobytes(order="C")
                return ["ndarray", *self.blob(raw), obj.dtype.str, list(obj.shape)]
            if isinstance(obj, np.generic) and not obj.dtype.hasobject and obj.dtype.fields is None:
                return ["npscalar", *self.blob(obj.tobytes()), obj.dtype.str]
        raise Unstorable(where, f"{t.__module__}.{t.__qualname__}")

    def tensor(self, t: torch.Tensor, where: str) -> List[Any]:
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise Unstorable(where, f"a {t.layout} tensor on {t.device}")
        c = t.detach().cpu().contiguous()
        raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
        return ["tensor", *self.blob(raw), str(c.dtype).replace("torch.", ""), list(c.shape)]


def encode_value(obj: Any) -> bytes:
    """``obj`` in the value format; :class:`Unstorable` when it holds another type."""
    enc = _Encoder()
    tree = enc.node(obj, "", 0)
    head = json.dumps({"tree": tree}, separators=(",", ":"), allow_nan=False).encode()
    return b"".join([MAGIC, _LEN.pack(len(head)), head, *enc.blobs])


def is_value(raw: Any) -> bool:
    return bytes(raw[: len(MAGIC)]) == MAGIC


class _Decoder:
    def __init__(self, blob: memoryview) -> None:
        self.blob = blob

    def take(self, at: Any, n: Any) -> memoryview:
        if not (type(at) is int and type(n) is int and at >= 0 and 0 <= n <= len(self.blob) - at):
            raise VerifyError("buffer out of range")
        return self.blob[at : at + n]

    def node(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise VerifyError("nested too deep")
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            raise VerifyError("not a value node")
        tag, args = node[0], node[1:]
        if tag == "none":
            return None
        if tag == "bool" and type(args[0]) is bool:
            return args[0]
        if tag == "int":
            return int(_str(args[0]))
        if tag == "float":
            return float.fromhex(_str(args[0]))
        if tag == "complex":
            return complex(float.fromhex(_str(args[0])), float.fromhex(_str(args[1])))
        if tag == "str":
            return _str(args[0])
        if tag == "bytes":
            return bytes(self.take(args[0], args[1]))
        if tag == "bytearray":
            return bytearray(self.take(args[0], args[1]))
        if tag == "bytesio":
            out = io.BytesIO(bytes(self.take(args[0], args[1])))
            out.seek(int(args[2]))
            return out
        if tag in ("list", "tuple"):
            items = [self.node(v, depth + 1) for v in _list(args[0])]
            return items if tag == "list" else tuple(items)
        if tag == "size":
            return torch.Size([int(v) for v in _list(args[0])])
        if tag in ("dict", "odict"):
            out_d: Any = {} if tag == "dict" else collections.OrderedDict()
            for pair in _list(args[0]):
                k, v = _list(pair)
                out_d[self.node(k, depth + 1)] = self.node(v, depth + 1)
            return out_d
        if tag == "tensor":
            return self.tensor(args)
        if tag == "dtype":
            return _torch_dtype(args[0])
        if tag in ("ndarray", "npscalar"):
            return self.numpy(tag, args)
        raise VerifyError(f"unknown value node {tag!r}")

    def tensor(self, args: List[Any]) -> torch.Tensor:
        raw = self.take(args[0], args[1])
        dtype = _torch_dtype(args[2])
        shape = _shape(args[3], len(raw), torch.empty((), dtype=dtype).element_size())
        if len(raw) == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(bytearray(raw), dtype=dtype)
        return flat.reshape(shape)

    def numpy(self, tag: str, args: List[Any]) -> Any:
        import numpy as np  # a numpy value was saved: numpy is there to load it

        raw = bytes(self.take(args[0], args[1]))
        code = _str(args[2])
        if not _NP_DTYPE.match(code):
            raise VerifyError(f"numpy dtype {code!r}")
        dtype = np.dtype(code)
        if tag == "npscalar":
            return np.frombuffer(raw, dtype=dtype, count=1)[0].copy()
        shape = _shape(args[3], len(raw), dtype.itemsize)
        return np.frombuffer(raw, dtype=dtype).copy().reshape(shape)


def _shape(v: Any, nbytes: int, itemsize: int) -> List[int]:
    """A shape that the stored bytes fill exactly (a hostile shape must not make the
    load allocate more than the bytes that are there)."""
    dims = [d for d in _list(v) if type(d) is int and d >= 0]
    if len(dims) != len(v):
        raise VerifyError("bad shape")
    count = 1
    for d in dims:
        count *= d
    if count * itemsize != nbytes:
        raise VerifyError(f"shape {dims} does not fit {nbytes} bytes")
    return dims


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise VerifyError("expected a string")
    return v


def _list(v: Any) -> List[Any]:
    if not isinstance(v, list):
        raise VerifyError("expected a list")
    return v


def _torch_dtype(name: Any) -> torch.dtype:
    got = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(got, torch.dtype):
        raise VerifyError(f"unknown dtype {name!r}")
    return got


def decode_value(raw: Any, what: str) -> Any:
    """The value stored by :func:`encode_value`; a one-line :class:`VerifyError` naming
    ``what`` when the bytes are not such a value."""
    buf = memoryview(bytes(raw))
    try:
        if not is_value(buf):
            raise VerifyError("not a stored value")
        at = len(MAGIC)
        (n,) = _LEN.unpack_from(buf, at)
        head = json.loads(bytes(buf[at + _LEN.size : at + _LEN.size + n]))
        if not isinstance(head, dict) or "tree" not in head:
            raise VerifyError("no value tree")
        return _Decoder(buf[at + _LEN.size + n :]).node(head["tree"], 0)
    except VerifyError as exc:
        raise VerifyError(f"{what}: bad stored value: {exc}") from None
    except (ValueError, TypeError, IndexError, struct.error, OverflowError, RuntimeError) as exc:
        raise VerifyError(f"{what}: bad stored value ({type(exc).__name__}: {exc})") from None
