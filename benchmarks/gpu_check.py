#!/usr/bin/env python3
"""The CUDA snapshot check: does ``save()`` really snapshot GPU tensors, and what does it
cost against the physical floor?

1. Correctness: CUDA tensors are saved, then changed on the GPU right after ``save()``
   returns (in place, on the current stream, while the background write may still run);
   the checkpoint must hold the values of the moment of the save, bit for bit.
2. Cost: the stall of ``save()`` (what the training loop waits) against the floor: the
   device-to-host copy of the same bytes into pinned memory (``copy_(non_blocking=True)``
   plus a synchronize), the least any snapshot of GPU state can cost.

    python benchmarks/gpu_check.py [--size 4GiB] [--rounds 5] [--json out.json]

Exit status: 0 when every round's checkpoint holds the save-time values, 1 when one does
not, 3 when there is no GPU (``not run: no GPU``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from claims import claim  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB", help="bytes of CUDA state (default 1GiB)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="work directory (default: under /var/tmp)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)

    import torch

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.core.units import format_bytes, parse_size

    if not torch.cuda.is_available():
        print("not run: no GPU")
        return 3
    size = parse_size(args.size)
    per = size // args.tensors // 4  # float32 elements
    dev = torch.device("cuda")
    state = {f"w{i}": torch.randn(per, device=dev) for i in range(args.tensors)}
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.dir or "/var/tmp"))
    rows: List[Dict[str, Any]] = []
    ok = True
    try:
        ckpt = Checkpointer(
            local=work / "local",
            pfs=work / "pfs",
            key="gpu",
            interval_steps=1,
            install_signals=False,
        )
        ckpt.save(state, step=0)  # warm-up: staging buffers are allocated once
        ckpt.wait()
        for r in range(1, args.rounds + 1):
            expect = {k: v.detach().cpu().clone() for k, v in state.items()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ckpt.save(state, step=r)
            stall = time.perf_counter() - t0
            for v in state.values():  # change them at once, on the GPU
                v.mul_(-1.0).add_(1.0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k, v in state.items():
                pinned[k].copy_(v, non_blocking=True)
            torch.cuda.synchronize()
            d2h = time.perf_counter() - t0
            ckpt.wait()
            got = Checkpointer(
                local=work / "local", pfs=work / "pfs", key="gpu", install_signals=False
            )
            restored = got.restore()
            got.close()
            same = (
                restored is not None
                and restored.step == r
                and all(torch.equal(restored.state[k].cpu(), expect[k]) for k in expect)
            )
            ok &= same
            rows.append({"stall_s": stall, "d2h_pinned_s": d2h, "holds_save_time_values": same})
            print(
                f"round {r}: save() stalled {stall:.3f}s, pinned D2H copy {d2h:.3f}s "
                f"({format_bytes(size)}); checkpoint holds the save-time values: {same}",
                flush=True,
            )
        ckpt.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {
        "gpu": torch.cuda.get_device_name(0),
        "size_bytes": size,
        "rounds": rows,
        "all_rounds_hold_save_time_values": ok,
        "stall_median_s": statistics.median(r["stall_s"] for r in rows),
        "d2h_median_s": statistics.median(r["d2h_pinned_s"] for r in rows),
        "claims": [
            claim(
                "gpu_save_stall_vs_pinned_d2h",
                [r["stall_s"] / r["d2h_pinned_s"] for r in rows],
                what=f"save() stall with {format_bytes(size)} of CUDA tensors",
                baseline="device-to-host copy of the same bytes into pinned memory (floor)",
            )
        ],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
