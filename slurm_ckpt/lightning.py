"""PyTorch Lightning: Lightning's own checkpoints, protected by slurm_ckpt's tiers.

::

    from slurm_ckpt.lightning import SlurmCheckpointIO, SlurmCheckpointCallback

    with Checkpointer(local=..., warm=..., key="run", interval_steps=500) as ckpt:
        io = SlurmCheckpointIO(ckpt)
        trainer = L.Trainer(plugins=[io], callbacks=[SlurmCheckpointCallback(io)], ...)
        trainer.fit(model, loader, ckpt_path=io.restore_path())   # None: a fresh start

Two pieces, because Lightning splits the work in two:

* :class:`SlurmCheckpointIO` is the ``CheckpointIO`` plugin: every checkpoint Lightning
  writes (ours, ``ModelCheckpoint``'s, ``trainer.save_checkpoint``) becomes one step of
  the Checkpointer, written with ``torch.save`` straight onto the local tier through
  ``ckpt.output()``: hashed, manifest last, flushed to the PFS/object store by the one
  flush engine, seen by ``list``/``verify``/``status``/the epilog like any checkpoint.
  ``load_checkpoint`` reads the verified copy that :meth:`SlurmCheckpointIO.restore_path`
  found (fetched to the local tier when only a warm or cold tier holds it). Lightning's
  ``remove_checkpoint`` (``ModelCheckpoint``'s top-k rotation) deletes nothing: which
  copies go is the retention policy's call, never a framework's.
* :class:`SlurmCheckpointCallback` decides *when*: at a training step boundary it asks
  ``ckpt.should_save(step)`` (the interval, a preemption signal, the job's end drawing
  near) and saves there. It never saves inside a signal handler: the Checkpointer's
  handlers only set a flag (:mod:`slurm_ckpt.job.signals`). It also saves every rank's
  RNG states in the checkpoint (Lightning does not), so a resume continues bitwise.

Coexisting with Lightning's ``SLURMEnvironment`` (one owner of signals and requeue):

* Lightning's auto-requeue (on by default under SLURM) answers SIGUSR1 by writing
  ``hpc_ckpt_N.ckpt`` from *inside* its signal handler, on every rank, then runs
  ``scontrol requeue`` itself. The callback switches it off at ``setup`` (logged), so
  requeue has one owner: SLURM's own ``--requeue`` on preemption, or the Checkpointer's
  ``requeue=True`` after a time-limit save. The Checkpointer, built before the Trainer,
  also holds SIGUSR1 first, and Lightning never installs a handler over an existing one.
* Lightning's SIGTERM handler is kept (it chains to ours): it ends ``fit`` with a
  ``SIGTERMException`` at the next batch boundary. Our save comes first, in
  ``on_train_batch_end``; when the signal lands after that check, Lightning raises at the
  boundary and ``on_exception`` takes the preemption save there (still a step boundary,
  as Lightning's own ``OnExceptionCheckpoint`` does). The process then exits 0.

Single-device and DDP only: Lightning calls ``CheckpointIO`` on global rank 0 with the
whole state, so the Checkpointer must be a one-part series (``rank=0, world_size=1``) on
every rank; :func:`lightning_checkpointer` builds one. ``FSDPStrategy`` and
``ModelParallelStrategy`` never call ``CheckpointIO`` (they run
``torch.distributed.checkpoint.save(checkpoint_id=path)`` themselves): such a job saves
through the DCP backend, ``dcp.save(state, storage_writer=ckpt.dcp_writer(step=...))``
(:mod:`slurm_ckpt.dcp`), and the callback refuses those strategies with a one-line error
that says so, instead of silently protecting nothing.

The data position: Lightning saves a train dataloader's state when the loader has
``state_dict``/``load_state_dict`` (e.g. torchdata's ``StatefulDataLoader``); with a plain
``DataLoader`` a mid-epoch resume trains the rest of that epoch on the loader's first
batches again (a fresh iterator; a new shuffle if it shuffles), only as many as were
left, so some samples of the epoch are seen twice and others not at all. The callback
warns about that.

The end of ``fit()`` saves the final step when the interval did not (``on_train_end``):
a finished run leaves its final state committed, and ``close()`` flushes it.
Under DDP the sampler must keep its own position too (torchdata's
``StatefulDistributedSampler``, ``Trainer(use_distributed_sampler=False)``): the sampler
Lightning substitutes wraps the loader's own one and saves nothing of it
(docs/lightning.md).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from lightning_fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.types import _PATH, _Stateful
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.utilities.exceptions import SIGTERMException

from slurm_ckpt import torch as sct
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.checkpointer import Checkpointer

log = logging.getLogger(__name__)

__all__ = [
    "CKPT_FILE",
    "SlurmCheckpointCallback",
    "SlurmCheckpointIO",
    "lightning_checkpointer",
]

#: The file, inside a step's directory, that holds Lightning's checkpoint dict.
CKPT_FILE = "lightning.ckpt"
#: ``meta.framework`` of the steps written here.
FRAMEWORK = "pytorch_lightning"


def lightning_checkpointer(key: Optional[str] = None, **options: Any) -> Checkpointer:
    """``Checkpointer.from_env()`` as a Lightning job needs it on every rank: one part
    per step (``rank=0, world_size=1``), because Lightning writes the whole state from
    global rank 0 only. Every rank still gets the signal flags and can restore."""
    options.setdefault("rank", 0)
    options.setdefault("world_size", 1)
    return Checkpointer.from_env(key, **options)


class SlurmCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` over a :class:`~slurm_ckpt.Checkpointer` (see the
    module docstring). ``tokens(checkpoint) -> int``, if given, tells the step's token
    count for the manifest and token intervals."""

    def __init__(
        self, ckpt: Checkpointer, tokens: Optional[Callable[[Dict[str, Any]], int]] = None
    ) -> None:
        if ckpt.world_size != 1 or ckpt.rank != 0:
            raise CkptError(
                "SlurmCheckpointIO: Lightning writes each checkpoint whole from global rank "
                "0, so the Checkpointer must have rank=0, world_size=1 on every rank "
                f"(got rank {ckpt.rank} of {ckpt.world_size}; see lightning_checkpointer())"
            )
        self.ckpt = ckpt
        self.tokens = tokens
        #: Set by the callback for the save it asks for: a preemption save or not
        #: (None: the Checkpointer decides from this process's own signal flag).
        self.preemption: Optional[bool] = None
        #: The steps written by this process, newest last.
        self.saved_steps: List[int] = []
        self._torch_io = TorchCheckpointIO()

    # -- Lightning's interface -------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """One step of the Checkpointer, numbered by Lightning's ``global_step``.
        Lightning's ``path`` only names it (``meta.lightning_name``): the bytes live on
        the tiers, not there."""
        if storage_options is not None:
            raise TypeError("SlurmCheckpointIO.save_checkpoint(): storage_options is not supported")
        step = int(checkpoint.get("global_step", 0))
        tokens = None if self.tokens is None else int(self.tokens(checkpoint))
        if self.saved_steps and self.saved_steps[-1] == step:
            # The same step again (ModelCheckpoint's top-k and "last" next to ours, or
            # a preemption right after an interval save): it is written already, and
            # replacing a step whose write or flush is still in flight only fails them.
            # close() flushes the newest step whether or not it was chosen for a flush.
            if self.preemption or (self.preemption is None and self.ckpt.preemption_pending):
                self.ckpt.mark_preemption_saved(step, tokens)
            log.debug("[ckpt] lightning: step %d is saved already (%s)", step, path)
            return
        meta = {
            "framework": FRAMEWORK,
            "lightning_name": os.path.basename(os.fspath(path)),
            "epoch": int(checkpoint.get("epoch", 0)),
        }
        with self.ckpt.output(
            step=step, tokens=tokens, meta=meta, preemption=self.preemption
        ) as out:
            torch.save(checkpoint, out / CKPT_FILE)
        self.saved_steps.append(step)
        log.info("[ckpt] lightning: step %d saved (%s)", step, meta["lightning_name"])

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Optional[Any] = None,
        weights_only: Optional[bool] = None,
    ) -> Dict[str, Any]:
        """Load the checkpoint at ``path``: a directory from :meth:`restore_path` (its
        bytes verified on the way there) or a Lightning checkpoint file."""
        p = Path(os.fspath(path))
        if p.is_dir():
            p = p / CKPT_FILE
        if map_location is None:
            return self._torch_io.load_checkpoint(p, weights_only=weights_only)
        return self._torch_io.load_checkpoint(p, map_location, weights_only)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Nothing is deleted: the retention policy decides which copies go (a
        framework's rotation must not take the only verified copy)."""
        log.debug("[ckpt] lightning: remove_checkpoint(%s) left to the retention policy", path)

    # -- ours ------------------------------------------------------------------------
    def restore_path(self, **kwargs: Any) -> Optional[str]:
        """The Lightning checkpoint file of the newest step that verifies on any tier
        (fetched to the local tier first when needed), for ``fit(ckpt_path=...)``;
        None when there is none. ``kwargs`` as in ``Checkpointer.restore_path``."""
        d = self.ckpt.restore_path(**kwargs)
        if d is None:
            return None
        f = Path(d) / CKPT_FILE
        if not f.is_file():
            raise CkptError(f"{d}: no {CKPT_FILE}: not a Lightning checkpoint of slurm_ckpt")
        return str(f)


class SlurmCheckpointCallback(Callback):
    """Saves at step boundaries when the Checkpointer says so, keeps RNG states, and
    owns signals and requeue next to Lightning's ``SLURMEnvironment`` (see the module
    docstring). ``filename`` names the checkpoints (``{step}`` is filled in)."""

    def __init__(self, io: SlurmCheckpointIO, filename: str = "slurm-ckpt-{step}.ckpt") -> None:
        self.io = io
        self.ckpt = io.ckpt
        self.filename = filename
        #: True once the save answering a preemption signal was taken (on every rank).
        self.preempted = False
        self._last_saved: Optional[int] = None
        self._rng_pending: Optional[List[Any]] = None

    @property
    def state_key(self) -> str:
        return "SlurmCheckpointCallback"

    # -- set-up ----------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_dcp_strategies(trainer)
        if trainer.strategy.checkpoint_io is not self.io:
            raise CkptError(
                "SlurmCheckpointCallback: pass its SlurmCheckpointIO to the Trainer too: "
                "Trainer(plugins=[io], callbacks=[SlurmCheckpointCallback(io)])"
            )
        _quiet_lightning_requeue(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply_rng()
        loader = trainer.train_dataloader
        if loader is not None and not isinstance(loader, _Stateful):
            log.warning(
                "[ckpt] lightning: the train dataloader keeps no state (no state_dict/"
                "load_state_dict, e.g. torchdata's StatefulDataLoader): a resume mid-epoch "
                "trains the rest of that epoch on the loader's first batches again (a new "
                "shuffle if it shuffles), only as many as were left: some samples of that "
                "epoch are seen twice, others not at all"
            )

    # -- when to save ----------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_saved:
            return  # accumulating gradients: no optimizer step since the last save
        warned = self.ckpt.signal_received is not None and not self.preempted
        due = self.ckpt.should_save(step=step) if trainer.is_global_zero else warned
        if trainer.world_size > 1:
            # Everyone saves or no one does (save_checkpoint is collective); a signal on
            # any rank makes it a preemption save.
            due = trainer.strategy.reduce_boolean_decision(due, all=False)
            warned = trainer.strategy.reduce_boolean_decision(warned, all=False)
        if due:
            self._save(trainer, preemption=warned or None)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The end of ``fit()``: the final state is committed through the Checkpointer
        (flushed by ``close()``) even when the interval did not fall on the last step,
        so a finished run never leaves its newest checkpoint steps behind."""
        step = trainer.global_step
        if step > 0 and step != self._last_saved and not self.preempted:
            log.info("[ckpt] lightning: fit ended at step %d: saving the final state", step)
            self._save(trainer, preemption=None)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        """Lightning ends ``fit`` on SIGTERM at a batch boundary: if our check in
        ``on_train_batch_end`` ran before the signal landed, the preemption save is
        taken here (the state is that of the last completed step)."""
        if not isinstance(exception, SIGTERMException) or self.preempted:
            return
        # Also when an interval save just took this very step: the plug-in then only
        # records it as the preemption save (close() flushes the newest step).
        self._save(trainer, preemption=True)

    def _save(self, trainer: Trainer, preemption: Optional[bool]) -> None:
        step = trainer.global_step
        if preemption:
            log.warning("[ckpt] preemption: Lightning saves step %d now and stops", step)
        self.io.preemption = preemption
        try:
            trainer.save_checkpoint(
                os.path.join(trainer.default_root_dir, self.filename.format(step=step)),
                weights_only=False,
            )
        finally:
            self.io.preemption = None
        self._last_saved = step
        if preemption:
            # The job is ending: stop fit cleanly (SIGTERM ends it anyway; a warning
            # signal such as --signal=USR1@300 would not).
            self.preempted = True
            trainer.should_stop = True

    # -- RNG states in the checkpoint ------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Every rank's RNG states (Python, NumPy, torch, CUDA): Lightning keeps none,
        so dropout or augmentation after a resume would draw other numbers."""
        mine = _rng_for_torch_save(sct.capture_rng())
        states = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            states = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(states, mine)
        return {"rng": states}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Kept until ``on_train_start``: Lightning restores callbacks before it builds
        the train dataloader's iterator, which draws a seed from torch's RNG; applied
        here, that draw would shift every random number after the resume."""
        self._rng_pending = state_dict.get("rng") or []

    def _apply_rng(self) -> None:
        states, self._rng_pending = self._rng_pending, None
        if states is None:
            return
        if len(states) != _world():
            log.warning(
                "[ckpt] lightning: checkpoint has the RNG states of %d ranks, this job has "
                "%d: RNG states not restored",
                len(states),
                _world(),
            )
            return
        rank = torch.distributed.get_rank() if _world() > 1 else 0
        sct.apply_rng(states[rank])


def _world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _rng_for_torch_save(rng: Dict[str, Any]) -> Dict[str, Any]:
    """NumPy's key array as a tensor: Lightning loads with ``weights_only`` (no NumPy)."""
    nps = rng.get("numpy")
    if nps is not None:
        nps["keys"] = torch.from_numpy(nps["keys"].astype("int64"))
    return rng


def _refuse_dcp_strategies(trainer: Trainer) -> None:
    """FSDP and ModelParallel save through ``torch.distributed.checkpoint`` and never
    call CheckpointIO: refusing is better than protecting nothing."""
    from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
        name = type(trainer.strategy).__name__
        raise CkptError(
            f"SlurmCheckpointCallback: {name} saves sharded state with "
            "torch.distributed.checkpoint, not CheckpointIO: save it with "
            "dcp.save(state, storage_writer=ckpt.dcp_writer(step=...)) (slurm_ckpt.dcp; "
            "docs/lightning.md shows how)"
        )


def _quiet_lightning_requeue(trainer: Trainer) -> None:
    """Keep Lightning's SLURM auto-requeue (a save inside its SIGUSR1 handler, then its
    own ``scontrol requeue``) from ever running, through Lightning's public API only.

    A parallel strategy (DDP) holds the cluster environment Lightning's signal connector
    consults (``strategy.cluster_environment``): its ``auto_requeue`` is switched off
    here, before Lightning registers its handlers. A single-device strategy has no
    public door to the environment Lightning detected; there Lightning installs its
    SIGUSR1 handler only where none is installed yet, so the Checkpointer (built before
    the Trainer) holding SIGUSR1 keeps it off, and a warning says when it does not."""
    env = getattr(trainer.strategy, "cluster_environment", None)
    if isinstance(env, SLURMEnvironment):
        if env.auto_requeue:
            env.auto_requeue = False
            log.warning(
                "[ckpt] lightning: SLURMEnvironment auto-requeue switched off: slurm_ckpt "
                "saves at the next step boundary and owns requeue"
            )
        return
    if env is not None or not SLURMEnvironment.detect() or TorchElasticEnvironment.detect():
        return  # not Lightning's SLURM environment: no auto-requeue to keep off
    if signal.getsignal(signal.SIGUSR1) not in (None, signal.SIG_DFL):
        log.warning(
            "[ckpt] lightning: SLURMEnvironment auto-requeue switched off: slurm_ckpt "
            "holds SIGUSR1 (Lightning installs no handler over it), saves at the next "
            "step boundary and owns requeue"
        )
        return
    log.warning(
        "[ckpt] lightning: SIGUSR1 is not held by the Checkpointer (install_signals=False "
        "or signals= without it): Lightning's auto-requeue would save inside its signal "
        "handler and requeue; pass Trainer(plugins=[..., SLURMEnvironment(auto_requeue=False)])"
    )
