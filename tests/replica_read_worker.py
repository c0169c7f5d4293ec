"""One rank of the shared-restore tests (tests/test_replica_read.py): a real process in
a real gloo process group that restores its own series from the shared PFS with
``replicas=`` and prints one line ``REPLY {json}``: the step, what it read and received,
and a sha256 of every leaf (the test compares them with the state that was saved).

    python replica_read_worker.py WORK RANK WORLD PORT MODE

MODE: ``ok``; ``ckpt`` (through ``Checkpointer.restore(replicas=True)``: the
agreement over the process group too, each rank's own local tier; ``ckpt-all``: every
tier, the local one first); ``kill:R:K`` (rank R
SIGKILLs itself just before it sends its K-th chunk, mid-restore); ``corrupt:R`` (rank R
sends every chunk of its stripe with one bit flipped, its own copy stays sound).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

from slurm_ckpt import Checkpointer
from slurm_ckpt.core.names import current_user
from slurm_ckpt.job.replica_read import ReplicaGroup
from slurm_ckpt.job.restore import Restorer
from slurm_ckpt.tiers.posix import PosixTier

KEY = "run"
#: Small hash chunks so that a few MiB make many chunks (every rank owns several).
CHUNK = 256 * 1024


def leaves(state: Any, path: str = "") -> Dict[str, str]:
    """sha256 of every array leaf, by path."""
    out: Dict[str, str] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(leaves(v, f"{path}/{k}"))
    elif isinstance(state, np.ndarray):
        out[path] = hashlib.sha256(np.ascontiguousarray(state).tobytes()).hexdigest()
    else:
        out[path] = repr(state)
    return out


def patch(mode: str, rank: int) -> None:
    """The fault of MODE, in this process's own broadcasts (the transport stays real)."""
    real = dist.broadcast
    sent = [0]
    if mode.startswith("kill:"):
        _, who, when = mode.split(":")
        if int(who) != rank:
            return

        def dying(tensor: Any, src: int, *a: Any, **kw: Any) -> Any:
            if src == rank:
                sent[0] += 1
                if sent[0] == int(when):
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(tensor, src, *a, **kw)

        dist.broadcast = dying
    elif mode.startswith("corrupt:"):
        if int(mode.split(":")[1]) != rank:
            return

        def lying(tensor: Any, src: int, *a: Any, **kw: Any) -> Any:
            if src == rank:
                bad = tensor.clone()
                bad[len(bad) // 2] ^= 1
                return real(bad, src, *a, **kw)
            return real(tensor, src, *a, **kw)

        dist.broadcast = lying


def main() -> None:
    work, rank, world, port, mode = Path(sys.argv[1]), *map(int, sys.argv[2:5]), sys.argv[5]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    patch(mode, rank)
    if mode in ("ckpt", "ckpt-all"):
        local = work / f"node{rank}"
        local.mkdir(exist_ok=True)
        ckpt = Checkpointer(
            local=local,
            warm=work / "pfs",
            key=KEY,
            rank=rank,
            world_size=world,
            install_signals=False,
            end_time_fn=None,
        )
        got = ckpt.restore(tiers=["warm"] if mode == "ckpt" else None, replicas=True)
    else:
        tier = PosixTier("pfs", str(work / "pfs"), chunk_size=CHUNK, streams=2)
        restorer = Restorer(
            [tier], current_user(), KEY, rank, world, replicas=ReplicaGroup(None, timeout=20)
        )
        got = restorer.restore()
    doc: Dict[str, Any] = {"rank": rank}
    if got is not None:
        doc.update(
            step=got.step,
            tier=got.tier,
            nbytes=got.nbytes,
            read_bytes=got.read_bytes,
            peer_bytes=got.peer_bytes,
            leaves=leaves(got.state),
        )
    sys.stdout.write("REPLY " + json.dumps(doc) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a peer may be dead: no process-group teardown to hang in


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
