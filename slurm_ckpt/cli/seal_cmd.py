"""``ckpt-slurm seal DIR`` and ``ckpt-slurm adopt DIR --key K``: our manifest on a
checkpoint another tool wrote (ops.seal), and that sealed directory as a step of a series
on a tier (ops.adopt_sealed).

``seal`` needs no site config: the directory is wherever the trainer put it, and the
manifest goes into it. ``ckpt-slurm verify DIR`` checks it afterwards, anywhere.
``adopt`` needs the tiers: the site config, or the tier flags of a user command.
"""

from __future__ import annotations

from typing import Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state, print_json
from slurm_ckpt.cli.params import SIZE
from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.safe_text import safe_text
from slurm_ckpt.cli.table import warn
from slurm_ckpt.core.hashing import DEFAULT_CHUNK_SIZE
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import UsageError
from slurm_ckpt.ops.seal import DEFAULT_KEY, seal_dir

#: Smallest chunk a manifest may use: each chunk is one digest (32 bytes) in the manifest.
MIN_CHUNK = 64 * 2**10


@register(
    "seal",
    examples=(
        "ckpt-slurm seal out/checkpoint-500",
        "ckpt-slurm seal /scratch/alice/dcp/step-2000 --key my-run",
        "ckpt-slurm seal lightning_logs/version_0/checkpoints --step 1200",
    ),
)
@click.command("seal")
@click.argument("directory", metavar="DIR")
@click.option(
    "-k",
    "--key",
    default=DEFAULT_KEY,
    show_default=True,
    help="The key the manifest names (the series it may be adopted into).",
)
@click.option(
    "-s",
    "--step",
    type=click.IntRange(min=0),
    help="The step the manifest names (default: the number that ends DIR's name, else 0).",
)
@click.option(
    "--chunk-size",
    type=SIZE,
    default=DEFAULT_CHUNK_SIZE,
    show_default="64MiB",
    help="Bytes per hashed chunk: the finest byte range verify can name as damaged.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON.")
def seal_cmd(directory: str, key: str, step: Optional[int], chunk_size: int, as_json: bool) -> int:
    """Seal a checkpoint directory another tool wrote (DCP, HF checkpoint-N, Lightning's
    dirpath, Orbax): write our manifest into it, last and atomically.

    Every file's size and per-chunk hashes go into DIR/manifest.json; afterwards
    'ckpt-slurm verify DIR' checks every byte anywhere and names the file and byte
    range of any damage. A directory still being written (a file open for writing, files
    changing while hashed, DCP without .metadata, an HF checkpoint-N without
    trainer_state.json) is refused, as are symlinks, special files, hard links and a
    directory already sealed. Exit status 0 when sealed, 1 when refused.
    """
    if chunk_size < MIN_CHUNK or chunk_size % 4096:
        raise UsageError(f"--chunk-size: at least 64KiB and a multiple of 4KiB, got {chunk_size}")
    with ByteProgress(f"seal {directory}") as bar:
        done = seal_dir(directory, key=key, step=step, chunk_size=chunk_size, progress=bar.advance)
    m = done.manifest
    if as_json:
        print_json(
            {
                "path": done.path,
                "format": done.fmt,
                "user": m.user,
                "key": m.key,
                "step": m.step,
                "files": len(m.files),
                "bytes": m.total_bytes,
                "seconds": round(done.seconds, 3),
            }
        )
        return 0
    click.echo(
        f"sealed {safe_text(done.path, 4096)} ({done.fmt}): {len(m.files)} files, "
        f"{format_bytes(m.total_bytes)} as {m.user}/{m.key} step {m.step}"
    )
    return 0


@register(
    "adopt",
    examples=(
        "ckpt-slurm adopt out/checkpoint-500 --key my-run",
        "ckpt-slurm adopt /scratch/alice/dcp/step-2000 --key my-run --tier warm",
        "ckpt-slurm adopt out/checkpoint-500 --key my-run --local ./ckpt/local   (no site config)",
    ),
    user=True,
)
@click.command("adopt")
@click.argument("directory", metavar="DIR")
@click.option("-k", "--key", required=True, help="The series (key) to adopt DIR into.")
@click.option(
    "-s",
    "--step",
    type=click.IntRange(min=0),
    help="The step in the series (default: the step DIR was sealed with).",
)
@click.option(
    "--tier",
    type=click.Choice(["local", "pfs", "warm"]),
    default="local",
    show_default=True,
    help="The tier the step is committed on (a directory tier; warm: the PFS).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON.")
@pass_state
def adopt_cmd(
    state: CliState, directory: str, key: str, step: Optional[int], tier: str, as_json: bool
) -> int:
    """Adopt a sealed directory into one of your series, as a step flush, gc and restore
    look after.

    The files are cloned (reflink) onto the tier where its filesystem can, else copied
    in the kernel, read back against the seal's hashes, and committed under
    rank-00000/ with the manifest last: 'Checkpointer(key=K).restore_path()' hands the
    directory back. DIR stays as it is. Exit status 0 when committed, 1 when refused.
    """
    from slurm_ckpt.ops.adopt_sealed import adopt_sealed
    from slurm_ckpt.ops.tier_roots import require_roots
    from slurm_ckpt.tiers.registry import tiers_from_config

    name = "pfs" if tier == "warm" else tier
    for note in require_roots(state.config, name):
        warn(note)
    tiers = tiers_from_config(state.config)
    if name not in tiers:
        raise UsageError(f"--tier {tier}: no {name} tier is configured")
    done = adopt_sealed(directory, tiers[name], key, step)
    m = done.manifest
    if as_json:
        print_json(
            {
                "source": done.source,
                "tier": name,
                "path": done.where,
                "user": m.user,
                "key": m.key,
                "step": m.step,
                "files": len(m.files),
                "bytes": m.total_bytes,
                "cloned": done.cloned,
                "copied": done.copied,
                "seconds": round(done.seconds, 3),
            }
        )
        return 0
    how = f"{done.cloned} cloned, {done.copied} copied"
    click.echo(
        f"adopted {safe_text(done.source, 4096)} as {m.user}/{m.key} step {m.step} on "
        f"{name} ({len(m.files)} files, {format_bytes(m.total_bytes)}: {how})"
    )
    return 0
