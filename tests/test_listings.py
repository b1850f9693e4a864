"""The tree's listings in the index: stored a page at a time (Python holds one page of a
huge directory, not the whole of it), stale entries dropped by the listing's stamp, an
object and a directory of one name settled across pages, and an index that stops
taking writes turning into a tree kept in memory, with one warning, not EIO."""

from __future__ import annotations

import logging
import tracemalloc

import pytest
import trio
from rocksdict import Options, Rdict

from bucketfs.backends.base import ListPage, ObjectInfo
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.namespace import Namespace
from tests.membackend import MemoryBackend


class HugeDirectory:
    """A bucket with one directory of `count` objects, made up page by page (no bytes,
    no key list held), so the only memory a listing takes is the namespace's."""

    url = "mem://huge"

    def __init__(self, count: int) -> None:
        self.count = count

    def list_page(self, prefix, delimiter, token, page_size):
        start = 0 if token is None else int(token) + 1
        stop = min(self.count, start + page_size)
        page = ListPage(objects=[ObjectInfo(f"d/{i:09d}.jpg", 100_000, 0, f"{i:032x}")
                                 for i in range(start, stop)])
        page.next_token = None if stop >= self.count else str(stop - 1)
        if prefix == "":
            return ListPage(prefixes=["d/"])
        return page

    def close(self) -> None:
        pass


class FailingIndex:
    """An Rdict whose writes fail once `failing` is set, as on a full or read-only disk
    (reads go on)."""

    def __init__(self, index: Rdict) -> None:
        self._index = index
        self.failing = False

    def _check(self) -> None:
        if self.failing:
            raise Exception("IO error: No space left on device")  # as rocksdict says it

    def write(self, batch):
        self._check()
        self._index.write(batch)

    def __setitem__(self, key, value):
        self._check()
        self._index[key] = value

    def delete_range(self, start, end):
        self._check()
        self._index.delete_range(start, end)

    def __getattr__(self, name):
        return getattr(self._index, name)


def namespace(backend, tmp_path, *, page_size=1000, index=None) -> Namespace:
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1), page_size=page_size)
    if index is None:
        index = Rdict(str(tmp_path / "index"), Options(raw_mode=True))
    return Namespace(store, "", index=index, space="mem://b")


def peak_listing_bytes(count: int, tmp_path) -> int:
    ns = namespace(HugeDirectory(count), tmp_path / str(count))

    async def main():
        d = await ns.lookup(1, "d")
        tracemalloc.start()
        assert await ns.lookup(d.inode, f"{count - 1:09d}.jpg") is not None
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    peak = trio.run(main)
    ns.index.close()
    return peak


def test_a_huge_directory_is_listed_in_memory_bounded_by_a_page(tmp_path):
    small, large = peak_listing_bytes(5_000, tmp_path), peak_listing_bytes(50_000, tmp_path)
    # Ten times the entries, about the same peak: one page (1,000 entries) at a time.
    assert large < 2 * small + 1_000_000, (small, large)
    assert large < 8_000_000, large


def test_a_relisting_drops_what_is_gone_and_keeps_inodes(tmp_path):
    backend = MemoryBackend({f"d/{i}": b"x" for i in range(30)})
    now = [0.0]
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1), page_size=7)
    index = Rdict(str(tmp_path / "index"), Options(raw_mode=True))
    ns = Namespace(store, "", index=index, space="mem://b", metadata_ttl=10,
                   clock=lambda: now[0])

    async def main():
        d = await ns.lookup(1, "d")
        kept = await ns.lookup(d.inode, "5")
        for i in range(10, 30):
            del backend.objects[f"d/{i}"]
        backend.objects["d/new"] = b"y"
        now[0] = 11
        names = sorted(n.name for n in await ns.children(d.inode))
        assert names == sorted([str(i) for i in range(10)] + ["new"])
        assert (await ns.lookup(d.inode, "5")).inode == kept.inode
        assert ns.known_files == 11 + 1  # the directory "d" and its 11 files
        with pytest.raises(KeyError):
            ns.get(kept.inode + 25)  # an inode of a removed entry is gone

    trio.run(main)
    index.close()


def test_an_object_and_a_directory_of_one_name_on_different_pages(tmp_path, caplog):
    objects = {"a": b"object", "a/inner": b"x", "b/": b"", "b/c": b"y", "z": b"z"}
    ns = namespace(MemoryBackend(objects), tmp_path, page_size=1)

    async def main():
        with caplog.at_level(logging.WARNING):
            entries = {(n.name, n.is_dir) for n in await ns.children(1)}
        assert entries == {("a", True), ("b", True), ("z", False)}
        a = await ns.lookup(1, "a")
        assert [n.name for n in await ns.children(a.inode)] == ["inner"]

    trio.run(main)
    assert sum("hidden by the directory" in r.getMessage() for r in caplog.records) == 1


def test_an_index_that_stops_taking_writes_keeps_the_tree_in_memory(tmp_path, caplog):
    objects = {f"d{i}/f{j}": bytes([i, j]) for i in range(4) for j in range(5)}
    backend = MemoryBackend(objects)
    index = FailingIndex(Rdict(str(tmp_path / "index"), Options(raw_mode=True)))
    ns = namespace(backend, tmp_path, index=index, page_size=3)

    async def main():
        d0 = await ns.lookup(1, "d0")  # listed into the index
        f0 = await ns.lookup(d0.inode, "f0")
        index.failing = True
        with caplog.at_level(logging.WARNING):
            for i in (1, 2, 3):  # listed now: kept in memory
                d = await ns.lookup(1, f"d{i}")
                assert sorted(n.name for n in await ns.children(d.inode)) == \
                    [f"f{j}" for j in range(5)]
                f = await ns.lookup(d.inode, "f4")
                assert ns.get(f.inode).key == f"d{i}/f4"
            # An entry the index holds changes in the bucket: a new inode, in memory.
            backend.objects["d0/f0"] = b"changed"
            await ns.refresh(f0)
            f0_new = await ns.lookup(d0.inode, "f0")
            assert f0_new.inode != f0.inode and f0_new.size == len(b"changed")
            assert ns.get(f0.inode).version == f0.version  # the old inode, for its handles
            del backend.objects["d0/f1"]
            f1 = await ns.lookup(d0.inode, "f1")
            await ns.refresh(f1)
            assert await ns.lookup(d0.inode, "f1") is None
            # The index still holds its inode's record; memory says it is gone.
            ns.forget(f1.inode)
            with pytest.raises(KeyError):
                ns.get(f1.inode)
            ns.forget(f0.inode)
            with pytest.raises(KeyError):
                ns.get(f0.inode)
            ns.forget_listings()  # --refresh, unsaved: everything is listed again
            d0_again = await ns.lookup(1, "d0")
            assert d0_again.inode == d0.inode
            assert (await ns.lookup(d0_again.inode, "f0")).inode == f0_new.inode
            assert await ns.lookup(d0.inode, "f1") is None

    trio.run(main)
    found = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(found) == 1 and "kept in memory" in found[0], found
    assert ns.known_files == 4 + 19


class CountingIndex(FailingIndex):
    """Counts the point reads made of the index."""

    def __init__(self, index: Rdict) -> None:
        super().__init__(index)
        self.reads = 0

    def get(self, key, *args):
        self.reads += 1
        return self._index.get(key, *args)


def test_an_inode_is_read_in_one_index_read_and_follows_its_listing(tmp_path):
    """A file's first read finds its entry by inode (the kernel listed the directory
    with READDIRPLUS, so no LOOKUP came): one index read, and the entry as the latest
    listing has it."""
    backend = MemoryBackend({f"d/{i}": bytes(i) for i in range(5)})
    now = [0.0]
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1), page_size=2)
    index = CountingIndex(Rdict(str(tmp_path / "index"), Options(raw_mode=True)))
    ns = Namespace(store, "", index=index, space="mem://b", metadata_ttl=10,
                   clock=lambda: now[0])

    async def main():
        d = await ns.lookup(1, "d")
        listed = {n.name: n for n in await ns.children(d.inode)}
        for name, entry in listed.items():
            index.reads = 0
            assert ns.get(entry.inode) == entry
            assert index.reads == 1, name
        # The same version listed with another time (a copy onto itself): one inode,
        # and what it reads is the new listing's entry.
        backend.mtimes = {"d/3": 7_000_000_000}
        now[0] = 11
        relisted = {n.name: n for n in await ns.children(d.inode)}
        assert relisted["3"].inode == listed["3"].inode
        assert relisted["3"].mtime_ns == 7_000_000_000 != listed["3"].mtime_ns
        assert ns.get(listed["3"].inode) == relisted["3"]

    trio.run(main)
    index.close()


def test_format4_inode_records_are_upgraded_in_place(tmp_path):
    """Format 4 kept (parent inode, name) in an inode's record; the upgrade rewrites
    each with its entry, and run again (a crash midway) changes nothing."""
    from bucketfs.cache import schema
    from bucketfs.cache.listings import ROOT_INODE, TreeIndex, upgrade_inode_records
    from bucketfs.cache.schema import DirEntry

    space = schema.tree_space("s3://b via http://127.0.0.1:1", "p/")
    index = Rdict(str(tmp_path / "index"), Options(raw_mode=True))
    tree = TreeIndex(index, space)
    root = tree.begin(ROOT_INODE)
    tree.add_page(root, [DirEntry("a", True, "p/a/"), DirEntry("é\udcff", False, "p/é\udcff",
                                                                  size=3, version="v")])
    tree.finish(root, 1.0)
    a = tree.child(ROOT_INODE, "a")
    listing = tree.begin(a.inode)
    tree.add_page(listing, [DirEntry("x", False, "p/a/x", size=10, mtime_ns=5,
                                     version="v1")])
    tree.finish(listing, 1.0)
    entries = [a, tree.child(ROOT_INODE, "é\udcff"), tree.child(a.inode, "x")]
    for entry in entries:  # written as format 4 wrote them
        index[schema.tree_inode_key(space, entry.inode)] = (
            entry.parent.to_bytes(8, "big") + entry.name.encode("utf-8", "surrogateescape"))
    assert upgrade_inode_records(index) == 3
    assert [tree.entry_of(entry.inode) for entry in entries] == entries
    assert upgrade_inode_records(index) == 0
    assert [tree.entry_of(entry.inode) for entry in entries] == entries
    index.close()
