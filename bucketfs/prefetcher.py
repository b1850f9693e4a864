"""The daemon side of hints: orders from the hints socket become fetches into the cache.

A job's order arrives as paths relative to the mount (`hints_server` validated it).
They are resolved to objects through the namespace (each directory listed once, then
one index read per file), with a checkpoint every few thousand paths so FUSE requests
are not held up, and handed to the pure `PrefetchScheduler` as (object key, size). A
newer order from the same job (rank) supersedes one still being resolved.

One task starts the fetches: woken by an order, an open while a fetch slot is free, or
a cancellation, it asks the scheduler what to start (at most the adaptive target, and
at most `connections`, fewer than the origin's connections, so a reader's own miss
always finds a free one), and starts a task for each. That task reads every block of
the object through the `BlockCache` (RAM, SSD, or one single-flight GET shared with any
reader that wants it meanwhile), reports back `fetched`, `failed` or `cancelled`, and
then, while its slot is still wanted, asks the scheduler for the next fetch itself: a
finished fetch wakes no other task. A new order that no longer wants a fetch in flight
cancels it. The scheduler's counters are copied for /metrics when a scrape asks (the
trio thread makes the copy), not at every event.

The read path tells the scheduler where each reader is: `Reader.open` calls
`observed_open(key)` once per opened file. Readers start as soon as their order is sent,
before it is resolved: the files opened meanwhile are remembered (a bounded list) and
replayed into the plan when it is installed, so the reader's position and the chunk
layout do not miss the first files of an epoch. The RAM tier's evictions of blocks that no
SSD tier keeps are reported as `evicted`, so a prefetched file that had to go before it
was read counts as wasted and is planned again.

With an SSD tier, `ChunkPacking` (bucketfs/packer.py) lays the small files the readers
open out into chunk files: in the order of the job's next epoch when the job announced
it (an ORDER with `next_epoch`: resolved like an order, given to the packer, never
prefetched), else in read order.

Concurrency: everything here runs in the trio thread; the scheduler and the packers are
only touched between awaits.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass

import trio

from bucketfs.backends.base import BackendError
from bucketfs.backends.common import one_line
from bucketfs.cache.blocks import BlockId, ObjectRef
from bucketfs.cache.schema import DirEntry
from bucketfs.cache.tiered import BlockCache
from bucketfs.hints.protocol import Order
from bucketfs.namespace import Namespace
from bucketfs.packer import ChunkPacking, layout_tag
from bucketfs.prefetch.concurrency import AdaptiveConcurrency
from bucketfs.prefetch.layout import NextPlan
from bucketfs.prefetch.scheduler import PrefetchScheduler, PrefetchStats
from bucketfs.tasks import failed, start_guarded
from bucketfs.workers import in_worker

log = logging.getLogger(__name__)

#: Opens remembered while an order resolves (its readers have already started).
_EARLY_OPENS = 8192

#: Paths resolved between two checkpoints (a listed directory: one index read each).
_RESOLVE_SLICE = 2048
#: A plan whose reader has not moved for this long belongs to a job that died without
#: saying so (kill -9): it is dropped, so its window stops holding the shared budget.
PLAN_IDLE_S = 900.0
_IDLE_CHECK_S = 30.0
#: How long a scrape of /metrics waits for the trio thread to copy the scheduler's
#: counters before it takes the last copy (a loop that busy is worth a stale figure).
STATS_WAIT_S = 1.0
#: Orders (and announcements) being resolved at once, and the bytes of paths they may
#: hold together: past either, a new order is refused with an error reply. A node's
#: ranks send two each per epoch; a dataset of a million ~100-byte paths is ~100 MB.
MAX_RESOLVING = 64
MAX_RESOLVING_BYTES = 512 << 20


def _paths_bytes(paths: Sequence[str]) -> int:
    # Characters, plus a str object's overhead each: close to what Python holds.
    return sum(map(len, paths)) + 56 * len(paths)


@dataclass(eq=False, slots=True)
class _Announced:
    """A job's next epoch's order, announced after its order number `follows`."""

    follows: int
    #: Resolved and planned, waiting for the order it follows to be installed.
    ready: tuple[NextPlan, bytes] | None = None


class HintedPrefetch:
    def __init__(
        self, namespace: Namespace, cache: BlockCache, scheduler: PrefetchScheduler, *,
        connections: int, block_size: int,
    ) -> None:
        """`scheduler` is made first: the caches' hinted eviction reads its plans."""
        self.namespace = namespace
        self.cache = cache
        self.scheduler = scheduler
        self.block_size = block_size
        self.connections = max(1, connections)
        # Start low and add GETs while they still raise the throughput (DLCache: enough
        # fetches in flight to cover the link's latency), up to `connections`. Low, because
        # on a thin link every GET too many delays the files the readers need first.
        self.concurrency = AdaptiveConcurrency(
            minimum=min(4, self.connections), maximum=self.connections,
            initial=min(4, self.connections), period_s=0.5)
        # The cache's origin bytes when a fetch last ended.
        self._origin_bytes = cache.stats.origin_bytes
        self._target_logged = self.concurrency.target
        #: Object key -> the version an order resolved it to (what prefetch fetches).
        self.objects: dict[str, ObjectRef] = {}
        self.packing = ChunkPacking(cache, self.objects, block_size) if cache.packs else None
        cache.events.on_evicted(self._ram_evicted)
        self._tasks: dict[str, trio.CancelScope] = {}
        self._generation: dict[Hashable, int] = {}
        self._generations = itertools.count(1)
        #: The cancel scope and the bytes of paths of each order being resolved, by
        #: (job, rank) and slot ("order" or "next"); the bytes of them all.
        self._resolutions: dict[tuple[Hashable, str], tuple[trio.CancelScope, int]] = {}
        self._resolving_bytes = 0
        #: Per job (and rank): the epoch of its last order, the generation of the order
        #: installed, its latest next-epoch order.
        self._epoch: dict[Hashable, int] = {}
        self._installed: dict[Hashable, int] = {}
        self._announced: dict[Hashable, _Announced] = {}
        #: Orders being resolved, and the files opened meanwhile: readers start as soon
        #: as the order is sent, and those first opens belong to the plan being made.
        self._resolving = 0
        self._early_opens: collections.deque[str] = collections.deque(maxlen=_EARLY_OPENS)
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.unknown_paths = 0
        self.orders = 0
        #: Orders refused because too much was being resolved, and orders dropped
        #: because their resolution failed (a LIST that failed after retries, a bug).
        self.refused_orders = 0
        self.failed_orders = 0
        self.next_orders = 0
        #: The scheduler's counters as last copied on the trio thread (the scheduler is
        #: not thread-safe). Copied when asked: at every event, the copy was a share of
        #: what hints cost a cold file.
        self.last_stats: PrefetchStats = self.scheduler.stats()
        self._token: trio.lowlevel.TrioToken | None = None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.packing is not None:
                start_guarded(nursery, "chunk packing", self.packing.run)
            start_guarded(nursery, "expiring idle plans", self._expire_idle_plans)
            self._token = trio.lowlevel.current_trio_token()
            task_status.started()
            while True:
                try:
                    self._start_fetches(nursery)
                except Exception as exc:  # a bug in planning: hints stall, reads go on
                    failed("starting prefetches", exc)
                self._wake = trio.Event()
                await self._wake.wait()

    def _target(self) -> int:
        """How many fetches may be in flight now (the adaptive concurrency's target)."""
        target = self.concurrency.update(trio.current_time())
        if target != self._target_logged:
            log.debug("hints: %d GETs in flight at most, was %d", target,
                      self._target_logged)
            self._target_logged = target
        return target

    def _start_fetches(self, nursery: trio.Nursery) -> None:
        free = self._target() - len(self._tasks)
        if free > 0:
            for key in self.scheduler.next_fetches(free, self._cached):
                start_guarded(nursery, "a prefetch", self._fetches, key)

    def _poke(self) -> None:
        self._wake.set()

    def current_stats(self) -> PrefetchStats:
        """The counters now. Trio thread only."""
        self.last_stats = self.scheduler.stats()
        return self.last_stats

    def stats_from_thread(self, wait_s: float = STATS_WAIT_S) -> PrefetchStats:
        """The counters now, for another thread (the metrics server's): the trio thread
        copies them; if it has not within `wait_s`, or runs no more, the last copy."""
        token = self._token
        if token is None:
            return self.last_stats
        try:
            if trio.lowlevel.current_trio_token() is token:  # asked on the trio thread
                return self.current_stats()
        except RuntimeError:  # another thread: the usual case
            pass
        copied = threading.Event()

        def copy() -> None:
            # Run by trio itself: an exception here would end the mount, not the scrape.
            try:
                self.current_stats()
            except Exception as exc:
                failed("copying prefetch counters", exc)
            finally:
                copied.set()

        try:
            token.run_sync_soon(copy)
        except trio.RunFinishedError:
            return self.last_stats
        copied.wait(wait_s)
        return self.last_stats

    # --- the hints socket (sync, trio thread) --------------------------------------------

    def on_order(self, order: Order) -> None:
        if self._nursery is None:
            raise ValueError("the daemon is not ready for hints yet")
        job = (order.job, order.rank)
        if order.next_epoch:
            self._on_next_order(job, order)
            return
        self._admit(job, "order", order)
        generation = self._generation[job] = next(self._generations)
        self._epoch[job] = order.epoch
        self.orders += 1
        self._resolve_in_background(job, "order", order.paths,
                                    functools.partial(self._install, job, order, generation))

    def _on_next_order(self, job: tuple[str, int], order: Order) -> None:
        """The order `job` will read after the one it sent last: advice for laying out
        what it reads now, never a plan to prefetch (its own ORDER brings that)."""
        assert self._nursery is not None
        current = self._epoch.get(job)
        if current is None:
            raise ValueError(f"job {order.job} rank {order.rank} sent no order to follow: "
                             "a next epoch's order comes after the current epoch's")
        if order.epoch <= current:
            raise ValueError(f"a next epoch's order must be for an epoch after {current}, "
                             f"not {order.epoch}")
        self.next_orders += 1
        if self.packing is None:
            return  # it only lays out SSD chunks
        self._admit(job, "next", order)
        announced = self._announced[job] = _Announced(self._generation[job])
        if self._installed.get(job) == announced.follows:
            self.packing.expect_next(job)
        self._resolve_in_background(job, "next", order.paths,
                                    functools.partial(self._install_next, job, order, announced))

    def _admit(self, job: tuple[str, int], slot: str, order: Order) -> None:
        """Refuse an order that would take the paths held by resolutions past their
        bounds (a client that floods the socket must not grow the daemon without end).
        One that replaces a resolution of the same job and slot takes its place."""
        replaced = self._resolutions.get((job, slot))
        count = len(self._resolutions) - (replaced is not None)
        held = self._resolving_bytes - (replaced[1] if replaced is not None else 0)
        if count >= MAX_RESOLVING:
            self.refused_orders += 1
            raise ValueError(f"{count} orders are being resolved already "
                             f"(limit {MAX_RESOLVING}); send it again later")
        if held + _paths_bytes(order.paths) > MAX_RESOLVING_BYTES:
            self.refused_orders += 1
            raise ValueError(f"orders being resolved hold {held >> 20} MiB of paths already "
                             f"(limit {MAX_RESOLVING_BYTES >> 20} MiB); send it again later")

    def on_end(self, job: str) -> None:
        plans = {j for j in self.scheduler.plans if isinstance(j, tuple) and j[0] == job}
        for plan in plans | {j for j in self._generation if j[0] == job}:
            self._forget_job(plan)
        self._forget_unplanned()
        self._poke()

    def _forget_job(self, job: tuple[str, int]) -> None:
        """Everything kept for one (job, rank): its plan and fetches, its packer, an order
        or announcement still resolving (cancelled), its generation and epoch."""
        if job in self.scheduler.plans:
            self._cancel(self.scheduler.end_job(job))
        if self.packing is not None:
            self.packing.end(job, forget=True)
        for slot in ("order", "next"):
            resolution = self._resolutions.get((job, slot))
            if resolution is not None:
                resolution[0].cancel()
        # Generations come from one counter, so an order resolving for a forgotten job
        # can never match a later order's generation.
        self._generation.pop(job, None)
        self._epoch.pop(job, None)
        self._installed.pop(job, None)
        self._announced.pop(job, None)

    def _resolve_in_background(self, job: tuple[str, int], slot: str, paths: Sequence[str],
                               work: Callable[[], Awaitable[None]]) -> None:
        """Start one order's resolution and install. A newer one in the same slot of the
        same job cancels it (decided here, in arrival order, not when the tasks run)."""
        assert self._nursery is not None
        name = (job, slot)
        older = self._resolutions.get(name)
        if older is not None:
            older[0].cancel()  # superseded: its result would be dropped anyway
        scope, size = trio.CancelScope(), _paths_bytes(paths)
        self._resolutions[name] = (scope, size)
        self._resolving_bytes += size
        self._nursery.start_soon(self._resolving_task, job, name, scope, size, work)

    async def _resolving_task(self, job: tuple[str, int], name: tuple[Hashable, str],
                              scope: trio.CancelScope, size: int,
                              work: Callable[[], Awaitable[None]]) -> None:
        """Whatever goes wrong fails this order (one log line), never the mount."""
        try:
            with scope:
                await work()
        except Exception as exc:
            self.failed_orders += 1
            reason = str(exc) if isinstance(exc, BackendError) \
                else f"{type(exc).__name__}: {exc}"
            log.warning("hints: an order of job %s rank %d was dropped: %s", job[0], job[1],
                        one_line(reason))
            log.debug("hints: the order failed", exc_info=True)
        finally:
            self._resolving_bytes -= size
            if self._resolutions.get(name, (None,))[0] is scope:
                del self._resolutions[name]

    async def _install(self, job: tuple[str, int], order: Order, generation: int) -> None:
        self._resolving += 1
        try:
            objects = await self._resolve(order.paths)
            resolved = [(obj.key, obj.size) for obj in objects]
            layout = b""
            if self.packing is not None:  # a million keys: not in the trio thread
                layout = await in_worker(layout_tag, resolved)
        finally:
            self._resolving -= 1
            early = list(self._early_opens)
            if not self._resolving:
                self._early_opens.clear()
        if self._generation.get(job) != generation:
            return  # a newer order (or the job's end) arrived meanwhile
        log.info("hints: job %s rank %d epoch %d: %d files (%d paths not found)", order.job,
                 order.rank, order.epoch, len(resolved), len(order.paths) - len(resolved))
        # Recorded only now, with no await before set_order: `_forget_unplanned` never
        # drops what an order still being resolved will need.
        self.objects.update((obj.key, obj) for obj in objects)
        self._cancel(self.scheduler.set_order(job, resolved))
        if self.packing is not None:
            self._installed[job] = generation
            announced = self._announced.get(job)
            if announced is not None and announced.follows != generation:
                del self._announced[job]  # it followed an older order
                announced = None
            # Its next order announced, or about to be: the reads wait for it.
            self.packing.new_order(job, layout,
                                   expect_next=order.next_follows or announced is not None,
                                   order_bytes=sum(obj.size for obj in objects))
            if announced is not None and announced.ready is not None:
                self.packing.next_order(job, *announced.ready)
                announced.ready = None
        for key in early:  # what the job's readers opened while this was resolved
            self.scheduler.observe_read(key, job)
            if self.packing is not None and key in self.scheduler.plans[job]:
                self.packing.opened(key, job)
        self._poke()

    async def _install_next(self, job: tuple[str, int], order: Order,
                            announced: _Announced) -> None:
        assert self.packing is not None
        objects = await self._resolve(order.paths)
        resolved = [(obj.key, obj.size) for obj in objects]
        # A million keys: not in the trio thread.
        planned = await in_worker(self.packing.plan_next, resolved)
        if self._announced.get(job) is not announced \
                or self._generation.get(job) != announced.follows:
            return  # a newer next order, a newer order or the job's end arrived meanwhile
        log.info("hints: job %s rank %d announced epoch %d: %d files (%d paths not found)",
                 order.job, order.rank, order.epoch, len(resolved),
                 len(order.paths) - len(resolved))
        if self._installed.get(job) == announced.follows:
            self.packing.next_order(job, *planned)
        else:
            announced.ready = planned  # given to the packer when its order is installed

    def _forget_unplanned(self) -> None:
        """Drop the versions of objects no plan reads and no fetch uses any more, so a
        long-lived mount does not keep every file it was ever hinted."""
        planned: set[Hashable] = set(self._tasks)
        for plan in self.scheduler.plans.values():
            planned.update(plan.keys)
        for key in [k for k in self.objects if k not in planned]:
            del self.objects[key]

    async def _resolve(self, paths: Sequence[str]) -> list[ObjectRef]:
        """The objects the paths name now; a path that names no file (missing, a
        directory, under a directory a re-listing removed) is counted and skipped.
        Walks each path's directories from the root with a cache of (directory inode,
        name) -> inode for this order, so a deep path costs one lookup per segment and
        no recursion, and what the cache holds is bounded by the directories that exist."""
        known: dict[tuple[int, str], int | None] = {}
        resolved: list[ObjectRef] = []
        lookups = 0
        for path in paths:
            *directories, name = path.split("/")
            inode: int | None = self.namespace.root.inode
            for segment in directories:
                step = (inode, segment)
                if step not in known:
                    node = await self._lookup(inode, segment)
                    lookups += 1
                    # A missing directory is remembered once, not every path below it.
                    known[step] = node.inode if node is not None and node.is_dir else None
                inode = known[step]
                if inode is None:
                    break
            node = None if inode is None else await self._lookup(inode, name)
            lookups += 1
            if node is None or node.is_dir:
                self.unknown_paths += 1
            else:
                resolved.append(ObjectRef(node.key, node.version, node.size))
            if lookups >= _RESOLVE_SLICE:
                lookups = 0
                await trio.sleep(0)  # FUSE requests are served between slices
        return resolved

    async def _lookup(self, parent: int, name: str) -> DirEntry | None:
        try:
            return await self.namespace.lookup(parent, name)
        except KeyError:  # the directory's inode went with a re-listing
            return None

    # --- the read path (sync, trio thread) -----------------------------------------------

    def observed_open(self, key: str) -> None:
        if self._resolving:
            self._early_opens.append(key)
        elif not (self.scheduler.plans or self.scheduler.inflight_bytes
                  or self.scheduler.held_bytes):
            return  # no job's hints to follow, pack or fetch, no prefetch to count
        self.scheduler.observe_read(key)
        if self.packing is not None:
            for job, plan in self.scheduler.plans.items():
                if key in plan:  # laid out with the first job that reads it
                    self.packing.opened(key, job)
                    break
        # The read moved its plan's window on. Only a free slot can take a new fetch
        # now; a busy slot's task takes the next one itself when its fetch ends.
        if len(self._tasks) < self.concurrency.target:
            self._poke()

    # --- fetching -----------------------------------------------------------------------

    def _blocks(self, obj: ObjectRef) -> range:
        return range(max(1, -(-obj.size // self.block_size)))

    def _cached(self, key: Hashable) -> bool:
        obj = self.objects.get(key)  # type: ignore[call-overload]
        if obj is None:
            return False
        holds = self.cache.holds
        if obj.size <= self.block_size:  # most files of an image dataset: one block
            return holds(BlockId(obj.key, obj.version, 0, size=obj.size))
        return all(holds(BlockId(obj.key, obj.version, i, size=obj.size))
                   for i in self._blocks(obj))

    def _ram_evicted(self, block: BlockId) -> None:
        # With an SSD tier every fetched block was written through: still cached.
        if not self.cache.writes_through and block.key in self.objects:
            self.scheduler.evicted(block.key)

    def _cancel(self, keys: list[Hashable]) -> None:
        for key in keys:
            scope = self._tasks.get(key)  # type: ignore[call-overload]
            if scope is not None:
                scope.cancel()

    async def _fetches(self, key: str) -> None:
        """Fetch `key`, then, while this task's slot is still wanted, whatever the
        scheduler starts next: a finished fetch spawns no task and wakes no loop. One
        cancel scope serves every fetch of the task (a scope entered and left per fetch
        was half of the Python calls an order added to a cold read): cancelling the key
        being fetched ends the task, and the fetch loop fills its slot again."""
        with trio.CancelScope() as scope:
            while True:
                await self._fetch(key, scope)
                if scope.cancel_called:  # cancelled as its fetch ended: no next key
                    break
                target = self._target()
                if len(self._tasks) >= target:
                    return
                if len(self._tasks) + 1 < target:
                    self._poke()  # more slots free than this one (the target rose)
                following = self.scheduler.next_fetches(1, self._cached)
                if not following:
                    return
                key = following[0]
        self._poke()  # cancelled: its slot is free

    async def _fetch(self, key: str, scope: trio.CancelScope) -> None:
        """Fetch `key` under its task's `scope`; cancelled, trio.Cancelled leaves here
        once the scheduler was told."""
        outcome = self.scheduler.cancelled
        started = trio.current_time()
        self._tasks[key] = scope
        try:
            obj = self.objects[key]
            for index in self._blocks(obj):
                await self.cache.get(obj, index)
            outcome = self.scheduler.fetched
        except BackendError as exc:  # the reader's own read tries again
            log.warning("hints: prefetch of %r failed: %s", key, exc)
            outcome = self.scheduler.failed
        except Exception as exc:  # a bug here must not take the mount down
            failed(f"prefetch of {key!r}", exc)
            outcome = self.scheduler.failed
        finally:
            del self._tasks[key]
            if outcome == self.scheduler.cancelled:  # trio.Cancelled is on its way out
                outcome(key)
        # Fetched or failed. The link's throughput, readers' own GETs included: judged on
        # prefetch's share alone, more GETs would seem to help whenever they only took
        # bandwidth from the readers.
        carried = self.cache.stats.origin_bytes - self._origin_bytes
        self._origin_bytes += carried
        self.concurrency.record(started, trio.current_time(), carried,
                                ok=outcome == self.scheduler.fetched)
        outcome(key)

    async def _expire_idle_plans(self) -> None:
        seen: dict[Hashable, tuple[int, float]] = {}  # plan -> (position, since)
        while True:
            await trio.sleep(_IDLE_CHECK_S)
            try:
                self._expire(seen)
            except Exception as exc:
                failed("expiring idle plans", exc)

    def _expire(self, seen: dict[Hashable, tuple[int, float]]) -> None:
        now = trio.current_time()
        for job, plan in list(self.scheduler.plans.items()):
            position, since = seen.get(job, (-1, now))
            if plan.position != position:
                seen[job] = (plan.position, now)
            elif now - since > PLAN_IDLE_S:
                log.info("hints: job %s has not read for %.0f s; dropping its plan",
                         job[0] if isinstance(job, tuple) else job, now - since)
                if isinstance(job, tuple):
                    self._forget_job(job)
                else:
                    self._cancel(self.scheduler.end_job(job))
                self._forget_unplanned()
                seen.pop(job, None)
        for job in [j for j in seen if j not in self.scheduler.plans]:
            del seen[job]
        self._poke()
