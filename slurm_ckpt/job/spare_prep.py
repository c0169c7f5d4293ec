"""What a hot spare builds while it waits: the rank-independent part of its Checkpointer.

Why: a spare learns its rank only when a node is lost, and everything it builds after
that is time the survivors spend waiting in the re-form. Measured on the loaded dev
cluster, building the Checkpointer and the model wrapping after the rank was known cost
seconds per recovery: imports (the first optimizer's ``torch._dynamo``, 2.2 s on an idle
core; FSDP2's ``fully_shard``, most of a second), the site configuration read and
validated, the tiers opened and their owner checked. None of that depends on the rank,
so :class:`Prebuilt` does it up front (:meth:`slurm_ckpt.job.recovery.Recovery.join`
calls it while the spare waits), and :meth:`Prebuilt.checkpointer` then only binds the
identity (rank, world size, series key: the lease, the partner link of the epoch and the
RAM tier, which are the rank's).

The same object serves a training rank (it builds it before its own join), so a script
has one code path whether it starts as a rank or as a spare.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from typing import Any, Dict, Optional, Sequence

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import current_user, validate_user
from slurm_ckpt.errors import TierError
from slurm_ckpt.job.checkpointer import Checkpointer
from slurm_ckpt.job.options import Options
from slurm_ckpt.job.owed import PathLike, load_job_config
from slurm_ckpt.tiers.registry import tiers_from_config

__all__ = ["RESTORE_IMPORTS", "TORCH_IMPORTS", "Prebuilt"]

log = logging.getLogger(__name__)

#: Modules a restore after a re-form needs and nothing imports before it.
RESTORE_IMPORTS = ("slurm_ckpt.job.replica_restore",)
#: What torch imports on first use, where the process has torch: the first optimizer a
#: process builds imports ``torch._dynamo`` (800 modules, sympy among them: 2.2 s on an
#: idle core here, torch 2.13; on the loaded dev cluster most of the DDP spare's setup
#: after it took its rank).
TORCH_IMPORTS = ("torch._dynamo",)


class Prebuilt:
    """The rank-independent part of a ``Checkpointer.from_env(**kwargs)``, built now.

    ``imports``: more modules to import now (``"torch.distributed.fsdp"`` for a script
    that applies ``fully_shard`` in its ``on_reform``). ``config_path`` and ``kwargs``:
    those of :meth:`Checkpointer.from_env` (validated here: a misspelt option fails at
    the spare's start, not at the recovery). ``seconds``: what building took.
    """

    def __init__(
        self,
        *,
        config_path: Optional[PathLike] = None,
        config: Optional[Config] = None,
        imports: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        t0 = time.monotonic()
        Options.from_kwargs(dict(kwargs))
        first_use = TORCH_IMPORTS if "torch" in sys.modules else ()
        for name in (*RESTORE_IMPORTS, *first_use, *imports):
            importlib.import_module(name)
        self.config = config if config is not None else load_job_config(config_path)
        self.kwargs: Dict[str, Any] = dict(kwargs)
        # Open the tiers once and check their owner: the mounts' metadata is then warm,
        # and a tier that cannot be used is said before the spare is needed.
        user = validate_user(kwargs.get("user") or current_user())
        for name, tier in tiers_from_config(self.config).items():
            try:
                tier.check_user(user)
            except TierError as exc:
                log.warning("[ckpt] hot spare: tier %s not usable now: %s", name, exc)
        self.seconds = time.monotonic() - t0

    def checkpointer(self, key: Optional[str] = None, **more: Any) -> Checkpointer:
        """The Checkpointer of the rank this process now holds (``RANK``/``WORLD_SIZE``
        set by the join): the prebuilt configuration and options, plus ``more``."""
        return Checkpointer.from_env(key, config=self.config, **{**self.kwargs, **more})
