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
`observed_open(key)` once per opened file. The RAM tier's evictions of blocks that no
SSD tier keeps are reported as `evicted`, so a prefetched file that had to go before it
was read counts as wasted and is planned again.

Concurrency: everything here runs in the trio thread; the scheduler is only touched
between awaits.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import trio

from bucketfs.backends.base import BackendError
from bucketfs.cache.blocks import BlockId, ObjectRef
from bucketfs.cache.tiered import BlockCache
from bucketfs.hints.protocol import Order
from bucketfs.namespace import Namespace
from bucketfs.prefetch.scheduler import PrefetchScheduler, PrefetchStats

log = logging.getLogger(__name__)

#: Paths resolved between two checkpoints (a listed directory: one index read each).
_RESOLVE_SLICE = 2048


class HintedPrefetch:
    def __init__(
        self, namespace: Namespace, *, window_bytes: int, budget_bytes: int,
        connections: int, block_size: int,
    ) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.connections = max(1, connections)
        self.scheduler = PrefetchScheduler(window_bytes=window_bytes,
                                           budget_bytes=budget_bytes, is_cached=self._cached)
        self.cache: BlockCache | None = None
        #: Object key -> the version an order resolved it to (what prefetch fetches).
        self.objects: dict[str, ObjectRef] = {}
        self._tasks: dict[str, trio.CancelScope] = {}
        self._generation: dict[Hashable, int] = {}
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.unknown_paths = 0
        self.orders = 0
        #: The scheduler's counters as of the last event (read by the metrics thread).
        self.last_stats: PrefetchStats = self.scheduler.stats()

    # --- wiring -------------------------------------------------------------------------

    def attach(self, cache: BlockCache) -> None:
        """The cache exists after the RAM tier, whose policy needs the scheduler."""
        self.cache = cache
        cache.ram.on_evict = self._ram_evicted

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                free = self.connections - len(self._tasks)
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
        generation = self._generation[job] = self._generation.get(job, 0) + 1
        self.orders += 1
        self._nursery.start_soon(self._install, job, order, generation)

    def on_end(self, job: str) -> None:
        for plan in [j for j in self.scheduler.plans if isinstance(j, tuple) and j[0] == job]:
            self._generation[plan] = self._generation.get(plan, 0) + 1
            self._cancel(self.scheduler.end_job(plan))
        for pending in [j for j in self._generation if j[0] == job]:
            self._generation[pending] += 1  # an order still resolving is dropped
        self._poke()

    async def _install(self, job: tuple[str, int], order: Order, generation: int) -> None:
        resolved = await self._resolve(order.paths)
        if self._generation.get(job) != generation:
            return  # a newer order (or the job's end) arrived meanwhile
        log.info("hints: job %s rank %d epoch %d: %d files (%d paths not found)", order.job,
                 order.rank, order.epoch, len(resolved), len(order.paths) - len(resolved))
        self._cancel(self.scheduler.set_order(job, resolved))
        self._poke()

    async def _resolve(self, paths: list[str]) -> list[tuple[str, int]]:
        directories: dict[str, int | None] = {"": self.namespace.root.inode}
        resolved: list[tuple[str, int]] = []
        for count, path in enumerate(paths, 1):
            parent, _, name = path.rpartition("/")
            inode = directories.get(parent, -1)
            if inode == -1:
                inode = directories[parent] = await self._directory(parent, directories)
            node = None if inode is None else await self.namespace.lookup(inode, name)
            if node is None or node.is_dir:
                self.unknown_paths += 1
                continue
            self.objects[node.key] = ObjectRef(node.key, node.version, node.size)
            resolved.append((node.key, node.size))
            if count % _RESOLVE_SLICE == 0:
                await trio.sleep(0)
        return resolved

    async def _directory(self, path: str, known: dict[str, int | None]) -> int | None:
        parent, _, name = path.rpartition("/")
        inode = known.get(parent, -1)
        if inode == -1:
            inode = known[parent] = await self._directory(parent, known)
        if inode is None:
            return None
        node = await self.namespace.lookup(inode, name)
        return node.inode if node is not None and node.is_dir else None

    # --- the read path (sync, trio thread) -----------------------------------------------

    def observed_open(self, key: str) -> None:
        self.scheduler.observe_read(key)
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
        outcome(key)
        self._poke()
