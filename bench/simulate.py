"""Trace-driven comparison of the eviction policies, against Belady's MIN:

    python -m bench.simulate [--out bench/results] [--seed 0] [--trace NAME ...]
                             [--set POLICY.PARAM=VALUE ...] [--fraction F ...]
                             [--no-hinted]

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

Hinted eviction (prefetch/next_use.py) is replayed next to them: `HintedPolicy` over
cost-lrfu (its --set parameters), told each job's order of an epoch when the epoch starts
(as `HintSampler` does), its reader's position following the reads (each read is
attributed to its job), the scheduler's window at 1/8 of the cache protecting the next
reads, each job ended after its last read (as its hint socket closes). Two rows:
`hinted`, a tier that evicts before it admits (as the RAM tier does), and
`hinted-decline`, a tier that admits first and may then evict the newcomer (it declines
to cache it), as MIN may. Below each table: their hit ratios over MIN's.

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
from bucketfs.prefetch.next_use import HintedPolicy, NextUse
from bucketfs.prefetch.scheduler import PrefetchScheduler

FRACTIONS = (0.10, 0.25, 0.50, 0.75, 0.90)
POLICY_ORDER = ("lru", "lfu", "lrfu", "cost-lrfu")
#: Seconds per byte at 1x: a 100 MB/s origin.
SECONDS_PER_BYTE = 1e-8
BATCH = 32
#: The hinted replays' window, as a fraction of the cache.
HINTED_WINDOW = 1 / 8
HINTED = ("hinted", "hinted-decline")

#: (read index, job, order): the job announces an epoch's order before that read.
Announcements = list[tuple[int, int, list[int]]]


@dataclass
class Trace:
    name: str
    description: str
    keys: list[int]  # the objects read, in order
    sizes: list[int]  # by object id
    costs: list[float]  # seconds to fetch, by object id
    orders: Announcements = field(default_factory=list)
    #: The job of each read; empty: all reads are job 0's.
    jobs: list[int] = field(default_factory=list)

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


def _epochs(rng: random.Random, files: Sequence[int], epochs: int) -> list[list[int]]:
    orders: list[list[int]] = []
    for _ in range(epochs):
        perm = list(files)
        rng.shuffle(perm)  # a new permutation each epoch, as a shuffling sampler does
        orders.append(perm)
    return orders


def _one_job(epochs: Sequence[list[int]]) -> tuple[list[int], Announcements]:
    """The reads of one job's epochs in turn, and its announcements."""
    keys: list[int] = []
    orders: Announcements = []
    for epoch in epochs:
        orders.append((len(keys), 0, epoch))
        keys.extend(epoch)
    return keys, orders


def _interleave(rng: random.Random, jobs: Sequence[Sequence[list[int]]],
                batch: int = BATCH) -> tuple[list[int], list[int], Announcements]:
    """Jobs (each a list of epochs) advance a batch at a time; the next batch comes from
    a random unfinished job. Returns the reads, the job of each, and the announcements
    (each epoch's order just before its first read)."""
    flat = [[key for epoch in epochs for key in epoch] for epochs in jobs]
    starts = [[sum(map(len, epochs[:e])) for e in range(len(epochs))] for epochs in jobs]
    pos = [0] * len(jobs)
    active = [i for i, job in enumerate(flat) if job]
    out: list[int] = []
    owner: list[int] = []
    orders: Announcements = []
    while active:
        i = rng.choice(active)
        chunk = flat[i][pos[i]:pos[i] + batch]
        for e, start in enumerate(starts[i]):
            if pos[i] <= start < pos[i] + len(chunk):
                orders.append((len(out) + start - pos[i], i, jobs[i][e]))
        out.extend(chunk)
        owner.extend([i] * len(chunk))
        pos[i] += batch
        if pos[i] >= len(flat[i]):
            active.remove(i)
    return out, owner, orders


def trace_shuffled(seed: int) -> Trace:
    rng = random.Random(seed)
    objs = _Objects(rng)
    files = objs.dataset(5000, 1.0)
    keys, orders = _one_job(_epochs(rng, files, 5))
    return Trace("shuffled", "one job, ImageFolder of 5,000 files (lognormal, mean 110 KB), "
                 "5 epochs, a new permutation each epoch, 1x cost per byte",
                 keys, objs.sizes, objs.costs, orders)


def trace_sweep(seed: int) -> Trace:
    rng = random.Random(seed + 1)
    objs = _Objects(rng)
    files = objs.dataset(5000, 1.0)
    jobs = [_epochs(rng, files, 3) for _ in range(4)]
    keys, owner, orders = _interleave(rng, jobs)
    return Trace("sweep", "hyper-parameter sweep: 4 jobs on one 5,000-file dataset, each "
                 "with its own shuffle, 3 epochs each, interleaved randomly by batch of 32",
                 keys, objs.sizes, objs.costs, orders, owner)


def trace_mixed(seed: int) -> Trace:
    rng = random.Random(seed + 2)
    objs = _Objects(rng)
    near = objs.dataset(2000, 1.0)
    far = objs.dataset(2000, 5.0)
    mid = objs.dataset(1000, 2.0)
    jobs = [_epochs(rng, near, 3), _epochs(rng, near, 3), _epochs(rng, far, 3),
            _epochs(rng, mid, 3)]
    keys, owner, orders = _interleave(rng, jobs)
    return Trace("mixed", "three datasets, different origins: near (2,000 files, 1x cost "
                 "per byte) read by 2 jobs, far (2,000 files, 5x) by 1 job, mid (1,000 "
                 "files, 2x) by 1 job; 3 epochs each, interleaved randomly by batch of 32",
                 keys, objs.sizes, objs.costs, orders, owner)


def _weighted(rng: random.Random, files: list[int], reads: int) -> list[int]:
    # A weighted sampler (with replacement): 10% of the files draw half the reads.
    hot = set(rng.sample(files, len(files) // 10))
    weights = [9.0 if f in hot else 1.0 for f in files]
    return rng.choices(files, weights, k=reads)


def trace_skewed(seed: int) -> Trace:
    rng = random.Random(seed + 3)
    objs = _Objects(rng)
    files = objs.dataset(5000, 1.0)
    keys, orders = _one_job([_weighted(rng, files, 30000)])  # one epoch of 30,000 draws
    return Trace("skewed", "weighted sampling with replacement over 5,000 files: 10% hot "
                 "files draw half the reads; 30,000 reads; 1x cost per byte",
                 keys, objs.sizes, objs.costs, orders)


def trace_shift(seed: int) -> Trace:
    rng = random.Random(seed + 4)
    objs = _Objects(rng)
    files = objs.dataset(5000, 1.0)
    # A re-weighted curriculum: popularity learnt in the first half is wrong in the
    # second, so it has to fade.
    keys, orders = _one_job([_weighted(rng, files, 15000), _weighted(rng, files, 15000)])
    return Trace("shift", "as skewed, but a new hot set after 15,000 of 30,000 reads",
                 keys, objs.sizes, objs.costs, orders)


def trace_switch(seed: int) -> Trace:
    rng = random.Random(seed + 5)
    objs = _Objects(rng)
    first = objs.dataset(2500, 1.0)
    second = objs.dataset(2500, 1.0)
    # DLCache's setting: a job ends, its dataset stays cached, the next job reads another.
    keys, orders = _one_job(_epochs(rng, first, 5) + _epochs(rng, second, 5))
    owner = [0] * (len(keys) // 2) + [1] * (len(keys) // 2)
    orders = [(at, 0 if at < len(keys) // 2 else 1, order) for at, _, order in orders]
    return Trace("switch", "one job, 5 epochs over a 2,500-file dataset, then another job, "
                 "5 epochs over a different 2,500-file dataset; 1x cost per byte",
                 keys, objs.sizes, objs.costs, orders, owner)


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
    used = 0
    for key in trace.keys:
        used = _reference(policy, trace, key, capacity, used, result, decline=False)
    return result


def _reference(policy: EvictionPolicy, trace: Trace, key: int, capacity: int, used: int,
               result: Result, *, decline: bool) -> int:
    """One read through a tier of `capacity` bytes holding `used`; returns the new `used`.
    `decline`: admit first, then evict (possibly the newcomer) as MIN does; else make
    room first, as the daemon's tiers do."""
    result.refs += 1
    if key in policy:
        result.hits += 1
        policy.touch(key)
        return used
    size = trace.sizes[key]
    result.bytes_fetched += size
    result.fetch_time_s += trace.costs[key]
    if size > capacity:
        return used
    if not decline:
        while used + size > capacity:
            used -= _evict(policy, trace.sizes)
    policy.admit(key, size, trace.costs[key])
    used += size
    while used > capacity:
        used -= _evict(policy, trace.sizes)
    return used


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


def simulate_hinted(trace: Trace, capacity: int, result: Result, params: dict[str, float],
                    *, decline: bool) -> Result:
    """Replay with `HintedPolicy` over cost-lrfu, each epoch's order announced as it
    starts. `decline`: see `_reference`."""
    sizes = trace.sizes
    plans = PrefetchScheduler(window_bytes=max(1, int(capacity * HINTED_WINDOW)),
                              budget_bytes=max(1, capacity))
    policy = HintedPolicy(make_policy("cost-lrfu", **params), NextUse(plans))
    result.params = {**_settings(policy._all), "cost_tolerance": policy.cost_tolerance,
                     "window_fraction": HINTED_WINDOW}
    announcements = iter(trace.orders)
    upcoming = next(announcements, None)
    owner = trace.jobs or [0] * len(trace.keys)
    last_read = {job: i for i, job in enumerate(owner)}
    used = 0
    for i, key in enumerate(trace.keys):
        while upcoming is not None and upcoming[0] == i:
            _, job, order = upcoming
            plans.set_order(job, [(k, sizes[k]) for k in order])
            upcoming = next(announcements, None)
        plans.observe_read(key, owner[i])
        if last_read[owner[i]] == i:
            plans.end_job(owner[i])  # the job exits; the daemon sees its socket close
        used = _reference(policy, trace, key, capacity, used, result, decline=decline)
    return result


def _evict(policy: EvictionPolicy, sizes: list[int]) -> int:
    victim = policy.victim()
    assert victim is not None, "policy is empty but the tier is full"
    policy.remove(victim)
    return sizes[victim]


def _settings(policy: EvictionPolicy) -> dict[str, float]:
    """The parameters a policy runs with, defaults included, for the record."""
    names = ("cooldown", "p", "lam", "tolerance", "cost_tolerance", "stale_after")
    return {n: getattr(policy, n) for n in names if getattr(policy, n, None) is not None}


def run(traces: Iterable[Trace], policies: dict[str, dict[str, float]],
        fractions: Sequence[float] = FRACTIONS, *, hinted: bool = True) -> dict[str, dict]:
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
            if hinted and trace.orders:
                for name in HINTED:
                    results.append(simulate_hinted(
                        trace, capacity, Result(name, fraction, capacity),
                        policies.get("cost-lrfu", {}), decline=name == "hinted-decline"))
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
        for name in (p for p in HINTED if p in policies and "MIN" in policies):
            lines.append(f"{name} / MIN at " + ", ".join(f"{f:.0%}" for f in fractions)
                         + ": hit ratio " + _ratios(cells, name, "hit_ratio", fractions)
                         + "; fetch time " + _ratios(cells, name, "fetch_time_s", fractions)
                         + "  ")
        if any(p in policies for p in HINTED):
            lines.append("")
    return "\n".join(lines)


def _ratios(cells: dict[tuple[str, float], dict], name: str, field: str,
            fractions: Sequence[float]) -> str:
    ratios = [cells[name, f][field] / cells["MIN", f][field] if cells["MIN", f][field]
              else math.nan for f in fractions]
    return ", ".join(f"{r:.3f}" for r in ratios)


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
    parser.add_argument("--fraction", action="append", type=float, metavar="F",
                        help="a cache size as a fraction of the working set (repeatable; "
                        "default 0.1, 0.25, 0.5, 0.75, 0.9)")
    parser.add_argument("--no-hinted", action="store_true",
                        help="leave out the hinted policy's replays")
    args = parser.parse_args(argv)
    if args.fraction and not all(0 < f <= 1 for f in args.fraction):
        parser.error("--fraction wants values in (0, 1]")

    started = time.perf_counter()
    traces = [TRACES[name](args.seed) for name in (args.trace or TRACES)]
    report = run(traces, _parse_sets(args.set), args.fraction or FRACTIONS,
                 hinted=not args.no_hinted)
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
