"""Background tasks whose failure must not take the mount down.

Every task started in the mount's nurseries either handles its own errors or runs
through `guarded`: an exception it raises is logged in one line (the traceback goes to
DEBUG) and counted, and the task ends; the mount goes on serving. Cancellation passes
through untouched, so unmounting still stops everything.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from bucketfs.backends.common import one_line
from bucketfs.logs import Throttle, held_back

log = logging.getLogger(__name__)

#: Background failures since the daemon started (the metrics and status read it).
failures = 0
#: A failure that repeats is logged at most once a minute per kind of task.
_QUIET_S = 60.0
_throttle = Throttle(_QUIET_S)


def describe(exc: BaseException) -> str:
    """One line saying what went wrong, for a log line or a reply."""
    text = str(exc)
    return one_line(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def failed(what: str, exc: BaseException) -> None:
    """Log a background failure in one line, with its traceback at DEBUG."""
    global failures
    failures += 1
    kind = what.partition(" of ")[0]  # "prefetch of 'a/b.jpg'" and the like: one kind
    held = _throttle.admit(kind)
    if held is not None:
        log.error("%s failed: %s; the mount goes on%s", what, describe(exc),
                  held_back(held))
    log.debug("%s failed", what, exc_info=exc)


async def guarded(what: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    try:
        await fn(*args)
    except Exception as exc:
        failed(what, exc)


def start_guarded(nursery: trio.Nursery, what: str, fn: Callable[..., Awaitable[Any]],
                  *args: Any) -> None:
    nursery.start_soon(guarded, what, fn, *args)
