"""Snapshots taken at the edges of a measured phase; their difference is the phase's cost.

A snapshot holds the origin's counters (from the delay proxy's control socket: requests
by kind, bytes, connections), the CPU time of the mount daemon's process tree (when the
contender has one), and the CPU time of the process taking it (and of its reaped
children, the DataLoader workers).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from bench.harness.origin import control_request
from bench.harness.procstats import cpu_seconds


@dataclass(frozen=True)
class Probe:
    control: Path | None
    daemon_pid: int | None = None

    def snapshot(self) -> dict[str, float]:
        values: dict[str, float] = {}
        if self.control is not None:
            for name, value in control_request(self.control, "stats").items():
                if isinstance(value, int):
                    values[f"origin_{name}"] = value
        if self.daemon_pid is not None:
            values["daemon_cpu_s"] = cpu_seconds(self.daemon_pid)
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        values["client_cpu_s"] = (own.ru_utime + own.ru_stime + children.ru_utime
                                  + children.ru_stime)
        return values


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after if key in before}
