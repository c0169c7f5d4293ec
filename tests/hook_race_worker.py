"""Child process of test_hook_race: one node's real hooks, run as root on request.

    python hook_race_worker.py          # then one JSON request per line on stdin

A request is ``{"hook": "epilog"|"stager", "cfg": {...}, "node": NAME, "nodes": [...],
"job": ID, "user": NAME, "slurm": "none"|"failing", "pause": LABEL, "pause_file": PATH}``.
The hook runs with that node's config, exactly as slurmd (epilog) or the stager daemon
would run it; its children (the copies, as the owning user) are forked from here. With
``pause``, the first crash point of that label that each child reaches is a pause
(:mod:`slurm_ckpt.core.faults`: ``<pause_file>.paused``, then wait for ``.go``), so the
test lets the other node's hook run while this one stands at a known point of its copy.
One JSON line answers each request: what the hook did, or the error it raised.

The process stays up for every round of a test (importing the package once, not once a
round), so a round costs the hooks' own work only.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Dict, List, Optional

from slurm_ckpt.core import faults
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import user_ids
from slurm_ckpt.errors import SlurmError
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.slurm.env import HookEnv
from slurm_ckpt.slurm.records import NodeInfo


class FailingSlurm:
    """A SLURM whose every query fails (slurmctld overloaded or unreachable): the hooks
    must then flush a partner copy rather than risk it (both nodes do, at once)."""

    def _fail(self, *_a: Any, **_kw: Any) -> Any:
        raise SlurmError("slurmctld: Socket timed out on send/recv operation")

    node_table = jobs_on_node = drain = resume_if_ours = job = _fail

    def node(self, name: str) -> NodeInfo:
        return self._fail(name)


def _run(req: Dict[str, Any]) -> Dict[str, Any]:
    faults._PAUSE_AT = req.get("pause") or ""
    faults._paused = False
    if req.get("pause_file"):
        os.environ["SLURM_CKPT_PAUSE_FILE"] = req["pause_file"]
    else:
        os.environ.pop("SLURM_CKPT_PAUSE_FILE", None)
    cfg = Config.from_dict(req["cfg"])
    client = FailingSlurm() if req.get("slurm") == "failing" else None
    results: List[List[Any]] = []
    drained: Optional[str] = None
    if req["hook"] == "epilog":
        u = user_ids(req["user"])
        env = HookEnv(req["job"], u.name, u.uid, u.gid, req["node"], req["nodes"], 0)
        rep = run_epilog(cfg, env, client)  # type: ignore[arg-type]
        flush, line, backlog, drained = rep.flush, rep.line(), rep.backlog[0], rep.drained
    else:
        srep = stager_pass(cfg, req["node"], client)  # type: ignore[arg-type]
        flush, line, backlog = srep.flush, srep.line(), srep.backlog
    for r in flush.results:
        results.append([list(r.ident), str(r.status.value), r.error or ""])
    return {
        "line": line,
        "results": results,
        "failed": len(flush.failed),
        "backlog": backlog,
        "drained": drained,
    }


def main() -> int:
    for raw in sys.stdin:
        try:
            out = _run(json.loads(raw))
        except Exception as exc:  # noqa: BLE001 - the test shows it, whatever it is
            out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
