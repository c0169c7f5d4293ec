"""The background read of everything but the weights, after a weights-first restore.

:meth:`Restorer.restore(weights_only=True) <slurm_ckpt.job.restore.Restorer.restore>`
hands the weights out as soon as they verify; this reads the rest of the same step on a
thread meanwhile, and :meth:`~slurm_ckpt.job.restore.Restorer.restore_rest` collects it.
Apart from the Restorer because it is its own concept: one read in flight, cancellable.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional

from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.errors import TierError, VerifyError
from slurm_ckpt.job.state import GROUP_REST, GROUP_WEIGHTS
from slurm_ckpt.job.state_reader import StateReader
from slurm_ckpt.tiers.base import Tier

__all__ = ["RestLoad"]


class RestLoad:
    """The background read of everything but the weights (weights-first restore)."""

    def __init__(self, reader: StateReader, tier: Tier, manifest: Manifest, where: str):
        self.reader, self.tier, self.manifest, self.where = reader, tier, manifest, where
        self.t0 = time.monotonic()
        self._stop = False
        self._bufs: Optional[Dict[str, Any]] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="ckpt-restore-rest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._bufs = self.reader.read(
                self.reader.blobs([GROUP_REST]), cancelled=lambda: self._stop
            )
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc
        finally:
            self.reader.close()

    def cancel(self) -> None:
        self._stop = True
        self._thread.join()
        self._bufs = None

    def same_weights(self, other: Manifest) -> bool:
        """Whether ``other`` (another tier's manifest of this step) has the same index and
        weight blobs, byte for byte (equal content hashes)."""
        mine = {f.path: f.hash for f in self.manifest.files}
        theirs = {f.path: f.hash for f in other.files}
        pre = f"{self.reader.prefix}/" if self.reader.prefix else ""
        names = [f"{pre}index.json"] + [f"{pre}{n}" for n in self.reader.blobs([GROUP_WEIGHTS])]
        return all(n in theirs and mine.get(n) == theirs[n] for n in names)

    def result(self, restorer: Any) -> Any:
        self._thread.join()
        if self._error is not None:
            if isinstance(self._error, (VerifyError, TierError)):
                raise self._error
            raise VerifyError(f"{self.where}: reading the rest failed: {self._error}")
        assert self._bufs is not None
        state = self.reader.build(self._bufs, [GROUP_REST])
        self._bufs = None
        return restorer.restored(self.tier, self.manifest, state, self.t0, True)
