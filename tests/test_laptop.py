"""A new user's first hour, end to end on a laptop: the example with one local tier
(no SLURM, no site config, no PFS), preempted by SIGTERM and started again, ends with
weights bitwise equal to an uninterrupted run; and the example uses only the public API.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from test_torch_resume import TRAIN, TrainProc

STEPS = 200


def test_the_example_on_a_laptop_resumes_bitwise_exact(tmp_path: Path) -> None:
    # a small sleep per step keeps the first run far from its end when the signal comes
    common = ["--steps", str(STEPS), "--interval-steps", "10", "--sleep-per-step", "0.005"]
    ref = TrainProc([*common, "--no-ckpt", "--digest-out", str(tmp_path / "ref")], tmp_path)
    local = tmp_path / "home" / "ckpt"  # does not exist yet: made, mode 0700
    args = [*common, "--local", str(local), "--key", "laptop", "--digest-out", str(tmp_path / "d")]
    first = TrainProc(args, tmp_path)
    assert first.expect(r"^START fresh").group(0)
    first.expect(r"^COMMITTED step=10$")  # a checkpoint exists; the run is near step 10
    first.signal(signal.SIGTERM)
    stopped = int(first.expect(r"^PREEMPTED step=(\d+)$").group(1))
    assert first.finish() == 0
    again = TrainProc(args, tmp_path)
    resumed = again.expect(r"^RESUMED step=(\d+) .*tier=local")
    assert int(resumed.group(1)) == stopped  # a preemption loses no step
    done = again.expect(rf"^DONE step={STEPS} digest=([0-9a-f]{{64}})$").group(1)
    assert again.finish() == 0 and ref.finish() == 0
    assert done == (tmp_path / "ref").read_text().strip()
    assert not any("FLUSHED" in line for line in first.lines + again.lines)  # no warm tier
    assert (local.stat().st_mode & 0o777) == 0o700


def test_the_example_imports_only_public_names() -> None:
    tree = ast.parse(Path(TRAIN).read_text())
    seen = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slurm_ckpt"):
            module = importlib.import_module(node.module)  # type: ignore[arg-type]
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                try:
                    importlib.import_module(target)  # a public submodule (slurm_ckpt.torch)
                    public = target in ("slurm_ckpt.torch",)
                except ImportError:
                    public = alias.name in module.__all__
                assert public, f"examples/train_tiny.py uses {target}, not public API"
                seen.append(target)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("slurm_ckpt.") for a in node.names)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "sct"  # slurm_ckpt.torch as sct
        ):
            import slurm_ckpt.torch as sct

            assert node.attr in sct.__all__, f"sct.{node.attr} is not public"
    assert "slurm_ckpt.Checkpointer" in seen and "slurm_ckpt.torch" in seen


def test_the_options_guide_code_runs(tmp_path: Path) -> None:
    """Every Python block of docs/user-guide-options.md runs as written."""
    text = (Path(TRAIN).parents[1] / "docs" / "user-guide-options.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert blocks
    for i, code in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(code)
        env = dict(os.environ, PYTHONPATH=str(Path(TRAIN).parents[1]))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             env=env, timeout=300, check=False)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        if i == 0:
            assert "resumed at 5 ran to 8" in out.stdout, out.stdout
