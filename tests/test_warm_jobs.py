"""The daemon's warm jobs (bucketfs/warm.py) with a namespace and a cache that are plain
Python: paths resolved once each, the budget of the last tier kept, blocks a tier holds
not fetched again, a file that fails counted and the job going on, a bug failing its
job (one log line) and never what runs beside it, CANCEL stopping a job, and the
bounds on what clients can make the daemon hold."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
import trio

from bucketfs import tasks, warm
from bucketfs.backends.base import NotFound
from bucketfs.cache.blocks import BlockId, ObjectRef
from bucketfs.logs import Throttle
from bucketfs.warm import WarmJobs

BLOCK = 100


@dataclass
class Node:
    inode: int
    is_dir: bool
    key: str = ""
    version: str = "v1"
    size: int = 0


class Tree:
    """A namespace: directories and files by path."""

    def __init__(self, files: dict[str, int]) -> None:
        self.root = Node(1, True)
        self.nodes: dict[tuple[int, str], Node] = {}
        inodes = {"": 1}
        for path, size in files.items():
            parts = path.split("/")
            for depth in range(1, len(parts)):
                directory = "/".join(parts[:depth])
                if directory not in inodes:
                    inodes[directory] = len(inodes) + 1
                    parent = inodes["/".join(parts[:depth - 1])]
                    self.nodes[(parent, parts[depth - 1])] = Node(inodes[directory], True)
            parent = inodes["/".join(parts[:-1])]
            self.nodes[(parent, parts[-1])] = Node(len(self.nodes) + 1000, False, path,
                                                   size=size)
        self.lookups = 0

    async def lookup(self, parent: int, name: str) -> Node | None:
        self.lookups += 1
        await trio.lowlevel.checkpoint()
        return self.nodes.get((parent, name))


@dataclass
class Tier:
    name: str
    capacity: int
    used: int = 0
    evictions: int = 0


@dataclass
class Cache:
    """Blocks of BLOCK bytes; `held` are cached already; `fail` keys raise."""

    tiers: tuple[Tier, ...] = (Tier("ram", 10_000),)
    block_size: int = BLOCK
    held: set[BlockId] = field(default_factory=set)
    fail: dict[str, Exception] = field(default_factory=dict)
    gets: list[tuple[str, int]] = field(default_factory=list)
    delay: float = 0.0

    def holds(self, block: BlockId) -> bool:
        return block in self.held

    async def get(self, obj: ObjectRef, index: int) -> bytes:
        if obj.key in self.fail:
            raise self.fail[obj.key]
        await trio.sleep(self.delay)
        self.gets.append((obj.key, index))
        self.held.add(BlockId(obj.key, obj.version, index, size=obj.size))
        return b"x"


def run_jobs(tree: Tree, cache: Cache, body, *, connections: int = 3):
    """Run `body(jobs)` with WarmJobs over the fakes; return the jobs' snapshots."""
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            jobs = WarmJobs(tree, cache, nursery, connections=connections)  # type: ignore[arg-type]
            await body(jobs)
            out["snapshot"] = jobs.snapshot()
            out["jobs"] = jobs
            nursery.cancel_scope.cancel()

    trio.run(main)
    return out["snapshot"], out["jobs"]


async def until_done(jobs: WarmJobs, number: int) -> dict:
    with trio.fail_after(10):
        while not jobs.jobs[number].done:
            await trio.sleep(0.001)
    return jobs.jobs[number].snapshot()


FILES = {"a/1": 250, "a/2": 100, "b/c/3": 50, "b/4": 0, "5": 120}


def test_a_job_fetches_every_block_once_through_the_cache():
    tree, cache = Tree(FILES), Cache()

    async def body(jobs):
        number = jobs.start(["a/1", "a/2", "a/1", "b/c/3", "b/4", "5", "nope/6", "a"])
        assert number == 1 and jobs.jobs[1].state == "resolving"
        job = await until_done(jobs, number)
        assert job["state"] == "done" and job["done"]
        assert (job["files_total"], job["files_done"]) == (5, 5)  # a/1 named twice: once
        assert job["bytes_total"] == job["bytes_done"] == 520
        assert job["missing"] == 2  # a path under no directory, and a directory
        assert job["errors"] == 0 and job["skipped_files"] == 0
        assert job["files_cached"] == 1  # the empty file has nothing to fetch

    run_jobs(tree, cache, body)
    assert sorted(cache.gets) == [("5", 0), ("5", 1), ("a/1", 0), ("a/1", 1), ("a/1", 2),
                                  ("a/2", 0), ("b/c/3", 0)]


def test_what_a_tier_holds_is_not_fetched_again():
    tree, cache = Tree(FILES), Cache()
    cache.held = {BlockId("a/1", "v1", 0, size=250), BlockId("a/2", "v1", 0, size=100)}

    async def body(jobs):
        job = await until_done(jobs, jobs.start(["a/1", "a/2"]))
        assert job["files_cached"] == 1 and job["bytes_cached"] == 100
        assert job["bytes_done"] == 350

    run_jobs(tree, cache, body)
    assert sorted(cache.gets) == [("a/1", 1), ("a/1", 2)]


def test_files_past_the_last_tiers_budget_are_skipped_and_said_so(caplog):
    tree = Tree({f"f/{i}": 300 for i in range(10)})
    cache = Cache(tiers=(Tier("ram", 5000), Tier("ssd", 1000)))

    async def body(jobs):
        job = await until_done(jobs, jobs.start([f"f/{i}" for i in range(10)]))
        assert (job["tier"], job["budget"]) == ("ssd", 1000)
        assert (job["files_total"], job["bytes_total"]) == (3, 900)
        assert (job["skipped_files"], job["skipped_bytes"]) == (7, 2100)
        assert job["files_done"] == 3

    with caplog.at_level(logging.WARNING, logger="bucketfs.warm"):
        run_jobs(tree, cache, body)
    assert {key for key, _ in cache.gets} == {"f/0", "f/1", "f/2"}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "do not fit the SSD cache's budget" in lines[0], lines


def test_a_file_that_fails_is_an_error_and_the_job_goes_on():
    tree, cache = Tree(FILES), Cache()
    cache.fail["a/2"] = NotFound("s3://b/a/2: no such object")

    async def body(jobs):
        job = await until_done(jobs, jobs.start(list(FILES)))
        assert job["state"] == "done" and job["errors"] == 1
        assert job["files_done"] == 4 and "no such object" in job["first_error"]
        assert jobs.errors == 1

    run_jobs(tree, cache, body)


def test_a_bug_fails_its_job_with_one_line_and_nothing_else(caplog, monkeypatch):
    monkeypatch.setattr(tasks, "failures", 0)
    monkeypatch.setattr(tasks, "_throttle", Throttle(tasks._QUIET_S))
    tree, cache = Tree(FILES), Cache()
    cache.fail["a/2"] = RuntimeError("a bug")

    async def body(jobs):
        broken = jobs.start(["a/1", "a/2"])
        job = await until_done(jobs, broken)
        assert job["state"] == "failed" and "RuntimeError: a bug" in job["reason"]
        cache.fail.clear()
        again = await until_done(jobs, jobs.start(["a/2", "5"]))  # the next job works
        assert again["state"] == "done" and again["files_done"] == 2

    with caplog.at_level(logging.ERROR):
        run_jobs(tree, cache, body)
    assert tasks.failures == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "warm job 1 failed" in errors[0].getMessage()


def test_cancel_stops_a_job_and_keeps_what_it_fetched():
    tree = Tree({f"f/{i}": 100 for i in range(50)})
    cache = Cache(delay=0.01)

    async def body(jobs):
        number = jobs.start([f"f/{i}" for i in range(50)])
        with trio.fail_after(10):
            while jobs.jobs[number].files_done < 5:
                await trio.sleep(0.001)
        jobs.cancel(number)
        job = await until_done(jobs, number)
        assert job["state"] == "cancelled" and 5 <= job["files_done"] < 50
        fetched = len(cache.gets)
        await trio.sleep(0.05)
        assert len(cache.gets) == fetched, "a cancelled job went on fetching"
        with pytest.raises(ValueError, match="no warm job 99"):
            jobs.cancel(99)

    run_jobs(tree, cache, body, connections=2)


def test_jobs_share_the_connections_and_are_bounded(monkeypatch):
    monkeypatch.setattr(warm, "KEEP_FINISHED", 2)
    tree = Tree({f"f/{i}": 100 for i in range(40)})
    cache = Cache(delay=0.01)
    in_flight = []

    original = cache.get

    async def counting(obj, index):
        in_flight.append(1)
        peak.append(len(in_flight))
        try:
            return await original(obj, index)
        finally:
            in_flight.pop()

    peak: list[int] = []
    cache.get = counting  # type: ignore[method-assign]

    async def body(jobs):
        numbers = [jobs.start([f"f/{i}" for i in range(j * 10, j * 10 + 10)])
                   for j in range(warm.MAX_RUNNING)]
        with pytest.raises(ValueError, match="warm jobs are running already"):
            jobs.start(["f/0"])
        for number in numbers:
            await until_done(jobs, number)
        jobs.start(["f/0"])  # finished jobs beyond KEEP_FINISHED are forgotten
        assert len(jobs.jobs) <= 3

    run_jobs(tree, cache, body, connections=3)
    assert max(peak) == 3


def test_the_mount_going_down_cancels_running_jobs(caplog):
    tree = Tree({f"f/{i}": 100 for i in range(50)})
    cache = Cache(delay=0.01)
    kept = {}

    async def body(jobs):
        kept["stopped"] = jobs.start([f"f/{i}" for i in range(25)])
        kept["unmounted"] = jobs.start([f"f/{i}" for i in range(25, 50)])
        with trio.fail_after(10):
            while jobs.jobs[1].files_done < 2:
                await trio.sleep(0.001)
        jobs.cancel_all("unmounted")  # what mount.py does before its flush
        await until_done(jobs, 1)
        await until_done(jobs, 2)

    with caplog.at_level(logging.INFO, logger="bucketfs.warm"):
        snapshot, _ = run_jobs(tree, cache, body)
    assert [(job["state"], job["reason"]) for job in snapshot] == \
        [("cancelled", "unmounted")] * 2
    assert sum("cancelled" in r.getMessage() for r in caplog.records) == 2

    async def cut_short(jobs):
        jobs.start([f"f/{i}" for i in range(50)])
        await trio.sleep(0.03)  # run_jobs then cancels the whole nursery, as an unmount

    _, jobs = run_jobs(Tree({f"f/{i}": 100 for i in range(50)}), Cache(delay=0.01), cut_short)
    assert (jobs.jobs[1].state, jobs.jobs[1].reason) == ("cancelled", "unmounted")
