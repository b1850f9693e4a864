"""What hints cost the daemon in a cold epoch, by what the job tells it:

    python -m bench.hinted_cost [--files 2000] [--readers 16] [--rounds 3]
                                [--ram-cache 2GiB] [--out DIR]

On loopback SeaweedFS, as bench.dataplane: FILES objects of ~100 KB, read cold by
READERS threads in a shuffled order through a fresh `--cache-dir` mount, the daemon's
CPU taken once it is idle (its prefetch and packing included), three arms interleaved
ROUNDS times:
  - no hints;
  - the order: the epoch's order sent first (`send_order`), as any hinted job does;
  - the order and the next: the next epoch's order announced too (`send_next_order`),
    as HintSampler does for a DistributedSampler, so what is read now may be laid out
    on SSD in that order.
With a RAM tier that holds every file (the default 2 GiB) the next epoch reads RAM and
nothing is laid out; with one smaller than the files (e.g. --ram-cache 64MiB) the
third arm packs. Needs root (FUSE). Results: JSON and a markdown table under --out.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.dataplane import Mount, make_dataset
from bench.harness.saving import save_results
from bucketfs.hints import send_next_order
from tests.servers import S3Server

ARMS = ("no hints", "the order", "the order and the next")


def one_pass(server: S3Server, work: Path, arm: str, now: list[str], later: list[str],
             readers: int, ram: str) -> dict[str, Any]:
    args = ["--ram-cache", ram, "--metadata-ttl", "forever",
            "--cache-dir", str(work / f"cache-{time.monotonic_ns()}")]
    with Mount(server, work / "mnt", args) as mnt:
        mnt.list_tree(now)
        where = str(mnt.mountpoint)

        def begin() -> None:
            if arm == "no hints":
                return
            nexts = arm == "the order and the next"
            mnt.send_order(now, next_follows=nexts)
            if nexts and not send_next_order([f"{where}/{name}" for name in later], epoch=1,
                                             mount=where, strict=True):
                raise RuntimeError("the daemon refused the next order")

        return mnt.read_all(now, readers, begin=begin, idle=True)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| arm | CPU per file, median (all) | loop / workers / other, median | "
             "files/s, median |", "| --- | --- | --- | ---: |"]
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        cpu = [r["cpu_ms_per_file"] for r in mine]
        parts = [statistics.median(r["cpu_ms_per_file_by_thread"][p] for r in mine)
                 for p in ("loop", "workers", "other")]
        lines.append(
            f"| {arm} | {statistics.median(cpu):.2f} ms "
            f"({', '.join(f'{c:.2f}' for c in cpu)}) | "
            f"{' / '.join(f'{p:.2f}' for p in parts)} | "
            f"{statistics.median(r['files_per_s'] for r in mine):,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hinted_cost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--readers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ram-cache", default="2GiB")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    rows = []
    with S3Server() as server, tempfile.TemporaryDirectory(prefix="hinted-cost-") as work:
        keys, _ = make_dataset(server, args.files, 100, 0)
        now = [k.removeprefix("train/") for k in keys]
        random.Random(5).shuffle(now)
        later = list(now)
        random.Random(6).shuffle(later)
        for round_ in range(args.rounds):
            for arm in ARMS:
                row = one_pass(server, Path(work), arm, now, later, args.readers,
                               args.ram_cache)
                rows.append({"arm": arm, "round": round_ + 1, **row})
                print(f"round {round_ + 1}, {arm}: {row['cpu_ms_per_file']:.2f} ms per file",
                      flush=True)
    text = table(rows)
    save_results(args.out, "hinted-cost", {"args": vars(args) | {"out": str(args.out)},
                                           "rows": rows}, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
