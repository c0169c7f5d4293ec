"""A tiny real HF Trainer run for tests/test_hf.py (a 2-layer GPT-2 built from a config:
no hub download; CPU), protected by :class:`slurm_ckpt.hf.SlurmCkptCallback`.

    python tests/hf_worker.py WORKDIR LOCAL PFS [--sigterm-at N | --kill-in-save-at N]

``PFS`` ``-``: a local tier only (laptop mode). ``--save-steps N``: the Trainer's own
schedule (default 4).

It resumes from ``ckpt.restore_path()``, records which samples every optimizer step
trained on (``WORKDIR/batches.<rank>.jsonl``: the data position), and writes ``WORKDIR/final.pt``
(the weights) when it reaches the last step and ``WORKDIR/result.json``.

``--sigterm-at N`` sends this process SIGTERM at the end of step N (a real signal,
through the Checkpointer's handler), as SLURM does before a preemption.
``--kill-in-save-at N`` SIGKILLs it inside the Trainer's save of step N, after the model
and optimizer files are written and before the RNG and trainer state: an incomplete
``checkpoint-N`` on disk. (It first waits until the earlier saves are committed and
flushed, so what is left is the same every time.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Dict

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import set_seed

from slurm_ckpt import Checkpointer
from slurm_ckpt.hf import SlurmCkptCallback

SAMPLES, SEQ, VOCAB = 24, 8, 64


class Tokens(Dataset):  # type: ignore[type-arg]
    """Sample ``i`` starts with token ``i``: the batches say which samples they hold."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = torch.tensor([i] + [(i * 7 + j * 3) % VOCAB for j in range(1, SEQ)])
        return {"input_ids": ids, "labels": ids.clone()}


class Recording(Trainer):
    """Records the samples of each step (the first token of every row)."""

    log_path: Path

    def training_step(self, model: Any, inputs: Dict[str, Any], *a: Any, **kw: Any) -> Any:
        with open(self.log_path, "a") as f:
            row = {"step": self.state.global_step + 1, "ids": inputs["input_ids"][:, 0].tolist()}
            f.write(json.dumps(row) + "\n")
        return super().training_step(model, inputs, *a, **kw)


class SigtermAt(TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("workdir", type=Path)
    p.add_argument("local")
    p.add_argument("pfs")
    p.add_argument("--sigterm-at", type=int)
    p.add_argument("--sigterm-rank", type=int, default=0, help="the rank that gets it")
    p.add_argument("--kill-in-save-at", type=int)
    p.add_argument("--save-steps", type=int, default=4)
    a = p.parse_args()
    warm = None if a.pfs == "-" else a.pfs  # "-": a local tier only (a laptop)
    for d in (a.workdir, Path(a.local), *([Path(warm)] if warm else [])):
        d.mkdir(parents=True, exist_ok=True)

    ckpt = Checkpointer(local=a.local, warm=warm, key="hf-run", end_time_fn=None)

    set_seed(0)
    torch.set_num_threads(1)  # tiny matrices: threads only contend on a shared machine
    cfg = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=str(a.workdir / "out"),
        per_device_train_batch_size=4,
        num_train_epochs=2,  # 6 steps an epoch, 12 in all
        save_strategy="steps",
        save_steps=a.save_steps,
        save_total_limit=1,  # the Trainer's rotation deletes what it saved before
        learning_rate=5e-3,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    # After TrainingArguments: under torchrun they set up torch.distributed, so that the
    # ranks agree on the step.
    resume = ckpt.restore_path()
    callbacks: list = []
    if a.sigterm_at is not None and ckpt.rank == a.sigterm_rank:
        callbacks.append(SigtermAt(a.sigterm_at))  # before ours: ours sees the flag at once
    callbacks.append(SlurmCkptCallback(ckpt))
    trainer = Recording(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.log_path = a.workdir / f"batches.{args.process_index}.jsonl"
    if a.kill_in_save_at is not None:
        orig = trainer._save_rng_state

        def killing_save(output_dir: str) -> None:
            if trainer.state.global_step == a.kill_in_save_at:
                ckpt.wait()  # the earlier saves committed and flushed: a fixed starting point
                os.kill(os.getpid(), signal.SIGKILL)
            orig(output_dir)

        trainer._save_rng_state = killing_save  # type: ignore[method-assign]

    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    done = trainer.state.global_step == trainer.state.max_steps
    if done and ckpt.rank == 0:
        torch.save(model.state_dict(), a.workdir / "final.pt")
    ckpt.close()
    result = {
        "resumed_from": None if resume is None else str(resume),
        "resumed_step": None if ckpt.restored is None else ckpt.restored.step,
        "resumed_tier": None if ckpt.restored is None else ckpt.restored.tier,
        "global_step": trainer.state.global_step,
        "done": done,
        "preempted": ckpt.preempted,
        "user": ckpt.user,
        "key": ckpt.shard_key,
    }
    name = "result.json" if ckpt.world_size == 1 else f"result-{ckpt.rank}.json"
    (a.workdir / name).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
