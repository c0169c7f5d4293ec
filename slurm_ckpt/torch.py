"""PyTorch training state <-> the toolkit's pickle-free state tree, restored bit for bit.

Why this module exists
----------------------
The job layer stores a nested dict whose leaves are tensors, numpy arrays, bytes or
JSON values (raw tensor bytes plus a JSON index, no pickle: a checkpoint must never be
able to run code when it is loaded, and must stay readable without the classes that
wrote it). A PyTorch training job's state is not shaped like that: optimizer state is
keyed by ``int``, ``param_groups`` hold tuples (``betas``), schedulers hold ``inf``
(``ReduceLROnPlateau``) or nested scheduler states, RNG states are tuples of Python
ints. :func:`capture` turns all of it into such a tree and :func:`apply` turns it back,
*exactly* - same values, same key types, same RNG streams - so a job resumed from a
checkpoint continues the very same trajectory (bitwise equal weights to an uninterrupted
run, which ``tests/test_torch_resume.py`` checks).

Layout of the tree (top-level keys)::

    model          {param/buffer name: tensor}      (first: weights can be restored alone)
    optimizer      {"state": {"0": {...}}, "param_groups": [...]}
    scheduler      the LR scheduler's state_dict (JSON-able parts)
    scaler         the GradScaler's state_dict
    rng            {"python": ..., "numpy": ..., "torch": tensor, "cuda": {"0": tensor}}
    data_position  the caller's dict (sampler epoch/index, tokens seen, ...)
    data_loader    the data loader's position (:mod:`slurm_ckpt.torch_data`)
    extra          anything else the caller wants kept (same value rules)
    torch_format   {"name": "slurm_ckpt.torch", "version": 1}

Values that have no exact JSON form are wrapped in small tagged dicts
(``{"__sc__": "tuple", "v": [...]}``, ``{"__sc__": "float", "v": "inf"}``, int-keyed
dicts, lists holding tensors) so the round trip is lossless; anything that could only be
saved by pickling (a lambda, a bound method, an arbitrary object) is refused with a
one-line :class:`UnsupportedState` naming where it was found.

Only this module, :mod:`slurm_ckpt.torch_state` (capture/apply), :mod:`slurm_ckpt.torch_data`
(the data loader's position) and :mod:`slurm_ckpt.torch_codec` (the value encoding) import
torch at module level; nothing below them may.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.dist import all_reduce_ints, process_group
from slurm_ckpt.job.recovery import Recovery as Recovery
from slurm_ckpt.job.recovery import RecoveryFailed as RecoveryFailed
from slurm_ckpt.job.spare_prep import Prebuilt as Prebuilt
from slurm_ckpt.torch_codec import UnsupportedState as UnsupportedState
from slurm_ckpt.torch_codec import decode as decode
from slurm_ckpt.torch_codec import encode as encode
from slurm_ckpt.torch_data import capture_loader, data_version
from slurm_ckpt.torch_state import FORMAT_NAME as FORMAT_NAME
from slurm_ckpt.torch_state import FORMAT_VERSION as FORMAT_VERSION
from slurm_ckpt.torch_state import apply as apply
from slurm_ckpt.torch_state import apply_model as apply_model
from slurm_ckpt.torch_state import apply_rng as apply_rng
from slurm_ckpt.torch_state import capture as capture
from slurm_ckpt.torch_state import capture_rng as capture_rng
from slurm_ckpt.torch_state import state_digest as state_digest

# The public API: one way in (TorchCheckpointer, for one rank and many), the two halves
# it is built on, and two helpers. The pieces (capture_rng, apply_model, the codec's
# encode/decode, the module-level save/restore) stay importable for tests and tools.
__all__ = [
    "Prebuilt",
    "Recovery",
    "RecoveryFailed",
    "Resumed",
    "ShardState",
    "TorchCheckpointer",
    "apply",
    "capture",
    "data_version",
    "recovery",
    "state_digest",
]


def recovery(
    directory: Optional[str] = None,
    *,
    timeout_s: float = 30.0,
    deadline_s: float = 300.0,
    wait_copy: bool = True,
    prepare: Optional[Callable[[], Any]] = None,
) -> Recovery:
    """In-job recovery (docs/in-job-recovery.md): join the job's membership and form the
    gloo process group with a ``timeout_s`` collective timeout. A hot spare
    (``SLURM_CKPT_SPARE=1``) waits here until it takes a lost rank's place (or exits 0
    when the job ends). Then::

        rec = slurm_ckpt.torch.recovery()            # rec.rank, rec.world_size, rec.group
        tc = TorchCheckpointer(Checkpointer.from_env(ram=RamOptions(every=1, keep=2),
                                                     partner=True), model, opt)
        def rebuild(group):                          # the one place that wraps the model
            global ddp
            ddp = DistributedDataParallel(model, process_group=group)
        rec.run(tc, train_step, total_steps, on_reform=rebuild)

    ``train_step(step)`` runs one step; a collective that fails in it (a rank lost) is
    recovered from inside the job: the survivors keep their processes, a spare takes
    the lost rank, every rank restores the newest step all hold, and ``run`` goes on
    from there. :class:`RecoveryFailed` when that cannot be done (fall back to a
    relaunch). ``prepare``: what a hot spare builds while it waits, before it knows
    its rank; pass ``lambda: Prebuilt(partner=True, ram=...)``
    (:class:`slurm_ckpt.job.spare_prep.Prebuilt`) and take the Checkpointer from
    ``rec.prepared.checkpointer()``: a recovery then waits for no Checkpointer's build."""
    return Recovery(
        directory,
        timeout_s=timeout_s,
        deadline_s=deadline_s,
        wait_copy=wait_copy,
        prepare=prepare,
    ).join()


class ShardState:
    """FSDP2's door to the RAM tier and to in-job recovery: each rank's own shards (the
    local part of every DTensor of the model and of the optimizer state) as the state
    tree of ``Checkpointer.ram_save``, put back in place at a restore.

    Why its own door: a sharded model's rank holds a part no other rank has, so after a
    loss the spare must take exactly that part from the partner's RAM copy, with no
    gather (:class:`TorchCheckpointer` takes a whole model's plain tensors). Use it as
    ``rec.run(ShardState(ckpt), ...)``, and in ``on_reform``, after ``fully_shard`` and
    the new optimizer, call :meth:`bind`. The optimizer's state must exist before a
    restore (make the momentum buffers, zero, as the first step would): the restore
    writes into it, it does not create it. The same world size and mesh: a re-shard
    goes through the DCP door instead (docs/dcp.md).
    """

    def __init__(self, ckpt: Any, model: Any = None, optimizer: Any = None) -> None:
        self.ckpt = ckpt
        self.model = model
        self.opt = optimizer

    def bind(self, model: Any, optimizer: Any) -> None:
        """The model and optimizer of the new group (after every re-form)."""
        self.model, self.opt = model, optimizer

    def _tree(self) -> Dict[str, Any]:
        if self.model is None or self.opt is None:
            raise CkptError(
                "ShardState: no model bound: call bind(model, optimizer) in on_reform, "
                "after fully_shard"
            )
        tree: Dict[str, Any] = {"model": {}, "opt": {}}
        for name, p in self.model.named_parameters():
            tree["model"][name] = _local(p)
            for k, v in self.opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    tree["opt"][f"{name}.{k}"] = _local(v)
        return tree

    def ram_save(self, step: int) -> bool:
        """This rank's shards into the RAM tier (``Checkpointer.ram_save``)."""
        return bool(self.ckpt.ram_save(self._tree, step=step))

    def restore(self) -> Any:
        """The newest step every rank holds, copied into the bound model's and
        optimizer's shards; None when there is none. What the Checkpointer's restore
        returned (``step``, ``tier``)."""
        got = self.ckpt.restore()
        if got is None:
            return None
        mine = self._tree()
        with torch.no_grad():
            for group in ("model", "opt"):
                for name, t in mine[group].items():
                    saved = got.state.get(group, {}).get(name)
                    if saved is None:
                        raise CkptError(
                            f"ShardState: step {got.step} ({got.tier}) has no {group} "
                            f"shard {name!r}: another model or optimizer"
                        )
                    t.copy_(saved)
        return got


def _local(t: Any) -> Any:
    """A DTensor's local shard (a plain tensor stays as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class Resumed:
    """What a restore put back: where training resumes, and where it came from."""

    step: int
    tokens: Optional[int]
    tier: str
    data_position: Optional[Dict[str, Any]]
    extra: Optional[Dict[str, Any]] = None
    #: seconds from the start of the restore until the weights were in the model
    weights_s: float = 0.0
    #: seconds for the whole restore (read + verify + apply)
    seconds: float = 0.0
    meta: Dict[str, Any] = field(default_factory=dict)
    #: The data version the checkpoint was trained on (None when it recorded none).
    data_version: Optional[str] = None


def save(
    ckpt: Any,
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[Any] = None,
    *,
    step: int,
    tokens: Optional[int] = None,
    data_position: Optional[Mapping[str, Any]] = None,
    extra: Optional[Mapping[str, Any]] = None,
    rng: bool = True,
    data_version: Optional[str] = None,
    loader: Optional[Any] = None,
    lazy: Any = False,
) -> Any:
    """``ckpt.save(capture(...), step=, tokens=)``: returns once the snapshot is taken (the
    job layer copies every tensor before returning), so training may go on at once.
    ``data_version`` (see :func:`data_version`) is recorded in the manifest. ``lazy``
    (a predicate over tensors) defers their copy: see :class:`TorchCheckpointer`, which
    makes the optimizer wait for it."""
    state = capture(
        model, optimizer, scheduler, scaler, data_position, extra, rng=rng, loader=loader
    )
    kw: Dict[str, Any] = {}
    if data_version is not None:
        kw["data_version"] = data_version
    if lazy:
        kw["lazy"] = lazy
    return ckpt.save(state, step=step, tokens=tokens, **kw)


def restore(
    ckpt: Any,
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[Any] = None,
    *,
    weights_first: bool = False,
    rng: bool = True,
    strict: bool = True,
    expect_data_version: Optional[str] = None,
    on_data_change: str = "warn",
    loader: Optional[Any] = None,
    replicas: Any = None,
) -> Optional[Resumed]:
    """Restore the newest complete, verified checkpoint into the given objects.

    Under torch.distributed the job layer makes every rank agree on one step (a min
    all-reduce of each rank's newest verified step, repeated until all hold it), so all
    ranks resume together; each rank loads its own shard. With ``weights_first`` the
    weights are read, verified and loaded into the model while the optimizer state is
    still being read; if that then fails verification, an older step is loaded whole
    (weights again included) and reported. Returns None when there is no checkpoint
    (every rank then starts fresh).

    ``replicas=True`` (data parallelism: every rank holds the same state) or a process
    group of such ranks: the checkpoint is read once by the group, each rank reading a
    stripe and receiving the rest, verified (``Checkpointer.restore``).
    """
    t0 = time.monotonic()
    kw: Dict[str, Any] = {}
    if expect_data_version is not None:  # warn, or refuse before anything is read
        kw = {"expect_data_version": expect_data_version, "on_data_change": on_data_change}
    if replicas is not None:
        kw["replicas"] = replicas
    got = ckpt.restore(weights_only=bool(weights_first and model is not None), **kw)
    if got is None:
        return None
    weights_s = 0.0
    if getattr(got, "partial", False):
        apply_model(got.state, model, strict=strict)  # type: ignore[arg-type]
        weights_s = time.monotonic() - t0
        rest = ckpt.restore_rest()
        state: Dict[str, Any] = dict(rest.state)
        if getattr(rest, "rolled_back", False):
            # the rest of that step was corrupt: an older step came back whole
            apply_model(state, model, strict=strict)  # type: ignore[arg-type]
            weights_s = time.monotonic() - t0
            got = rest
        pos = apply(
            state, None, optimizer, scheduler, scaler, rng=rng, strict=strict, loader=loader
        )
    else:
        state = got.state
        if model is not None:
            apply_model(state, model, strict=strict)
            weights_s = time.monotonic() - t0
        pos = apply(
            state, None, optimizer, scheduler, scaler, rng=rng, strict=strict, loader=loader
        )
    extra = state.get("extra")
    return Resumed(
        step=got.step,
        tokens=got.tokens,
        tier=got.tier,
        data_position=pos,
        extra=None if extra is None else decode(extra),
        weights_s=weights_s,
        seconds=time.monotonic() - t0,
        meta=dict(getattr(got, "meta", {}) or {}),
        data_version=(getattr(got, "meta", {}) or {}).get("data_version"),
    )


def _check_args(ckpt: Any, model: Any, optimizer: Any) -> None:
    """One line naming the argument for the usual mix-ups (swapped or repeated
    arguments), instead of an AttributeError at the first save, or none at all."""
    from slurm_ckpt.errors import CkptError

    if isinstance(ckpt, torch.nn.Module) or not hasattr(ckpt, "save"):
        raise CkptError(
            f"TorchCheckpointer: the first argument is the Checkpointer, not a "
            f"{type(ckpt).__name__}: TorchCheckpointer(ckpt, model, optimizer, ...)"
        )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise CkptError(
            f"TorchCheckpointer: model= must be a torch.nn.Module, not {type(model).__name__}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CkptError(
            "TorchCheckpointer: optimizer= must be a torch.optim.Optimizer, not "
            f"{type(optimizer).__name__} (the order is ckpt, model, optimizer, scheduler)"
        )


class TorchCheckpointer:
    """The one way to checkpoint a PyTorch job: a Checkpointer bound to the model, the
    optimizer, the scheduler, the scaler and the data loader, consistent across ranks.

    ::

        tc = TorchCheckpointer.from_env(model=model, optimizer=opt, scheduler=sched,
                                        loader=loader, interval_steps=500)
        # standalone (a laptop needs only local=):
        #   TorchCheckpointer(Checkpointer(local="/tmp/ckpt", key="run"), model, opt, ...)
        got = tc.restore()                  # None: a fresh start; else .step, .tokens ...
        for batch in loader:
            ...
            if tc.should_save(step=step, tokens=tokens):
                tc.save(step=step, tokens=tokens)
            if tc.preempted:
                break
        tc.close()

    Why a wrapper: under data parallelism every rank must take the same decision at the
    same step boundary. A preemption signal reaches the ranks at slightly different
    moments, and ``interval_seconds`` is measured per process; if rank 0 saved and left
    at step 100 while rank 1 went on to step 101, rank 1 would hang (or crash) in the
    next gradient all-reduce and the two shards would hold different steps. So here
    :meth:`should_save` combines the ranks' answers with one tiny all-reduce (MAX of
    "wants to save" and "got a signal") per step: all ranks save at the same step, and
    once any rank got a signal all of them stop after that save (:attr:`preempted`).
    Without torch.distributed it is a plain pass-through: the same code serves one rank.

    ``loader``: its position is saved and restored (see :func:`capture`), so a resume
    mid-epoch continues at the same sample with the same worker seeds.

    **Lazy snapshot** (``lazy=True``, the default when an optimizer is given):
    :meth:`save` returns before the parameters and the optimizer state are copied; the
    copy runs during the next forward and backward pass, and the next
    ``optimizer.step()`` (or a ``load_state_dict`` of the model or optimizer) waits for
    it through pre-hooks registered here. The checkpoint holds exactly the values at
    :meth:`save`; an in-place write that bypasses those paths is detected by the
    tensors' version counters and the checkpoint is refused (``p.data`` writes are not
    seen: call :meth:`wait_snapshot` first). See :mod:`slurm_ckpt.job.lazy`.
    """

    def __init__(
        self,
        ckpt: Any,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Optional[Any] = None,
        scaler: Optional[Any] = None,
        *,
        loader: Optional[Any] = None,
        rng: bool = True,
        lazy: Optional[bool] = None,
    ) -> None:
        _check_args(ckpt, model, optimizer)
        self.ckpt = ckpt
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.loader = loader
        if loader is not None:
            capture_loader(loader)  # at once: the warning about a plain DataLoader, or the error
        self.rng = rng
        self._peer_signal = False
        self._saved_after_signal = False
        self.last_save: Any = None
        self.lazy = (optimizer is not None) if lazy is None else bool(lazy)
        if self.lazy and optimizer is None:
            raise ValueError("TorchCheckpointer(lazy=True) needs the optimizer, whose step waits")
        self._hooks: List[Any] = []
        if self.lazy:
            wait = self._wait_hook
            self._hooks.append(optimizer.register_step_pre_hook(wait))
            self._hooks.append(optimizer.register_load_state_dict_pre_hook(wait))
            if model is not None:
                self._hooks.append(model.register_load_state_dict_pre_hook(wait))

    def _wait_hook(self, *_args: Any, **_kwargs: Any) -> None:
        self.ckpt.wait_snapshot()

    def wait_snapshot(self) -> float:
        """Wait for the newest save's background copy; returns the seconds waited."""
        return float(self.ckpt.wait_snapshot())

    def _guarded(self) -> Callable[[Any], bool]:
        """The tensors whose only writers wait for the drain: the model's parameters and
        the optimizer's state (by storage, since ``state_dict()`` hands out detached
        views of them)."""
        ptrs = set()
        if self.model is not None:
            ptrs.update(p.untyped_storage().data_ptr() for p in self.model.parameters())
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        ptrs.add(v.untyped_storage().data_ptr())

        def pred(t: Any) -> bool:
            return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in ptrs

        return pred

    @classmethod
    def from_env(
        cls,
        key: Optional[str] = None,
        *,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Optional[Any] = None,
        scaler: Optional[Any] = None,
        loader: Optional[Any] = None,
        rng: bool = True,
        **options: Any,
    ) -> TorchCheckpointer:
        """``Checkpointer.from_env(key, **options)`` (site config, SLURM job, ckpt-srun's
        signal) bound to these objects."""
        from slurm_ckpt.job.checkpointer import Checkpointer

        ckpt = Checkpointer.from_env(key, **options)
        return cls(ckpt, model, optimizer, scheduler, scaler, loader=loader, rng=rng)

    @property
    def rank(self) -> int:
        return int(self.ckpt.rank)

    @property
    def world_size(self) -> int:
        return int(self.ckpt.world_size)

    @property
    def stats(self) -> Any:
        return self.ckpt.stats

    def restore(
        self,
        weights_first: bool = False,
        strict: bool = True,
        expect_data_version: Optional[str] = None,
        on_data_change: str = "warn",
        replicas: Any = None,
    ) -> Optional[Resumed]:
        """The newest step every rank holds verified, put back into the bound objects
        (None: no checkpoint, every rank starts fresh). ``replicas``: read once by the
        ranks that hold the same state (``True`` for DDP; see :func:`restore`)."""
        return restore(
            self.ckpt,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            weights_first=weights_first,
            rng=self.rng,
            strict=strict,
            expect_data_version=expect_data_version,
            on_data_change=on_data_change,
            loader=self.loader,
            replicas=replicas,
        )

    def should_save(self, step: Optional[int] = None, tokens: Optional[int] = None) -> bool:
        """True on every rank at once when any rank's interval is due or any rank got a
        preemption signal."""
        want = bool(self.ckpt.should_save(step=step, tokens=tokens))
        if process_group() is None:
            return want
        signalled = self.ckpt.signal_received is not None
        want_any, signal_any = (bool(x) for x in all_reduce_ints([want, signalled], "max"))
        if signal_any:
            self._peer_signal = True
        return want_any or signal_any

    def save(
        self,
        step: int,
        tokens: Optional[int] = None,
        data_position: Optional[Mapping[str, Any]] = None,
        extra: Optional[Mapping[str, Any]] = None,
        data_version: Optional[str] = None,
    ) -> Any:
        """Snapshot the bound objects (and the loader's position); returns the frozen
        ``slurm_ckpt.Saved`` once the snapshot is taken."""
        self.last_save = save(
            self.ckpt,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            step=step,
            tokens=tokens,
            data_position=data_position,
            extra=extra,
            rng=self.rng,
            data_version=data_version,
            lazy=self._guarded() if self.lazy else False,
            loader=self.loader,
        )
        if self._peer_signal:
            self._saved_after_signal = True
        return self.last_save

    def ram_save(self, step: int, tokens: Optional[int] = None, force: bool = False) -> bool:
        """Call after every optimizer step with the RAM tier on (``Checkpointer(ram=...)``,
        docs/in-job-recovery.md): the bound objects go into host memory (and the
        partner's) when the RAM tier's interval is due; they are captured only then.
        Returns whether a snapshot was taken."""

        def state() -> Any:
            return capture(
                self.model,
                self.optimizer,
                self.scheduler,
                self.scaler,
                None,
                None,
                rng=self.rng,
                loader=self.loader,
            )

        return bool(self.ckpt.ram_save(state, step=step, tokens=tokens, force=force))

    @property
    def preempted(self) -> bool:
        """True once the state was saved after a preemption signal (on any rank)."""
        return bool(self.ckpt.preempted) or self._saved_after_signal

    def wait(self, flush: bool = True, timeout: Optional[float] = None) -> bool:
        return bool(self.ckpt.wait(flush=flush, timeout=timeout))

    def close(self) -> Any:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return self.ckpt.close()

    def __enter__(self) -> TorchCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
