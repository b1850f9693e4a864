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
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import trio

log = logging.getLogger(__name__)

T = TypeVar("T")

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
    """`fn(*args)` in a worker thread (`trio.to_thread.run_sync`), under SCHED_BATCH."""
    # Named as trio names it, after `fn` rather than this module's wrapper (py-spy, top).
    name = f"{getattr(fn, '__name__', None)} from {trio.lowlevel.current_task().name}"
    return await trio.to_thread.run_sync(_call, fn, args, thread_name=name, limiter=limiter)
