"""A watchdog over reads for load tests: every read is timed, and one that takes longer
than a bound fails the test instead of hanging it.

    watchdog = Watchdog(names, slots=8, bound=20.0, on_stall=kill_the_daemon)
    with watchdog:
        with watchdog.timing(slot, names.index(path)):
            data = read(path)
    watchdog.check()  # AssertionError naming the path of a stalled read

Readers record the start and end of each read in their own slot of shared memory, so
forked children (DataLoader workers) are watched like threads of this process. A monitor
thread looks at every slot ten times a second; the first read older than the bound is
recorded and `on_stall` is called, which should make every pending read fail (killing
the FUSE daemon does: the kernel aborts its requests with ENOTCONN). CLOCK_MONOTONIC is
one clock for every process, so a child's start time means the same to the monitor.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.sharedctypes import RawArray
from types import TracebackType
from typing import Self

TICK_S = 0.1


class Watchdog:
    def __init__(self, names: Sequence[str], *, slots: int, bound: float,
                 on_stall: Callable[[], None]) -> None:
        self.names = list(names)
        self.bound = bound
        self.on_stall = on_stall
        # One writer per slot (a thread or a worker process), so no locks: the monitor
        # reads aligned doubles and ints, which a store never tears.
        self._started = RawArray(ctypes.c_double, slots)  # 0: no read in progress
        self._what = RawArray(ctypes.c_int, slots)
        self._reads = RawArray(ctypes.c_longlong, slots)
        self._longest = RawArray(ctypes.c_double, slots)
        self._longest_what = RawArray(ctypes.c_int, slots)
        #: Called on every tick from the monitor thread (sampling the daemon's RSS).
        self.on_tick: list[Callable[[], None]] = []
        self.stall: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    @contextlib.contextmanager
    def timing(self, slot: int, what: int) -> Iterator[None]:
        """Time one read of `names[what]` by the reader owning `slot`."""
        self._what[slot] = what
        started = self._started[slot] = time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - started
            self._started[slot] = 0.0
            self._reads[slot] += 1
            if elapsed > self._longest[slot]:
                self._longest[slot], self._longest_what[slot] = elapsed, what

    @property
    def reads(self) -> int:
        return sum(self._reads)

    def longest(self) -> tuple[float, str]:
        """The longest read so far, in seconds, and what it read."""
        slot = max(range(len(self._longest)), key=self._longest.__getitem__)
        return self._longest[slot], self.names[self._longest_what[slot]]

    def check(self) -> None:
        assert self.stall is None, f"a read stalled: {self.stall}"

    def _watch(self) -> None:
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            for slot, started in enumerate(self._started):
                if started and now - started > self.bound and self.stall is None:
                    self.stall = (f"{self.names[self._what[slot]]} has been read for "
                                  f"{now - started:.1f} s (bound {self.bound} s, slot {slot})")
                    self.on_stall()
            for tick in self.on_tick:
                tick()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
