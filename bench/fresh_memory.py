"""What touching fresh memory costs on this machine, GiB by GiB:

    python -m bench.fresh_memory [--gib 5]

Touches GIB gibibytes of anonymous memory one GiB at a time, keeping each (so every GiB
needs pages nobody freed a moment ago), then frees them all and touches the same amount
again (pages just freed). Prints the CPU each GiB took. On bare metal both columns are
the kernel's fault and zeroing cost. On a VM whose balloon driver reports free pages to
the host, a page the host has taken back costs a host fault on first touch, charged to
the guest process that touches it: the first column then climbs once the recently
freed pages run out. bench.dataplane's large-object row needs such pages three times
over (see `back_memory` there), which is why it is also taken with memory backed first.
"""

from __future__ import annotations

import argparse
import mmap
from pathlib import Path

from bench.harness.procstats import self_cpu

GiB = 1024**3
_STEP = 64 * 1024**2
_REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def touch_one_gib() -> tuple[mmap.mmap, float]:
    began = self_cpu()
    region = mmap.mmap(-1, GiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ones = b"\1" * _STEP
    for offset in range(0, GiB, _STEP):
        region[offset:offset + _STEP] = ones
    return region, self_cpu() - began


def touch(gib: int) -> list[float]:
    kept, costs = [], []
    for _ in range(gib):
        region, took = touch_one_gib()
        kept.append(region)
        costs.append(took)
    for region in kept:
        region.close()
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=5)
    args = parser.parse_args(argv)
    reporting = _REPORTED.read_text().strip() + " KiB" if _REPORTED.exists() else "no"
    print(f"free page reporting to a host: {reporting}")
    fresh = touch(args.gib)
    reused = touch(args.gib)
    print("| GiB | CPU-s, pages not freed just before | CPU-s, pages freed just before |")
    print("| ---: | ---: | ---: |")
    for number, (first, second) in enumerate(zip(fresh, reused, strict=True), start=1):
        print(f"| {number} | {first:.2f} | {second:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
