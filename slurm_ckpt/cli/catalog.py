"""``ckpt-slurm list`` and ``ckpt-slurm verify``: what is committed where, and is it intact.

``verify`` re-reads and re-hashes every byte and exits 1 on any mismatch, so it can gate a
restart or a deletion in a script. ``list`` without a KEY lists the caller's series (as
root: every user's), so a user can discover what they have.

Output goes through :mod:`slurm_ckpt.cli.table` (``--json``, ``--parsable``,
``--noheader``, width-adaptive tables); ``verify`` shows a progress bar on a terminal.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state, print_json
from slurm_ckpt.cli.params import USER
from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.safe_text import safe_text
from slurm_ckpt.cli.table import (
    Column,
    Listing,
    OutputFormat,
    output_options,
    plural,
    warn,
)
from slurm_ckpt.core.names import current_user, validate_key, validate_user
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import NotFound, UsageError
from slurm_ckpt.ops.catalog import series_rows, step_rows, verify_targets
from slurm_ckpt.ops.damage import COMMITTED, CORRUPT, UNREADABLE
from slurm_ckpt.ops.tier_roots import require_roots
from slurm_ckpt.ops.uncommit import uncommit_damaged
from slurm_ckpt.ops.verify_path import (
    UNLISTED_NOTE,
    note_unlisted,
    unlisted_on_tier,
    verify_path,
)
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.registry import ORDER, tiers_from_config

#: ``warm`` names the warm tier whatever its kind (the PFS, or the object store).
tier_choice = click.Choice(["all", "warm", *ORDER])

user_option = click.option(
    "-u",
    "--user",
    type=USER,
    help="Owner of the checkpoints (default: you; root: list every user's).",
)
tier_option = click.option(
    "--tier", type=tier_choice, default="all", show_default=True, help="Only this tier."
)


def _user(user: Optional[str]) -> str:
    return validate_user(user) if user else current_user()


def _selected(state: CliState, tier: str) -> Dict[str, Tier]:
    asked = tier
    if tier == "warm":
        tier = state.config.tiers.warm
    for note in require_roots(state.config, None if tier == "all" else tier):
        warn(note)
    tiers = tiers_from_config(state.config)
    if tier == "all":
        return tiers
    if tier not in tiers:  # in the words the user typed
        raise UsageError(f"--tier {asked}: the {asked} tier is not configured{_warm_hint(asked)}")
    return {tier: tiers[tier]}


def _warm_hint(asked: str) -> str:
    return " (give it with --warm DIR)" if asked in ("warm", "pfs") else ""


def tier_role(name: str, config: Any) -> str:
    """A tier's name in the vocabulary users see: ``local``, ``warm`` (the tier flushes go
    to: the PFS, or the object store on a site without one), ``cold`` (the rest)."""
    if name in ("local", "warm", "partner", "ram"):
        return name
    return "warm" if name == config.tiers.warm else "cold"


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
    Column("lineage", "lineage", fmt=lambda v: v or "-"),
    Column("state", "state"),
    Column("reason", "reason", wrap=True),
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
    Column("damaged", "damaged", right=True, style=lambda t: "red" if t != "0" else None),
    Column("path", "path", drop=1, wrap=True),
]


@register(
    "list",
    examples=(
        "ckpt-slurm list",
        "ckpt-slurm list my-run",
        "ckpt-slurm list my-run -u alice --tier warm --parsable",
        "ckpt-slurm list my-run --local ./ckpt/local --warm ./ckpt/pfs   (no site config)",
    ),
    user=True,
)
@click.command("list")
@click.argument("key", required=False)
@user_option
@tier_option
@output_options
@pass_state
def list_cmd(
    state: CliState, key: Optional[str], user: Optional[str], tier: str, out: OutputFormat
) -> int:
    """List the committed checkpoints of KEY on each tier, or (no KEY) your series.

    Without KEY: one line per series and tier (root: every user's series; -u: that
    user's). Damaged step directories are listed too, with their state (CORRUPT,
    INCOMPLETE, UNREADABLE, FOREIGN) and reason. Each step names its lineage;
    "(retired)" marks a step a rollback abandoned (restore it by step and lineage).
    Exit status 1 when KEY has no
    committed checkpoint, or when a damaged step is listed.
    """
    tiers = _selected(state, tier)
    if key is None:
        users = [validate_user(user)] if user else (None if os.geteuid() == 0 else [current_user()])
        rows = series_rows(tiers, users)
        bad = sum(r["damaged"] for r in rows)
        for r in rows:
            r["role"] = tier_role(r["tier"], state.config)
        if out.json:
            print_json({"series": rows})
            return 1 if bad else 0
        for r in rows:
            if out.human:
                r["tier"] = r["role"]
        title = "checkpoint series" + (f" of {users[0]}" if users else "")
        if not rows and out.decorated:
            click.echo(f"no committed checkpoints{' of ' + users[0] if users else ''}")
            return 0
        Listing(SERIES_COLUMNS, rows, title).print(out)
        if bad and out.decorated:
            warn(f"{plural(bad, 'damaged step')}: see ckpt-slurm list KEY; exit status 1")
        return 1 if bad else 0
    user = _user(user)
    validate_key(key)
    rows = step_rows(tiers, user, key)
    bad_rows = [r for r in rows if r["state"] != COMMITTED]
    for r in rows:  # a retired step (a rollback abandoned it) says so where people look
        r["role"] = tier_role(r["tier"], state.config)
        if out.json:
            continue
        if r.get("retired"):
            r["lineage"] = f"{r['lineage']} (retired)"
        if r.get("suspect") and not r.get("reason"):  # replicas did not agree on it
            r["reason"] = r["suspect"]
        if out.human:  # the vocabulary: local, warm, cold (scripts keep the tier's name)
            r["tier"] = r["role"]
    if out.json:
        print_json({"user": user, "key": key, "checkpoints": rows})
        return 1 if bad_rows else 0
    if not rows:
        raise NotFound(f"no committed checkpoint for {user}/{key}")
    Listing(STEP_COLUMNS, rows, f"checkpoints of {user}/{key}").print(out)
    if bad_rows and out.decorated:
        warn(f"{plural(len(bad_rows), 'damaged step')} (see state and reason): exit status 1")
    return 1 if bad_rows else 0


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


#: ``verify``'s state for a checkpoint whose listed bytes verify but whose directory also
#: holds files the manifest does not list.
UNLISTED = "UNLISTED"


def _result_state(ok: bool, problems: List[str]) -> str:
    """OK, or why not: a read refused for permissions is UNREADABLE, not CORRUPT."""
    if ok:
        return "OK"
    if problems and all("permission denied" in p for p in problems):
        return UNREADABLE
    if problems and all(p.endswith(": " + UNLISTED_NOTE) for p in problems):
        return UNLISTED  # the listed bytes verify; the directory holds more than them
    return CORRUPT


def _is_path(target: str) -> bool:
    return os.sep in target or target.startswith(".")


def _verify_path(target: str, streams: int, out: OutputFormat) -> int:
    """``verify PATH``: any checkpoint directory, wherever it is (see ops.verify_path)."""
    size: List[int] = []
    with ByteProgress(f"verify {target}") as bar:
        res = verify_path(target, streams, progress=bar.advance, expected_size=size)
    rep, m = res.report, res.manifest
    row = {
        "tier": "path",
        "user": None if m is None else m.user,
        "key": None if m is None else m.key,
        "step": None if m is None else m.step,
        "path": res.path,
        "state": _result_state(rep.ok, rep.problems),
        "ok": rep.ok,
        "bytes": rep.nbytes,
        "seconds": round(rep.seconds, 3),
        "problems": rep.problems + res.notes,
        "moved": res.moved,
        "origin": res.origin,
    }
    if out.json:
        print_json({"ok": rep.ok, "checkpoints": [row]})
    else:
        Listing(VERIFY_COLUMNS, [row], "verify").print(out)
        if out.human:
            # The table shows the first problems; every one gets its own line too: the
            # file and, for damaged content, the byte range of each chunk that differs.
            for problem in rep.problems:
                click.echo(f"{row['state']}: {safe_text(problem, 4096)}")
    return 0 if rep.ok else 1


@register(
    "verify",
    examples=(
        "ckpt-slurm verify my-run",
        "ckpt-slurm verify my-run --step 4000 --tier warm",
        "ckpt-slurm verify /lustre/checkpoints/alice/my-run/step-0000004000",
        "ckpt-slurm verify my-run --local ./ckpt/local   (no site config)",
    ),
    user=True,
)
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
    """Re-hash every byte of TARGET (a KEY, or a checkpoint directory anywhere) against
    its manifest.

    A KEY: every step on every tier, damaged step directories included (CORRUPT,
    INCOMPLETE, UNREADABLE, FOREIGN, with the reason). A directory: wherever it is (a
    copy that was moved says so); a missing path, a symlink and a permission problem
    each get their own message. Exit status 0 when everything verifies, 1 otherwise.

    A damaged copy on the warm tier, checked by its owner or root, is uncommitted there
    (manifest.json.damaged): nodes still holding the checkpoint flush it again.
    """
    if _is_path(target):
        given = [
            flag
            for flag, value in (("--step", step), ("--user", user), ("--tier", tier != "all"))
            if value not in (None, False)
        ]
        if given:
            raise UsageError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to a KEY; "
                f"{target} is one checkpoint directory "
                f"(its manifest names its user, key and step)"
            )
        return _verify_path(target, 4, out)
    checks, broken = verify_targets(_selected(state, tier), target, _user(user), step)
    reports = []
    with ByteProgress("verify", total=sum(c[4] for c in checks)) as bar:
        for t, u, k, s, size in checks:
            bar.set_description(f"verify {t.name} {u}/{k} step {s}")
            rep = t.verify(u, k, s, progress=bar.advance)
            note_unlisted(rep, unlisted_on_tier(t, u, k, s))
            reports.append((t, u, k, rep, size))
    rows: List[Dict[str, Any]] = []
    notes: List[str] = []
    for t, u, k, r, size in reports:
        row = {
            "tier": t.name,
            "user": u,
            "key": k,
            "step": r.step,
            "path": t.location(u, k, r.step),
            "state": _result_state(r.ok, r.problems),
            "ok": r.ok,
            "bytes": r.nbytes,
            "seconds": round(r.seconds, 3),
            "problems": list(r.problems),
        }
        # A damaged warm copy is taken out of use, so that the nodes holding the
        # checkpoint flush it again (ops.uncommit): by its owner or root only.
        done = (
            uncommit_damaged(state.config, t, u, k, r.step, size)
            if row["state"] == CORRUPT
            else None
        )
        if done is not None:
            row["uncommitted"] = done.done
            row["problems"].append(done.note)
            notes.append(f"{tier_role(t.name, state.config)} {u}/{k} step {r.step}: {done.note}")
        rows.append(row)
    rows += [
        dict(d.to_dict(), tier=name, ok=False, bytes=0, seconds=0.0, problems=[d.reason])
        for name, d in broken
    ]
    rows.sort(key=lambda r: (ORDER.index(r["tier"]) if r["tier"] in ORDER else 99, r["step"] or 0))
    for r in rows:
        r.pop("reason", None)
        r["role"] = tier_role(r["tier"], state.config)
    ok = all(r["ok"] for r in rows)
    if out.json:
        print_json({"ok": ok, "checkpoints": rows})
    else:
        for r in rows:
            if out.human:  # the vocabulary, as in list (scripts keep the tier's name)
                r["tier"] = r["role"]
        Listing(VERIFY_COLUMNS, rows, "verify").print(out)
        if out.human:
            for note in notes:
                click.echo(safe_text(note, 4096))
    return 0 if ok else 1
