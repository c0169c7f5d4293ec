"""The fault campaign's trainer: deterministic, cheap, and checkable from the outside.

Why not ``examples/train_tiny.py``: importing torch takes seconds on a small machine, and
the campaign starts hundreds of trainers. This one trains a NumPy "model" (weights, a
momentum buffer and a PCG64 generator whose state is part of the checkpoint), saves
through the public :class:`slurm_ckpt.Checkpointer` API like any job, and is fully
deterministic: the state after step ``s`` is a pure function of ``(size, seed, s)``
(:func:`reference_digests`). So the campaign can check that what a restart loaded is
bit for bit what was saved at that step, and that the finished run equals an
uninterrupted one.

It runs as the job user, with the site config of its node. Output, one line per event::

    START fresh | RESUMED step=S tier=T digest=D
    SAVED step=s               save() returned (snapshot taken)
    COMMITTED step=s           the local tier holds step s
    FLUSHED step=s             the PFS holds a verified copy of step s
    PARTNERED / RECEIVED step=s    the partner committed our copy / we committed one
    LOCALFAIL step=s / FLUSHFAIL step=s   a save / flush failed (training goes on)
    PREEMPTED step=s           a signal came; step s was saved; exit 0
    DONE step=s digest=D

The last step completed is kept in ``--progress`` (replaced by rename), so the campaign
knows how much work a kill cost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np

_OUT = threading.Lock()


def emit(line: str) -> None:
    with _OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def initial_state(size: int, seed: int) -> Dict[str, Any]:
    rng = np.random.Generator(np.random.PCG64(seed))
    w = rng.standard_normal(size, dtype=np.float32)
    return {
        "model": {"w": w},
        "optim": {"m": np.zeros(size, dtype=np.float32)},
        "rng": rng.bit_generator.state,
        "step": 0,
    }


def train_step(state: Dict[str, Any]) -> None:
    """One 'optimizer step': momentum SGD on noise drawn from the saved generator."""
    bg = np.random.PCG64()
    bg.state = state["rng"]
    g = np.random.Generator(bg).standard_normal(len(state["model"]["w"]), dtype=np.float32)
    m = state["optim"]["m"]
    m *= np.float32(0.9)
    m += g
    state["model"]["w"] -= np.float32(1e-3) * m
    state["rng"] = bg.state
    state["step"] += 1


def digest(state: Dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(state["model"]["w"]).tobytes())
    h.update(np.ascontiguousarray(state["optim"]["m"]).tobytes())
    h.update(json.dumps(state["rng"], sort_keys=True).encode())
    h.update(str(int(state["step"])).encode())
    return h.hexdigest()[:32]


def reference_digests(size: int, seed: int, steps: int) -> List[str]:
    """Digest of the state after each step 0..steps of an uninterrupted run."""
    state = initial_state(size, seed)
    out = [digest(state)]
    for _ in range(steps):
        train_step(state)
        out.append(digest(state))
    return out


def _owned(state: Any) -> Dict[str, Any]:
    """A restored state as writable arrays of our own (restore hands out views)."""
    return {
        "model": {"w": np.array(state["model"]["w"], dtype=np.float32, copy=True)},
        "optim": {"m": np.array(state["optim"]["m"], dtype=np.float32, copy=True)},
        "rng": json.loads(json.dumps(state["rng"])),
        "step": int(state["step"]),
    }


def _progress(path: Optional[str], step: int) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"step": step}))
    os.replace(tmp, path)


def file_agree(directory: str, rank: int, world_size: int, timeout: float = 60.0) -> Any:
    """The restore's ``agree`` (a min over the ranks) for plain processes, through files:
    round ``n`` of rank ``r`` is ``<directory>/<n>.<r>`` (written whole, then renamed).
    What ``torch.distributed``'s all_reduce(MIN) gives the real jobs: with it a rank
    relaunched on a spare counts the shard it fetched from its partner copy. Every rank
    calls it the same number of times (the restore's rounds); a rank waits for the others'
    file of the round (a missing one past ``timeout`` is an error: a rank died)."""
    rounds = iter(range(1 << 30))

    def agree(value: int) -> int:
        n = next(rounds)
        mine = os.path.join(directory, f"{n}.{rank}")
        with open(f"{mine}.tmp", "w") as fh:
            fh.write(str(int(value)))
        os.replace(f"{mine}.tmp", mine)
        deadline = time.monotonic() + timeout
        values = []
        for r in range(world_size):
            path = os.path.join(directory, f"{n}.{r}")
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"agree round {n}: no value from rank {r}")
                time.sleep(0.005)
            with open(path) as fh:
                values.append(int(fh.read()))
        return min(values)

    return agree


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--size", type=int, default=1 << 16, help="float32 values per array")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--kill-wait", type=float, default=10.0)
    p.add_argument("--progress")
    # Partner-copy scenarios: one worker per rank ("node"); every rank trains the same
    # trajectory, so each rank's shard is checkable against the same reference.
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--partner-host", default=None, help="address of this rank's partner server")
    p.add_argument("--agree-dir", default=None, help="restore agreement through files here")
    args = p.parse_args(argv)

    if os.environ.get("CAMPAIGN_LOG"):  # the library's log in the worker's output
        import logging

        logging.basicConfig(level=logging.INFO, format="log %(message)s")
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.core.config import Config

    def on_event(name: str, info: Dict[str, Any]) -> None:
        tag = {
            "local_done": "COMMITTED",
            "flush_done": "FLUSHED",
            "local_failed": "LOCALFAIL",
            "flush_failed": "FLUSHFAIL",
            "partner_done": "PARTNERED",  # the partner committed our copy of the step
            "partner_received": "RECEIVED",  # we committed a partner copy of another rank
        }.get(name)
        if tag:
            emit(f"{tag} step={info['step']}")

    ckpt = Checkpointer(
        key=args.key,
        config=Config.load(args.config),
        interval_steps=args.interval,
        job=args.job,
        node=args.node,
        kill_wait_s=args.kill_wait,
        on_event=on_event,
        rank=args.rank,
        world_size=args.world_size,
        partner_host=args.partner_host,
        agree=None
        if args.agree_dir is None
        else file_agree(args.agree_dir, args.rank, args.world_size),
    )
    got = ckpt.restore()
    if got is None:
        state = initial_state(args.size, args.seed)
        emit("START fresh")
    else:
        state = _owned(got.state)
        emit(f"RESUMED step={state['step']} tier={got.tier} digest={digest(state)}")
    while state["step"] < args.steps:
        train_step(state)
        step = state["step"]
        _progress(args.progress, step)
        if args.sleep:
            time.sleep(args.sleep)
        if ckpt.should_save(step=step):
            ckpt.save(state, step=step)
            emit(f"SAVED step={step}")
        if ckpt.preempted:
            break
    ckpt.close()
    if ckpt.preempted:
        emit(f"PREEMPTED step={state['step']}")
    else:
        emit(f"DONE step={state['step']} digest={digest(state)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
