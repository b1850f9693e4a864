"""The daemon side of hints: orders from the hints socket become fetches into the cache.

A job's order arrives as paths relative to the mount (`hints_server` validated it).
They are resolved to objects through the namespace (each directory listed once, then
one index read per file), with a checkpoint every few thousand paths so FUSE requests
are not held up, and handed to the pure `PrefetchScheduler` as (object key, size). A
newer order from the same job (rank) supersedes one still being resolved.

One task runs the fetches: it asks the scheduler what to start (at most `connections`
at once, fewer than the origin's connections, so a reader's own miss always finds a
free one), reads every block of the object through the `BlockCache` (RAM, SSD, or one
single-flight GET shared with any reader that wants it meanwhile), and reports back
`fetched`, `failed` or `cancelled`. A new order that no longer wants a fetch in flight
cancels it.

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
import logging
from collections.abc import Hashable
from dataclasses import dataclass

import trio

from bucketfs.backends.base import BackendError
from bucketfs.cache.blocks import BlockId, ObjectRef
from bucketfs.cache.tiered import BlockCache
from bucketfs.hints.protocol import Order
from bucketfs.namespace import Namespace
from bucketfs.packer import ChunkPacking, layout_tag
from bucketfs.prefetch.packing import NextPlan
from bucketfs.prefetch.scheduler import AdaptiveConcurrency, PrefetchScheduler, PrefetchStats

log = logging.getLogger(__name__)

#: Opens remembered while an order resolves (its readers have already started).
_EARLY_OPENS = 8192

#: Paths resolved between two checkpoints (a listed directory: one index read each).
_RESOLVE_SLICE = 2048
#: A plan whose reader has not moved for this long belongs to a job that died without
#: saying so (kill -9): it is dropped, so its window stops holding the shared budget.
PLAN_IDLE_S = 900.0
_IDLE_CHECK_S = 30.0


@dataclass(eq=False, slots=True)
class _Announced:
    """A job's next epoch's order, announced after its order number `follows`."""

    follows: int
    #: Resolved and planned, waiting for the order it follows to be installed.
    ready: tuple[NextPlan, bytes] | None = None


class HintedPrefetch:
    def __init__(
        self, namespace: Namespace, *, window_bytes: int, budget_bytes: int,
        connections: int, block_size: int,
    ) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.connections = max(1, connections)
        # Start low and add GETs while they still raise the throughput (DLCache: enough
        # fetches in flight to cover the link's latency), up to `connections`. Low, because
        # on a thin link every GET too many delays the files the readers need first.
        self.concurrency = AdaptiveConcurrency(
            minimum=min(4, self.connections), maximum=self.connections,
            initial=min(4, self.connections), period_s=0.5)
        self.scheduler = PrefetchScheduler(window_bytes=window_bytes,
                                           budget_bytes=budget_bytes, is_cached=self._cached)
        self.cache: BlockCache | None = None
        self._origin_bytes = 0  # the cache's origin bytes when a fetch last ended
        self._target_logged = self.concurrency.target
        self.packing: ChunkPacking | None = None
        #: Object key -> the version an order resolved it to (what prefetch fetches).
        self.objects: dict[str, ObjectRef] = {}
        self._tasks: dict[str, trio.CancelScope] = {}
        self._generation: dict[Hashable, int] = {}
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
        self.next_orders = 0
        #: The scheduler's counters as of the last event (read by the metrics thread).
        self.last_stats: PrefetchStats = self.scheduler.stats()

    # --- wiring -------------------------------------------------------------------------

    def attach(self, cache: BlockCache) -> None:
        """The cache exists after the RAM tier, whose policy needs the scheduler."""
        self.cache = cache
        self._origin_bytes = cache.stats.origin_bytes
        cache.ram.on_evict = self._ram_evicted
        if cache.disk is not None:
            self.packing = ChunkPacking(cache, self.objects, self.block_size)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.packing is not None:
                nursery.start_soon(self.packing.run)
            nursery.start_soon(self._expire_idle_plans)
            task_status.started()
            while True:
                target = self.concurrency.update(trio.current_time())
                if target != self._target_logged:
                    log.debug("hints: %d GETs in flight at most, was %d", target,
                              self._target_logged)
                    self._target_logged = target
                free = target - len(self._tasks)
                if free > 0:
                    for key in self.scheduler.next_fetches(free):
                        nursery.start_soon(self._fetch, key)
                self._wake = trio.Event()
                await self._wake.wait()

    def _poke(self) -> None:
        self.last_stats = self.scheduler.stats()
        self._wake.set()

    # --- the hints socket (sync, trio thread) --------------------------------------------

    def on_order(self, order: Order) -> None:
        if self._nursery is None:
            raise ValueError("the daemon is not ready for hints yet")
        job = (order.job, order.rank)
        if order.next_epoch:
            self._on_next_order(job, order)
            return
        generation = self._generation[job] = self._generation.get(job, 0) + 1
        self._epoch[job] = order.epoch
        self.orders += 1
        self._nursery.start_soon(self._install, job, order, generation)

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
        announced = self._announced[job] = _Announced(self._generation[job])
        if self._installed.get(job) == announced.follows:
            self.packing.expect_next(job)
        self._nursery.start_soon(self._install_next, job, order, announced)

    def on_end(self, job: str) -> None:
        for plan in [j for j in self.scheduler.plans if isinstance(j, tuple) and j[0] == job]:
            self._generation[plan] = self._generation.get(plan, 0) + 1
            self._cancel(self.scheduler.end_job(plan))
            if self.packing is not None:
                self.packing.end(plan, forget=True)
        for pending in [j for j in self._generation if j[0] == job]:
            self._generation[pending] += 1  # an order still resolving is dropped
            self._epoch.pop(pending, None)
            self._installed.pop(pending, None)
            self._announced.pop(pending, None)  # and a next order too
        self._forget_unplanned()
        self._poke()

    async def _install(self, job: tuple[str, int], order: Order, generation: int) -> None:
        self._resolving += 1
        try:
            objects = await self._resolve(order.paths)
            resolved = [(obj.key, obj.size) for obj in objects]
            layout = b""
            if self.packing is not None:  # a million keys: not in the trio thread
                layout = await trio.to_thread.run_sync(layout_tag, resolved)
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
                                   expect_next=order.next_follows or announced is not None)
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
        planned = await trio.to_thread.run_sync(self.packing.plan_next, resolved)
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

    async def _resolve(self, paths: list[str]) -> list[ObjectRef]:
        directories: dict[str, int | None] = {"": self.namespace.root.inode}
        resolved: list[ObjectRef] = []
        for count, path in enumerate(paths, 1):
            parent, _, name = path.rpartition("/")
            inode = await self._directory(parent, directories)
            node = None if inode is None else await self.namespace.lookup(inode, name)
            if node is None or node.is_dir:
                self.unknown_paths += 1
                continue
            resolved.append(ObjectRef(node.key, node.version, node.size))
            if count % _RESOLVE_SLICE == 0:
                await trio.sleep(0)
        return resolved

    async def _directory(self, path: str, known: dict[str, int | None]) -> int | None:
        """The inode of the directory at `path`, None if there is none; `known` caches
        the answers for one order."""
        if path in known:
            return known[path]
        parent, _, name = path.rpartition("/")
        inode = await self._directory(parent, known)
        node = None if inode is None else await self.namespace.lookup(inode, name)
        known[path] = node.inode if node is not None and node.is_dir else None
        return known[path]

    # --- the read path (sync, trio thread) -----------------------------------------------

    def observed_open(self, key: str) -> None:
        if self._resolving:
            self._early_opens.append(key)
        self.scheduler.observe_read(key)
        if self.packing is not None:
            for job, plan in self.scheduler.plans.items():
                if key in plan:  # laid out with the first job that reads it
                    self.packing.opened(key, job)
                    break
        self._poke()

    # --- fetching -----------------------------------------------------------------------

    def _blocks(self, obj: ObjectRef) -> range:
        return range(max(1, -(-obj.size // self.block_size)))

    def _cached(self, key: Hashable) -> bool:
        obj = self.objects.get(key)  # type: ignore[call-overload]
        if obj is None or self.cache is None:
            return False
        return all(self.cache.holds(BlockId(obj.key, obj.version, i))
                   for i in self._blocks(obj))

    def _ram_evicted(self, block: BlockId) -> None:
        # With an SSD tier every fetched block was written through: still cached.
        if self.cache is not None and self.cache.disk is None and block.key in self.objects:
            self.scheduler.evicted(block.key)

    def _cancel(self, keys: list[Hashable]) -> None:
        for key in keys:
            scope = self._tasks.get(key)  # type: ignore[call-overload]
            if scope is not None:
                scope.cancel()

    async def _fetch(self, key: str) -> None:
        assert self.cache is not None
        obj = self.objects[key]
        outcome = self.scheduler.cancelled
        started = trio.current_time()
        with trio.CancelScope() as scope:
            self._tasks[key] = scope
            try:
                for index in self._blocks(obj):
                    await self.cache.get(obj, index)
                outcome = self.scheduler.fetched
            except BackendError as exc:  # the reader's own read tries again
                log.warning("hints: prefetch of %r failed: %s", key, exc)
                outcome = self.scheduler.failed
            except Exception:  # a bug here must not take the mount down
                log.exception("hints: prefetch of %r failed", key)
                outcome = self.scheduler.failed
            finally:
                del self._tasks[key]
        if outcome != self.scheduler.cancelled:
            # The link's throughput, readers' own GETs included: judged on prefetch's
            # share alone, more GETs would seem to help whenever they only took
            # bandwidth from the readers.
            carried = self.cache.stats.origin_bytes - self._origin_bytes
            self._origin_bytes += carried
            self.concurrency.record(started, trio.current_time(), carried,
                                    ok=outcome == self.scheduler.fetched)
        outcome(key)
        self._poke()

    async def _expire_idle_plans(self) -> None:
        seen: dict[Hashable, tuple[int, float]] = {}  # plan -> (position, since)
        while True:
            await trio.sleep(_IDLE_CHECK_S)
            now = trio.current_time()
            for job, plan in list(self.scheduler.plans.items()):
                position, since = seen.get(job, (-1, now))
                if plan.position != position:
                    seen[job] = (plan.position, now)
                elif now - since > PLAN_IDLE_S:
                    log.info("hints: job %s has not read for %.0f s; dropping its plan",
                             job[0] if isinstance(job, tuple) else job, now - since)
                    self._cancel(self.scheduler.end_job(job))
                    self._forget_unplanned()
                    seen.pop(job, None)
            for job in [j for j in seen if j not in self.scheduler.plans]:
                del seen[job]
            self._poke()
