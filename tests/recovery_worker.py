"""One process of the in-job recovery tests (tests/test_in_job_recovery.py): a training
rank, or a hot spare (``SLURM_CKPT_SPARE=1``), of a tiny model
(``tests/helpers/tiny_model.py``, as in the cluster's worker) trained with DDP (or
FSDP2's ``fully_shard``) over gloo on 127.0.0.1, with partner copies and the RAM tier on
every step, through ``slurm_ckpt.torch.recovery``. Its own "node" directory (local tier,
ledger); the warm tier and the partner rendezvous are shared.

    python recovery_worker.py WORK NODE MODE TOTAL TIMEOUT_S DEADLINE_S

Environment: ``SLURM_CKPT_RECOVERY_DIR``, ``SLURM_CKPT_TASK``, maybe ``SLURM_CKPT_SPARE``
and ``SPARE_SETUP_S`` (a spare sleeps that long once it knows its rank: a slow setup).
Lines on stdout: ``PID p``, ``RANK r``, ``READY t`` (``time.time()`` once its setup is
done, just before training: the known point a test compares the job timeline's records
with), ``STEP s`` after each step, at the end
``DONE {json}``; the final parameters go to WORK/final.rankR.pt (DDP) or the rank's
shards to WORK/final.rankR.pt (FSDP2). A RecoveryFailed is one line ``FAILED ...`` and
its exit code.
"""

from __future__ import annotations

import json
import logging
import os
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

JOB = "5151"


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    work, node, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    total, timeout_s, deadline_s = int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
    torch.set_num_threads(1)
    out(f"PID {os.getpid()}")
    model = tiny_model.build()
    try:
        rec = sct.recovery(timeout_s=timeout_s, deadline_s=deadline_s)
    except sct.RecoveryFailed as exc:
        out(f"FAILED {exc}")
        sys.exit(exc.exit_code)
    rank = rec.rank
    out(f"RANK {rank}")
    if rec.spare:
        # a slow setup after the rank is known (tests of where the re-form's wait lands)
        time.sleep(float(os.environ.get("SPARE_SETUP_S", "0")))
    for d in (work / node / "local", work / node / "ledger", work / "pfs"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(work / node / "ledger", 0o700)
    ckpt = Checkpointer(
        local=work / node / "local",
        warm=work / "pfs",
        key="run",
        rank=rank,
        world_size=rec.world_size,
        node=node,
        job=JOB,
        ledger_dir=work / node / "ledger",
        install_signals=False,
        end_time_fn=None,
        flush_every=100,
        keep_local=2,
        partner=True,
        keep_partner=2,
        partner_dir=work / "rendezvous",
        partner_host="127.0.0.1",
        ram=RamOptions(every=1, keep=2),
    )
    out(f"READY {time.time()!r}")
    state: Dict[str, Any] = {}
    if mode == "ddp":
        state["opt"] = tiny_model.optimizer(model.parameters())
        door: Any = sct.TorchCheckpointer(ckpt, model, state["opt"], lazy=False)

        def rebuild(group: Any) -> None:
            state["net"] = tiny_model.ddp(model, group)

    else:
        door = sct.ShardState(ckpt)

        def rebuild(group: Any) -> None:
            state["net"], state["opt"] = tiny_model.fsdp(rec.world_size, door)

    def step_fn(step: int) -> None:
        tiny_model.train_step(state["net"], state["opt"], rank, step)
        out(f"STEP {step}")

    try:
        last = rec.run(door, step_fn, total, on_reform=rebuild)
    except sct.RecoveryFailed as exc:
        out(f"FAILED {exc}")
        sys.exit(exc.exit_code)
    final = tiny_model.final(model if mode == "ddp" else state["net"], mode != "ddp")
    torch.save(final, work / f"final.rank{rank}.pt")
    out(
        "DONE "
        + json.dumps({"rank": rank, "last": last, "history": rec.history, "started": rec.started})
    )
    ckpt.close()


if __name__ == "__main__":
    main()
