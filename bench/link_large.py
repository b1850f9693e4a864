"""A large object read cold over a shaped link: the daemon's CPU per GiB against the GET
clients' own, on the same link, interleaved:

    python -m bench.link_large [--link near] [--mib 512] [--rounds 3] \\
        [--arm cache="--cache-dir {scratch}/cache"] [--arm ram=""] \\
        [--clients boto3,obstore2,obstore8]

Issue 13 asks for a large object read "at >= 0.8x the throughput of the GET client alone
on the same link, at <= 1 CPU-s per GiB". On loopback (bench.dataplane) the client's
figure is obstore's; on a link the kernel's receive work and the number of transfers in
flight change both sides, so this measures them side by side. The network is the peer
benchmark's (bench.harness: SeaweedFS behind the delay proxy in one namespace, the
readers in another, tc htb on the veth pair; root). Each round, in an order alternating
between rounds: every mount arm started afresh (its own empty scratch directory), the
page cache dropped, the object read with `dd bs=1M`, the daemon's CPU from /proc (the
write-through waited for: one second after the read); then each GET client in a
process of its own in the readers' namespace, its CPU from getrusage around the read
(all its threads; the interpreter's start-up excluded):

- boto3: one streaming GET of the whole object, read 1 MiB at a time;
- obstoreN: N parallel ranged GETs of 4 MiB (bucketfs's block size) through obstore.

Results: JSON and a table under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
BLOCK = 4 * MiB
KEY = "large/big.bin"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def client_read(kind: str, size: int) -> dict[str, float]:
    """Read the object with one GET client, in this process (run in the readers'
    namespace, with the origin's AWS_* variables); its seconds and CPU-s."""
    from bench.harness.origin import BUCKET, REGION

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    if kind == "boto3":
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)

        def read() -> int:
            body = client.get_object(Bucket=BUCKET, Key=KEY)["Body"]
            total = 0
            while chunk := body.read(MiB):
                total += len(chunk)
            return total
    elif kind.startswith("obstore"):
        import obstore
        from obstore.store import S3Store

        parallel = int(kind.removeprefix("obstore") or "8")
        store = S3Store(BUCKET, endpoint=endpoint, region=REGION,
                        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                        virtual_hosted_style_request=False,
                        client_options={"allow_http": True})

        def one(start: int) -> int:
            end = min(start + BLOCK, size)
            return len(obstore.get_range(store, KEY, start=start, end=end))

        def read() -> int:
            with ThreadPoolExecutor(parallel) as pool:
                return sum(pool.map(one, range(0, size, BLOCK)))
    else:
        raise SystemExit(f"no such client: {kind}")
    cpu, started = _cpu(), time.monotonic()
    got = read()
    seconds, used = time.monotonic() - started, _cpu() - cpu
    if got != size:
        raise SystemExit(f"{kind} read {got} of {size} bytes")
    return {"seconds": seconds, "cpu_s": used}


def _summary(rows: list[dict[str, float]], size: int) -> dict[str, Any]:
    rates = [size / MiB / r["seconds"] for r in rows]
    per_gib = [r["cpu_s"] * 1024 * MiB / size for r in rows]
    return {"MiBps": rates, "cpu_s_per_gib": per_gib,
            "MiBps_median": statistics.median(rates),
            "cpu_s_per_gib_median": statistics.median(per_gib)}


def _read_through_mount(origin: Any, work: Path, flags: str) -> dict[str, float]:
    """One cold `dd` of the object through a fresh mount with these flags."""
    from bench.harness.contenders import MountContext, _bucketfs
    from bench.harness.mounts import MountProcess
    from bench.harness.runner import drop_page_cache

    scratch = Path(tempfile.mkdtemp(dir=work))
    argv = tuple(shlex.split(flags.replace("{scratch}", str(scratch))))
    ctx = MountContext(origin.endpoint, origin.access_key, origin.secret_key,
                       work / "mnt", scratch, dict(os.environ))
    mount = MountProcess(_bucketfs(ctx, argv), scratch / "mount.log")
    mount.start(work / "mnt" / "train" / "c" / "a.jpg")
    try:
        drop_page_cache()
        cpu, started = mount.cpu_seconds(), time.monotonic()
        subprocess.run(["dd", f"if={work / 'mnt' / KEY}", "of=/dev/null", "bs=1M"],
                       check=True, capture_output=True)
        seconds = time.monotonic() - started
        time.sleep(1.0)  # the write-through to SSD, charged to the read
        return {"seconds": seconds, "cpu_s": mount.cpu_seconds() - cpu}
    finally:
        mount.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def _read_with_client(origin: Any, kind: str, mib: int) -> dict[str, float]:
    """One read of the object by a GET client, in a process in the readers' namespace."""
    from bench.harness.netlab import CLIENT_NS, in_namespace

    argv = in_namespace(CLIENT_NS, [sys.executable, "-m", "bench.link_large", "--mib",
                                    str(mib), "--client", kind])
    done = subprocess.run(argv, check=True, capture_output=True, text=True,
                          env={**os.environ, **origin.env()},
                          cwd=Path(__file__).resolve().parent.parent)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", default="near")
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arm", action="append", default=[],
                        help='NAME="mount flags" ({scratch}: the arm\'s scratch directory)')
    parser.add_argument("--clients", default="boto3,obstore2,obstore8")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: one client's read
    args = parser.parse_args()
    size = args.mib * MiB
    if args.client:
        print(json.dumps(client_read(args.client, size)))
        return

    from bench.harness.mounts import clean_stale_mounts
    from bench.harness.netlab import NetLab
    from bench.harness.origin import Origin
    from bench.harness.saving import save_results
    from bench.harness.scenarios import LINKS
    from bench.harness.stats import format_summary, summarize

    link = LINKS[args.link]
    arms = dict(arm.split("=", 1) for arm in args.arm) or {
        "bucketfs --cache-dir": "--cache-dir {scratch}/cache", "bucketfs RAM only": ""}
    clients = [c for c in args.clients.split(",") if c]
    # On disk (the SSD tier's cache directories go here), a directory of our own.
    work = Path(tempfile.mkdtemp(prefix="bucketfs-link-large-", dir="/var/tmp"))
    (work / "train" / "c").mkdir(parents=True)
    (work / "train" / "c" / "a.jpg").write_bytes(os.urandom(1000))  # what a mount waits for
    (work / "origin").mkdir()
    big = work / "big.bin"
    with big.open("wb") as out:
        for _ in range(args.mib):
            out.write(os.urandom(MiB))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in [*arms, *clients]}
    try:
        with NetLab(link), Origin(work / "origin", link.one_way_delay_ms) as origin:
            origin.upload(work / "train", [big])
            big.unlink()
            names = [*arms, *clients]
            for round_ in range(args.rounds):
                for name in names if round_ % 2 == 0 else names[::-1]:
                    if name in arms:
                        row = _read_through_mount(origin, work, arms[name])
                    else:
                        row = _read_with_client(origin, name, args.mib)
                    results[name].append(row)
                    rate = size / MiB / row["seconds"]
                    print(f"round {round_} {name}: {rate:.1f} MiB/s, "
                          f"{row['cpu_s'] * 1024 * MiB / size:.2f} CPU-s per GiB", flush=True)
    finally:
        clean_stale_mounts(work)
        shutil.rmtree(work, ignore_errors=True)
    summary = {name: _summary(rows, size) for name, rows in results.items()}
    lines = [f"Link: {link.name} ({link.rtt_ms:g} ms RTT, {link.mbit} Mbit/s); object "
             f"{args.mib} MiB, cold; {args.rounds} rounds, "
             f"interleaved. Machine: {platform.node()}, {os.cpu_count()} cores.", "",
             "| reader | MiB/s | CPU-s per GiB |", "| --- | ---: | ---: |"]
    for name, row in summary.items():
        rate, cpu = summarize(row["MiBps"]), summarize(row["cpu_s_per_gib"])
        lines.append(f"| {name} | {format_summary(rate)} | {format_summary(cpu, 2)} |")
    table = "\n".join(lines)
    print(table)
    save_results(args.out, "link-large", {"args": vars(args) | {"out": str(args.out)},
                                          "results": results, "summary": summary}, table)


if __name__ == "__main__":
    main()
