"""SLURM's command-line tools, as a directory of small scripts, for the suite's tests of
what root *asks* SLURM (the machine running the suite has no SLURM).

The real :class:`~slurm_ckpt.slurm.client.SlurmClient` is pointed at the directory
(``path=``) and runs the scripts as it runs ``scontrol`` and ``squeue`` on a cluster: a
process per call, an argument vector, a timeout. Each call costs what a call to a real
controller costs (``latency``, default 20 ms: 400 ``scontrol show node`` calls took
8.7 s on the dev cluster) and is logged (``calls``), so that a test can tell how many
queries root made and what they named. What SLURM knows is a table of nodes
(``set_node``); ``scontrol update`` calls (drains, resumes) are logged (``updates``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

from slurm_ckpt.slurm.client import SlurmClient

_SCONTROL = r"""#!/bin/sh
PATH=/usr/bin:/bin
D=$(dirname "$0")
echo "scontrol $*" >> "$D/calls.log"
sleep {latency}
if [ "$1" = show ] && [ "$2" = node ]; then
  if [ -n "$4" ]; then
    line=$(grep -F "NodeName=$4 " "$D/nodes")
    if [ -z "$line" ]; then echo "scontrol: error: Node $4 not found" >&2; exit 1; fi
    echo "$line"
    exit 0
  fi
  cat "$D/nodes"
  exit 0
fi
if [ "$1" = update ]; then echo "$*" >> "$D/updates.log"; exit 0; fi
if [ "$1" = --version ]; then echo "slurm 22.05.8"; exit 0; fi
echo "scontrol: error: unsupported here: $*" >&2
exit 1
"""

_SQUEUE = r"""#!/bin/sh
PATH=/usr/bin:/bin
D=$(dirname "$0")
echo "squeue $*" >> "$D/calls.log"
sleep {latency}
exit 0
"""


class FakeSlurm:
    """A directory of SLURM tools (see the module docstring); ``client()`` is the real
    client using them."""

    def __init__(self, base: Path, latency: float = 0.02) -> None:
        self.dir = base / "slurm-bin"
        self.dir.mkdir()
        for name, text in (("scontrol", _SCONTROL), ("squeue", _SQUEUE)):
            p = self.dir / name
            p.write_text(text.replace("{latency}", f"{latency:g}"))
            os.chmod(p, 0o755)
        self.table: Dict[str, str] = {}
        for name in ("calls.log", "updates.log"):
            (self.dir / name).write_text("")
        self._write()

    def set_node(self, name: str, state: str = "IDLE") -> None:
        self.table[name] = state
        self._write()

    def _write(self) -> None:
        lines = [
            f"NodeName={n} Arch=x86_64 State={s} Partitions=low" for n, s in self.table.items()
        ]
        (self.dir / "nodes").write_text("".join(line + "\n" for line in lines))

    def client(self) -> SlurmClient:
        return SlurmClient(backend="cli", path=str(self.dir), timeout=30)

    @property
    def calls(self) -> List[str]:
        return (self.dir / "calls.log").read_text().splitlines()

    @property
    def updates(self) -> List[str]:
        return (self.dir / "updates.log").read_text().splitlines()

    @property
    def drains(self) -> List[str]:
        return [u for u in self.updates if "state=drain" in u]
