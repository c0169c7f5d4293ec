"""The lossless, pickle-free encoding of PyTorch state_dict values (the half of
:mod:`slurm_ckpt.torch` that knows value types, not training objects).

Values that have no exact JSON form are wrapped in small tagged dicts
(``{"__sc__": "tuple", "v": [...]}``, ``{"__sc__": "float", "v": "inf"}``, int-keyed
dicts, lists holding tensors) so the round trip is lossless; anything that could only be
saved by pickling (a lambda, a bound method, an arbitrary object) is refused with a
one-line :class:`UnsupportedState` naming where it was found.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from slurm_ckpt.errors import EXIT_USAGE, CkptError

__all__ = ["TAG", "UnsupportedState", "as_tensor", "decode", "encode", "has_blob", "tensors_in"]

TAG = "__sc__"

_JSON_SCALARS = (str, int, float, bool, type(None))


class UnsupportedState(CkptError):
    """A value in the training state cannot be stored without pickle (lambda, object...)."""

    exit_code = EXIT_USAGE


# ---------------------------------------------------------------------------------------
# generic lossless encoding of state_dict-like values
# ---------------------------------------------------------------------------------------
def _is_leaf_blob(x: Any) -> bool:
    """Leaves the job layer stores as raw bytes (not JSON)."""
    return isinstance(x, (torch.Tensor, np.ndarray, bytes))


def has_blob(x: Any) -> bool:
    """Does an encoded value contain a tensor/array/bytes anywhere? (Such values must sit
    in dicts, not lists: the job layer's index only nests tensors inside dicts.)"""
    if _is_leaf_blob(x):
        return True
    if isinstance(x, dict):
        return any(has_blob(v) for v in x.values())
    if isinstance(x, list):
        return any(has_blob(v) for v in x)
    return False


def _enc_tensor(t: torch.Tensor, path: str) -> torch.Tensor:
    if t.layout != torch.strided:
        raise UnsupportedState(f"{path}: {t.layout} tensors are not supported (use dense)")
    if t.is_quantized:
        raise UnsupportedState(f"{path}: quantized tensors are not supported")
    if t.device.type == "meta":
        raise UnsupportedState(f"{path}: a meta tensor has no data to save")
    t = t.detach()
    if type(t) is not torch.Tensor:  # nn.Parameter, DTensor, ... -> plain tensor view
        if not isinstance(t, torch.nn.Parameter) and hasattr(t, "__torch_dispatch__"):
            raise UnsupportedState(
                f"{path}: tensor subclass {type(t).__name__} is not supported; "
                "pass a plain (local or gathered) tensor"
            )
        t = t.as_subclass(torch.Tensor)
    return t


def encode(obj: Any, path: str = "state") -> Any:
    """Encode one value losslessly into tensors/arrays/bytes/JSON nested in dicts.

    Tensors are returned as detached references, not copies: the job layer's ``save()``
    takes the snapshot, so copying here would only double the memory of a checkpoint.
    ``path`` names the value in error messages.
    """
    if isinstance(obj, torch.Tensor):
        return _enc_tensor(obj, path)
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise UnsupportedState(f"{path}: numpy object arrays would need pickle")
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, np.generic):  # before int/float: np.float64 subclasses float
        if obj.dtype.hasobject or obj.dtype.kind not in "biufc":
            raise UnsupportedState(f"{path}: numpy scalar of dtype {obj.dtype} not supported")
        if obj.dtype.kind == "c":
            return {
                TAG: "npscalar",
                "dtype": obj.dtype.str,
                "v": [obj.real.item(), obj.imag.item()],
            }
        v = obj.item()
        return {TAG: "npscalar", "dtype": obj.dtype.str, "v": encode(v, path)}
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        return {TAG: "float", "v": repr(float(obj))}  # 'inf', '-inf', 'nan'
    if isinstance(obj, torch.dtype):
        return {TAG: "dtype", "v": str(obj).replace("torch.", "")}
    if isinstance(obj, torch.device):
        return {TAG: "device", "v": str(obj)}
    if isinstance(obj, Mapping):
        keys = list(obj.keys())
        if all(isinstance(k, str) for k in keys):
            if TAG in keys:
                raise UnsupportedState(f"{path}: the key {TAG!r} is reserved")
            return {k: encode(obj[k], f"{path}.{k}") for k in keys}
        for k in keys:
            if not isinstance(k, _JSON_SCALARS) or (isinstance(k, float) and not math.isfinite(k)):
                raise UnsupportedState(f"{path}: dict key {k!r} ({type(k).__name__}) not supported")
        return {
            TAG: "dict",
            "k": keys,
            "v": {str(i): encode(obj[k], f"{path}[{k!r}]") for i, k in enumerate(keys)},
        }
    if isinstance(obj, (list, tuple)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        if isinstance(obj, tuple) and type(obj) is not tuple and not isinstance(obj, torch.Size):
            raise UnsupportedState(f"{path}: named tuple {type(obj).__name__} would need pickle")
        items = [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if any(has_blob(v) for v in items):
            return {TAG: kind + "_d", "v": {str(i): v for i, v in enumerate(items)}}
        return items if kind == "list" else {TAG: "tuple", "v": items}
    what = "a function or lambda" if callable(obj) else f"an object of type {type(obj).__name__}"
    raise UnsupportedState(
        f"{path}: {what} cannot be saved without pickle; keep it in code (e.g. pass the same "
        "lambda when rebuilding the scheduler) or reduce it to tensors/JSON values"
    )


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode` (tensors and arrays are returned as they come)."""
    if isinstance(obj, dict):
        tag = obj.get(TAG)
        if tag is None:
            return {k: decode(v) for k, v in obj.items()}
        v = obj["v"]
        if tag == "float":
            return float(v)
        if tag == "tuple":
            return tuple(decode(x) for x in v)
        if tag in ("list_d", "tuple_d"):
            items = [decode(v[str(i)]) for i in range(len(v))]
            return items if tag == "list_d" else tuple(items)
        if tag == "dict":
            return {k: decode(v[str(i)]) for i, k in enumerate(obj["k"])}
        if tag == "npscalar":
            dt = np.dtype(obj["dtype"])
            if dt.kind == "c":
                return dt.type(complex(v[0], v[1]))
            return dt.type(decode(v))
        if tag == "dtype":
            return getattr(torch, v)
        if tag == "device":
            return torch.device(v)
        raise UnsupportedState(f"unknown tag {tag!r} in saved state (written by a newer version?)")
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    return obj


def as_tensor(x: Any) -> Any:
    """Tensors may come back from storage as numpy arrays; the optimizer wants tensors."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return x


def tensors_in(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: tensors_in(v) for k, v in x.items()}
    if isinstance(x, list):
        return [tensors_in(v) for v in x]
    if isinstance(x, tuple):
        return tuple(tensors_in(v) for v in x)
    return as_tensor(x)
