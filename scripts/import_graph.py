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
* **circles**: groups of modules that import each other, directly or round a ring (lazy
  imports count: a circle broken only by a lazy import is still one concept cut in two).
* **private reaches**: ``x._name`` where ``x`` is not ``self``/``cls`` (another object's
  private member), stdlib modules aside.
* **PosixTier outside tiers/**: code outside ``slurm_ckpt/tiers/`` that names the POSIX
  tier's class (the kind of a tier is the tiers' business: ``tiers/registry.py``).
* **"object" literals** outside ``tiers/`` and the config's alias table
  (:data:`OBJECT_ALLOWED`): code that decides by the object tier's name.
* **torch below the framework floor**: a module-level ``import torch`` in a layer below
  :data:`FRAMEWORK_FLOOR` (the framework doors may import torch; the job floor may not).
* **file copy loops outside tiers/**: ``os.copy_file_range``/``os.sendfile``/``shutil``
  copies outside the copy engine of ``slurm_ckpt/tiers/``.
* **files each tier kind touches**: for each class of ``tiers/`` that says its ``kind``,
  the product files that name it (its own module, the registry: what adding a kind
  costs).

Reads the source with :mod:`ast` only (nothing is imported or run).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

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
    "torch_codec": 8,
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
#: The lowest layer whose modules may import torch at module level: the framework doors.
FRAMEWORK_FLOOR = 8
#: Upward imports allowed *inside a function* only (never at module level): the
#: Checkpointer's ``dcp_writer()``/``dcp_reader()`` (job layer) hand out the objects of
#: the DCP backend (``slurm_ckpt/dcp/``, which imports torch). Importing them when called
#: keeps every module of the job floor loadable without torch; at module level the same
#: import is an upward one.
LAZY_DOORS: Dict[str, Set[str]] = {"job": {"dcp"}}
#: Files outside tiers/ that may spell "object": the config's table of section aliases.
OBJECT_ALLOWED = ("slurm_ckpt/core/config_schema.py",)
#: Calls that copy one file into another (a copy engine's job: slurm_ckpt/tiers/).
COPY_CALLS = {
    ("os", "copy_file_range"),
    ("os", "sendfile"),
    ("shutil", "copyfile"),
    ("shutil", "copy"),
    ("shutil", "copy2"),
    ("shutil", "copyfileobj"),
}


@dataclass
class Facts:
    modules: int = 0
    upward: List[str] = field(default_factory=list)
    lazy_doors: List[str] = field(default_factory=list)
    private: List[str] = field(default_factory=list)
    largest: List[Tuple[str, int]] = field(default_factory=list)
    pfs_literals: List[str] = field(default_factory=list)
    loggers: List[str] = field(default_factory=list)
    exit_literals: List[str] = field(default_factory=list)
    circles: List[List[str]] = field(default_factory=list)
    reaches: List[str] = field(default_factory=list)
    posix_outside: List[str] = field(default_factory=list)
    object_literals: List[str] = field(default_factory=list)
    torch_below: List[str] = field(default_factory=list)
    copy_loops: List[str] = field(default_factory=list)
    kind_files: Dict[str, List[str]] = field(default_factory=dict)


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
    known = {module_name(p, root) for p in pkg.rglob("*.py")}
    edges: Dict[str, Set[str]] = {m: set() for m in known}
    named: Dict[str, Set[str]] = {}  # file -> identifiers it names
    kinds: Set[str] = set()  # tier classes (they say their kind)
    for path in sorted(pkg.rglob("*.py")):
        here = module_name(path, root)
        rel = str(path.relative_to(root))
        is_pkg = path.name == "__init__.py"
        text = path.read_text()
        sizes.append((rel, text.count("\n")))
        facts.modules += 1
        tree = ast.parse(text, rel)
        mine = part_of(here)
        eager = {id(s) for s in _top_level_imports(tree.body)}  # run on import
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
                elif hi > lo and id(node) not in eager and theirs in LAZY_DOORS.get(mine, ()):
                    facts.lazy_doors.append(f"{rel}:{node.lineno}: {src}")
                elif hi > lo:
                    facts.upward.append(f"{rel}:{node.lineno}: {mine} imports {src}")
                elif mine == theirs == "hooks" and src != f"{PACKAGE}.hooks" and here != src:
                    facts.upward.append(f"{rel}:{node.lineno}: a hook imports {src}")
                for n in names:
                    if _private(n):
                        facts.private.append(f"{rel}:{node.lineno}: {src}.{n}")
        _more_facts(tree, rel, here, mine, facts, edges, known)
        named[rel] = _names_in(tree)
        if mine == "tiers":
            kinds |= _kind_classes(tree)
    facts.upward.sort()
    facts.lazy_doors = sorted(set(facts.lazy_doors))
    facts.private.sort()
    facts.largest = sorted(sizes, key=lambda s: -s[1])[:5]
    facts.circles = _circles(edges, known)
    facts.kind_files = {
        cls: sorted(f for f, names in named.items() if cls in names) for cls in sorted(kinds)
    }
    return facts


def _kind_classes(tree: ast.Module) -> Set[str]:
    """Classes whose body says ``kind = "<a string>"`` (a tier kind)."""
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        for stmt in node.body
        if isinstance(stmt, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "kind" for t in stmt.targets)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    }


def _names_in(tree: ast.Module) -> Set[str]:
    """Every identifier a module names in code (not in text)."""
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            out.update(a.name.split(".")[-1] for a in node.names)
        elif isinstance(node, ast.ClassDef):
            out.add(node.name)
    return out


def _top_level_imports(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    """Import statements run at import time: the module body, into ``if``/``try`` blocks
    but not into functions, classes or ``if TYPE_CHECKING:``."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, ast.If):
            if not (isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING"):
                yield from _top_level_imports(stmt.body)
            yield from _top_level_imports(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for part in (stmt.body, stmt.orelse, stmt.finalbody):
                yield from _top_level_imports(part)
            for h in stmt.handlers:
                yield from _top_level_imports(h.body)


def _more_facts(
    tree: ast.Module,
    rel: str,
    here: str,
    mine: Optional[str],
    facts: Facts,
    edges: Dict[str, Set[str]],
    known: Set[str],
) -> None:
    """Circles' edges, private reaches, PosixTier and "object" outside tiers/, torch below
    the framework floor and copy calls outside tiers/, for one module."""
    in_tiers = mine == "tiers"
    stdlib: Set[str] = set()  # names bound to modules outside the package (os, sys)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not a.name.startswith(PACKAGE):
                    stdlib.add(a.asname or a.name.split(".")[0])
    is_pkg = rel.endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    edges[here].add(a.name)
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(node, here, is_pkg)
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in known:
                    edges[here].add(sub)
                elif src in known:
                    edges[here].add(src)
                if a.name == "PosixTier" and not in_tiers:
                    facts.posix_outside.append(f"{rel}:{node.lineno}")
        elif isinstance(node, ast.Name) and node.id == "PosixTier" and not in_tiers:
            facts.posix_outside.append(f"{rel}:{node.lineno}")
        elif isinstance(node, ast.Attribute):
            if node.attr == "PosixTier" and not in_tiers:
                facts.posix_outside.append(f"{rel}:{node.lineno}")
            if _private(node.attr) and not (
                isinstance(node.value, ast.Name)
                and (node.value.id in ("self", "cls") or node.value.id in stdlib)
            ):
                facts.reaches.append(f"{rel}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value == "object":
            if not in_tiers and rel not in OBJECT_ALLOWED:
                facts.object_literals.append(f"{rel}:{node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (
                not in_tiers
                and isinstance(f.value, ast.Name)
                and (f.value.id, f.attr) in COPY_CALLS
            ):
                facts.copy_loops.append(f"{rel}:{node.lineno}: {f.value.id}.{f.attr}")
    layer = LAYERS.get(mine or "", FRAMEWORK_FLOOR)
    if mine is not None and layer < FRAMEWORK_FLOOR:
        for stmt in _top_level_imports(tree.body):
            names = (
                [a.name for a in stmt.names]
                if isinstance(stmt, ast.Import)
                else [stmt.module or ""]
                if not stmt.level
                else []
            )
            if any(n == "torch" or n.startswith("torch.") for n in names):
                facts.torch_below.append(f"{rel}:{stmt.lineno}")
    facts.posix_outside = sorted(set(facts.posix_outside))


def _circles(edges: Dict[str, Set[str]], known: Set[str]) -> List[List[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(known):
        if v not in index:
            visit(v)
    return sorted(out)


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
    print(f"lazy doors (an upward import inside a function, LAZY_DOORS): {len(f.lazy_doors)}")
    for line in f.lazy_doors:
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
    print(f"circles: {len(f.circles)}")
    for group in f.circles:
        print("  " + " <-> ".join(group))
    for title, lines in (
        ("private reaches (x._name, x not self/cls)", f.reaches),
        ("PosixTier named outside tiers/", f.posix_outside),
        ('"object" literals outside tiers/ and the config alias table', f.object_literals),
        ("module-level torch imports below the framework floor", f.torch_below),
        ("file copy calls outside tiers/", f.copy_loops),
    ):
        print(f"{title}: {len(lines)}")
        for line in lines:
            print(f"  {line}")
    print("product files naming each tier kind's class:")
    for cls, files in f.kind_files.items():
        print(f"  {cls}: {len(files)}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
