"""examples/recovery_ddp.py, the recovery API's example, in its laptop mode: real local
processes (2 DDP ranks over gloo on 127.0.0.1 and a hot spare), rank 1 SIGKILLed after
step 8; the example's own launcher declares it lost and the spare takes its place. The
survivor recovers from its own RAM snapshot with at most one step redone, the spare
starts from the partner's RAM copy, and the final weights are bitwise those of the same
example run without a failure (``--kill-at 0``), run side by side.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "recovery_ddp.py"
STEPS = 30
#: A bound on each run (a hang fails the test instead of blocking it).
WAIT_S = 400


def start(work: Path, kill_at: int) -> subprocess.Popen:
    args = ["--laptop", "--work", str(work), "--steps", str(STEPS), "--kill-at", str(kill_at)]
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(p: subprocess.Popen) -> str:
    try:
        out, _ = p.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"the example did not finish in {WAIT_S}s:\n{out}") from None
    assert p.returncode == 0, out
    return out


def field(out: str, pattern: str) -> str:
    m = re.search(pattern, out, re.M)
    assert m, (pattern, out)
    return m.group(1)


def test_the_recovery_example_survives_a_killed_rank_on_a_laptop(tmp_path: Path) -> None:
    ref = start(tmp_path / "ref", 0)
    run = start(tmp_path / "run", 8)
    ref_out, out = finish(ref), finish(run)
    want = field(ref_out, r"^RESULT ok digest=([0-9a-f]{64})$")
    assert "killed" not in ref_out and "recovered=" not in ref_out, ref_out
    assert "laptop: rank 1 (pid " in out and "(the spare) is rank 1" in out, out
    [h] = json.loads(field(out, r"^RANK 0 pid=\d+ recovered=(.*)$"))
    assert h["epoch"] == 1 and h["tier"] == "ram" and h["recomputed"] <= 1, out
    started = json.loads(field(out, r"^RANK 1 pid=\d+ started=(.*)$"))
    assert started == {"step": h["step"], "tier": "partner-ram"}, out
    assert field(out, r"^RESULT ok digest=([0-9a-f]{64})$") == want, (out, ref_out)
    # the survivor is one process from start to end: its steps go on past the kill, and
    # the step after the restored one is done again if it was done before (recomputed)
    steps = [
        int(ln.split()[1])
        for ln in (tmp_path / "run" / "task0.out").read_text().splitlines()
        if ln.startswith("STEP ")
    ]
    assert steps[-1] == STEPS and 1 + h["recomputed"] <= steps.count(h["step"] + 1) <= 2, steps


def test_bad_laptop_options_are_one_line_errors(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(EXAMPLE), "--laptop", "--ranks", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "--ranks must be >= 2" in p.stderr, p.stderr
