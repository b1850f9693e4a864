"""The serving thread's load as `bucketfs status` reports it: its share of a core, its
time per file opened and the files per second that allows, over the sampled window."""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace

from bucketfs.status import MountFacts, MountStatus, _Sample


class Clocks:
    def __init__(self) -> None:
        self.thread, self.process = 0.0, 0.0

    def thread_cpu_s(self) -> float:
        return self.thread

    def process_cpu_s(self) -> float:
        return self.process


def status_with(clocks: Clocks, reader: SimpleNamespace) -> MountStatus:
    store = SimpleNamespace(counts=SimpleNamespace(bytes_fetched=0, get=0, head=0, list=0))
    facts = MountFacts("s3://b/", "s3", "", "/mnt", 4 << 20)
    return MountStatus(facts, SimpleNamespace(), store, reader, None, SimpleNamespace(),
                       clocks)  # type: ignore[arg-type]


def ten_seconds_ago(status: MountStatus, opens: int, thread: float, process: float) -> None:
    status._samples = collections.deque(
        [_Sample(time.monotonic() - 10.0, 0, 0, opens, thread, process)])


def test_a_busy_window_gives_the_time_per_file_and_the_ceiling_it_allows():
    clocks, reader = Clocks(), SimpleNamespace(opens=0)
    status = status_with(clocks, reader)
    ten_seconds_ago(status, opens=1_000, thread=5.0, process=7.0)
    reader.opens, clocks.thread, clocks.process = 21_000, 13.6, 20.0  # 20,000 files, 8.6 s
    load = status._load()
    assert 9.9 <= load["interval_s"] <= 10.1
    assert abs(load["serving_thread_busy"] - 0.86) < 0.01
    assert abs(load["daemon_cores"] - 1.3) < 0.02
    assert load["serving_ms_per_file"] == 0.43
    assert load["files_per_s_ceiling"] == 2_326


def test_too_few_files_in_the_window_give_no_time_per_file():
    clocks, reader = Clocks(), SimpleNamespace(opens=0)
    status = status_with(clocks, reader)
    ten_seconds_ago(status, opens=0, thread=0.0, process=0.0)
    reader.opens, clocks.thread, clocks.process = 99, 0.5, 0.6  # mostly other work
    load = status._load()
    assert load["serving_ms_per_file"] is None and load["files_per_s_ceiling"] is None
    assert abs(load["serving_thread_busy"] - 0.05) < 0.01
