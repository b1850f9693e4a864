"""Worker threads: where every blocking call of the daemon runs (GETs and other backend
calls, the SSD tier, index writes, layout planning, large hint bodies).

Each worker thread runs under SCHED_BATCH. Why: a worker wakes when its GET or disk
write completes, and the first thing it needs is the GIL, which the trio thread usually
holds. Under the default policy the waking worker preempts whatever runs on its CPU,
often the trio thread itself, only to block on the GIL at once: two context switches
for nothing, several times per cold file. SCHED_BATCH takes wakeup preemption away from
these threads and nothing else (they keep their fair share of CPU; on an idle CPU they
run at once). The trio thread keeps the default policy, so a FUSE request still wakes it
promptly. Threads a worker starts inherit the policy: obstore's tokio threads are
started by the first GET. On 2,000 cold 100 KB files this took the daemon from
0.74-0.79 to 0.62-0.64 ms of CPU per file (docs/BENCHMARKS.md, step 12). The cost:
with every core busy (DataLoader workers decoding), a finished GET waits for the running
task's time slice; a hinted far-link epoch took about 2% longer in the median.

No privilege is needed: any thread may lower its own claim this way. A daemon an
operator started under another policy (`chrt --idle`, a real-time one) keeps it: only
threads under the default policy are switched.

The hop to a worker is trio's thread cache (`trio.lowlevel.start_thread_soon`) and a
reschedule of the waiting task, not `trio.to_thread.run_sync`, which also copies the
context, names the thread after each job (two `prctl` calls through ctypes) and runs a
message loop so that the thread may call back into trio: nothing here uses those, and
a cold file makes two or three hops. 2,000 cold 100 KB files, interleaved: 0.66-0.685
-> 0.615-0.64 ms of daemon CPU per file with the SSD tier, 0.515-0.565 -> 0.48-0.535 RAM
only (docs/BENCHMARKS.md, step 15). Threads keep trio's names
(`Trio thread N`); py-spy's stacks say what each runs.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import outcome
import trio

log = logging.getLogger(__name__)

T = TypeVar("T")
A = TypeVar("A")

_thread = threading.local()


def run_as_background_thread() -> None:
    """Put the calling thread under SCHED_BATCH if it runs under the default policy
    (once per thread; a no-op where the platform has no such policy, logged at DEBUG if
    the kernel refuses)."""
    _thread.background = True
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None:
        return
    try:
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            os.sched_setscheduler(0, batch, os.sched_param(0))
    except OSError as exc:  # a seccomp filter, say: the thread runs as it was
        log.debug("cannot put a worker thread under SCHED_BATCH: %s", exc)


def _call(fn: Callable[..., T], args: tuple[object, ...]) -> T:
    if not getattr(_thread, "background", False):
        run_as_background_thread()
    return fn(*args)


async def in_worker(fn: Callable[..., T], *args: object,
                    limiter: trio.CapacityLimiter | None = None) -> T:
    """`fn(*args)` in a worker thread under SCHED_BATCH, at most `limiter`'s count at
    once (trio's default limiter if None). The calling task waits until `fn` returns,
    even if cancelled meanwhile (as `trio.to_thread.run_sync` waits by default): the
    cancellation takes effect at its next checkpoint."""
    if limiter is None:
        limiter = trio.to_thread.current_default_thread_limiter()
    await trio.lowlevel.checkpoint_if_cancelled()
    slot = await take_slot(limiter)
    try:
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome[T]) -> None:
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        trio.lowlevel.start_thread_soon(functools.partial(_call, fn, args), deliver)
        return await trio.lowlevel.wait_task_rescheduled(_wait_for_the_thread)  # type: ignore[no-any-return]
    finally:
        limiter.release_on_behalf_of(slot)


async def take_slot(limiter: trio.CapacityLimiter) -> object:
    """A slot of `limiter` for one call (a borrower per call, so one task may wait on
    several calls); release it with `limiter.release_on_behalf_of(slot)`. A free slot is
    taken without the scheduling round trip `acquire_on_behalf_of` makes even then."""
    slot = object()
    try:
        limiter.acquire_on_behalf_of_nowait(slot)
    except trio.WouldBlock:
        await limiter.acquire_on_behalf_of(slot)
    return slot


def _wait_for_the_thread(_: object) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


class CallQueue(Generic[A, T]):
    """Calls of one blocking function from the trio thread, served by at most `threads`
    worker threads that go on with each other's queued calls and hand results back in
    shared wakeups: where `in_worker` costs every call a thread hop, a limiter slot and
    two wakeups, a busy queue costs a call an append and a share of one wakeup.

    `call(arg)` starts a worker thread for its call while fewer than `threads` run (as
    many calls in flight as with a limiter of that count: a thread never waits behind
    another's call), and otherwise queues it. A thread that finishes a call takes the
    next queued one, and leaves when none is queued. Each result goes back as soon as
    its call returns: appended to a list, with a callback for the trio thread scheduled
    only if none is pending, so results that finish while the trio thread is busy go
    back together. Each call's exception (or result) goes to its caller alone. As with
    `in_worker`, a caller cancelled while its call is queued or made waits for it.
    Trio thread only, but for the worker threads' own part."""

    def __init__(self, fn: Callable[[A], T], *, threads: int) -> None:
        if threads < 1:
            raise ValueError("a call queue needs at least one thread")
        self.fn = fn
        self.threads = threads
        #: (argument, waiting task): the trio thread appends, worker threads pop (a
        #: deque's append and popleft are atomic).
        self._queued: collections.deque[tuple[A, trio.lowlevel.Task]] = collections.deque()
        #: Threads started and not yet known (on the trio thread) to have left.
        self._running = 0
        #: Shared with the worker threads, under `_lock`: results not yet handed back,
        #: threads that left since, and whether a hand-back callback is scheduled.
        self._lock = threading.Lock()
        self._done: list[tuple[trio.lowlevel.Task, outcome.Outcome[T]]] = []
        self._left = 0
        self._wake_pending = False
        self._token: trio.lowlevel.TrioToken | None = None
        #: Threads started and calls made (their ratio: calls per thread hop).
        self.hops = 0
        self.calls = 0

    async def call(self, arg: A) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        job = (arg, trio.lowlevel.current_task())
        if self._running < self.threads:
            self._start(job)
        else:
            self._queued.append(job)
        return await trio.lowlevel.wait_task_rescheduled(_wait_for_the_thread)  # type: ignore[no-any-return]

    def _start(self, job: tuple[A, trio.lowlevel.Task]) -> None:
        if self._token is None:
            self._token = trio.lowlevel.current_trio_token()
        self._running += 1
        self.hops += 1
        trio.lowlevel.start_thread_soon(functools.partial(_call, self._serve, (job,)),
                                        _left_the_thread)

    def _serve(self, job: tuple[A, trio.lowlevel.Task]) -> None:
        """In a worker thread: this call, then every queued one, each result handed
        back as it comes; the last one together with the thread's leaving."""
        result = None
        try:
            while True:
                arg, task = job
                result = (task, outcome.capture(self.fn, arg))
                try:
                    job = self._queued.popleft()
                except IndexError:
                    break
                self._hand_back(result)
                result = None
        finally:
            self._hand_back(result, leaving=True)

    def _hand_back(self, result: tuple[trio.lowlevel.Task, outcome.Outcome[T]] | None, *,
                   leaving: bool = False) -> None:
        with self._lock:
            if result is not None:
                self._done.append(result)
            self._left += leaving
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            assert self._token is not None
            self._token.run_sync_soon(self._deliver)

    def _deliver(self) -> None:
        """In the trio thread (a callback of `run_sync_soon`, which must not raise):
        every result handed back since the last time, to its caller; threads that left
        are replaced while calls are queued."""
        with self._lock:
            done, self._done = self._done, []
            left, self._left = self._left, 0
            self._wake_pending = False
        self.calls += len(done)
        for task, result in done:
            trio.lowlevel.reschedule(task, result)
        self._running -= left
        # A call queued while every thread was busy, whose thread then found the queue
        # empty and left: start one for it.
        while self._queued and self._running < self.threads:
            try:
                job = self._queued.popleft()
            except IndexError:  # a running thread took it meanwhile
                break
            self._start(job)


def _left_the_thread(result: outcome.Outcome[None]) -> None:
    """trio's callback when a `CallQueue` thread's work ends: `_serve` hands every
    result back itself, and raises only on a bug, which is logged here."""
    if isinstance(result, outcome.Error):
        log.error("a worker thread of a call queue failed", exc_info=result.error)
