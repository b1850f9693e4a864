"""Nothing an order brings takes the daemon down: a path thousands of segments deep, a
LIST that fails after its retries, an inode a re-listing removed, a bug in the install
step. Each fails (part of) that order, with one log line, and the next order works.
The memory orders hold is bounded: orders being resolved are capped, a newer order of
a job cancels the older one's resolution, and a job that dies without END leaves
nothing behind once its plan expires."""

from __future__ import annotations

import logging

import pytest
import trio

from bucketfs import prefetcher as prefetcher_module
from bucketfs.backends.base import TransientError
from tests.membackend import MemoryBackend
from tests.test_prefetcher import dataset, order, settle, with_daemon


class ListFailures(MemoryBackend):
    """A bucket whose listings under `failing` fail (an expired token, say)."""

    def __init__(self, objects: dict[str, bytes], failing: str) -> None:
        super().__init__(objects)
        self.failing = failing

    def list_page(self, prefix, delimiter, token, page_size):
        if prefix.startswith(self.failing):
            raise TransientError(f"injected LIST failure under {prefix!r}")
        return super().list_page(prefix, delimiter, token, page_size)


def test_a_path_thousands_of_segments_deep_is_unknown_not_a_crash():
    objects = dataset(9)
    backend = MemoryBackend(objects)
    deep = "/".join(["c0"] * 1_900) + "/000.jpg"

    async def body(prefetch, read):
        prefetch.on_order(order("a", [deep, "c0/000.jpg"]))
        await settle(prefetch)
        assert prefetch.unknown_paths == 1
        assert prefetch.failed_orders == 0
        assert prefetch.scheduler.stats().prefetches_started == 1
        assert await read("c1/001.jpg") == objects["train/c1/001.jpg"]

    trio.run(with_daemon, backend, body)


def test_an_order_whose_listing_fails_is_dropped_and_the_next_one_works(caplog):
    objects = dataset(9)
    backend = ListFailures(objects, "train/c2/")

    async def body(prefetch, read):
        prefetch.on_order(order("a", ["c0/000.jpg", "c2/002.jpg"]))
        await settle(prefetch)
        assert prefetch.failed_orders == 1
        assert ("a", 0) not in prefetch.scheduler.plans  # nothing installed
        prefetch.on_order(order("b", ["c1/001.jpg"]))
        await settle(prefetch)
        assert prefetch.scheduler.stats().prefetches_started == 1
        assert await read("c0/003.jpg") == objects["train/c0/003.jpg"]

    with caplog.at_level(logging.WARNING, logger="bucketfs.prefetcher"):
        trio.run(with_daemon, backend, body)
    dropped = [r for r in caplog.records if "was dropped" in r.getMessage()]
    assert len(dropped) == 1 and "injected LIST failure" in dropped[0].getMessage()
    assert "\n" not in dropped[0].getMessage()


def test_a_directory_inode_gone_with_a_relisting_makes_its_paths_unknown(monkeypatch):
    objects = dataset(9)
    backend = MemoryBackend(objects)

    async def body(prefetch, read):
        real_lookup = prefetch.namespace.lookup

        async def stale(parent, name):
            if name == "000.jpg":  # its directory's inode was dropped meanwhile
                raise KeyError(parent)
            return await real_lookup(parent, name)

        monkeypatch.setattr(prefetch.namespace, "lookup", stale)
        prefetch.on_order(order("a", ["c0/000.jpg", "c1/001.jpg"]))
        await settle(prefetch)
        assert (prefetch.unknown_paths, prefetch.failed_orders) == (1, 0)
        assert prefetch.scheduler.stats().prefetches_started == 1

    trio.run(with_daemon, backend, body)


def test_a_bug_in_installing_an_order_fails_that_order_only(monkeypatch, caplog):
    objects = dataset(9)
    backend = MemoryBackend(objects)

    async def body(prefetch, read):
        real = prefetch.scheduler.set_order
        calls = []

        def broken(job, resolved):
            calls.append(job)
            if len(calls) == 1:
                raise RuntimeError("a bug in set_order")
            return real(job, resolved)

        monkeypatch.setattr(prefetch.scheduler, "set_order", broken)
        prefetch.on_order(order("a", ["c0/000.jpg"]))
        await settle(prefetch)
        assert prefetch.failed_orders == 1
        prefetch.on_order(order("a", ["c0/000.jpg", "c1/001.jpg"]))
        await settle(prefetch)
        assert prefetch.scheduler.stats().prefetches_started == 2

    with caplog.at_level(logging.WARNING, logger="bucketfs.prefetcher"):
        trio.run(with_daemon, backend, body)
    assert any("RuntimeError: a bug in set_order" in r.getMessage() for r in caplog.records)


def test_orders_being_resolved_are_capped(monkeypatch):
    objects = dataset(9)
    backend = MemoryBackend(objects)
    monkeypatch.setattr(prefetcher_module, "MAX_RESOLVING", 3)

    async def body(prefetch, read):
        release = trio.Event()

        async def slow(paths):
            await release.wait()
            return []

        monkeypatch.setattr(prefetch, "_resolve", slow)
        for job in "abc":
            prefetch.on_order(order(job, ["c0/000.jpg"]))
        await trio.sleep(0.05)
        with pytest.raises(ValueError, match="limit 3"):
            prefetch.on_order(order("d", ["c0/000.jpg"]))
        assert prefetch.refused_orders == 1
        # A newer order of the same job replaces its resolution rather than adding one.
        prefetch.on_order(order("a", ["c0/000.jpg"], epoch=1))
        await trio.sleep(0.05)
        assert len(prefetch._resolutions) == 3
        release.set()
        await settle(prefetch)
        assert prefetch._resolutions == {} and prefetch._resolving_bytes == 0

    trio.run(with_daemon, backend, body)


def test_the_bytes_of_paths_being_resolved_are_capped(monkeypatch):
    objects = dataset(9)
    backend = MemoryBackend(objects)
    monkeypatch.setattr(prefetcher_module, "MAX_RESOLVING_BYTES", 100_000)

    async def body(prefetch, read):
        with pytest.raises(ValueError, match="MiB of paths"):
            prefetch.on_order(order("a", ["c0/000.jpg"] * 2_000))
        prefetch.on_order(order("a", ["c0/000.jpg"] * 100))
        await settle(prefetch)
        assert prefetch.refused_orders == 1

    trio.run(with_daemon, backend, body)


def test_a_job_killed_without_end_leaves_nothing_once_its_plan_expires(monkeypatch):
    objects = dataset(9)
    backend = MemoryBackend(objects)
    monkeypatch.setattr(prefetcher_module, "PLAN_IDLE_S", 0.2)
    monkeypatch.setattr(prefetcher_module, "_IDLE_CHECK_S", 0.05)

    async def body(prefetch, read):
        prefetch.on_order(order("a", ["c0/000.jpg", "c1/001.jpg"]))
        await settle(prefetch)
        assert ("a", 0) in prefetch.scheduler.plans
        await trio.sleep(0.5)
        assert prefetch.scheduler.plans == {}
        for per_job in (prefetch._generation, prefetch._epoch, prefetch._installed,
                        prefetch._announced, prefetch._resolutions, prefetch.objects):
            assert not per_job

    trio.run(with_daemon, backend, body)
