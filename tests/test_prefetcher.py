"""The daemon side of hints without FUSE: orders resolved through the namespace, one
fetch per object however many jobs plan it, newer orders and ended jobs win, failures
leave the reader's own read to report."""

from __future__ import annotations

import functools
import random

import trio

from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tiered import BlockCache
from bucketfs.hints.protocol import Order
from bucketfs.namespace import Namespace
from bucketfs.prefetch.eviction import make_policy
from bucketfs.prefetch.next_use import HintedPolicy, NextUse
from bucketfs.prefetch.scheduler import PrefetchScheduler
from bucketfs.prefetcher import HintedPrefetch
from bucketfs.reader import ByteBudget, Reader, ReadSettings
from tests.membackend import MemoryBackend

MiB = 1024**2


def dataset(count: int = 60) -> dict[str, bytes]:
    rng = random.Random(count)
    return {f"train/c{i % 3}/{i:03d}.jpg": rng.randbytes(20_000 + i) for i in range(count)}


def order(job: str, paths: list[str], epoch: int = 0) -> Order:
    return Order(job=job, rank=0, world_size=1, epoch=epoch, paths=paths)


async def with_daemon(backend: MemoryBackend, body, *, ram: int = 64 * MiB,
                      window: int = 8 * MiB, connections: int = 4) -> None:
    store = ObjectStore(backend, max_workers=8, retry=RetryPolicy(1))
    namespace = Namespace(store, "train/")
    scheduler = PrefetchScheduler(window_bytes=window, budget_bytes=window)
    policy = HintedPolicy(make_policy(), NextUse(scheduler),
                          key_of=lambda b: b.key if isinstance(b, BlockId) else b)
    async with trio.open_nursery() as nursery:
        cache = BlockCache(store, RamTier(ram, policy), None, block_size=4 * MiB,
                           nursery=nursery)
        prefetch = HintedPrefetch(namespace, cache, scheduler, connections=connections,
                                  block_size=4 * MiB)
        reader = Reader(cache, ByteBudget(64 * MiB), ReadSettings(), nursery,
                        on_open=prefetch.observed_open)
        await nursery.start(prefetch.run)

        async def read(path: str) -> bytes:
            parent, _, name = path.rpartition("/")
            node = await namespace.lookup((await namespace.lookup(1, parent)).inode, name)
            handle = reader.open(node.key, node.version, node.size)
            return await reader.read(handle, 0, node.size)

        try:
            await body(prefetch, read)
        finally:
            nursery.cancel_scope.cancel()
    namespace.close()


async def settle(prefetch: HintedPrefetch) -> None:
    """Until orders are installed and fetches done: nothing changed for 50 ms."""
    last, quiet = None, 0
    while quiet < 5:
        await trio.sleep(0.01)
        stats = prefetch.scheduler.stats()
        now = (len(prefetch._tasks), prefetch.scheduler.plans_version,
               stats.prefetches_started, stats.failed_fetches, prefetch.unknown_paths)
        quiet = quiet + 1 if now == last and not prefetch._tasks else 0
        last = now


def test_two_jobs_share_one_fetch_per_object_and_read_the_right_bytes():
    objects = dataset()
    backend = MemoryBackend(objects)
    paths = [key.removeprefix("train/") for key in objects]

    async def body(prefetch, read):
        first, second = paths[:], paths[:]
        random.Random(1).shuffle(first)
        random.Random(2).shuffle(second)
        prefetch.on_order(order("a", first))
        prefetch.on_order(order("b", second))
        await settle(prefetch)

        async def job(sequence):
            for path in sequence:
                assert await read(path) == objects["train/" + path]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(job, first)
            nursery.start_soon(job, second)
        stats = prefetch.scheduler.stats()
        assert stats.prefetches_started == len(paths)
        assert stats.prefetch_hits > 0

    trio.run(with_daemon, backend, body)
    assert backend.calls["get"] == len(objects)  # one GET per object for both jobs


def test_paths_that_name_nothing_are_skipped_and_counted():
    objects = dataset(9)
    backend = MemoryBackend(objects)

    async def body(prefetch, read):
        prefetch.on_order(order("a", ["c0/000.jpg", "nope/1.jpg", "c1/missing.jpg", "c1"]))
        await settle(prefetch)
        assert prefetch.unknown_paths == 3
        assert prefetch.scheduler.stats().prefetches_started == 1

    trio.run(with_daemon, backend, body)


def test_prefetch_concurrency_is_judged_on_all_the_bytes_the_origin_sent():
    # Readers' own GETs share the link with prefetch: a controller that counted only
    # prefetch's bytes would see more GETs "help" whenever they took bandwidth from the
    # readers.
    objects = dataset(12)
    backend = MemoryBackend(objects)
    paths = [key.removeprefix("train/") for key in objects]

    async def body(prefetch, read):
        carried: list[int] = []
        record = prefetch.concurrency.record

        def counting(started: float, finished: float, nbytes: int, *, ok: bool = True) -> int:
            carried.append(nbytes)
            return record(started, finished, nbytes, ok=ok)

        prefetch.concurrency.record = counting
        for path in paths[:4]:  # read before any order: the readers' own GETs
            await read(path)
        prefetch.on_order(order("a", paths[4:]))
        await settle(prefetch)
        assert prefetch.scheduler.stats().prefetches_started == len(paths) - 4
        assert sum(carried) == prefetch.cache.stats.origin_bytes == sum(
            len(data) for data in objects.values())

    trio.run(with_daemon, backend, body)


def test_a_newer_order_and_the_end_of_a_job_win():
    objects = dataset(30)
    backend = MemoryBackend(objects)
    paths = sorted(key.removeprefix("train/") for key in objects)

    async def body(prefetch, read):
        # Both arrive before the first is resolved: only the newer one is installed.
        prefetch.on_order(order("a", paths[:10]))
        prefetch.on_order(order("a", paths[10:20], epoch=1))
        await settle(prefetch)
        started = prefetch.scheduler.stats().prefetches_started
        assert started == 10
        assert {key for key in prefetch.objects} >= {"train/" + p for p in paths[10:20]}
        plan = next(iter(prefetch.scheduler.plans.values()))
        assert set(plan.keys) == {"train/" + p for p in paths[10:20]}
        prefetch.on_end("a")
        assert not prefetch.scheduler.plans
        assert not prefetch.objects  # nothing kept for a job that ended
        prefetch.on_order(order("b", paths[20:]))
        prefetch.on_end("b")  # ended while its order is still being resolved
        await settle(prefetch)
        assert not prefetch.scheduler.plans
        assert prefetch.scheduler.stats().prefetches_started == started

    trio.run(with_daemon, backend, body)


def test_a_failing_origin_fails_the_prefetch_not_the_daemon():
    objects = dataset(6)
    backend = MemoryBackend(objects)
    broken = "train/c0/000.jpg"
    backend.failures[broken] = -1  # every GET of it fails

    async def body(prefetch, read):
        prefetch.on_order(order("a", sorted(k.removeprefix("train/") for k in objects)))
        await settle(prefetch)
        assert prefetch.scheduler.stats().failed_fetches == 1
        backend.failures.clear()
        assert await read("c0/000.jpg") == objects[broken]  # the reader's own read works
        assert await read("c1/001.jpg") == objects["train/c1/001.jpg"]

    trio.run(with_daemon, backend, body)


def test_the_plan_of_a_job_that_stopped_reading_is_dropped():
    from trio.testing import MockClock

    from bucketfs.prefetcher import PLAN_IDLE_S

    objects = dataset(12)
    backend = MemoryBackend(objects)
    paths = sorted(key.removeprefix("train/") for key in objects)

    async def body(prefetch, read):
        prefetch.on_order(order("alive", paths))
        prefetch.on_order(order("dead", paths[::-1]))
        await settle(prefetch)
        assert len(prefetch.scheduler.plans) == 2
        for path in paths:  # "alive" reads, slowly; "dead" never does
            assert await read(path) == objects["train/" + path]
            await trio.sleep(PLAN_IDLE_S / 8)
        await trio.sleep(PLAN_IDLE_S / 2)
        assert [job for job, _ in prefetch.scheduler.plans] == ["alive"]

    trio.run(with_daemon, backend, body, clock=MockClock(autojump_threshold=0.01))


def test_a_finished_prefetch_takes_the_next_one_in_its_own_task():
    # With one fetch slot, the whole order is fetched by the task started first: a
    # finished fetch neither spawns a task nor needs the fetch loop to wake.
    import bucketfs.prefetcher as prefetcher

    objects = dataset(8)
    backend = MemoryBackend(objects)
    paths = sorted(key.removeprefix("train/") for key in objects)
    spawned: list[str] = []
    start_guarded = prefetcher.start_guarded

    def counting(nursery, what, *args):
        spawned.append(what)
        return start_guarded(nursery, what, *args)

    async def body(prefetch, read):
        prefetch.on_order(order("a", paths))
        await settle(prefetch)
        assert prefetch.scheduler.stats().prefetches_started == len(paths)
        for path in paths:
            assert await read(path) == objects["train/" + path]

    prefetcher.start_guarded = counting
    try:
        trio.run(functools.partial(with_daemon, backend, body, connections=1))
    finally:
        prefetcher.start_guarded = start_guarded
    assert spawned.count("a prefetch") == 1
    assert backend.calls["get"] == len(objects)


def test_a_scrape_gets_the_counters_as_they_are_and_never_hangs_on_a_busy_loop():
    # /metrics is served from another thread; the trio thread copies the scheduler's
    # counters for each scrape, so they are never older than the scrape. A loop that
    # does not answer in time gets the last copy.
    import threading

    objects = dataset(10)
    backend = MemoryBackend(objects)
    paths = sorted(key.removeprefix("train/") for key in objects)

    async def body(prefetch, read):
        prefetch.on_order(order("a", paths))
        await settle(prefetch)
        for path in paths:
            await read(path)
        scraped = await trio.to_thread.run_sync(prefetch.stats_from_thread)
        assert scraped == prefetch.scheduler.stats()
        assert scraped.prefetches_started == scraped.prefetch_hits == len(paths)
        assert prefetch.stats_from_thread() == scraped  # asked on the trio thread itself
        before = prefetch.last_stats
        prefetch.scheduler.prefetch_hits += 1  # counted, not copied yet
        answers: list = []
        scrape = threading.Thread(
            target=lambda: answers.append(prefetch.stats_from_thread(wait_s=0.05)))
        scrape.start()
        # The trio thread stays busy (blocked here) until the scrape has answered.
        scrape.join(timeout=10)
        assert not scrape.is_alive() and answers == [before]
        with trio.fail_after(5):  # the copy the scrape asked for runs once the loop is free
            while prefetch.last_stats.prefetch_hits != len(paths) + 1:
                await trio.sleep(0.01)

    trio.run(with_daemon, backend, body)


def test_a_scrape_whose_copy_fails_gets_the_last_copy_and_the_mount_goes_on():
    from bucketfs import tasks

    objects = dataset(4)
    backend = MemoryBackend(objects)
    paths = sorted(key.removeprefix("train/") for key in objects)

    async def body(prefetch, read):
        before, failures = prefetch.last_stats, tasks.failures

        def broken():
            raise RuntimeError("a bug in the counters")

        prefetch.scheduler.stats = broken
        assert await trio.to_thread.run_sync(prefetch.stats_from_thread) is before
        with trio.fail_after(5):  # logged and counted, on the trio thread
            while tasks.failures != failures + 1:
                await trio.sleep(0.01)
        for path in paths:  # the loop, and reads, go on
            assert await read(path) == objects["train/" + path]

    trio.run(with_daemon, backend, body)


def test_cancelling_a_prefetch_in_flight_ends_its_task_and_the_slot_is_filled_again():
    # One cancel scope serves every fetch of a prefetch task: the cancelled key is told
    # `cancelled`, that task ends, and the rest of the order is still fetched.
    import threading

    objects = dataset(12)
    paths = sorted(key.removeprefix("train/") for key in objects)
    stuck = "train/" + paths[0]
    gate = threading.Event()

    class Gated(MemoryBackend):
        def get_range(self, key: str, version: str, start: int, length: int) -> bytes:
            if key == stuck:
                gate.wait(10)
            return super().get_range(key, version, start, length)

    backend = Gated(objects)

    async def body(prefetch, read):
        told: list[str] = []
        cancelled = prefetch.scheduler.cancelled
        prefetch.scheduler.cancelled = lambda key: (told.append(key), cancelled(key))[1]
        async with trio.open_nursery() as readers:
            readers.start_soon(read, paths[0])  # its GET waits at the gate
            while not prefetch.cache.inflight:
                await trio.sleep(0.01)
            prefetch.on_order(order("a", paths))
            while stuck not in prefetch._tasks:  # joined the reader's GET
                await trio.sleep(0.01)
            prefetch._cancel([stuck])
            await trio.sleep(0.05)
            assert told == [stuck]
            gate.set()
        await settle(prefetch)
        assert prefetch.scheduler.stats().failed_fetches == 0
        assert all(prefetch.cache.ram.holds(BlockId(k, backend.version(k), 0,
                                                    size=len(objects[k])))
                   for k in objects)
        assert not prefetch._tasks

    trio.run(with_daemon, backend, body)
