"""`bucketfs warm`: the daemon fetches files into the cache before training, through the
path reads take.

A WARM request on the hints socket names files relative to the mount (the client walked
the directories through the mount). `WarmJobs.start` answers at once with the job's id
and runs it in a task:

1. resolve the paths through the namespace, one lookup per path segment as hinted
   orders are resolved, with a checkpoint every few thousand so FUSE requests are
   served meanwhile (paths that name no file are counted as `missing`);
2. fit the budget: files are taken in the order given until the next would take their
   total past the budget of the cache's last tier (the SSD tier's, else RAM's); the
   rest are `skipped` (warming them would only evict the first ones), and the status
   says so;
3. fetch every block of each file that no tier holds yet through `BlockCache.get`:
   RAM, write-through to SSD (waiting when the disk's queue is full), one single-flight
   GET shared with any reader, the origin's connection limit and the retry policy all
   apply. At most `connections` files are in flight over all jobs (fewer than the
   origin's connections, so a reader's own miss always finds one).

A file whose fetch fails after the retries counts as an error and the job goes on.
Anything else that goes wrong fails that job (one log line, counted as a background
failure), never the mount. CANCEL stops a job: what it fetched stays cached. The
status (`snapshot`) holds the running jobs and the last finished ones.

Concurrency: everything here runs in the trio thread; jobs are only touched between
awaits.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from bucketfs.backends.base import BackendError
from bucketfs.backends.common import one_line
from bucketfs.cache.blocks import BlockId, ObjectRef, block_span
from bucketfs.cache.schema import DirEntry
from bucketfs.cache.tiered import BlockCache
from bucketfs.namespace import Namespace
from bucketfs.tasks import describe, failed

log = logging.getLogger(__name__)

#: Jobs running at once (a client cannot make the daemon hold unbounded path lists),
#: and finished jobs kept for the status.
MAX_RUNNING = 4
KEEP_FINISHED = 8
#: Path lookups between two checkpoints while resolving.
_RESOLVE_SLICE = 2048


@dataclass(eq=False, slots=True)
class WarmJob:
    id: int
    paths: int
    started: float = field(default_factory=time.monotonic)
    state: str = "resolving"  # then "warming", then "done", "cancelled" or "failed"
    reason: str = ""
    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    #: Of the done: files and bytes already cached when the job came to them.
    files_cached: int = 0
    bytes_cached: int = 0
    errors: int = 0
    first_error: str = ""
    missing: int = 0
    skipped_files: int = 0
    skipped_bytes: int = 0
    tier: str = ""
    budget: int = 0
    finished: float | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    @property
    def done(self) -> bool:
        return self.finished is not None

    def snapshot(self) -> dict[str, Any]:
        end = self.finished if self.finished is not None else time.monotonic()
        return {
            "id": self.id, "state": self.state, "done": self.done, "reason": self.reason,
            "paths": self.paths, "files_total": self.files_total,
            "bytes_total": self.bytes_total, "files_done": self.files_done,
            "bytes_done": self.bytes_done, "files_cached": self.files_cached,
            "bytes_cached": self.bytes_cached, "errors": self.errors,
            "first_error": self.first_error, "missing": self.missing,
            "skipped_files": self.skipped_files, "skipped_bytes": self.skipped_bytes,
            "tier": self.tier, "budget": self.budget, "elapsed_s": round(end - self.started, 2),
        }


class WarmJobs:
    def __init__(self, namespace: Namespace, cache: BlockCache, nursery: trio.Nursery, *,
                 connections: int) -> None:
        self.namespace = namespace
        self.cache = cache
        self.nursery = nursery
        self.connections = max(1, connections)
        # Shared by every job: two warms do not double the connections taken.
        self.limiter = trio.CapacityLimiter(self.connections)
        self.jobs: dict[int, WarmJob] = {}
        self._ids = itertools.count(1)
        #: Files that failed, over all jobs since the mount (the status's errors).
        self.errors = 0

    # --- the hints socket (sync, trio thread) --------------------------------------------

    def start(self, paths: Sequence[str]) -> int:
        running = sum(not job.done for job in self.jobs.values())
        if running >= MAX_RUNNING:
            raise ValueError(f"{running} warm jobs are running already (limit "
                             f"{MAX_RUNNING}); wait for one or cancel it")
        job = WarmJob(next(self._ids), len(paths))
        self.jobs[job.id] = job
        self._forget_finished()
        self.nursery.start_soon(self._run, job, paths)
        return job.id

    def cancel(self, number: int) -> None:
        job = self.jobs.get(number)
        if job is None:
            raise ValueError(f"no warm job {number}")
        if not job.done:
            job.state = "cancelled"
            job.scope.cancel()

    def cancel_all(self, reason: str) -> None:
        """Stop every running job (the mount is going down: the flush to SSD must not
        wait for a job that goes on fetching)."""
        for job in self.jobs.values():
            if not job.done:
                job.state, job.reason = "cancelled", reason
                job.scope.cancel()

    def snapshot(self) -> list[dict[str, Any]]:
        return [job.snapshot() for job in self.jobs.values()]

    def _forget_finished(self) -> None:
        finished = [n for n, job in self.jobs.items() if job.done]
        for number in finished[:max(0, len(finished) - KEEP_FINISHED)]:
            del self.jobs[number]

    # --- a job ---------------------------------------------------------------------------

    async def _run(self, job: WarmJob, paths: Sequence[str]) -> None:
        """Whatever goes wrong fails this job (one log line), never the mount."""
        try:
            with job.scope:
                objects = await self._resolve(job, paths)
                del paths  # the job holds only what it will fetch
                self._fit(job, objects)
                job.state = "warming"
                await self._fetch_all(job, objects)
                job.state = "done"
        except BackendError as exc:  # a listing that failed after the retries
            job.state, job.reason = "failed", one_line(str(exc))
            log.warning("warm job %d failed: %s", job.id, job.reason)
        except Exception as exc:
            while isinstance(exc, ExceptionGroup):  # from the workers' nursery: say what
                exc = exc.exceptions[0]
            job.state, job.reason = "failed", describe(exc)
            failed(f"warm job {job.id}", exc)
        finally:
            if job.state in ("resolving", "warming"):  # the mount's nursery was cancelled
                job.state, job.reason = "cancelled", "unmounted"
            job.finished = time.monotonic()
            if job.state != "failed":
                log.info("warm job %d %s: %d of %d files (%.1f MiB) in %.1f s, %d already "
                         "cached, %d errors%s", job.id, job.state, job.files_done,
                         job.files_total, job.bytes_done / 2**20, job.finished - job.started,
                         job.files_cached, job.errors,
                         f" (first: {job.first_error})" if job.errors else "")

    async def _resolve(self, job: WarmJob, paths: Sequence[str]) -> list[ObjectRef]:
        """The files the paths name now, each once, in the order given."""
        known: dict[tuple[int, str], int | None] = {}
        found: dict[str, ObjectRef] = {}
        for number, path in enumerate(paths, 1):
            *directories, name = path.split("/")
            inode: int | None = self.namespace.root.inode
            for segment in directories:
                step = (inode, segment)
                if step not in known:
                    node = await self._lookup(inode, segment)
                    known[step] = node.inode if node is not None and node.is_dir else None
                inode = known[step]
                if inode is None:
                    break
            node = None if inode is None else await self._lookup(inode, name)
            if node is None or node.is_dir:
                job.missing += 1
            else:
                found.setdefault(node.key, ObjectRef(node.key, node.version, node.size))
            if number % _RESOLVE_SLICE == 0:
                await trio.sleep(0)  # FUSE requests are served between slices
        return list(found.values())

    async def _lookup(self, parent: int, name: str) -> DirEntry | None:
        try:
            return await self.namespace.lookup(parent, name)
        except KeyError:  # the directory's inode went with a re-listing
            return None

    def _fit(self, job: WarmJob, objects: list[ObjectRef]) -> None:
        """Keep the files that fit the last tier's budget, in order; count the rest."""
        last = self.cache.tiers[-1]
        job.tier, job.budget = last.name, last.capacity
        total = 0
        for count, obj in enumerate(objects):
            if total + obj.size > last.capacity:
                rest = objects[count:]
                job.skipped_files = len(rest)
                job.skipped_bytes = sum(o.size for o in rest)
                del objects[count:]
                log.warning("warm job %d: %d files (%.1f MiB) do not fit the %s cache's "
                            "budget of %.1f MiB: warming the first %d", job.id,
                            count + len(rest), (total + job.skipped_bytes) / 2**20,
                            last.name.upper(), last.capacity / 2**20, count)
                break
            total += obj.size
        job.files_total, job.bytes_total = len(objects), total

    async def _fetch_all(self, job: WarmJob, objects: list[ObjectRef]) -> None:
        queue = iter(objects)  # shared: each worker takes the next file
        async with trio.open_nursery() as nursery:
            for _ in range(min(self.connections, len(objects))):
                nursery.start_soon(self._worker, job, queue)

    async def _worker(self, job: WarmJob, queue: Any) -> None:
        for obj in queue:
            await trio.lowlevel.checkpoint()  # files already cached take no await
            async with self.limiter:
                await self._fetch(job, obj)

    async def _fetch(self, job: WarmJob, obj: ObjectRef) -> None:
        block_size = self.cache.block_size
        cached = True
        try:
            for index in range(-(-obj.size // block_size)):
                block = BlockId(obj.key, obj.version, index, size=obj.size)
                start, end = block_span(obj.size, block_size, index)
                if not self.cache.holds(block):
                    cached = False
                    await self.cache.get(obj, index)
                job.bytes_done += end - start
        except BackendError as exc:  # counted; the job goes on with the next file
            job.errors += 1
            self.errors += 1
            job.first_error = job.first_error or one_line(str(exc))
            return
        job.files_done += 1
        if cached:
            job.files_cached += 1
            job.bytes_cached += obj.size
