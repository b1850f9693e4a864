"""Sequential read-ahead for one open file.

The policy, after mountpoint-s3: the window starts small, doubles each time the reader
stays sequential and the buffered bytes ahead run low, and resets on a seek. Bytes
are requested ahead only when less than half the window remains buffered (DELI's
"prefetch when half is consumed"), so GETs stay large. Memory is not decided here: the
caller charges each planned part against a global budget.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ReadaheadPlan:
    #: Fetch ahead up to here (exclusive), if that is past what is buffered; the read's
    #: own bytes are the caller's to fetch.
    fetch_until: int
    #: False: a seek, read-ahead starts over after this read.
    sequential: bool


class SequentialWindow:
    def __init__(self, size: int, *, initial: int, maximum: int) -> None:
        if not 0 < initial <= maximum:
            raise ValueError("need 0 < initial <= maximum")
        self.size = size
        self.initial = initial
        self.maximum = maximum
        self.window = initial
        #: Where the next sequential read is expected to start.
        self.next_offset = 0

    def on_read(self, start: int, end: int, buffered_until: int) -> ReadaheadPlan:
        """A read of [start, end) arrived; `buffered_until` is where the bytes already
        fetched or in flight for this file stop (or `start` if none cover it)."""
        # The kernel issues its own read-ahead concurrently, so a read may land a little
        # before or after the previous one; anything up to one window away counts as
        # sequential.
        sequential = self.next_offset - self.window <= start <= self.next_offset + self.window
        self.next_offset = max(self.next_offset, end) if sequential else end
        if not sequential:
            self.window = self.initial
            return ReadaheadPlan(fetch_until=end, sequential=False)
        if buffered_until - end >= self.window // 2:
            return ReadaheadPlan(fetch_until=buffered_until, sequential=True)
        plan = ReadaheadPlan(fetch_until=min(self.size, end + self.window), sequential=True)
        self.window = min(self.maximum, self.window * 2)
        return plan
