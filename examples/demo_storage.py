#!/usr/bin/env python3
"""Standalone storage demo (no SLURM needed): save, corrupt one byte, catch it, fall back.

1. commits checkpoints at steps 100 and 200 to a "local" tier and copies them, verified,
   to a "pfs" tier on another directory;
2. flips a single byte of step 200 on the local tier;
3. runs ``ckpt-slurm verify`` (exit 1, names the damaged byte range) and shows that the
   newest *verified* local checkpoint is now step 100, while the PFS copy of step 200 is
   still intact - so a restore would take step 200 from the PFS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier

USER, KEY = "demo", "tiny-llm"


def sh(*args: str) -> int:
    print(f"\n$ ckpt-slurm {' '.join(args)}", flush=True)
    return subprocess.run([sys.executable, "-m", "slurm_ckpt.cli.main", *args]).returncode


def main() -> int:
    base = Path(tempfile.mkdtemp(prefix="slurm-ckpt-demo-"))
    local, pfs = base / "nvme", base / "pfs"
    local.mkdir()
    pfs.mkdir()
    cfg = base / "config.toml"
    cfg.write_text(
        f'[tiers.local]\nroot = "{local}"\nrequire_mount = false\nmin_free = 0\n'
        f'[tiers.pfs]\nroot = "{pfs}"\n'
    )
    os.environ["SLURM_CKPT_CONFIG"] = str(cfg)
    tiers = {"local": PosixTier("local", str(local)), "pfs": PosixTier("pfs", str(pfs))}

    print(f"demo directories under {base}")
    for step in (100, 200):
        with tiers["local"].writer(USER, KEY, step, tokens=step * 4096) as w:
            w.write_buffers(
                {"model.bin": os.urandom(3 << 20), "optimizer.bin": os.urandom(6 << 20)}
            )
            w.commit()
        res = copy_checkpoint(tiers["local"], tiers["pfs"], USER, KEY, step)
        print(f"step {step}: committed locally, copied+verified to PFS ({res.nbytes} bytes)")
    sh("list", KEY, "--user", USER)

    victim = Path(tiers["local"].step_path(USER, KEY, 200)) / "optimizer.bin"
    with open(victim, "r+b") as fh:
        fh.seek(4_000_000)
        b = fh.read(1)
        fh.seek(4_000_000)
        fh.write(bytes([b[0] ^ 1]))
    print(f"\nflipped one bit of byte 4000000 in {victim}")

    rc = sh("verify", KEY, "--user", USER)
    print(f"(exit status {rc}: verify caught the corruption)")
    best, bad = tiers["local"].latest_verified(USER, KEY)
    pfs_best, _ = tiers["pfs"].latest_verified(USER, KEY)
    print(
        f"\nnewest verified on local: step {best.step if best else None} "
        f"(skipped: {[r.step for r in bad]})"
    )
    print(f"newest verified on pfs:   step {pfs_best.step if pfs_best else None}")
    assert rc == 1 and best is not None and best.step == 100
    assert pfs_best is not None and pfs_best.step == 200
    print(
        "\nresult: the corrupt local step 200 is never chosen; a restore takes step 200 "
        "from the PFS, and step 100 stays available locally."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
