"""DCP's global ``Metadata`` as JSON, so that loading a checkpoint never unpickles it.

DCP's own ``FileSystemWriter`` pickles ``Metadata`` into ``.metadata``, and its reader
unpickles it: whoever can write a checkpoint can run code in every job that loads it.
Here the metadata is a JSON document with a fixed shape, decoded field by field into
DCP's dataclasses; dtypes are looked up by name among ``torch.dtype`` values only.

What it holds besides DCP's own fields: the saving world size, and for every rank's part
the content hash of its data file (``parts``). A part found on a tier counts only when its
manifest lists that very hash, so the metadata binds the step to the exact bytes of every
part (a part left from another attempt at the same step never mixes in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from slurm_ckpt.errors import VerifyError

__all__ = ["FORMAT", "ItemInfo", "decode", "dtype_name", "encode", "misfit", "parse_dtype"]

FORMAT = "slurm_ckpt.dcp/1"


@dataclass(frozen=True)
class ItemInfo:
    """Where one saved item lives: ``WriteResult.storage_data`` of this backend (it is
    gathered to the coordinator, so it is a plain picklable record)."""

    rank: int
    file: str
    pos: int
    nbytes: int
    kind: str  # "tensor", "value" (slurm_ckpt.dcp.values) or "bytes" (a torch.save pickle)
    dtype: Optional[str] = None
    shape: Optional[Tuple[int, ...]] = None
    #: The content hash of the part's data file, and the node that wrote it (the
    #: coordinator builds the parts table from these; not stored per item).
    part_hash: Optional[str] = None
    node: Optional[str] = None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_dtype(name: object) -> torch.dtype:
    """A ``torch.dtype`` from its name; anything else is refused (never getattr'd into
    arbitrary attributes of torch)."""
    got = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(got, torch.dtype):
        raise VerifyError(f"DCP metadata: unknown dtype {name!r}")
    return got


def _ints(value: object, what: str) -> List[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise VerifyError(f"DCP metadata: {what} is not a list of integers")
    return list(value)


def _path(value: object) -> Tuple[Any, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)) for v in value
    ):
        raise VerifyError("DCP metadata: planner_data holds a path that is not str/int")
    return tuple(value)


def encode(
    metadata: Metadata, items: Dict[MetadataIndex, ItemInfo], parts: Dict[int, Dict[str, Any]]
) -> bytes:
    """JSON bytes of ``metadata`` plus where every item lives and each part's identity.
    Raises ``TypeError`` when a custom planner put something into ``planner_data`` that
    is not a mapping of names to key paths (DCP's default planner does exactly that)."""
    sdm: Dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            sdm[fqn] = {
                "type": "tensor",
                "dtype": dtype_name(md.properties.dtype),
                "requires_grad": bool(md.properties.requires_grad),
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"DCP metadata: {fqn}: unsupported storage metadata {type(md)}")
    pdata = metadata.planner_data
    if pdata is not None:
        if not isinstance(pdata, dict):
            raise TypeError("DCP metadata: planner_data must be a dict (DCP's default planner)")
        pdata = {str(k): list(v) for k, v in pdata.items()}
    sm = metadata.storage_meta
    doc = {
        "format": FORMAT,
        "version": metadata.version,
        "world_size": len(parts),
        "parts": {str(r): p for r, p in sorted(parts.items())},
        "state_dict_metadata": sdm,
        "planner_data": pdata,
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": list(sm.modules),
        },
        "items": [
            {
                "fqn": idx.fqn,
                "offset": None if idx.offset is None else list(idx.offset),
                "index": idx.index,
                "rank": info.rank,
                "file": info.file,
                "pos": info.pos,
                "nbytes": info.nbytes,
                "kind": info.kind,
                "dtype": info.dtype,
                "shape": None if info.shape is None else list(info.shape),
            }
            for idx, info in items.items()
        ],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass
class Decoded:
    """The parsed document: DCP's ``Metadata`` (its ``storage_data`` maps each
    ``MetadataIndex`` to an :class:`ItemInfo`) and the parts table."""

    metadata: Metadata
    world_size: int
    parts: Dict[int, Dict[str, Any]]


def decode(data: bytes, where: str) -> Decoded:
    """Parse metadata bytes (already hash-verified) as hostile input: one-line
    :class:`VerifyError` on anything unexpected."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise VerifyError("not a slurm_ckpt DCP metadata document")
        sdm: Dict[str, Any] = {}
        for fqn, md in doc["state_dict_metadata"].items():
            if md["type"] == "bytes":
                sdm[fqn] = BytesStorageMetadata()
                continue
            if md["type"] != "tensor":
                raise VerifyError(f"{fqn}: unknown type {md['type']!r}")
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=parse_dtype(md["dtype"]), requires_grad=bool(md["requires_grad"])
                ),
                size=torch.Size(_ints(md["size"], f"{fqn} size")),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(_ints(c["offsets"], f"{fqn} offsets")),
                        sizes=torch.Size(_ints(c["sizes"], f"{fqn} sizes")),
                    )
                    for c in md["chunks"]
                ],
            )
        storage: Dict[MetadataIndex, ItemInfo] = {}
        for it in doc["items"]:
            kind = it["kind"]
            if kind not in ("tensor", "value", "bytes"):
                raise VerifyError(f"item kind {kind!r}")
            shape = None if it["shape"] is None else tuple(_ints(it["shape"], "shape"))
            if kind == "tensor":
                parse_dtype(it["dtype"])
            pos, nbytes, rank = (int(it[k]) for k in ("pos", "nbytes", "rank"))
            if pos < 0 or nbytes < 0 or rank < 0 or not isinstance(it["file"], str):
                raise VerifyError("item position out of range")
            idx = MetadataIndex(
                str(it["fqn"]),
                None if it["offset"] is None else _ints(it["offset"], "offset"),
                None if it["index"] is None else int(it["index"]),
            )
            storage[idx] = ItemInfo(rank, it["file"], pos, nbytes, kind, it["dtype"], shape)
        pdata = doc["planner_data"]
        if pdata is not None:
            pdata = {str(k): _path(v) for k, v in pdata.items()}
        sm = doc["storage_meta"]
        smeta = (
            StorageMeta()
            if sm is None
            else StorageMeta(
                checkpoint_id=sm["checkpoint_id"],
                save_id=sm["save_id"],
                modules=[str(m) for m in sm["modules"]],
            )
        )
        parts = {int(r): dict(p) for r, p in doc["parts"].items()}
        world = int(doc["world_size"])
        if sorted(parts) != list(range(world)):
            raise VerifyError("parts table does not name every rank")
    except VerifyError as exc:
        raise VerifyError(f"{where}: bad DCP metadata: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise VerifyError(f"{where}: bad DCP metadata ({type(exc).__name__}: {exc})") from None
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=pdata,
        storage_data=storage,
        storage_meta=smeta,
        version=doc["version"],
    )
    return Decoded(md, world, parts)


def misfit(decoded: Decoded, part_sizes: Dict[int, int]) -> Optional[str]:
    """Why the metadata does not fit its parts (None: it fits).

    The metadata is hash-verified, but whoever wrote the step wrote it too: every item
    must lie inside its part's data file (``part_sizes``: rank -> bytes), a tensor's
    bytes must be exactly its shape times its dtype's size, and its shape must be the
    chunk the global metadata names for it, inside the tensor's size. Without this a
    load would index past a buffer or allocate a shape of 2**40 elements and raise,
    instead of the step being skipped like a corrupt one."""
    md = decoded.metadata
    for idx, info in md.storage_data.items():
        where = f"item {idx.fqn}"
        part = decoded.parts.get(info.rank)
        if part is None or part.get("file") != info.file or info.rank not in part_sizes:
            return f"{where}: in no part of the step (rank {info.rank}, file {info.file!r})"
        if info.pos < 0 or info.nbytes < 0 or info.pos + info.nbytes > part_sizes[info.rank]:
            return (
                f"{where}: bytes {info.pos}+{info.nbytes} outside part {info.rank} "
                f"({part_sizes[info.rank]} bytes)"
            )
        smd = md.state_dict_metadata.get(idx.fqn)
        if info.kind in ("bytes", "value"):  # non-tensor items: DCP describes them as bytes
            if not isinstance(smd, BytesStorageMetadata):
                return f"{where}: saved as {info.kind}, not described as bytes"
            continue
        if not isinstance(smd, TensorStorageMetadata) or info.shape is None:
            return f"{where}: saved as a tensor, not described as one"
        if parse_dtype(info.dtype) != smd.properties.dtype:
            return f"{where}: dtype {info.dtype} is not the tensor's"
        shape = list(info.shape)
        count = 1
        for n in shape:
            if n < 0:
                return f"{where}: negative dimension in {tuple(shape)}"
            count *= n
        esize = torch.empty((), dtype=smd.properties.dtype).element_size()
        if count * esize != info.nbytes:
            return f"{where}: shape {tuple(shape)} is not {info.nbytes} bytes"
        offsets = list(idx.offset) if idx.offset is not None else [0] * len(shape)
        chunk = next((c for c in smd.chunks if list(c.offsets) == offsets), None)
        if chunk is None or list(chunk.sizes) != shape:
            return f"{where}: shape {tuple(shape)} at {tuple(offsets)} is no chunk of the tensor"
        size = list(smd.size)
        if len(size) != len(shape) or any(
            o < 0 or o + n > t for o, n, t in zip(offsets, shape, size)
        ):
            return f"{where}: chunk {tuple(offsets)}+{tuple(shape)} outside {tuple(size)}"
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            for c in smd.chunks:
                if MetadataIndex(fqn, list(c.offsets)) not in md.storage_data:
                    return f"item {fqn}: chunk {tuple(c.offsets)} is stored nowhere"
        elif MetadataIndex(fqn) not in md.storage_data:
            return f"item {fqn}: stored nowhere"
    return None
