"""What one daemon's CPU per file becomes on a many-core node, by where its threads run:

    python -m bench.placement [--files 4000] [--readers 16] [--rounds 2]
                              [--variants all,cpus4,cpus2,tokio2,cpus4+tokio2] [--out DIR]

On a 2-core VM the daemon spends ~0.45 ms of CPU per cold ~100 KB file; on a 16-core
GPU node the same benchmark measured twice that, nearly all of it on its worker threads
(docs/BENCHMARKS.md, "On a 16-core GPU node"). This runs the cold pass (`--cache-dir`,
READERS threads, a fresh mount each time) and a warm pass from the RAM tier under each
variant, interleaved ROUNDS times, on loopback SeaweedFS as bench.dataplane does:
  - all: the daemon as it starts, free to run on every core;
  - cpusN: the daemon's threads confined to N cores (the last N, away from where the
    readers start), as `bucketfs mount --cpus N` does;
  - tokioN: obstore's runtime with N worker threads (TOKIO_WORKER_THREADS, read when
    the daemon creates its first store) instead of one per core;
  - combinations joined by "+".
CPU is the daemon's (/proc/PID/stat, all threads), split by thread as bench.dataplane
does. Needs root (FUSE, drop_caches). Results: JSON and a markdown table under --out.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.dataplane import Mount, drop_page_cache, make_dataset
from bench.harness.saving import save_results
from tests.servers import S3Server


def parse_variant(name: str) -> tuple[int | None, dict[str, str]]:
    """"cpus4+tokio2" -> (4, {"TOKIO_WORKER_THREADS": "2"}); "all" -> (None, {})."""
    cpus, env = None, {}
    for part in name.split("+"):
        if part == "all":
            continue
        if part.startswith("cpus") and part[4:].isdigit() and int(part[4:]) > 0:
            cpus = int(part[4:])
        elif part.startswith("tokio") and part[5:].isdigit() and int(part[5:]) > 0:
            env["TOKIO_WORKER_THREADS"] = part[5:]
        else:
            raise ValueError(f"unknown variant part {part!r} (all, cpusN, tokioN)")
    return cpus, env


def one_variant(server: S3Server, work: Path, rel: list[str], readers: int, name: str,
                ) -> dict[str, Any]:
    cpus, env = parse_variant(name)
    args = ["--ram-cache", "2GiB", "--metadata-ttl", "forever",
            "--cache-dir", str(work / f"cache-{name}-{time.monotonic_ns()}")]
    if cpus is not None:
        args += ["--cpus", str(cpus)]
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the daemon inherits the benchmark's environment
    try:
        with Mount(server, work / "mnt", args) as mnt:
            mnt.list_tree(rel)
            cold = mnt.read_all(rel, readers)
            drop_page_cache()
            warm = mnt.read_all(rel, readers)
            allowed = len(os.sched_getaffinity(mnt.pid))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"variant": name, "daemon_cores": allowed, "cold": cold, "warm_ram": warm}


def summary(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | daemon cores | cold CPU per file (loop / workers / other) | "
             "cold files/s | warm RAM CPU per file | warm files/s |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_name.setdefault(row["variant"], []).append(row)

    def span(values: list[float], fmt: str) -> str:
        low, high = min(values), max(values)
        return format(low, fmt) if low == high else f"{low:{fmt}}-{high:{fmt}}"

    for name, runs in by_name.items():
        cold = [r["cold"] for r in runs]
        parts = {part: [c["cpu_ms_per_file_by_thread"][part] for c in cold]
                 for part in ("loop", "workers", "other")}
        median = {part: statistics.median(v) for part, v in parts.items()}
        lines.append(
            f"| {name} | {runs[0]['daemon_cores']} | "
            f"{span([c['cpu_ms_per_file'] for c in cold], '.2f')} ms "
            f"({median['loop']:.2f} / {median['workers']:.2f} / {median['other']:.2f}) | "
            f"{span([c['files_per_s'] for c in cold], ',.0f')} | "
            f"{span([r['warm_ram']['cpu_ms_per_file'] for r in runs], '.2f')} ms | "
            f"{span([r['warm_ram']['files_per_s'] for r in runs], ',.0f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4000)
    parser.add_argument("--file-kb", type=int, default=100)
    parser.add_argument("--readers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="all,cpus4,cpus2,tokio2,cpus4+tokio2")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    for name in variants:
        try:
            parse_variant(name)
        except ValueError as exc:
            parser.error(str(exc))
    rows = []
    with S3Server() as server, tempfile.TemporaryDirectory(prefix="placement-") as work:
        keys, _ = make_dataset(server, args.files, args.file_kb, 0)
        rel = [k.removeprefix("train/") for k in keys]
        random.Random(5).shuffle(rel)
        for round_ in range(args.rounds):
            for name in variants:
                row = one_variant(server, Path(work), rel, args.readers, name)
                row["round"] = round_ + 1
                rows.append(row)
                print(f"round {round_ + 1} {name}: cold {row['cold']['cpu_ms_per_file']:.2f} "
                      f"ms per file, {row['cold']['files_per_s']:,.0f} files/s", flush=True)
    result = {"machine": f"{os.cpu_count()} cores", "args": vars(args) | {"out": str(args.out)},
              "rows": rows}
    text = summary(rows)
    save_results(args.out, "placement", result, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
