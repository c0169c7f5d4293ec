#!/usr/bin/env python3
"""Protect a checkpoint your code (or your framework) writes itself: a directory of files.

Run it twice: the first run trains to ``--stop-at`` and "dies"; the second resumes from
the newest verified checkpoint and trains to the end::

    python examples/any_dir.py --local /tmp/l --warm /tmp/p --steps 40 --stop-at 25
    python examples/any_dir.py --local /tmp/l2 --warm /tmp/p --steps 40   # another node

Each save is ``with ckpt.output(step=...) as path:``: write anything into ``path`` (here
``torch.save`` files and a JSON file); on exit the files are hashed, committed with the
manifest last and flushed to the PFS. ``ckpt.restore_path()`` hands back the newest
complete checkpoint that verifies, on the local tier (fetched from the PFS when only it
has it: the second command above uses an empty local tier). ``ckpt.adopt(step, dir)``
does the same for a directory your framework already wrote (``--adopt``).
Under SLURM use ``Checkpointer.from_env()`` instead of ``--local``/``--warm``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slurm_ckpt import Checkpointer  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local", required=True, help="the node-local tier (a directory)")
    p.add_argument(
        "--warm", "--pfs", dest="warm", required=True, help="the shared tier (a directory)"
    )
    p.add_argument("--key", default="any-dir-demo")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--stop-at", type=int, help="stop after this step (a simulated crash)")
    p.add_argument("--adopt", action="store_true", help="write elsewhere, then adopt()")
    a = p.parse_args()
    for d in (a.local, a.warm):
        os.makedirs(d, exist_ok=True)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = Checkpointer(local=a.local, warm=a.warm, key=a.key, end_time_fn=None)
    start = 0
    path = ckpt.restore_path()
    if path is not None:
        model.load_state_dict(torch.load(path / "model.pt", weights_only=True))
        opt.load_state_dict(torch.load(path / "optim.pt", weights_only=True))
        start = json.loads((path / "progress.json").read_text())["step"]
        print(f"RESUMED step={start} from {path}")
    else:
        print("START fresh")

    def write(out: str, step: int) -> None:
        torch.save(model.state_dict(), os.path.join(out, "model.pt"))
        torch.save(opt.state_dict(), os.path.join(out, "optim.pt"))
        with open(os.path.join(out, "progress.json"), "w") as f:
            json.dump({"step": step}, f)

    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(a.steps, 16, 8, generator=g), torch.randn(a.steps, 16, 1, generator=g)
    for step in range(start + 1, a.steps + 1):
        loss = torch.nn.functional.mse_loss(model(xs[step - 1]), ys[step - 1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % a.every == 0 or ckpt.preemption_pending:
            if a.adopt:  # a framework's own directory, snapshotted
                with tempfile.TemporaryDirectory() as own:
                    write(own, step)
                    ckpt.adopt(step, own)
            else:
                with ckpt.output(step=step) as out:
                    write(str(out), step)
            print(f"SAVED step={step} loss={loss.item():.4f}")
        if step == a.stop_at or ckpt.preempted:
            print(f"STOPPED step={step}")
            break
    ckpt.close()  # waits for the flushes to the PFS
    for info in ckpt.warm.steps(ckpt.user, ckpt.shard_key):
        ok = ckpt.warm.verify(ckpt.user, ckpt.shard_key, info.step).ok
        print(f"PFS step={info.step} verified={ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
