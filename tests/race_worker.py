"""Child process for the concurrent-writer tests: copies one checkpoint to a shared tier,
optionally pausing at a named crash point until told to go on.

    python race_worker.py SRC DST STEP [PAUSE_LABEL]

DST is a directory (a POSIX tier) or ``s3:`` and a JSON object with ``endpoint``,
``bucket``, ``prefix`` (an object tier; the AWS credentials come from the environment).

With PAUSE_LABEL, the first time the copy reaches that crash point it prints ``paused``
and waits for a line on stdin: the test then lets the other writer run to a known point
(no sleeps, no timing). Prints one JSON line: ``{"present": bool}`` or ``{"error": type}``.
"""

from __future__ import annotations

import json
import sys
import threading

import slurm_ckpt.core.commit as commit_mod
import slurm_ckpt.tiers.copy as copy_mod
import slurm_ckpt.tiers.s3_write as s3_write_mod
from slurm_ckpt.errors import CkptError
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.s3 import S3Tier

CHUNK = 4096


def install_pause(label: str) -> None:
    """Make the crash point ``label`` (its first hit) a pause: ``paused`` on stdout, then
    wait for a line on stdin."""
    hit = threading.Event()
    lock = threading.Lock()

    def point(name: str) -> None:
        if name != label:
            return
        with lock:
            if hit.is_set():
                return
            hit.set()
            print("paused", flush=True)
            sys.stdin.readline()

    commit_mod.crashpoint = point  # type: ignore[assignment]
    copy_mod.crashpoint = point  # type: ignore[assignment]
    s3_write_mod.crashpoint = point  # type: ignore[assignment]


def destination(spec: str) -> Tier:
    """The shared tier: a directory, or ``s3:{json}``."""
    if spec.startswith("s3:"):
        where = json.loads(spec[3:])
        return S3Tier("object", chunk_size=CHUNK, concurrency=2, **where)
    return PosixTier("pfs", spec, chunk_size=CHUNK, streams=2)


def main() -> None:
    src_root, dst_root, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if len(sys.argv) > 4:
        install_pause(sys.argv[4])
    src = PosixTier("local", src_root, chunk_size=CHUNK, streams=2)
    dst = destination(dst_root)
    try:
        res = copy_checkpoint(src, dst, "alice", "run", step)
    except CkptError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return
    print(json.dumps({"present": res.already_present}), flush=True)


if __name__ == "__main__":
    main()
