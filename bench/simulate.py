"""Trace-driven comparison of the eviction policies, against Belady's MIN:

    python -m bench.simulate [--out bench/results] [--seed 0] [--trace NAME ...]
                             [--set POLICY.PARAM=VALUE ...]

Models one cache tier of a given byte capacity that admits every object on a miss (one
larger than the whole tier is fetched but not admitted), making room first by evicting
`victim()`s; nothing is prefetched. Each trace is replayed through every policy (default
parameters unless --set) at capacities of 10%, 25%, 50%, 75% and 90% of its working set
(bytes of the distinct objects it reads); per run it reports the hit ratio, the bytes
fetched and the fetch time, the sum of the refetch cost of every miss. Costs are per
byte by origin (1x = 100 MB/s), and the policy is told the cost of each object it admits.

Traces: shuffled (one job, multi-epoch), sweep (4 jobs on one dataset), mixed (three
datasets from origins of different cost), skewed (weighted sampling with replacement),
shift (skewed, hot set changes halfway), switch (one job's dataset, then another's).

MIN evicts the cached object whose next use is farthest in the future (an object never
used again first), and may evict the one it just admitted, i.e. not cache it. With equal
sizes that is optimal for the hit ratio; with variable sizes it is the usual
farthest-next-use heuristic, not an exact optimum, and it ignores cost, so it bounds
neither the hit ratio nor the fetch time exactly. It is the reference point, not a
policy: it needs the future.

Results: JSON under --out and one Markdown table per trace on stdout. Deterministic for
a given --seed.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bucketfs.prefetch.eviction import POLICIES, EvictionPolicy, make_policy

FRACTIONS = (0.10, 0.25, 0.50, 0.75, 0.90)
POLICY_ORDER = ("lru", "lfu", "lrfu", "cost-lrfu")
#: Seconds per byte at 1x: a 100 MB/s origin.
SECONDS_PER_BYTE = 1e-8
BATCH = 32


@dataclass
class Trace:
    name: str
    description: str
    keys: list[int]  # the objects read, in order
    sizes: list[int]  # by object id
    costs: list[float]  # seconds to fetch, by object id

    @property
    def working_set(self) -> int:
        return sum(self.sizes[k] for k in set(self.keys))


@dataclass
class Result:
    policy: str
    fraction: float
    capacity: int
    refs: int = 0
    hits: int = 0
    bytes_fetched: int = 0
    fetch_time_s: float = 0.0
    params: dict[str, float] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.refs if self.refs else 0.0


# -- traces -----------------------------------------------------------------------------

class _Objects:
    """Object ids with lognormal sizes (mean `mean_bytes`) and a per-byte cost."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.sizes: list[int] = []
        self.costs: list[float] = []

    def dataset(self, files: int, cost_factor: float, mean_bytes: float = 110e3,
                sigma: float = 0.6) -> list[int]:
        mu = math.log(mean_bytes) - sigma**2 / 2
        first = len(self.sizes)
        for _ in range(files):
            size = max(1024, int(self.rng.lognormvariate(mu, sigma)))
            self.sizes.append(size)
            self.costs.append(size * SECONDS_PER_BYTE * cost_factor)
        return list(range(first, first + files))


def _epochs(rng: random.Random, files: Sequence[int], epochs: int) -> list[int]:
    order: list[int] = []
    for _ in range(epochs):
        perm = list(files)
        rng.shuffle(perm)  # a new permutation each epoch, as a shuffling sampler does
        order.extend(perm)
    return order


def _interleave(rng: random.Random, jobs: Sequence[list[int]], batch: int = BATCH) -> list[int]:
    """Jobs advance a batch at a time; the next batch comes from a random unfinished job."""
    pos = [0] * len(jobs)
    active = [i for i, job in enumerate(jobs) if job]
    out: list[int] = []
    while active:
        i = rng.choice(active)
        out.extend(jobs[i][pos[i]:pos[i] + batch])
        pos[i] += batch
        if pos[i] >= len(jobs[i]):
            active.remove(i)
    return out


def trace_shuffled(seed: int) -> Trace:
    rng = random.Random(seed)
    objs = _Objects(rng)
    files = objs.dataset(5000, 1.0)
    return Trace("shuffled", "one job, ImageFolder of 5,000 files (lognormal, mean 110 KB), "
                 "5 epochs, a new permutation each epoch, 1x cost per byte",
                 _epochs(rng, files, 5), objs.sizes, objs.costs)


def trace_sweep(seed: int) -> Trace:
    rng = random.Random(seed + 1)
    objs = _Objects(rng)
    files = objs.dataset(5000, 1.0)
    jobs = [_epochs(rng, files, 3) for _ in range(4)]
    return Trace("sweep", "hyper-parameter sweep: 4 jobs on one 5,000-file dataset, each "
                 "with its own shuffle, 3 epochs each, interleaved randomly by batch of 32",
                 _interleave(rng, jobs), objs.sizes, objs.costs)


def trace_mixed(seed: int) -> Trace:
    rng = random.Random(seed + 2)
    objs = _Objects(rng)
    near = objs.dataset(2000, 1.0)
    far = objs.dataset(2000, 5.0)
    mid = objs.dataset(1000, 2.0)
    jobs = [_epochs(rng, near, 3), _epochs(rng, near, 3), _epochs(rng, far, 3),
            _epochs(rng, mid, 3)]
    return Trace("mixed", "three datasets, different origins: near (2,000 files, 1x cost "
                 "per byte) read by 2 jobs, far (2,000 files, 5x) by 1 job, mid (1,000 "
                 "files, 2x) by 1 job; 3 epochs each, interleaved randomly by batch of 32",
                 _interleave(rng, jobs), objs.sizes, objs.costs)


def _weighted(rng: random.Random, files: list[int], reads: int) -> list[int]:
    # A weighted sampler (with replacement): 10% of the files draw half the reads.
    hot = set(rng.sample(files, len(files) // 10))
    weights = [9.0 if f in hot else 1.0 for f in files]
    return rng.choices(files, weights, k=reads)


def trace_skewed(seed: int) -> Trace:
    rng = random.Random(seed + 3)
    objs = _Objects(rng)
    files = objs.dataset(5000, 1.0)
    return Trace("skewed", "weighted sampling with replacement over 5,000 files: 10% hot "
                 "files draw half the reads; 30,000 reads; 1x cost per byte",
                 _weighted(rng, files, 30000), objs.sizes, objs.costs)


def trace_shift(seed: int) -> Trace:
    rng = random.Random(seed + 4)
    objs = _Objects(rng)
    files = objs.dataset(5000, 1.0)
    # A re-weighted curriculum: popularity learnt in the first half is wrong in the
    # second, so it has to fade.
    return Trace("shift", "as skewed, but a new hot set after 15,000 of 30,000 reads",
                 _weighted(rng, files, 15000) + _weighted(rng, files, 15000),
                 objs.sizes, objs.costs)


def trace_switch(seed: int) -> Trace:
    rng = random.Random(seed + 5)
    objs = _Objects(rng)
    first = objs.dataset(2500, 1.0)
    second = objs.dataset(2500, 1.0)
    # DLCache's setting: a job ends, its dataset stays cached, the next job reads another.
    return Trace("switch", "one job, 5 epochs over a 2,500-file dataset, then another job, "
                 "5 epochs over a different 2,500-file dataset; 1x cost per byte",
                 _epochs(rng, first, 5) + _epochs(rng, second, 5), objs.sizes, objs.costs)


TRACES: dict[str, Callable[[int], Trace]] = {
    "shuffled": trace_shuffled,
    "sweep": trace_sweep,
    "mixed": trace_mixed,
    "skewed": trace_skewed,
    "shift": trace_shift,
    "switch": trace_switch,
}


# -- replay -----------------------------------------------------------------------------

def simulate(policy: EvictionPolicy, trace: Trace, capacity: int, result: Result) -> Result:
    sizes, costs = trace.sizes, trace.costs
    used = 0
    for key in trace.keys:
        result.refs += 1
        if key in policy:
            result.hits += 1
            policy.touch(key)
            continue
        size = sizes[key]
        result.bytes_fetched += size
        result.fetch_time_s += costs[key]
        if size > capacity:
            continue
        while used + size > capacity:
            victim = policy.victim()
            assert victim is not None, "policy is empty but the tier is full"
            used -= sizes[victim]
            policy.remove(victim)
        policy.admit(key, size, costs[key])
        used += size
    return result


def simulate_min(trace: Trace, capacity: int, result: Result) -> Result:
    keys, sizes, costs = trace.keys, trace.sizes, trace.costs
    never = len(keys)
    next_use = [never] * len(keys)
    seen: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        next_use[i] = seen.get(keys[i], never)
        seen[keys[i]] = i
    cached: dict[int, int] = {}  # key -> its next use
    farthest: list[tuple[int, int]] = []  # (-next use, key); outdated records skipped
    used = 0
    for i, key in enumerate(keys):
        result.refs += 1
        nxt = next_use[i]
        if key in cached:
            result.hits += 1
        else:
            size = sizes[key]
            result.bytes_fetched += size
            result.fetch_time_s += costs[key]
            if size > capacity:
                continue
            used += size
        cached[key] = nxt
        heapq.heappush(farthest, (-nxt, key))
        while used > capacity:
            neg, victim = heapq.heappop(farthest)
            if cached.get(victim) == -neg:
                del cached[victim]
                used -= sizes[victim]
    return result


def _settings(policy: EvictionPolicy) -> dict[str, float]:
    """The parameters a policy runs with, defaults included, for the record."""
    names = ("cooldown", "p", "lam", "tolerance", "cost_tolerance", "stale_after")
    return {n: getattr(policy, n) for n in names if getattr(policy, n, None) is not None}


def run(traces: Iterable[Trace], policies: dict[str, dict[str, float]],
        fractions: Sequence[float] = FRACTIONS) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for trace in traces:
        ws = trace.working_set
        results: list[Result] = []
        for fraction in fractions:
            capacity = int(ws * fraction)
            for name, params in policies.items():
                policy = make_policy(name, **params)
                result = Result(name, fraction, capacity, params=_settings(policy))
                results.append(simulate(policy, trace, capacity, result))
            results.append(simulate_min(trace, capacity, Result("MIN", fraction, capacity)))
        out[trace.name] = {
            "description": trace.description,
            "objects": len(set(trace.keys)),
            "reads": len(trace.keys),
            "working_set_bytes": ws,
            "all_miss_fetch_time_s": sum(trace.costs[k] for k in trace.keys),
            "results": [{"policy": r.policy, "params": r.params, "fraction": r.fraction,
                         "capacity_bytes": r.capacity, "reads": r.refs, "hits": r.hits,
                         "hit_ratio": r.hit_ratio, "bytes_fetched": r.bytes_fetched,
                         "fetch_time_s": r.fetch_time_s} for r in results],
        }
    return out


def markdown(report: dict[str, dict]) -> str:
    lines: list[str] = []
    for name, trace in report.items():
        results = trace["results"]
        fractions = sorted({r["fraction"] for r in results})
        policies = list(dict.fromkeys(r["policy"] for r in results))
        cells = {(r["policy"], r["fraction"]): r for r in results}
        lines += [f"### {name}", "",
                  f"{trace['description']}. {trace['reads']:,} reads of "
                  f"{trace['objects']:,} objects, working set "
                  f"{trace['working_set_bytes'] / 1e6:.0f} MB; every read a miss would "
                  f"take {trace['all_miss_fetch_time_s']:.1f} s. "
                  "Cells: hit ratio / fetch time.", "",
                  "| policy | " + " | ".join(f"{f:.0%} cache" for f in fractions) + " |",
                  "| --- |" + " ---: |" * len(fractions)]
        for policy in policies:
            row = [f"{cells[policy, f]['hit_ratio']:.1%} / "
                   f"{cells[policy, f]['fetch_time_s']:.1f} s" for f in fractions]
            lines.append(f"| {policy} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def _parse_sets(items: Sequence[str]) -> dict[str, dict[str, float]]:
    params: dict[str, dict[str, float]] = {name: {} for name in POLICY_ORDER}
    for item in items:
        try:
            target, value = item.split("=", 1)
            policy, param = target.split(".", 1)
            params[policy][param] = float(value)
        except (ValueError, KeyError):
            raise SystemExit(f"--set wants POLICY.PARAM=VALUE with POLICY one of "
                             f"{', '.join(POLICIES)}; got {item!r}") from None
    for policy, values in params.items():
        try:
            make_policy(policy, **values)
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"--set {policy}: {exc}") from None
    return params


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="append", choices=list(TRACES),
                        help="replay only these traces (repeatable; default all)")
    parser.add_argument("--set", action="append", default=[], metavar="POLICY.PARAM=VALUE",
                        help="a policy parameter, e.g. cost-lrfu.tolerance=3 (repeatable)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    traces = [TRACES[name](args.seed) for name in (args.trace or TRACES)]
    report = run(traces, _parse_sets(args.set))
    elapsed = time.perf_counter() - started

    argv_shown = list(sys.argv[1:] if argv is None else argv)
    results = {
        "command": " ".join(["python -m bench.simulate", *argv_shown]),
        "seed": args.seed,
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "elapsed_s": elapsed,
        "traces": report,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"simulate-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(markdown(report))
    print(f"{elapsed:.0f} s; written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
