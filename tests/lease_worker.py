"""Child process for the lease tests: one Checkpointer, driven line by line on stdin.

    python lease_worker.py LOCAL WARM KEY [--node N] [--job J] [--takeover]

Prints one JSON line per command: ``{"ready": pid}`` once constructed
(or ``{"error": ...}`` and exit status 3), then for ``save N`` ``{"saved": N, ...}``,
``restore [N [LINEAGE]]``, ``close``; ``exit`` ends the process without close().
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from slurm_ckpt import Checkpointer
from slurm_ckpt.errors import CkptError


def say(**doc: object) -> None:
    print(json.dumps(doc), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("local")
    ap.add_argument("warm")
    ap.add_argument("key")
    ap.add_argument("--node")
    ap.add_argument("--job")
    ap.add_argument("--takeover", action="store_true")
    a = ap.parse_args()
    try:
        ckpt = Checkpointer(
            local=a.local,
            warm=a.warm or None,
            key=a.key,
            node=a.node,
            job=a.job,
            install_signals=False,
            **({"takeover": True} if a.takeover else {}),
        )
    except CkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(3)
    say(ready=os.getpid())
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "save":
                step = int(args[0])
                ckpt.save({"x": step}, step=step)
                ckpt.wait()
                s = ckpt.stats
                say(saved=step, committed=s.committed, error=s.last_error)
            elif cmd == "restore":
                step = int(args[0]) if args else None
                lineage = args[1] if len(args) > 1 else None
                r = ckpt.restore(step=step, **({"lineage": lineage} if lineage else {}))
                say(restored=r and r.step, lineage=getattr(r, "lineage", None))
            elif cmd == "close":
                ckpt.close()
                say(closed=True)
            elif cmd == "exit":
                os._exit(0)
        except CkptError as exc:
            say(error=str(exc))


if __name__ == "__main__":
    main()
