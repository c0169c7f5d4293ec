"""HF transformers ``Trainer`` integration: its own ``checkpoint-N/`` directories, protected.

::

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.hf import SlurmCkptCallback

    ckpt = Checkpointer.from_env(key="my-run")
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[SlurmCkptCallback(ckpt)])
    trainer.train(resume_from_checkpoint=ckpt.restore_path())   # None: from scratch
    ckpt.close()                       # waits for the flushes (and requeues if asked)

What the callback does, and why:

* **on_save** (called after the Trainer wrote ``checkpoint-N/`` and ran its own rotation)
  hands the directory to :meth:`Checkpointer.adopt`: a snapshot (reflinks, hard links or
  a copy) that the Trainer's next rotation (``save_total_limit``) cannot delete from
  under the flush; the files are hashed, committed with the manifest last, and flushed
  to the PFS or object store like any checkpoint.
* **on_step_end**: when a preemption signal arrived (SLURM's ``--signal``, SIGTERM) or
  the job's end is closer than a save and its flush, it sets ``control.should_save`` and
  ``control.should_training_stop``: the Trainer saves at this step boundary (never
  inside a signal handler), the save is the preemption save (always flushed), and
  ``train()`` returns. With several ranks the flag is agreed first (a max-reduce), so
  every rank saves at the same step.
* **The end of training**: at the last step it sets ``control.should_save`` when the
  Trainer's own schedule would not save there, so the final state is committed (and
  flushed by ``close()``) whatever ``save_steps`` is.
* **Resume**: ``ckpt.restore_path()`` returns the newest checkpoint that is committed on
  every rank and verifies, on the local tier (fetched from the PFS, object store or cold
  tier if need be, verified on the way). A ``checkpoint-N`` the Trainer was killed while
  writing is never committed, so never chosen; HF's own ``get_last_checkpoint`` picks
  the highest ``checkpoint-*`` even when it is incomplete (transformers#35782).
  Everything of the Trainer's resume then works from that directory as it does from its
  own: model, optimizer, scheduler, ``trainer_state.json``, the RNG states, and the
  data position (``skip_first_batches`` over the seeded sampler: the data continue
  where they stopped).

With several ranks, each rank adopts the ``checkpoint-N`` it sees (its own part; the
ranks wait for each other first, as rank 0 writes most files): with ``output_dir`` on a
shared filesystem every rank's part holds the whole directory, so that any rank on any
node can resume from its own.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from slurm_ckpt.job.checkpointer import Checkpointer
from slurm_ckpt.job.dist import all_reduce_ints, process_group

log = logging.getLogger(__name__)

__all__ = ["SlurmCkptCallback"]

#: The Trainer's name for its checkpoint directories (transformers.trainer_utils).
PREFIX_CHECKPOINT_DIR = "checkpoint"


class SlurmCkptCallback(TrainerCallback):  # type: ignore[misc]
    """Adopts every ``checkpoint-N`` the Trainer saves and makes the Trainer save and
    stop at the step boundary after a preemption signal (see the module docstring).

    ``tokens``: a function of the Trainer's state giving the tokens trained on (recorded
    in the manifest, shown by ``list``); by default ``state.num_input_tokens_seen`` when
    the Trainer counts them (``include_num_input_tokens_seen``)."""

    def __init__(
        self,
        ckpt: Checkpointer,
        *,
        tokens: Optional[Callable[[TrainerState], Optional[int]]] = None,
    ) -> None:
        self.ckpt = ckpt
        self.tokens = tokens or _tokens_seen
        #: The step whose save answers a preemption (set at the step boundary).
        self.preempt_step: Optional[int] = None
        #: The newest step adopted (the Trainer may save one step twice: at the last
        #: step, then at the epoch's end).
        self.adopted_step: Optional[int] = None

    def _preempted_anywhere(self) -> bool:
        mine = 1 if self.ckpt.preemption_pending else 0
        if process_group() is None:
            return bool(mine)
        return all_reduce_ints([mine], "max")[0] == 1

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        if state.max_steps and state.global_step >= state.max_steps and not control.should_save:
            # The last step: the Trainer saves it only when save_steps divides it. Asked
            # here, it writes checkpoint-N and on_save commits it: the final state of a
            # finished run is never left behind.
            control.should_save = True
            log.info("[ckpt] end of training: the Trainer saves checkpoint-%d", state.global_step)
        if self.preempt_step is None and self._preempted_anywhere():
            self.preempt_step = state.global_step
            control.should_save = True
            control.should_training_stop = True
            log.warning(
                "[ckpt] preemption: the Trainer saves checkpoint-%d now and stops",
                state.global_step,
            )
        return control

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        step = state.global_step
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        dist = process_group()
        if dist is not None:
            dist.barrier()  # rank 0 writes the model and trainer_state.json: wait for it
        if not os.path.isdir(path):
            log.warning("[ckpt] on_save: %s does not exist: nothing adopted", path)
            return control
        if step == self.adopted_step:
            return control  # committed already
        self.ckpt.adopt(
            step,
            path,
            tokens=self.tokens(state),
            meta={"framework": "transformers", "checkpoint": os.path.basename(path)},
            preemption=True if self.preempt_step == step else None,
        )
        self.adopted_step = step
        return control


def _tokens_seen(state: TrainerState) -> Optional[int]:
    n = getattr(state, "num_input_tokens_seen", 0)
    return int(n) if n else None
