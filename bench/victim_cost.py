"""What choosing an SSD victim costs, with hints and without:

    python -m bench.victim_cost [--files 20000] [--epochs 3] [--size 4096]

Replays shuffled epochs over a real DiskTier (RocksDB index, block files on disk) whose
capacity is half the files, as `tests/test_hinted_victims.py` does at small scale: each
epoch's order goes to the scheduler first, every read is observed, a miss is stored.
Times every call of `DiskTier._victim` (the choice only: not the unlink, not the index
writes) and every `put` as a whole, with `HintedVictims` and with cost-lrfu alone.
Pure CPU and local disk: no FUSE, no network. Prints a table; JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bucketfs.cache.blocks import BlockId
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.hinted_victims import HintedVictims
from bucketfs.prefetch.eviction import make_policy
from bucketfs.prefetch.next_use import NextUse
from bucketfs.prefetch.scheduler import PrefetchScheduler


def replay(directory: Path, orders: list[list[str]], size: int, hinted: bool
           ) -> dict[str, Any]:
    capacity = len(orders[0]) // 2
    disk = DiskTier(directory, capacity * size, make_policy("cost-lrfu"), source="bench",
                    block_size=size)
    plans = PrefetchScheduler(window_bytes=64 * size, budget_bytes=10**12)
    if hinted:
        future = NextUse(plans)
        disk.hinted = HintedVictims(future.distance, future.plans)
    choices: list[float] = []
    choose = disk._victim

    def timed_victim(incoming: Any) -> bytes | None:
        started = time.perf_counter()
        try:
            return choose(incoming)
        finally:
            choices.append(time.perf_counter() - started)

    disk._victim = timed_victim  # type: ignore[method-assign]
    puts: list[float] = []
    hits = []
    payload = b"x" * size
    for order in orders:
        plans.set_order("job", [(key, size) for key in order])
        epoch_hits = 0
        for key in order:
            plans.observe_read(key, job="job")
            block = BlockId(key, "v1", 0, size=size)
            if disk.get(block) is not None:
                epoch_hits += 1
                continue
            started = time.perf_counter()
            disk.put(block, payload, 0.01)
            puts.append(time.perf_counter() - started)
        hits.append(epoch_hits)
    disk.close()
    return {
        "hinted": hinted, "files": len(orders[0]), "capacity": capacity,
        "hits_per_epoch": hits, "victim_choices": len(choices),
        "choice_us_median": 1e6 * statistics.median(choices) if choices else 0.0,
        "choice_us_p99": 1e6 * sorted(choices)[int(0.99 * len(choices))] if choices else 0.0,
        "choice_s_total": sum(choices),
        "put_us_median": 1e6 * statistics.median(puts) if puts else 0.0,
        "puts": len(puts),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--size", type=int, default=4096, help="bytes per file")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    rng = random.Random(1)
    names = [f"img/{i:06d}.jpg" for i in range(args.files)]
    orders = [rng.sample(names, len(names)) for _ in range(args.epochs)]
    results = []
    for hinted in (False, True):
        with tempfile.TemporaryDirectory(prefix="bucketfs-victims-") as scratch:
            results.append(replay(Path(scratch), orders, args.size, hinted))
    print(f"{args.files} files, SSD tier of {args.files // 2}, {args.epochs} shuffled epochs, "
          f"{platform.node()}")
    print("| policy | victim choices | choice µs (median) | choice µs (p99) | "
          "choice s (all) | put µs (median) | hits per epoch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {'hinted' if r['hinted'] else 'cost-lrfu'} | {r['victim_choices']:,} | "
              f"{r['choice_us_median']:.0f} | {r['choice_us_p99']:.0f} | "
              f"{r['choice_s_total']:.2f} | {r['put_us_median']:.0f} | "
              f"{', '.join(map(str, r['hits_per_epoch']))} |")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"victim_cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
