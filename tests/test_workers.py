"""Worker threads (bucketfs/workers.py): what `in_worker` runs comes back as it would
from a direct call, runs under SCHED_BATCH (and so do threads it starts), within the
limiter given, and the trio thread keeps its own policy."""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from bucketfs.workers import CallQueue, in_worker, run_as_background_thread


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


def test_a_cancelled_caller_waits_for_its_worker_and_frees_the_slot():
    """Cancellation cannot abandon a running worker (its result, a block written or a
    buffer filled, must not land after the caller has gone): the caller waits for it,
    then sees the cancellation, and the limiter's slot is free again."""
    finished = threading.Event()

    def slow() -> str:
        threading.Event().wait(0.2)
        finished.set()
        return "done"

    async def main() -> tuple[bool, bool, int]:
        limiter = trio.CapacityLimiter(1)
        with trio.move_on_after(0.02) as scope:
            await in_worker(slow, limiter=limiter)
            await trio.lowlevel.checkpoint()
        return scope.cancelled_caught, finished.is_set(), limiter.borrowed_tokens

    cancelled, finished_first, borrowed = trio.run(main)
    assert cancelled and finished_first and borrowed == 0


def test_a_task_holding_a_slot_may_still_call_a_worker_under_that_limiter():
    """Each call borrows a slot of its own, as `trio.to_thread.run_sync` does: a task
    that already holds one of the limiter's slots is not refused a second."""
    async def main() -> int:
        limiter = trio.CapacityLimiter(2)
        async with limiter:
            return await in_worker(lambda: limiter.borrowed_tokens, limiter=limiter)

    assert trio.run(main) == 2


async def call_each(calls: CallQueue[int, Any], args: range,
                    meanwhile: Callable[[], Awaitable[None]] | None = None,
                    ) -> dict[int, object]:
    """Each of `args` through `calls`, from a task of its own: its value, or what it
    raised. `meanwhile` runs once every task has started."""
    got: dict[int, object] = {}

    async def caller(x: int) -> None:
        try:
            got[x] = await calls.call(x)
        except Exception as exc:
            got[x] = exc

    async with trio.open_nursery() as nursery:
        for x in args:
            nursery.start_soon(caller, x)
        if meanwhile is not None:
            await meanwhile()
    return got


def test_a_call_queue_gives_each_caller_its_own_value_or_exception():
    def invert(x: int) -> float:
        return 1 / x

    seen = trio.run(call_each, CallQueue(invert, threads=2), range(-10, 11))
    assert set(seen) == set(range(-10, 11))
    assert isinstance(seen.pop(0), ZeroDivisionError)
    assert all(value == 1 / x for x, value in seen.items())


def test_queued_calls_are_made_by_the_running_threads_within_the_bound():
    """Calls that come while every thread is busy wait in the queue, and the threads
    take them when their own call returns: 40 calls, two thread hops, never more than
    two threads at once."""
    running, peak = 0, 0
    lock = threading.Lock()
    gate = threading.Event()

    def work(x: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        gate.wait(5)
        with lock:
            running -= 1
        return x

    async def open_the_gate() -> None:
        await trio.sleep(0.05)  # every call queued behind the first two
        gate.set()

    calls = CallQueue(work, threads=2)
    got = trio.run(call_each, calls, range(40), open_the_gate)
    assert sorted(got.values()) == list(range(40)) and calls.calls == 40
    assert peak == 2
    assert calls.hops == 2


def test_calls_run_side_by_side_while_threads_are_free():
    """A call never waits behind another's while fewer than `threads` run (a slow disk
    keeps its parallel reads): four calls that each wait for the other three finish."""
    meeting = threading.Barrier(4, timeout=5)

    def meet(_: int) -> int:
        return meeting.wait()

    got = trio.run(call_each, CallQueue(meet, threads=4), range(4))
    assert sorted(got.values()) == [0, 1, 2, 3]  # each thread's arrival index


def test_a_cancelled_queued_caller_waits_for_its_call():
    """As with in_worker: the call is made and waited for, and the cancellation is
    seen at the caller's next checkpoint."""
    finished = threading.Event()

    def slow(_: None) -> str:
        threading.Event().wait(0.2)
        finished.set()
        return "done"

    async def main() -> tuple[bool, object, bool]:
        calls = CallQueue(slow, threads=1)
        got: object = None
        with trio.move_on_after(0.02) as scope:
            got = await calls.call(None)
            await trio.lowlevel.checkpoint()
        return scope.cancelled_caught, got, finished.is_set()

    assert trio.run(main) == (True, "done", True)


def test_call_queue_threads_run_under_sched_batch():
    async def main() -> int:
        return await CallQueue(lambda _: policy(), threads=1).call(None)

    assert trio.run(main) == os.SCHED_BATCH
