"""``ckpt-slurm prolog|epilog|stager|install-hooks``: the root-side SLURM integration.

``prolog`` and ``epilog`` are what the SLURM Prolog/Epilog scripts (``hooks/prolog``,
``hooks/epilog``, or the ones ``install-hooks`` writes) call; they read the job from the
environment slurmd sets. ``stager`` is the per-node daemon (systemd unit
``etc/slurm-ckpt-stager.service``). All of them must run as root: they switch to the
job's user for every touch of user data.

Failures are one line (``ckpt-slurm: error: ...``) and a non-zero status. A failed prolog
also drains the node with the reason ``slurm_ckpt: prolog: <why>`` (unless an admin has
drained it already), so ``sinfo -R`` says what is wrong rather than SLURM's generic
"Prolog error"; SLURM then requeues the job, held.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state
from slurm_ckpt.cli.params import NODE, SECONDS_COMPAT, Duration
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.safe_text import LINE_LIMIT, safe_text
from slurm_ckpt.core import trust
from slurm_ckpt.core.config import load_config
from slurm_ckpt.core.names import validate_node
from slurm_ckpt.core.units import format_duration
from slurm_ckpt.errors import CkptError, ConfigError, SlurmError, UsageError
from slurm_ckpt.node.hook_record import recorded
from slurm_ckpt.ops.install import GRACE_S, install_hooks, render_hook
from slurm_ckpt.slurm.env import slurmd_nodename, this_node

log = logging.getLogger(__name__)

__all__ = [
    "GRACE_S",
    "epilog_cmd",
    "install_hooks_cmd",
    "prolog_cmd",
    "render_hook",
    "stager_cmd",
]

# --------------------------------------------------------------------------- helpers


def _setup_logging(kind: str) -> None:
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"{kind}: %(levelname)s: %(message)s"
    )


def _need_root(what: str) -> None:
    """A hook run by anyone but root is a usage error (exit 2, as the README's exit-code
    table has it for a hook run outside SLURM), not a failed operation."""
    if os.geteuid() != 0:
        raise UsageError(f"{what} must run as root (it switches to the job's user)")


def _client(timeout: float = 15.0):  # noqa: ANN202 - SlurmClient, imported lazily
    from slurm_ckpt.slurm.client import SlurmClient

    return SlurmClient(timeout=timeout)


#: A failed epilog after a failed prolog keeps the prolog's reason: it names the cause
#: (a missing or full local tier), the epilog's own failure is only its consequence.
PROLOG_REASON = "slurm_ckpt: prolog:"


def _drain_quietly(  # noqa: ANN001
    client, node: Optional[str], reason: str, keep: Optional[str] = None
) -> None:
    """Drain ``node`` with ``reason``; a drain whose reason starts with ``keep`` stays."""
    if not node:
        return
    try:
        validate_node(node)
        if keep is not None:
            current = client.node(node).reason or ""
            if current.startswith(keep):
                log.info("%s stays drained with %r", node, current)
                return
        client.drain(node, reason)
    except CkptError as exc:
        log.error("could not drain %s: %s", node, exc)


# --------------------------------------------------------------------------- commands

budget_option = click.option(
    "--budget",
    type=SECONDS_COMPAT,
    default=None,
    help="Finish within this long (100s; a plain number is seconds, as installed hook "
    "scripts pass it); hooks.budget of the config applies when it is "
    "smaller (the hook scripts pass the budget they were installed with, so lowering "
    "hooks.budget works at once; raising it needs `install-hooks` again).",
)


def _budget(cfg_budget: float, cap: Optional[float]) -> float:
    return cfg_budget if cap is None else min(cfg_budget, cap)


def _trusted_config(state: CliState) -> Any:
    """The config, once its file is known to be root's alone (a config a user can
    write would let them choose what root deletes, chowns and runs): ConfigError
    (exit 2) otherwise, with the fix."""
    from slurm_ckpt.core.config import resolve_config_path
    from slurm_ckpt.ops.install import refuse_untrusted

    path, _origin = resolve_config_path(state.config_path)
    refuse_untrusted(trust.path_problems(os.path.abspath(path), "config"))
    return state.config


def _drain_text(kind: str, exc: CkptError) -> str:
    """The drain reason of a failed hook: a node check's own message (built from the
    site's config: paths, sizes), else only the kind of failure - never an error text
    that may carry names users chose (``sinfo -R`` shows it to everyone). Printable
    ASCII, one line, at most 200 characters."""
    from slurm_ckpt.node.guard import NodeCheckFailed

    if isinstance(exc, NodeCheckFailed):
        text = str(exc)
    else:
        text = f"failed ({type(exc).__name__}); see the hook log and ckpt-slurm status"
    text = "".join(c if " " <= c <= "~" else "?" for c in text)
    return f"slurm_ckpt: {kind}: {text}"[:200]


def _hook_env(kind: str, client: Any) -> Any:
    """The job environment slurmd sets, or one line and exit 2 (usage) for both hooks:
    a missing or malformed ``$SLURM_JOB_ID`` means the hook was not run by slurmd, and
    prolog and epilog must answer that with the same code. The node is drained first
    (when its name is known), as for any failed hook."""
    from slurm_ckpt.slurm.env import hook_env

    try:
        return hook_env()
    except CkptError as exc:
        msg = f"{kind}: bad SLURM job environment: {exc}"
        _drain_quietly(client, slurmd_nodename(), f"slurm_ckpt: {msg}")
        raise UsageError(msg) from None


@register(
    "prolog",
    examples=(
        "Prolog=/etc/slurm/ckpt-hooks/prolog   (slurm.conf; the script runs: ckpt-slurm prolog "
        "--budget 100s)",
    ),
    admin=True,
)
@click.command("prolog")
@budget_option
@pass_state
def prolog_cmd(state: CliState, budget: Optional[float]) -> None:
    """SLURM Prolog (root, every node of the job): prepare the local tier or refuse.

    Exits non-zero with one reason line when the node cannot take the job (missing or
    full local tier, failed write probe, unsafe directories); the node is then drained
    with reason "slurm_ckpt: prolog: ..." and SLURM requeues the job, held.
    """
    from slurm_ckpt.hooks.prolog import PrologFailed, run_prolog

    _setup_logging("prolog")
    _need_root("ckpt-slurm prolog")
    client = _client()
    env = _hook_env("prolog", client)
    try:
        cfg = _trusted_config(state)
        with recorded(cfg, env.node or this_node(None), "prolog"):
            report = run_prolog(cfg, env, client, _budget(cfg.hooks.budget, budget))
    except CkptError as exc:
        _drain_quietly(client, slurmd_nodename(), _drain_text("prolog", exc))
        if isinstance(exc, (PrologFailed, ConfigError)):
            raise  # a bad or untrusted config keeps its exit status (2)
        raise PrologFailed(str(exc)) from None
    click.echo(safe_text(report.line(), LINE_LIMIT))


@register(
    "epilog",
    examples=(
        "Epilog=/etc/slurm/ckpt-hooks/epilog   (slurm.conf; the script runs: ckpt-slurm epilog "
        "--budget 100s)",
    ),
    admin=True,
)
@click.command("epilog")
@budget_option
@pass_state
def epilog_cmd(state: CliState, budget: Optional[float]) -> None:
    """SLURM Epilog (root, every node of the job): flush the job's checkpoints.

    What does not reach the PFS within the budget is handed to the stager and the node is
    drained with reason "slurm_ckpt: flushing N checkpoints (SIZE)" until it is done.
    """
    from slurm_ckpt.hooks.epilog import run_epilog

    _setup_logging("epilog")
    _need_root("ckpt-slurm epilog")
    client = _client()
    env = _hook_env("epilog", client)
    try:
        cfg = _trusted_config(state)
        with recorded(cfg, env.node or this_node(None), "epilog"):
            report = run_epilog(cfg, env, client, _budget(cfg.hooks.budget, budget))
    except CkptError as exc:
        _drain_quietly(client, slurmd_nodename(), _drain_text("epilog", exc), keep=PROLOG_REASON)
        raise
    click.echo(safe_text(report.line(), LINE_LIMIT))


@register(
    "stager",
    examples=(
        "systemctl enable --now slurm-ckpt-stager",
        "ckpt-slurm stager --once",
    ),
    admin=True,
)
@click.command("stager")
@click.option("--once", is_flag=True, help="One pass, then exit (1 if work remains).")
@click.option(
    "--interval",
    type=Duration(minimum=0.1),
    default="30s",
    show_default=True,
    help="Time between passes: 30s, 1min.",
)
@click.option(
    "-w",
    "--node",
    type=NODE,
    default=None,
    help="SLURM node name (default: $SLURMD_NODENAME, else the short host name).",
)
@click.option("--no-slurm", is_flag=True, help="Do not query or update SLURM (flush only).")
@pass_state
def stager_cmd(
    state: CliState, once: bool, interval: float, node: Optional[str], no_slurm: bool
) -> int:
    """Per-node daemon: finish flushes the epilog handed off, then resume the node
    (only if its drain reason is still ours)."""
    from slurm_ckpt.hooks.stager import run_stager

    _setup_logging("stager")
    _need_root("ckpt-slurm stager")
    name = this_node(node)
    client = None if no_slurm else _client()
    _trusted_config(state)  # fail now, with one line, if the config is bad or not root's

    def load() -> Any:
        _trusted_config(state)  # re-read every pass: checked every pass
        return load_config(state.config_path)

    return run_stager(
        load,
        name,
        client,
        interval=interval,
        once=once,
        emit=lambda line: click.echo(safe_text(line, LINE_LIMIT)),
    )


@register(
    "install-hooks",
    examples=(
        "ckpt-slurm install-hooks --dest /etc/slurm/ckpt-hooks --config "
        "/etc/slurm-ckpt/config.toml",
    ),
    admin=True,
)
@click.command("install-hooks")
@click.option(
    "--dest",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to write the prolog and epilog scripts into.",
)
@click.option(
    "--config",
    "config_file",
    default=None,
    metavar="FILE",
    help="Config the hooks use (default: the global --config, $SLURM_CKPT_CONFIG or "
    "/etc/slurm-ckpt/config.toml).",
)
@click.option("--log-file", default=None, metavar="FILE", help="Also log hook output here.")
@click.option(
    "--force", is_flag=True, help="Install even if the budget does not fit PrologEpilogTimeout."
)
@pass_state
def install_hooks_cmd(
    state: CliState,
    dest: Path,
    config_file: Optional[str],
    log_file: Optional[str],
    force: bool,
) -> None:
    """Write DEST/prolog and DEST/epilog calling this ckpt-slurm with that config.

    The config is validated now (a broken one would fail every job later), and when SLURM
    is reachable, hooks.budget plus the scripts' grace time is checked against
    PrologEpilogTimeout.
    """
    try:
        client: Any = _client(timeout=10.0)
    except SlurmError as exc:
        client = None
        click.echo(f"note: PrologEpilogTimeout not checked ({exc})", err=True)
    done = install_hooks(dest, config_file or state.config_path, log_file, force, client)
    if done.note:
        click.echo(f"note: {done.note}", err=True)
    prolog, epilog = done.scripts
    click.echo(
        f"installed {prolog} and {epilog} (ckpt-slurm {done.exe}, config {done.config}, "
        f"budget {format_duration(done.budget)}); slurm.conf: Prolog={prolog} "
        f"Epilog={epilog} PrologFlags=Alloc"
    )
    for tier, root in done.missing:
        click.echo(
            f"warning: the {tier} tier's root {root} does not exist on this node: create it "
            "(root-owned, mode 755) on every node that runs jobs before pointing slurm.conf "
            "at these hooks, or every prolog there refuses its job",
            err=True,
        )
    if done.unit is not None:
        click.echo(
            f"stager unit for this installation: {done.unit} (cp it to /etc/systemd/system/, "
            "then systemctl daemon-reload && systemctl enable --now slurm-ckpt-stager)"
        )
