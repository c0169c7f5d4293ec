"""Ranged reads of DCP parts (``dcp_reader(ranged=True)``): a load reads only the byte
ranges its plan needs, each widened to whole hash chunks and verified chunk by chunk
against the manifest as it lands, on any tier (an object store gets ranged GETs).

Why opt-in: the default load verifies every part whole *before* the ranks agree on a
step, so damage anywhere makes all ranks fall back a step together. A ranged load cannot
know which bytes it needs until DCP hands it the plan, after the step is agreed; so
damage it finds there can only fail the load (one line naming the file and the range),
never fall back. What it buys: a rank that needs a slice of a part (a load at another
world size) reads that slice, not the part.

Apart from :mod:`slurm_ckpt.dcp.reading` because it is its own concept: which bytes
a plan needs, and reading just those.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from slurm_ckpt.core.fastread import ChunkReader, run_tasks
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.dcp.meta import ItemInfo, parse_dtype
from slurm_ckpt.dcp.part_file import open_part
from slurm_ckpt.errors import NotFound, TierError, VerifyError
from slurm_ckpt.tiers.base import Tier

__all__ = ["RangedRead", "item_range", "plan_ranges", "read_ranges"]

#: Chunks read at once per part (each a ranged read of one hash chunk).
STREAMS = 8


def item_range(
    info: ItemInfo, offsets: Sequence[int], lengths: Sequence[int]
) -> Tuple[int, int, int]:
    """``(start, end, needed)``: the bytes ``[start, end)`` of the part that hold the
    region ``offsets``/``lengths`` of a tensor item (row-major), and how many of them
    the region itself holds. For a shard cut along the first dimension (FSDP, a load at
    another world size) the span is exactly the region; otherwise it is the smallest
    span that covers it."""
    dtype = parse_dtype(info.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    shape = tuple(info.shape or ())
    if not shape:
        return info.pos, info.pos + info.nbytes, info.nbytes
    lengths = list(lengths) if lengths else list(shape)
    offsets = list(offsets) if offsets else [0] * len(shape)
    count = math.prod(lengths)
    if count == 0:
        return info.pos, info.pos, 0
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    lo = sum(o * s for o, s in zip(offsets, strides))
    hi = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides)) + 1
    return info.pos + lo * esize, info.pos + hi * esize, count * esize


class RangedRead:
    """What one ranged ``read_data`` did: bytes its plan needs, bytes read from storage,
    counted (for logs, tests and benchmarks)."""

    def __init__(self) -> None:
        self.nbytes_needed = 0
        self.nbytes_read = 0


def _chunks(ranges: Iterable[Tuple[int, int]], chunk_size: int, size: int) -> List[int]:
    want: Set[int] = set()
    for a, b in ranges:
        a, b = max(a, 0), min(b, size)
        if b > a:
            want.update(range(a // chunk_size, (b - 1) // chunk_size + 1))
    return sorted(want)


def read_ranges(
    holders: List[Tuple[Tier, Manifest]],
    user: str,
    key: str,
    step: int,
    what: str,
    relpath: str,
    want: str,
    ranges: List[Tuple[int, int]],
    stats: RangedRead,
) -> Tuple[str, memoryview]:
    """The tier name and a buffer of the part's size in which every chunk that
    ``ranges`` touch is read and verified (the rest is never read: zero pages).

    The first holder that opens is used; a chunk that fails its hash there is a
    :class:`VerifyError` naming the file and the range (no quiet fallback: the step was
    agreed before this rank knew which bytes it needs)."""
    last: Optional[BaseException] = None
    for tier, _m in holders:
        try:
            with open_part(tier, user, key, step, relpath, want) as part:
                size = part.job.entry.size
                with ChunkReader([part.job], part.chunk_size, part.where) as cr:
                    every = cr.tasks()
                    tasks = [every[i] for i in _chunks(ranges, cr.chunk_size, size)]
                    try:
                        run_tasks(cr.read, tasks, STREAMS, name="ckpt-ranged")
                    finally:
                        stats.nbytes_read += cr.nbytes_read
                    buf = cr.bufs[0]
            return tier.name, memoryview(buf)[:size]
        except VerifyError as exc:
            raise VerifyError(
                f"dcp step {step}: {what}: {exc}; a ranged load cannot fall back: load "
                "again without ranged=True (it verifies whole parts and falls back to a "
                "sound copy or an older step), or load an older step with step=N"
            ) from None
        except (KeyError, TierError, NotFound, OSError) as exc:
            last = exc  # this tier cannot serve it at all: the next one may
    raise VerifyError(
        f"dcp step {step}: {what}: {relpath} could not be opened on any tier ({last}); "
        "load again without ranged=True, or an older step with step=N"
    )


def plan_ranges(storage: Any, reqs: Sequence[Any]) -> Tuple[List[Tuple[int, int]], int]:
    """The byte ranges of one part that ``reqs`` (DCP ``ReadItem``s) need, and how many
    bytes they need in all."""
    out: List[Tuple[int, int]] = []
    needed = 0
    for req in reqs:
        info: ItemInfo = storage[req.storage_index]
        if info.kind != "tensor":
            out.append((info.pos, info.pos + info.nbytes))
            needed += info.nbytes
            continue
        a, b, n = item_range(info, req.storage_offsets, req.lengths)
        out.append((a, b))
        needed += n
    return out, needed
