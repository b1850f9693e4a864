"""Worker threads (bucketfs/workers.py): what `in_worker` runs comes back as it would
from a direct call, runs under SCHED_BATCH (and so do threads it starts), within the
limiter given, and the trio thread keeps its own policy."""

from __future__ import annotations

import os
import threading

import pytest
import trio

from bucketfs.workers import Batches, in_worker, run_as_background_thread


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


def test_batches_give_each_caller_its_own_value_or_exception():
    def invert(x: int) -> float:
        return 1 / x

    async def main() -> dict[int, object]:
        batches = Batches(invert, threads=2, batch=4)
        seen: dict[int, object] = {}

        async def caller(x: int) -> None:
            try:
                seen[x] = await batches.call(x)
            except ZeroDivisionError as exc:
                seen[x] = exc

        async with trio.open_nursery() as nursery:
            for x in range(-10, 11):
                nursery.start_soon(caller, x)
        return seen

    seen = trio.run(main)
    assert set(seen) == set(range(-10, 11))
    assert isinstance(seen.pop(0), ZeroDivisionError)
    assert all(value == 1 / x for x, value in seen.items())


def test_concurrent_calls_share_hops_within_the_thread_bound():
    """Calls queued while a batch is made are made together, at most `batch` per hop,
    and never more than `threads` threads at once."""
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

    async def main() -> Batches[int, int]:
        batches = Batches(work, threads=2, batch=8)
        async with trio.open_nursery() as nursery:
            for x in range(40):
                nursery.start_soon(batches.call, x)
            await trio.sleep(0.05)  # every call queued behind the first ones
            gate.set()
        return batches

    batches = trio.run(main)
    assert batches.calls == 40
    assert peak == 2
    # Eight calls to a batch at most (five batches), and no more than one batch short
    # of eight (the first thread's ends when the queue is empty): not 40 hops.
    assert 5 <= batches.batches <= 6


def test_a_cancelled_batch_caller_waits_for_its_call():
    """As with in_worker: the call is made and waited for, and the cancellation is
    seen at the caller's next checkpoint."""
    finished = threading.Event()

    def slow(_: None) -> str:
        threading.Event().wait(0.2)
        finished.set()
        return "done"

    async def main() -> tuple[bool, object, bool]:
        batches = Batches(slow, threads=1)
        got: object = None
        with trio.move_on_after(0.02) as scope:
            got = await batches.call(None)
            await trio.lowlevel.checkpoint()
        return scope.cancelled_caught, got, finished.is_set()

    assert trio.run(main) == (True, "done", True)


def test_batch_workers_run_under_sched_batch():
    async def main() -> int:
        return await Batches(lambda _: policy(), threads=1).call(None)

    assert trio.run(main) == os.SCHED_BATCH
