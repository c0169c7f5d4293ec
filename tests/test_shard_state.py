"""FSDP2's public door to the RAM tier (``slurm_ckpt.torch.ShardState``): each rank's own
DTensor shards, model and optimizer, snapshotted and put back in place. A real
``fully_shard`` over a one-rank gloo group and a real Checkpointer with the RAM tier;
the multi-rank recovery through it is tests/test_in_job_recovery.py's FSDP2 case."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import slurm_ckpt.torch as sct
from slurm_ckpt import Checkpointer
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.options import RamOptions


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded() -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for p in net.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return net, opt


def test_a_rank_shards_go_to_ram_and_come_back_in_place(tmp_path: Path, group: None) -> None:
    ckpt = Checkpointer(
        local=tmp_path, key="run", install_signals=False, ram=RamOptions(every=1, keep=2)
    )
    try:
        door = sct.ShardState(ckpt)
        with pytest.raises(CkptError, match=r"call bind\(model, optimizer\) in on_reform"):
            door.ram_save(step=1)
        net, opt = sharded()
        door.bind(net, opt)
        net(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        want = {k: p.to_local().clone() for k, p in net.named_parameters()}
        assert door.ram_save(step=1)
        assert ckpt.ram.wait_idle(60)  # the snapshot commits in the background
        net2, opt2 = sharded()  # a re-form: a fresh model and optimizer
        door.bind(net2, opt2)
        got = door.restore()
        assert (got.step, got.tier) == (1, "ram")
        for k, p in net2.named_parameters():
            assert torch.equal(p.to_local(), want[k]), k
            assert torch.equal(
                opt2.state[p]["momentum_buffer"].to_local(),
                opt.state[dict(net.named_parameters())[k]]["momentum_buffer"].to_local(),
            )
    finally:
        ckpt.close()
