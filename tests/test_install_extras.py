"""The README's install commands, run in a fresh virtual environment.

* ``pip install CHECKOUT``: the library and the commands, without boto3 (laptops and
  PFS sites need no object-store client); a config with an object tier then says in one
  line which extra to install;
* ``pip install "CHECKOUT[s3]"`` adds boto3, and the object tier loads;
* ``[plot]`` adds matplotlib: ``ckpt-slurm report --png`` draws (without it, one line
  names the extra);
* ``[hf,lightning]`` installs transformers with accelerate and pytorch-lightning, with
  torch from the CPU wheel (the README's hint), and both doors import.

The packages come from the package index through pip's cache (scripts/setup warmed it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = "/opt/wheels"
#: A laptop run in the fresh venv (numpy only, no torch): two saves, flushed.
RUN = (
    "import sys\n"
    "import numpy as np\n"
    "from slurm_ckpt import Checkpointer\n"
    "c = Checkpointer(local=sys.argv[1], warm=sys.argv[2], key='run', install_signals=False)\n"
    "for s in (1, 2):\n"
    "    c.save({'w': np.full(256, s, dtype=np.float32)}, step=s)\n"
    "    c.wait()\n"
    "c.close()\n"
)


def _pip(py: Path, *args: str) -> subprocess.CompletedProcess:
    """``pip ARGS`` in the venv; ``install`` without byte-compiling (torch's and
    transformers' thousands of modules: most of the test's time, and what is checked
    here is what gets installed and that it imports)."""
    links = ["--find-links", WHEELS] if os.path.isdir(WHEELS) else []
    quick = ["--no-compile"] if args[:1] == ("install",) else []
    return subprocess.run(
        [str(py), "-m", "pip", "--disable-pip-version-check", *args, *quick, *links],
        capture_output=True,
        text=True,
        timeout=900,
    )


def _has(py: Path, module: str) -> bool:
    r = subprocess.run(
        [
            str(py),
            "-c",
            f"import importlib.util,sys; sys.exit(importlib.util.find_spec({module!r}) is None)",
        ],
        capture_output=True,
    )
    return r.returncode == 0


def test_each_extra_installs_what_the_readme_says(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    base = _pip(py, "install", "-q", str(REPO))
    assert base.returncode == 0, base.stderr
    v = subprocess.run(
        [str(venv / "bin" / "ckpt-slurm"), "--version"], capture_output=True, text=True
    )
    assert (v.returncode, v.stdout.strip()) == (0, "ckpt-slurm 0.1.0"), v.stderr
    assert not _has(py, "boto3") and not _has(py, "botocore")
    site = tmp_path / "site.toml"
    site.write_text(
        f'[tiers.local]\nroot = "{tmp_path}"\nrequire_mount = false\n'
        '[tiers.object]\nendpoint = "http://127.0.0.1:1"\nbucket = "ckpt"\n'
    )
    probe = (
        "import sys\n"
        "from slurm_ckpt.core.config import load_config\n"
        "from slurm_ckpt.errors import CkptError\n"
        "from slurm_ckpt.tiers.registry import tiers_from_config\n"
        f"try:\n    print(sorted(tiers_from_config(load_config({str(site)!r}))))\n"
        "except CkptError as e:\n    print('ERR', e)\n"
    )
    before = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    assert before.stdout.strip().startswith("ERR the object tier needs boto3"), before
    assert "pip install '/path/to/slurm_ckpt[s3]'" in before.stdout, before  # not PyPI

    s3 = _pip(py, "install", "-q", f"{REPO}[s3]")
    assert s3.returncode == 0, s3.stderr
    assert _has(py, "boto3") and _has(py, "zlib_ng")
    after = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    assert after.stdout.strip() == "['local', 'object']", after

    # [plot]: report --png draws a series' life; without matplotlib it says which extra.
    local, warm, png = tmp_path / "nvme", tmp_path / "warm", tmp_path / "life.png"
    run = subprocess.run(
        [str(py), "-c", RUN, str(local), str(warm)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    report = [str(venv / "bin" / "ckpt-slurm"), "report", "run", "--local", str(local)]
    report += ["--warm", str(warm), "--png", str(png)]
    no_plot = subprocess.run(report, capture_output=True, text=True)
    assert no_plot.returncode == 2 and not png.exists(), no_plot
    assert no_plot.stderr.strip().count("\n") == 0, no_plot.stderr  # one line
    assert "'/path/to/slurm_ckpt[plot]'" in no_plot.stderr, no_plot.stderr
    plot = _pip(py, "install", "-q", f"{REPO}[plot]")
    assert plot.returncode == 0, plot.stderr
    drawn = subprocess.run(report, capture_output=True, text=True)
    assert drawn.returncode == 0 and png.stat().st_size > 10_000, drawn.stderr

    # [hf] and [lightning], installed for real (torch from the CPU wheel this machine
    # keeps in /opt/wheels, as the README's hint says): the doors import.
    both = _pip(py, "install", "-q", f"{REPO}[hf,lightning]", "torch==2.13.0")
    assert both.returncode == 0, both.stderr
    for module in ("transformers", "accelerate", "pytorch_lightning"):
        assert _has(py, module), module
    doors = subprocess.run(
        [str(py), "-c", "import slurm_ckpt.hf, slurm_ckpt.lightning; print('ok')"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert doors.stdout.strip() == "ok", doors.stderr
