"""``ckpt-slurm list`` and ``ckpt-slurm verify``: what is committed where, and is it intact.

``verify`` re-reads and re-hashes every byte and exits 1 on any mismatch, so it can gate a
restart or a deletion in a script.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state, print_json, print_table
from slurm_ckpt.core.layout import parse_step_dirname
from slurm_ckpt.core.names import current_user, validate_key, validate_user
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import CkptError, NotFound
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.registry import ORDER, tiers_from_config

tier_choice = click.Choice(["all", *ORDER])


def _user(user: Optional[str]) -> str:
    return validate_user(user) if user else current_user()


def _selected(state: CliState, tier: str) -> Dict[str, PosixTier]:
    tiers = tiers_from_config(state.config)
    if tier == "all":
        return tiers
    if tier not in tiers:
        raise CkptError(f"tier {tier!r} is not configured")
    return {tier: tiers[tier]}


@click.command("list")
@click.argument("key")
@click.option("--user", help="owner of the checkpoints (default: you)")
@click.option("--tier", type=tier_choice, default="all", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@pass_state
def list_cmd(state: CliState, key: str, user: Optional[str], tier: str, as_json: bool) -> None:
    """List the committed checkpoints of KEY on each tier."""
    user = _user(user)
    validate_key(key)
    rows: List[dict] = []
    now = time.time()
    for name, t in _selected(state, tier).items():
        for s in t.steps(user, key):
            m = s.manifest
            rows.append(
                {
                    "tier": name,
                    "step": s.step,
                    "tokens": m.tokens,
                    "bytes": m.total_bytes,
                    "files": len(m.files),
                    "age_s": round(now - m.wall_time, 1),
                    "job": m.job,
                    "node": m.node,
                    "path": t.step_path(user, key, s.step),
                }
            )
    if as_json:
        print_json({"user": user, "key": key, "checkpoints": rows})
        return
    if not rows:
        raise NotFound(f"no committed checkpoint for {user}/{key}")
    print_table(
        f"checkpoints of {user}/{key}",
        [
            [
                r["tier"],
                r["step"],
                r["tokens"] if r["tokens"] is not None else "-",
                format_bytes(r["bytes"]),
                format_duration(r["age_s"]),
                r["job"] or "-",
                r["node"] or "-",
            ]
            for r in rows
        ],
        ["tier", "step", "tokens", "size", "age", "job", "node"],
    )


@click.command("verify")
@click.argument("target")
@click.option("--user", help="owner of the checkpoints (default: you)")
@click.option("--tier", type=tier_choice, default="all", show_default=True)
@click.option("--step", type=int, help="only this step (default: every committed step)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@pass_state
def verify_cmd(
    state: CliState,
    target: str,
    user: Optional[str],
    tier: str,
    step: Optional[int],
    as_json: bool,
) -> int:
    """Re-hash every byte of TARGET (a step directory, or a KEY) against its manifest.

    Exit status 0 when everything verifies, 1 on any mismatch.
    """
    checks = []  # (tier, user, key, step)
    if os.sep in target or target.startswith("."):
        path = Path(target).absolute()
        s = parse_step_dirname(path.name)
        if s is None or not path.is_dir():
            raise CkptError(f"{target}: not a checkpoint directory (expected .../step-NNNNNNNNNN)")
        key_dir = path.parent
        t = PosixTier("path", str(key_dir.parent.parent))
        checks.append((t, key_dir.parent.name, key_dir.name, s))
    else:
        user = _user(user)
        validate_key(target)
        for t in _selected(state, tier).values():
            for info in t.steps(user, target):
                if step is None or info.step == step:
                    checks.append((t, user, target, info.step))
        if not checks:
            raise NotFound(
                f"no committed checkpoint for {user}/{target}"
                + (f" at step {step}" if step is not None else "")
            )
    reports = [t.verify(u, k, s) for t, u, k, s in checks]
    ok = all(r.ok for r in reports)
    if as_json:
        print_json(
            {
                "ok": ok,
                "checkpoints": [
                    {
                        "where": r.where,
                        "step": r.step,
                        "ok": r.ok,
                        "bytes": r.nbytes,
                        "seconds": round(r.seconds, 3),
                        "problems": r.problems,
                    }
                    for r in reports
                ],
            }
        )
    else:
        print_table(
            "verify",
            [
                [
                    r.where.split(":", 1)[0],
                    r.step,
                    format_bytes(r.nbytes),
                    "OK" if r.ok else "CORRUPT",
                    "; ".join(r.problems[:3]),
                ]
                for r in reports
            ],
            ["tier", "step", "size", "result", "problems"],
        )
    return 0 if ok else 1
