"""CPU time and peak memory of a process and its descendants, read from /proc."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _read_stat(path: str) -> tuple[str, list[str]] | None:
    """A process's or thread's `stat`: its name, and the fields after it (None if gone)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after it.
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def _stat_fields(pid: int) -> list[str] | None:
    stat = _read_stat(f"/proc/{pid}/stat")
    return None if stat is None else stat[1]


def self_cpu() -> float:
    """User + system time of this process (all its threads), not its children."""
    times = os.times()
    return times.user + times.system


def own_cpu_seconds(pid: int) -> float:
    """User + system time of process pid alone (all its threads), not its children."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else sum(int(v) for v in fields[11:13]) / _TICK


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


def _threads(pid: int) -> list[int]:
    """The ids of the live threads of process pid (none if it is gone)."""
    try:
        return [int(entry.name) for entry in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """User + system seconds of each live thread of process pid, by thread id, with the
    thread's name (`comm`). A thread that has exited is gone from this map, though the
    process's own total (`cpu_seconds`) still counts its time."""
    threads: dict[int, tuple[str, float]] = {}
    for tid in _threads(pid):
        stat = _read_stat(f"/proc/{pid}/task/{tid}/stat")
        if stat is None:
            continue  # exited between the listing and the read
        name, fields = stat
        threads[tid] = (name, (int(fields[11]) + int(fields[12])) / _TICK)
    return threads


def thread_switches(pid: int) -> dict[int, tuple[str, int]]:
    """Voluntary context switches of each live thread of process pid (`voluntary_ctxt_
    switches` in /proc/PID/task/TID/status: each time the thread blocked, on I/O, a lock,
    the GIL or a wait for work), by thread id, with the thread's name. A thread that has
    exited is gone from this map, and /proc keeps no total for it."""
    threads: dict[int, tuple[str, int]] = {}
    for tid in _threads(pid):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # exited between the listing and the read
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        threads[tid] = (fields["Name"], int(fields["voluntary_ctxt_switches"]))
    return threads


#: How trio names its worker threads (the OS name is cut to 15 bytes).
_WORKER_NAME = "Trio thread"


def _part(pid: int, tid: int, name: str, process_name: str) -> str:
    """Which part of the daemon a thread is: its event loop (the main thread), one of
    trio's worker threads, or another (native) thread. A worker is told by its name: up
    to Python 3.13 a Python thread keeps the process's, where native threads name
    themselves (tokio's `tokio-rt-worker`, RocksDB's `rocksdb:low`); from 3.14 it carries
    its Python name, which trio makes "Trio thread N"."""
    if tid == pid:
        return "loop"
    if name == process_name or name.startswith(_WORKER_NAME):
        return "workers"
    return "other"


def split_by_thread(pid: int, before: dict[int, tuple[str, float]],
                    after: dict[int, tuple[str, float]], total: float) -> dict[str, float]:
    """The CPU seconds `total` of process pid between two `thread_cpu` samples, split into
    its main thread (the daemon's event loop), trio's worker threads and the rest
    (native threads, and threads that exited between the samples)."""
    if pid not in after:
        return {"loop": 0.0, "workers": 0.0, "other": total}
    parts = _deltas(pid, before, after)
    return {"loop": parts["loop"], "workers": parts["workers"],
            "other": max(0.0, total - parts["loop"] - parts["workers"])}


def switches_by_thread(pid: int, before: dict[int, tuple[str, int]],
                       after: dict[int, tuple[str, int]]) -> dict[str, int]:
    """The voluntary context switches of process pid between two `thread_switches`
    samples, by part as `split_by_thread` splits CPU (threads that exited in between
    are not counted: /proc keeps no count for them)."""
    if pid not in after:
        return {"loop": 0, "workers": 0, "other": 0}
    return {part: int(n) for part, n in _deltas(pid, before, after).items()}


def _deltas(pid: int, before: dict[int, tuple[str, float]] | dict[int, tuple[str, int]],
            after: dict[int, tuple[str, float]] | dict[int, tuple[str, int]],
            ) -> dict[str, float]:
    process_name = after[pid][0]
    parts = {"loop": 0.0, "workers": 0.0, "other": 0.0}
    for tid, (name, value) in after.items():
        parts[_part(pid, tid, name, process_name)] += value - (before[tid][1]
                                                               if tid in before else 0)
    return parts
