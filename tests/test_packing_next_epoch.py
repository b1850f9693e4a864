"""The next epoch's order, announced ahead, as the daemon handles it (no FUSE): resolved
like an order, never prefetched, handed to the job's packer, which lays out what the
current epoch reads in chunks planned by it, tagged with that order's layout tag; files
packed by another layout are laid out anew and their old chunks reclaimed; a stale
announcement is dropped."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from rocksdict import Rdict

from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.ram import RamTier
from bucketfs.cache.schema import CHUNK, ENTRY, WRITE_THROUGH, decode_chunk, decode_packed
from bucketfs.cache.tiered import BlockCache
from bucketfs.hints.protocol import Order
from bucketfs.namespace import Namespace
from bucketfs.packer import layout_tag
from bucketfs.prefetch.eviction import make_policy
from bucketfs.prefetch.layout import DEFAULT_CHUNK_BYTES, plan_chunks
from bucketfs.prefetch.scheduler import PrefetchScheduler
from bucketfs.prefetcher import HintedPrefetch
from bucketfs.reader import ByteBudget, Reader, ReadSettings
from tests.membackend import MemoryBackend

KiB, MiB = 1024, 1024**2
JOB = ("job", 0)


def chunk_layouts(index: Rdict) -> list[tuple[bytes, list[str]]]:
    """Each chunk in the SSD tier's index (by id): its layout tag and the object keys
    of its live members in offset order. Works on a live tier's index or a read-only
    open of a cache directory."""
    chunks = []
    for name, value in index.items(from_key=CHUNK):
        if not name.startswith(CHUNK):
            break
        chunk = int.from_bytes(name[1:], "big")
        tags, keys = set(), []
        for member in sorted(decode_chunk(value).members, key=lambda m: m.offset):
            packed = decode_packed(index.get(ENTRY + member.entry) or b"")
            if packed is not None and packed.chunk == chunk:  # not moved out since
                tags.add(packed.layout)
                # an entry is namespace NUL key NUL version NUL block index
                keys.append(member.entry.decode("utf-8", "surrogateescape").split("\0")[1])
        assert len(tags) <= 1, "one layout per chunk"
        chunks.append((tags.pop() if tags else b"", keys))
    return chunks


def follows(chunks: list[tuple[bytes, list[str]]], order: list[str]) -> bool:
    """Each chunk's members are consecutive in `order`, in that order."""
    position = {key: i for i, key in enumerate(order)}
    return all([position[k] for k in keys] == list(range(position[keys[0]],
                                                         position[keys[0]] + len(keys)))
               for _, keys in chunks if keys)


def dataset(count: int = 150) -> dict[str, bytes]:
    rng = random.Random(count)
    return {f"c{i % 3}/{i:04d}.jpg": rng.randbytes(80 * KiB + 97 * i)
            for i in range(count)}


def shuffled(paths: list[str], seed: int) -> list[str]:
    order = list(paths)
    random.Random(seed).shuffle(order)
    return order


def order(paths: list[str], epoch: int, *, next_epoch: bool = False,
          next_follows: bool = False) -> Order:
    return Order(JOB[0], JOB[1], 1, epoch, paths, next_epoch, next_follows)


class Daemon:
    """HintedPrefetch over a RAM + SSD cache of an in-memory bucket, as the mount wires
    it, and a reader that opens and reads like FUSE does."""

    def __init__(self, prefetch: HintedPrefetch, cache: BlockCache, reader: Reader,
                 namespace: Namespace, files: dict[str, bytes]) -> None:
        self.prefetch, self.cache, self.reader = prefetch, cache, reader
        self.namespace, self.files = namespace, files
        assert cache.disk is not None and prefetch.packing is not None
        self.disk = cache.disk
        self.packing = prefetch.packing

    async def read(self, path: str) -> bytes:
        parent, _, name = path.rpartition("/")
        directory = await self.namespace.lookup(1, parent)
        node = await self.namespace.lookup(directory.inode, name)
        handle = self.reader.open(node.key, node.version, node.size)
        return await self.reader.read(handle, 0, node.size)

    async def until(self, done: Callable[[], bool]) -> None:
        with trio.fail_after(20):
            while not done():
                await trio.sleep(0.01)

    async def quiet(self) -> None:
        """Orders installed, fetches done, chunks written: nothing changed for 50 ms."""
        last, still = None, 0
        with trio.fail_after(20):
            while still < 5:
                await trio.sleep(0.01)
                queue = self.packing._receive.statistics()
                now = (len(self.prefetch._tasks), self.prefetch.scheduler.plans_version,
                       self.packing.chunks_written, queue.current_buffer_used,
                       queue.tasks_waiting_receive, len(self.cache.writing))
                busy = self.prefetch._tasks or queue.current_buffer_used \
                    or not queue.tasks_waiting_receive
                still = still + 1 if now == last and not busy else 0
                last = now

    def planned(self) -> bool:
        state = self.packing.jobs.get(JOB)
        return state is not None and state.packer.planned

    def layout(self, paths: list[str]) -> bytes:
        return layout_tag(("train/" + p, len(self.files[p])) for p in paths)


def run(files: dict[str, bytes], directory: Path, body, *, ram: int = 4 * MiB) -> MemoryBackend:
    """`body(daemon)` over a cache whose RAM tier holds less than the dataset: the next
    epoch reads SSD, so what it reads is laid out there."""
    backend = MemoryBackend({"train/" + k: v for k, v in files.items()})

    async def main() -> None:
        store = ObjectStore(backend, max_workers=8, retry=RetryPolicy(1))
        namespace = Namespace(store, "train/")
        disk = DiskTier(directory, 512 * MiB, make_policy("cost-lrfu"), source="mem://b",
                        block_size=MiB)
        async with trio.open_nursery() as nursery:
            cache = BlockCache(store, RamTier(ram, make_policy()), disk, block_size=MiB,
                               nursery=nursery)
            prefetch = HintedPrefetch(
                namespace, cache, PrefetchScheduler(window_bytes=8 * MiB, budget_bytes=8 * MiB),
                connections=4, block_size=MiB)
            reader = Reader(cache, ByteBudget(64 * MiB), ReadSettings(), nursery,
                            on_open=prefetch.observed_open)
            await nursery.start(prefetch.run)
            daemon = Daemon(prefetch, cache, reader, namespace, files)
            try:
                await body(daemon)
            finally:
                nursery.cancel_scope.cancel()
        disk.close()
        namespace.close()

    trio.run(main)
    return backend


def planned_chunks(files: dict[str, bytes], paths: list[str]) -> set[tuple[str, ...]]:
    """The chunks (their members, in order) of a layout planned by `paths`."""
    plan = plan_chunks(((p, len(files[p])) for p in paths), chunk_bytes=DEFAULT_CHUNK_BYTES)
    return {tuple("train/" + f.key for f in chunk.files) for chunk in plan}


def members(chunks: list[tuple[bytes, list[str]]]) -> set[tuple[str, ...]]:
    """The chunks' members, in offset order (chunk ids follow completion, not layout)."""
    return {tuple(keys) for _, keys in chunks}


@pytest.mark.parametrize("next_resolved_first", [False, True])
def test_an_epoch_is_packed_in_the_announced_next_order(tmp_path, next_resolved_first):
    files = dataset()
    epoch_0, epoch_1 = shuffled(list(files), 1), shuffled(list(files), 2)
    seen: dict[str, object] = {}

    async def body(daemon: Daemon) -> None:
        if next_resolved_first:  # the announcement waits for its order to be installed
            resolve = daemon.prefetch._resolve

            async def slow(paths: list[str]):
                if paths is epoch_0:
                    await trio.sleep(0.3)
                return await resolve(paths)

            daemon.prefetch._resolve = slow  # type: ignore[method-assign]
        daemon.prefetch.on_order(order(epoch_0, 0))
        daemon.prefetch.on_order(order(epoch_1, 1, next_epoch=True))
        if next_resolved_first:
            await daemon.until(lambda: daemon.prefetch._announced[JOB].ready is not None)
            assert not daemon.planned()
        await daemon.until(daemon.planned)
        for path in epoch_0:
            assert await daemon.read(path) == files[path]
        # Every planned chunk had all its files read: written during the epoch.
        await daemon.quiet()
        seen["during"] = chunk_layouts(daemon.disk.index)
        daemon.prefetch.on_order(order(epoch_1, 1))  # epoch 1 starts
        await daemon.quiet()
        seen["after"] = chunk_layouts(daemon.disk.index)
        seen["tag_1"] = daemon.layout(epoch_1)

    backend = run(files, tmp_path / "cache", body)
    assert seen["after"] == seen["during"]
    chunks = seen["after"]
    assert members(chunks) == planned_chunks(files, epoch_1)
    assert {tag for tag, _ in chunks} == {seen["tag_1"]}
    assert follows(chunks, ["train/" + p for p in epoch_1])
    assert not follows(chunks, ["train/" + p for p in epoch_0])
    assert backend.calls["get"] == len(files)


@pytest.mark.parametrize("ram_mib", [64, 4])
def test_nothing_is_laid_out_for_a_next_epoch_the_ram_tier_will_serve(tmp_path, ram_mib):
    """A RAM tier that holds every file of the order (~13 MB in 64 MiB) serves the next
    epoch itself: what the epoch reads stays in the write-through's chunks, no chunk is
    written for the announced order, and that epoch asks neither the bucket nor the SSD.
    With 4 MiB the same epoch is laid out (the test above)."""
    files = dataset()
    epoch_0, epoch_1 = shuffled(list(files), 1), shuffled(list(files), 2)
    seen: dict[str, object] = {}

    async def body(daemon: Daemon) -> None:
        daemon.prefetch.on_order(order(epoch_0, 0, next_follows=True))
        daemon.prefetch.on_order(order(epoch_1, 1, next_epoch=True))
        await daemon.until(lambda: JOB in daemon.packing.jobs
                           and not daemon.packing.jobs[JOB].packer.expecting)
        for path in epoch_0:
            assert await daemon.read(path) == files[path]
        await daemon.quiet()
        seen["written"] = daemon.packing.chunks_written
        seen["layouts"] = {tag for tag, _ in chunk_layouts(daemon.disk.index)}
        reads = daemon.disk.chunks.reads
        daemon.prefetch.on_order(order(epoch_1, 1))  # epoch 1 starts
        for path in epoch_1:
            assert await daemon.read(path) == files[path]
        await daemon.quiet()
        seen["ssd_reads"] = daemon.disk.chunks.reads - reads
        seen["tag_1"] = daemon.layout(epoch_1)

    backend = run(files, tmp_path / "cache", body, ram=ram_mib * MiB)
    if ram_mib == 64:
        assert seen["written"] == 0 and seen["layouts"] == {WRITE_THROUGH}
        assert seen["ssd_reads"] == 0
        assert backend.calls["get"] == len(files)
    else:
        assert seen["written"] > 0 and seen["tag_1"] in seen["layouts"]


def test_the_next_order_relays_chunks_of_another_layout_and_reclaims_them(tmp_path):
    files = dataset()
    epochs = [shuffled(list(files), seed) for seed in (1, 2, 3)]
    seen: list[list[tuple[bytes, list[str]]]] = []
    counts: dict[str, int] = {}

    async def body(daemon: Daemon) -> None:
        for epoch, (now, upcoming) in enumerate(itertools.pairwise(epochs)):
            daemon.prefetch.on_order(order(now, epoch))
            daemon.prefetch.on_order(order(upcoming, epoch + 1, next_epoch=True))
            await daemon.until(daemon.planned)
            for path in now:
                assert await daemon.read(path) == files[path]
            daemon.prefetch.on_order(order(upcoming, epoch + 1))
            await daemon.quiet()
            seen.append(chunk_layouts(daemon.disk.index))
        counts["records"] = daemon.disk.chunks.count
        counts["files"] = len(list((tmp_path / "cache/chunks").glob("*.chk")))

    backend = run(files, tmp_path / "cache", body)  # mostly read back
    first, second = seen
    tags = [layout_tag(("train/" + p, len(files[p])) for p in e) for e in epochs]
    assert {tag for tag, _ in first} == {tags[1]}
    # Epoch 1 was read from epoch 1's chunks and laid out anew for epoch 2: the old
    # chunks emptied and were deleted.
    assert {tag for tag, _ in second} == {tags[2]}
    assert members(second) == planned_chunks(files, epochs[2])
    assert counts == {"records": len(second), "files": len(second)}
    assert backend.calls["get"] == len(files)


def test_a_next_order_prefetches_nothing(tmp_path):
    files = dataset(40)
    paths = list(files)
    now, later = paths[:20], paths[20:]

    async def body(daemon: Daemon) -> None:
        daemon.prefetch.on_order(order(now, 0))
        daemon.prefetch.on_order(order(later, 1, next_epoch=True))
        await daemon.until(daemon.planned)
        await daemon.quiet()
        plan = daemon.prefetch.scheduler.plans[JOB]
        assert set(plan.keys) == {"train/" + p for p in now}
        assert daemon.prefetch.scheduler.stats().prefetches_started == len(now)
        assert (daemon.prefetch.orders, daemon.prefetch.next_orders) == (1, 1)

    backend = run(files, tmp_path / "cache", body)
    assert backend.calls["get"] == len(now)


def test_a_next_order_needs_an_order_before_it(tmp_path):
    files = dataset(6)

    async def body(daemon: Daemon) -> None:
        on_order = daemon.prefetch.on_order
        with pytest.raises(ValueError, match="sent no order to follow"):
            on_order(order(list(files), 1, next_epoch=True))
        on_order(order(list(files), 3))
        for epoch in (3, 2):
            with pytest.raises(ValueError, match=f"epoch after 3, not {epoch}"):
                on_order(order(list(files), epoch, next_epoch=True))
        daemon.prefetch.on_end(JOB[0])
        with pytest.raises(ValueError, match="sent no order to follow"):
            on_order(order(list(files), 4, next_epoch=True))
        assert daemon.prefetch.next_orders == 0

    run(files, tmp_path / "cache", body)


def test_reads_before_the_announced_order_arrives_wait_for_it(tmp_path):
    files = dataset()
    now, upcoming = shuffled(list(files), 1), shuffled(list(files), 2)
    seen: dict[str, object] = {}

    async def body(daemon: Daemon) -> None:
        daemon.prefetch.on_order(order(now, 0, next_follows=True))
        await daemon.until(lambda: JOB in daemon.packing.jobs)
        for path in now[:100]:  # 8 MiB: two chunks' worth in read order
            await daemon.read(path)
        await daemon.quiet()
        seen["before"] = daemon.packing.chunks_written
        daemon.prefetch.on_order(order(upcoming, 1, next_epoch=True))
        await daemon.until(daemon.planned)
        for path in now[100:]:
            await daemon.read(path)
        await daemon.quiet()
        seen["chunks"] = chunk_layouts(daemon.disk.index)

    run(files, tmp_path / "cache", body)
    assert seen["before"] == 0
    chunks = seen["chunks"]
    assert members(chunks) == planned_chunks(files, upcoming)
    assert {tag for tag, _ in chunks} == {
        layout_tag(("train/" + p, len(files[p])) for p in upcoming)}


@pytest.mark.parametrize("next_follows", [False, True])
def test_a_next_order_overtaken_by_a_newer_order_is_dropped(tmp_path, next_follows):
    files = dataset(90)
    a, b, c = (shuffled(list(files), seed) for seed in (1, 2, 3))
    seen: dict[str, object] = {}

    async def body(daemon: Daemon) -> None:
        # No await between them: the announcement for A is stale before it resolves.
        daemon.prefetch.on_order(order(a, 0, next_follows=True))
        daemon.prefetch.on_order(order(b, 1, next_epoch=True))
        daemon.prefetch.on_order(order(c, 1, next_follows=next_follows))
        await daemon.quiet()
        state = daemon.packing.jobs[JOB]
        assert not state.packer.planned and state.packer.expecting == next_follows
        assert state.layout == daemon.layout(c)
        for path in c:
            await daemon.read(path)
        await daemon.quiet()
        # Waiting for C's next order, nothing is written; else C's read order is.
        seen["during"] = daemon.packing.chunks_written
        daemon.prefetch.on_end(JOB[0])  # no next order came: read order, at the end
        await daemon.quiet()
        seen["chunks"] = chunk_layouts(daemon.disk.index)
        seen["tag"] = daemon.layout(c)

    run(files, tmp_path / "cache", body)
    chunks = seen["chunks"]
    if not next_follows:  # C's own order is a guess: nothing is laid out by it
        assert seen["during"] == 0
        assert {tag for tag, _ in chunks} == {WRITE_THROUGH}  # the write-through's only
        return
    assert seen["during"] == 0
    assert {tag for tag, _ in chunks} == {seen["tag"]}
    assert members(chunks) == planned_chunks(files, c)
