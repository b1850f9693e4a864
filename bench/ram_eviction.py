"""What the RAM tier's admission costs once it is full, as a dataset larger than RAM fills it:

    python -m bench.ram_eviction [--puts 60000] [--rounds 5] [--capacities 100,2600,26000]

A `RamTier` of CAPACITY blocks of 100 KB (2,600 is ~256 MiB) under the daemon's default
policy (cost-lrfu, cool-down 64), alone and wrapped in `HintedPolicy` with no plan (as
a mount with hints on and no job sending them), takes PUTS blocks, each new: past the
first CAPACITY, every one admitted evicts one, as in a cold epoch. For each: CPU per put
(`time.process_time`, min and median over ROUNDS rounds), and the ranks the policy
computes per put (`_rank` calls: the heaps' main cost). Also the same puts into a tier
large enough never to evict. Pure CPU: no FUSE, no network, no block bytes copied (every
put shares one buffer). Prints a table; JSON under --out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.harness.saving import save_results
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tier import CacheEvents
from bucketfs.prefetch.eviction import CostAwareLRFU, EvictionPolicy, make_policy
from bucketfs.prefetch.next_use import HintedPolicy, NextUse
from bucketfs.prefetch.scheduler import PrefetchScheduler

BLOCK = 100_000
COST = 0.001  # seconds to fetch a block again: one cost class for every block


def policy(hinted: bool) -> EvictionPolicy:
    plain = make_policy("cost-lrfu", cooldown=64)
    if not hinted:
        return plain
    plans = PrefetchScheduler(window_bytes=10 * BLOCK, budget_bytes=10**12)
    return HintedPolicy(plain, NextUse(plans))


def one_round(capacity: int, puts: int, hinted: bool) -> tuple[float, float, int]:
    """(µs of CPU per put, ranks per put, evictions)."""
    ranks = 0
    original = CostAwareLRFU._rank

    def counting(self: CostAwareLRFU, entry: Any) -> tuple[float, ...]:
        nonlocal ranks
        ranks += 1
        return original(self, entry)

    tier = RamTier(capacity * BLOCK, policy(hinted), CacheEvents())
    data = bytes(BLOCK)
    blocks = [BlockId(f"train/c{i % 20:02d}/{i:07d}.jpg", f"etag-{i}", 0, size=BLOCK)
              for i in range(puts)]
    began = time.process_time()
    for block in blocks:
        tier.put(block, data, COST)
    used = time.process_time() - began
    CostAwareLRFU._rank = counting  # type: ignore[method-assign]
    try:  # counted apart: the counter's own cost stays out of the CPU figure
        counted = RamTier(capacity * BLOCK, policy(hinted), CacheEvents())
        for block in blocks:
            counted.put(block, data, COST)
    finally:
        CostAwareLRFU._rank = original  # type: ignore[method-assign]
    return 1e6 * used / puts, ranks / puts, tier.evictions


def run(capacities: list[int], puts: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for capacity in [*capacities, puts + 1]:  # the last never evicts
        for hinted in (False, True):
            results = [one_round(capacity, puts, hinted) for _ in range(rounds)]
            cpu = [r[0] for r in results]
            rows.append({"capacity_blocks": capacity, "hinted": hinted,
                         "us_per_put_min": min(cpu), "us_per_put_median": statistics.median(cpu),
                         "ranks_per_put": results[0][1], "evictions": results[0][2],
                         "puts": puts})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| RAM tier, blocks | policy | evictions | µs per put, min / median "
             "| ranks per put |", "| ---: | --- | ---: | --- | ---: |"]
    for row in rows:
        name = "cost-lrfu in HintedPolicy, no plan" if row["hinted"] else "cost-lrfu"
        lines.append(f"| {row['capacity_blocks']:,} | {name} | {row['evictions']:,} "
                     f"| {row['us_per_put_min']:.2f} / {row['us_per_put_median']:.2f} "
                     f"| {row['ranks_per_put']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ram_eviction",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--puts", type=int, default=60_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--capacities", default="100,2600,26000",
                        type=lambda text: [int(x) for x in text.split(",") if x])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    rows = run(args.capacities, args.puts, args.rounds)
    text = table(rows)
    print(text, end="")
    save_results(args.out, "ram-eviction", {"rows": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
