"""Child process for crash tests: saves or copies one checkpoint, maybe dying midway.

Run with ``SLURM_CKPT_CRASH_AT=N`` to be SIGKILLed at the N-th crash point.
    python crash_worker.py save ROOT STEP
    python crash_worker.py copy SRC DST STEP
"""

from __future__ import annotations

import json
import sys

from slurm_ckpt.core.commit import AlreadyCommitted
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier

CHUNK = 4096


def payload(step: int) -> dict:
    # Deterministic bytes so a re-run writes the same checkpoint.
    return {
        "model.bin": bytes((step * 7 + i) % 251 for i in range(3 * CHUNK + 100)),
        "optim/state.bin": bytes((step * 13 + i) % 241 for i in range(2 * CHUNK)),
        "meta.json": json.dumps({"step": step}).encode(),
    }


def main() -> None:
    op = sys.argv[1]
    if op == "save":
        tier = PosixTier("local", sys.argv[2], chunk_size=CHUNK, streams=2)
        step = int(sys.argv[3])
        try:
            with tier.writer("alice", "run", step, tokens=step * 10) as w:
                w.write_buffers(payload(step))
                w.commit()
        except AlreadyCommitted:
            print("already")
    else:
        src = PosixTier("local", sys.argv[2], streams=2)
        dst = PosixTier("pfs", sys.argv[3], streams=2)
        res = copy_checkpoint(src, dst, "alice", "run", int(sys.argv[4]))
        print(json.dumps({"resumed": res.resumed_files, "present": res.already_present}))


if __name__ == "__main__":
    main()
