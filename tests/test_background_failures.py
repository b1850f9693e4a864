"""No failure of a background task takes the mount down: each is logged in one line
(rate-limited per kind), counted, and the mount's nursery goes on; cancellation still
passes through, so unmounting stops everything."""

from __future__ import annotations

import logging
import re

import pyfuse3
import pytest
import trio

from bucketfs import mount, tasks
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.blocks import ObjectRef
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tiered import BlockCache
from bucketfs.logs import Throttle
from bucketfs.prefetch.eviction import make_policy
from tests.membackend import MemoryBackend
from tests.test_prefetcher import dataset, order, settle, with_daemon

MiB = 1024**2


@pytest.fixture(autouse=True)
def fresh_log_limits(monkeypatch):
    monkeypatch.setattr(tasks, "_throttle", Throttle(tasks._QUIET_S))


def test_a_failing_task_is_logged_once_and_the_nursery_goes_on(caplog):
    async def broken(n: int) -> None:
        raise RuntimeError(f"bug number {n}")

    async def main():
        before = tasks.failures
        async with trio.open_nursery() as nursery:
            for n in range(5):
                tasks.start_guarded(nursery, "a background task", broken, n)
        return tasks.failures - before

    with caplog.at_level(logging.ERROR, logger="bucketfs.tasks"):
        assert trio.run(main) == 5
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1, lines  # the first of them; the rest only counted
    assert re.fullmatch(r"a background task failed: RuntimeError: bug number \d; "
                        r"the mount goes on", lines[0])


def test_cancellation_passes_through_a_guarded_task():
    async def forever() -> None:
        await trio.sleep_forever()

    async def main():
        with trio.move_on_after(0.05) as scope:
            async with trio.open_nursery() as nursery:
                tasks.start_guarded(nursery, "waiting", forever)
        return scope.cancelled_caught

    assert trio.run(main)


def test_telling_the_kernel_to_forget_a_name_never_raises(monkeypatch):
    def refused(inode_p, name, deleted=0, ignore_enoent=False):
        raise RuntimeError("not mounted")

    monkeypatch.setattr(pyfuse3, "invalidate_entry_async", refused)
    mount._kernel_forgets_name(1, "f.bin")  # returns, raises nothing


class BrokenDisk:
    """An SSD tier with a bug in `put_many`."""

    block_size = 4 * MiB
    writable = True

    def holds(self, block):
        return False

    def get(self, block, ahead=0):
        return None

    def put_many(self, blocks):
        raise RuntimeError("a bug in the SSD tier")


def test_a_bug_in_writing_through_to_ssd_leaves_reads_working(caplog):
    backend = MemoryBackend({"a": b"x" * 1000, "b": b"y" * 2000})
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1))

    async def main():
        async with trio.open_nursery() as nursery:
            cache = BlockCache(store, RamTier(64 * MiB, make_policy()), BrokenDisk(),
                               block_size=4 * MiB, nursery=nursery)
            for key in ("a", "b"):
                obj = ObjectRef(key, backend.version(key), len(backend.objects[key]))
                assert await cache.get(obj, 0) == backend.objects[key]
            while cache.writing:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.ERROR, logger="bucketfs.tasks"):
        trio.run(main)
    assert any("a bug in the SSD tier" in r.getMessage() for r in caplog.records)


def test_a_bug_in_planning_prefetches_stalls_hints_not_the_mount(monkeypatch, caplog):
    objects = dataset(9)
    backend = MemoryBackend(objects)

    async def body(prefetch, read):
        def broken(free, is_cached=None):
            raise RuntimeError("a bug in next_fetches")

        monkeypatch.setattr(prefetch.scheduler, "next_fetches", broken)
        prefetch.on_order(order("a", ["c0/000.jpg", "c1/001.jpg"]))
        await settle(prefetch)
        assert await read("c2/002.jpg") == objects["train/c2/002.jpg"]
        monkeypatch.undo()
        prefetch.on_order(order("a", ["c0/000.jpg", "c1/001.jpg"], epoch=1))
        await settle(prefetch)  # the loop is alive: the next order prefetches
        assert prefetch.scheduler.stats().prefetches_started == 2

    with caplog.at_level(logging.ERROR, logger="bucketfs.tasks"):
        trio.run(with_daemon, backend, body)
    assert any("a bug in next_fetches" in r.getMessage() for r in caplog.records)
