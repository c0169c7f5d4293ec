"""``ckpt-slurm seal DIR``: our manifest on a checkpoint another tool wrote (ops.seal).

No site config is needed: the directory is wherever the trainer put it, and the manifest
goes into it. ``ckpt-slurm verify DIR`` checks it afterwards, anywhere.
"""

from __future__ import annotations

from typing import Optional

import click

from slurm_ckpt.cli.output import print_json
from slurm_ckpt.cli.params import SIZE
from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.safe_text import safe_text
from slurm_ckpt.core.hashing import DEFAULT_CHUNK_SIZE
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import UsageError
from slurm_ckpt.ops.seal import DEFAULT_KEY, seal_dir

#: Smallest chunk a manifest may use: each chunk is one digest (32 bytes) in the manifest.
MIN_CHUNK = 64 * 2**10


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
