"""One rank of the RAM-tier tests (tests/test_ram_tier.py): a real process with a
Checkpointer of its own "node" (local tier, ledger), partner copies and the RAM tier on,
gloo over 127.0.0.1. The test drives it line by line on stdin; every answer is one line
``REPLY {json}`` on stdout (the logs go to stderr).

    python ram_worker.py WORK RANK NODE EVERY KEEP

Commands:
    init PORT            join the gloo process group at 127.0.0.1:PORT
    train A B [S,S..]    steps A..B: an all-reduce, ram_save() and a wait until its copy
                         is acknowledged (and save() at steps S)
    solo A B             steps A..B with ram_save() only, no collective, no wait
    idle                 wait until the RAM copies are committed and sent
    damage KEY STEP      flip a byte of the RAM copy held here of KEY at STEP
    recover PORT         a new process group at PORT (the old one dropped), restore(),
                         the state written to WORK/restored.rankR.pt
    stats                the RAM tier's counters, events and what this rank holds
    exit                 close
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from slurm_ckpt import Checkpointer
from slurm_ckpt.job.options import RamOptions

KEY = "run"
JOB = "4343"
#: Elements of the model's big tensor: 4 MiB of float32 (several copy pieces).
BIG = 2**20


def make_state(rank: int, step: int) -> Dict[str, Any]:
    """The state rank ``rank`` has after ``step``: deterministic, different per step."""
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    return {
        "model": {"w": torch.randn(BIG, generator=g), "b": torch.randn(513, generator=g)},
        "optimizer": {"m": torch.randn(4099, generator=g), "count": step},
        "step": step,
    }


def reply(doc: Dict[str, Any]) -> None:
    sys.stdout.write("REPLY " + json.dumps(doc, default=str) + "\n")
    sys.stdout.flush()


def open_ckpt(work: Path, rank: int, node: str, every: int, keep: int, events: List[str]) -> Any:
    for d in (work / node / "local", work / node / "ledger", work / "pfs"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(work / node / "ledger", 0o700)
    return Checkpointer(
        local=work / node / "local",
        warm=work / "pfs",
        key=KEY,
        rank=rank,
        world_size=2,
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
        ram=RamOptions(every=every, keep=keep),
        on_event=lambda name, info: events.append(name),
    )


def main() -> None:
    warnings.filterwarnings("ignore")
    work, rank, node = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    every, keep = int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    events: List[str] = []
    ckpt = open_ckpt(work, rank, node, every, keep, events)
    reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        op = cmd[0]
        if op == "init":
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{cmd[1]}", rank=rank, world_size=2
            )
            reply({"ok": True})
        elif op in ("train", "solo"):
            saves = {int(s) for s in cmd[3].split(",")} if len(cmd) > 3 else set()
            for step in range(int(cmd[1]), int(cmd[2]) + 1):
                state = make_state(rank, step)
                if op == "train":
                    dist.all_reduce(torch.ones(1))  # the step's collective
                ckpt.ram_save(state, step=step)
                if op == "train":  # every step's copy acknowledged before the next step
                    assert ckpt.ram.wait_idle(60)
                if step in saves:
                    ckpt.save(state, step=step)
                    assert ckpt.wait(flush=True)
                    assert ckpt.partner.wait_idle(60)
            reply({"step": step, "stats": vars(ckpt.ram.stats)})
        elif op == "idle":
            reply({"idle": ckpt.ram.wait_idle(60), "stats": vars(ckpt.ram.stats)})
        elif op == "damage":
            ckpt.ram.held.damage_for_test(cmd[1], int(cmd[2]))
            reply({"ok": True})
        elif op == "recover":
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{cmd[1]}", rank=rank, world_size=2
            )
            got = ckpt.restore()
            if got is None:
                reply({"step": None})
                continue
            torch.save(got.state, work / f"restored.rank{rank}.pt")
            reply({"step": got.step, "tier": got.tier})
        elif op == "stats":
            held = {
                k: {
                    "slots": ckpt.ram.held.slots(k),
                    "listed": [s.step for s in ckpt.ram.held.listed(k)],
                }
                for k in ckpt.ram.held.keys()  # noqa: SIM118 - a method
            }
            own = {
                "slots": ckpt.ram.own.slots(ckpt.shard_key),
                "listed": [s.step for s in ckpt.ram.own.listed(ckpt.shard_key)],
            }
            reply({"stats": vars(ckpt.ram.stats), "events": events, "held": held, "own": own})
        elif op == "exit":
            ckpt.close()
            if dist.is_initialized():
                dist.destroy_process_group()
            reply({"bye": True})
            return


if __name__ == "__main__":
    main()
