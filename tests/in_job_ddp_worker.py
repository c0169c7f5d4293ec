"""One rank (or hot spare) of the DDP and FSDP2 runs of tests/test_cluster_in_job.py,
launched by ``ckpt-srun --spares 1 --in-job`` on the dev cluster: a tiny model
(``tests/helpers/tiny_model.py``, copied next to this file by the test) trained
with ``DistributedDataParallel`` (or, with ``--fsdp``, FSDP2's ``fully_shard``) over gloo
through ``slurm_ckpt.torch.recovery`` (the job side of in-job recovery), with the site's
tiers (``Checkpointer.from_env``), partner copies and the RAM tier every step.

    python in_job_ddp_worker.py TOTAL SLEEP_S OUT_DIR [--fsdp]

Lines: ``PID pid=P node=N`` first (before the model is built: a spare prints it too),
``RANK r``, ``SETUP bind_s=.. prepare_s=..`` (what building took after the rank was
known, and before it, while a spare waited), ``STEP s`` after each step, and at the end
``DONE {json}`` with the rank, the last step, the recovery history, what the first
restore read (``started``: for a spare that took a lost rank, where its state came from)
and a sha256 of the final parameters: the same digest on every rank of a DDP run; with
``--fsdp``, of this rank's own shards (each rank its own). The final parameters (or
shards) also go to ``OUT_DIR/<job>.final.rank<r>.pt``. FSDP2's door (each rank's shards
as the state tree) is ``slurm_ckpt.torch.ShardState``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict

import torch
from helpers import tiny_model

import slurm_ckpt.torch as sct
from slurm_ckpt import Checkpointer
from slurm_ckpt.job.options import RamOptions


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
    total, sleep_s, out_dir = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    fsdp = sys.argv[4:] == ["--fsdp"]
    torch.set_num_threads(1)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    out(f"PID pid={os.getpid()} node={node}")
    model = tiny_model.build()
    # what the wrapping in rebuild() imports, with the rank-independent part of the
    # Checkpointer: a hot spare builds it while it waits (slurm_ckpt.job.spare_prep)
    imports = ["torch.distributed.fsdp"] if fsdp else ["torch.nn.parallel"]
    try:
        rec = sct.recovery(
            timeout_s=20,
            deadline_s=120,
            prepare=lambda: sct.Prebuilt(
                imports=imports, partner=True, ram=RamOptions(every=1, keep=2)
            ),
        )
    except sct.RecoveryFailed as exc:
        out(f"FAILED {exc}")
        sys.exit(exc.exit_code)
    ranked = time.monotonic()
    rank = rec.rank
    out(f"RANK {rank}")
    ckpt: Checkpointer = rec.prepared.checkpointer()
    state: Dict[str, Any] = {}
    if fsdp:
        door: Any = sct.ShardState(ckpt)

        def rebuild(group: Any) -> None:
            state["net"], state["opt"] = tiny_model.fsdp(rec.world_size, door)

    else:
        state["opt"] = tiny_model.optimizer(model.parameters())
        door = sct.TorchCheckpointer(ckpt, model, state["opt"], lazy=False)

        def rebuild(group: Any) -> None:
            state["net"] = tiny_model.ddp(model, group)

    def step_fn(step: int) -> None:
        tiny_model.train_step(state["net"], state["opt"], rank, step)
        out(f"STEP {step}")
        time.sleep(sleep_s)

    # seconds from the rank known to the re-form (a spare's setup after it was needed),
    # and what prepare() took before (a spare: while it waited)
    out(f"SETUP bind_s={time.monotonic() - ranked:.3f} prepare_s={rec.prepare_s:.3f}")
    try:
        last = rec.run(door, step_fn, total, on_reform=rebuild)
    except sct.RecoveryFailed as exc:
        out(f"FAILED {exc}")
        sys.exit(exc.exit_code)
    final = tiny_model.final(state["net"] if fsdp else model, fsdp)
    h = hashlib.sha256()
    for k in sorted(final):
        h.update(k.encode())
        h.update(final[k].numpy().tobytes())
    job = os.environ.get("SLURM_JOB_ID", "0")
    torch.save(final, out_dir / f"{job}.final.rank{rank}.pt")
    doc = {
        "rank": rank,
        "last": last,
        "history": rec.history,
        "started": rec.started,
        "digest": h.hexdigest(),
    }
    out("DONE " + json.dumps(doc))
    ckpt.close()


if __name__ == "__main__":
    main()
