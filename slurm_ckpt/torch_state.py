"""Capture and apply a PyTorch training state as the toolkit's pickle-free tree.

The halves :mod:`slurm_ckpt.torch` is built on (its docstring gives the tree's layout
and why it is exact): :func:`capture` turns a model, optimizer, scheduler, scaler, the
RNGs and the data loader's position into the tree ``Checkpointer.save()`` stores, and
:func:`apply` puts it back bit for bit. Apart from the saving and restoring *policy*
(``TorchCheckpointer``, ``save``, ``restore``) so that each module holds one concept.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Optional

import numpy as np
import torch

from slurm_ckpt.torch_codec import (
    UnsupportedState,
    as_tensor,
    decode,
    encode,
    tensors_in,
)
from slurm_ckpt.torch_data import apply_loader, capture_loader

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "apply",
    "apply_model",
    "apply_rng",
    "capture",
    "capture_rng",
    "state_digest",
]

FORMAT_NAME = "slurm_ckpt.torch"
FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------
def _model_state(model: torch.nn.Module) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, value in model.state_dict().items():
        out[name] = encode(value, f"model.{name}")
    return out


def _optimizer_state(opt: torch.optim.Optimizer) -> Dict[str, Any]:
    sd = opt.state_dict()
    state = sd.get("state", {})
    keys = list(state.keys())
    int_keys = all(isinstance(k, int) and not isinstance(k, bool) for k in keys)
    if not int_keys and not all(isinstance(k, str) for k in keys):
        raise UnsupportedState("optimizer.state: keys must be all ints or all strings")
    enc_state = {str(k): encode(state[k], f"optimizer.state[{k!r}]") for k in keys}
    out: Dict[str, Any] = {
        "state": enc_state,
        "param_groups": encode(sd.get("param_groups", []), "optimizer.param_groups"),
        "int_keys": int_keys,
    }
    rest = {k: v for k, v in sd.items() if k not in ("state", "param_groups")}
    if rest:  # e.g. optimizers with extra top-level entries
        out["rest"] = encode(rest, "optimizer")
    return out


def _optimizer_load(opt: torch.optim.Optimizer, saved: Dict[str, Any]) -> None:
    int_keys = bool(saved.get("int_keys", True))
    state = {(int(k) if int_keys else k): tensors_in(decode(v)) for k, v in saved["state"].items()}
    sd: Dict[str, Any] = {
        "state": state,
        "param_groups": tensors_in(decode(saved["param_groups"])),
    }
    if "rest" in saved:
        sd.update(tensors_in(decode(saved["rest"])))
    opt.load_state_dict(sd)


def capture_rng() -> Dict[str, Any]:
    """Every global RNG a training step may draw from: Python, NumPy, torch CPU, CUDA."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=True)
    name, keys, pos, has_gauss, cached = np_state  # type: ignore[misc]
    out: Dict[str, Any] = {
        "python": {
            "version": int(version),
            "internal": [int(x) for x in internal],
            "gauss_next": encode(gauss_next, "rng.python.gauss_next"),
        },
        "numpy": {
            "name": str(name),
            "keys": np.array(keys, dtype=np.uint32, copy=True),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": encode(float(cached), "rng.numpy.cached_gaussian"),
        },
        "torch": torch.get_rng_state(),
    }
    # Only when this process already uses CUDA: asking for the states would otherwise
    # initialise CUDA in a CPU-only job (and a never-used CUDA RNG needs no restoring).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return out


def apply_rng(saved: Dict[str, Any]) -> None:
    """Restore the RNGs saved by :func:`capture_rng` (CUDA ones only where CUDA exists)."""
    py = saved.get("python")
    if py is not None:
        random.setstate(
            (int(py["version"]), tuple(int(x) for x in py["internal"]), decode(py["gauss_next"]))
        )
    nps = saved.get("numpy")
    if nps is not None:
        keys = np.asarray(nps["keys"], dtype=np.uint32)
        np.random.set_state(
            (
                str(nps["name"]),
                keys,
                int(nps["pos"]),
                int(nps["has_gauss"]),
                float(decode(nps["cached_gaussian"])),
            )
        )
    ts = saved.get("torch")
    if ts is not None:
        torch.set_rng_state(as_tensor(ts).to(torch.uint8).cpu().clone())
    cuda = saved.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            warnings.warn(
                "checkpoint holds CUDA RNG states but CUDA is not available: not restored",
                stacklevel=3,
            )
        else:
            states = [as_tensor(cuda[str(i)]).to(torch.uint8).cpu() for i in range(len(cuda))]
            n = torch.cuda.device_count()
            if n != len(states):
                warnings.warn(
                    f"checkpoint holds {len(states)} CUDA RNG states, this process sees {n} "
                    "devices: restoring the first min of both",
                    stacklevel=3,
                )
            for i in range(min(n, len(states))):
                torch.cuda.set_rng_state(states[i], i)


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------
def capture(
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[Any] = None,
    data_position: Optional[Mapping[str, Any]] = None,
    extra: Optional[Mapping[str, Any]] = None,
    *,
    rng: bool = True,
    loader: Optional[Any] = None,
) -> Dict[str, Any]:
    """The complete training state as a pickle-free tree, ready for ``Checkpointer.save``.

    ``loader``: the data loader, whose position is kept so that a resume continues at
    the same sample (torchdata's ``StatefulDataLoader``, or a ``DataLoader`` whose
    sampler has ``state_dict()``; a plain ``DataLoader`` is warned about once, with the
    fix: see :mod:`slurm_ckpt.torch_data`).

    Tensors are *references* into the live model/optimizer (detached, not copied): hand
    the result to ``save()`` straight away, which snapshots them before returning, and do
    not step the optimizer in between. ``rng=False`` leaves the global RNGs out (for a
    job whose randomness is fully derived from the step, or for weights-only exports).

    Schedulers: ``LambdaLR``/``MultiplicativeLR`` already leave plain functions and
    lambdas out of their ``state_dict`` (rebuild the scheduler with the same function
    before :func:`apply`); a callable *object*'s attributes are saved when they are
    tensors/JSON values, and anything else raises :class:`UnsupportedState` naming it.
    """
    state: Dict[str, Any] = {}
    if model is not None:  # first: the job layer writes "model" first (weights-first restore)
        state["model"] = _model_state(model)
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(optimizer)
    if scheduler is not None:
        state["scheduler"] = encode(scheduler.state_dict(), "scheduler")
    if scaler is not None:
        state["scaler"] = encode(scaler.state_dict(), "scaler")
    if rng:
        state["rng"] = capture_rng()
    if data_position is not None:
        state["data_position"] = encode(dict(data_position), "data_position")
    if loader is not None:
        state["data_loader"] = encode(capture_loader(loader), "data_loader")
    if extra is not None:
        state["extra"] = encode(dict(extra), "extra")
    state["torch_format"] = {"name": FORMAT_NAME, "version": FORMAT_VERSION}
    return state


def _check_format(state: Mapping[str, Any]) -> None:
    fmt = state.get("torch_format")
    if fmt is None:
        return  # a tree saved by hand; accept what is there
    if fmt.get("name") != FORMAT_NAME or int(fmt.get("version", 0)) > FORMAT_VERSION:
        raise UnsupportedState(
            f"checkpoint state format {fmt!r} is not readable by this version "
            f"({FORMAT_NAME} v{FORMAT_VERSION})"
        )


def apply_model(state: Mapping[str, Any], model: torch.nn.Module, strict: bool = True) -> None:
    """Load only the weights (``state["model"]``) into ``model`` - e.g. straight after a
    weights-only restore, before the optimizer state has been read."""
    _check_format(state)
    if "model" not in state:
        raise UnsupportedState("checkpoint holds no model weights ('model' key missing)")
    sd = {k: tensors_in(decode(v)) for k, v in state["model"].items()}
    model.load_state_dict(sd, strict=strict)


def apply(
    state: Mapping[str, Any],
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[Any] = None,
    *,
    rng: bool = True,
    strict: bool = True,
    loader: Optional[Any] = None,
) -> Optional[Dict[str, Any]]:
    """Restore what :func:`capture` saved into the given objects; return the data position.

    ``loader``: a fresh data loader built like the saved one; its next iterator
    continues where the saved one stood.

    Order matters for exactness: model, then optimizer (its ``load_state_dict`` casts
    state to the parameters' device/dtype), scheduler, scaler, and the RNGs last so that
    nothing run during the restore consumes random numbers after they were set. A part
    asked for but missing from the checkpoint is an error, not a silent fresh start.

    The optimizer adopts the restored state tensors when their dtype and device already
    match (no copy, as ``Optimizer.load_state_dict`` does): do not apply the same tree
    to a second optimizer.
    """
    _check_format(state)
    if model is not None:
        apply_model(state, model, strict=strict)
    if optimizer is not None:
        if "optimizer" not in state:
            raise UnsupportedState("checkpoint holds no optimizer state ('optimizer' missing)")
        _optimizer_load(optimizer, state["optimizer"])
    if scheduler is not None:
        if "scheduler" not in state:
            raise UnsupportedState("checkpoint holds no LR scheduler state ('scheduler' missing)")
        scheduler.load_state_dict(tensors_in(decode(state["scheduler"])))
    if scaler is not None:
        if "scaler" not in state:
            raise UnsupportedState("checkpoint holds no GradScaler state ('scaler' missing)")
        scaler.load_state_dict(tensors_in(decode(state["scaler"])))
    if loader is not None:
        if "data_loader" not in state:
            raise UnsupportedState("checkpoint holds no data loader position ('data_loader')")
        apply_loader(tensors_in(decode(state["data_loader"])), loader)
    if rng and "rng" in state:
        apply_rng(state["rng"])
    pos = state.get("data_position")
    return None if pos is None else decode(pos)


def state_digest(source: Any) -> str:
    """sha256 of the raw bytes of every tensor of a model (or state_dict), in order.

    Used to prove that a resumed run ends bitwise equal to an uninterrupted one; names,
    dtypes and shapes are hashed too so a reshaped or retyped tensor cannot collide.
    """
    sd = source.state_dict() if isinstance(source, torch.nn.Module) else source
    h = hashlib.sha256()
    for name, t in _flat_items(sd):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _flat_items(sd: Mapping[str, Any], prefix: str = "") -> Iterable[Any]:
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            yield name, v
        elif isinstance(v, np.ndarray):
            yield name, torch.from_numpy(np.ascontiguousarray(v))
        elif isinstance(v, Mapping):
            yield from _flat_items(v, name + ".")


# ---------------------------------------------------------------------------------------
# with a Checkpointer (the job layer)
# ---------------------------------------------------------------------------------------
