"""Interleaved cold reads of one large object under mount options that differ:

    python -m bench.large_options --arm never="--huge-buffers never" \\
        --arm always="--huge-buffers always" [--ram-cache 2GiB] [--rounds 4] \\
        [--large-mib 1024] [--no-cache-dir] [--out DIR]

For a change that an option switches (step 37's huge buffers), on one tree: each round
mounts every arm afresh (order alternating between rounds), with its own empty cache
directory, drops the page cache, backs the VM's memory first (bench.fresh_memory: a VM
whose host takes freed memory back charges a first touch several times a fault), and
reads the object with `dd bs=4M`; with a cache directory it then mounts the arm again
and reads the object from the SSD tier the same way. CPU is the daemon's, from /proc,
the write-through to SSD waited for. Loopback SeaweedFS; obstore's 8 parallel 8 MiB
range GETs once per round as the GET client's own figure. Results: JSON and a table
under bench/results/.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.dataplane import (
    MiB,
    Mount,
    back_memory,
    drop_page_cache,
    make_dataset,
    obstore_large,
)
from bench.harness.saving import save_results
from tests.servers import S3Server


def run(args: argparse.Namespace) -> dict[str, Any]:
    arms = dict(arm.split("=", 1) for arm in args.arm)
    passes = ["cold", "from the SSD tier (remounted)"] if args.cache_dir else ["cold"]
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {one: [] for one in passes} for name in arms}
    rows["obstore"] = {"cold": []}
    with S3Server() as server, tempfile.TemporaryDirectory(prefix="large-options-") as work:
        _, large = make_dataset(server, 0, 100, args.large_mib)
        relative = large.removeprefix("large/")
        names = list(arms)
        for round_number in range(args.rounds):
            for name in names if round_number % 2 == 0 else names[::-1]:
                cache = Path(work) / f"cache-{round_number}-{name}"
                options = ["--ram-cache", args.ram_cache, *shlex.split(arms[name])]
                if args.cache_dir:
                    options += ["--cache-dir", str(cache)]
                for one in passes:
                    with Mount(server, Path(work) / "mnt", options, prefix="large") as mount:
                        drop_page_cache()
                        back_memory(4)
                        row = mount.dd(relative)
                    rows[name][one].append(row)
                    print(f"round {round_number} {name}, {one}: {row['mb_per_s']:.0f} MB/s, "
                          f"{row['cpu_s_per_gib']:.2f} CPU-s per GiB", flush=True)
                shutil.rmtree(cache, ignore_errors=True)
            client = obstore_large(server, large, args.large_mib * MiB)
            if client is not None:
                rows["obstore"]["cold"].append(client)
    return {"machine": f"{platform.node()}, {os.cpu_count()} cores",
            "args": vars(args) | {"out": str(args.out)}, "arms": arms, "rows": rows}


def report(results: dict[str, Any]) -> str:
    args = results["args"]
    lines = [f"{args['large_mib']} MiB object, cold, dd bs=4M, RAM tier {args['ram_cache']}"
             f"{', --cache-dir' if args['cache_dir'] else ''}; {args['rounds']} rounds, "
             f"{results['machine']}", "",
             "| arm | options | read | MB/s (median) | CPU-s per GiB: median (rounds) |",
             "| --- | --- | --- | ---: | --- |"]
    for name, by_pass in results["rows"].items():
        options = results["arms"].get(name, "(the GET client alone)")
        for one, rows in by_pass.items():
            if not rows:
                continue
            cpu = [row["cpu_s_per_gib"] for row in rows]
            lines.append(
                f"| {name} | `{options}` | {one} | "
                f"{statistics.median(row['mb_per_s'] for row in rows):.0f} | "
                f"{statistics.median(cpu):.2f} ({', '.join(f'{c:.2f}' for c in cpu)}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.large_options",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", required=True,
                        help='NAME="OPTIONS": one arm (give two or more)')
    parser.add_argument("--ram-cache", default="2GiB")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--large-mib", type=int, default=1024)
    parser.add_argument("--no-cache-dir", dest="cache_dir", action="store_false")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    results = run(args)
    text = report(results)
    print(text, end="")
    save_results(args.out, "large-options", results, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
