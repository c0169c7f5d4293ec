"""The tiny model that both in-job recovery workers train: ``tests/recovery_worker.py``
(ranks on one host) and ``tests/in_job_ddp_worker.py`` (ranks on the dev cluster).

One copy, because both tests compare a recovered run bitwise with an uninterrupted one:
the initial values, the batches, DDP's bucket layout and FSDP2's sharding must be the
same in every process of a run, and a fix to one worker must reach the other.

The workers run as scripts, so their own directory is first on ``sys.path`` and they
import this as ``helpers.tiny_model``; the cluster test copies it next to its worker.
Only torch here: the workers do the checkpointing.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

__all__ = ["batch", "build", "ddp", "final", "fsdp", "optimizer", "train_step"]


def build() -> nn.Module:
    """The model, with the same initial values in every process (seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def batch(rank: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of ``step``: a function of both only, so that a step redone
    after a recovery sees the very batch it saw the first time."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def ddp(model: nn.Module, group: Any) -> nn.Module:
    """``model`` wrapped for the (re-)formed ``group``. find_unused_parameters: DDP keeps
    its first gradient-bucket layout (it would rebuild it after the first iteration, and
    a re-wrapped DDP starts over from the first layout: gloo would sum in another order,
    not bitwise the same)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=group, find_unused_parameters=True)


def fsdp(world_size: int, door: Any) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model sharded with FSDP2 over ``world_size`` ranks, and its optimizer,
    bound to ``door`` (a ``slurm_ckpt.torch.ShardState``). The same initial values as
    :func:`build`: the restore puts the state back. The momentum buffers exist from the
    first step on; made now (zero), a restore has somewhere to put them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = build()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = optimizer(net.parameters())
    door.bind(net, opt)
    for p in net.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return net, opt


def train_step(net: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One step of rank ``rank``: its batch, the loss, the gradients, the update."""
    x, y = batch(rank, step)
    opt.zero_grad()
    loss = ((net(x) - y) ** 2).mean()
    loss.backward()
    opt.step()


def final(net: nn.Module, sharded: bool) -> Dict[str, torch.Tensor]:
    """The final values to compare: the whole model's (DDP: the same on every rank), or
    this rank's own shards (FSDP2)."""
    if sharded:
        return {k: p.to_local().detach().clone() for k, p in net.named_parameters()}
    return {k: v.detach().clone() for k, v in net.state_dict().items()}
