"""How busy the thread that answers every FUSE request is: one mount's ceiling.

Every request of a mount is answered by the one trio thread (docs/ARCHITECTURE.md, "One
serving process"), so the CPU that thread spends per second, near 1, says the mount
serves as many files per second as it can, whatever the node's cores: more readers
then wait longer, they do not read faster (a cold ~100 KB file costs it ~0.43 ms on the
2-core VM, docs/BENCHMARKS.md). The daemon's CPU in all (worker threads: the SSD tier,
large replies) says what the mount costs the node. Both are read from the kernel's
per-thread and per-process CPU clocks, so counting them costs the read path nothing,
and any thread (Prometheus's scrape) can read them. `bucketfs status` also divides the
thread's CPU by the files opened in the same seconds: its time per file, and the files
per second that allows at that mix of work.
"""

from __future__ import annotations

import threading
import time


class ServingLoad:
    """The CPU clocks of the serving thread (the one that makes this) and the process."""

    def __init__(self) -> None:
        self._thread_clock = time.pthread_getcpuclockid(threading.get_ident())

    def thread_cpu_s(self) -> float:
        """CPU seconds the serving thread has used."""
        return time.clock_gettime(self._thread_clock)

    @staticmethod
    def process_cpu_s() -> float:
        """CPU seconds the daemon has used, all its threads."""
        return time.process_time()
