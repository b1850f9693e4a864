"""What one read of the SSD tier's index costs at N entries, with its Bloom filters and
without:

    python -m bench.index_gets [--entries 1000000] [--reads 20000] [--rounds 8]

Writes N block records (keys shaped as `schema.entry_name` makes them: origin, an
ImageNet-like key, ETag, size, span; 60-byte values) into a fresh raw-mode RocksDB
opened with `index_options()` (the daemon's) and into one with RocksDB's defaults
(no filters), in write batches of 10,000, flushed to SST files; then times
READS `get`s of keys it holds (a hit's lookup) and of keys it does not (a cold block's
`DiskTier.holds`), CPU per get (`time.process_time`), the two indexes in alternation,
the best of ROUNDS rounds each. The files stay in the page cache: what is measured is
RocksDB's work, not the disk. Prints a table; JSON under --out.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from rocksdict import Options, Rdict, WriteBatch

from bench.harness.saving import save_results
from bucketfs.cache.index_options import index_options

SOURCE = "s3://dataset/train"


def record_key(i: int, version: str = "etag") -> bytes:
    size = 110_000 + i % 5000
    return (f"E{SOURCE}\0train/n{i % 1000:08d}/n{i:08d}_{i}.JPEG\0\"{version}{i:032x}\"\0"
            f"{size}\0{0}\0{size}").encode()


def fill(directory: Path, options: Options, entries: int) -> Rdict:
    index = Rdict(str(directory), options)
    value = os.urandom(60)
    batch = WriteBatch(raw_mode=True)
    for i in range(entries):
        batch.put(record_key(i), value)
        if i % 10_000 == 9_999:
            index.write(batch)
            batch = WriteBatch(raw_mode=True)
    index.write(batch)
    index.flush()
    return index


def timed(index: Rdict, keys: list[bytes]) -> float:
    """µs of CPU per get of `keys`."""
    began = time.process_time()
    for key in keys:
        index.get(key)
    return (time.process_time() - began) / len(keys) * 1e6


def run(entries: int, reads: int, rounds: int) -> list[dict[str, Any]]:
    """Both indexes built first, then timed in alternation (this machine's speed drifts
    more between minutes than the difference measured), the best round of each kept."""
    rng = random.Random(1)
    held = [record_key(i) for i in rng.sample(range(entries), min(reads, entries))]
    absent = [record_key(i, "other") for i in rng.sample(range(entries), min(reads, entries))]
    configs = (("Bloom filters (index_options)", index_options()),
               ("RocksDB defaults, no filters", Options(raw_mode=True)))
    with tempfile.TemporaryDirectory(prefix="index-gets-") as directory:
        indexes = [fill(Path(directory) / str(n), options, entries)
                   for n, (_, options) in enumerate(configs)]
        try:
            best = [{"held_us": float("inf"), "absent_us": float("inf")} for _ in configs]
            for round_ in range(rounds):
                order = range(len(configs)) if round_ % 2 == 0 else reversed(range(len(configs)))
                for n in order:
                    for measure, keys in (("held_us", held), ("absent_us", absent)):
                        best[n][measure] = min(best[n][measure], timed(indexes[n], keys))
        finally:
            for index in indexes:
                index.close()
    return [{"index": name, "entries": entries, **row}
            for (name, _), row in zip(configs, best, strict=True)]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| index | entries | µs per get, key held | µs per get, key absent |",
             "| --- | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['index']} | {row['entries']:,} | {row['held_us']:.2f} "
                     f"| {row['absent_us']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.index_gets",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    rows = run(args.entries, args.reads, args.rounds)
    text = table(rows)
    print(text, end="")
    save_results(args.out, "index-gets", {"rows": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
