#!/usr/bin/env python3
"""Object tier benchmark: our upload and download of a checkpoint against boto3's own
``upload_file``/``download_file`` (their defaults) and, when it is installed, against AWS's
CRT client as PyTorch users meet it (s3torchconnector's ``S3Checkpoint`` writer and
reader), all on the same SeaweedFS, in one run.

Claims, with our verification included (the upload hashes every chunk against the
manifest and the store checks each part's CRC32 before the manifest is written; the
download hashes every chunk as it lands and commits the copy: fsync, manifest last):

* issue "object tier": throughput ours / boto3 >= 1.0 both ways;
* issue "restore that scales": time ours / CRT <= 0.8 for the upload and <= 0.5 for the
  download (s3torchconnector 1.5: ``pip install s3torchconnector==1.5.0``; without it
  these two claims are reported as not run).

Method: the checkpoint (``--size`` bytes in ``--files`` files) is committed on a tmpfs
"local" tier; downloads land on another tmpfs, so neither side waits for a local disk.
The server (``scripts/s3-server``, 127.0.0.1 only) keeps its data on this machine's disk.
Rounds alternate which side goes first; objects are deleted between rounds. The figure is
the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
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

import boto3  # noqa: E402
from claims import claim  # noqa: E402

try:  # the CRT baseline is optional: the benchmark says so when it is missing
    from s3torchconnector import S3Checkpoint, S3ClientConfig
except ImportError:  # pragma: no cover - depends on the machine
    S3Checkpoint = None

from slurm_ckpt.core.units import format_bytes, parse_size  # noqa: E402
from slurm_ckpt.tiers.copy import copy_checkpoint  # noqa: E402
from slurm_ckpt.tiers.posix import PosixTier  # noqa: E402
from slurm_ckpt.tiers.s3 import S3Tier  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def sh(*args: str, env: dict = None) -> str:  # type: ignore[assignment]
    return subprocess.run(args, check=True, capture_output=True, text=True, env=env).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--part-size", default="16MiB", help="tiers.object.part_size")
    ap.add_argument("--concurrency", type=int, default=8, help="tiers.object.concurrency")
    ap.add_argument("--chunk-size", default="64MiB", help="copy.chunk_size (hash chunks)")
    ap.add_argument("--quick", action="store_true", help="256 MiB, 3 rounds")
    ap.add_argument("--no-crt", action="store_true", help="skip the s3torchconnector baseline")
    ap.add_argument("--json", metavar="PATH", help="write the figures (and claims) here")
    a = ap.parse_args()
    if a.quick:
        a.size, a.rounds = "256MiB", 3
    size = parse_size(a.size)
    work = Path(tempfile.mkdtemp(prefix="bench-s3-", dir="/var/tmp"))
    mnts = [work / "src", work / "dst"]
    env = dict(os.environ, SLURM_CKPT_VENV=sys.prefix, S3_SERVER_DIR=str(work / "server"))
    started = False
    try:
        for m in mnts:
            m.mkdir()
            sh("mount", "-t", "tmpfs", "-o", f"size={size * 3 + 2**28}", "tmpfs", str(m))
        envfile = sh("bash", str(REPO / "scripts/s3-server"), "start", env=env).split()[-1]
        started = True
        creds = dict(line.split("=", 1) for line in Path(envfile).read_text().split())
        os.environ.update({k: creds[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
        client = boto3.client(
            "s3", endpoint_url=creds["S3_ENDPOINT"], region_name="us-east-1"
        )  # boto3's defaults, as a user would write it
        client.create_bucket(Bucket="bench")
        crt = None
        if S3Checkpoint is not None and not a.no_crt:
            crt = S3Checkpoint(
                "us-east-1",
                endpoint=creds["S3_ENDPOINT"],
                s3client_config=S3ClientConfig(force_path_style=True),
            )
        chunk = parse_size(a.chunk_size)
        local = PosixTier("local", str(mnts[0]), chunk_size=chunk)
        per = size // a.files
        with local.writer("bench", "k", 1) as w:
            w.write_buffers({f"shard-{i}.bin": os.urandom(per) for i in range(a.files)})
        m = local.manifest("bench", "k", 1)
        files = [str(mnts[0] / "bench/k/step-0000000001" / e.path) for e in m.files]
        total = m.total_bytes
        ups: list = []
        sides = ("ours", "theirs") + (("crt",) if crt is not None else ())
        cpu: dict = {(u, n): [] for u in (True, False) for n in sides}
        downs: list = []
        crt_ups: list = []
        crt_downs: list = []
        load_before = os.getloadavg()[0]
        for r in range(a.rounds):
            obj = S3Tier(
                "object",
                endpoint=creds["S3_ENDPOINT"],
                bucket="bench",
                prefix=f"ours-{r}",
                part_size=parse_size(a.part_size),
                concurrency=a.concurrency,
                chunk_size=chunk,
            )
            dst_root = mnts[1] / f"ours-{r}"
            dst_root.mkdir()
            dst = PosixTier("restore", str(dst_root))

            def ours_up(obj: S3Tier = obj) -> None:
                copy_checkpoint(local, obj, "bench", "k", 1)

            def theirs_up(r: int = r) -> None:
                for f in files:
                    client.upload_file(f, "bench", f"theirs-{r}/{os.path.basename(f)}")

            def ours_down(obj: S3Tier = obj, dst: PosixTier = dst) -> None:
                copy_checkpoint(obj, dst, "bench", "k", 1)

            def theirs_down(r: int = r) -> None:
                for f in files:
                    name = os.path.basename(f)
                    client.download_file(
                        "bench", f"theirs-{r}/{name}", str(mnts[1] / f"theirs-{r}-{name}")
                    )

            def crt_up(r: int = r) -> None:
                assert crt is not None
                for f in files:
                    uri = f"s3://bench/crt-{r}/{os.path.basename(f)}"
                    with open(f, "rb") as src, crt.writer(uri) as w:
                        while True:  # 8 MiB pieces, as a torch.save into it writes
                            piece = src.read(8 * 2**20)
                            if not piece:
                                break
                            w.write(piece)

            def crt_down(r: int = r) -> None:
                assert crt is not None
                for f in files:
                    name = os.path.basename(f)
                    reader = crt.reader(f"s3://bench/crt-{r}/{name}")
                    with open(mnts[1] / f"crt-{r}-{name}", "wb") as out_f:
                        while True:
                            piece = reader.read(8 * 2**20)
                            if not piece:
                                break
                            out_f.write(piece)

            pairs = [
                (ours_up, theirs_up, crt_up, ups, crt_ups),
                (ours_down, theirs_down, crt_down, downs, crt_downs),
            ]
            for ours, theirs, crt_fn, out, crt_out in pairs:
                order = [("ours", ours), ("theirs", theirs)]
                if crt is not None:
                    order.append(("crt", crt_fn))
                shift = r % len(order)  # each side goes first in turn
                order = order[shift:] + order[:shift]
                t = {}
                for name, fn in order:
                    subprocess.run(["sync"], check=True)
                    c0 = os.times()
                    t0 = time.perf_counter()
                    fn()
                    t[name] = time.perf_counter() - t0
                    c1 = os.times()
                    cpu[(out is ups, name)].append(c1.user + c1.system - c0.user - c0.system)
                out.append((t["ours"], t["theirs"]))
                if crt is not None:
                    crt_out.append((t["ours"], t["crt"]))
                print(
                    f"round {r + 1} {'upload' if out is ups else 'download'}: ours "
                    f"{t['ours']:.2f}s, boto3 {t['theirs']:.2f}s"
                    + (f", CRT {t['crt']:.2f}s" if crt is not None else ""),
                    file=sys.stderr,
                    flush=True,
                )
            assert dst.verify("bench", "k", 1).ok
            obj.delete("bench", "k", 1)
            shutil.rmtree(dst_root)
            for f in files:
                client.delete_object(Bucket="bench", Key=f"theirs-{r}/{os.path.basename(f)}")
                Path(mnts[1] / f"theirs-{r}-{os.path.basename(f)}").unlink()
                if crt is not None:
                    client.delete_object(Bucket="bench", Key=f"crt-{r}/{os.path.basename(f)}")
                    Path(mnts[1] / f"crt-{r}-{os.path.basename(f)}").unlink()

        def summary(rows: list) -> dict:
            ratios = [th / ou for ou, th in rows]  # throughput ours / theirs
            up = rows is ups
            return {
                # This process's CPU (all threads) per GiB moved: the client's share of
                # the machine, which the server (on the same cores here) does not get.
                "ours_cpu_s_per_GiB": round(
                    statistics.median(cpu[(up, "ours")]) * 2**30 / total, 2
                ),
                "boto3_cpu_s_per_GiB": round(
                    statistics.median(cpu[(up, "theirs")]) * 2**30 / total, 2
                ),
                "ours_MBps": [round(total / ou / 1e6) for ou, _ in rows],
                "boto3_MBps": [round(total / th / 1e6) for _, th in rows],
                "ratio_median": round(statistics.median(ratios), 2),
                "ratios": [round(x, 2) for x in ratios],
            }

        doc = {
            "bytes": total,
            "files": a.files,
            "rounds": a.rounds,
            "part_size": parse_size(a.part_size),
            "concurrency": a.concurrency,
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "upload": summary(ups),
            "download": summary(downs),
            "claims": [
                claim(
                    f"s3_{what}_vs_boto3",
                    [th / ou for ou, th in rows],
                    ours_s=[ou for ou, _ in rows],
                    baseline_s=[th for _, th in rows],
                    what=(
                        f"object tier {what} of {format_bytes(total)} ({a.files} files), "
                        + (
                            "every chunk hashed against the manifest, CRC32 per part "
                            "checked by the store, manifest last (throughput)"
                            if what == "upload"
                            else "every chunk hashed as it lands, committed (throughput)"
                        )
                    ),
                    baseline=f"boto3 {what}_file with its defaults, same server",
                    target=1.0,
                    cmp=">=",
                )
                for what, rows in (("upload", ups), ("download", downs))
            ]
            + [
                claim(
                    f"s3_{what}_vs_crt",
                    [ou / th for ou, th in rows],
                    ours_s=[ou for ou, _ in rows],
                    baseline_s=[th for _, th in rows],
                    what=f"object tier {what} of {format_bytes(total)} ({a.files} files), "
                    "verified as above (time)",
                    baseline=f"s3torchconnector 1.5 S3Checkpoint {what} (AWS CRT), same server",
                    target=target,
                    cmp="<=",
                )
                for what, rows, target in (("upload", crt_ups, 0.8), ("download", crt_downs, 0.5))
                if rows
            ],
        }
        if crt is not None:
            for what, rows in (("upload", crt_ups), ("download", crt_downs)):
                doc[what]["crt_MBps"] = [round(total / th / 1e6) for _, th in rows]
                doc[what]["crt_cpu_s_per_GiB"] = round(
                    statistics.median(cpu[(what == "upload", "crt")]) * 2**30 / total, 2
                )
        if a.json:
            Path(a.json).write_text(json.dumps(doc, indent=1))
        print(f"checkpoint: {format_bytes(total)} in {a.files} files, {a.rounds} rounds")
        for what in ("upload", "download"):
            d = doc[what]
            print(
                f"{what:8s} ours {d['ours_MBps']} MB/s, boto3 {d['boto3_MBps']} MB/s, "
                f"throughput ratio median {d['ratio_median']} (target >= 1.0) "
                f"rounds {d['ratios']}; client CPU {d['ours_cpu_s_per_GiB']} vs "
                f"{d['boto3_cpu_s_per_GiB']} s/GiB"
            )
        for c in doc["claims"]:
            if c["name"].endswith("_vs_crt"):
                print(
                    f"{c['name']}: time ours / CRT median {c['median']:.2f} "
                    f"(target <= {c['target']}) {c['verdict']}"
                )
        if crt is None:
            print("CRT baseline not run (pip install s3torchconnector==1.5.0, or --no-crt given)")
        print(f"load average (1 min): {load_before:.2f} before, {doc['load_after']:.2f} after")
        return 0 if all(c["verdict"] == "PASS" for c in doc["claims"]) else 1
    finally:
        if started:
            subprocess.run(
                ["bash", str(REPO / "scripts/s3-server"), "stop"], env=env, capture_output=True
            )
        for m in mnts:
            subprocess.run(["umount", str(m)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
