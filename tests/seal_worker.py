"""Checkpoints written by other tools, for tests/test_seal.py (real torch and transformers,
CPU, no hub download).

    python tests/seal_worker.py dcp DIR        # stock DCP FileSystemWriter into DIR
    python tests/seal_worker.py dcp-load DIR   # load it back (exit 0 when equal)
    python tests/seal_worker.py dcp-paused DIR # the same save, held mid-write (see below)
    python tests/seal_worker.py hf OUT         # a plain HF Trainer: OUT/checkpoint-2
    python tests/seal_worker.py lightning DIR  # Lightning ModelCheckpoint(dirpath=DIR)
    python tests/seal_worker.py append FILE    # a writer in progress (see below)

``append`` opens FILE for appending, writes a first block, prints ``ready`` (the known
point the test waits for) and then keeps appending until its stdin is closed: a writer
that is still at work when ``seal`` runs, whatever the timing.

``dcp-paused`` is a stock ``FileSystemWriter`` save held in the middle of writing its
shard: the planner (DCP's public ``planner=`` seam; the writer is untouched) prints
``writing`` when the writer asks it for the data of one item - the shard file is then
open for writing and there is no ``.metadata`` yet - and goes on when a line comes on
stdin.
"""

from __future__ import annotations

import os
import select
import sys
from typing import Dict


def _state() -> Dict[str, object]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 64))
    return {"model": model.state_dict(), "step": torch.tensor(3)}


def dcp(path: str) -> int:
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint import FileSystemWriter

    dist_cp.save(_state(), storage_writer=FileSystemWriter(path))
    return 0


def dcp_paused(path: str) -> int:
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Paused(DefaultSavePlanner):
        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            if write_item.index.fqn == "note":  # a non-tensor: written into the open shard
                print("writing", flush=True)
                sys.stdin.readline()
            return super().resolve_data(write_item)

    state = dict(_state(), note="the save is held here")
    dist_cp.save(state, storage_writer=FileSystemWriter(path), planner=Paused())
    return 0


def dcp_load(path: str) -> int:
    import torch
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint import FileSystemReader

    want = _state()
    got = {
        "model": {k: torch.zeros_like(v) for k, v in want["model"].items()},  # type: ignore[union-attr]
        "step": torch.tensor(0),
    }
    dist_cp.load(got, storage_reader=FileSystemReader(path))
    same = all(torch.equal(got["model"][k], v) for k, v in want["model"].items())  # type: ignore[index,union-attr]
    return 0 if same and int(got["step"]) == 3 else 1  # type: ignore[call-overload]


def hf(out: str) -> int:
    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.trainer_utils import set_seed

    class Tokens(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
            ids = torch.tensor([(i * 7 + j * 3) % 64 for j in range(8)])
            return {"input_ids": ids, "labels": ids.clone()}

    set_seed(0)
    torch.set_num_threads(1)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=8)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        max_steps=2,
        save_strategy="steps",
        save_steps=2,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=Tokens()).train()
    return 0


def lightning(dirpath: str) -> int:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(64, 64)

        def training_step(self, batch: object, _i: int) -> torch.Tensor:
            (x,) = batch  # type: ignore[misc]
            return self.net(x).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 64)), batch_size=4)
    every = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=4,
        callbacks=[every],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(Tiny(), data)
    return 0


def append(path: str) -> int:
    block = b"x" * 4096
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, block)
        print("ready", flush=True)
        while not select.select([sys.stdin], [], [], 0.01)[0]:
            os.write(fd, block)
        sys.stdin.read()
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    cmd, arg = sys.argv[1], sys.argv[2]
    sys.exit(
        {
            "dcp": dcp,
            "dcp-load": dcp_load,
            "dcp-paused": dcp_paused,
            "hf": hf,
            "lightning": lightning,
            "append": append,
        }[cmd](arg)
    )
