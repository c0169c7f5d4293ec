"""The Checkpointer is a composed facade (issue 32): a plain class whose public methods
delegate to small objects over the typed JobContext, none of which sees the facade."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from slurm_ckpt import Checkpointer
from slurm_ckpt.job.closing import Closing
from slurm_ckpt.job.ram_methods import RamDoor
from slurm_ckpt.job.restoring import Restoring
from slurm_ckpt.job.saving import Saving
from slurm_ckpt.job.seams import Seams

REPO = Path(__file__).resolve().parents[1]
PARTS = (Saving, Restoring, Closing, Seams, RamDoor)


def test_the_checkpointer_inherits_nothing() -> None:
    assert Checkpointer.__bases__ == (object,)


def test_no_part_imports_the_facade_or_takes_it() -> None:
    importers = []
    for path in sorted((REPO / "slurm_ckpt" / "job").glob("*.py")):
        # spare_prep builds Checkpointers for a hot spare (a factory above the facade,
        # issue 30), it is not one of the facade's parts.
        if path.name in ("checkpointer.py", "__init__.py", "spare_prep.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "slurm_ckpt.job.checkpointer":
                importers.append(path.name)
    assert importers == []
    for part in PARTS:
        params = inspect.signature(part.__init__).parameters
        assert "ckpt" not in params and "checkpointer" not in params, part.__name__


def test_each_delegating_method_shows_its_parts_docstring() -> None:
    shown = 0
    for name, member in vars(Checkpointer).items():
        if name.startswith("_"):
            continue
        func = member.fget if isinstance(member, property) else member
        for part in PARTS:
            theirs = inspect.getattr_static(part, name, None)
            if theirs is None or isinstance(theirs, property) != isinstance(member, property):
                continue  # not this part's, or another thing of the same name (stats)
            doc = theirs.__doc__
            assert doc and func.__doc__ == doc, f"Checkpointer.{name}"
            shown += 1
    # save, should_save, the restore side, the framework doors, the waits, the RAM tier
    assert shown >= 18, shown
