#!/usr/bin/env python3
"""A tiny PyTorch Lightning job whose checkpoints go through slurm_ckpt.

Why it exists: the smallest complete Lightning example (``SlurmCheckpointIO`` plugin +
``SlurmCheckpointCallback``), and the script the tests interrupt with SIGTERM and resume:
the final weights must be bitwise equal to an uninterrupted run's, and the data must
continue exactly where it stopped (torchdata's ``StatefulDataLoader``, whose state
Lightning keeps in its checkpoint).

Standalone::

    python examples/lightning_train.py --local /tmp/l --warm /tmp/p --key demo \\
        --steps 60 --interval-steps 10

Under SLURM (tiers from the site config, one part per step on every rank; one task per
device, as Lightning's SLURMEnvironment expects)::

    srun --ntasks-per-node=2 python examples/lightning_train.py --devices 2 \
        --key $SLURM_JOB_NAME --steps 5000

``--devices 2`` trains DDP on two CPU processes (gloo). Output, one line per event (the
tests parse them; keep them stable)::

    START fresh | RESUMED step=S tier=T path=P
    BATCH step=s rank=r idx=i,j,...   the sample indices of the batch trained at step s
    STEP s loss=...                   after every optimizer step (rank 0)
    SAVED step=s                      a checkpoint of step s was written (rank 0)
    PREEMPTED step=s                  a signal arrived; step s was saved; exit 0
    DONE step=s digest=...            the final weights digest (rank 0)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, _REPO)

import pytorch_lightning as pl  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402

from slurm_ckpt import Checkpointer  # noqa: E402
from slurm_ckpt import torch as sct  # noqa: E402


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Points(torch.utils.data.Dataset):
    """A fixed regression problem: sample ``i`` is ``(i, x_i, y_i)``, the index kept so
    the tests can see exactly which data each step trained on."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        w = torch.randn(8, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class Data(pl.LightningDataModule):
    """The train loader, built once the Trainer knows the ranks.

    A ``StatefulDataLoader``: Lightning saves its state (the position in the epoch) in
    each checkpoint and restores it, so a resume continues at the next batch. One
    device: shuffled from torch's global RNG (seeded, restored by the callback); a
    loader given its own ``generator=`` resumes mid-epoch exactly but shuffles the epochs
    after a resume differently (torchdata 0.11 keeps that generator as it was when the
    epoch began). DDP: torchdata's ``StatefulDistributedSampler`` (its position is saved
    too), not Lightning's replacement sampler, which wraps the loader's own sampler and
    saves nothing of it, so a resume after the first epoch would shuffle differently.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, batch: int, seed: int) -> None:
        super().__init__()
        self.dataset, self.batch, self.seed = dataset, batch, seed

    def train_dataloader(self) -> StatefulDataLoader:
        world = self.trainer.world_size
        if world == 1:
            return StatefulDataLoader(self.dataset, batch_size=self.batch, shuffle=True)
        sampler = StatefulDistributedSampler(
            self.dataset, num_replicas=world, rank=self.trainer.global_rank, seed=self.seed
        )
        return StatefulDataLoader(self.dataset, batch_size=self.batch, sampler=sampler)


class Tiny(pl.LightningModule):
    def __init__(self, lr: float, sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.lr, self.sleep = lr, sleep

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        ids = ",".join(str(int(i)) for i in idx)
        emit(f"BATCH step={self.global_step + 1} rank={self.global_rank} idx={ids}")
        return nn.functional.mse_loss(self.net(x), y)  # dropout draws from torch's RNG

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 0:
            emit(f"STEP {self.global_step} loss={float(outputs['loss']):.6f}")
        if self.sleep:
            time.sleep(self.sleep)  # paces the run for the tests' signals

    def on_save_checkpoint(self, checkpoint: Any) -> None:
        if self.global_rank == 0:
            emit(f"SAVED step={checkpoint['global_step']}")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local", help="node-local tier root (else the site config)")
    p.add_argument("--warm", "--pfs", dest="warm", help="warm tier root (else the site config)")
    p.add_argument("--key", default=None, help="checkpoint series (default: the job id)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--samples", type=int, default=96, help="dataset size (one epoch)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--interval-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--devices", type=int, default=1, help="CPU processes (2+: DDP, gloo)")
    p.add_argument("--sleep-per-step", type=float, default=0.0)
    p.add_argument("--no-ckpt", action="store_true", help="plain Lightning, no slurm_ckpt")
    p.add_argument(
        "--model-checkpoint",
        action="store_true",
        help="also Lightning's ModelCheckpoint (top-2 and last, every interval): its saves "
        "go through the same plug-in",
    )
    p.add_argument("--root", default=".", help="Lightning's default_root_dir")
    return p.parse_args(argv)


def checkpointer(args: argparse.Namespace) -> Checkpointer:
    from slurm_ckpt.lightning import lightning_checkpointer

    opts = {"interval_steps": args.interval_steps, "rank": 0, "world_size": 1}
    if args.local:  # standalone; --local alone is a laptop (nothing flushed anywhere)
        return Checkpointer(local=args.local, warm=args.warm, key=args.key or "lightning", **opts)
    return lightning_checkpointer(args.key, **opts)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)
    model = Tiny(args.lr, args.sleep_per_step)
    data = Data(Points(args.samples, args.seed), args.batch, args.seed)
    trainer_kw: dict = dict(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=args.root,
        use_distributed_sampler=False,  # Data picks the sampler (see there)
    )
    if args.no_ckpt:
        trainer = pl.Trainer(**trainer_kw)
        emit("START fresh")
        trainer.fit(model, datamodule=data)
        return done(trainer, model)

    from slurm_ckpt.lightning import SlurmCheckpointCallback, SlurmCheckpointIO

    # Built before the Trainer: its handlers hold SIGTERM/SIGUSR1 first; `with` closes it
    # (local write finished, PFS flush waited for up to the deadline) however fit ends.
    with checkpointer(args) as ckpt:
        io = SlurmCheckpointIO(ckpt)
        callback = SlurmCheckpointCallback(io)
        callbacks: List[pl.Callback] = [callback]
        if args.model_checkpoint:
            trainer_kw["enable_checkpointing"] = True
            callbacks.append(
                pl.callbacks.ModelCheckpoint(
                    every_n_train_steps=args.interval_steps,
                    save_top_k=2,
                    monitor="step",
                    mode="max",
                    save_last=True,
                )
            )
        trainer = pl.Trainer(plugins=[io], callbacks=callbacks, **trainer_kw)
        path = io.restore_path()
        if path is None:
            emit("START fresh")
        else:
            emit(f"RESUMED step={ckpt.restored.step} tier={ckpt.restored.tier} path={path}")
        try:
            trainer.fit(model, datamodule=data, ckpt_path=path)
        finally:
            if callback.preempted and trainer.is_global_zero:
                emit(f"PREEMPTED step={trainer.global_step}")
    return done(trainer, model)


def done(trainer: pl.Trainer, model: Tiny) -> int:
    if trainer.is_global_zero:
        emit(f"DONE step={trainer.global_step} digest={sct.state_digest(model.net)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
