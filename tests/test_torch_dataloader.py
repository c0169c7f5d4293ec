"""Exact data resume: the data loader's position is part of the checkpoint.

A shuffled, two-worker run is interrupted mid-epoch and resumed from its checkpoint with
every object built anew (and the global RNGs scrambled, as in a new process); its final
weights must be bitwise equal to an uninterrupted run's. The same run with a plain
``DataLoader`` is warned about and ends elsewhere - which also shows that the digest
comparison can fail.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

import numpy as np
import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import slurm_ckpt.torch_data
from slurm_ckpt import Checkpointer
from slurm_ckpt.torch import TorchCheckpointer, state_digest

STEPS = 32  # two epochs of 16 batches
STOP = 21  # mid-way through the second epoch
SAVE_EVERY = 7


class Noisy(torch.utils.data.Dataset):
    """Items with noise drawn in the worker from its torch RNG (seeded from the loader's
    base seed). StatefulDataLoader keeps each worker's dataset state_dict(), so the
    worker's RNG stream goes on where it stood: that is how augmentation stays exact."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        x = torch.full((8,), float(i) / 64.0) + 0.1 * torch.rand(8)
        return x, torch.tensor(i % 4)

    def state_dict(self) -> Dict[str, Any]:
        return {"torch_rng": torch.get_rng_state()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        torch.set_rng_state(sd["torch_rng"])


class Plain(Noisy):
    """The same items without noise (for a loader whose workers' seeds are not kept)."""

    def __getitem__(self, i: int) -> Any:
        return torch.full((8,), float(i) / 64.0), torch.tensor(i % 4)


class StatefulShuffle(torch.utils.data.Sampler):
    """A shuffling sampler that can save where it is in its epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        perm = torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        while self.pos < self.n:
            self.pos += 1
            yield int(perm[self.pos - 1])
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: Dict[str, int]) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])


def stateful_loader() -> Any:
    return StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2)


def plain_loader() -> Any:
    return torch.utils.data.DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2)


def sampler_loader() -> Any:
    # no workers: with them a plain DataLoader's sampler runs ahead of the batches used
    return torch.utils.data.DataLoader(
        Plain(), batch_size=4, sampler=StatefulShuffle(64, 7), num_workers=0,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip


def run(
    tmp_path: Path, make_loader: Callable[[], Any], stop: Optional[int], key: str
) -> Optional[str]:
    """Train to STEPS (or to ``stop``, then return None as if killed); resumes from the
    newest checkpoint of ``key`` when there is one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    loader = make_loader()
    ckpt = Checkpointer(
        local=tmp_path / key, key=key, interval_steps=SAVE_EVERY, install_signals=False,
        end_time_fn=None,
    )  # fmt: skip
    tc = TorchCheckpointer(ckpt, model, opt, loader=loader)
    got = tc.restore()
    step = 0 if got is None else got.step
    while step < STEPS:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if tc.should_save(step=step):
                tc.save(step=step)
            if step == stop:
                tc.close()
                return None
            if step == STEPS:
                break
    tc.close()
    return state_digest(model)


def interrupted(tmp_path: Path, make_loader: Callable[[], Any], key: str) -> Optional[str]:
    assert run(tmp_path, make_loader, STOP, key) is None
    torch.manual_seed(12345)  # a new process would start with other RNG states
    random.seed(12345)
    np.random.seed(12345)
    return run(tmp_path, make_loader, None, key)


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    slurm_ckpt.torch_data._warned.clear()


def test_a_stateful_loader_resumes_mid_epoch_bitwise_exact(tmp_path: Path) -> None:
    reference = run(tmp_path, stateful_loader, None, "ref")
    with pytest.warns() as record:
        resumed = interrupted(tmp_path, stateful_loader, "cut")
    assert not [w for w in record if "slurm_ckpt" in str(w.message)]
    assert resumed == reference


def test_a_stateful_sampler_resumes_mid_epoch_exact(tmp_path: Path) -> None:
    reference = run(tmp_path, sampler_loader, None, "ref")
    assert interrupted(tmp_path, sampler_loader, "cut") == reference


def test_a_plain_dataloader_is_warned_about_once_with_the_fix(tmp_path: Path) -> None:
    reference = run(tmp_path, plain_loader, None, "ref")
    slurm_ckpt.torch_data._warned.clear()
    with pytest.warns(UserWarning) as record:
        resumed = interrupted(tmp_path, plain_loader, "cut")
    ours = [str(w.message) for w in record if str(w.message).startswith("slurm_ckpt:")]
    assert len([m for m in ours if "global torch RNG" in m]) == 1  # once, not per save
    assert all("StatefulDataLoader" in m for m in ours)  # the fix
    assert resumed != reference  # what the warning is about
