"""How keys become a tree: lazy listing, pagination, edge-case keys, TTL."""

from __future__ import annotations

import logging

import trio

from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.namespace import Namespace
from tests.membackend import MemoryBackend

EDGE_KEYS = {
    "data/a": b"file a",              # hidden: the prefix data/a/ exists too
    "data/a/inner": b"inner",
    "data/marker/": b"",              # a directory marker object
    "data/marker/x": b"x",
    "data/empty-marker/": b"",        # a marker with nothing under it
    "data/with space.txt": b"s",
    "data/ünïcødé.txt": b"u",
    "data/100%+plus.txt": b"p",
    "data/zero": b"",
    "data/dbl//slash": b"skipped",    # an empty path segment
    "data/./dot": b"skipped",
    "data/../dotdot": b"skipped",
    "data/" + "L" * 256: b"skipped",  # longer than NAME_MAX
    "data/" + "é" * 127: b"kept",     # 254 bytes of UTF-8
    "other/outside": b"not under the prefix",
}


def make(objects, prefix="data/", page_size=1000, ttl=float("inf"), clock=None):
    backend = MemoryBackend(objects)
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1), page_size=page_size)
    kwargs = {"clock": clock} if clock else {}
    return backend, Namespace(store, prefix, metadata_ttl=ttl, **kwargs)


def names(nodes):
    return {(n.name, n.is_dir) for n in nodes}


def test_edge_case_keys(caplog):
    _, ns = make(EDGE_KEYS)

    async def main():
        with caplog.at_level(logging.WARNING):
            root = await ns.children(1)
        assert names(root) == {
            ("a", True), ("marker", True), ("empty-marker", True), ("with space.txt", False),
            ("ünïcødé.txt", False), ("100%+plus.txt", False), ("zero", False),
            ("dbl", True), ("é" * 127, False),
        }
        a = await ns.lookup(1, "a")
        assert names(await ns.children(a.inode)) == {("inner", False)}
        marker = await ns.lookup(1, "marker")
        assert names(await ns.children(marker.inode)) == {("x", False)}
        assert await ns.children((await ns.lookup(1, "empty-marker")).inode) == []
        dbl = await ns.lookup(1, "dbl")
        assert await ns.children(dbl.inode) == []  # "dbl//slash" has an empty segment
        zero = await ns.lookup(1, "zero")
        assert (zero.size, zero.is_dir) == (0, False)
        assert await ns.lookup(1, "missing") is None
        assert await ns.lookup(zero.inode, "below-a-file") is None

    trio.run(main)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("hidden by the directory" in w for w in warnings)
    assert any("longer than 255 bytes" in w for w in warnings)
    assert sum("'.'" in w for w in warnings) == 1
    assert sum("'..'" in w for w in warnings) == 1


def test_listing_is_paginated_lazy_and_single_flight():
    objects = {f"d/{i:04d}": b"x" for i in range(25)} | {"d/sub/1": b"y", "e/2": b"z"}
    backend, ns = make(objects, prefix="", page_size=10)

    async def main():
        d = await ns.lookup(1, "d")
        calls_after_root = backend.calls["list"]
        assert calls_after_root == 1  # the root fits one page: "d/" and "e/"
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(ns.lookup, d.inode, f"{i:04d}")
        # 26 entries at 10 a page: 3 pages, listed once for all 20 concurrent lookups.
        assert backend.calls["list"] == calls_after_root + 3
        assert len(await ns.children(d.inode)) == 26
        assert backend.calls["list"] == calls_after_root + 3

    trio.run(main)


def test_ttl_relists_keeps_inodes_and_gives_a_changed_object_a_new_one():
    now = [0.0]
    backend, ns = make({"p/a": b"1", "p/c": b"3"}, prefix="p/", ttl=10, clock=lambda: now[0])

    async def main():
        a, c = await ns.lookup(1, "a"), await ns.lookup(1, "c")
        backend.objects["p/b"] = b"2"
        backend.objects["p/a"] = b"changed"
        assert await ns.lookup(1, "b") is None  # still within the TTL
        now[0] = 11
        b = await ns.lookup(1, "b")
        assert b is not None
        assert (await ns.lookup(1, "c")).inode == c.inode  # unchanged: the same inode
        a2 = await ns.lookup(1, "a")
        # One inode, one version: the kernel's pages of the old one stay the old bytes.
        assert a2.inode != a.inode and a2.size == len(b"changed")
        assert ns.get(a.inode).version == a.version  # still there for its handles

    trio.run(main)
    assert backend.calls["list"] == 2


def test_prefix_with_no_objects_is_an_empty_root():
    _, ns = make({"x/1": b"1"}, prefix="nothing/")

    async def main():
        assert await ns.children(1) == []

    trio.run(main)


def test_entries_resume_after_a_name_and_nothing_is_held_per_entry():
    objects = {f"d/{name}": b"x" for name in ("a", "a1", "a10", "a2", "b", "é")}
    _, ns = make(objects, prefix="d/")

    async def main():
        names = [n.name for n in await ns.entries(1)]
        assert names == ["a", "a1", "a10", "a2", "b", "é"]
        assert [n.name for n in await ns.entries(1, "a1")] == ["a10", "a2", "b", "é"]
        assert [n.name for n in await ns.entries(1, "é")] == []
        node = await ns.lookup(1, "a10")
        assert ns.get(node.inode).key == "d/a10"
        assert not hasattr(ns, "nodes")  # entries live in the index only

    trio.run(main)
    ns.close()


def test_listings_and_inodes_outlive_the_namespace_in_a_shared_index(tmp_path):
    from rocksdict import Options, Rdict

    index = Rdict(str(tmp_path / "index"), Options(raw_mode=True))
    backend = MemoryBackend({"p/a": b"1", "p/sub/b": b"2"})
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1))

    async def walk(ns):
        a = await ns.lookup(1, "a")
        sub = await ns.lookup(1, "sub")
        b = await ns.lookup(sub.inode, "b")
        return a.inode, b.inode, ns.known_bytes

    first = trio.run(walk, Namespace(store, "p/", index=index, space="mem://bucket"))
    lists = backend.calls["list"]
    again = Namespace(store, "p/", index=index, space="mem://bucket")
    assert trio.run(walk, again) == first == (first[0], first[1], 2)
    assert backend.calls["list"] == lists  # no LIST: the saved listings were used
    assert again.any_file_key() in ("p/a", "p/sub/b")
    again.forget_listings()
    assert trio.run(walk, again)[:2] == first[:2]  # listed again, same inodes
    assert backend.calls["list"] == lists + 2
    other = Namespace(store, "p/", index=index, space="mem://other")
    assert trio.run(walk, other)  # another bucket's tree is separate
    assert backend.calls["list"] == lists + 4
    index.close()


def test_a_zero_ttl_lists_on_every_lookup_and_never_loops():
    backend, ns = make({"p/a": b"1", "p/b": b"2"}, prefix="p/", ttl=0)

    async def main():
        for _ in range(3):
            assert (await ns.lookup(1, "a")).size == 1
        async with trio.open_nursery() as nursery:  # concurrent lookups share a listing
            for name in ("a", "b", "a", "b"):
                nursery.start_soon(ns.lookup, 1, name)

    trio.run(main)
    assert 3 < backend.calls["list"] <= 3 + 4
    ns.close()


def test_a_lookup_takes_its_directory_s_listing_time_from_memory_once_read():
    now = [0.0]
    backend, ns = make({"p/a": b"1", "p/b": b"2"}, prefix="p/", ttl=10, clock=lambda: now[0])
    reads = []
    listed_at = ns.tree.listed_at
    ns.tree.listed_at = lambda inode: reads.append(inode) or listed_at(inode)

    async def main():
        for name in ("a", "b", "a", "b"):
            assert await ns.lookup(1, name) is not None
        assert backend.calls["list"] == 1 and len(reads) == 1  # the first, before listing
        now[0] = 11  # past the TTL: listed again, and that time kept
        assert await ns.lookup(1, "a") is not None
        assert await ns.lookup(1, "b") is not None
        assert backend.calls["list"] == 2 and len(reads) == 1
        ns.forget_listings()  # mount --refresh: listed again at the next lookup
        assert await ns.lookup(1, "a") is not None
        assert backend.calls["list"] == 3

    trio.run(main)
    ns.close()
