"""Children of root's processes that must not outlive their parent.

Why: root forks helpers (a copy child as the user, a slot's lease renewer). A helper
whose parent was killed must die too - a renewer left running would hold a PFS slot
forever, a copy child would go on writing for no one. Linux kills such a child when the
parent dies if it asked for it with ``prctl(PR_SET_PDEATHSIG)``; the request is cleared
by a change of credentials, so a child that drops privileges asks again afterwards.
"""

from __future__ import annotations

import ctypes
import signal

__all__ = ["set_pdeathsig"]

_PR_SET_PDEATHSIG = 1


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (a no-op where
    ``prctl`` is missing). Callers check ``os.getppid()`` afterwards: a parent that died
    before the call is not covered."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
