"""Which cores the daemon's threads run on: the `cpus` option.

One daemon's Python threads (the trio thread that answers FUSE and its worker threads)
share one GIL, and obstore's runtime starts a worker thread per core it may use. Free to
run on every core of a many-core node, they hand the GIL and each GET's completion from
core to core: on a 16-core GPU node the daemon's worker threads cost 3-5x per cold file
what they cost on a 2-core VM. Confined to 4 of those cores, the daemon served as many
cold files per second at 10-15% less CPU per file (docs/BENCHMARKS.md, "On a 16-core GPU
node"; the GIL lets one thread run at a time anyway), and it leaves the other cores to
the data loader's workers.

`cpus` is a count N (the last N cores this process may use: the scheduler and interrupt
handling favour the first ones) or a list in taskset's form ("8-11,14"). It is applied
at the start of the daemon, before any thread exists, so every thread it starts later
(trio's workers, obstore's runtime, which sizes itself to what it may use, RocksDB's)
inherits it.
"""

from __future__ import annotations

import os

__all__ = ["chosen_cores", "confine", "parse_cpus"]


def _core_list(text: str) -> set[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}; ValueError for anything else."""
    cores: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{text!r} is not a count of cores or a list such as 0-3,8")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{part.strip()!r}: a range runs from low to high")
        cores.update(range(first, last + 1))
    return cores


def parse_cpus(value: object) -> str | None:
    """The option's value as given (a count, or a list of cores), checked; None: all."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("expected a count of cores or a list such as 0-3,8")
    text = str(value).strip()
    if text.isdigit():
        if int(text) < 1:
            raise ValueError("expected at least 1 core")
        return str(int(text))
    _core_list(text)
    return text


def chosen_cores(spec: str, allowed: set[int]) -> set[int]:
    """The cores `spec` names among `allowed` (this process's affinity). A count takes
    the last N allowed cores (all of them if it is larger); a list must name only
    allowed cores (ValueError otherwise: a typo should not pin the daemon elsewhere)."""
    if spec.isdigit():
        return set(sorted(allowed)[-int(spec):])
    cores = _core_list(spec)
    if missing := cores - allowed:
        raise ValueError(f"cpus {spec}: cores {sorted(missing)} are not available to the "
                         f"daemon (it may use {sorted(allowed)})")
    return cores


def confine(spec: str) -> set[int]:
    """Confine this process (its main thread, and so every thread it starts later) to
    the cores `spec` names; returns them. Call it before any other thread exists."""
    cores = chosen_cores(spec, os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores)
    return cores
