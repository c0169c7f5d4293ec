#!/usr/bin/env python3
"""Storage benchmarks: our commit and copy against dd and cp, side by side in one run.

Claims checked (issue "Foundation"):
  * committing a checkpoint of N files (hashes included) to the local tier takes at most
    1.15x the time of ``dd bs=16M conv=fsync`` writing the same bytes;
  * copying it local -> PFS (another filesystem) with verification takes at most 1.1x the
    time of ``cp -r`` followed by ``sync``.

Method: the payload lives in memory (and, for dd, in a tmpfs file, so dd's input is a
memory copy too). Rounds alternate which side goes first; before every timed run the page
cache is synced and, when we may, dropped, so that both sides start from the same state.
The figure reported is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurm_ckpt.core.units import format_bytes, parse_size  # noqa: E402
from slurm_ckpt.tiers.copy import copy_checkpoint  # noqa: E402
from slurm_ckpt.tiers.posix import PosixTier  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from claims import claim  # noqa: E402


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError:
        pass  # not root: both sides still start after the same sync


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    drop_caches()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def commit_payload(local: PosixTier, step: int, payload: list) -> None:
    with local.writer("bench", "k", step) as w:
        w.write_buffers({f"shard-{i}.bin": p for i, p in enumerate(payload)})
        w.commit()


def cp_and_sync(src: str, dst: Path) -> None:
    subprocess.run(["cp", "-r", src, str(dst)], check=True)
    subprocess.run(["sync"], check=True)


class LoopFS:
    """A loop-mounted ext4 image: a 'PFS' on a different filesystem than the local tier."""

    def __init__(self, workdir: Path, size: int) -> None:
        self.img = workdir / "pfs.img"
        self.mnt = workdir / "pfs"
        self.mnt.mkdir()
        with open(self.img, "wb") as fh:
            fh.truncate(size)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(self.img)], check=True)
        subprocess.run(["mount", "-o", "loop", str(self.img), str(self.mnt)], check=True)

    def close(self) -> None:
        subprocess.run(["umount", str(self.mnt)], check=False)
        self.img.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local", help="local tier directory (default: a temp dir under /var/tmp)")
    ap.add_argument("--pfs", help="PFS directory on another filesystem (default: loop ext4)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()

    size = parse_size(args.size)
    per_file = size // args.files
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="/var/tmp"))
    loop = None
    try:
        local_root = Path(args.local) if args.local else work / "local"
        local_root.mkdir(parents=True, exist_ok=True)
        if args.pfs:
            pfs_root = Path(args.pfs)
        else:
            if os.geteuid() != 0:
                print("bench: --pfs DIR is required when not root", file=sys.stderr)
                return 2
            loop = LoopFS(work, 2 * size + 512 * 2**20)
            pfs_root = loop.mnt
        shm = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm"))
        payload = [bytearray(os.urandom(per_file)) for _ in range(args.files)]
        src_file = shm / "payload.bin"
        with open(src_file, "wb") as fh:
            for p in payload:
                fh.write(p)
        local = PosixTier("local", str(local_root))
        pfs = PosixTier("pfs", str(pfs_root))
        rows = {"commit": [], "copy": []}
        for r in range(args.rounds):
            step = r + 1
            dd_out = local_root / "dd.out"

            run_dd = functools.partial(
                subprocess.run,
                ["dd", f"if={src_file}", f"of={dd_out}", "bs=16M", "conv=fsync"],
                check=True,
                capture_output=True,
            )
            run_commit = functools.partial(commit_payload, local, step, payload)
            order = [("dd", run_dd), ("ours", run_commit)]
            if r % 2:
                order.reverse()
            t = {name: timed(fn) for name, fn in order}
            dd_out.unlink()
            rows["commit"].append(t)

            cp_dst = pfs_root / "cp-copy"
            src_dir = local.step_path("bench", "k", step)

            run_cp = functools.partial(cp_and_sync, src_dir, cp_dst)
            run_copy = functools.partial(copy_checkpoint, local, pfs, "bench", "k", step)
            order = [("cp", run_cp), ("ours", run_copy)]
            if r % 2:
                order.reverse()
            t = {name: timed(fn) for name, fn in order}
            shutil.rmtree(cp_dst)
            pfs.delete("bench", "k", step)
            local.delete("bench", "k", step)
            rows["copy"].append(t)
            print(
                f"round {r + 1}: commit {rows['commit'][-1]['ours']:.2f}s vs dd "
                f"{rows['commit'][-1]['dd']:.2f}s; copy {t['ours']:.2f}s vs cp+sync {t['cp']:.2f}s",
                flush=True,
            )
        shutil.rmtree(shm)
        result = {
            "size_bytes": size,
            "files": args.files,
            "rounds": args.rounds,
            "commit_vs_dd": statistics.median(x["ours"] / x["dd"] for x in rows["commit"]),
            "copy_vs_cp_sync": statistics.median(x["ours"] / x["cp"] for x in rows["copy"]),
            "raw": rows,
            "claims": [
                claim(
                    "commit_vs_dd",
                    [x["ours"] / x["dd"] for x in rows["commit"]],
                    ours_s=[x["ours"] for x in rows["commit"]],
                    baseline_s=[x["dd"] for x in rows["commit"]],
                    what=f"commit {format_bytes(size)} in {args.files} files, hashed",
                    baseline="dd bs=16M conv=fsync of the same bytes",
                    target=1.15,
                ),
                claim(
                    "copy_vs_cp_sync",
                    [x["ours"] / x["cp"] for x in rows["copy"]],
                    ours_s=[x["ours"] for x in rows["copy"]],
                    baseline_s=[x["cp"] for x in rows["copy"]],
                    what="copy local -> PFS, verified, committed",
                    baseline="cp -r + sync",
                    target=1.10,
                ),
            ],
        }
        limits = {"commit_vs_dd": 1.15, "copy_vs_cp_sync": 1.10}
        print(
            f"\nstorage benchmark: {format_bytes(size)} in {args.files} files, median of "
            f"{args.rounds} rounds"
        )
        ok = True
        for k, lim in limits.items():
            verdict = "PASS" if result[k] <= lim else "FAIL"
            ok &= verdict == "PASS"
            print(f"  {k:18s} ratio {result[k]:.3f}  (target <= {lim})  {verdict}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0 if ok else 1
    finally:
        if loop:
            loop.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
