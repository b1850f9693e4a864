"""CPU time and peak memory of a process and its descendants, read from /proc."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after it.
    return text[text.rindex(")") + 2:].split()


def self_cpu() -> float:
    """User + system time of this process (all its threads), not its children."""
    times = os.times()
    return times.user + times.system


def descendants(pid: int) -> list[int]:
    """pid and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system time of the tree under pid, including children it has reaped."""
    total = 0
    for member in descendants(pid):
        fields = _stat_fields(member)
        if fields is not None:
            # utime, stime, cutime, cstime are fields 14-17 of stat (11-14 after the name).
            total += sum(int(v) for v in fields[11:15])
    return total / _TICK


def peak_rss_mib(pid: int) -> float:
    """The sum of VmHWM (peak resident set) over the tree under pid, in MiB."""
    total_kib = 0
    for member in descendants(pid):
        try:
            lines = Path(f"/proc/{member}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("VmHWM:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024
