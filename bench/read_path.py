"""The daemon's Python read path in one process, without FUSE or a server:

    python -m bench.read_path [--files 2000] [--rounds 15] [--out DIR]

FILES objects of ~100 KB (one block each) in an in-memory bucket, read through
`fs.Operations.read` as the kernel asks when it opens files itself (a read at offset 0
starts a file), over the mount's own parts: namespace, reader, block cache, RAM tier
under the hinted eviction policy, hinted prefetch told of every open (as on a mount,
where hints are on by default). Four passes:
  - cold: every file fetched from the in-memory bucket (a worker thread each), the
    RAM tier emptied before each round;
  - cold, the order sent first: as a job with HintSampler reads, the round's order
    given to hinted prefetch just before the reads (resolved, planned and prefetched
    while they go on; the pass ends when the last prefetch has);
  - warm: every file again from the RAM tier, its read state kept;
  - warm, inode not seen before: the read states dropped first, so each read looks its
    inode up in the index (the first read of a file after a listing);
  - warm, name looked up first: the read states dropped, and each read preceded by a
    LOOKUP of its name, as the kernel asks when it opens a path it has no entry for.
For each: Python function calls per read (cProfile's count over ROUNDS passes, which
moves by a call or so between runs where CPU time moves by tens of percent, so two trees
compare on a noisy machine), and CPU per read (`time.process_time`, min and
median over ROUNDS shuffled rounds, without the profiler). No FUSE dispatch, kernel copy
or GET client: what `bench.dataplane` measures on a real mount includes those.
Results: JSON and a markdown table under --out.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import trio

from bench.harness.saving import save_results
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tier import CacheEvents
from bucketfs.cache.tiered import BlockCache
from bucketfs.fs import PATCHED_PYFUSE3, Operations
from bucketfs.hints.protocol import Order
from bucketfs.namespace import Namespace
from bucketfs.prefetch.eviction import make_policy
from bucketfs.prefetch.next_use import HintedPolicy, NextUse
from bucketfs.prefetch.scheduler import PrefetchScheduler
from bucketfs.prefetcher import HintedPrefetch
from bucketfs.reader import ByteBudget, Reader, ReadSettings
from tests.membackend import MemoryBackend

PASSES = ("cold", "cold, the order sent first", "warm", "warm, inode not seen before",
          "warm, name looked up first")


async def measure(files: int, rounds: int) -> dict[str, dict[str, float]]:
    objects = {f"train/c{i % 20}/{i:05d}.jpg": random.Random(i).randbytes(100_000 + i)
               for i in range(files)}
    store = ObjectStore(MemoryBackend(objects), max_workers=8, retry=RetryPolicy(1))
    namespace = Namespace(store, "train/")
    scheduler = PrefetchScheduler(window_bytes=1 << 28, budget_bytes=1 << 28)
    policy = HintedPolicy(make_policy(), NextUse(scheduler),
                          key_of=lambda b: b.key if isinstance(b, BlockId) else b)
    results: dict[str, dict[str, float]] = {}
    async with trio.open_nursery() as nursery:
        cache = BlockCache(store, RamTier(2 << 30, policy, CacheEvents()), None,
                           block_size=4 << 20, nursery=nursery)
        prefetch = HintedPrefetch(namespace, cache, scheduler, connections=14,
                                  block_size=4 << 20)
        reader = Reader(cache, ByteBudget(1 << 29), ReadSettings(), nursery,
                        on_open=prefetch.observed_open)
        await nursery.start(prefetch.run)
        operations = Operations(namespace, reader, uid=0, gid=0, kernel_ttl=60,
                                kernel_opens=PATCHED_PYFUSE3)
        names = {entry.inode: (directory, entry.name)
                 for directory in await namespace.children(1)
                 for entry in await namespace.children(directory.inode)}
        paths = {inode: f"{directory.name}/{name}"
                 for inode, (directory, name) in names.items()}
        inodes = list(paths)
        epochs = itertools.count()

        async def one_pass(order: list[int], fresh: bool, hinted: bool,
                           looked_up: bool) -> float:
            if fresh:
                operations.read_states.clear()
            began = time.process_time()
            if hinted:
                prefetch.on_order(Order(job="bench", rank=0, world_size=1,
                                        epoch=next(epochs),
                                        paths=[paths[inode] for inode in order]))
            for inode in order:
                if looked_up:
                    directory, name = names[inode]
                    await operations.lookup(directory.inode, name.encode(), None)  # type: ignore[arg-type]
                if not operations.kernel_opens:  # stock pyfuse3: an open per file
                    fh = (await operations.open(inode, 0, None)).fh
                    await operations.read(fh, 0, 131072)
                    await operations.release(fh)
                else:
                    await operations.read(inode, 0, 131072)
            while scheduler.inflight_bytes:  # what prefetch has in flight counts too
                await trio.sleep(0.001)
            return (time.process_time() - began) / len(order) * 1e6

        def empty_ram() -> None:
            for block, _, _ in cache.ram.items():
                cache.ram.remove(block)

        for name in PASSES:
            order = list(inodes)
            random.Random(name).shuffle(order)
            cpu = []
            profile = cProfile.Profile()
            # A cold pass empties the RAM tier first. Each pass runs ROUNDS times for its
            # CPU, then ROUNDS times under the profiler: calls are counted over them all,
            # so the eviction policy's heap rebuilds (one every few passes) count at
            # their share, not wherever one happens to fall.
            for profiled in (False, True):
                for round_ in range(rounds):
                    random.Random(round_).shuffle(order)
                    if name.startswith("cold"):
                        empty_ram()
                    hinted = name.startswith("cold, the order")
                    args = (order, name != "warm", hinted, name.endswith("looked up first"))
                    if profiled:
                        profile.enable()
                        await one_pass(*args)
                        profile.disable()
                    else:
                        cpu.append(await one_pass(*args))
                    if hinted:  # the job is done: the warm passes read with no plan
                        prefetch.on_end("bench")
            calls = pstats.Stats(profile).total_calls / (rounds * len(order))  # type: ignore[attr-defined]
            results[name] = {"python_calls_per_read": calls, "cpu_us_min": min(cpu),
                             "cpu_us_median": statistics.median(cpu)}
        nursery.cancel_scope.cancel()
    namespace.close()
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| pass | Python calls per read | CPU per read, min / median |",
             "| --- | ---: | --- |"]
    for name, row in results.items():
        lines.append(f"| {name} | {row['python_calls_per_read']:.1f} | "
                     f"{row['cpu_us_min']:.1f} / {row['cpu_us_median']:.1f} us |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.read_path",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    results = trio.run(measure, args.files, args.rounds)
    text = table(results)
    print(text, end="")
    report: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)},
                              "passes": results}
    save_results(args.out, "read-path", report, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
