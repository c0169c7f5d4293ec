#!/usr/bin/env python3
"""An HF ``Trainer`` job protected by slurm_ckpt: one callback, one resume argument.

::

    python examples/hf_trainer.py --local /tmp/l --warm /tmp/p --out /tmp/hf-out
    # interrupt it (Ctrl-C is not it: `kill -TERM <pid>`, as SLURM does), run it again:
    # it resumes from the newest verified checkpoint-N, with the data where they stopped

Under SLURM drop ``--local``/``--warm``: the tiers come from the site config, the key
from the job (``Checkpointer.from_env``), and ``#SBATCH --signal=B:TERM@120`` (or the
site's preemption SIGTERM) makes the Trainer save at the next step boundary and stop;
``ckpt.close()`` waits for the flush and requeues when asked (``requeue=True``).

The model is a tiny 2-layer GPT-2 built from a config (no download) on random tokens,
so that the example runs anywhere on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slurm_ckpt import Checkpointer  # noqa: E402
from slurm_ckpt.hf import SlurmCkptCallback  # noqa: E402


class RandomTokens(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 256, seq: int = 16, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local", help="node-local tier (default: the site config)")
    p.add_argument("--warm", "--pfs", dest="warm", help="shared tier (default: the site config)")
    p.add_argument("--key", default="hf-demo")
    p.add_argument("--out", default="hf-out", help="the Trainer's output_dir")
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args()

    if a.local and a.warm:
        for d in (a.local, a.warm):
            os.makedirs(d, exist_ok=True)
        ckpt = Checkpointer(local=a.local, warm=a.warm, key=a.key)
    else:
        ckpt = Checkpointer.from_env(key=a.key)

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=64,
        vocab_size=128,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=a.out,
        per_device_train_batch_size=8,
        num_train_epochs=a.epochs,
        save_strategy="steps",
        save_steps=20,
        save_total_limit=2,  # the Trainer's rotation cannot hurt: each save is adopted
        logging_steps=20,
        report_to=[],
        use_cpu=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(),
        callbacks=[SlurmCkptCallback(ckpt)],
    )
    resume = ckpt.restore_path()  # newest verified, on the local tier; None: from scratch
    print("resuming from", resume or "scratch")
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    ckpt.close()
    print("preempted" if ckpt.preempted else "done", "at step", trainer.state.global_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
