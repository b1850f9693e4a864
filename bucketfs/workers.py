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


class Batches(Generic[A, T]):
    """Calls of one blocking function, made by worker threads in batches: `call(arg)`
    queues its argument and waits; a worker thread makes queued calls one after another
    until `batch` are made or none is queued, then hands every result back to the trio
    thread with one wakeup. Under many concurrent callers (readers missing RAM at once)
    one thread hop then serves several calls, where `in_worker` makes one hop, one
    limiter slot and two wakeups per call.

    At most `threads` worker threads at once. A thread starts when the first call is
    queued, and another while fewer than `threads` run and at least `batch` calls wait;
    when a batch ends with calls still queued, the next starts at once. Each call's
    exception (or result) goes to its caller alone. As with `in_worker`, a caller
    cancelled while its call is queued or made waits for it. Trio thread only, but for
    the worker threads' own part."""

    def __init__(self, fn: Callable[[A], T], *, threads: int, batch: int = 8) -> None:
        if threads < 1 or batch < 1:
            raise ValueError("a batch needs at least one thread and one call")
        self.fn = fn
        self.threads = threads
        self.batch = batch
        #: (argument, waiting task); the trio thread appends, worker threads pop (a
        #: deque's append and popleft are atomic).
        self._queued: collections.deque[tuple[A, trio.lowlevel.Task]] = collections.deque()
        self._running = 0
        #: Batches made, and calls made in them (the mean batch, for tests and metrics).
        self.batches = 0
        self.calls = 0

    async def call(self, arg: A) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._queued.append((arg, trio.lowlevel.current_task()))
        if self._running == 0 or (
                self._running < self.threads and len(self._queued) >= self.batch):
            self._start()
        return await trio.lowlevel.wait_task_rescheduled(_wait_for_the_thread)  # type: ignore[no-any-return]

    def _start(self) -> None:
        self._running += 1
        token = trio.lowlevel.current_trio_token()

        def deliver(made: outcome.Outcome[list[tuple[trio.lowlevel.Task, outcome.Outcome[T]]]],
                    ) -> None:
            token.run_sync_soon(self._finished, made)

        trio.lowlevel.start_thread_soon(functools.partial(_call, self._make_batch, ()),
                                        deliver)

    def _make_batch(self) -> list[tuple[trio.lowlevel.Task, outcome.Outcome[T]]]:
        """In a worker thread: up to `batch` queued calls, each result captured."""
        made = []
        while len(made) < self.batch:
            try:
                arg, task = self._queued.popleft()
            except IndexError:
                break
            made.append((task, outcome.capture(self.fn, arg)))
        return made

    def _finished(self, made: outcome.Outcome[list[tuple[trio.lowlevel.Task,
                                                          outcome.Outcome[T]]]]) -> None:
        """In the trio thread (a callback of `run_sync_soon`, which must not raise):
        every caller of the batch gets its result; another batch starts while calls are
        queued."""
        self._running -= 1
        if isinstance(made, outcome.Error):  # _make_batch captures every call's error
            log.error("a batch of worker calls failed", exc_info=made.error)
        else:
            self.batches += 1
            self.calls += len(made.value)
            for task, result in made.value:
                trio.lowlevel.reschedule(task, result)
        if self._queued and self._running < self.threads:
            self._start()
