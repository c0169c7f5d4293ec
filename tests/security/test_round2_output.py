"""Round 2, finding 6: root's output is safe to read whatever users wrote.

The attacker's checkpoints carry a ``data_version`` with ESC/OSC/BEL sequences, a C1
CSI (``U+009B``), a bidi override (``U+202E``) and a 1 MB value, a file name with C1 and
bidi characters (what ``verify`` prints) and labels with bidi overrides. Root runs
every command that shows user data, in every output format; nothing in what it prints
is a character a terminal acts on or hides, and no line is a megabyte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

import pytest

from slurm_ckpt.cli.safe_text import is_unsafe, safe_json, safe_text
from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.core.names import validate_relpath
from slurm_ckpt.errors import InvalidName, VerifyError

from .conftest import ATTACKER, Site, as_user, cli, forged_manifest, plant_checkpoint

DATA = b"h" * 64
ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred"  # OSC title + BEL, clear screen, colour
C1 = "\x9b31m"  # C1 CSI: a CSI to many terminals without any ESC
BIDI = "safe\u202egnp.exe"  # reads as "safeexe.png"
HOSTILE = [ESC, C1, BIDI, "zero\u200bwidth", "line\u2028break", "x" * 2**20]
MAX_LINE = 10_000


def _corpus(pfs: str) -> None:
    """As the attacker: one committed step of ``dv`` per hostile data_version, and one
    whose file name is hostile (its payload does not match, so verify names it)."""
    for step, text in enumerate(HOSTILE, start=1):
        man = forged_manifest(ATTACKER, "dv", step, DATA, meta={"data_version": text})
        plant_checkpoint(pfs, ATTACKER, "dv", step, DATA, man)
    name = "w\x9b[31m\u202e.bin"
    files = [{"path": name, "size": 64, "hash": "0" * 32, "chunks": ["0" * 32]}]
    man = forged_manifest(ATTACKER, "names", 1, DATA, files=files, job="7\u202e1")
    sdir = plant_checkpoint(pfs, ATTACKER, "names", 1, DATA, man)
    os.rename(os.path.join(sdir, "w.bin"), os.path.join(sdir, name))


def _check(what: str, text: str) -> None:
    bad = sorted({f"U+{ord(c):04X}" for c in text if is_unsafe(c) and c != "\n"})
    assert not bad, f"{what}: raw {bad} in root's output"
    longest = max((len(line) for line in text.split("\n")), default=0)
    assert longest <= MAX_LINE, f"{what}: a line of {longest} characters"


def test_every_command_prints_user_text_safely(site: Site, tmp_path: Path) -> None:
    conf = site.config_file()
    as_user(ATTACKER, _corpus, str(site.pfs))
    sdir = site.pfs / ATTACKER / "names" / step_dirname(1)
    assert sdir.is_dir()
    runs: List[List[str]] = [["status", "--no-slurm", *f] for f in ([], ["--parsable"], ["--json"])]
    runs += [["list", *f] for f in ([], ["--parsable"], ["--json"])]
    for key in ("dv", "names"):
        for fmt in ([], ["--parsable"], ["--json"]):
            runs.append(["list", key, "-u", ATTACKER, *fmt])
            runs.append(["verify", key, "-u", ATTACKER, *fmt])
    runs += [["verify", str(site.pfs / ATTACKER / "dv" / step_dirname(1))]]
    runs += [["verify", str(sdir), *f] for f in ([], ["--json"])]
    runs += [["gc", "--dry-run", *f] for f in ([], ["--json"])]
    runs += [["restore", "dv", "-u", ATTACKER, "--step", "1", "--to", str(tmp_path / "r")]]
    seen = ""
    for argv in runs:
        r = cli(*argv, config=conf)
        assert "Traceback" not in r.stderr, (argv, r.stderr[-3000:])
        _check(" ".join(argv) + " (stdout)", r.stdout)
        _check(" ".join(argv) + " (stderr)", r.stderr)
        seen += r.stdout + r.stderr
    # The values are shown, escaped (not dropped): a reader sees what is there.
    assert "\\x1b]0;pwned\\x07" in seen and "\\x9b31m" in seen and "\\u202e" in seen


def test_the_helper_and_the_names() -> None:
    assert safe_text(ESC) == "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mred"
    assert safe_text(BIDI) == "safe\\u202egnp.exe"
    assert safe_text("é 日本 ok") == "é 日本 ok"
    cut = safe_text("x" * 2**20)
    assert len(cut) < 600 and cut.endswith(f"[{2**20 - 512} more characters]")
    assert len(safe_json({"a": ["y" * 2**20]})["a"][0]) < 5000
    for name in ("a\x9bb", "a\u202eb.bin", "a\u200bb", "a\u2028b", "a\x85b"):
        with pytest.raises(InvalidName):
            validate_relpath(name)
    assert validate_relpath("données/日本.bin") == "données/日本.bin"
    for label in ({"job": "7\u202e1"}, {"node": "n\u200b1"}, {"meta": {"k\u202e": 1}}):
        with pytest.raises(VerifyError):
            Manifest.from_bytes(forged_manifest(ATTACKER, "k", 1, DATA, **label))
