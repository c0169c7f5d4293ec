#!/usr/bin/env python3
"""Structure facts of slurm_ckpt, from its import graph (``python3 scripts/import_graph.py``,
``--json`` for a machine; ``tests/test_structure.py`` holds the code to the first two).

* **upward imports**: an import of a higher layer (README "Layout of the code"; the order
  is :data:`LAYERS`), or of one hook by another. Lazy imports inside functions count:
  a lazy import is still an arrow. Must be none.
* **private imports**: a module that takes another module's ``_name`` (``from m import
  _x``, or ``m._x`` through an imported module). Must be none: merge the pair, or make the
  helper public.
* **largest modules**, by lines.
* **"pfs" literals**: the string ``"pfs"`` in the product, each place listed.
* **hand-typed logger names** (``getLogger("...")``, not ``__name__``) and **literal exit
  codes** in exception classes (not the ``EXIT_*`` constants): must be none.

Reads the source with :mod:`ast` only (nothing is imported or run).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "slurm_ckpt"

#: Layer of each top-level part of the package: a module imports only its own layer or
#: lower ones. ``hooks`` and ``ops`` share a layer (no hook imports another hook). The
#: package root (``slurm_ckpt/__init__.py``: ``__version__`` and the lazy
#: ``Checkpointer``) is importable from everywhere and imports lazily from above.
LAYERS: Dict[str, int] = {
    "__init__": 0,
    "errors": 0,
    "core": 1,
    "tiers": 2,
    "ledger": 3,
    "admission": 4,
    "slurm": 5,
    "node": 6,
    "job": 7,
    "torch_codec": 7,
    "torch": 8,
    "torch_data": 8,
    "torch_state": 8,
    "dcp": 8,
    "hf": 8,
    "lightning": 8,
    "hooks": 8,
    "ops": 8,
    "cli": 9,
}


@dataclass
class Facts:
    modules: int = 0
    upward: List[str] = field(default_factory=list)
    private: List[str] = field(default_factory=list)
    largest: List[Tuple[str, int]] = field(default_factory=list)
    pfs_literals: List[str] = field(default_factory=list)
    loggers: List[str] = field(default_factory=list)
    exit_literals: List[str] = field(default_factory=list)


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or ["__init__"]
    return ".".join(parts)


def part_of(module: str) -> Optional[str]:
    """``slurm_ckpt.node.work`` -> ``node``; None outside the package."""
    bits = module.split(".")
    if bits[0] != PACKAGE:
        return None
    return bits[1] if len(bits) > 1 else "__init__"


def _resolve(node: ast.ImportFrom, here: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = here.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def scan(root: Path = REPO) -> Facts:
    facts = Facts()
    pkg = root / PACKAGE
    sizes: List[Tuple[str, int]] = []
    for path in sorted(pkg.rglob("*.py")):
        here = module_name(path, root)
        rel = str(path.relative_to(root))
        is_pkg = path.name == "__init__.py"
        text = path.read_text()
        sizes.append((rel, text.count("\n")))
        facts.modules += 1
        tree = ast.parse(text, rel)
        mine = part_of(here)
        modules: Dict[str, str] = {}  # local alias -> imported slurm_ckpt module
        for node in ast.walk(tree):
            targets: List[Tuple[str, List[str]]] = []
            if isinstance(node, ast.Import):
                for a in node.names:
                    targets.append((a.name, []))
                    if a.name.startswith(PACKAGE + ".") and a.asname:
                        modules[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(node, here, is_pkg)
                names = []
                for a in node.names:  # "from slurm_ckpt.core import fsio": a module
                    sub = pkg.joinpath(*src.split(".")[1:], a.name)
                    if src.startswith(PACKAGE) and (
                        sub.with_suffix(".py").exists() or sub.is_dir()
                    ):
                        modules[a.asname or a.name] = f"{src}.{a.name}"
                        targets.append((f"{src}.{a.name}", []))
                    else:
                        names.append(a.name)
                if names:
                    targets.append((src, names))
            elif isinstance(node, ast.Constant) and node.value == "pfs":
                facts.pfs_literals.append(f"{rel}:{node.lineno}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "getLogger"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                facts.loggers.append(f"{rel}:{node.lineno}: getLogger({node.args[0].value!r})")
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (
                        isinstance(stmt, ast.Assign)
                        and any(
                            isinstance(t, ast.Name) and t.id == "exit_code" for t in stmt.targets
                        )
                        and isinstance(stmt.value, ast.Constant)
                    ):
                        facts.exit_literals.append(f"{rel}:{stmt.lineno}: {node.name}")
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and _private(node.attr)
            ):
                facts.private.append(f"{rel}:{node.lineno}: {modules[node.value.id]}.{node.attr}")
            for src, names in targets:
                theirs = part_of(src)
                if theirs is None or mine is None:
                    continue
                if src == here:
                    continue
                lo, hi = LAYERS.get(mine), LAYERS.get(theirs)
                if mine == "__init__":
                    pass  # the package's lazy facade (PEP 562): names for users, no layer
                elif lo is None or hi is None:
                    facts.upward.append(f"{rel}:{node.lineno}: {src} (layer unknown)")
                elif hi > lo:
                    facts.upward.append(f"{rel}:{node.lineno}: {mine} imports {src}")
                elif mine == theirs == "hooks" and src != f"{PACKAGE}.hooks" and here != src:
                    facts.upward.append(f"{rel}:{node.lineno}: a hook imports {src}")
                for n in names:
                    if _private(n):
                        facts.private.append(f"{rel}:{node.lineno}: {src}.{n}")
    facts.upward.sort()
    facts.private.sort()
    facts.largest = sorted(sizes, key=lambda s: -s[1])[:5]
    return facts


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="the facts as JSON")
    args = ap.parse_args(argv)
    f = scan()
    if args.json:
        print(json.dumps(asdict(f), indent=2))
        return 0
    order = " -> ".join(sorted(LAYERS, key=lambda k: LAYERS[k]))
    print(f"{f.modules} modules of {PACKAGE}; layers: {order}")
    print(f"upward imports: {len(f.upward)}")
    for line in f.upward:
        print(f"  {line}")
    print(f"cross-module private imports: {len(f.private)}")
    for line in f.private:
        print(f"  {line}")
    print(f"hand-typed logger names: {len(f.loggers)}; literal exit codes: {len(f.exit_literals)}")
    for line in f.loggers + f.exit_literals:
        print(f"  {line}")
    print("largest modules: " + ", ".join(f"{p} ({n} lines)" for p, n in f.largest))
    print(f'"pfs" string literals: {len(f.pfs_literals)}')
    for line in f.pfs_literals:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
