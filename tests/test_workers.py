"""Worker threads (bucketfs/workers.py): what `in_worker` runs comes back as it would
from a direct call, runs under SCHED_BATCH (and so do threads it starts), within the
limiter given, and the trio thread keeps its own policy."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import trio

from bucketfs.workers import in_worker, run_as_background_thread


def policy() -> int:
    return os.sched_getscheduler(0)


def policy_of_a_thread_started_here() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(policy()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_worker_runs_under_sched_batch_and_the_trio_thread_keeps_its_policy():
    async def main() -> tuple[int, int, int, int]:
        before = policy()
        in_thread = await in_worker(policy)
        started = await in_worker(policy_of_a_thread_started_here)
        return before, in_thread, started, policy()

    before, in_thread, started, after = trio.run(main)
    assert in_thread == os.SCHED_BATCH
    assert started == os.SCHED_BATCH  # obstore's tokio threads start this way
    assert before == after == os.SCHED_OTHER


def test_values_and_exceptions_pass_through():
    def divide(a: int, b: int) -> float:
        return a / b

    async def main() -> None:
        assert await in_worker(divide, 6, 3) == 2
        with pytest.raises(ZeroDivisionError):
            await in_worker(divide, 1, 0)

    trio.run(main)


def test_the_limiter_bounds_how_many_run_at_once():
    running, peak = 0, 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        threading.Event().wait(0.02)
        with lock:
            running -= 1

    async def main() -> None:
        limiter = trio.CapacityLimiter(2)
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(lambda: in_worker(work, limiter=limiter))

    trio.run(main)
    assert peak == 2


def test_a_policy_the_operator_chose_is_kept():
    """A daemon started under SCHED_IDLE (`chrt --idle`) keeps it in its workers: only
    threads under the default policy are switched."""
    def idle_then_mark() -> int:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        run_as_background_thread()
        return policy()

    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(idle_then_mark()))
    thread.start()
    thread.join()
    assert seen == [os.SCHED_IDLE]


def test_a_worker_is_named_after_what_it_runs():
    """As trio names its threads (what py-spy and top show), not after the wrapper."""
    def os_thread_name() -> str:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    async def main() -> str:
        return await in_worker(os_thread_name)

    assert trio.run(main).startswith("os_thread_name")
