"""``ckpt-slurm list`` and ``ckpt-slurm verify``: what is committed where, and is it intact.

``verify`` re-reads and re-hashes every byte and exits 1 on any mismatch, so it can gate a
restart or a deletion in a script. ``list`` without a KEY lists the caller's series (as
root: every user's), so a user can discover what they have.

Output goes through :mod:`slurm_ckpt.cli.table` (``--json``, ``--parsable``,
``--noheader``, width-adaptive tables); ``verify`` shows a progress bar on a terminal.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import click

from slurm_ckpt.cli.output import CliState, pass_state
from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.table import Column, Listing, OutputFormat, output_options, print_json_doc
from slurm_ckpt.core.layout import parse_step_dirname
from slurm_ckpt.core.names import current_user, validate_key, validate_user
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import CkptError, NotFound, TierError, UsageError
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.registry import ORDER, tiers_from_config

tier_choice = click.Choice(["all", *ORDER])

user_option = click.option(
    "-u", "--user", help="Owner of the checkpoints (default: you; root: list every user's)."
)
tier_option = click.option(
    "--tier", type=tier_choice, default="all", show_default=True, help="Only this tier."
)


def _user(user: Optional[str]) -> str:
    return validate_user(user) if user else current_user()


def _selected(state: CliState, tier: str) -> Dict[str, PosixTier]:
    tiers = tiers_from_config(state.config)
    if tier == "all":
        return tiers
    if tier not in tiers:
        raise UsageError(f"--tier {tier}: tier {tier!r} is not configured")
    return {tier: tiers[tier]}


def _tokens(value: Any) -> str:
    return "-" if value is None else f"{value:,}".replace(",", "_")


STEP_COLUMNS = [
    Column("tier", "tier"),
    Column("user", "user", drop=3),
    Column("key", "key", drop=4),
    Column("step", "step", right=True),
    Column("tokens", "tokens", fmt=_tokens, right=True, drop=2),
    Column("bytes", "size", fmt=format_bytes, right=True),
    Column("files", "files", right=True, drop=5),
    Column("age_s", "age", fmt=format_duration, right=True),
    Column("job", "job", drop=1),
    Column("node", "node", drop=1),
    Column("data_version", "data", fmt=lambda v: v or "-", drop=3),
    Column("path", "path", drop=6, wrap=True),
]

SERIES_COLUMNS = [
    Column("tier", "tier"),
    Column("user", "user"),
    Column("key", "key"),
    Column("steps", "steps", right=True),
    Column("step", "newest", right=True),
    Column("bytes", "size", fmt=format_bytes, right=True),
    Column("age_s", "age", fmt=format_duration, right=True),
    Column("path", "path", drop=1, wrap=True),
]


def _series_path(t: Any, user: str, key: str) -> str:
    """Where a series lives: a directory, or an object-store prefix as a URL."""
    root = getattr(t, "root", None)
    if root is not None:
        return os.path.join(root, user, key)
    return f"s3://{t.bucket}/{t.series_prefix(user, key)}"


def _series_rows(tiers: Dict[str, PosixTier], users: Optional[List[str]]) -> List[Dict[str, Any]]:
    """One row per series per tier: step count, newest step, bytes, age of the newest."""
    now = time.time()
    rows: List[Dict[str, Any]] = []
    for name, t in tiers.items():
        try:
            names = users if users is not None else t.users()
        except (TierError, OSError):
            continue
        for u in names:
            try:
                keys = t.keys(validate_user(u))
            except (CkptError, OSError):
                continue  # another user's private directory, or not a user directory
            for k in keys:
                try:
                    steps = t.steps(u, validate_key(k))
                except (CkptError, OSError):
                    continue
                if not steps:
                    continue
                newest = steps[-1]
                rows.append(
                    {
                        "tier": name,
                        "user": u,
                        "key": k,
                        "steps": len(steps),
                        "step": newest.step,
                        "bytes": sum(s.manifest.total_bytes for s in steps),
                        "age_s": round(now - newest.manifest.wall_time, 3),
                        "path": _series_path(t, u, k),
                    }
                )
    rows.sort(key=lambda r: (r["user"], r["key"], ORDER.index(r["tier"])))
    return rows


@click.command("list")
@click.argument("key", required=False)
@user_option
@tier_option
@output_options
@pass_state
def list_cmd(
    state: CliState, key: Optional[str], user: Optional[str], tier: str, out: OutputFormat
) -> None:
    """List the committed checkpoints of KEY on each tier, or (no KEY) your series.

    Without KEY: one line per series and tier (root: every user's series; -u: that
    user's). Exit status 1 when KEY has no committed checkpoint.
    """
    tiers = _selected(state, tier)
    if key is None:
        users = [validate_user(user)] if user else (None if os.geteuid() == 0 else [current_user()])
        rows = _series_rows(tiers, users)
        if out.json:
            print_json_doc({"series": rows})
            return
        title = "checkpoint series" + (f" of {users[0]}" if users else "")
        if not rows and out.decorated:
            click.echo(f"no committed checkpoints{' of ' + users[0] if users else ''}")
            return
        Listing(SERIES_COLUMNS, rows, title).print(out)
        return
    user = _user(user)
    validate_key(key)
    rows = []
    now = time.time()
    for name, t in tiers.items():
        for s in t.steps(user, key):
            m = s.manifest
            rows.append(
                {
                    "tier": name,
                    "user": user,
                    "key": key,
                    "step": s.step,
                    "tokens": m.tokens,
                    "bytes": m.total_bytes,
                    "files": len(m.files),
                    "age_s": round(now - m.wall_time, 3),
                    "job": m.job,
                    "node": m.node,
                    "data_version": m.meta.get("data_version"),
                    "path": t.step_path(user, key, s.step),
                }
            )
    if out.json:
        print_json_doc({"user": user, "key": key, "checkpoints": rows})
        return
    if not rows:
        raise NotFound(f"no committed checkpoint for {user}/{key}")
    Listing(STEP_COLUMNS, rows, f"checkpoints of {user}/{key}").print(out)


VERIFY_COLUMNS = [
    Column("tier", "tier"),
    Column("user", "user", drop=3),
    Column("key", "key", drop=4),
    Column("step", "step", right=True),
    Column("bytes", "size", fmt=format_bytes, right=True),
    Column("seconds", "time", fmt=format_duration, right=True, drop=2),
    Column("state", "result"),
    Column("problems", "problems", fmt=lambda v: "; ".join(v[:3]) if v else "-", wrap=True),
    Column("path", "path", drop=5, wrap=True),
]


def _targets(
    state: CliState, target: str, user: Optional[str], tier: str, step: Optional[int]
) -> List[Tuple[PosixTier, str, str, int, int]]:
    """What to verify: ``(tier, user, key, step, bytes)`` for a step directory or a KEY."""
    checks: List[Tuple[PosixTier, str, str, int, int]] = []
    if os.sep in target or target.startswith("."):
        path = Path(target).absolute()
        s = parse_step_dirname(path.name)
        if s is None or not path.is_dir():
            raise CkptError(f"{target}: not a checkpoint directory (expected .../step-NNNNNNNNNN)")
        key_dir = path.parent
        t = PosixTier("path", str(key_dir.parent.parent))
        size = 0
        with contextlib.suppress(CkptError):  # verify reports it
            size = t.manifest(key_dir.parent.name, key_dir.name, s).total_bytes
        checks.append((t, key_dir.parent.name, key_dir.name, s, size))
        return checks
    user = _user(user)
    validate_key(target)
    for t in _selected(state, tier).values():
        for info in t.steps(user, target):
            if step is None or info.step == step:
                checks.append((t, user, target, info.step, info.manifest.total_bytes))
    if not checks:
        raise NotFound(
            f"no committed checkpoint for {user}/{target}"
            + (f" at step {step}" if step is not None else "")
        )
    return checks


@click.command("verify")
@click.argument("target")
@user_option
@tier_option
@click.option("-s", "--step", type=int, help="Only this step (default: every committed step).")
@output_options
@pass_state
def verify_cmd(
    state: CliState,
    target: str,
    user: Optional[str],
    tier: str,
    step: Optional[int],
    out: OutputFormat,
) -> int:
    """Re-hash every byte of TARGET (a step directory, or a KEY) against its manifest.

    Exit status 0 when everything verifies, 1 on any mismatch.
    """
    checks = _targets(state, target, user, tier, step)
    reports = []
    with ByteProgress("verify", total=sum(c[4] for c in checks)) as bar:
        for t, u, k, s, _size in checks:
            bar.set_description(f"verify {t.name} {u}/{k} step {s}")
            reports.append((t, u, k, t.verify(u, k, s, progress=bar.advance)))
    ok = all(r.ok for _t, _u, _k, r in reports)
    rows = [
        {
            "tier": t.name,
            "user": u,
            "key": k,
            "step": r.step,
            "path": t.step_path(u, k, r.step),
            "state": "OK" if r.ok else "CORRUPT",
            "ok": r.ok,
            "bytes": r.nbytes,
            "seconds": round(r.seconds, 3),
            "problems": r.problems,
        }
        for t, u, k, r in reports
    ]
    if out.json:
        print_json_doc({"ok": ok, "checkpoints": rows})
    else:
        Listing(VERIFY_COLUMNS, rows, "verify").print(out)
    return 0 if ok else 1
