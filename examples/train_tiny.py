#!/usr/bin/env python3
"""A tiny, fully deterministic CPU training job that checkpoints with slurm_ckpt.

Why it exists: it is the end-to-end proof that a job interrupted any number of times
(SIGTERM from SLURM preemption, or SIGKILL) and restarted ends with weights *bitwise
equal* to an uninterrupted run - the weights, AdamW moments, LR schedule, every global
RNG (Python, NumPy, torch) and the data position are all restored exactly. The tests
and the dev-cluster demo run it; it is also the smallest complete example of the API.

Standalone::

    python examples/train_tiny.py --local /tmp/l --warm /tmp/p --key demo --steps 200 \\
        --interval-steps 20 --digest-out /tmp/digest

Under SLURM (tiers from the site config, rank/world size from the environment; see
examples/sbatch_train.sh, which runs it through ``ckpt-srun``)::

    srun python examples/train_tiny.py --key $SLURM_JOB_NAME --steps 5000

With several tasks it trains data-parallel (torch.distributed, gloo); each rank saves
its own shard and all ranks resume from the same step.

Output, one line per event (the tests parse these; keep them stable)::

    START fresh [reached=R lost=R] | RESUMED step=S reached=R lost=L tier=T tokens=N
    STEP s loss=...            after every completed step
    SAVED step=s               after save() returned (snapshot taken)
    COMMITTED step=s           the local tier holds step s (background thread)
    FLUSHED step=s             the PFS holds a verified copy of step s
    PREEMPTED step=s           a signal arrived; the state at step s was saved; exit 0
    DONE step=s digest=...     the final weights digest (also written to --digest-out)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import threading
import time
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, _REPO)

from slurm_ckpt import torch as sct  # noqa: E402

VOCAB = 32
CONTEXT = 8


# -- data: a deterministic synthetic "language" ------------------------------------------
def make_corpus(seed: int, length: int = 50_000) -> np.ndarray:
    """Text from a fixed random Markov chain: learnable structure, no files needed."""
    g = np.random.default_rng(seed)
    trans = g.dirichlet(np.full(VOCAB, 0.15), size=VOCAB)
    cdf = np.cumsum(trans, axis=1)
    u = g.random(length)
    out = np.empty(length, dtype=np.int64)
    tok = 0
    for i in range(length):
        tok = min(int(np.searchsorted(cdf[tok], u[i])), VOCAB - 1)
        out[i] = tok
    return out


class Sampler:
    """Epoch-shuffled windows; its whole position is (epoch, index), saved as JSON.

    The permutation of an epoch is a pure function of (seed, epoch, rank), so a resumed
    job rebuilds it and continues at ``index`` instead of replaying or skipping data.
    """

    def __init__(self, corpus: np.ndarray, batch: int, seed: int, rank: int, world: int):
        self.corpus = torch.from_numpy(corpus)
        self.batch = batch
        self.seed, self.rank, self.world = seed, rank, world
        self.n_windows = len(corpus) - CONTEXT - 1
        self.epoch, self.index = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> np.ndarray:
        g = np.random.default_rng([self.seed, self.epoch])
        perm = g.permutation(self.n_windows)
        return perm[self.rank :: self.world]  # each rank its own disjoint share

    @property
    def per_epoch(self) -> int:
        return len(self._perm) // self.batch

    def next(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.index >= self.per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._perm = self._permutation()
        starts = self._perm[self.index * self.batch : (self.index + 1) * self.batch]
        self.index += 1
        # augmentation drawn from the *global* RNGs on purpose: their exact restore is
        # part of what a resume must get right (Python random + NumPy legacy global).
        jitter = np.random.randint(0, 2, size=len(starts))
        starts = np.minimum(starts + jitter, self.n_windows - 1)
        idx = torch.from_numpy(starts)[:, None] + torch.arange(CONTEXT + 1)
        xy = self.corpus[idx]
        if random.random() < 0.05:  # occasional noise token
            xy = xy.clone()
            xy[:, random.randrange(CONTEXT)] = random.randrange(VOCAB)
        return xy[:, :CONTEXT], xy[:, CONTEXT]

    def position(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, pos: Dict[str, Any]) -> None:
        self.epoch, self.index = int(pos["epoch"]), int(pos["index"])
        self._perm = self._permutation()


# -- model -------------------------------------------------------------------------------
class TinyLM(nn.Module):
    """Char-level MLP language model: embed a context window, predict the next char."""

    def __init__(self, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.net = nn.Sequential(
            nn.Linear(CONTEXT * dim, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Dropout(0.1),  # consumes the torch RNG every step
            nn.Linear(hidden, VOCAB),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.emb(x).flatten(1))


def build(args: argparse.Namespace) -> Tuple[nn.Module, Any, Any]:
    torch.manual_seed(args.seed)  # identical initial weights on every rank and every run
    model = TinyLM(args.dim, args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warm),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps - warm)),
        ],
        milestones=[warm],
    )
    return model, opt, sched


# -- helpers -----------------------------------------------------------------------------
def deterministic() -> None:
    """``torch.use_deterministic_algorithms(True)`` for eager kernels, without its cost.

    The public call also imports ``torch._inductor`` to set the compiler's flag (about 3 s
    of start-up here, paid again at every restart of an interrupted job); this script
    never compiles, so it sets the eager flag directly when this torch has the setter.
    """
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(True)
    else:
        setter(True, warn_only=False)
    assert torch.are_deterministic_algorithms_enabled()


_OUT_LOCK = threading.Lock()


def emit(line: str) -> None:
    """One whole line per write, also from the checkpointer's background threads."""
    with _OUT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def on_event(name: str, info: Dict[str, Any]) -> None:
    """Progress of the background phases of a save (called from the job layer's threads)."""
    if name == "local_done":
        emit(f"COMMITTED step={info['step']}")
    elif name == "flush_done":
        emit(f"FLUSHED step={info['step']}")


def read_reached(path: Optional[str]) -> Optional[int]:
    if not path:
        return None
    try:
        with open(path) as fh:
            return int(json.load(fh)["step"])
    except (OSError, ValueError, KeyError):
        return None


def write_reached(path: Optional[str], step: int) -> None:
    """Last step this job completed, for the 'steps lost' line of the next restart.

    Replaced by rename so a kill never leaves a torn file; not fsynced: it is a
    statistic, and a process kill (the case it is for) does not lose the page cache.
    """
    if not path:
        return
    tmp = f"{path}.tmp"  # one writer per file (per key and rank): a fixed name leaves no litter
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"step": step}))
    os.replace(tmp, path)


def average_gradients(model: nn.Module, world: int) -> None:
    """Data parallelism by hand: sum each gradient over the ranks, one parameter at a time,
    always in the same order.

    Not ``DistributedDataParallel``: DDP rebuilds its gradient buckets after the first
    iteration of a process, so the first step after every restart would all-reduce with
    another bucket layout than the uninterrupted run did at that step. With more than two
    ranks the layout decides the order in which the ranks' values are added, and float
    addition is not associative: the resumed run would drift from the uninterrupted one
    in the last bits. Per-parameter all-reduces in a fixed order add every value the same
    way in every process, so a resume stays bitwise exact at any world size.
    """
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def setup_distributed(args: argparse.Namespace) -> Tuple[int, int]:
    """Join a gloo process group when launched as several ranks.

    Rank and world size come from the same rule the Checkpointer uses (``RANK``/
    ``WORLD_SIZE`` as torchrun sets them, else ``SLURM_PROCID`` and the srun step's task
    count), so the process group and the checkpoint shards always agree.
    """
    import torch.distributed as dist

    from slurm_ckpt import rank_and_world_size

    rank, world = rank_and_world_size()
    if world <= 1:
        return 0, 1
    os.environ.setdefault("MASTER_ADDR", _master_addr())
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", 0)) % 2000))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def _master_addr() -> str:
    """The address of the job's first node, where rank 0 listens for the rendezvous.

    The first host name of the allocation when it resolves; else that node's ``NodeAddr``
    as SLURM knows it (``scontrol show node``): on clusters whose node names are not in
    DNS - the dev cluster runs every node on 127.0.0.1 - only SLURM knows where a node is.
    """
    import socket
    import subprocess

    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes:
        return "127.0.0.1"

    def scontrol(*args: str) -> str:
        try:
            out = subprocess.run(
                ["scontrol", *args], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout if out.returncode == 0 else ""

    hosts = scontrol("show", "hostnames", nodes).split()
    if not hosts:
        return "127.0.0.1"
    try:
        socket.getaddrinfo(hosts[0], None)
        return hosts[0]
    except OSError:
        pass
    m = re.search(r"\bNodeAddr=(\S+)", scontrol("-o", "show", "node", hosts[0]))
    return m.group(1) if m else hosts[0]


def make_checkpointer(
    args: argparse.Namespace, rank: int, world: int, model: nn.Module, opt: Any, sched: Any
) -> Optional[sct.TorchCheckpointer]:
    """Standalone: the tiers given on the command line (``--local`` alone is a laptop).
    Under ckpt-srun (examples/sbatch_train.sh): the site config, the key and the warning
    signal ckpt-srun relays all come from the environment (``from_env``)."""
    from slurm_ckpt import Checkpointer

    if args.no_ckpt:
        return None
    if args.local or args.warm:
        ckpt = Checkpointer(
            local=args.local,
            warm=args.warm,
            key=args.key,
            interval_steps=args.interval_steps,
            rank=rank,
            world_size=world,
            on_event=on_event,
        )
        return sct.TorchCheckpointer(ckpt, model, opt, sched)
    return sct.TorchCheckpointer.from_env(
        args.key,
        model=model,
        optimizer=opt,
        scheduler=sched,
        interval_steps=args.interval_steps,
        on_event=on_event,
    )


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local", help="node-local tier root (standalone mode)")
    p.add_argument(
        "--warm",
        "--pfs",
        dest="warm",
        help="warm tier root, a PFS or shared directory (standalone mode; --pfs: old name)",
    )
    p.add_argument(
        "--key",
        default=os.environ.get("SLURM_CKPT_KEY")
        or os.environ.get("SLURM_JOB_NAME")
        or "train-tiny",
        help="checkpoint series (default: $SLURM_CKPT_KEY, $SLURM_JOB_NAME, train-tiny)",
    )
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--interval-steps", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--sleep-per-step", type=float, default=0.0, help="slow down (cluster tests)")
    p.add_argument("--digest-out", help="write the final weights digest (sha256) here")
    p.add_argument(
        "--progress-file",
        help="side file recording the last step reached (default: next to --digest-out or "
        "in $SLURM_SUBMIT_DIR / the current directory, one per key and rank)",
    )
    p.add_argument("--no-ckpt", action="store_true", help="reference run without checkpoints")
    p.add_argument(
        "--weights-first",
        action="store_true",
        help="restore the weights, then the optimizer state (two verified reads)",
    )
    p.add_argument("--quiet-steps", action="store_true", help="do not print a line per step")
    return p.parse_args(argv)


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    deterministic()
    rank, world = setup_distributed(args)
    if args.progress_file is None and not args.no_ckpt:
        base = os.path.dirname(os.path.abspath(args.digest_out)) if args.digest_out else None
        base = base or os.environ.get("SLURM_SUBMIT_DIR") or os.getcwd()
        args.progress_file = os.path.join(base, f".train_tiny-{args.key}-rank{rank}.progress")

    model, opt, sched = build(args)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + 1000 + rank)  # dropout differs per rank, as in real DP
    sampler = Sampler(make_corpus(args.seed), args.batch, args.seed, rank, world)

    tc = make_checkpointer(args, rank, world, model, opt, sched)
    step, tokens = 0, 0
    got = None if tc is None else tc.restore(weights_first=args.weights_first)  # ranks agree
    if got is None:
        reached = None if tc is None else read_reached(args.progress_file)
        # a job killed before its first checkpoint was committed loses everything
        emit("START fresh" if not reached else f"START fresh reached={reached} lost={reached}")
    else:
        step, tokens = got.step, got.tokens or 0
        sampler.seek(got.data_position or {"epoch": 0, "index": 0})
        reached = read_reached(args.progress_file)
        lost = None if reached is None else max(0, reached - step)
        emit(f"RESUMED step={step} reached={reached} lost={lost} tier={got.tier} tokens={tokens}")

    model.train()
    preempted = False
    while step < args.steps:
        x, y = sampler.next()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            average_gradients(model, world)
        opt.step()
        sched.step()
        step += 1
        tokens += int(x.numel()) * world
        write_reached(args.progress_file, step)
        if not args.quiet_steps:
            emit(f"STEP {step} loss={loss.item():.6f}")
        if args.sleep_per_step:
            time.sleep(args.sleep_per_step)
        if tc is None:
            continue
        if tc.should_save(step=step, tokens=tokens):
            tc.save(step=step, tokens=tokens, data_position=sampler.position())
            emit(f"SAVED step={step}")
        if tc.preempted:
            preempted = True
            break

    if tc is not None:
        tc.close()  # waits for the local commit (and the PFS copy, per policy)
    if preempted:
        emit(f"PREEMPTED step={step}")
        _finish_distributed(world)
        return 0  # exit 0: SLURM requeues the job; the next run resumes at this step
    digest = sct.state_digest(model)
    emit(f"DONE step={step} digest={digest}")
    if args.digest_out and rank == 0:
        with open(args.digest_out, "w") as fh:
            fh.write(digest + "\n")
    _finish_distributed(world)
    return 0


def _finish_distributed(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
