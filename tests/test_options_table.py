"""The Checkpointer's options are defined once (issue 32): the table in
slurm_ckpt/job/option_table.py makes the ``Options`` fields, the options part of
``help(Checkpointer)`` and the option tables of docs/user-guide-options.md; the explicit
signature (kept for IDEs) must say exactly what the table says."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from slurm_ckpt import Checkpointer
from slurm_ckpt.job.option_table import GROUPS, OPTIONS, docstring_section, option_rows
from slurm_ckpt.job.options import OPTION_NAMES, Options

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "options_page.py"


def _page_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("options_page", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same(a: object, b: object) -> bool:
    return a is b or a == b


def test_the_options_dataclass_is_the_table_in_its_order() -> None:
    fields = dataclasses.fields(Options)
    rows = option_rows()
    assert [f.name for f in fields] == [o.name for o in rows] == list(OPTION_NAMES)
    for f, o in zip(fields, rows):
        assert _same(f.default, o.default), f.name
        assert f.type == o.kind, f.name


def test_the_signature_says_exactly_what_the_table_says() -> None:
    params = list(inspect.signature(Checkpointer.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [o.name for o in OPTIONS]  # names and order
    for p, o in zip(params, OPTIONS):
        assert _same(p.default, o.default), f"{p.name}: {p.default!r} != {o.default!r}"
        keyword_only = p.kind is p.KEYWORD_ONLY
        assert keyword_only == (o.option or o.name == "config"), p.name


def test_each_group_is_one_run_of_rows_with_a_heading() -> None:
    order = [o.group for o in OPTIONS]
    runs = [g for i, g in enumerate(order) if i == 0 or order[i - 1] != g]
    assert runs == list(GROUPS)  # every group once, in GROUPS' order, no group empty
    assert len({o.name for o in OPTIONS}) == len(OPTIONS)
    assert all(o.help.strip() and "\n" not in o.help.split("\n")[0] for o in OPTIONS)


def test_help_shows_the_table() -> None:
    doc = Checkpointer.__doc__ or ""
    assert doc.endswith(docstring_section())
    text = (inspect.getdoc(Checkpointer) or "") + "\n"
    for o in OPTIONS:
        assert f"\n  {o.name}: {o.help.split(chr(10))[0]}\n" in text, o.name


def test_the_options_page_is_made_from_the_table() -> None:
    page_script = _page_script()
    page = (REPO / "docs" / "user-guide-options.md").read_text()
    assert page_script.render(page) == page, "stale: python scripts/options_page.py --write"
    documented = [o for o in OPTIONS if o.group != "deprecated"]
    for o in documented:
        assert page.count(f"\n| `{o.name}` |") == 1, o.name
    # A table edited by hand is caught, and the script's check says so.
    edited = page.replace("| `interval_steps` | none |", "| `interval_steps` | 500 |")
    assert edited != page and page_script.render(edited) == page
    r = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
